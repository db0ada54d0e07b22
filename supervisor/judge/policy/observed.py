"""What an attempt leaves for the next night (pure): the key that decides its memory, the
estimator's prediction for it and what it really used (the hook's GPU peak file, the host peak), fit or OOM."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from supervisor.core.models import Category, Diagnosis, JobContext, Overrides
from supervisor.judge.policy import rungs as R
from supervisor.judge.policy import search as S
from supervisor.judge.policy.estimate import model_states

GiB = 1 << 30
# Host RAM of a GPU training process besides offloaded states: Python, torch, CUDA/HIP
# runtime, the dataset and pinned buffers. A lead; host observations correct it.
HOST_BASE = 2 * GiB
# Extra margin on a prediction, by how far the evidence is from the job (a share of the
# prediction). An exactly observed fit needs none beyond the policy's fit_headroom. Another
# cutoff_len scales activations linearly (flash attention), as the estimator does, so its ratio
# carries well; a sibling size shifts the states/activations mix. bench_policy --learned
# (base): other_seq/sibling at 0.10/0.15 fit first 99.4%/99.3% at cost 1.042/1.054; at
# 0.05/0.08 99.6%/99.3% at 1.034/1.039 (a miss costs a climb); at 0 91.6-95.6%.
MARGINS = {"same_config": 0.0, "same_job": 0.03, "same_kind": 0.05, "other_versions": 0.08, "other_seq": 0.05,
           "sibling": 0.08}
# More margin when a candidate's setup (setup_of) differs from every fit the ratio came from.
SETUP_MARGIN = 0.10
# "same_job": this kind under the job's own name (a job resubmitted night after night): its own
# attempts before those of other jobs of its kind, whose data or allocator luck may differ.
TIER_ORDER = ("same_job", "same_kind", "other_versions", "other_seq", "sibling")
TIER_WORDS = {"same_job": "of this job", "same_kind": "of this kind",
              "other_versions": "of this kind under other library versions",
              "other_seq": "of the same model at another cutoff_len", "sibling": "of a sibling model size"}
# Fields of the key that are the configuration (what a remedy changes), not the job's kind.
CONFIG_FIELDS = ("micro_batch", "grad_accum", "grad_checkpointing", "zero_stage", "offload_optimizer",
                 "offload_param")
VERSION_FIELDS = ("torch", "transformers", "deepspeed")


def memory_key(ctx: JobContext, ov: Overrides, *, deepspeed_version: str | None = None) -> dict[str, Any]:
    """Everything that determines an attempt's memory, as plain JSON values."""
    v = R.view_of(ctx, ov)
    shape = ctx.model_shape or {}
    gc = "off" if not v.gc_on else ("offloaded" if v.unsloth_gc else "on")
    return {
        "params": ctx.param_count, "hidden_size": shape.get("hidden_size"),
        "num_layers": shape.get("num_layers"), "vocab_size": shape.get("vocab_size"),
        "finetuning_type": str(v.config.get("finetuning_type", "lora")),
        "cutoff_len": v.cutoff, "packing": S.packed(v.config),
        # What sizes activations: cutoff_len, or the data's longest sample when shorter (S.seq_len).
        "seq_len": S.seq_len(ctx, v), "data_p95_tokens": (ctx.dataset_token_lengths or {}).get("p95"),
        "micro_batch": v.micro, "grad_accum": v.accum, "grad_checkpointing": gc,
        "zero_stage": v.setup.zero_stage, "offload_optimizer": v.setup.offload_optimizer,
        "offload_param": v.setup.offload_param,
        "gpu_capacity": ctx.gpu_capacity_bytes, "world_size": ctx.launched_world_size(),
        "torch": ctx.torch_version, "transformers": ctx.transformers_version, "deepspeed": deepspeed_version,
    }


def setup_of(key: Mapping[str, Any], ov: Mapping[str, Any] | Overrides) -> tuple[Any, ...]:
    """How the configuration holds memory apart from the batch split: checkpointing, ZeRO,
    offload, allocator tuning, a cap. A ratio observed under one setup is extrapolated to
    another only with SETUP_MARGIN more."""
    o = ov if isinstance(ov, Overrides) else Overrides.from_dict(ov)
    return (key.get("grad_checkpointing"), key.get("zero_stage"), key.get("offload_optimizer"),
            key.get("offload_param"), R.ALLOC_VARS[0] in o.env, R.cap_fraction(o) is not None)


def kind_of(key: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in key.items() if k not in CONFIG_FIELDS}


def config_sig(key: Mapping[str, Any], ov: Mapping[str, Any] | Overrides) -> tuple[Any, ...]:
    """The configuration an attempt ran, independent of the job file it came from: two jobs of one
    kind whose user batches differ have different Overrides for the same 4x4, and one sig."""
    return (*(key.get(f) for f in CONFIG_FIELDS), key.get("cutoff_len"), *setup_of(key, ov)[4:])


@dataclass(frozen=True)
class GpuPeak:
    """The largest per-device peak the hook's peak file holds (bytes)."""

    max_reserved: int
    max_allocated: int
    total: int | None
    name: str | None
    devices: int


def parse_peak_file(data: Any) -> GpuPeak | None:
    """The hook's peak file (supervisor/hooks/startup/.../peak.py) -> the worst device, or None
    when it holds no device (a CPU run, a process that never used the GPU) or is not one."""
    procs = data.get("processes") if isinstance(data, Mapping) else None
    if not isinstance(procs, Mapping):
        return None
    best: GpuPeak | None = None
    n = 0
    for entry in procs.values():
        for d in (entry.get("devices") or []) if isinstance(entry, Mapping) else []:
            try:
                res, alloc = int(d["max_reserved_bytes"]), int(d.get("max_allocated_bytes") or 0)
            except (KeyError, TypeError, ValueError):
                continue
            n += 1
            if best is None or res > best.max_reserved:
                total = d.get("total_bytes")
                best = GpuPeak(res, alloc, int(total) if isinstance(total, int) else None, d.get("name"), 0)
    return None if best is None else GpuPeak(best.max_reserved, best.max_allocated, best.total, best.name, n)


@dataclass(frozen=True)
class Observation:
    """What one finished attempt used, and whether it fit.

    For a fit, the peaks are what the configuration needs; for an OOM, `gpu_peak` /
    `host_peak` are lower bounds (what it had when it failed, plus the failed request)."""

    key: Mapping[str, Any]
    overrides: Mapping[str, Any]
    outcome: str  # "fit" | "gpu_oom" | "host_oom"
    gpu_peak: int | None = None
    gpu_total: int | None = None
    gpu_name: str | None = None
    host_peak: int | None = None
    host_limit: int | None = None
    predicted_gpu: int | None = None
    # The part of predicted_gpu that is model states (DeepSpeed's formulas): the correction scales
    # only the rest (activations, runtime overhead), so a ratio seen where states are small (with
    # parameter offload) is not multiplied onto states that dominate another configuration. Rows
    # written without it count for their own configuration only, not in the GPU correction.
    predicted_gpu_states: int | None = None
    predicted_host: int | None = None
    job: str = ""
    attempt: int = 0
    time: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["key"], d["overrides"], d["extra"] = dict(self.key), dict(self.overrides), dict(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Observation:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


def on_gpu(ctx: JobContext) -> bool:
    return bool(ctx.gpu_capacity_bytes)


def predict_gpu_states(ctx: JobContext, ov: Overrides) -> int | None:
    """The model-state part of predict_gpu (weights, gradients, optimizer state on the GPU)."""
    if not on_gpu(ctx) or ctx.param_count is None:
        return None
    v = R.view_of(ctx, ov)
    lil = ctx.largest_layer_params or ctx.param_count // 40
    return model_states(ctx.param_count, lil, ctx.launched_world_size(), v.setup)[0]


def corrected_gpu(pred: int, states: int | None, k: float) -> int:
    """The GPU need after the correction: model states as the formula says, the rest x k."""
    fixed = min(states or 0, pred)
    return int(fixed + k * (pred - fixed))


def predict_gpu(ctx: JobContext, ov: Overrides) -> int | None:
    """The estimator's GPU peak (search.base_need), or None on a CPU run / unknown shape."""
    return S.base_need(ctx, ov) if on_gpu(ctx) else None


def predict_host(ctx: JobContext, ov: Overrides) -> int | None:
    """The estimator's host peak: offloaded states + HOST_BASE; on a CPU run the whole training."""
    need = S.base_need(ctx, ov)
    if need is None:
        return None
    v = R.view_of(ctx, ov)
    lil = ctx.largest_layer_params or (ctx.param_count or 0) // 40
    _, host_states = model_states(ctx.param_count or 0, lil, ctx.launched_world_size(), v.setup)
    return host_states + (HOST_BASE if on_gpu(ctx) else need)


def observation(ctx: JobContext, ov: Overrides, diagnosis: Diagnosis | None, *, succeeded: bool,
                max_step: int | None = None, resumed_from_step: int | None = None,
                peak: GpuPeak | None = None, peak_rss_bytes: int | None = None,
                memory_limit_bytes: int | None = None, deepspeed_version: str | None = None,
                job: str = "", attempt: int = 0, time: float = 0.0) -> Observation | None:
    """The record of one finished attempt, or None when it says nothing about memory.

    Fit: it succeeded, or trained past the step it started from without an OOM (then its
    peaks are real). OOM: a GPU or host OOM diagnosis; its lower bounds come from the OOM
    message (capacity - free + the failed request), the peak file, or the memory limit."""
    if ctx.param_count is None or not ctx.model_shape or ctx.kind != "llamafactory":
        return None
    key = memory_key(ctx, ov, deepspeed_version=deepspeed_version)
    cat = diagnosis.category if diagnosis is not None else None
    gpu_total = (peak.total if peak else None) or ctx.gpu_capacity_bytes
    common: dict[str, Any] = {
        "key": key, "overrides": ov.to_dict(), "gpu_total": gpu_total, "gpu_name": peak.name if peak else None,
        "host_limit": memory_limit_bytes, "predicted_gpu": predict_gpu(ctx, ov),
        "predicted_gpu_states": predict_gpu_states(ctx, ov),
        "predicted_host": predict_host(ctx, ov), "job": job, "attempt": attempt, "time": time}
    if cat == Category.GPU_OOM and (diagnosis.numbers.get("held_by_others") or 0) >= GiB:
        return None  # other processes' memory: it says nothing about this configuration
    if cat == Category.GPU_OOM:
        lb = S._observed_demand(diagnosis, ctx.gpu_capacity_bytes)
        if lb is not None:
            lb -= diagnosis.numbers.get("reserved_unallocated") or 0  # what only the allocator returns
        cands = [x for x in (lb, peak.max_reserved if peak else None) if x]
        # Neither numbers nor a peak file: it did not fit, by how much is unknown. The whole GPU
        # as its "peak" would raise the correction of every candidate on a guess.
        return Observation(outcome="gpu_oom", gpu_peak=max(cands) if cands else None,
                           host_peak=peak_rss_bytes, extra={"summary": diagnosis.summary,
                                                            "outside_pytorch": diagnosis.subkind in R.NON_CACHING_SUBKINDS},
                           **common)
    if cat == Category.HOST_OOM:
        lb = max([x for x in (memory_limit_bytes, peak_rss_bytes) if x] or [0]) or None
        return Observation(outcome="host_oom", host_peak=lb, extra={"summary": diagnosis.summary}, **common)
    trained = max_step is not None and max_step > (resumed_from_step or 0)
    if not (succeeded or trained):
        return None
    if on_gpu(ctx) and peak is None:
        return None  # a fit without its GPU peak says nothing usable about the GPU
    return Observation(outcome="fit", gpu_peak=peak.max_reserved if peak else None,
                       host_peak=peak_rss_bytes, **common)
