"""DeepSpeed configs: the one we generate for offload, and checks of the user's.

DeepSpeed validates `zero_optimization` and its offload sections strictly but
silently ignores unknown TOP-LEVEL keys (`zero_optimisation` leaves a run at
stage 0), so both levels are checked here, before hours of GPU time are spent.
The built-in schema (`llamafactory/ds_keys.py`, frozen from DeepSpeed 0.19.8)
is the default: it costs no torch import. `schema="installed"` validates with
DeepSpeed's own pydantic models instead (submit time, tests).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from supervisor.core.models import Problem

# Sections DeepSpeed validates with a pydantic model (unknown key -> error).
_STRICT_SECTIONS = ("zero_optimization",)
_OFFLOAD_SECTIONS = ("offload_param", "offload_optimizer")

# Keys that look like DeepSpeed but never existed, with what to do instead.
_NOT_DEEPSPEED_KEYS = {
    "stage3_parition_grads": "misspelled, and not a DeepSpeed key in any spelling: ZeRO-3 always "
                             "partitions gradients. Remove it (DeepSpeed refuses the whole config for it)",
    "stage3_partition_grads": "not a DeepSpeed key: ZeRO-3 always partitions gradients. Remove it "
                              "(DeepSpeed refuses the whole config for it)",
}


def zero3_offload_config(*, offload_param: bool, bf16: bool | None, fp16: bool | None) -> dict[str, Any]:
    """ZeRO-3 with optimizer (and optionally parameter) state offloaded to pinned CPU memory.

    Batch sizes and clipping stay "auto" so the HF integration fills them from
    the training arguments (a non-auto value that disagrees is an error);
    precision follows the job's own flags, "auto" when it sets none.
    pin_memory matters: unpinned offload traffic is much slower.
    """
    cpu = {"device": "cpu", "pin_memory": True}
    zero: dict[str, Any] = {
        "stage": 3,
        "offload_optimizer": dict(cpu),
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1_000_000_000,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    if offload_param:
        zero["offload_param"] = dict(cpu)
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
        "fp16": {
            "enabled": "auto" if fp16 is None else bool(fp16),
            "loss_scale": 0,
            "loss_scale_window": 1000,
            "initial_scale_power": 16,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "bf16": {"enabled": "auto" if bf16 is None else bool(bf16)},
        "zero_optimization": zero,
    }


def _schema(schema: str) -> dict[str, Any]:
    if schema == "installed":
        from supervisor.intake.llamafactory.introspect import deepspeed_schema

        return _cached_installed(deepspeed_schema)
    from supervisor.intake.llamafactory.ds_keys import SCHEMA

    return SCHEMA


_INSTALLED: dict[str, Any] = {}


def _cached_installed(fn: Any) -> dict[str, Any]:
    if "ds" not in _INSTALLED:
        _INSTALLED["ds"] = fn()
    return _INSTALLED["ds"]


def _near(key: str, valid: Any) -> str | None:
    hits = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return hits[0] if hits else None


def validate_deepspeed_config(cfg: Mapping[str, Any], *, prefix: str = "deepspeed",
                              schema: str = "builtin", warnings: list[Problem] | None = None) -> list[Problem]:
    """Every problem DeepSpeed would raise on, or would silently ignore, in `cfg`.

    Keys are dotted paths under `prefix`. "auto" is accepted anywhere (the HF
    integration fills it in). An unknown top-level key is a problem when it is a
    misspelling of a section (`zero_optimisation`: its settings would not act, the run goes on at
    stage 0); any other one (LLaMA-Factory's fp8 preset has `comms_config`, DeepSpeed's name
    for it is `comms_logger`) only has no effect: said in `warnings` when given.
    """
    if not isinstance(cfg, Mapping):
        return [Problem(prefix, f"a DeepSpeed config must be a mapping, not {type(cfg).__name__}")]
    sch = _schema(schema)
    problems: list[Problem] = []
    for key in cfg:
        if key not in sch["top_level"]:
            near = _near(str(key), sch["top_level"])
            typo = near is not None and difflib.SequenceMatcher(None, str(key), near).ratio() >= 0.8
            what = ("not a DeepSpeed config key: DeepSpeed silently ignores unknown top-level keys, "
                    "so this section would have no effect")
            if typo:
                problems.append(Problem(f"{prefix}.{key}", what, near))
            elif warnings is not None:
                warnings.append(Problem(f"{prefix}.{key}", what + "; harmless unless you meant it to act",
                                        near))
    zero = cfg.get("zero_optimization")
    if zero is None:
        return problems
    if isinstance(zero, bool):  # deprecated boolean form, DeepSpeed still reads it
        return problems
    if not isinstance(zero, Mapping):
        return problems + [Problem(f"{prefix}.zero_optimization", "must be a mapping")]
    problems += _check_section(zero, sch["zero_optimization"], f"{prefix}.zero_optimization")
    for sect in _OFFLOAD_SECTIONS:
        sub = zero.get(sect)
        if sub is None:
            continue
        if not isinstance(sub, Mapping):
            problems.append(Problem(f"{prefix}.zero_optimization.{sect}", "must be a mapping"))
            continue
        problems += _check_section(sub, sch[sect], f"{prefix}.zero_optimization.{sect}")
    if schema == "installed" and not problems:
        problems += _pydantic_check(zero, f"{prefix}.zero_optimization")
    return problems


def _check_section(section: Mapping[str, Any], fields: Mapping[str, Any], where: str) -> list[Problem]:
    out: list[Problem] = []
    for key, value in section.items():
        spec = fields.get(key)
        if key in _NOT_DEEPSPEED_KEYS:
            out.append(Problem(f"{where}.{key}", _NOT_DEEPSPEED_KEYS[key], None))
            continue
        if spec is None:
            out.append(Problem(f"{where}.{key}",
                               "unknown key: DeepSpeed refuses the whole config "
                               "(pydantic extra_forbidden)", _near(str(key), fields)))
            continue
        if key in _OFFLOAD_SECTIONS or value == "auto" or value is None:
            continue
        msg = _value_problem(value, spec)
        if msg:
            out.append(Problem(f"{where}.{key}", msg))
    return out


def _value_problem(value: Any, spec: Mapping[str, Any]) -> str | None:
    types = set(spec.get("types") or ["any"])
    choices = spec.get("choices")
    if choices is not None and value not in choices:
        return f"{value!r} is not one of {choices}"
    if "any" in types or choices is not None:
        return None
    if isinstance(value, bool):
        return None if "bool" in types else f"expected {'/'.join(sorted(types))}, got a boolean"
    if isinstance(value, int):
        return None if types & {"int", "float"} else f"expected {'/'.join(sorted(types))}, got a number"
    if isinstance(value, float):
        if "float" in types or ("int" in types and value.is_integer()):
            return None
        return f"expected {'/'.join(sorted(types))}, got {value!r}"
    if isinstance(value, str):
        return None if "str" in types else f"expected {'/'.join(sorted(types))}, got the string {value!r}"
    return None


def _pydantic_check(zero: Mapping[str, Any], where: str) -> list[Problem]:
    """Let DeepSpeed's own model judge what the key lists cannot (ranges, cross-field rules)."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    try:
        DeepSpeedZeroConfig(**dict(zero))
    except ValidationError as err:
        return [Problem(".".join([where, *(str(x) for x in e["loc"])]), e["msg"]) for e in err.errors()]
    except (AssertionError, ValueError) as err:
        return [Problem(where, str(err))]
    return []


# What transformers' HfTrainerDeepSpeedConfig.trainer_config_process fill_match()es against the
# training arguments: a non-"auto" value that disagrees ends the run at start-up (ValueError
# "Please correct the following DeepSpeed config values that mismatch TrainingArguments values").
# (DeepSpeed key, LLaMA-Factory key, its default when the YAML does not set it.)
_MATCHED = (
    ("train_micro_batch_size_per_gpu", "per_device_train_batch_size", 8),
    ("gradient_accumulation_steps", "gradient_accumulation_steps", 1),
    ("gradient_clipping", "max_grad_norm", 1.0),
)
BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


def _num(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return value


def check_launch_pair(config: Mapping[str, Any], ds: Mapping[str, Any] | None, *,
                      world_size: int) -> list[Problem]:
    """The rendered YAML and DeepSpeed JSON as transformers will match them, before launch.

    Pure: the edge calls it with the effective YAML, the JSON it points at and the world size
    really launched; every problem is one transformers would refuse the run for.
    """
    if not isinstance(ds, Mapping):
        return []
    out: list[Problem] = []
    for ds_key, lf_key, default in _MATCHED:
        have = ds.get(ds_key)
        want = config.get(lf_key, default)
        if have is None or have == "auto" or _num(have) == _num(want):
            continue
        out.append(Problem(f"deepspeed.{ds_key}", f"is {have!r} but the YAML's {lf_key}={want!r}: transformers "
                                                  "refuses the mismatch at start-up; set it to \"auto\""))
    have = ds.get("train_batch_size")
    micro = config.get("per_device_train_batch_size", 8)
    accum = config.get("gradient_accumulation_steps", 1)
    want = int(world_size) * int(micro) * int(accum)
    if have not in (None, "auto") and _num(have) != want:
        out.append(Problem("deepspeed.train_batch_size",
                           f"is {have!r} but world size {world_size} x per_device_train_batch_size {micro} x "
                           f"gradient_accumulation_steps {accum} = {want}: transformers refuses the mismatch; "
                           "set it to \"auto\""))
    return out


def with_batch_fields(ds: Mapping[str, Any], *, micro: int, accum: int, world_size: int) -> dict[str, Any] | None:
    """`ds` with its explicit (non-"auto") batch fields rewritten to agree with a new split,
    or None when it has none (the user's file then stays as it is)."""
    values = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
              "train_batch_size": micro * accum * world_size}
    explicit = [k for k in BATCH_KEYS if ds.get(k) not in (None, "auto")]
    if not explicit:
        return None
    return {**ds, **{k: values[k] for k in explicit}}
