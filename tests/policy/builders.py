"""Builders for policy tests: a job, a diagnosis, an attempt."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from supervisor.core.models import (
    AttemptRecord,
    Category,
    Diagnosis,
    ExitRecord,
    JobContext,
    Overrides,
    Phase,
)

GiB = 1 << 30


def job(config: Mapping[str, Any] | None = None, **kw: Any) -> JobContext:
    base = {"model_name_or_path": "/models/llama", "stage": "sft", "finetuning_type": "full",
            "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "bf16": True}
    return JobContext(id=kw.pop("id", 7), name="j", kind=kw.pop("kind", "llamafactory"),
                      config={**base, **(config or {})}, **kw)


def oom(phase: Phase = Phase.TRAIN_STEP, *, short_gib: float | None = None, cap_gib: float = 192,
        frag: bool = False, reserved_gib: float | None = None, subkind: str | None = None,
        vendor: str = "hip", category: Category = Category.GPU_OOM) -> Diagnosis:
    numbers: dict[str, Any] = {}
    if short_gib is not None:
        numbers = {"tried_to_allocate": int((short_gib + 0.5) * GiB), "free": int(0.5 * GiB),
                   "total_capacity": int(cap_gib * GiB)}
    if reserved_gib is not None:
        numbers["reserved_unallocated"] = int(reserved_gib * GiB)
    return Diagnosis(category, "out of memory", subkind=subkind, vendor=vendor, phase=phase,
                     numbers=numbers, fragmentation=frag)


def diag(category: Category, summary: str = "it failed") -> Diagnosis:
    return Diagnosis(category, summary)


def attempt(n: int, overrides: Overrides, d: Diagnosis | None, ckpt: int | None = None) -> AttemptRecord:
    return AttemptRecord(number=n, overrides=overrides, diagnosis=d, exit=ExitRecord(1),
                         checkpoint_step_after=ckpt)


