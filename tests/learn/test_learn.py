"""The pure part of learned plans: record, key, correction, choice, refusal."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.core.models import Overrides
from supervisor.judge.policy import evidence as LE
from supervisor.judge.policy import learn as L
from supervisor.judge.policy import observed as LO
from supervisor.judge.policy import refusal as LR
from supervisor.judge.policy import rungs as R

from .builders import (
    PARAMS,
    POLICY,
    SHAPE,
    GiB,
    cpu_job,
    demo_night,
    fit_gpu,
    gpu_job,
    gpu_oom,
    host_oom,
    split,
)


def test_nothing_known_starts_as_submitted_without_a_reason():
    assert L.initial_overrides(gpu_job(), POLICY, []) == (Overrides(), None)
    # Observations of an unrelated kind (another GPU) say nothing either.
    other = fit_gpu(gpu_job(cap_gib=80), Overrides(), 10 * GiB)
    assert L.initial_overrides(gpu_job(), POLICY, [other]) == (Overrides(), None)


def test_demo_resubmitted_starts_where_it_fit_with_the_reason():
    ctx = cpu_job()
    ov, reason = L.initial_overrides(ctx, POLICY, demo_night(ctx))
    v = R.view_of(ctx, ov)
    assert (v.micro, v.accum) == (4, 4)
    assert ov == split(ctx, 4)  # the micro_batch rung's own overrides: effective batch kept
    assert reason == ("learned: 3 attempts of this kind on this box: micro-batch 16 and 8 ran out of host memory, "
                      "4x4 fit (peak 1.32 GiB of 1.91 GiB); starting at 4x4 (observed to fit)")


def test_observation_key_and_outcomes():
    ctx = gpu_job(micro=8, accum=2)
    cap = ctx.gpu_capacity_bytes
    o = LO.observation(ctx, Overrides(), gpu_oom(cap, 23 * GiB, 2 * GiB), succeeded=False)
    assert o.outcome == "gpu_oom" and o.gpu_peak == 25 * GiB  # in use + the failed request: a lower bound
    assert o.key["micro_batch"] == 8 and o.key["grad_accum"] == 2 and o.key["gpu_capacity"] == cap
    assert o.key["hidden_size"] == 896 and o.key["torch"] == "2.9.1" and o.key["grad_checkpointing"] == "on"
    assert LO.observation(ctx, Overrides(), host_oom(), succeeded=False, memory_limit_bytes=GiB).host_peak == GiB
    # Trained past its start without an OOM: a fit, even though it ended otherwise later.
    peak = LO.GpuPeak(20 * GiB, 18 * GiB, cap, "H200", 1)
    assert LO.observation(ctx, Overrides(), None, succeeded=False, max_step=40, resumed_from_step=10,
                         peak=peak).outcome == "fit"
    # No step, no OOM (a config error at start): nothing to learn; a GPU fit without its peak neither.
    assert LO.observation(ctx, Overrides(), None, succeeded=False, max_step=10, resumed_from_step=10) is None
    assert LO.observation(ctx, Overrides(), None, succeeded=True) is None
    # Unknown model shape: no key to learn under.
    assert LO.observation(dataclasses.replace(ctx, model_shape=None), Overrides(), None, succeeded=True,
                         peak=peak) is None


def test_correction_lowers_an_over_prediction_and_starts_higher():
    """The estimator over-predicts; a fit observed at 60% of its prediction lets the next run keep
    a larger micro-batch than the estimator alone would allow."""
    ctx = gpu_job(micro=16)
    pred = {m: LO.predict_gpu(ctx, split(ctx, m)) for m in (16, 8, 4)}
    limit = ctx.gpu_capacity_bytes * (1 - POLICY.fit_headroom)
    assert pred[8] > limit  # the estimator alone: 8 would not fit
    obs = [fit_gpu(ctx, split(ctx, 4), int(0.6 * pred[4]))]
    c = LE.correction(LO.memory_key(ctx, Overrides()), obs, "gpu")
    # The correction scales what the estimator guesses (activations, overhead), not DeepSpeed's states.
    states = LO.predict_gpu_states(ctx, split(ctx, 4))
    k = (0.6 * pred[4] - states) / (pred[4] - states)
    assert abs(c.k - k) < 1e-3 and c.k < 0.6 and c.tier == "same_kind"
    ov, reason = L.initial_overrides(ctx, POLICY, obs)
    chosen = R.view_of(ctx, ov).micro
    need = LO.corrected_gpu(pred[chosen], LO.predict_gpu_states(ctx, split(ctx, chosen)), c.k)
    assert need * 1.05 <= limit and chosen >= 8
    # One fit: the tier's 5% and the margin of a single observation (issue 27).
    assert f"activations and overhead x{c.k:.2f}, margin {LO.MARGINS['same_kind'] + LE.FEW_FITS:.0%}" in reason


def test_oom_raises_the_correction():
    ctx = gpu_job(micro=16)
    pred4 = LO.predict_gpu(ctx, split(ctx, 4))
    pred8 = LO.predict_gpu(ctx, split(ctx, 8))
    cap = ctx.gpu_capacity_bytes
    obs = [fit_gpu(ctx, split(ctx, 4), int(0.5 * pred4)),
           LO.observation(ctx, split(ctx, 8), gpu_oom(cap, cap - GiB // 4, int(0.1 * pred8)), succeeded=False)]
    c = LE.correction(LO.memory_key(ctx, Overrides()), obs, "gpu")
    assert c.bounded_by_oom and c.k > 0.5
    ov, _ = L.initial_overrides(ctx, POLICY, obs)
    assert R.view_of(ctx, ov).micro != 8  # the configuration that ran out is never the start


def test_other_sequence_length_and_sibling_scale_by_the_estimator():
    short = gpu_job(cutoff=1024)
    obs = [fit_gpu(short, split(short, 4), int(0.8 * LO.predict_gpu(short, split(short, 4))))]
    long = gpu_job(cutoff=4096)
    c = LE.correction(LO.memory_key(long, Overrides()), obs, "gpu")
    assert c.tier == "other_seq" and abs(c.k - LE.observed_ratio(obs[0], "gpu")) < 1e-9 and c.k < 0.8
    _, reason = L.initial_overrides(long, POLICY, obs)
    assert reason.startswith("learned: 1 attempt of the same model at another cutoff_len") and f"margin {LO.MARGINS['other_seq'] + LE.FEW_FITS:.0%}" in reason
    big = gpu_job(params=2 * PARAMS, shape={**SHAPE,
                                                 "num_layers": 48})
    assert LE.correction(LO.memory_key(big, Overrides()), obs, "gpu").tier == "sibling"
    other_vocab = gpu_job(shape={"hidden_size": 896, "num_layers": 24, "vocab_size": 32000})
    assert LE.correction(LO.memory_key(other_vocab, Overrides()), obs, "gpu").tier is None


def test_user_config_known_to_fit_is_never_changed():
    ctx = gpu_job(micro=4, accum=4)
    obs = [fit_gpu(ctx, Overrides(), 20 * GiB)]
    ov, reason = L.initial_overrides(ctx, POLICY, obs)
    assert ov == Overrides() and "starting at the job as submitted (observed to fit)" in reason


def test_infeasible_refuses_with_numbers_and_passes_what_fits():
    # A 70B-sized full fine-tune on one 24 GiB GPU with 64 GiB of host RAM: nothing reachable fits.
    huge = dataclasses.replace(gpu_job(params=70_000_000_000, shape={"hidden_size": 8192, "num_layers": 80,
                                                                     "vocab_size": 128256}),
                               largest_layer_params=1_050_000_000, host_ram_bytes=64 * GiB)
    why = LR.infeasible(huge, POLICY, [])
    assert why is not None and "cannot run on this box" in why and "of the 24.00 GiB GPU" in why
    assert "host RAM" in why and "the estimator alone" in why
    assert LR.infeasible(gpu_job(), POLICY, []) is None
    assert LR.infeasible(cpu_job(), POLICY, demo_night(cpu_job())) is None


def test_peak_file_parse_takes_the_worst_device():
    data = {"version": 1, "processes": {
        "1": {"devices": [{"index": 0, "name": "A", "total_bytes": 100, "max_allocated_bytes": 50,
                           "max_reserved_bytes": 60}]},
        "2": {"devices": [{"index": 1, "name": "A", "total_bytes": 100, "max_allocated_bytes": 70,
                           "max_reserved_bytes": 80}, {"index": 2, "bogus": 1}]}}}
    p = LO.parse_peak_file(data)
    assert (p.max_reserved, p.max_allocated, p.total, p.devices) == (80, 70, 100, 2)
    assert LO.parse_peak_file({"processes": {}}) is None and LO.parse_peak_file([1]) is None


@settings(max_examples=60, deadline=None)
@given(micro=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32]), accum=st.sampled_from([1, 2, 3, 4]),
       ratio=st.floats(0.3, 2.0), seen_micro_pick=st.integers(0, 10), oom=st.booleans())
def test_property_effective_batch_kept_and_start_predicted_to_fit(micro, accum, ratio, seen_micro_pick, oom):
    ctx = gpu_job(micro=micro, accum=accum, cap_gib=40)
    options = [micro, *R.micro_batch_options(ctx, Overrides(), POLICY)]
    seen = options[seen_micro_pick % len(options)]
    ov_seen = split(ctx, seen)
    obs = [fit_gpu(ctx, ov_seen, int(ratio * LO.predict_gpu(ctx, ov_seen)))]
    if oom and seen != micro:
        cap = ctx.gpu_capacity_bytes
        obs.append(LO.observation(ctx, Overrides(), gpu_oom(cap, cap - GiB, 2 * GiB), succeeded=False))
    ov, reason = L.initial_overrides(ctx, POLICY, obs)
    v = R.view_of(ctx, ov)
    assert v.micro * v.accum == micro * accum  # the user's effective batch, exactly
    pred = L.predict(ctx, POLICY, obs)
    if reason is None:
        assert ov == Overrides() and pred.chosen is None
        return
    chosen = pred.chosen
    assert chosen.overrides == ov and chosen.fits
    # Never higher than needed: no faster configuration was also predicted to fit.
    assert all(c.speed <= chosen.speed for c in pred.candidates if c.fits)
    if oom and seen != micro:
        assert ov != Overrides()  # the configuration that ran out is not the start


def test_an_observed_fit_above_the_headroom_is_still_trusted():
    """Found by bench_policy --learned: a configuration that ran to the end at 99% of the GPU was
    judged against capacity x (1 - fit_headroom) like a prediction and skipped for a slower one."""
    ctx = gpu_job(micro=8, accum=2)
    cap = ctx.gpu_capacity_bytes
    obs = [LO.observation(ctx, Overrides(), gpu_oom(cap, cap - GiB // 2, 2 * GiB), succeeded=False),
           fit_gpu(ctx, split(ctx, 4), int(0.99 * cap), n=2)]
    ov, reason = L.initial_overrides(ctx, POLICY, obs)
    assert ov == split(ctx, 4) and reason.endswith("starting at 4x4 (observed to fit)")


def test_a_ratio_is_extrapolated_to_another_setup_only_with_more_margin():
    """Found by bench_policy --learned: a ratio seen without ZeRO (or with allocator tuning) was
    applied to a ZeRO-3 candidate with the plain 5%, which then ran out. Another checkpointing
    mode under the same ZeRO setup: the ratio with SETUP_MARGIN more; another ZeRO/offload setup:
    no ratio at all (issue 16, case 8), the estimator with SETUP_MARGIN."""
    ctx = gpu_job(micro=8, accum=2)
    obs = [fit_gpu(ctx, split(ctx, 4), int(0.9 * LO.predict_gpu(ctx, split(ctx, 4))))]
    pred = L.predict(ctx, POLICY, obs)
    plain = next(c for c in pred.candidates if c.overrides == split(ctx, 2))
    host_gc = next(c for c in pred.candidates if c.label == "2x8 + checkpoints in host RAM")
    zero3 = next(c for c in pred.candidates if "ZeRO-3" in c.label)
    assert plain.margin == pytest.approx(LO.MARGINS["same_kind"] + LE.FEW_FITS)  # one fit: issue 27
    assert host_gc.margin == pytest.approx(plain.margin + LO.SETUP_MARGIN) and host_gc.k == plain.k < 1
    assert zero3.margin == pytest.approx(LO.SETUP_MARGIN + LE.FEW_FITS) and zero3.k == 1.0  # never below a seen setup's


def test_host_use_without_offload_does_not_inflate_offload_or_refuse_the_job():
    """A GPU run's 6 GiB of host RSS without ZeRO is three times HOST_BASE; carried to ZeRO-3
    offload it would triple the DeepSpeed host estimate and could refuse a runnable job."""
    ctx = dataclasses.replace(gpu_job(micro=8, accum=2, params=8_000_000_000,
                                      shape={"hidden_size": 4096, "num_layers": 32, "vocab_size": 128256}),
                              largest_layer_params=525_000_000, host_ram_bytes=256 * GiB)
    seen = LO.observation(ctx, split(ctx, 1), None, succeeded=True, peak=LO.GpuPeak(20 * GiB, 19 * GiB, None, None, 1),
                         peak_rss_bytes=6 * GiB)
    pred = L.predict(ctx, POLICY, [seen])
    offload = next(c for c in pred.candidates if "ZeRO-3" in c.label)
    assert offload.host_need == LO.predict_host(ctx, offload.overrides)
    assert LR.infeasible(ctx, POLICY, [seen]) is None


def test_offload_host_need_from_the_estimator_alone_gets_no_learned_margin():
    """Found by bench_policy --learned: the GPU margin was put on the host estimate too, so a
    ZeRO-3 offload whose (uncorrected, already 1.5x-buffered) host need fits was refused."""
    base = gpu_job(micro=8, accum=2, params=8_000_000_000, cap_gib=80,
                   shape={"hidden_size": 4096, "num_layers": 32, "vocab_size": 128256})
    base = dataclasses.replace(base, largest_layer_params=525_000_000)
    off = R.zero3_offload_param(base, Overrides(), host_oom(), POLICY, R.Memory())
    host = LO.predict_host(base, off.overrides)
    ctx = dataclasses.replace(base, host_ram_bytes=int(host * 1.03 / (0.95 * 0.9)))
    seen = LO.observation(ctx, split(ctx, 1), None, succeeded=True, peak=LO.GpuPeak(20 * GiB, 19 * GiB, None, None, 1),
                         peak_rss_bytes=6 * GiB)
    pred = L.predict(ctx, POLICY, [seen])
    c = next(c for c in pred.candidates if c.overrides == off.overrides)
    assert c.host_need == host and c.fits


def test_candidates_include_checkpoints_in_host_ram_when_checkpointing_is_already_on():
    """Found by bench_policy --learned: with checkpointing on (LLaMA-Factory's default) the
    start candidates lacked use_unsloth_gc, so a night that fit with it had no same-setup twin."""
    ctx = gpu_job(micro=8, accum=2)
    labels = [L.label(ctx, ov) for ov in L.configurations(ctx, POLICY)]
    assert "8x2 + checkpoints in host RAM" in labels and "2x8 + checkpoints in host RAM" in labels


def test_a_fit_under_the_same_host_limit_is_trusted_even_with_rss_above_it():
    """RLIMIT_DATA counts private writable memory; the sampled RSS also counts torch's shared
    pages, so the demo's 4x4 can fit its 1.91 GiB limit with 2.1 GiB RSS."""
    ctx = cpu_job()
    obs = demo_night(ctx)
    obs[-1] = dataclasses.replace(obs[-1], host_peak=int(2.1 * GiB))
    ov, reason = L.initial_overrides(ctx, POLICY, obs)
    assert ov == split(ctx, 4) and "starting at 4x4 (observed to fit)" in reason
    # Under a tighter limit than it ran with, the numbers decide again.
    tighter = dataclasses.replace(ctx, host_memory_limit_bytes=int(1.5 * GiB))
    assert L.initial_overrides(tighter, POLICY, obs)[0] != split(ctx, 4)


def test_a_small_gpu_job_under_a_tight_host_limit_is_not_refused_on_a_guess():
    """Found with plan: HOST_BASE (a lead for Python + torch + the runtime) counted in the refusal,
    so a 5M-parameter GPU job under a 1.91 GiB host limit was 'refused at submit'."""
    ctx = dataclasses.replace(gpu_job(params=5_000_000, shape={"hidden_size": 256, "num_layers": 4,
                                                               "vocab_size": 4000}),
                              largest_layer_params=1_000_000, host_memory_limit_bytes=int(1.91 * GiB))
    assert LR.infeasible(ctx, POLICY, []) is None


def test_an_oom_caused_by_other_processes_memory_is_not_the_configurations():
    """decide() waits out such an OOM with the job unchanged; recorded as this configuration's
    OOM it would make the next submission start lower than needed."""
    ctx = gpu_job(micro=8, accum=2)
    cap = ctx.gpu_capacity_bytes
    d = gpu_oom(cap, cap - GiB // 4, 2 * GiB)
    d = dataclasses.replace(d, numbers={**d.numbers, "held_by_others": 14 * GiB})
    assert LO.observation(ctx, Overrides(), d, succeeded=False) is None


@settings(max_examples=80, deadline=None)
@given(fit_ratios=st.lists(st.floats(0.2, 3.0), min_size=0, max_size=3),
       oom_ratios=st.lists(st.floats(0.2, 3.0), min_size=0, max_size=3), extra=st.floats(0.2, 3.0))
def test_property_an_oom_never_lowers_the_correction_and_fits_set_it_both_ways(fit_ratios, oom_ratios, extra):
    ctx = gpu_job(micro=8, accum=2)
    key = LO.memory_key(ctx, Overrides())
    ov = split(ctx, 4)
    pred = LO.predict_gpu(ctx, ov)

    def oom_obs(r):
        return dataclasses.replace(fit_gpu(ctx, ov, int(r * pred)), outcome="gpu_oom")

    obs = [fit_gpu(ctx, ov, int(r * pred)) for r in fit_ratios] + [oom_obs(r) for r in oom_ratios]
    k = LE.correction(key, obs, "gpu").k
    assert LE.correction(key, [*obs, oom_obs(extra)], "gpu").k >= k - 1e-9
    if fit_ratios:
        # Fits alone set k exactly (below 1 too: the estimator over-predicted); OOMs can only raise it,
        # unless fits of their own configuration outweigh them (OOM_ODDS to 1).
        heard = [o for o in obs if id(o) not in LE.outweighed(obs)]
        assert abs(k - max(LE.observed_ratio(o, "gpu") for o in heard)) < 1e-9
    else:
        assert k >= 1.0
