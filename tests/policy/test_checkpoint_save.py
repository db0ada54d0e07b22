"""An OOM while a checkpoint is being saved (phase checkpoint_save) is the save's: under a ZeRO-3
full fine-tune every save gathers the whole model's 16-bit weights onto rank 0, which no batch size
changes. The remedy saves shards only (no gather); nothing of the training changes."""

from __future__ import annotations

import json
from pathlib import Path

from supervisor.core.models import Category, Overrides, Phase
from supervisor.judge.policy import decide

from .builders import attempt, job, oom

# LLaMA-Factory's own ZeRO-3 preset (v0.9.5): stage3_gather_16bit_weights_on_model_save true
Z3 = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "llamafactory-v0.9.5" / "examples" / "deepspeed"
                 / "ds_z3_config.json").read_text())
GATHER = "stage3_gather_16bit_weights_on_model_save"


def first(j, d, policy, overrides=None, ckpt=40):
    return decide(j, [attempt(1, overrides or Overrides(), d, ckpt)], d, policy)


def test_a_gpu_oom_while_a_zero3_full_fine_tune_saves_saves_shards_only_and_keeps_the_batch(default_policy):
    """Before: the ladder of a training step's OOM (a smaller micro-batch), which the gather ignores."""
    d = first(job(deepspeed_config=Z3), oom(Phase.CHECKPOINT_SAVE, short_gib=3), default_policy)
    assert d.kind == "escalate" and d.rung == "sharded_save", d.reason
    assert "checkpoint_save" in d.reason and "zero_to_fp32.py" in d.reason
    assert d.overrides.yaml == {} and d.overrides.env == {}, "the batch and the allocator are not touched"
    assert d.overrides.deepspeed["zero_optimization"] == {**Z3["zero_optimization"], GATHER: False}
    assert {k: v for k, v in d.overrides.deepspeed.items() if k != "zero_optimization"} == \
        {k: v for k, v in Z3.items() if k != "zero_optimization"}
    assert [c.target for c in d.changes] == ["deepspeed"]


def test_a_host_oom_while_saving_gets_the_same_remedy(default_policy):
    d = first(job(deepspeed_config=Z3), oom(Phase.CHECKPOINT_SAVE, category=Category.HOST_OOM, vendor="cpu"),
              default_policy)
    assert d.rung == "sharded_save" and d.overrides.yaml == {}


def test_the_same_oom_at_a_training_step_is_not_the_save(default_policy):
    d = first(job(deepspeed_config=Z3), oom(Phase.TRAIN_STEP, short_gib=3), default_policy)
    assert d.rung != "sharded_save" and "sharded_save" not in d.reason


def test_a_lora_save_gathers_only_the_adapter_so_the_ladder_goes_on(default_policy):
    d = first(job({"finetuning_type": "lora"}, deepspeed_config=Z3), oom(Phase.CHECKPOINT_SAVE, short_gib=3),
              default_policy)
    assert d.rung != "sharded_save"
    assert "sharded_save: a LoRA adapter's save gathers only the adapter" in d.reason, d.reason


def test_without_zero3_or_once_applied_it_is_not_offered_again(default_policy):
    z2 = {"zero_optimization": {"stage": 2}}
    d = first(job(deepspeed_config=z2), oom(Phase.CHECKPOINT_SAVE, short_gib=3), default_policy)
    assert d.rung != "sharded_save" and "not DeepSpeed ZeRO-3" in d.reason
    save_oom = oom(Phase.CHECKPOINT_SAVE, short_gib=3)
    j = job(deepspeed_config=Z3)
    sharded = first(j, save_oom, default_policy).overrides
    d = decide(j, [attempt(1, Overrides(), save_oom, 40), attempt(2, sharded, save_oom, 40)], save_oom,
               default_policy)
    assert d.rung != "sharded_save" and "already saving without the 16-bit gather" in d.reason


def test_a_policy_that_wants_consolidated_weights_gets_no_sharded_save(default_policy):
    strict = default_policy.model_copy(update={"allow_sharded_save": False})
    d = first(job(deepspeed_config=Z3), oom(Phase.CHECKPOINT_SAVE, short_gib=3), strict)
    assert d.rung != "sharded_save" and "allow_sharded_save" in d.reason
