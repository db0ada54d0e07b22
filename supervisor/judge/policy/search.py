"""Choose the cheapest configuration predicted to fit, when the model's shape is known.

The prediction is the estimator's (model states by ZeRO setup + activations by
micro-batch, sequence length and checkpointing + a runtime overhead),
calibrated on what the failed attempts actually demanded: an OOM message
gives capacity, free memory and the one allocation that failed, so every
failed attempt's true peak is at least (capacity - free + tried); when the
prediction for that configuration was lower, later predictions are scaled up
by the same factor.

Up to three rungs may be combined into one step when no single rung is
predicted to close the gap: one failed attempt is hours lost, a compound
step costs nothing extra. Among the configurations predicted to fit, the one
with the highest estimated throughput wins (fewest rungs on a tie).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from supervisor.core.models import AttemptRecord, Category, Diagnosis, JobContext, Overrides
from supervisor.judge.policy import rungs as R
from supervisor.judge.policy.estimate import activation_bytes, model_states
from supervisor.judge.policy.schema import Policy

GiB = 1 << 30
RUNTIME_OVERHEAD = GiB  # CUDA/HIP context, BLAS workspaces, communication buffers
MAX_COMBINED = 3

# Estimated relative throughput of each choice (1.0 = plain training); leads, not truths:
# recomputation costs ~20-30% (articles), optimizer offload ~15% (articles' 15% for full
# offload is on the optimistic side), parameter offload moves every weight over PCIe twice a step.
SPEED = {"gc": 0.8, "unsloth_gc": 0.95, "allocator": 0.99, "cutoff_len": 0.7}
TOKENS_HALF_EFFICIENCY = 2048  # tokens per micro-batch at which the GPU runs at ~half its best
# Offload costs do not depend on the model size but on tokens per step: a CPU Adam step
# takes ~1 ns/parameter while the GPU spends ~6 FLOPs/parameter/token at ~200 TFLOP/s, so
# the optimizer step weighs like ~30k tokens of compute; moving the 16-bit weights over
# PCIe (~25 GB/s) twice per micro-batch weighs like ~5k tokens per micro-batch.
ADAM_STEP_TOKENS = 30_000
PARAM_TRAFFIC_TOKENS = 5_000


@dataclass(frozen=True)
class Step:
    names: tuple[str, ...]
    applied: tuple[R.Applied, ...]
    overrides: Overrides
    need: int
    speed: float


PAD_MULTIPLE = 8  # LLaMA-Factory's SFT collator pads a batch to a multiple of 8 tokens


def packed(config: Any) -> bool:
    """Samples packed into cutoff_len blocks: `packing`/`neat_packing`, on by default for stage pt
    (LLaMA-Factory's parser: packing = stage == "pt" when unset)."""
    p = config.get("packing")
    if config.get("neat_packing"):
        return True
    return bool(p) if p is not None else str(config.get("stage", "sft")) == "pt"


def seq_len(job: JobContext, v: R.View) -> int:
    """The longest sequence a micro-batch holds, which sizes its activations: cutoff_len, or the
    training set's longest sample (padded to PAD_MULTIPLE) when it is known, shorter and samples
    are not packed."""
    longest = (job.dataset_token_lengths or {}).get("max")
    if not longest or packed(v.config):
        return v.cutoff
    return min(v.cutoff, -(-int(longest) // PAD_MULTIPLE) * PAD_MULTIPLE)


def base_need(job: JobContext, ov: Overrides) -> int | None:
    shape = job.model_shape
    if not job.param_count or not shape:
        return None
    try:
        hidden, layers = int(shape["hidden_size"]), int(shape["num_layers"])
    except (KeyError, TypeError, ValueError):
        return None
    v = R.view_of(job, ov)
    lil = job.largest_layer_params or job.param_count // 40
    states, _ = model_states(job.param_count, lil, job.launched_world_size(), v.setup)
    act = activation_bytes(micro_batch=v.micro, seq_len=seq_len(job, v), hidden=hidden, layers=layers,
                           checkpointing=v.gc_on, vocab=int(shape.get("vocab_size") or 0),
                           offload_checkpoints=v.unsloth_gc)
    return states + act + RUNTIME_OVERHEAD


def speed(job: JobContext, ov: Overrides) -> float:
    v = R.view_of(job, ov)
    tokens = v.micro * v.cutoff
    s = tokens / (tokens + TOKENS_HALF_EFFICIENCY)
    if v.gc_on:
        s *= SPEED["gc"] * (SPEED["unsloth_gc"] if v.unsloth_gc else 1.0)
    if v.setup.offload_optimizer:
        per_step = tokens * v.accum * job.launched_world_size()
        s *= 1 / (1 + ADAM_STEP_TOKENS * v.setup.trainable_fraction / per_step)
    if v.setup.offload_param:
        s *= 1 / (1 + PARAM_TRAFFIC_TOKENS / tokens)
    if R.ALLOC_VARS[0] in ov.env:
        s *= SPEED["allocator"]
    if "cutoff_len" in ov.yaml:
        s *= SPEED["cutoff_len"]
    return s


def _observed_demand(d: Diagnosis | None, capacity: int | None) -> int | None:
    if d is None or d.category != Category.GPU_OOM:
        return None
    n = d.numbers
    cap = n.get("total_capacity") or capacity
    if cap is None or n.get("free") is None or n.get("tried_to_allocate") is None:
        return None
    return cap - n["free"] - (n.get("held_by_others") or 0) + n["tried_to_allocate"]


def calibration(job: JobContext, history: Sequence[AttemptRecord]) -> float:
    """How much the prediction under-estimated the failed attempts (>= 1)."""
    k = 1.0
    for a in history:
        seen = _observed_demand(a.diagnosis, job.gpu_capacity_bytes)
        pred = base_need(job, a.overrides)
        if seen and pred:
            # Reserved-but-unallocated memory is counted on its own (see predicted_need), so it is
            # taken out here whether or not the diagnosis called it fragmentation.
            waste = a.diagnosis.numbers.get("reserved_unallocated") or 0
            k = max(k, (seen - waste) / pred)
    return k


def predicted_need(job: JobContext, ov: Overrides, diag: Diagnosis, mem: R.Memory,
                   history: Sequence[AttemptRecord], k: float | None = None) -> int | None:
    """Predicted GPU peak of `ov`: the calibrated estimate plus the memory PyTorch held but could
    not use (reserved_unallocated) in the failed attempt, which only allocator tuning hands back.
    It counts even when smaller than the failed request (no fragmentation flag): those bytes
    were not available to the job either way."""
    base = base_need(job, ov)
    if base is None:
        return None
    waste = 0 if R.ALLOC_VARS[0] in ov.env else (mem.reserved_unallocated or 0)
    return int((calibration(job, history) if k is None else k) * base) + waste


def choose(job: JobContext, current: Overrides, diag: Diagnosis, policy: Policy, mem: R.Memory,
           history: Sequence[AttemptRecord], first: Sequence[str], rest: Sequence[str],
           expand: Callable[[str, Overrides], list[R.Applied]], failed: set[str]) -> Step | None:
    """The fastest configuration within MAX_COMBINED rungs predicted to fit, or None."""
    capacity = mem.capacity
    if capacity is None or base_need(job, current) is None:
        return None
    limit = capacity * (1 - policy.fit_headroom)
    k = calibration(job, history)

    def limit_of(ov: Overrides) -> float:
        """A memory cap (memory_fraction) is PyTorch's limit, not the GPU."""
        f = R.cap_fraction(ov)
        return limit if f is None else min(limit, f * capacity)

    def need(ov: Overrides) -> int:
        return predicted_need(job, ov, diag, mem, history, k)  # type: ignore[return-value]

    best: Step | None = None
    frontier = [Step((), (), current, need(current), speed(job, current))]
    seen = {current.fingerprint()}
    for depth in range(policy.max_combined_rungs):
        nxt: list[Step] = []
        for step in frontier:
            for name in (first if depth == 0 else rest):
                if name in step.names:
                    continue
                for applied in expand(name, step.overrides):
                    ov = applied.overrides
                    fp = ov.fingerprint()
                    if fp in seen or fp in failed:
                        continue
                    seen.add(fp)
                    cand = Step((*step.names, name), (*step.applied, applied), ov, need(ov), speed(job, ov))
                    if cand.need <= limit_of(ov):
                        if best is None or (cand.speed, -len(cand.names)) > (best.speed, -len(best.names)):
                            best = cand
                    else:
                        nxt.append(cand)
        frontier = nxt
    return best


def describe(step: Step) -> str:
    return "; ".join(f"{n}: {a.what}" for n, a in zip(step.names, step.applied))


def expansions_for(job: JobContext, diag: Diagnosis, policy: Policy, mem: R.Memory,
                   fns: dict[str, Callable[..., Any]], kwargs_for: Callable[[str], dict[str, Any]]
                   ) -> Callable[[str, Overrides], list[R.Applied]]:
    """Each rung as the list of configurations it can lead to (micro_batch: every exact split)."""

    def expand(name: str, ov: Overrides) -> list[R.Applied]:
        if name == "micro_batch":
            out = []
            for target in R.micro_batch_options(job, ov, policy):
                r = fns[name](job, ov, diag, policy, mem, **kwargs_for(name), target=target)
                if isinstance(r, R.Applied):
                    out.append(r)
            return out
        r = fns[name](job, ov, diag, policy, mem, **kwargs_for(name))
        return [r] if isinstance(r, R.Applied) else []

    return expand
