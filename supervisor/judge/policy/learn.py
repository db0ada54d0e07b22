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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from supervisor.core.models import Category, Diagnosis, JobContext, Overrides
from supervisor.judge.policy import rungs as R
from supervisor.judge.policy import search as S
from supervisor.judge.policy.evidence import (
    Correction,
    Record,
    correction,
    evidence_margin,
    outweighed,
    records,
    tier,
    tier_of,
)
from supervisor.judge.policy.observed import (
    CONFIG_FIELDS,
    MARGINS,
    SETUP_MARGIN,
    TIER_WORDS,
    GiB,
    Observation,
    config_sig,
    corrected_gpu,
    memory_key,
    on_gpu,
    predict_gpu,
    predict_gpu_states,
    predict_host,
    setup_of,
)
from supervisor.judge.policy.schema import Policy

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
    # Observed at this longer cutoff_len, not this one (longer_fit): the bound its fit there gives.
    longer: int | None = None
    own: bool = False  # this job's own attempts fit it (it ran here, under this name)
    # What slows it that the speed estimate models, each larger = slower: -micro-batch,
    # checkpointing (off, on, in host RAM), optimizer offload, parameter offload (slowdowns()).
    slows: tuple[int, ...] = ()


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
    # A run with no GPU runs out of host memory only: a GPU OOM here would count as a GPU seen
    # (rungs.without_gpu) and let the GPU-only remedies (offload) in (issue 27 item 1).
    cat = Category.HOST_OOM if R.without_gpu(ctx) else Category.GPU_OOM
    diag, mem = Diagnosis(cat, "learned plan"), R.Memory()
    ladder = set(policy.ladder)
    bases = [Overrides()]
    if "grad_checkpointing" in ladder:  # on when off; else checkpoints in host RAM where allowed
        r = R.grad_checkpointing(ctx, Overrides(), diag, policy, mem, host_pressure=R.without_gpu(ctx))
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
        """The fastest candidate predicted to fit; never one slower than this job's own fit: a
        configuration that adds what the speed estimate only guesses at (checkpointing, an offload,
        a smaller micro-batch) replaces the job's own fit only when it is predicted SPEED_MARGIN
        faster."""
        ok = [c for c in self.candidates if c.fits]
        own = [c for c in ok if c.own]
        if own:
            floor = max(own, key=lambda c: c.speed)
            ok = [c for c in ok if c is floor or (c.speed > floor.speed and (
                all(a <= b for a, b in zip(c.slows, floor.slows)) or c.speed >= floor.speed * (1 + SPEED_MARGIN)))]
        return max(ok, key=lambda c: (c.speed, c.source == "observed", -len(c.overrides.rungs))) if ok else None

    @property
    def learned(self) -> bool:
        return bool(self.gpu.basis or self.host.basis)


# How much faster (search.speed) a start must be predicted than the job's own fit when it adds a
# slowdown that fit has not: the speed estimate's factors are leads (checkpointing 0.8 where
# recomputation costs 25%, one offload cost for every model size). bench_policy --nights, base,
# development part: night 2 cost more than night 1 for 4 jobs at 0 (6.6% and 0.75% predicted gains
# that were 6% and 26% losses), 0 at 0.10.
SPEED_MARGIN = 0.10


def slowdowns(ctx: JobContext, ov: Overrides) -> tuple[int, ...]:
    v = R.view_of(ctx, ov)
    gc = 0 if not v.gc_on else (2 if v.unsloth_gc else 1)
    return (-v.micro, gc, int(v.setup.offload_optimizer), int(v.setup.offload_param))


def margin_of(ctx: JobContext, c: Correction, resource: str) -> float:
    """A prediction's margin: the distance of the evidence (MARGINS, SETUP_MARGIN) plus what it has
    shown (evidence_margin: its error on this kind, and more with fewer fits). No fit under the
    candidate's ZeRO/offload setup: the estimator's own number, with SETUP_MARGIN and a single fit's
    margin where other setups were seen (their ratios are not carried; never less margin than a
    setup with evidence, which pushed starts to unseen setups), except on a GPU run's host
    (DeepSpeed's formula carries its 1.5x), and the lower bounds it rests on add theirs. A CPU
    run's host need is the whole training's estimate, which had no margin ("margin 0%", issue 27)."""
    if c.tier is None:
        setup = c.unseen_setup and (resource == "gpu" or not on_gpu(ctx))
        # No fit under its setup is the fewest observations there are: never less than one fit's.
        return (SETUP_MARGIN + evidence_margin(c, resource) if setup
                else evidence_margin(c, resource) if c.basis else 0.0)
    return MARGINS.get(c.tier, 0.0) + (0.0 if c.same_setup else SETUP_MARGIN) + evidence_margin(c, resource)


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
    other_seq = [o for o in observations if id(o) not in skip and tier(key, o.key) == "other_seq"]
    cands = []
    for ov in configurations(ctx, policy, fitted):
        ck = memory_key(ctx, ov)
        rec = own.get(config_sig(ck, ov)) or recs.get(config_sig(ck, ov))
        longer = None
        if rec is None:
            rec, longer = longer_fit(ck, ov, other_seq)
        sp = S.speed(ctx, ov)
        slows = slowdowns(ctx, ov)
        if rec is not None and not rec.fit:
            cands.append(Candidate(ov, label(ctx, ov), rec.peak("gpu"), rec.peak("host"), 0.0, "oom", False, sp,
                                   slows=slows))
            continue
        pg, ph = predict_gpu(ctx, ov), predict_host(ctx, ov)
        sig = setup_of(ck, ov)
        gc_ = correction(key, observations, "gpu", sig, skip=skip, job=job)
        hc_ = correction(key, observations, "host", sig, skip=skip, job=job)
        gpu = corrected_gpu(pg, predict_gpu_states(ctx, ov), gc_.k) if pg is not None else None
        host = int(ph * hc_.k) if ph is not None else None
        used = gc_ if gc_.basis else hc_

        m_gpu, m_host = margin_of(ctx, gc_, "gpu"), margin_of(ctx, hc_, "host")
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
        mine = own.get(config_sig(ck, ov))
        cands.append(Candidate(ov, label(ctx, ov), gpu, host, margin, source, fits, sp, used.k, longer,
                               own=mine is not None and mine.fit, slows=slows))
    return Prediction(tuple(cands), gpu_c, host_c, gpu_limit, host_limit, tuple(same), outside)


def longer_fit(ck: dict[str, Any], ov: Overrides,
               other_seq: Sequence[Observation]) -> tuple[Record | None, int | None]:
    """The same configuration of the same model seen to fit at a longer cutoff_len (and no shorter
    longest sample), weighed as records() weighs; with the closest such cutoff_len. Activations
    grow with the sequence and every sample is cut at cutoff_len, so that fit's peak bounds this
    configuration's: a job at a shorter cutoff_len starts where the longer one fit, where one
    factor on the estimator, raised by the longer run's OOMs, would put every split over the
    budget (issue 27: the demo at cutoff_len 1024 after 2048 climbed the ladder again). An OOM of
    this configuration at a cutoff_len between the two, not outweighed, contradicts it: no bound."""
    n = len(CONFIG_FIELDS)
    want = config_sig(ck, ov)
    seq = ck.get("seq_len") or ck.get("cutoff_len") or 0
    groups: dict[int, list[Observation]] = {}
    for o in other_seq:  # the same model at another sequence length (tier "other_seq"), not outweighed
        sig = config_sig(o.key, o.overrides)
        cut = o.key.get("cutoff_len") or 0
        if sig[:n] != want[:n] or sig[n + 1:] != want[n + 1:] or cut < (ck.get("cutoff_len") or 0):
            continue
        if o.outcome != "fit" or (o.key.get("seq_len") or cut) >= seq:
            groups.setdefault(cut, []).append(o)
    for cut in sorted(groups):
        rec = records(groups[cut]).get(config_sig(groups[cut][0].key, groups[cut][0].overrides))
        if rec is not None and not rec.fit:
            return None, None  # ran out at a cutoff_len between: no bound from a longer one
        if rec is not None and rec.fit:
            return rec, cut
    return None, None


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
    if choice.source == "observed" and choice.longer:
        cut = R.view_of(ctx, choice.overrides).cutoff
        peak = choice.gpu_need if choice.gpu_need is not None else choice.host_need
        basis = (f"observed to fit at cutoff_len {choice.longer} (peak {_gib(peak)}, the largest seen), which needs no "
                 f"less than cutoff_len {cut}; margin {choice.margin:.0%}")
    elif choice.source == "observed":
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
    info = account(ctx, policy, pred, choice)
    why = reason_for(ctx, pred, choice)
    if choice.source != "observed" and info.get("fallback_label"):
        why += f"; if it runs out of memory, back to {info['fallback_label']}, which fit {info['fallback_seen']}"
    return dataclasses.replace(choice.overrides, learned=info), why


def _seen(o: Observation) -> str:
    """'on 2026-12-06 (job lf-lora, attempt 4)': when and where a fit was seen."""
    import datetime

    where = f"job {o.job}, attempt {o.attempt}" if o.job else f"attempt {o.attempt}"
    if o.time < 1e9:  # no wall-clock time (a simulated or hand-made record)
        return f"({where})"
    day = datetime.datetime.fromtimestamp(o.time, datetime.timezone.utc).strftime("%Y-%m-%d")
    return f"on {day} ({where})"


def known_fit(ctx: JobContext, pred: Prediction, but: Candidate | None = None) -> tuple[Candidate, Observation] | None:
    """The configuration last observed to fit for this kind (same effective batch, allowed by the
    job's policy, still counted as fitting), other than `but`, with its newest fit."""
    best: tuple[Candidate, Observation] | None = None
    for c in pred.candidates:
        if c.source != "observed" or not c.fits or (but is not None and c.overrides.fingerprint() == but.overrides.fingerprint()):
            continue
        sig = config_sig(memory_key(ctx, c.overrides), c.overrides)
        fits = [o for o in pred.same_kind if o.outcome == "fit" and config_sig(o.key, o.overrides) == sig]
        if fits:
            o = max(fits, key=lambda o: o.time)
            if best is None or (o.time, c.speed) > (best[1].time, best[0].speed):
                best = (c, o)
    return best


def account(ctx: JobContext, policy: Policy, pred: Prediction, choice: Candidate) -> dict[str, Any]:
    """What a learned start carries for its own OOM (fallback.learned_fallback): its label, the
    configuration last seen to fit and when, and what learning added beyond the micro-batch split
    (and the split without it), to be taken away first."""
    out: dict[str, Any] = {"start": choice.label, "source": choice.source}
    fit = known_fit(ctx, pred, but=choice)
    if fit is not None:
        c, o = fit
        out.update(fallback=dataclasses.replace(c.overrides, learned=None).to_dict(), fallback_label=c.label,
                   fallback_seen=_seen(o))
    added = [r for r in choice.overrides.rungs if r != "micro_batch"]
    if added:
        v, user = R.view_of(ctx, choice.overrides), R.view_of(ctx, Overrides())
        base = Overrides()
        if v.micro != user.micro:
            r = R.micro_batch(ctx, Overrides(), Diagnosis(Category.HOST_OOM, "learned plan"), policy, R.Memory(),
                              target=v.micro)
            base = r.overrides if isinstance(r, R.Applied) else base
        out.update(added=added, without=base.to_dict())
    return out
