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

Rules the choice keeps:
  * Every candidate gets its own correction: the estimator's error depends on the setup
    (checkpointing, ZeRO stage, offload), so the ratio of fits under the candidate's own setup
    is carried first (this job's kind, then another cutoff_len, then a sibling size), and a
    ratio from another setup only with SETUP_MARGIN more. The start is the fastest candidate
    predicted to fit: a configuration is never chosen over a faster one just because it was
    seen to fit.
  * Only configurations the job's OWN policy can reach are candidates (`allowed`): what a job
    under another policy learned is evidence about memory, never a licence.
  * Observations are weighed, not newest-wins: a configuration counts as fitting while its fits
    outnumber its OOMs OOM_ODDS to 1, and an OOM outweighed so does not raise the correction.
    An OOM whose peak is unknown (no numbers, no peak file) is recorded without a peak.
  * The training set's longest sample (when the edge knows it) sizes activations without
    packing, and is part of the key: another dataset at the same cutoff_len is "other_seq".
  * A refusal (`refusal_bound`) needs every reachable configuration to fail even under the most
    optimistic credible estimate (estimate.OPTIMISTIC_NAME), against the box's capacity: host RAM
    other processes hold is weather (hostwait.py), never a reason to refuse or change the job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from supervisor.core.models import Category, Diagnosis, JobContext, Overrides
from supervisor.judge.policy import rungs as R
from supervisor.judge.policy import search as S
from supervisor.judge.policy.estimate import OPTIMISTIC_BUFFER, OPTIMISTIC_NAME, model_states
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
    same_seq = (a.get("cutoff_len") == b.get("cutoff_len")
                and a.get("seq_len", a.get("cutoff_len")) == b.get("seq_len", b.get("cutoff_len")))
    if same_model and same_seq:
        # An unknown version (plan, without probing the job's environment) is no difference.
        same = all(a.get(f) == b.get(f) or a.get(f) is None or b.get(f) is None for f in VERSION_FIELDS)
        return "same_kind" if same else "other_versions"
    if same_model:
        return "other_seq"
    if a.get("vocab_size") == b.get("vocab_size") and a.get("vocab_size"):
        return "sibling"
    return None


def tier_of(target: Mapping[str, Any], o: Observation, job: str | None = None) -> str | None:
    """tier(), with "same_job" for an observation of this kind under the job's own name."""
    t = tier(target, o.key)
    return "same_job" if t == "same_kind" and job and o.job == job else t


@dataclass(frozen=True)
class Correction:
    """The factor on the estimator for one resource and the observations it rests on."""

    k: float
    tier: str | None
    basis: tuple[Observation, ...]
    bounded_by_oom: bool = False
    same_setup: bool = False  # the ratio came from fits with the candidate's own setup
    unseen_setup: bool = False  # jobs of this kind were seen, none under the candidate's ZeRO/offload setup


def _ratio(seen: int | None, pred: int | None) -> float | None:
    return seen / pred if seen and pred else None


def observed_ratio(o: Observation, resource: str) -> float | None:
    """observed / predicted for one observation. GPU: of the part beyond model states (what the
    estimator guesses: activations, overhead, buffers), None for rows without the split."""
    if resource == "gpu":
        if o.predicted_gpu_states is None or not o.gpu_peak or not o.predicted_gpu:
            return None
        fixed = min(o.predicted_gpu_states, o.predicted_gpu)
        rest = o.predicted_gpu - fixed
        return max(0.0, o.gpu_peak - fixed) / rest if rest > 0 else None
    return _ratio(o.host_peak, o.predicted_host)


# A configuration counts as fitting while it fit at least this many times per OOM: one OOM (a long
# batch, a neighbour's burst) among many fits does not mark it "oom" for the kind forever.
OOM_ODDS = 2


def _config_id(o: Observation) -> tuple[Any, ...]:
    kind = tuple(sorted((k, str(v)) for k, v in kind_of(o.key).items() if k != "gpu_capacity"))
    return kind, config_sig(o.key, o.overrides)


def outweighed(observations: Sequence[Observation]) -> frozenset[int]:
    """ids of the OOMs whose own configuration (same kind) fit at least OOM_ODDS times per OOM."""
    groups: dict[tuple[Any, ...], list[Observation]] = {}
    for o in observations:
        groups.setdefault(_config_id(o), []).append(o)
    out: set[int] = set()
    for g in groups.values():
        ooms = [o for o in g if o.outcome != "fit"]
        if ooms and sum(1 for o in g if o.outcome == "fit") >= OOM_ODDS * len(ooms):
            out.update(id(o) for o in ooms)
    return frozenset(out)


def correction(target_key: Mapping[str, Any], observations: Sequence[Observation], resource: str,
               setup: tuple[Any, ...] | None = None, *, skip: frozenset[int] | None = None,
               job: str | None = None) -> Correction:
    """k for "gpu" or "host" of a candidate with `setup` (setup_of; None: any setup).

    The estimator's error is a property of the setup (which formula), so a ratio is carried
    across tiers before it is carried across setups, and never across ZeRO/offload setups:
    1. the closest tier with fits under the candidate's own setup: their largest
       observed/predicted ratio (`same_setup`);
    2. else the closest tier with fits under its ZeRO/offload setup (other checkpointing,
       allocator tuning or cap: the caller adds SETUP_MARGIN);
    3. else no fit says anything about its states: the estimator alone, raised by OOM lower
       bounds under its ZeRO/offload setup (`unseen_setup` when others were seen). A ratio seen
       with parameter offload, where states are small and unmodelled buffers dominate, carried to
       a configuration without offload would start a 14B LoRA at parameter offload for nothing.
    An OOM raises k to its lower bound when its tier is no farther than the fits' and its setup
    is as close; OOMs outweighed by fits of their own configuration (`skip`) never do."""
    skip = outweighed(observations) if skip is None else skip
    by_tier: dict[str, list[Observation]] = {}
    for o in observations:
        t = tier_of(target_key, o, job)
        if t is not None:
            by_tier.setdefault(t, []).append(o)

    def ratios(obs: Iterable[Observation]) -> list[tuple[Observation, float]]:
        return [(o, r) for o in obs if (r := observed_ratio(o, resource)) is not None]

    def near(o: Observation, level: str) -> bool:
        if level == "any":
            return True
        seen = setup_of(o.key, o.overrides)
        return seen == setup if level == "setup" else seen[1:4] == setup[1:4]  # type: ignore[index]

    levels = ("setup", "states") if setup is not None else ("any",)
    for level in levels:
        for i, t in enumerate(TIER_ORDER):
            fits = ratios(o for o in by_tier.get(t, []) if o.outcome == "fit" and near(o, level))
            if not fits:
                continue
            k = max(r for _, r in fits)
            lbs = ratios(o for tt in TIER_ORDER[:i + 1] for o in by_tier.get(tt, [])
                         if o.outcome == f"{resource}_oom" and id(o) not in skip and near(o, level))
            raised = bool(lbs) and max(r for _, r in lbs) > k
            k = max([k, *(r for _, r in lbs)])
            return Correction(k, t, tuple(o for o, _ in fits) + tuple(o for o, _ in lbs), raised, level == "setup")
    level = levels[-1]
    lbs = ratios(o for t in TIER_ORDER for o in by_tier.get(t, [])
                 if o.outcome == f"{resource}_oom" and id(o) not in skip and near(o, level))
    unseen = setup is not None and any(by_tier.values())
    if lbs:
        return Correction(max(1.0, *(r for _, r in lbs)), None, tuple(o for o, _ in lbs), True, unseen_setup=unseen)
    return Correction(1.0, None, (), unseen_setup=unseen)


@dataclass(frozen=True)
class Record:
    """Every attempt of one configuration of this job's kind, weighed (not newest-wins)."""

    fits: tuple[Observation, ...]
    ooms: tuple[Observation, ...]

    @property
    def fit(self) -> bool:
        return bool(self.fits) and len(self.fits) >= OOM_ODDS * len(self.ooms)

    def peak(self, resource: str) -> int | None:
        """A fit's: the largest peak it was seen at; an OOM's: the largest lower bound."""
        vals = [getattr(o, f"{resource}_peak") for o in (self.fits if self.fit else self.ooms)]
        return max([v for v in vals if v is not None], default=None)

    @property
    def host_limit(self) -> int | None:
        """The tightest host limit it fit under."""
        return min([o.host_limit for o in self.fits if o.host_limit], default=None)


def records(same_kind: Sequence[Observation]) -> dict[tuple[Any, ...], Record]:
    """config_sig -> Record, over observations of this job's own kind."""
    fits: dict[tuple[Any, ...], list[Observation]] = {}
    ooms: dict[tuple[Any, ...], list[Observation]] = {}
    for o in same_kind:
        (fits if o.outcome == "fit" else ooms).setdefault(config_sig(o.key, o.overrides), []).append(o)
    return {sig: Record(tuple(fits.get(sig, ())), tuple(ooms.get(sig, ()))) for sig in {*fits, *ooms}}


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


def allowed(ctx: JobContext, policy: Policy, ov: Overrides) -> bool:
    """Whether the job's OWN policy can reach `ov` from the job as submitted: each thing it changes
    needs the rung that changes it on the ladder (and within that rung's settings). A job under
    `conservative` never starts at a batch split another job's policy allowed."""
    ladder = set(policy.ladder)
    v, u = R.view_of(ctx, ov), R.view_of(ctx, Overrides())
    need: set[str] = set()
    if (v.micro, v.accum) != (u.micro, u.accum):
        if v.micro * v.accum != u.micro * u.accum or v.micro < policy.rungs.micro_batch.floor:
            return False
        need.add("micro_batch")
    if v.gc_on != u.gc_on or v.unsloth_gc != u.unsloth_gc:
        if not v.gc_on or (v.unsloth_gc != u.unsloth_gc
                           and not (v.unsloth_gc and policy.rungs.grad_checkpointing.allow_unsloth_gc)):
            return False  # no rung turns checkpointing (or checkpoints in host RAM) off
        need.add("grad_checkpointing")
    if v.setup != u.setup:
        if v.setup.zero_stage != 3 or not v.setup.offload_optimizer:
            return False
        need.add("zero3_offload_param" if v.setup.offload_param else "zero3_offload_optimizer")
    if v.cutoff != u.cutoff:
        if v.cutoff > u.cutoff or not policy.allow_data_changes:
            return False
        need.add("cutoff_len")
    if v.eval_batch != u.eval_batch:
        need.add("eval_batch")
    if set(v.ours_alloc) - {"per_process_memory_fraction"}:
        need.add("allocator")
    if R.cap_fraction(ov) is not None or "vllm_gpu_util" in ov.yaml:
        need.add("memory_fraction")
    return need <= ladder


def configurations(ctx: JobContext, policy: Policy, observed: Iterable[Overrides] = (),
                   host_check: str = "budget") -> list[Overrides]:
    """What a first attempt may start at: the job as submitted, each exact micro-batch split
    (the micro_batch rung's own code, so the effective batch stays the user's), with
    gradient checkpointing and ZeRO-3 offload where the ladder has them, and the
    configurations seen to fit for this kind that the job's own policy allows. `host_check`
    is the offload rungs' (rungs._zero3): "possible" for every configuration the policy could
    ever reach on this box (what a refusal must rule out)."""
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
                r = getattr(R, name)(ctx, b, diag, policy, mem, has_checkpoint=False, host_check=host_check)
                if isinstance(r, R.Applied):
                    bases.append(r.overrides)
    out = list(bases)
    if "micro_batch" in ladder:
        for b in bases:
            for t in R.micro_batch_options(ctx, b, policy):
                r = R.micro_batch(ctx, b, diag, policy, mem, target=t)
                if isinstance(r, R.Applied):
                    out.append(r.overrides)
    out += [o for o in observed if _same_batch(ctx, o) and allowed(ctx, policy, o)]
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
    # GPU memory kept free in predictions for allocations outside PyTorch's allocator (a library's
    # workspace), when jobs of this kind ran out there: peaks the hook measures do not count them.
    outside_room: int = 0

    @property
    def chosen(self) -> Candidate | None:
        ok = [c for c in self.candidates if c.fits]
        return max(ok, key=lambda c: (c.speed, c.source == "observed", -len(c.overrides.rungs))) if ok else None

    @property
    def learned(self) -> bool:
        return bool(self.gpu.basis or self.host.basis)


def predict(ctx: JobContext, policy: Policy, observations: Sequence[Observation]) -> Prediction | None:
    """Every start configuration with its corrected need; None when the model shape is unknown.
    Judged against the job's budget on this box, not against what other processes hold now."""
    if ctx.kind != "llamafactory" or S.base_need(ctx, Overrides()) is None:
        return None
    ctx = dataclasses.replace(ctx, host_used_by_others_bytes=None)  # weather: hostwait.py
    key = memory_key(ctx, Overrides())
    skip = outweighed(observations)
    job = ctx.name or None
    gpu_c = correction(key, observations, "gpu", skip=skip, job=job)
    host_c = correction(key, observations, "host", skip=skip, job=job)
    same = [o for o in observations if tier(key, o.key) == "same_kind"]
    # The job's own attempts decide for a configuration they ran; else all of its kind, weighed.
    own, recs = records([o for o in same if job and o.job == job]), records(same)
    gpu_limit = int(ctx.gpu_capacity_bytes * (1 - policy.fit_headroom)) if on_gpu(ctx) else None
    outside = 0
    if gpu_limit and any(o.extra.get("outside_pytorch") for o in observations if tier_of(key, o, job)):
        # As much as the memory_fraction rung leaves them: what such an OOM needs outside PyTorch.
        outside = int((1 - policy.rungs.memory_fraction.fraction) * ctx.gpu_capacity_bytes)
        gpu_limit -= outside
    budget = R.host_budget(ctx, policy)
    host_limit = int(budget * (1 - policy.fit_headroom)) if budget else None
    fitted = [Overrides.from_dict(o.overrides) for o in same if o.outcome == "fit"]
    cands = []
    for ov in configurations(ctx, policy, fitted):
        ck = memory_key(ctx, ov)
        rec = own.get(config_sig(ck, ov)) or recs.get(config_sig(ck, ov))
        sp = S.speed(ctx, ov)
        if rec is not None and not rec.fit:
            cands.append(Candidate(ov, label(ctx, ov), rec.peak("gpu"), rec.peak("host"), 0.0, "oom", False, sp))
            continue
        pg, ph = predict_gpu(ctx, ov), predict_host(ctx, ov)
        sig = setup_of(ck, ov)
        gc_ = correction(key, observations, "gpu", sig, skip=skip, job=job)
        hc_ = correction(key, observations, "host", sig, skip=skip, job=job)
        gpu = corrected_gpu(pg, predict_gpu_states(ctx, ov), gc_.k) if pg is not None else None
        host = int(ph * hc_.k) if ph is not None else None
        used = gc_ if gc_.basis else hc_

        def margin_of(c: Correction, resource: str) -> float:
            """By the distance of the evidence. No fit under the candidate's ZeRO/offload setup: the
            estimator's own number, with SETUP_MARGIN on the GPU where other setups were seen (their
            ratios are not carried); on the host none (DeepSpeed's formula carries its 1.5x)."""
            if c.tier is None:
                return SETUP_MARGIN if c.unseen_setup and resource == "gpu" else 0.0
            return MARGINS.get(c.tier, 0.0) + (0.0 if c.same_setup else SETUP_MARGIN)

        m_gpu, m_host = margin_of(gc_, "gpu"), margin_of(hc_, "host")
        margin = m_gpu if pg is not None else m_host
        source = "predicted"
        g_lim, h_lim = gpu_limit, host_limit
        cap_f = R.cap_fraction(ov)
        if g_lim is not None and cap_f is not None:
            # Under a memory cap PyTorch gets that share of the GPU and the rest stays free.
            g_lim = min(g_lim + outside, int(cap_f * ctx.gpu_capacity_bytes))
        if rec is not None:
            # It ran to the end of its work: the whole GPU / budget is the limit it proved.
            gpu = rec.peak("gpu") if rec.peak("gpu") is not None else gpu
            host = rec.peak("host") if rec.peak("host") is not None else host
            margin = m_gpu = m_host = MARGINS["same_config"]
            source = "observed"
            g_lim = ctx.gpu_capacity_bytes if on_gpu(ctx) else None
            h_lim = budget or None
            if rec.host_limit and budget and budget >= rec.host_limit:
                # It ran under this limit (or a tighter one): its sampled RSS, which counts shared
                # pages an RLIMIT_DATA limit does not, may exceed the limit without meaning anything.
                h_lim = None
        fits = all(need is None or limit is None or need * (1 + m) <= limit
                   for need, limit, m in ((gpu, g_lim, m_gpu), (host, h_lim, m_host)))
        cands.append(Candidate(ov, label(ctx, ov), gpu, host, margin, source, fits, sp, used.k))
    return Prediction(tuple(cands), gpu_c, host_c, gpu_limit, host_limit, tuple(same), outside)


def host_need(ctx: JobContext, policy: Policy, ov: Overrides, observations: Sequence[Observation] = ()) -> int | None:
    """Host RAM the configuration `ov` is expected to use (bytes): what it was seen to use when it
    fit before (this kind), else the estimator corrected by host observations, else DeepSpeed's
    buffered estimate of offloaded states plus HOST_BASE; None when unknown (no model shape)."""
    pred = predict(ctx, policy, observations)
    key = memory_key(ctx, ov)
    if pred is not None:
        for c in pred.candidates:
            if c.source != "oom" and config_sig(memory_key(ctx, c.overrides), c.overrides) == config_sig(key, ov):
                return c.host_need
    ph = predict_host(ctx, ov)
    if ph is None:
        return None
    k = correction(memory_key(ctx, Overrides()), observations, "host", setup_of(key, ov)).k if observations else 1.0
    return int(ph * max(1.0, k))


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
        sig = config_sig(memory_key(ctx, chosen.overrides), chosen.overrides)
        fits = [o for o in fits if config_sig(o.key, o.overrides) == sig] or fits
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
        what = "estimator x" if res == "host" else "estimator: model states + activations and overhead x"
        kept = (f", {_gib(pred.outside_room)} kept free for memory outside PyTorch's allocator, which jobs of this "
                "kind ran out of" if res == "GPU" and pred.outside_room else "")
        basis = (f"predicted ~{_gib(need)} of {_gib(limit)} usable {res} memory{kept} ({what}{choice.k:.2f}, "
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
