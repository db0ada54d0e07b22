"""The pure resume decisions: every transition of the compatibility table, in milliseconds."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from supervisor.judge.resume import (
    ARCHIVE_DIR,
    Checkpoint,
    RunShape,
    parse_version,
    plan_resume,
    run_shape,
)

OUT = Path("/runs/job/out")


def ckpt(step: int = 8, *, deepspeed: bool = False, zero_stage: int | None = None, world: int = 1,
         tbs: int = 16, weights: bool = True, adapter: bool = False, optimizer: bool = True) -> Checkpoint:
    return Checkpoint(path=OUT / f"checkpoint-{step}", step=step, deepspeed=deepspeed,
                      zero_stage=zero_stage, world_size=world, train_batch_size=tbs,
                      has_weights=weights, adapter=adapter, has_optimizer=optimizer,
                      ds_tag=f"global_step{step}" if deepspeed else None)


def shape(micro: int = 16, accum: int = 1, *, world: int = 1, stage: int | None = None,
          off: bool = False, ft: str = "full") -> RunShape:
    return RunShape(deepspeed_stage=stage, offload_optimizer=off, offload_param=off,
                    world_size=world, micro_batch=micro, grad_accum=accum, finetuning_type=ft)


def test_no_checkpoint_starts_fresh_without_auto_resume():
    plan = plan_resume(None, prev=None, nxt=shape(), transformers_version="5.6.0")
    assert plan.mode == "fresh"
    assert plan.yaml["resume_from_checkpoint"] is None
    assert plan.yaml["overwrite_output_dir"] is False


def test_same_shape_resumes_exactly_from_an_explicit_path():
    plan = plan_resume(ckpt(), prev=shape(), nxt=shape(), transformers_version="5.6.0")
    assert plan.mode == "exact"
    assert plan.yaml == {"resume_from_checkpoint": str(OUT / "checkpoint-8"), "overwrite_output_dir": False}
    assert plan.fixups == () and plan.semantic_change is None


def test_micro_batch_remedy_on_new_transformers_needs_no_fixup():
    plan = plan_resume(ckpt(tbs=16), prev=shape(16, 1), nxt=shape(4, 4), transformers_version="5.6.0")
    assert plan.mode == "exact" and plan.fixups == () and plan.semantic_change is None


@pytest.mark.parametrize("version", ["4.57.1", "5.1.2", "5.2.0.dev0", None])
def test_micro_batch_remedy_on_old_or_unknown_transformers_patches_train_batch_size(version):
    plan = plan_resume(ckpt(tbs=16), prev=shape(16, 1), nxt=shape(4, 4), transformers_version=version)
    if version == "5.2.0.dev0":
        assert plan.fixups == ()  # 5.2 carries the fix
        return
    assert plan.mode == "exact"
    (fx,) = plan.fixups
    assert fx.kind == "patch_train_batch_size"
    assert fx.value == 4
    assert fx.path == OUT / "checkpoint-8" / "trainer_state.json"
    assert fx.backup is not None and fx.backup.parent == fx.path.parent and fx.backup != fx.path


def test_changed_effective_batch_is_reported_as_semantic_change():
    plan = plan_resume(ckpt(), prev=shape(16, 1), nxt=shape(4, 1), transformers_version="5.6.0")
    assert plan.mode == "exact"
    assert plan.semantic_change and "16 -> 4" in plan.semantic_change


def test_offload_off_within_zero3_same_world_resumes_exactly():
    c = ckpt(deepspeed=True, zero_stage=3)
    plan = plan_resume(c, prev=shape(stage=3, off=True), nxt=shape(stage=3, off=False),
                       transformers_version="5.6.0")
    assert plan.mode == "exact"


def test_optimizer_offload_on_within_zero3_is_not_exact():
    """Measured: DeepSpeedCPUAdam dies on the torch-AdamW state (KeyError 'bias_correction')."""
    c = ckpt(deepspeed=True, zero_stage=3)
    plan = plan_resume(c, prev=shape(stage=3, off=False), nxt=shape(stage=3, off=True),
                       transformers_version="5.6.0")
    assert plan.mode == "restart" and "bias_correction" in plan.reason


@pytest.mark.parametrize(
    ("c", "nxt", "words"),
    [
        (ckpt(), shape(stage=3, off=True), "no DeepSpeed -> DeepSpeed"),
        (ckpt(deepspeed=True, zero_stage=2), shape(stage=3), "ZeRO-2 layout -> ZeRO-3"),
        (ckpt(deepspeed=True, zero_stage=3), shape(stage=2), "ZeRO-3 layout -> ZeRO-2"),
        (ckpt(deepspeed=True, zero_stage=3, world=2), shape(stage=3, world=1), "world size 2 -> 1"),
        (ckpt(deepspeed=True, zero_stage=3), shape(), "DeepSpeed -> no DeepSpeed"),
    ],
)
def test_incompatible_optimizer_state_never_continues_weights_only_by_default(c, nxt, words):
    plan = plan_resume(c, prev=None, nxt=nxt, transformers_version="5.6.0")
    assert plan.mode == "restart"
    assert words in plan.reason
    assert plan.yaml["resume_from_checkpoint"] is None  # and LLaMA-Factory cannot auto-resume:
    (fx,) = plan.fixups
    assert fx.kind == "archive_checkpoints" and fx.path == OUT
    assert fx.target is not None and fx.target.parent == OUT / ARCHIVE_DIR
    assert plan.semantic_change and "step 0" in plan.semantic_change


def test_weights_only_into_deepspeed_loads_weights_from_the_archived_checkpoint():
    plan = plan_resume(ckpt(), prev=shape(), nxt=shape(stage=3, off=True), transformers_version="5.6.0",
                       allow_weights_only=True, archive_name="attempt-2")
    assert plan.mode == "weights_only"
    archived = OUT / ARCHIVE_DIR / "attempt-2" / "checkpoint-8"
    assert plan.yaml["model_name_or_path"] == str(archived)
    assert plan.yaml["resume_from_checkpoint"] is None
    assert plan.fixups[0].target == archived.parent
    assert "WEIGHTS-ONLY" in (plan.semantic_change or "")


def test_weights_only_lora_uses_the_adapter():
    c = ckpt(adapter=True)
    plan = plan_resume(c, prev=shape(ft="lora"), nxt=shape(ft="lora", stage=3), transformers_version="5.6.0",
                       allow_weights_only=True)
    assert plan.mode == "weights_only"
    assert "adapter_name_or_path" in plan.yaml and "model_name_or_path" not in plan.yaml


def test_weights_only_out_of_deepspeed_lets_transformers_keep_the_step():
    c = ckpt(deepspeed=True, zero_stage=3)
    plan = plan_resume(c, prev=shape(stage=3), nxt=shape(), transformers_version="5.6.0",
                       allow_weights_only=True)
    assert plan.mode == "weights_only"
    assert plan.yaml["resume_from_checkpoint"] == str(c.path)
    assert "LR schedule restarts" in (plan.semantic_change or "")


def test_zero3_without_gathered_weights_cannot_continue_weights_only():
    c = ckpt(deepspeed=True, zero_stage=3, weights=False)
    plan = plan_resume(c, prev=None, nxt=shape(stage=2), transformers_version="5.6.0",
                       allow_weights_only=True)
    assert plan.mode == "restart" and "no consolidated weights" in plan.reason


def test_universal_conversion_when_allowed_for_deepspeed_to_deepspeed():
    c = ckpt(deepspeed=True, zero_stage=3, world=2)
    plan = plan_resume(c, prev=None, nxt=shape(stage=3, world=1), transformers_version="5.6.0",
                       allow_universal=True, allow_weights_only=True)
    assert plan.mode == "universal"
    assert plan.deepspeed == {"checkpoint": {"load_universal": True}}
    (fx,) = plan.fixups
    assert fx.kind == "ds_to_universal" and fx.value == "global_step8"
    assert plan.yaml["resume_from_checkpoint"] == str(c.path)


def test_universal_is_not_offered_from_a_plain_checkpoint():
    plan = plan_resume(ckpt(), prev=None, nxt=shape(stage=3), transformers_version="5.6.0",
                       allow_universal=True)
    assert plan.mode == "restart"


def test_finetuning_type_change_restarts():
    plan = plan_resume(ckpt(adapter=True), prev=shape(ft="lora"), nxt=shape(ft="full"),
                       transformers_version="5.6.0", allow_weights_only=True)
    assert plan.mode == "restart"


def test_checkpoint_without_optimizer_state_is_not_exact():
    plan = plan_resume(ckpt(optimizer=False), prev=shape(), nxt=shape(), transformers_version="5.6.0")
    assert plan.mode == "restart" and "no optimizer state" in plan.reason


def test_files_win_over_the_remembered_shape():
    # The supervisor thought the run was plain, but the checkpoint is ZeRO-3: not loadable plain.
    c = ckpt(deepspeed=True, zero_stage=3)
    plan = plan_resume(c, prev=shape(), nxt=shape(), transformers_version="5.6.0")
    assert plan.mode == "restart"


def test_run_shape_reads_llamafactory_defaults_and_offload():
    s = run_shape({}, world_size=1, deepspeed_cfg=None)
    assert (s.micro_batch, s.grad_accum, s.finetuning_type, s.deepspeed_stage) == (8, 1, "lora", None)
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                "offload_param": {"device": "none"}}}
    s = run_shape({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 8}, world_size=4,
                  deepspeed_cfg=ds)
    assert (s.deepspeed_stage, s.offload_optimizer, s.offload_param, s.effective_batch) == (3, True, False, 64)
    assert run_shape({}, world_size=1, deepspeed_cfg={}).deepspeed_stage == 0


def test_parse_version():
    assert parse_version("5.2.0.dev0") == (5, 2, 0)
    assert parse_version("4.57.1") == (4, 57, 1)
    assert parse_version("5.6.0rc1") == (5, 6, 0)
    assert parse_version("") is None and parse_version(None) is None


def test_plans_are_frozen():
    plan = plan_resume(ckpt(), prev=shape(), nxt=shape(), transformers_version="5.6.0")
    with pytest.raises(AttributeError):
        plan.mode = "fresh"  # type: ignore[misc]
    assert replace(plan, mode="fresh").mode == "fresh"


def test_universal_is_not_offered_for_a_zero_stage_change():
    """Only world-size changes within one ZeRO layout were verified through ds_to_universal."""
    c = ckpt(deepspeed=True, zero_stage=2, world=2)
    plan = plan_resume(c, prev=None, nxt=shape(stage=3, world=1), transformers_version="5.6.0",
                       allow_universal=True)
    assert plan.mode == "restart"


# --- universal checkpoints (measured for real: tests/checkpoints/test_real_*) ----------------------------

def test_a_zero2_world_size_change_turns_round_robin_gradients_off_in_the_target():
    plan = plan_resume(ckpt(deepspeed=True, zero_stage=2, world=1), prev=shape(2, 4, world=1, stage=2),
                       nxt=shape(2, 2, world=2, stage=2), transformers_version="5.6.0", allow_universal=True)
    assert plan.mode == "universal"
    assert plan.deepspeed == {"checkpoint": {"load_universal": True},
                              "zero_optimization": {"round_robin_gradients": False}}


def test_zero2_shards_written_with_round_robin_on_two_ranks_are_never_converted():
    """LLaMA-Factory's ds_z2 preset: the conversion of such shards is silently wrong."""
    rr = replace(shape(2, 2, world=2, stage=2), round_robin=True)
    plan = plan_resume(ckpt(deepspeed=True, zero_stage=2, world=2), prev=rr, nxt=shape(2, 4, world=1, stage=2),
                       transformers_version="5.6.0", allow_universal=True)
    assert plan.mode == "restart" and "round_robin_gradients" in plan.reason
    one = plan_resume(ckpt(deepspeed=True, zero_stage=2, world=1), prev=replace(rr, world_size=1),
                      nxt=shape(2, 2, world=2, stage=2), transformers_version="5.6.0", allow_universal=True)
    assert one.mode == "universal", "on one rank round robin changes nothing"


def test_a_lean_zero3_universal_load_slims_the_old_optimizer_file_and_keeps_the_original():
    nxt = replace(shape(2, 1, world=2, stage=3), lean_load=True, load_universal=True)
    plan = plan_resume(ckpt(deepspeed=True, zero_stage=3, world=2), prev=shape(2, 1, world=2, stage=3), nxt=nxt,
                       transformers_version="5.6.0", allow_universal=True)
    assert plan.mode == "universal" and [f.kind for f in plan.fixups] == ["ds_to_universal",
                                                                          "slim_universal_optimizer_state"]
    slim = plan.fixups[1]
    assert slim.path == OUT / "checkpoint-8" / "global_step8_universal" / "zero" / "optimizer_state.pt"
    assert slim.backup.name == "optimizer_state.pt.supervisor-orig"
