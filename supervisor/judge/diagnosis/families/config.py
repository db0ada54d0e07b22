"""The user's configuration: unknown keys, models, datasets and templates not found, DeepSpeed's
config checks, allocator options, checkpoints that cannot be loaded, a non-empty output folder.

Where config_error ends and crash_other (a bug) begins: the exception's class AND what its message
says it checked. A framework's own config/argument validation (Lightning's Misconfiguration,
pydantic/omegaconf/yacs/hydra config models, a registry lookup, DeepSpeed's batch identity, an
`X must be one of`, a 'Please set `key`') and a checkpoint whose shapes do not fit the model
are the user's configuration. A TypeError/AttributeError/ImportError from a version mismatch is not.
"""

from __future__ import annotations

import re

from supervisor.core.models import Category
from supervisor.judge.diagnosis.families import checks
from supervisor.judge.diagnosis.hits import HINT, ROOT, Hit, Segment

# --- config ---------------------------------------------------------------
_CONFIG_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("unknown_keys", re.compile(r"Some (?:keys|specified arguments) are not used by the HfArgumentParser: (?P<detail>\[.*?\])")),
    (
        "model_not_found",
        re.compile(
            r"is not a local folder and is not a valid model identifier|Can't load (?:tokenizer|config|the configuration|the model)"
            r"|HFValidationError|Repo id must be|does not appear to have a file named|Incorrect path_or_model_id"
            r"|LocalEntryNotFoundError|RepositoryNotFoundError"
            # modeling_utils.py: the folder given holds no weights file of any kind
            r"|Error no file named \S+.* found in directory"
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
# A framework's own configuration checks, told by the exception's class (any message).
_CHECK_CLASSES = frozenset({
    "MisconfigurationException", "ConfigAttributeError", "ConfigKeyError", "ConfigTypeError",
    "ConfigCompositionException", "OverrideParseException", "MissingMandatoryValue",
})
# Messages of config checks, whatever class carries them (ValueError, AssertionError, KeyError, ...).
_CHECK_MESSAGES: tuple[tuple[str, re.Pattern[str]], ...] = (
    # load_state_dict: a checkpoint of another model, vocabulary or LoRA rank than the one built
    ("checkpoint_mismatch", re.compile(r"Error\(s\) in loading state_dict for|size mismatch for \S+: copying a param")),
    # a script's own check of a path it was given ("Instance images root doesn't exists.")
    ("path_not_found", re.compile(r"\b(?:root|dir|directory|folder|path|file)\b[^.\n]{0,60}?"
                                  r"\b(?:does ?n[o']t exists?|does not exists?|not exists?)\b"
                                  # transformers' HfDeepSpeedConfig: "Expected a string path to an existing deepspeed config"
                                  r"|\bpath to an existing\b", re.IGNORECASE)),
    # DeepSpeed: train_batch_size == micro_batch_per_gpu * gradient_acc_step * world_size
    ("batch_size_mismatch", re.compile(r"Check batch related parameters")),
    # yacs, omegaconf/hydra, mmcv/mmengine registries: a key or a type name the config gives is unknown
    ("unknown_keys", re.compile(r"Non-existent config key|is not in struct|Could not override '"
                                r"|is not in the (?:\S+ )?registry"
                                # a registry's refusal in other words (ms-swift's model_type, detectron2's catalog)
                                r"|['\"] is (?:not|already) registered\b")),
    (
        "invalid_arguments",
        re.compile(
            r"[Pp]lease (?:set|specify|provide|pass|select|input) (?:`|the |an? )|(?:[Mm]ust|[Nn]eeds? to|[Ss]hould) be one of"
            r"|is not a valid [A-Z]\w+|[Yy]ou selected an invalid|(?:should|must) be divisible by|is not divisible by"
            r"|is not compatible with|can only work with|mixed precision requires|`--\w+` arg cannot be"
            r"|remaining_argv: \[|\bTarget modules? .*(?:not found in the base model|is not supported)"
            r"|Error: Target module \w+\($|You can't train a model that has been loaded in"
            r"|Attempting to unscale FP16 gradients|in the [Dd]eep[Ss]peed config"
            # a check that tells the user what to fix: "... exceeds nc=20 in x.yaml. Correct your labels or your model."
            r"|\b[Cc]orrect your (?:labels|config|configuration|settings|arguments|data|dataset|model)\b"
        ),
    ),
)
# A path the user gave (a dataset, its labels, a checkpoint, a folder) that is not there.
_NOT_FOUND_EXCS = frozenset({"FileNotFoundError", "NotADirectoryError", "IsADirectoryError"})
# ...unless it is a program or a library the environment lacks (a compiler, a shared object): not the config.
_TOOL_OR_LIB_RE = re.compile(r"\.(?:so|dll|dylib)\b|'(?:nvcc|ninja|git|gcc|g\+\+|cc|c\+\+|make|cmake|ldconfig|nvidia-smi)'"
                             r"|/bin/|Could not find module")
_CHECK_CARRIERS = frozenset({"ValueError", "AssertionError", "KeyError", "RuntimeError", "Exception"})
# Said outside an exception line: a load_state_dict message line, hydra's refusal, a script's own check.
_CHECK_MENTION_RE = re.compile(r"size mismatch for \S+: copying a param with shape|Please verify arguments"
                               # the end of a long check message (PEFT's target module, printed as a repr)
                               r"|\) is not supported\. Currently, only the following \w+ are supported"
                               r"|^Key '[^']*' is not in struct|^Could not override '"
                               # argparse.py ArgumentParser.error(): "%(prog)s: error: %(message)s", exit 2
                               r"|^\S+: error: (?:argument \S+: |unrecognized arguments: |the following arguments are"
                               r" required: |ambiguous option: )"
                               # jsonargparse (LightningCLI) after its usage line: "error: Parser key ...", "error:
                               # Validation failed: Key '...' is not expected"
                               r"|^error: (?:Parser key [\"']|Validation failed: |Configuration check failed|Problem with "
                               r"given class_path|Unrecognized arguments: )"
                               # click/exceptions.py UsageError.show(): "Error: {message}", exit 2
                               r"|^Error: (?:No such option: |Invalid value for |Missing (?:option|argument|parameter) "
                               r"|Got unexpected extra arguments? )"
                               # hydra's instantiate (_instantiate2.py) and omegaconf's MissingMandatoryValue
                               r"|^Error (?:in call to|locating) target '|^Missing mandatory value: "
                               # ...and the repr of what the target refused, the line after: a key it does not take
                               r"|^TypeError\([\"'][\w.]*__init__\(\) (?:got an unexpected keyword|missing \d+ required)"
                               # load_state_dict's message wrapped mid-sentence (module.py)
                               r"|^(?:the shape in )?current\s*(?:model is )?torch\.Size\(|^model is torch\.Size\(")


# A key the config file lacks, read as an attribute of the loaded config: mmcv/mmengine's ConfigDict.__getattr__
# re-raises the KeyError as "'ConfigDict' object has no attribute 'x'", and so do EasyDict/AttrDict configs.
_CONFIG_OBJECT_ATTR_RE = re.compile(r"'(?:ConfigDict|EasyDict|AttrDict|CfgNode|Config)' object has no attribute '")


# A class a framework raises only for its configuration or arguments (allennlp's ConfigurationError,
# argparse's ArgumentError, click's BadParameter, hydra's InstantiationException, any *ConfigError, and a
# Misconfiguration wherever it sits in the name: Lightning's MisconfigurationException, NeMo's
# LoggerMisconfigurationError / CheckpointMisconfigurationError).
_CHECK_CLASS_RE = re.compile(r"^(?:[A-Z]\w*)?(?:Config|Configuration)(?:Validation)?(?:Error|Exception)$"
                             r"|^(?:Argument|Arguments|ArgumentType|Setting|Settings|Option|Options|Parameter|HParams?"
                             r"|Usage)(?:Error|Exception)$|^\w*Misconfigur\w*(?:Error|Exception)$|^Instantiation|^MissingConfig|^BadParameter$"
                             r"|^ValidationError$")


def find(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> None:
    """Append this family's hits for one segment (`t` its text, `exc` its short exception class)."""
    # Configuration.
    for name, rx in _CONFIG_RULES:
        m = rx.search(t)
        if m and (exc_form or name in ("deepspeed_config", "unknown_keys")):
            hits.append(Hit(name, Category.CONFIG_ERROR, ROOT, name, exc=seg.exc))
            return
    if hits:
        return
    if exc_form:
        if exc in _CHECK_CLASSES or (exc and _CHECK_CLASS_RE.search(exc)) or checks.CONFIG_MODULE_RE.match(seg.exc or ""):
            hits.append(Hit("config_check", Category.CONFIG_ERROR, ROOT, "invalid_config", exc=seg.exc))
            return
        if exc in _NOT_FOUND_EXCS and not _TOOL_OR_LIB_RE.search(t):
            hits.append(Hit("path_not_found", Category.CONFIG_ERROR, ROOT, "path_not_found", exc=seg.exc))
            return
        if exc in _CHECK_CARRIERS:
            for name, rx in _CHECK_MESSAGES:
                if rx.search(t):
                    hits.append(Hit(name, Category.CONFIG_ERROR, ROOT, name, exc=seg.exc))
                    return
        if exc == "AttributeError" and _CONFIG_OBJECT_ATTR_RE.search(t):
            hits.append(Hit("config_missing_key", Category.CONFIG_ERROR, ROOT, "invalid_config", exc=seg.exc))
            return
        if exc in checks.GRAMMAR_CARRIERS and checks.says_config_check(seg.exc_msg or t):
            hits.append(Hit("config_check", Category.CONFIG_ERROR, ROOT, "invalid_config", exc=seg.exc))
            return
    elif checks.check_code(t):  # a traceback's code line: the scanner reads it with the exception under it
        hits.append(Hit("config_check_code", Category.CONFIG_ERROR, HINT, checks.check_code(t) or ""))
    elif _CHECK_MENTION_RE.search(t):
        # Structural only as the final error of the log (conclude promotes a *_mention there).
        hits.append(Hit("config_check_mention", Category.CONFIG_ERROR, HINT, "invalid_config"))
