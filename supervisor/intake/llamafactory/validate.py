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

# Presets LLaMA-Factory 0.9.5 ships in examples/deepspeed/ of its source (the wheel ships none).
SHIPPED_DS_PRESETS = ("ds_z0_config.json", "ds_z2_autotp_config.json", "ds_z2_config.json",
                      "ds_z2_offload_config.json", "ds_z3_config.json", "ds_z3_fp8_config.json",
                      "ds_z3_offload_config.json")

# Keys people write that LLaMA-Factory does not have, with what they meant.
_KNOWN_MISTAKES: dict[str, tuple[str, str | None]] = {
    "gpu_memory_utilization": (
        ("a vLLM inference setting, not a training one (LLaMA-Factory refuses the whole config for "
         "it): remove this line. The supervisor caps training memory itself when needed (its "
         "memory_fraction remedy sets PyTorch's per-process memory fraction)"),
        None),
    "compute_type": (
        "not a LLaMA-Factory key; precision is chosen with `bf16: true` (or `fp16: true`)",
        "bf16: true"),
    "torch_dtype": (
        ("not a LLaMA-Factory training key; training precision is `bf16: true` / `fp16: true`, "
         "the loaded weights' dtype is `infer_dtype`"),
        "bf16: true"),
    "gradient_checkpointing": (
        ("not a LLaMA-Factory key: it enables gradient checkpointing by default; "
         "`disable_gradient_checkpointing: true` turns it off"),
        "disable_gradient_checkpointing"),
    "max_seq_length": ("LLaMA-Factory calls the sequence length `cutoff_len`", "cutoff_len"),
    "max_length": ("LLaMA-Factory calls the sequence length `cutoff_len`", "cutoff_len"),
}

# Keys transformers 5 removed from TrainingArguments (LLaMA-Factory 0.9.5 allows transformers 5.6):
# their settings moved into `fsdp_config`.
_MOVED_TO_FSDP_CONFIG = {
    "fsdp_transformer_layer_cls_to_wrap": "transformer_layer_cls_to_wrap",
    "fsdp_min_num_params": "min_num_params",
}

# Megatron-Core keys (mcore_adapter's TrainingArguments), read by LLaMA-Factory only with USE_MCA=1.
_MEGATRON_KEYS = frozenset((
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel",
    "bias_activation_fusion", "apply_rope_fusion", "use_distributed_optimizer", "overlap_param_gather",
    "overlap_grad_reduce", "moe_grouped_gemm", "moe_token_dispatcher_type", "expert_model_parallel_size",
    "recompute_granularity", "context_parallel_size", "virtual_pipeline_model_parallel_size",
    "expert_tensor_parallel_size", "moe_layer_freq", "recompute_method", "recompute_num_layers",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"))

# Keys only LLaMA-Factory's inference engines read (chat/api/export): no effect on a training run.
_INFERENCE_ONLY_PREFIXES = ("vllm_", "sglang_")

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


# Typed `str` in TrainingArguments, but transformers' `Trainer.train` takes a bool there too
# (`true`: the newest checkpoint of output_dir) and LLaMA-Factory passes the value through.
ALSO_BOOL = frozenset({"resume_from_checkpoint"})


def env_enabled(env: Mapping[str, str] | None, name: str) -> bool:
    """LLaMA-Factory's own `is_env_enabled`: only "true", "y" and "1" (any case) count."""
    return str((env or {}).get(name, "")).strip().lower() in ("true", "y", "1")


def validate_config(config: Mapping[str, Any], *, workdir: Path, schema: str | None = None,
                    env: Mapping[str, str] | None = None,
                    warnings: list[Problem] | None = None) -> list[Problem]:
    """Every problem in a LLaMA-Factory train config (without the supervisor block).

    `env` is the job's own environment (its `supervisor.env`): ALLOW_EXTRA_ARGS and USE_MCA change
    which keys LLaMA-Factory accepts. What is worth saying but does not stop a run goes to
    `warnings` when given (dropped otherwise: a launch-time re-check must not refuse for it)."""
    source = schema_source(schema)
    fields = lf_fields(source)
    ds_top = _ds_top_level(source)
    problems: list[Problem] = []
    said: list[Problem] = warnings if warnings is not None else []
    extra_ok = env_enabled(env, "ALLOW_EXTRA_ARGS")
    mca = env_enabled(env, "USE_MCA")
    for key, value in config.items():
        spec = fields.get(key)
        if spec is None:
            p = _unknown_key(str(key), fields, ds_top)
            if mca and key not in _KNOWN_MISTAKES:
                said.append(Problem(p.key, "not a LLaMA-Factory key; with USE_MCA=1 it goes to Megatron-Core "
                                           "(mcore_adapter), whose keys are not checked here"))
            elif extra_ok:
                said.append(Problem(p.key, p.message + "; ALLOW_EXTRA_ARGS is set in the job's env, so "
                                                       "LLaMA-Factory ignores it", p.suggestion))
            else:
                problems.append(p)
            continue
        msg = None if key in ALSO_BOOL and isinstance(value, bool) else value_problem(value, spec)
        if msg:
            problems.append(Problem(str(key), msg))
        elif str(key).startswith(_INFERENCE_ONLY_PREFIXES):
            said.append(Problem(str(key), "only LLaMA-Factory's vLLM/SGLang inference (chat, api, export) "
                                          "reads it: no effect on training; remove it"))
    if config.get("infer_backend") not in (None, "huggingface"):
        problems.append(Problem("infer_backend", f"{config['infer_backend']!r} is an inference engine; "
                                "LLaMA-Factory refuses it for training (\"vLLM/SGLang backend is only "
                                "available for API, CLI and Web\"): remove the line", None))
    problems += _contradictions(config)
    if "deepspeed" in config and config["deepspeed"] is not None:
        problems += _deepspeed_problems(config["deepspeed"], workdir, source, config, said)
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
    if key in _MOVED_TO_FSDP_CONFIG:
        inner = _MOVED_TO_FSDP_CONFIG[key]
        return Problem(key, f"transformers 5 (installed with LLaMA-Factory 0.9.5) no longer has it and "
                            f"LLaMA-Factory refuses the config: write it inside fsdp_config instead, "
                            f"e.g. `fsdp_config: {{{inner}: ...}}`", f"fsdp_config: {{{inner}: ...}}")
    if key in _MEGATRON_KEYS:
        return Problem(key, "a Megatron-Core (mcore_adapter) key: LLaMA-Factory reads it only when the job's "
                            "environment sets USE_MCA=1 (and mcore_adapter is installed there); add "
                            "`env: {USE_MCA: \"1\"}` to the supervisor block, or remove the key")
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


def _deepspeed_problems(value: Any, workdir: Path, source: str, config: Mapping[str, Any],
                        warnings: list[Problem]) -> list[Problem]:
    if isinstance(value, Mapping):
        return validate_deepspeed_config(value, prefix="deepspeed", schema=source, warnings=warnings)
    if not isinstance(value, str):
        return [Problem("deepspeed", "must be a path to a JSON file, an inline JSON string or a mapping")]
    text = value.strip()
    if text.startswith("{"):
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as exc:
            return [Problem("deepspeed", f"inline DeepSpeed JSON does not parse: {exc}")]
        return validate_deepspeed_config(cfg, prefix="deepspeed", schema=source, warnings=warnings)
    path = Path(text).expanduser()
    resolved = path if path.is_absolute() else workdir / path
    if not resolved.is_file():
        return [_missing_ds_file(text, path, resolved, workdir, config)]
    try:
        cfg = json.loads(resolved.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return [Problem("deepspeed", f"{resolved} is not readable JSON: {exc}")]
    found: list[Problem] = []
    out = [Problem(p.key, f"{p.message} (in {resolved})", p.suggestion)
           for p in validate_deepspeed_config(cfg, prefix="deepspeed", schema=source, warnings=found)]
    warnings += [Problem(p.key, f"{p.message} (in {resolved})", p.suggestion) for p in found]
    return out


_REMEDY_ADVICE = ("or drop `deepspeed:`: when memory runs out, the supervisor's zero3 remedies "
                  "generate a ZeRO-3 (offload) config themselves")


def _missing_ds_file(text: str, path: Path, resolved: Path, workdir: Path,
                     config: Mapping[str, Any]) -> Problem:
    """Advice that leads to an accepted config: the absolute path of the preset where a
    LLaMA-Factory checkout near the job has it (never a different preset), else dropping the key."""
    where = ("" if path.is_absolute() else
             f" (a relative path resolves against the job's workdir {workdir}, where you ran submit)")
    message = f"DeepSpeed config {text!r} does not exist: looked for {resolved}{where}"
    name = path.name
    if name not in SHIPPED_DS_PRESETS:
        near = nearest(name, SHIPPED_DS_PRESETS)
        if near:
            message += f". LLaMA-Factory ships {near} in examples/deepspeed/, not {name}"
            name = near
    found = _find_preset(name, workdir, config) if name in SHIPPED_DS_PRESETS else None
    if found is not None:
        return Problem("deepspeed", f"{message}; found it at {found}: give that path", str(found))
    if resolved.parent.is_dir():
        near = nearest(path.name, [p.name for p in resolved.parent.glob("*.json")])
        if near:
            return Problem("deepspeed", f"{message}; {resolved.parent} has {near}",
                           str(resolved.parent / near))
    if name in SHIPPED_DS_PRESETS:
        message += (f". It is a preset of LLaMA-Factory's source checkout (examples/deepspeed/{name}; the "
                    "pip package ships none): give its absolute path in your checkout, or run submit from "
                    "the checkout's root")
    return Problem("deepspeed", f"{message}, {_REMEDY_ADVICE}", None)


def _find_preset(name: str, workdir: Path, config: Mapping[str, Any]) -> Path | None:
    """`name` in a LLaMA-Factory checkout the job points at: the workdir itself or the folder
    holding its dataset_dir (a checkout's data/ sits beside examples/)."""
    roots = [workdir]
    ddir = config.get("dataset_dir")
    if isinstance(ddir, str) and ddir not in ("ONLINE",) and not ddir.startswith("REMOTE:"):
        d = Path(ddir).expanduser()
        roots.append((d if d.is_absolute() else workdir / d).parent)
    for root in roots:
        cand = root / "examples" / "deepspeed" / name
        if cand.is_file():
            return cand
    return None
