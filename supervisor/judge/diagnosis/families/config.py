"""The user's configuration: unknown keys, models, datasets and templates not found, DeepSpeed's
config checks, allocator options, checkpoints that cannot be loaded, a non-empty output folder."""

from __future__ import annotations

import re

from supervisor.core.models import Category
from supervisor.judge.diagnosis.hits import ROOT, Hit, Segment

# --- config ---------------------------------------------------------------
_CONFIG_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("unknown_keys", re.compile(r"Some (?:keys|specified arguments) are not used by the HfArgumentParser: (?P<detail>\[.*?\])")),
    (
        "model_not_found",
        re.compile(
            r"is not a local folder and is not a valid model identifier|Can't load (?:tokenizer|config|the configuration|the model)"
            r"|HFValidationError|Repo id must be|does not appear to have a file named|Incorrect path_or_model_id"
            r"|LocalEntryNotFoundError|RepositoryNotFoundError"
        ),
    ),
    (
        "dataset_not_found",
        re.compile(
            r"Undefined dataset (?P<detail>\S+) in|Cannot open \S*dataset_info\.json|File \S+ not found\."
            r"|Cannot find valid samples|DatasetNotFoundError|Please specify dataset for"
        ),
    ),
    ("template_not_found", re.compile(r"Template (?P<detail>\S+) does not exist")),
    (
        "deepspeed_config",
        re.compile(
            r"validation errors? for DeepSpeed\w*|Please correct the following DeepSpeed config values that mismatch"
            r"|DeepSpeedConfigError|Extra inputs are not permitted.*extra_forbidden"
        ),
    ),
    ("allocator_conf", re.compile(r"Unrecognized CachingAllocator option|Unrecognized key '[^']*' in \w+ allocator config")),
    ("checkpoint_incompatible", re.compile(r"Can't find a valid checkpoint at|ZeRORuntimeException")),
    ("incomplete_checkpoint", re.compile(r"checkpoint-\d+/trainer_state\.json")),
    ("output_dir", re.compile(r"Output directory \S+ already exists and is not empty")),
)


def find(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> None:
    """Append this family's hits for one segment (`t` its text, `exc` its short exception class)."""
    # Configuration.
    for name, rx in _CONFIG_RULES:
        m = rx.search(t)
        if m and (exc_form or name in ("deepspeed_config", "unknown_keys")):
            hits.append(Hit(name, Category.CONFIG_ERROR, ROOT, name, exc=seg.exc))
            break
