"""An OOM while a checkpoint is being loaded (phase checkpoint_load) is answered with what helps
at load time, never with a smaller micro-batch (no activations exist yet)."""

from __future__ import annotations

from supervisor.core.models import Category, Overrides, Phase
from supervisor.judge.policy import decide
from supervisor.judge.policy.decide import LOAD_TIME

from .builders import attempt, job, oom

Z3_OFFLOAD = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
              "train_micro_batch_size_per_gpu": "auto"}


def first(j, d, policy, overrides=None, ckpt=40):
    return decide(j, [attempt(1, overrides or Overrides(), d, ckpt)], d, policy)


def test_a_host_oom_while_loading_a_zero_checkpoint_loads_it_per_parameter_not_a_smaller_batch(default_policy):
    """Before: a host OOM went to the host ladder (micro_batch first) whatever its phase."""
    d = first(job(deepspeed_config=Z3_OFFLOAD), oom(Phase.CHECKPOINT_LOAD, category=Category.HOST_OOM, vendor="cpu"),
              default_policy)
    assert d.rung == "universal_load" and "checkpoint_load" in d.reason
    assert d.overrides.yaml == {}, "the batch is not touched"
    assert d.overrides.deepspeed["checkpoint"] == {"load_universal": True}
    assert d.overrides.deepspeed["zero_optimization"] == Z3_OFFLOAD["zero_optimization"]
    assert [c.target for c in d.changes] == ["deepspeed"]


def test_the_same_host_oom_at_a_training_step_still_gets_the_batch_remedy(default_policy):
    d = first(job(deepspeed_config=Z3_OFFLOAD), oom(Phase.TRAIN_STEP, category=Category.HOST_OOM, vendor="cpu"),
              default_policy)
    assert d.rung == "micro_batch"


def test_a_host_oom_while_loading_without_deepspeed_fails_saying_the_batch_is_not_the_cause(default_policy):
    d = first(job(), oom(Phase.CHECKPOINT_LOAD, category=Category.HOST_OOM, vendor="cpu"), default_policy)
    assert d.kind == "fail" and "a smaller micro-batch frees nothing" in d.reason
    assert "universal_load: no DeepSpeed ZeRO-3 checkpoint" in d.reason


def test_once_loading_per_parameter_failed_too_nothing_else_is_tried(default_policy):
    load_oom = oom(Phase.CHECKPOINT_LOAD, category=Category.HOST_OOM)
    j = job(deepspeed_config=Z3_OFFLOAD)
    universal = first(j, load_oom, default_policy).overrides
    d = decide(j, [attempt(1, Overrides(), load_oom, 40), attempt(2, universal, load_oom, 40)], load_oom,
               default_policy)
    assert d.kind == "fail" and "already loading through the universal format" in d.reason


def test_zero2_gets_no_lean_universal_load(default_policy):
    z2 = {"zero_optimization": {"stage": 2}}
    d = first(job(deepspeed_config=z2), oom(Phase.CHECKPOINT_LOAD, category=Category.HOST_OOM), default_policy)
    assert d.kind == "fail" and "measured for ZeRO-3 only" in d.reason


def test_a_gpu_oom_while_loading_gets_load_time_remedies_only(default_policy):
    d = first(job(deepspeed_config=Z3_OFFLOAD), oom(Phase.CHECKPOINT_LOAD, short_gib=2, frag=True), default_policy)
    assert d.rung in LOAD_TIME["gpu_oom"] and "per_device_train_batch_size" not in d.overrides.yaml


def test_a_policy_without_universal_checkpoints_gets_no_universal_load(default_policy):
    strict = default_policy.model_copy(update={"allow_universal_checkpoint": False})
    d = first(job(deepspeed_config=Z3_OFFLOAD), oom(Phase.CHECKPOINT_LOAD, category=Category.HOST_OOM), strict)
    assert d.kind == "fail" and "allow_universal_checkpoint" in d.reason
