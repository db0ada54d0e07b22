"""Check a LLaMA-Factory training config before it costs a GPU night.

LLaMA-Factory refuses a whole config for one unknown key, but only after the
launcher, torchrun and every rank have started; DeepSpeed ignores unknown
top-level keys without a word. Here both are caught at submit time with the
nearest valid key, and the mistakes the source articles made get a precise
explanation.

Schema source: the frozen key list (`lf_keys.py`, from llamafactory 0.9.5) by
default, so the daemon never imports torch. `schema="installed"` (or env
OOM_SUPERVISOR_SCHEMA=installed) reads LLaMA-Factory's own argument
dataclasses instead (seconds: it imports torch and transformers).
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from supervisor.core.models import Problem
from supervisor.intake.deepspeed_config import validate_deepspeed_config

SCHEMA_ENV = "OOM_SUPERVISOR_SCHEMA"

# Presets LLaMA-Factory ships in examples/deepspeed/ (facts.md).
SHIPPED_DS_PRESETS = ("ds_z0_config.json", "ds_z2_config.json", "ds_z2_offload_config.json",
                      "ds_z3_config.json", "ds_z3_offload_config.json")

# Keys people write that LLaMA-Factory does not have, with what they meant.
_KNOWN_MISTAKES: dict[str, tuple[str, str | None]] = {
    "gpu_memory_utilization": (
        "not a LLaMA-Factory training argument: it is a vLLM engine setting, and LLaMA-Factory "
        "refuses the whole config for it. Its vLLM knob is `vllm_gpu_util` (inference only); to cap "
        "training memory leave this out and let the supervisor's memory_fraction remedy set "
        "PyTorch's per-process memory fraction",
        "vllm_gpu_util"),
    "compute_type": (
        "not a LLaMA-Factory key; precision is chosen with `bf16: true` (or `fp16: true`)",
        "bf16: true"),
    "torch_dtype": (
        "not a LLaMA-Factory training key; training precision is `bf16: true` / `fp16: true`, "
        "the loaded weights' dtype is `infer_dtype`",
        "bf16: true"),
    "gradient_checkpointing": (
        "not a LLaMA-Factory key: it enables gradient checkpointing by default; "
        "`disable_gradient_checkpointing: true` turns it off",
        "disable_gradient_checkpointing"),
    "max_seq_length": ("LLaMA-Factory calls the sequence length `cutoff_len`", "cutoff_len"),
    "max_length": ("LLaMA-Factory calls the sequence length `cutoff_len`", "cutoff_len"),
}

_LORA_ONLY = ("lora_target", "lora_rank", "lora_alpha", "lora_dropout", "additional_target",
              "use_rslora", "use_dora", "loraplus_lr_ratio", "pissa_init")


def schema_source(schema: str | None = None) -> str:
    return schema or os.environ.get(SCHEMA_ENV, "builtin")


@lru_cache(maxsize=2)
def lf_fields(schema: str = "builtin") -> Mapping[str, Mapping[str, Any]]:
    if schema == "installed":
        from supervisor.intake.llamafactory.introspect import llamafactory_fields

        return llamafactory_fields()
    from supervisor.intake.llamafactory.lf_keys import FIELDS

    return FIELDS


def nearest(key: str, valid: Any) -> str | None:
    hits = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return hits[0] if hits else None


def validate_config(config: Mapping[str, Any], *, workdir: Path, schema: str | None = None) -> list[Problem]:
    """Every problem in a LLaMA-Factory train config (without the supervisor block)."""
    source = schema_source(schema)
    fields = lf_fields(source)
    ds_top = _ds_top_level(source)
    problems: list[Problem] = []
    for key, value in config.items():
        spec = fields.get(key)
        if spec is None:
            problems.append(_unknown_key(str(key), fields, ds_top))
            continue
        msg = value_problem(value, spec)
        if msg:
            problems.append(Problem(str(key), msg))
    problems += _contradictions(config)
    if "deepspeed" in config and config["deepspeed"] is not None:
        problems += _deepspeed_problems(config["deepspeed"], workdir, source)
    return problems


def config_warnings(config: Mapping[str, Any]) -> list[Problem]:
    """What a valid config costs the supervisor's recovery, said at submit (and in `plan`).

    `save_only_model: true` makes the Trainer write weights without optimizer, scheduler and RNG
    state, so no checkpoint can be resumed exactly: every failure restarts from step 0.
    """
    out: list[Problem] = []
    if config.get("save_only_model") is True:
        out.append(Problem("save_only_model",
                           "true: checkpoints hold the weights only (no optimizer, scheduler or RNG state), "
                           "so none can be resumed and every failure restarts the run from step 0; "
                           "set it to false to let the supervisor resume", "save_only_model: false"))
    return out


def _unknown_key(key: str, fields: Mapping[str, Any], ds_top: Any) -> Problem:
    if key in _KNOWN_MISTAKES:
        message, suggestion = _KNOWN_MISTAKES[key]
        return Problem(key, message, suggestion)
    if key in ds_top:
        return Problem(key, "a DeepSpeed config key at the top level of a LLaMA-Factory config; "
                            "put it inside the `deepspeed:` mapping or JSON file", "deepspeed")
    near = nearest(key, fields)
    near_ds = nearest(key, ds_top)
    if near is None and near_ds is not None:
        return Problem(key, f"not a LLaMA-Factory key; it looks like the DeepSpeed key {near_ds!r}, "
                            "which belongs inside the `deepspeed:` mapping or JSON file", "deepspeed")
    return Problem(key, "not a LLaMA-Factory training argument (LLaMA-Factory refuses the whole "
                        "config for an unknown key)", near)


def _ds_top_level(source: str) -> Any:
    if source == "installed":
        from supervisor.intake.deepspeed_config import _schema

        return _schema("installed")["top_level"]
    from supervisor.intake.llamafactory.ds_keys import SCHEMA

    return SCHEMA["top_level"]


def value_problem(value: Any, spec: Mapping[str, Any]) -> str | None:
    """A wrong value type, where it is cheap and certain to tell."""
    types = set(spec.get("types") or ["any"])
    choices = spec.get("choices")
    if value is None:
        return None if ("null" in types or "any" in types) else "must not be empty (null)"
    if choices is not None and not isinstance(value, (dict, list)):
        return None if value in choices else f"{value!r} is not one of {choices}"
    if "any" in types:
        return None
    want = "/".join(sorted(types - {"null"}))
    if isinstance(value, bool):
        return None if "bool" in types else f"expected {want}, got {str(value).lower()}"
    if isinstance(value, int):
        return None if types & {"int", "float"} else f"expected {want}, got the number {value}"
    if isinstance(value, float):
        if "float" in types or ("int" in types and value.is_integer()):
            return None
        return f"expected {want}, got {value!r}"
    if isinstance(value, str):
        if "str" in types:
            return None
        if "bool" in types:
            return (f"expected true/false, got the string {value!r} (quoted in YAML; "
                    f"any non-empty string counts as true)")
        if "float" in types and _is_float(value):
            return None  # OmegaConf (LLaMA-Factory's loader) reads 1e-5 as a float; PyYAML does not
        if "int" in types and value.strip().lstrip("-").isdigit():
            return f"expected a number, got the string {value!r} (remove the quotes)"
        return f"expected {want}, got the string {value!r}"
    if isinstance(value, dict):
        return None if "dict" in types else f"expected {want}, got a mapping"
    if isinstance(value, list):
        return None if "list" in types else f"expected {want}, got a list"
    return None


def _is_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _contradictions(config: Mapping[str, Any]) -> list[Problem]:
    ftype = config.get("finetuning_type", "lora")
    out = []
    if ftype in ("full", "freeze"):
        for key in _LORA_ONLY:
            if key in config:
                out.append(Problem(
                    key, f"applies only to LoRA, but finetuning_type is {ftype!r}: either remove "
                         f"{key} or set finetuning_type: lora",
                    "finetuning_type: lora"))
    if config.get("bf16") is True and config.get("fp16") is True:
        out.append(Problem("fp16", "bf16 and fp16 are both true; choose one", "bf16: true"))
    return out


def _deepspeed_problems(value: Any, workdir: Path, source: str) -> list[Problem]:
    if isinstance(value, Mapping):
        return validate_deepspeed_config(value, prefix="deepspeed", schema=source)
    if not isinstance(value, str):
        return [Problem("deepspeed", "must be a path to a JSON file, an inline JSON string or a mapping")]
    text = value.strip()
    if text.startswith("{"):
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as exc:
            return [Problem("deepspeed", f"inline DeepSpeed JSON does not parse: {exc}")]
        return validate_deepspeed_config(cfg, prefix="deepspeed", schema=source)
    path = Path(text).expanduser()
    resolved = path if path.is_absolute() else workdir / path
    if not resolved.is_file():
        return [_missing_ds_file(text, path, resolved, workdir)]
    try:
        cfg = json.loads(resolved.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return [Problem("deepspeed", f"{resolved} is not readable JSON: {exc}")]
    return [Problem(p.key, f"{p.message} (in {resolved})", p.suggestion)
            for p in validate_deepspeed_config(cfg, prefix="deepspeed", schema=source)]


def _missing_ds_file(text: str, path: Path, resolved: Path, workdir: Path) -> Problem:
    where = "" if path.is_absolute() else f" (relative paths resolve against the job's workdir {workdir})"
    message = f"DeepSpeed config {text!r} does not exist: looked for {resolved}{where}"
    suggestion = None
    if path.name not in SHIPPED_DS_PRESETS:
        near = nearest(path.name, SHIPPED_DS_PRESETS)
        if near:
            suggestion = str(path.with_name(near))
            message += (f". LLaMA-Factory ships {near} in examples/deepspeed/, not {path.name}")
    elif resolved.parent.is_dir():
        suggestion = None
    if suggestion is None and resolved.parent.is_dir():
        near = nearest(path.name, [p.name for p in resolved.parent.glob("*.json")])
        if near:
            suggestion = str(path.with_name(near))
    return Problem("deepspeed", message, suggestion)
