"""Refuse only the impossible (issue 16, case 5); memory others hold means wait, never refuse (case 6)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from supervisor.core.models import Overrides
from supervisor.judge.policy import learn as L
from supervisor.judge.policy import observed as LO
from supervisor.judge.policy import refusal as LR
from supervisor.judge.policy import rungs as R
from supervisor.judge.policy.estimate import shape_from_config

from .builders import POLICY, GiB, gpu_job

LLAMA3_70B = {"hidden_size": 8192, "num_hidden_layers": 80, "intermediate_size": 28672, "vocab_size": 128256,
              "num_attention_heads": 64, "num_key_value_heads": 8}
LLAMA3_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 128256,
             "num_attention_heads": 32, "num_key_value_heads": 8}


def job_of(cfg: dict, *, gpu_gib: float, host_gib: float, others_gib: float = 0, **kw):
    shape = shape_from_config(cfg)
    ctx = gpu_job(micro=8, accum=2, cap_gib=gpu_gib, params=shape.params,
                  shape={"hidden_size": shape.hidden_size, "num_layers": shape.num_layers,
                         "vocab_size": shape.vocab_size}, **kw)
    return dataclasses.replace(ctx, largest_layer_params=shape.largest_layer_params, host_ram_bytes=int(host_gib * GiB),
                               host_used_by_others_bytes=int(others_gib * GiB) or None)


# --- case 5: a refusal is final, so it must be certain -------------------------------------------

@pytest.mark.parametrize("gpu", [24, 48, 80])
def test_a_70b_full_finetune_the_box_can_hold_with_parameter_offload_is_not_refused(gpu):
    """Refused before: ZeRO-3 parameter offload "would need ~1774 GiB" (DeepSpeed's 18 B/param
    x its 1.5 buffer) over the ~1620 GiB budget of an 1800 GiB box; without the buffer it needs
    ~1183 GiB: possible, so it is tried and what it really uses is learned."""
    ctx = job_of(LLAMA3_70B, gpu_gib=gpu, host_gib=1800)
    assert LR.infeasible(ctx, POLICY, []) is None
    # and the climb can reach it: the rung is the last resort, not skipped as impossible
    off = R.zero3_offload_param(ctx, Overrides(), None, POLICY, R.Memory(), host_check="possible")
    assert isinstance(off, R.Applied) and "tried, and what it really uses is learned" in off.what


def test_a_refusal_names_the_optimistic_bound_and_its_numbers():
    ctx = job_of(LLAMA3_70B, gpu_gib=24, host_gib=1024)
    assert "DeepSpeed's estimate_zero3_model_states_mem_needs_all_cold without" in LR.infeasible(ctx, POLICY, [])
    from supervisor.judge.policy.estimate import OPTIMISTIC_NAME

    r = LR.refusal_bound(ctx, POLICY, [])
    assert r is not None and r.estimate == OPTIMISTIC_NAME
    assert "estimate_zero3_model_states_mem_needs_all_cold without its additional_buffer_factor" in r.text
    need = 18 * ctx.param_count  # parameters and optimizer offloaded, no buffer factor
    assert f"need at least ~{need / GiB:.2f} GiB host RAM" in r.text and "18 B/param" in r.text
    assert "more than the 1024.00 GiB of the box's RAM" in r.text and "of the 24.00 GiB GPU" in r.text
    assert "what other processes hold now is not counted" in r.text and "[the estimator alone]" in r.text
    assert not any(b.gpu_ok and b.host_ok for b in r.bounds)
    assert min(b.host for b in r.bounds if "parameter" in b.label) == need


def test_the_optimistic_bound_is_deepspeeds_own_estimator_without_its_buffer():
    pytest.importorskip("deepspeed", reason="deepspeed not installed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    ctx = job_of(LLAMA3_70B, gpu_gib=24, host_gib=1024)
    r = LR.refusal_bound(ctx, POLICY, [])
    for b in r.bounds:
        if "ZeRO-3" not in b.label:
            continue
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(ctx.param_count, ctx.largest_layer_params, 1, 1,
                                                            cpu_offload=True, cpu_offload_params="parameter" in b.label,
                                                            additional_buffer_factor=1.0)
        assert (b.host, b.gpu) == (int(cpu), int(gpu)), b.label


def test_an_observed_fit_or_a_small_job_is_never_refused():
    ctx = job_of(LLAMA3_70B, gpu_gib=24, host_gib=1024)
    seen = LO.observation(ctx, Overrides(), None, succeeded=True, peak=LO.GpuPeak(20 * GiB, 19 * GiB, None, None, 1),
                         job="earlier")
    assert LR.infeasible(ctx, POLICY, [seen]) is None  # it ran here: whatever the estimate says
    assert LR.infeasible(gpu_job(), POLICY, []) is None


# --- case 6: memory others hold is weather ------------------------------------------------------

def test_host_ram_others_hold_never_refuses_the_job():
    """The same 8B full fine-tune on one 80 GiB GPU: passes on an idle 512 GiB box, and was refused
    for good while other processes held 300 GiB (optimizer offload's ~180 GiB over a ~161 GiB budget)."""
    idle = job_of(LLAMA3_8B, gpu_gib=80, host_gib=512)
    busy = dataclasses.replace(idle, host_used_by_others_bytes=300 * GiB)
    assert LR.infeasible(idle, POLICY, []) is None
    assert LR.infeasible(busy, POLICY, []) is None
    # ... nor changes what it starts at or which remedy it gets
    assert L.initial_overrides(busy, POLICY, []) == L.initial_overrides(idle, POLICY, [])
    assert R.host_budget(busy, POLICY) == R.host_budget(idle, POLICY) == int(512 * GiB * 0.9)


def test_host_ram_others_hold_is_waited_for_bounded_then_the_attempt_starts_unchanged():
    from supervisor.judge.policy.hostwait import host_wait

    idle = job_of(LLAMA3_8B, gpu_gib=80, host_gib=512)
    busy = dataclasses.replace(idle, host_used_by_others_bytes=300 * GiB)
    off = R.zero3_offload_optimizer(idle, Overrides(), None, POLICY, R.Memory())
    assert isinstance(off, R.Applied)
    assert host_wait(idle, POLICY, off.overrides) is None  # nobody else: nothing to wait for
    assert host_wait(busy, POLICY, Overrides()) is None  # no offload: ~2 GiB fits what is left
    w = host_wait(busy, POLICY, off.overrides, waited_s=0)
    need = LO.predict_host(idle, off.overrides)
    assert w.wait and w.need == need and w.others == 300 * GiB and w.available == int(512 * GiB * 0.9) - 300 * GiB
    assert w.retry_in_s == POLICY.host_wait_poll_s and w.max_wait_s == POLICY.host_wait_max_s
    assert "other processes hold 300 GiB of the box's 512 GiB host RAM" in w.reason
    assert f"this attempt needs ~{need / GiB:.0f} GiB and may use ~161 GiB now" in w.reason
    assert "retry in 60 s" in w.reason and "then it starts anyway" in w.reason
    late = host_wait(busy, POLICY, off.overrides, waited_s=POLICY.host_wait_max_s)
    assert not late.wait and "starting anyway, the job unchanged" in late.reason
    # the last poll is cut to the bound
    assert host_wait(busy, POLICY, off.overrides, waited_s=POLICY.host_wait_max_s - 10).retry_in_s == 10


def test_host_wait_uses_what_the_configuration_was_seen_to_use():
    from supervisor.judge.policy.hostwait import host_wait

    idle = job_of(LLAMA3_8B, gpu_gib=80, host_gib=512)
    off = R.zero3_offload_optimizer(idle, Overrides(), None, POLICY, R.Memory())
    seen = LO.observation(idle, off.overrides, None, succeeded=True,
                         peak=LO.GpuPeak(60 * GiB, 58 * GiB, None, None, 1), peak_rss_bytes=140 * GiB, job="j")
    busy = dataclasses.replace(idle, host_used_by_others_bytes=300 * GiB)
    w = host_wait(busy, POLICY, off.overrides, observations=[seen])
    assert w is None  # it used 140 GiB; 161 GiB are free
    busier = dataclasses.replace(idle, host_used_by_others_bytes=330 * GiB)
    assert host_wait(busier, POLICY, off.overrides, observations=[seen]).need == 140 * GiB


def test_a_host_oom_while_others_held_memory_never_turns_into_a_refusal():
    """A host OOM proves a demand beyond what was free then, not beyond the box: with others
    holding memory it is weather. Only an OOM whose lower bound exceeds the capacity is certain.
    (`conservative` reaches three configurations here: as submitted and the two offloads.)"""
    from supervisor.judge.policy import BUILTIN_POLICY_DIR, load_policy

    from .builders import host_oom

    conservative = load_policy("conservative", search_dirs=[BUILTIN_POLICY_DIR])
    ctx = job_of(LLAMA3_70B, gpu_gib=24, host_gib=1800)
    off = R.zero3_offload_param(ctx, Overrides(), None, conservative, R.Memory(), host_check="possible")
    weather = LO.observation(ctx, off.overrides, host_oom(), succeeded=False, peak_rss_bytes=1400 * GiB, job="earlier")
    assert LR.infeasible(ctx, conservative, []) is None
    assert LR.infeasible(ctx, conservative, [weather]) is None
    beyond = dataclasses.replace(weather, host_peak=1900 * GiB)
    refused = LR.infeasible(ctx, conservative, [beyond])
    assert refused is not None and "1 of them ran out of memory here beyond the capacity" in refused


def test_a_job_that_would_not_fit_an_empty_box_is_not_kept_waiting_for_others():
    """Issue 27 item 5: a 7B-class job whose need is over the box's budget waited the full
    host_wait_max_s (1 h) before every attempt while others held 1 GiB of 24 GiB, then started
    unchanged anyway. Freeing what others hold cannot make it fit: it starts now, and says so."""
    from supervisor.judge.policy.hostwait import host_wait

    small_box = job_of(LLAMA3_8B, gpu_gib=80, host_gib=24, others_gib=1)
    off = R.zero3_offload_optimizer(dataclasses.replace(small_box, host_ram_bytes=512 * GiB), Overrides(), None,
                                    POLICY, R.Memory())
    assert isinstance(off, R.Applied)
    assert LO.predict_host(small_box, off.overrides) > R.host_budget(small_box, POLICY)
    w = host_wait(small_box, POLICY, off.overrides, waited_s=0)
    assert w is not None and not w.wait, w and w.reason
    assert "waiting cannot make it fit" in w.reason and "starting now" in w.reason


def test_a_job_that_others_stand_between_it_and_a_fit_waits_for_them():
    """...and one that would fit once others free their memory does wait (bounded, as before)."""
    from supervisor.judge.policy.hostwait import host_wait

    box = job_of(LLAMA3_8B, gpu_gib=80, host_gib=24, others_gib=4)
    seen = LO.observation(box, Overrides(), None, succeeded=True,
                         peak=LO.GpuPeak(60 * GiB, 58 * GiB, None, None, 1), peak_rss_bytes=20 * GiB, job="j")
    w = host_wait(box, POLICY, Overrides(), observations=[seen])
    assert w is not None and w.wait and w.need == 20 * GiB, w
    assert "waiting for them" in w.reason
