"""Read the argument schema from the installed LLaMA-Factory and DeepSpeed.

Importing either pulls torch (seconds, gigabytes), so nothing here runs at
import time and the daemon never calls it: it serves `generate_keys` (which
freezes the schema into `lf_keys.py` / `ds_keys.py`) and the opt-in
"installed" validation path at submit time.

A field is described by a small JSON-friendly dict:
  {"owner": class name, "types": sorted type names (bool, int, float, str,
   dict, list, null, any), "choices": [...] or None, "default": JSON value or None}
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from typing import Any

LF_ARG_CLASSES = ("ModelArguments", "DataArguments", "TrainingArguments",
                  "FinetuningArguments", "GeneratingArguments")


def _describe_type(hint: Any) -> tuple[set[str], list[Any] | None]:
    """Flatten a type hint into cheap-to-check type names and literal choices."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        names: set[str] = set()
        choices: list[Any] | None = []
        for arg in typing.get_args(hint):
            n, c = _describe_type(arg)
            names |= n
            if c is None:
                choices = None if not ({"str"} & n and choices is not None and n == {"enum"}) else choices
            elif choices is not None:
                choices += c
        if "str" in names:  # "Enum | str" accepts any string
            choices = None
        names.discard("enum")
        if choices:
            names.add("str")
        return names, (choices or None)
    if origin is typing.Literal:
        vals = list(typing.get_args(hint))
        return {type(v).__name__ if v is not None else "null" for v in vals}, vals
    if hint is type(None):
        return {"null"}, None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return {"enum"}, [m.value for m in hint]
    base = origin or hint
    for name, cls in (("bool", bool), ("int", int), ("float", float), ("str", str),
                      ("dict", dict), ("list", list)):
        if base is cls:
            return {name}, None
    return {"any"}, None


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        json.dumps(value)
        return value
    except TypeError:
        return None


def llamafactory_fields() -> dict[str, dict[str, Any]]:
    """Every key `llamafactory-cli train` accepts, as its parser sees it."""
    import llamafactory.hparams as hp  # heavy: torch + transformers

    out: dict[str, dict[str, Any]] = {}
    for cls_name in LF_ARG_CLASSES:
        cls = getattr(hp, cls_name)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init or f.name in out:
                continue
            names, choices = _describe_type(hints.get(f.name, Any))
            if choices is not None and len(names - {"null"}) == 1 and names == {"enum"}:
                names = {"str"}
            default = f.default if f.default is not dataclasses.MISSING else None
            out[f.name] = {"owner": cls_name, "types": sorted(names - {"enum"}) or ["any"],
                           "choices": [_jsonable(c) for c in choices] if choices else None,
                           "default": _jsonable(default)}
    return out


def llamafactory_version() -> str:
    from importlib.metadata import version

    return version("llamafactory")


def deepspeed_version() -> str:
    from importlib.metadata import version

    return version("deepspeed")


def _pydantic_fields(model: Any) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, info in model.model_fields.items():
        names, choices = _describe_type(info.annotation)
        if names == {"enum"} or (choices and "enum" in names):
            names = {"str", "int"}
        entry = {"types": sorted(names - {"enum"}) or ["any"],
                 "choices": [_jsonable(c) for c in choices] if choices else None,
                 "deprecated": bool((info.json_schema_extra or {}).get("deprecated"))
                 if isinstance(info.json_schema_extra, dict) else False}
        out[name] = entry
        if info.alias and info.alias != name:
            out[info.alias] = dict(entry, alias_of=name)
    return out


def deepspeed_schema() -> dict[str, Any]:
    """The ZeRO sections DeepSpeed validates strictly, and the top-level keys it reads.

    The top-level keys are recorded by handing DeepSpeedConfig a dict that
    remembers every key looked up; a few sections are read elsewhere (engine,
    profiler, autotuner, AIO) and are added by name.
    """
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    seen: set[str] = set()

    class Recording(dict):
        def get(self, k, *a):
            seen.add(k)
            return super().get(k, *a)

        def __contains__(self, k):
            seen.add(k)
            return super().__contains__(k)

        def __getitem__(self, k):
            seen.add(k)
            return super().__getitem__(k)

    batch = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1}
    for extra in ({"zero_optimization": {"stage": 3}}, {"fp16": {"enabled": True}},
                  {"bf16": {"enabled": True}, "optimizer": {"type": "Adam", "params": {}},
                   "scheduler": {"type": "WarmupLR", "params": {}}}):
        DeepSpeedConfig(Recording({**batch, **extra}))
    read_elsewhere = {"activation_checkpointing", "flops_profiler", "autotuning", "aio"}
    top = sorted({k for k in seen if isinstance(k, str)} | read_elsewhere)
    return {
        "top_level": top,
        "zero_optimization": _pydantic_fields(DeepSpeedZeroConfig),
        "offload_param": _pydantic_fields(DeepSpeedZeroOffloadParamConfig),
        "offload_optimizer": _pydantic_fields(DeepSpeedZeroOffloadOptimizerConfig),
    }
