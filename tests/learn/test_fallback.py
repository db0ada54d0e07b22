"""Issue 27 items 3 and 4: the second night is never worse than the first.

Night 1 of a LoRA job on a CPU-only box under a 2 GB host_memory_limit found 3x8 fit (24, 12, 6
ran out of host memory). Night 2 started at a cheaper learned configuration (24x1 + ZeRO-3 optimizer
offload, "estimator x1.00, margin 0%"), ran out, then cut the micro-batch under the offload until
it failed: 3x8 was never tried again, and the failure said the model states need "~0.00 GiB"."""

from __future__ import annotations

import dataclasses
import json
import re

from supervisor.core.models import AttemptRecord, DecisionKind, ExitRecord, JobContext, Overrides
from supervisor.judge.policy import evidence as LE
from supervisor.judge.policy import learn as L
from supervisor.judge.policy import observed as LO
from supervisor.judge.policy import rungs as R
from supervisor.judge.policy.decide import decide

from .builders import POLICY, GiB, cpu_job, fit_gpu, gpu_job, gpu_oom, host_oom, split


def lora_cpu(micro: int = 24, accum: int = 1) -> JobContext:
    c = cpu_job(micro, accum, limit_gib=2.0)
    return dataclasses.replace(c, name="lf-lora", config={**c.config, "finetuning_type": "lora"})


def host_attempt(ctx: JobContext, ov: Overrides, n: int) -> tuple[bool, LO.Observation]:
    """The CPU box's truth: micro-batch 3 and below fit (at 0.9 GiB), whatever else is set."""
    ok = R.view_of(ctx, ov).micro <= 3
    return ok, LO.observation(ctx, ov, None if ok else host_oom(), succeeded=ok,
                              peak_rss_bytes=int(0.9 * GiB) if ok else 2 * GiB,
                              memory_limit_bytes=ctx.host_memory_limit_bytes, max_step=30 if ok else 0,
                              job=ctx.name, attempt=n, time=float(n))


def gpu_attempt(ctx: JobContext, ov: Overrides, n: int) -> tuple[bool, LO.Observation]:
    """A 24 GiB GPU's truth: micro-batch 4 and below fit (at 12 GiB), 8 and above run out."""
    cap = ctx.gpu_capacity_bytes
    if R.view_of(ctx, ov).micro <= 4:
        return True, dataclasses.replace(fit_gpu(ctx, ov, 12 * GiB, n=n), job=ctx.name)
    return False, LO.observation(ctx, ov, gpu_oom(cap, cap - GiB, 2 * GiB), succeeded=False, job=ctx.name,
                                 attempt=n, time=float(n))


def night(ctx: JobContext, start: Overrides, attempt=host_attempt, first: int = 1) -> tuple[list, list]:
    """Attempts until one fits or the policy stops: (labels tried, observations they leave)."""
    tried, left, history, ov = [], [], [], start
    for n in range(first, first + 12):
        tried.append(L.label(ctx, ov))
        ok, o = attempt(ctx, ov, n)
        left.append(o)
        if ok:
            return tried, left
        diag = host_oom() if attempt is host_attempt else gpu_oom(ctx.gpu_capacity_bytes,
                                                                  ctx.gpu_capacity_bytes - GiB, 2 * GiB)
        history.append(AttemptRecord(n - first + 1, ov, diag, ExitRecord(1)))
        d = decide(ctx, history, diag, POLICY)
        if d.kind != DecisionKind.ESCALATE:
            return [*tried, f"FAILED: {d.reason}"], left
        ov = d.overrides
    return [*tried, "LOOP"], left


def test_a_failed_learned_start_goes_back_to_the_configuration_that_fit():
    """Night 1 climbed to 3x8; its OOMs left no numbers (the kernel's OOM killer, nothing sampled),
    so the one fit says the estimator is high and night 2 starts cheaper. That start ran out and
    the ladder halved its micro-batch (8x3, 4x6, 2x12): a night longer than the first, ending
    slower than what fit. The next attempt is the night-1 fit, and night 2 ends no later."""
    ctx = lora_cpu()
    tried1, obs = night(ctx, Overrides())
    assert tried1 == ["24x1", "12x2", "6x4", "3x8"]
    obs = [o if o.outcome == "fit" else dataclasses.replace(o, host_peak=None) for o in obs]
    start, why = L.initial_overrides(ctx, POLICY, obs)
    assert R.view_of(ctx, start).micro > 3, why  # cheaper than what fit, and wrong
    assert why.endswith("; if it runs out of memory, back to 3x8, which fit (job lf-lora, attempt 4)"), why
    # The account travels with the attempt's recorded overrides (the daemon stores to_dict()).
    start = Overrides.from_dict(json.loads(json.dumps(start.to_dict())))
    assert start.learned["fallback_label"] == "3x8"
    assert start.fingerprint() == dataclasses.replace(start, learned=None).fingerprint()  # not the configuration
    tried2, obs2 = night(ctx, start, first=len(obs) + 1)
    assert tried2 == [L.label(ctx, start), "3x8"], tried2
    assert len(tried2) <= len(tried1), (tried1, tried2)
    # Night 3 does not take the failed start again.
    again, why = L.initial_overrides(ctx, POLICY, [*obs, *obs2])
    assert again.fingerprint() != start.fingerprint(), why


def test_a_learned_start_never_keeps_what_it_added_while_the_micro_batch_is_cut():
    """The issue's night 2 kept ZeRO-3 offload while cutting the micro-batch 12, 6, 3, 1 and failed."""
    ctx = lora_cpu()
    tried1, obs = night(ctx, Overrides())
    assert tried1 == ["24x1", "12x2", "6x4", "3x8"]
    start, _why = L.initial_overrides(ctx, POLICY, obs)
    tried2, _ = night(ctx, start, first=5)
    assert not any("offload" in t for t in tried2), tried2
    assert tried2[-1] == "3x8" and len(tried2) <= len(tried1), tried2


def test_the_fallback_is_said_in_the_decisions_words_and_takes_away_what_learning_added():
    ctx = gpu_job(micro=16, cap_gib=24)
    cap = ctx.gpu_capacity_bytes
    obs = [LO.observation(ctx, Overrides(), gpu_oom(cap, cap - GiB, 2 * GiB), succeeded=False, job="earlier",
                          attempt=1, time=1.0),
           fit_gpu(ctx, split(ctx, 4), 12 * GiB, n=2)]
    start, _ = L.initial_overrides(ctx, POLICY, obs)
    assert R.view_of(ctx, start).micro == 8
    # As if learning had also added checkpointing: it goes with the rest, never kept under a cut.
    gc = R.grad_checkpointing(ctx, start, gpu_oom(cap, cap - GiB, 2 * GiB), POLICY, R.Memory())
    assert isinstance(gc, R.Applied)
    added = dataclasses.replace(gc.overrides, learned=start.learned)
    for ov in (start, added):
        d = decide(ctx, [AttemptRecord(1, ov, gpu_oom(cap, cap - GiB, 2 * GiB), ExitRecord(1))],
                   gpu_oom(cap, cap - GiB, 2 * GiB), POLICY)
        assert d.kind == DecisionKind.ESCALATE and d.overrides.fingerprint() == split(ctx, 4).fingerprint(), d
        assert d.reason.startswith(f"the learned start {L.label(ctx, ov)} ran out of GPU memory; back to 4x4, "
                                   "which fit (job earlier, attempt 2"), d.reason
        assert d.overrides.learned is None  # the fallback is no learned start: its own OOM climbs the ladder
        keys = {c.key for c in d.changes}
        assert "per_device_train_batch_size" in keys
        assert ov is start or "use_unsloth_gc" in keys
    # A real record's time is said as the night's date.
    dated = [obs[0], dataclasses.replace(obs[1], time=1796594400.0)]
    dated_start, _ = L.initial_overrides(ctx, POLICY, dated)
    d = decide(ctx, [AttemptRecord(1, dated_start, gpu_oom(cap, cap - GiB, 2 * GiB), ExitRecord(1))],
               gpu_oom(cap, cap - GiB, 2 * GiB), POLICY)
    assert "back to 4x4, which fit on 2026-12-06 (job earlier, attempt 2)" in d.reason, d.reason
    # No fit known: what learning added goes first, and the ladder cuts the split without it.
    alone = dataclasses.replace(added, learned={"start": "8x2 + checkpoints in host RAM", "source": "predicted",
                                                "added": ["grad_checkpointing"],
                                                "without": split(ctx, 8).to_dict()})
    d = decide(ctx, [AttemptRecord(1, alone, gpu_oom(cap, cap - GiB, 2 * GiB), ExitRecord(1))],
               gpu_oom(cap, cap - GiB, 2 * GiB), POLICY)
    assert d.kind == DecisionKind.ESCALATE and not R.view_of(ctx, d.overrides).unsloth_gc, d
    assert R.view_of(ctx, d.overrides).micro < 8, d
    assert "what learning added (grad_checkpointing) is taken away first" in d.reason, d.reason


def test_a_recorded_fit_that_no_longer_fits_is_not_chosen_again_and_the_ladder_goes_on():
    ctx = lora_cpu()
    _, obs = night(ctx, Overrides())
    start, _ = L.initial_overrides(ctx, POLICY, obs)
    start = split(ctx, 4)  # as if learning had taken 4x6
    # Night 2: the learned start ran out; recorded, no later learned start takes it again.
    bad = LO.observation(ctx, start, host_oom(), succeeded=False, peak_rss_bytes=2 * GiB,
                         memory_limit_bytes=ctx.host_memory_limit_bytes, job=ctx.name, attempt=5, time=5.0)
    again, why = L.initial_overrides(ctx, POLICY, [*obs, bad])
    assert again.fingerprint() != start.fingerprint(), why
    # And where the known fit itself ran out (the box changed), nothing is pretended: the ladder.
    fit_only = split(ctx, 3)
    fallen = LO.observation(ctx, fit_only, host_oom(), succeeded=False, peak_rss_bytes=2 * GiB,
                            memory_limit_bytes=ctx.host_memory_limit_bytes, job=ctx.name, attempt=6, time=6.0)
    d = decide(ctx, [AttemptRecord(1, fit_only, host_oom(), ExitRecord(1))], host_oom(), POLICY)
    assert d.kind == DecisionKind.ESCALATE and R.view_of(ctx, d.overrides).micro < 3, d
    assert L.initial_overrides(ctx, POLICY, [*obs, bad, fallen])[0].fingerprint() != fit_only.fingerprint()


# --- item 4: the margin comes from the evidence ------------------------------------------------

def _gpu_fits(ctx: JobContext, micros_and_ratios) -> list[LO.Observation]:
    """Fits whose observed/predicted ratio (of the non-state part) is the given one."""
    out = []
    for n, (micro, ratio) in enumerate(micros_and_ratios, 1):
        ov = split(ctx, micro)
        pred, states = LO.predict_gpu(ctx, ov), LO.predict_gpu_states(ctx, ov)
        peak = LO.corrected_gpu(pred, states, ratio)
        out.append(dataclasses.replace(fit_gpu(ctx, ov, peak, n=n), job=f"j{n}"))
    return out


def test_one_observation_gives_a_real_margin_and_agreeing_ones_a_smaller_one():
    ctx = gpu_job(micro=16, cap_gib=80)
    key = LO.memory_key(ctx, Overrides())
    one = _gpu_fits(ctx, [(4, 0.6)])
    four = _gpu_fits(ctx, [(4, 0.6), (2, 0.6), (8, 0.6), (1, 0.6)])
    m1 = LE.evidence_margin(LE.correction(key, one, "gpu"), "gpu")
    m4 = LE.evidence_margin(LE.correction(key, four, "gpu"), "gpu")
    assert m1 >= LE.FEW_FITS > 0 and m4 < m1, (m1, m4)
    # in the prediction the user sees
    c1 = next(c for c in L.predict(ctx, POLICY, one).candidates if c.overrides == Overrides())
    c4 = next(c for c in L.predict(ctx, POLICY, four).candidates if c.overrides == Overrides())
    assert c1.margin > LO.MARGINS["same_kind"] and c4.margin < c1.margin, (c1.margin, c4.margin)


def test_the_error_shown_on_this_kind_bounds_the_margin_from_below():
    ctx = gpu_job(micro=16, cap_gib=80)
    key = LO.memory_key(ctx, Overrides())
    # 2x8 used 0.9 of its estimate where the others used at most 0.6: predicted from them, it was
    # 50% over; a new configuration may be too.
    spread = _gpu_fits(ctx, [(4, 0.5), (2, 0.9), (8, 0.6), (1, 0.55)])
    m = LE.evidence_margin(LE.correction(key, spread, "gpu"), "gpu")
    assert m >= 0.9 / 0.6 - 1 - 1e-6, m
    c = next(c for c in L.predict(ctx, POLICY, spread).candidates if c.overrides == Overrides())
    assert c.margin >= m + LO.MARGINS["same_kind"] - 1e-6, c.margin


def test_a_host_prediction_from_no_fit_under_its_setup_has_a_margin_on_a_cpu_run():
    """'predicted ~1.57 GiB of 1.86 GiB usable host memory (estimator x1.00, margin 0%)'."""
    ctx = lora_cpu()
    _, obs = night(ctx, Overrides())
    pred = L.predict(ctx, POLICY, obs)
    for c in pred.candidates:
        if c.source == "predicted":
            assert c.margin > 0, (c.label, c.margin)
    _start, why = L.initial_overrides(ctx, POLICY, obs)
    assert "margin 0%" not in (why or ""), why


# --- item 4: no figure that cannot be true ----------------------------------------------------

def test_a_cpu_runs_model_states_are_never_said_to_need_nothing():
    """'no remedy left ...; model states alone need ~0.00 GiB host RAM': on a run with no GPU every
    state is in host RAM, and a LoRA's offloaded optimizer state rounds to nothing."""
    ctx = lora_cpu(micro=1, accum=24)
    # Night 2's last configuration: 1x24 under ZeRO-3 optimizer offload (built as a GPU run's rung).
    off = R.zero3_offload_optimizer(ctx, Overrides(), gpu_oom(GiB, GiB, GiB), POLICY, R.Memory())
    assert isinstance(off, R.Applied)
    d = decide(ctx, [AttemptRecord(1, off.overrides, host_oom(), ExitRecord(1))], host_oom(), POLICY)
    assert d.kind == DecisionKind.FAIL, d
    assert "~0.00 GiB" not in d.reason, d.reason
    said = re.search(r"model states alone need ~([0-9.]+) GiB", d.reason)
    assert said is not None, d.reason
    assert float(said.group(1)) >= round(2 * ctx.param_count / GiB, 2), d.reason  # the 16-bit weights alone
