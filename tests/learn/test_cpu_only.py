"""Issue 27 item 1: on a run with no GPU the 'device' is host memory, so a remedy whose only
effect is on GPU memory (ZeRO offload to the CPU, a GPU memory cap, the CUDA caching allocator's
settings) moves nothing and adds processes: never a candidate there, learned or escalated."""

from __future__ import annotations

import pytest

from supervisor.core.models import Overrides
from supervisor.judge.policy import learn as L
from supervisor.judge.policy import rungs as R

from .builders import POLICY, GiB, cpu_job, demo_night, gpu_job, gpu_oom, host_oom


@pytest.mark.parametrize("rung", [R.zero3_offload_optimizer, R.zero3_offload_param, R.memory_fraction, R.allocator])
def test_a_gpu_only_remedy_is_skipped_on_a_cpu_only_run_and_says_why(rung):
    got = rung(cpu_job(), Overrides(), host_oom(), POLICY, R.Memory())
    assert isinstance(got, R.Skipped), got
    assert "a run with no GPU" in got.why


def test_the_same_remedies_still_apply_where_there_is_a_gpu():
    assert isinstance(R.zero3_offload_optimizer(gpu_job(), Overrides(), host_oom(), POLICY, R.Memory()), R.Applied)
    # a GPU OOM is a GPU seen, whatever the probe said (a daemon host unlike its compute nodes)
    seen = gpu_oom(24 * GiB, 23 * GiB, GiB)
    assert isinstance(R.memory_fraction(cpu_job(), Overrides(), seen, POLICY, R.Memory()), R.Applied)


def test_a_learned_start_on_a_cpu_only_run_never_adds_an_offload():
    """Night 2 of the demo's kind started at 24x1 + ZeRO-3 optimizer offload and was stopped
    five times within 5 s; 4x4 had fit the night before."""
    obs = demo_night(cpu_job())
    for micro in (24, 16, 8):
        ov, _why = L.initial_overrides(cpu_job(micro=micro), POLICY, obs)
        assert not any(r.startswith("zero3") for r in ov.rungs), (micro, ov.rungs, _why)
        assert ov.deepspeed is None and "FORCE_TORCHRUN" not in ov.env
