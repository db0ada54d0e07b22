"""A small job and the observations its earlier attempts would leave."""

from __future__ import annotations

from typing import Any

from supervisor.core.models import Category, Diagnosis, JobContext, Overrides
from supervisor.judge.policy import BUILTIN_POLICY_DIR, load_policy
from supervisor.judge.policy import observed as LO
from supervisor.judge.policy import rungs as R

GiB = 1 << 30
POLICY = load_policy("default", search_dirs=[BUILTIN_POLICY_DIR])
# Qwen2.5-0.5B's shape (tests/policy uses the same numbers).
SHAPE = {"hidden_size": 896, "num_layers": 24, "vocab_size": 151936}
PARAMS, LIL = 494_032_768, 136_134_656


def gpu_job(micro: int = 16, accum: int = 1, *, cap_gib: float = 24, cutoff: int = 2048, params: int = PARAMS,
            shape: dict[str, int] | None = None, **kw: Any) -> JobContext:
    cfg = {"model_name_or_path": "/models/q", "stage": "sft", "finetuning_type": "full",
           "per_device_train_batch_size": micro, "gradient_accumulation_steps": accum, "cutoff_len": cutoff,
           "bf16": True, **kw.pop("config", {})}
    return JobContext(id=1, name="j", kind="llamafactory", config=cfg, param_count=params, largest_layer_params=LIL,
                      model_shape=shape or SHAPE, gpu_capacity_bytes=int(cap_gib * GiB), host_ram_bytes=512 * GiB,
                      torch_version="2.9.1", transformers_version="4.57.1", visible_gpu_count=1, **kw)


def cpu_job(micro: int = 16, accum: int = 1, *, limit_gib: float = 1.91) -> JobContext:
    """The demo's kind: a CPU run under a host memory limit."""
    cfg = {"model_name_or_path": "/models/tiny", "stage": "sft", "finetuning_type": "full",
           "per_device_train_batch_size": micro, "gradient_accumulation_steps": accum, "cutoff_len": 256}
    return JobContext(id=1, name="demo", kind="llamafactory", config=cfg, param_count=30_000_000,
                      largest_layer_params=5_000_000, model_shape={"hidden_size": 256, "num_layers": 4,
                                                                   "vocab_size": 32000},
                      host_memory_limit_bytes=int(limit_gib * GiB), host_ram_bytes=8 * GiB, visible_gpu_count=0)


def split(ctx: JobContext, micro: int) -> Overrides:
    """The micro_batch rung's own configuration for `micro` (the user's when unchanged)."""
    if micro == R.view_of(ctx, Overrides()).micro:
        return Overrides()
    r = R.micro_batch(ctx, Overrides(), Diagnosis(Category.GPU_OOM, "x"), POLICY, R.Memory(), target=micro)
    assert isinstance(r, R.Applied), r
    return r.overrides


def gpu_oom(cap: int, in_use: int, tried: int) -> Diagnosis:
    return Diagnosis(Category.GPU_OOM, "CUDA out of memory", vendor="cuda",
                     numbers={"total_capacity": cap, "free": cap - in_use, "tried_to_allocate": tried})


def host_oom() -> Diagnosis:
    return Diagnosis(Category.HOST_OOM, "DefaultCPUAllocator: can't allocate memory", vendor="cpu")


def fit_gpu(ctx: JobContext, ov: Overrides, peak: int, n: int = 1) -> LO.Observation:
    o = LO.observation(ctx, ov, None, succeeded=True, peak=LO.GpuPeak(peak, peak, ctx.gpu_capacity_bytes,
                                                                       "NVIDIA H200", 1),
                      peak_rss_bytes=3 * GiB, job="earlier", attempt=n, time=float(n))
    assert o is not None
    return o


def demo_night(ctx: JobContext) -> list[LO.Observation]:
    """16x1 and 8x2 ran out of host memory, 4x4 fit at 1.32 GiB of 1.91 GiB."""
    limit = ctx.host_memory_limit_bytes
    out = []
    for n, (micro, ok) in enumerate(((16, False), (8, False), (4, True)), 1):
        o = LO.observation(ctx, split(ctx, micro), None if ok else host_oom(), succeeded=ok,
                          peak_rss_bytes=int(1.32 * GiB) if ok else int(1.7 * GiB), memory_limit_bytes=limit,
                          max_step=30 if ok else 0, job="demo", attempt=n, time=float(n))
        assert o is not None
        out.append(o)
    return out
