"""Refuse only the impossible (pure): every configuration the policy can reach fails even under
the most optimistic credible estimate, against the box's capacity (never what others hold now)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from supervisor.core.models import JobContext, Overrides
from supervisor.judge.policy import rungs as R
from supervisor.judge.policy import search as S
from supervisor.judge.policy.estimate import OPTIMISTIC_BUFFER, OPTIMISTIC_NAME, model_states
from supervisor.judge.policy.evidence import records, tier
from supervisor.judge.policy.learn import _gib, configurations, label
from supervisor.judge.policy.observed import Observation, config_sig, memory_key, on_gpu
from supervisor.judge.policy.schema import Policy


@dataclass(frozen=True)
class Bound:
    """One reachable configuration under the most optimistic credible estimate."""

    label: str
    gpu: int | None  # model states on the GPU (bytes), activations not counted
    host: int | None  # model states in host RAM, DeepSpeed's formula without its buffer factor
    gpu_ok: bool
    host_ok: bool


@dataclass(frozen=True)
class Refusal:
    """Why the box cannot run a job in any configuration its policy can reach: the optimistic
    bound it was judged on (`estimate`), the capacities and each configuration's numbers."""

    text: str
    estimate: str
    gpu_capacity: int | None
    host_capacity: int | None
    bounds: tuple[Bound, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "estimate": self.estimate, "gpu_capacity_bytes": self.gpu_capacity,
                "host_capacity_bytes": self.host_capacity, "configurations": [asdict(b) for b in self.bounds]}


def _optimistic(ctx: JobContext, ov: Overrides) -> tuple[int | None, int | None]:
    """(gpu, host) bytes of `ov` under the most optimistic credible estimate: model states by
    DeepSpeed's formulas without the buffer factor, no activations, no runtime overhead, no
    process base. On a CPU run everything is host RAM."""
    v = R.view_of(ctx, ov)
    lil = ctx.largest_layer_params or (ctx.param_count or 0) // 40
    gpu, host = model_states(ctx.param_count or 0, lil, ctx.launched_world_size(), v.setup, buffer=OPTIMISTIC_BUFFER)
    return (gpu, host) if on_gpu(ctx) else (None, gpu + host)


def refusal_bound(ctx: JobContext, policy: Policy, observations: Sequence[Observation]) -> Refusal | None:
    """The refusal of a job no configuration its policy can reach could run, or None (run it).

    A refusal is final, so it must be certain: every configuration the policy can reach on this
    box (offload included whatever the budget: rungs host_check="possible") must exceed the GPU or
    the host's capacity even under the most optimistic credible estimate (estimate.OPTIMISTIC_NAME),
    or have run out of memory here (weighed: OOM_ODDS); one seen to fit ends it. Capacity is the
    GPU and the job's host_memory_limit, else the box's RAM: what other processes hold at the
    moment is not counted (memory that others hold means wait, hostwait.py)."""
    if ctx.kind != "llamafactory" or S.base_need(ctx, Overrides()) is None:
        return None
    ctx = dataclasses.replace(ctx, host_used_by_others_bytes=None)
    key = memory_key(ctx, Overrides())
    recs = records([o for o in observations if tier(key, o.key) == "same_kind"])
    cap, host_cap = ctx.gpu_capacity_bytes, R.host_capacity(ctx)
    fitted = [Overrides.from_dict(r.fits[0].overrides) for r in recs.values() if r.fit]
    bounds: list[Bound] = []
    for ov in configurations(ctx, policy, fitted, host_check="possible"):
        rec = recs.get(config_sig(memory_key(ctx, ov), ov))
        if rec is not None and rec.fit:
            return None  # it ran
        gpu, host = _optimistic(ctx, ov)
        gpu_ok = gpu is None or cap is None or gpu <= cap
        host_ok = host is None or host_cap is None or host <= host_cap
        if rec is not None:
            # An OOM rules a configuration out only when it proves a demand beyond the capacity: one
            # below it may have been fragmentation or memory others held at the time (weather).
            gpu_ok = gpu_ok and not any(o.outcome == "gpu_oom" and cap and (o.gpu_peak or 0) > cap for o in rec.ooms)
            host_ok = host_ok and not any(o.outcome == "host_oom" and host_cap and (o.host_peak or 0) > host_cap
                                          for o in rec.ooms)
        bounds.append(Bound(label(ctx, ov), gpu, host, gpu_ok, host_ok))
    if not bounds or any(b.gpu_ok and b.host_ok for b in bounds):
        return None
    # An offload rung refuses itself only where even the unbuffered estimate is over the box: say so.
    for rung, param in (("zero3_offload_optimizer", False), ("zero3_offload_param", True)):
        if rung not in policy.ladder or any(("parameter" in b.label) == param and "ZeRO-3" in b.label for b in bounds):
            continue
        zero = {"stage": 3, "offload_optimizer": {"device": "cpu"},
                **({"offload_param": {"device": "cpu"}} if param else {})}
        p = Overrides(deepspeed={"zero_optimization": zero})
        gpu, host = _optimistic(ctx, p)
        bounds.append(Bound(label(ctx, p), gpu, host, gpu is None or cap is None or gpu <= cap,
                            host is None or host_cap is None or host <= host_cap))
    parts = []
    gpu_fit = [b for b in bounds if b.gpu_ok and b.host is not None]
    host_fit = [b for b in bounds if b.host_ok and b.gpu is not None]
    if gpu_fit and host_cap:
        b = min(gpu_fit, key=lambda b: b.host or 0)
        per = f", {(b.host or 0) / ctx.param_count:.0f} B/param" if ctx.param_count else ""
        where = "its host_memory_limit" if ctx.host_memory_limit_bytes else "the box's RAM"
        parts.append(f"the configurations that fit the {_gib(cap)} GPU need at least ~{_gib(b.host)} host RAM "
                     f"({b.label}{per}), more than the {_gib(host_cap)} of {where}")
    if host_fit and cap:
        b = min(host_fit, key=lambda b: b.gpu or 0)
        parts.append(f"those that fit the host RAM need at least ~{_gib(b.gpu)} of the {_gib(cap)} GPU ({b.label})")
    if not parts:
        least = min(bounds, key=lambda b: (b.gpu or 0, b.host or 0))
        parts.append(f"the least any reachable configuration needs is ~{_gib(least.gpu)} of the {_gib(cap)} GPU "
                     f"and ~{_gib(least.host)} host RAM of {_gib(host_cap)} ({least.label})")
    seen = [b for b in bounds if b.gpu_ok != (b.gpu is None or cap is None or b.gpu <= cap)
            or b.host_ok != (b.host is None or host_cap is None or b.host <= host_cap)]
    basis = (f"{len(seen)} of them ran out of memory here beyond the capacity" if seen else "the estimator alone")
    text = (f"cannot run on this box in any of the {len(bounds)} configurations policy {policy.name!r} can reach "
            f"(micro-batch down to {policy.rungs.micro_batch.floor}, checkpointing, ZeRO-3 offload), even under "
            f"the most optimistic credible estimate, {OPTIMISTIC_NAME}: " + "; ".join(parts)
            + f"; what other processes hold now is not counted [{basis}]")
    return Refusal(text, OPTIMISTIC_NAME, cap, host_cap, tuple(bounds))


def infeasible(ctx: JobContext, policy: Policy, observations: Sequence[Observation]) -> str | None:
    """refusal_bound's text, or None: the job is tried, and what really happens is learned."""
    r = refusal_bound(ctx, policy, observations)
    return r.text if r is not None else None
