"""The world size a LLaMA-Factory launch really has, from its environment (no torch)."""

from __future__ import annotations

import pytest

from supervisor.core.models import JobContext
from supervisor.intake.llamafactory.launch import launch_fields, pinned_nproc, visible_gpu_count


@pytest.mark.parametrize("env,probed,expected", [
    ({}, 8, 8),
    ({}, 0, 0),                                   # CPU box
    ({"CUDA_VISIBLE_DEVICES": "2,3"}, 8, 2),
    ({"CUDA_VISIBLE_DEVICES": ""}, 8, 0),
    ({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, 8, 1),   # the runtime stops at the first invalid id
    ({"HIP_VISIBLE_DEVICES": "0,1,2"}, 8, 3),
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3", "ROCR_VISIBLE_DEVICES": "0"}, 8, 1),
    ({"CUDA_VISIBLE_DEVICES": "GPU-5a1b,GPU-77c0"}, 4, 2),
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 2, 2),  # cannot see more than the box has
])
def test_visible_gpu_count(env, probed, expected):
    assert visible_gpu_count(env, probed) == expected


def test_the_context_from_launch_fields_knows_the_world_size():
    ctx = JobContext(1, "j", "llamafactory", {}, **launch_fields(nproc_per_node=None, gpus=None, env={},
                                                                    probed_gpus=8))
    assert ctx.launched_world_size() == 8
    ctx = JobContext(1, "j", "llamafactory", {}, **launch_fields(nproc_per_node=None, gpus=None,
                                                                    env={"NPROC_PER_NODE": "2"}, probed_gpus=8))
    assert ctx.launched_world_size() == 2
    ctx = JobContext(1, "j", "llamafactory", {}, **launch_fields(nproc_per_node=None, gpus=[4, 5, 6], env={},
                                                                    probed_gpus=8))
    assert ctx.launched_world_size() == 3
    assert pinned_nproc({"NPROC_PER_NODE": "x"}) is None and pinned_nproc({"NPROC_PER_NODE": "0"}) is None
