"""Learned plans: what earlier attempts really used corrects the estimator (pure, no I/O).

Why: the estimator alone is conservative (it over-predicts activations and runtime
overhead), so a policy trusting it starts too low, and it knows nothing of the box's real
overheads, so it can also start too high. Each finished attempt leaves an `Observation`:
the key that determines its memory, what it used (the hook's peak GPU file, peak host
RSS) and whether it fit. For a new job the observations of similar runs give a factor
k = observed / predicted (the same kind of job first, then the same model at another
sequence length, then a sibling model size), applied to the estimator's prediction of
each candidate configuration: k < 1 lowers it, k > 1 raises it. OOMs are lower bounds:
they only raise k. The job starts at the fastest configuration predicted to fit with a
margin that grows with the distance of the evidence (MARGINS).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from supervisor.core.models import Category, Diagnosis, JobContext, Overrides
from supervisor.judge.policy import rungs as R
from supervisor.judge.policy import search as S
from supervisor.judge.policy.estimate import Setup, model_states
from supervisor.judge.policy.schema import Policy

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
MARGINS = {"same_config": 0.0, "same_kind": 0.05, "other_versions": 0.08, "other_seq": 0.05,
           "sibling": 0.08}
# More margin when a candidate's setup (setup_of) differs from every fit the ratio came from.
SETUP_MARGIN = 0.10
TIER_ORDER = ("same_kind", "other_versions", "other_seq", "sibling")
TIER_WORDS = {"same_kind": "of this kind", "other_versions": "of this kind under other library versions",
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
        "cutoff_len": v.cutoff, "packing": bool(v.config.get("packing") or v.config.get("neat_packing")),
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
        "predicted_host": predict_host(ctx, ov), "job": job, "attempt": attempt, "time": time}
    if cat == Category.GPU_OOM and (diagnosis.numbers.get("held_by_others") or 0) >= GiB:
        return None  # other processes' memory: it says nothing about this configuration
    if cat == Category.GPU_OOM:
        lb = S._observed_demand(diagnosis, ctx.gpu_capacity_bytes)
        if lb is not None:
            lb -= diagnosis.numbers.get("reserved_unallocated") or 0  # what only the allocator returns
        cands = [x for x in (lb, peak.max_reserved if peak else None) if x]
        return Observation(outcome="gpu_oom", gpu_peak=max(cands) if cands else gpu_total,
                           host_peak=peak_rss_bytes, extra={"summary": diagnosis.summary}, **common)
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


# --- matching and correction ---------------------------------------------------------------

GPU_CAPACITY_TOLERANCE = 0.02  # probes differ (nvidia-smi MiB, sysfs, torch): 80 GiB vs 79.6 GiB is one GPU


def same_gpu(a: int | None, b: int | None) -> bool:
    """The same GPU capacity (both None: a CPU run), within the probes' rounding."""
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= GPU_CAPACITY_TOLERANCE * max(a, b)


def tier(target: Mapping[str, Any], seen: Mapping[str, Any]) -> str | None:
    """How close an observation's kind is to the job's: a TIER_ORDER name, or None (unrelated)."""
    a, b = kind_of(target), kind_of(seen)
    for f in ("finetuning_type", "world_size", "packing"):
        if a.get(f) != b.get(f):
            return None
    if not same_gpu(a.get("gpu_capacity"), b.get("gpu_capacity")):
        return None
    same_model = all(a.get(f) == b.get(f) for f in ("params", "hidden_size", "num_layers", "vocab_size"))
    if same_model and a.get("cutoff_len") == b.get("cutoff_len"):
        # An unknown version (plan, without probing the job's environment) is no difference.
        same = all(a.get(f) == b.get(f) or a.get(f) is None or b.get(f) is None for f in VERSION_FIELDS)
        return "same_kind" if same else "other_versions"
    if same_model:
        return "other_seq"
    if a.get("vocab_size") == b.get("vocab_size") and a.get("vocab_size"):
        return "sibling"
    return None


@dataclass(frozen=True)
class Correction:
    """The factor on the estimator for one resource and the observations it rests on."""

    k: float
    tier: str | None
    basis: tuple[Observation, ...]
    bounded_by_oom: bool = False
    same_setup: bool = False  # the ratio came from fits with the candidate's own setup


def _ratio(seen: int | None, pred: int | None) -> float | None:
    return seen / pred if seen and pred else None


def correction(target_key: Mapping[str, Any], observations: Sequence[Observation], resource: str,
               setup: tuple[Any, ...] | None = None) -> Correction:
    """k for "gpu" or "host": the closest tier with a fit gives the largest observed/predicted
    ratio of its fits (of those with `setup` when there are any: `same_setup`); an OOM of that
    resource in that or a closer tier raises k to its lower bound. Without any fit, OOMs
    alone may only raise it (k >= 1)."""
    peak, pred = f"{resource}_peak", f"predicted_{resource}"
    by_tier: dict[str, list[Observation]] = {}
    for o in observations:
        t = tier(target_key, o.key)
        if t is not None:
            by_tier.setdefault(t, []).append(o)
    ooms_seen: list[Observation] = []
    for t in TIER_ORDER:
        group = by_tier.get(t, [])
        ooms_seen += [o for o in group if o.outcome == f"{resource}_oom"]
        fits = [(o, _ratio(getattr(o, peak), getattr(o, pred))) for o in group if o.outcome == "fit"]
        fits = [(o, r) for o, r in fits if r is not None]
        if fits:
            alike = [(o, r) for o, r in fits if setup is not None and setup_of(o.key, o.overrides) == setup]
            fits = alike or fits
            k = max(r for _, r in fits)
            lbs = [(o, r) for o in ooms_seen if (r := _ratio(getattr(o, peak), getattr(o, pred))) is not None]
            raised = bool(lbs) and max(r for _, r in lbs) > k
            k = max([k, *(r for _, r in lbs)])
            return Correction(k, t, tuple(o for o, _ in fits) + tuple(o for o, _ in lbs), raised, bool(alike))
    lbs = [(o, r) for o in ooms_seen if (r := _ratio(getattr(o, peak), getattr(o, pred))) is not None]
    if lbs:
        return Correction(max(1.0, *(r for _, r in lbs)), None, tuple(o for o, _ in lbs), True)
    return Correction(1.0, None, ())


# --- choosing the first attempt's configuration ------------------------------------------

@dataclass(frozen=True)
class Candidate:
    overrides: Overrides
    label: str
    gpu_need: int | None  # corrected prediction (or the observed peak), bytes
    host_need: int | None
    margin: float
    source: str  # "observed" (ran and fit) | "oom" (ran out of memory) | "predicted"
    fits: bool
    speed: float
    k: float = 1.0  # the correction applied (1.0 for an observed one)


def label(ctx: JobContext, ov: Overrides) -> str:
    """`4x4`, `2x8 + ZeRO-3 optimizer offload`: the configuration in a few words."""
    v, user = R.view_of(ctx, ov), R.view_of(ctx, Overrides())
    extra = []
    if v.gc_on and not user.gc_on:
        extra.append("gradient checkpointing")
    if v.unsloth_gc and not user.unsloth_gc:
        extra.append("checkpoints in host RAM")
    if v.setup.zero_stage == 3 and v.setup != user.setup:
        extra.append("ZeRO-3 " + ("parameter+optimizer" if v.setup.offload_param else "optimizer") + " offload")
    if R.ALLOC_VARS[0] in ov.env and "allocator" in ov.rungs:
        extra.append("allocator tuning")
    if R.cap_fraction(ov) is not None:
        extra.append("memory cap")
    if v.cutoff != user.cutoff:
        extra.append(f"cutoff_len {v.cutoff}")
    return " + ".join([f"{v.micro}x{v.accum}", *extra])


def _same_batch(ctx: JobContext, ov: Overrides) -> bool:
    v, u = R.view_of(ctx, ov), R.view_of(ctx, Overrides())
    return v.micro * v.accum == u.micro * u.accum


def configurations(ctx: JobContext, policy: Policy, observed: Iterable[Overrides] = ()) -> list[Overrides]:
    """What a first attempt may start at: the job as submitted, each exact micro-batch split
    (the micro_batch rung's own code, so the effective batch stays the user's), with
    gradient checkpointing and ZeRO-3 offload where the ladder has them, and the
    configurations seen to fit for this same job."""
    diag, mem = Diagnosis(Category.GPU_OOM, "learned plan"), R.Memory()
    ladder = set(policy.ladder)
    bases = [Overrides()]
    if "grad_checkpointing" in ladder:  # on when off; else checkpoints in host RAM where allowed
        r = R.grad_checkpointing(ctx, Overrides(), diag, policy, mem)
        if isinstance(r, R.Applied):
            bases.append(r.overrides)
    for name in ("zero3_offload_optimizer", "zero3_offload_param"):
        if name in ladder:
            for b in list(bases):
                r = getattr(R, name)(ctx, b, diag, policy, mem, has_checkpoint=False)
                if isinstance(r, R.Applied):
                    bases.append(r.overrides)
    out = list(bases)
    if "micro_batch" in ladder:
        for b in bases:
            for t in R.micro_batch_options(ctx, b, policy):
                r = R.micro_batch(ctx, b, diag, policy, mem, target=t)
                if isinstance(r, R.Applied):
                    out.append(r.overrides)
    out += [o for o in observed if _same_batch(ctx, o)]
    seen, uniq = set(), []
    for o in out:
        if o.fingerprint() not in seen:
            seen.add(o.fingerprint())
            uniq.append(o)
    return uniq


@dataclass(frozen=True)
class Prediction:
    """Everything `plan` shows and initial_overrides decides from."""

    candidates: tuple[Candidate, ...]
    gpu: Correction
    host: Correction
    gpu_limit: int | None
    host_limit: int | None
    same_kind: tuple[Observation, ...]

    @property
    def chosen(self) -> Candidate | None:
        ok = [c for c in self.candidates if c.fits]
        return max(ok, key=lambda c: (c.speed, c.source == "observed", -len(c.overrides.rungs))) if ok else None

    @property
    def learned(self) -> bool:
        return bool(self.gpu.basis or self.host.basis)


def predict(ctx: JobContext, policy: Policy, observations: Sequence[Observation]) -> Prediction | None:
    """Every start configuration with its corrected need; None when the model shape is unknown."""
    if ctx.kind != "llamafactory" or S.base_need(ctx, Overrides()) is None:
        return None
    key = memory_key(ctx, Overrides())
    gpu_c, host_c = correction(key, observations, "gpu"), correction(key, observations, "host")
    same = [o for o in observations if tier(key, o.key) == "same_kind"]
    known = {Overrides.from_dict(o.overrides).fingerprint(): o for o in sorted(same, key=lambda o: o.time)}
    gpu_limit = int(ctx.gpu_capacity_bytes * (1 - policy.fit_headroom)) if on_gpu(ctx) else None
    budget = ctx.host_budget_bytes(policy.host_ram_reserve)
    host_limit = int(budget * (1 - policy.fit_headroom)) if budget else None
    fitted = [Overrides.from_dict(o.overrides) for o in same if o.outcome == "fit"]
    cands = []
    for ov in configurations(ctx, policy, fitted):
        seen = known.get(ov.fingerprint())
        sp = S.speed(ctx, ov)
        if seen is not None and seen.outcome != "fit":
            cands.append(Candidate(ov, label(ctx, ov), seen.gpu_peak, seen.host_peak, 0.0, "oom", False, sp))
            continue
        pg, ph = predict_gpu(ctx, ov), predict_host(ctx, ov)
        sig = setup_of(memory_key(ctx, ov), ov)
        gc_, hc_ = correction(key, observations, "gpu", sig), correction(key, observations, "host", sig)
        same_states = any(setup_of(o.key, o.overrides)[1:4] == sig[1:4] for o in hc_.basis if o.outcome == "fit")
        if hc_.basis and not same_states and not hc_.bounded_by_oom and on_gpu(ctx):
            # A GPU run's host use under one ZeRO/offload setup (a fixed base) says little about
            # offloaded states under another: the estimator's DeepSpeed formula stands there.
            hc_ = Correction(1.0, None, ())
        gpu = int(pg * gc_.k) if pg is not None else None
        host = int(ph * hc_.k) if ph is not None else None
        used = gc_ if gc_.basis else hc_

        def margin_of(c: Correction) -> float:
            """No basis: the estimator's own number (DeepSpeed's host formula carries its 1.5x)."""
            return MARGINS.get(c.tier or "", 0.0) + (0.0 if c.same_setup else SETUP_MARGIN) if c.basis else 0.0

        m_gpu, m_host = margin_of(gc_), margin_of(hc_)
        margin = m_gpu if pg is not None else m_host
        source = "predicted"
        g_lim, h_lim = gpu_limit, host_limit
        if seen is not None:
            # It ran to the end of its work: the whole GPU / budget is the limit it proved.
            gpu = seen.gpu_peak if seen.gpu_peak is not None else gpu
            host = seen.host_peak if seen.host_peak is not None else host
            margin = m_gpu = m_host = MARGINS["same_config"]
            source = "observed"
            g_lim = ctx.gpu_capacity_bytes if on_gpu(ctx) else None
            h_lim = budget or None
            if seen.host_limit and budget and budget >= seen.host_limit:
                # It ran under this limit (or a tighter one): its sampled RSS, which counts shared
                # pages an RLIMIT_DATA limit does not, may exceed the limit without meaning anything.
                h_lim = None
        fits = all(need is None or limit is None or need * (1 + m) <= limit
                   for need, limit, m in ((gpu, g_lim, m_gpu), (host, h_lim, m_host)))
        cands.append(Candidate(ov, label(ctx, ov), gpu, host, margin, source, fits, sp, used.k))
    return Prediction(tuple(cands), gpu_c, host_c, gpu_limit, host_limit, tuple(same))


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.2f} GiB"


def _what_ran(ctx: JobContext, obs: Sequence[Observation], chosen: Candidate | None = None) -> str:
    """'micro-batch 16 and 8 ran out of host memory, 4x4 fit (peak 1.32 GiB of 1.91 GiB)'."""
    key = memory_key(ctx, Overrides())

    def name(o: Observation) -> str:
        if tier(key, o.key) == "same_kind":
            return label(ctx, Overrides.from_dict(o.overrides))
        return f"{o.key.get('micro_batch')}x{o.key.get('grad_accum')}"

    def listed(items: list[str]) -> str:
        return " and ".join(items) if len(items) < 3 else ", ".join(items[:-1]) + " and " + items[-1]

    parts = []
    for outcome, words in (("gpu_oom", "ran out of GPU memory"), ("host_oom", "ran out of host memory")):
        names = list(dict.fromkeys(name(o) for o in obs if o.outcome == outcome))
        if names and all(" + " not in n for n in names):
            mbs = list(dict.fromkeys(str(o.key.get("micro_batch")) for o in obs if o.outcome == outcome))
            parts.append(f"micro-batch {listed(mbs)} {words}")
        elif names:
            parts.append(f"{listed(names)} {words}")
    fits = [o for o in obs if o.outcome == "fit"]
    if chosen is not None and chosen.source == "observed":
        fits = [o for o in fits if Overrides.from_dict(o.overrides).fingerprint() == chosen.overrides.fingerprint()] \
            or fits
    if fits:
        o = fits[-1]
        if o.gpu_peak is not None:
            parts.append(f"{name(o)} fit (peak {_gib(o.gpu_peak)} of {_gib(o.gpu_total)}"
                         + (f" on {o.gpu_name}" if o.gpu_name else "") + ")")
        else:
            parts.append(f"{name(o)} fit (peak {_gib(o.host_peak)}"
                         + (f" of {_gib(o.host_limit)}" if o.host_limit else "") + ")")
    return ", ".join(parts)


def reason_for(ctx: JobContext, pred: Prediction, choice: Candidate) -> str:
    corr = pred.gpu if pred.gpu.basis else pred.host
    obs = pred.same_kind or corr.basis
    where = TIER_WORDS.get(corr.tier or "same_kind", "") if not pred.same_kind else TIER_WORDS["same_kind"]
    head = f"learned: {len(obs)} attempt{'s' if len(obs) != 1 else ''} {where} on this box"
    ran = _what_ran(ctx, obs, choice)
    if choice.source == "observed":
        basis = "observed to fit"
    else:
        res = "GPU" if choice.gpu_need is not None else "host"
        need = choice.gpu_need if res == "GPU" else choice.host_need
        limit = pred.gpu_limit if res == "GPU" else pred.host_limit
        basis = (f"predicted ~{_gib(need)} of {_gib(limit)} usable {res} memory (estimator x{choice.k:.2f}, "
                 f"margin {choice.margin:.0%})")
    start = "the job as submitted" if not choice.overrides.rungs else choice.label
    return f"{head}: {ran}; starting at {start} ({basis})" if ran else f"{head}; starting at {start} ({basis})"


def initial_overrides(ctx: JobContext, policy: Policy,
                      observations: Sequence[Observation]) -> tuple[Overrides, str | None]:
    """The first attempt's configuration: Overrides() and no reason when nothing is known;
    else the fastest configuration known or predicted to fit (never a heavier one)."""
    pred = predict(ctx, policy, observations)
    if pred is None or not pred.learned:
        return Overrides(), None
    choice = pred.chosen
    if choice is None:
        return Overrides(), None  # nothing predicted to fit: the ladder (and infeasible()) take over
    ov = choice.overrides
    return ov, reason_for(ctx, pred, choice)


def infeasible(ctx: JobContext, policy: Policy, observations: Sequence[Observation]) -> str | None:
    """Why the box cannot run this job in any configuration the policy can reach, with
    numbers, or None. Judged on the (corrected) estimate without margin and against the
    whole GPU, so only a clear case is refused."""
    pred = predict(ctx, policy, observations)
    if pred is None:
        return None
    cap = ctx.gpu_capacity_bytes
    budget = ctx.host_budget_bytes(policy.host_ram_reserve)
    ok = []
    for c in pred.candidates:
        if c.source == "oom":
            continue
        if c.source == "observed":
            return None  # it ran
        gpu_ok = c.gpu_need is None or cap is None or c.gpu_need <= cap
        # HOST_BASE is a lead, not a measurement: uncorrected, only the states' formula refuses.
        host = c.host_need - HOST_BASE if c.host_need is not None and on_gpu(ctx) and c.k == 1.0 \
            and not pred.host.basis else c.host_need
        host_ok = host is None or budget is None or host <= budget
        ok.append((gpu_ok and host_ok, dataclasses.replace(c, host_need=host)))
    if not ok or any(f for f, _ in ok):
        return None
    lowest_gpu = min((c for _, c in ok if c.gpu_need is not None), key=lambda c: c.gpu_need or 0, default=None)
    lowest_host = min((c for _, c in ok if c.host_need is not None), key=lambda c: c.host_need or 0, default=None)
    parts = []
    if lowest_gpu is not None and cap:
        parts.append(f"the least GPU memory any reachable configuration needs is ~{_gib(lowest_gpu.gpu_need)} "
                     f"({lowest_gpu.label}, host ~{_gib(lowest_gpu.host_need)}) of the {_gib(cap)} GPU")
    if lowest_host is not None and budget and (lowest_host.host_need or 0) > budget:
        parts.append(f"the least host RAM is ~{_gib(lowest_host.host_need)} ({lowest_host.label}) of the "
                     f"~{_gib(budget)} the job may use ({R.host_budget_source(ctx, policy)})")
    if not any("ZeRO-3 parameter" in c.label for _, c in ok) and ctx.param_count:
        # The rung refused itself (its host need over the budget): say by how much.
        v = R.view_of(ctx, Overrides())
        lil = ctx.largest_layer_params or ctx.param_count // 40
        _, need = model_states(ctx.param_count, lil, ctx.launched_world_size(),
                               Setup(3, True, True, v.setup.trainable_fraction))
        parts.append(f"ZeRO-3 parameter offload would need ~{_gib(need)} host RAM")
    k = pred.gpu if pred.gpu.basis else pred.host
    basis = (f"estimator corrected x{k.k:.2f} by {len(k.basis)} observation(s)" if k.basis
             else "the estimator alone")
    return (f"cannot run on this box in any of the {len(ok)} configurations policy {policy.name!r} can reach "
            f"(micro-batch down to {policy.rungs.micro_batch.floor}, checkpointing, ZeRO-3 offload): "
            + "; ".join(parts) + f" [{basis}]")

