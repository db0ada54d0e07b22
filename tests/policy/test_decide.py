"""decide() over tables of (diagnosis, history) -> decision."""

from __future__ import annotations

import pytest

from supervisor.core.models import Category, DecisionKind, Overrides, Phase
from supervisor.judge.policy import backoff_delay, decide, parse_policy_text

from .builders import GiB, attempt, diag, job, oom


def first(j, d, policy, overrides=None, ckpt=None):
    return decide(j, [attempt(1, overrides or Overrides(), d, ckpt)], d, policy)


# --- effective batch preservation ----------------------------------------------------------

@pytest.mark.parametrize("micro,accum,world,new_micro,new_accum", [
    (8, 1, 1, 4, 2),
    (6, 1, 1, 3, 2),
    (3, 3, 1, 1, 9),
    (7, 1, 1, 1, 7),
    (4, 2, 4, 2, 4),
    (12, 5, 2, 6, 10),
    (2, 1, 8, 1, 2),
])
def test_micro_batch_keeps_effective_batch_exactly(default_policy, micro, accum, world, new_micro, new_accum):
    j = job({"per_device_train_batch_size": micro, "gradient_accumulation_steps": accum}, world_size=world)
    d = first(j, oom(), default_policy)
    assert d.kind == DecisionKind.ESCALATE and d.rung == "micro_batch"
    y = d.overrides.yaml
    assert (y["per_device_train_batch_size"], y["gradient_accumulation_steps"]) == (new_micro, new_accum)
    assert new_micro * new_accum * world == micro * accum * world
    assert f"{micro}x{accum}x{world} = {new_micro}x{new_accum}x{world} unchanged" in d.reason


def test_prime_micro_batch_says_the_split_is_not_a_halving(default_policy):
    d = first(job({"per_device_train_batch_size": 7}), oom(), default_policy)
    assert "the nearest exact split of 7" in d.reason


def test_micro_batch_at_floor_is_skipped_with_reason(default_policy):
    j = job({"per_device_train_batch_size": 1, "gradient_accumulation_steps": 16})
    d = first(j, oom(), default_policy)
    assert d.rung != "micro_batch"
    assert "micro_batch: micro-batch already 1 (floor 1)" in d.reason


def test_micro_batch_targets_the_shortfall_when_numbers_allow(default_policy):
    # 1B params full FT: ~16 GiB model states on a 24 GiB card; 8 GiB short.
    j = job({"per_device_train_batch_size": 8}, param_count=1_000_000_000, gpu_capacity_bytes=24 * GiB)
    d = first(j, oom(short_gib=8, cap_gib=24), default_policy)
    assert d.rung == "micro_batch"
    # activations ~ 24 + 8.5 - 0.5 - 14.9 = ~17 GiB; halving frees 8.5 < 8*1.15, so it goes to 2
    assert d.overrides.yaml["per_device_train_batch_size"] == 2
    assert d.overrides.yaml["gradient_accumulation_steps"] == 4


# --- the rules by diagnosis -----------------------------------------------------------------

def test_fragmentation_goes_to_allocator_first_and_keeps_climbing_its_steps(default_policy):
    j = job()
    d1 = first(j, oom(frag=True), default_policy)
    assert d1.rung == "allocator"
    assert d1.overrides.env["PYTORCH_HIP_ALLOC_CONF"] == "garbage_collection_threshold:0.8,max_split_size_mb:512"
    assert d1.overrides.env["PYTORCH_CUDA_ALLOC_CONF"] == d1.overrides.env["PYTORCH_ALLOC_CONF"]
    assert d1.overrides.env["OPTIM_TORCH"] == "0"
    h = [attempt(1, Overrides(), oom(frag=True)), attempt(2, d1.overrides, oom(frag=True))]
    d2 = decide(j, h, oom(frag=True), default_policy)
    assert d2.rung == "allocator" and "max_split_size_mb:256" in d2.overrides.env["PYTORCH_HIP_ALLOC_CONF"]


def test_expandable_segments_only_on_cuda(default_policy):
    ov = Overrides(env={"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.8,max_split_size_mb:128"})
    hip = first(job(), oom(frag=True, vendor="hip"), default_policy, ov)
    assert hip.rung != "allocator"
    assert "allocator: allocator settings already at their last step" in hip.reason
    cuda = first(job(), oom(frag=True, vendor="cuda"), default_policy, ov)
    assert cuda.rung == "allocator"
    assert cuda.overrides.env["PYTORCH_CUDA_ALLOC_CONF"] == (
        "garbage_collection_threshold:0.8,expandable_segments:True")


def test_plain_oom_tries_allocator_late(default_policy):
    d = first(job(), oom(short_gib=2), default_policy)
    assert d.rung == "micro_batch"


def test_fragmentation_with_too_little_reserved_memory_skips_allocator(default_policy):
    d = first(job(), oom(short_gib=2, reserved_gib=0.1, frag=True), default_policy)
    assert d.rung == "micro_batch"
    assert "allocator: frees ~0.10 GiB, cannot close 2.00 GiB" in d.reason


def test_library_oom_goes_to_memory_fraction_hook_on_old_torch(default_policy):
    d = first(job(torch_version="2.5.1"), oom(subkind="library"), default_policy)
    assert d.rung == "memory_fraction"
    assert d.overrides.env == {"OOM_SUPERVISOR_MEMORY_FRACTION": "0.88"}


def test_memory_fraction_uses_the_allocator_option_on_new_torch(default_policy):
    d = first(job(torch_version="2.14.1+cu128"), oom(subkind="driver"), default_policy)
    assert d.rung == "memory_fraction"
    assert d.overrides.env["PYTORCH_CUDA_ALLOC_CONF"] == "per_process_memory_fraction:0.88"


def test_memory_fraction_for_vllm_jobs_sets_vllm_gpu_util(default_policy):
    d = first(job(uses_vllm=True), oom(subkind="library"), default_policy)
    assert d.overrides.yaml == {"vllm_gpu_util": 0.88}


def test_model_load_oom_goes_straight_to_offload(default_policy):
    d = first(job(visible_gpu_count=0), oom(Phase.MODEL_LOAD), default_policy)  # a CPU box
    assert d.rung == "zero3_offload_param"
    assert d.overrides.env["FORCE_TORCHRUN"] == "1" and d.overrides.env["NPROC_PER_NODE"] == "1"
    zero = d.overrides.deepspeed["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"] == {"device": "cpu", "pin_memory": True}


def test_model_load_oom_on_several_gpus_tries_partitioning_first(default_policy):
    d = first(job(world_size=4), oom(Phase.MODEL_LOAD), default_policy)
    assert d.rung == "zero3_offload_optimizer"
    assert d.overrides.env["NPROC_PER_NODE"] == "4"
    assert "offload_param" not in d.overrides.deepspeed["zero_optimization"]


def test_eval_oom_lowers_eval_batch_not_training_batch(default_policy):
    d = first(job({"per_device_eval_batch_size": 8}), oom(Phase.EVALUATION), default_policy)
    assert d.rung == "eval_batch"
    assert d.overrides.yaml == {"per_device_eval_batch_size": 4}


def test_resume_oom_adds_param_offload_not_a_batch_change(default_policy):
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    d = first(job(deepspeed_config=ds), oom(Phase.RESUME), default_policy, ckpt=40)
    assert d.rung == "zero3_offload_param"
    assert "per_device_train_batch_size" not in d.overrides.yaml


def test_resume_oom_never_turns_optimizer_offload_on_under_a_zero3_checkpoint(default_policy):
    ds = {"zero_optimization": {"stage": 3}}
    d = first(job(deepspeed_config=ds), oom(Phase.RESUME, frag=True), default_policy, ckpt=40)
    assert d.rung == "allocator"
    assert "KeyError 'bias_correction'" in d.reason


def test_resume_oom_without_deepspeed_does_not_switch_to_it(default_policy):
    d = first(job(), oom(Phase.RESUME, frag=True), default_policy, ckpt=40)
    assert d.rung == "allocator"
    assert "ZeRO-3 cannot load them" in d.reason


def test_big_shortfall_skips_rungs_that_cannot_close_it(default_policy):
    # 7B full fine-tune, 40 GiB short: batch halving cannot close it; offload can.
    j = job({"per_device_train_batch_size": 2, "use_unsloth_gc": True}, param_count=7_000_000_000,
            gpu_capacity_bytes=192 * GiB)
    d = first(j, oom(short_gib=70, cap_gib=192), default_policy)
    assert d.rung == "zero3_offload_optimizer"
    assert "micro_batch: frees" in d.reason and "cannot close 70.00 GiB" in d.reason


def test_host_oom_without_offload_splits_the_batch(default_policy):
    d = first(job(), oom(category=__import__("supervisor.core.models").core.models.Category.HOST_OOM, vendor="cpu"),
              default_policy)
    assert d.rung == "micro_batch"


def test_host_oom_after_param_offload_steps_back_and_reports_ram(default_policy):
    j = job(param_count=8_000_000_000, host_ram_bytes=256 * GiB)
    load = oom(Phase.MODEL_LOAD)
    d1 = first(j, load, default_policy)
    assert d1.rung == "zero3_offload_param"
    host = oom(category=Category.HOST_OOM, vendor="cpu")
    d2 = decide(j, [attempt(1, Overrides(), load), attempt(2, d1.overrides, host)], host, default_policy)
    assert d2.kind == DecisionKind.ESCALATE and d2.rung == "zero3_offload_optimizer"
    assert "offload_param" not in d2.overrides.deepspeed["zero_optimization"]
    assert "host RAM" in d2.reason and "GiB" in d2.reason


def test_never_repeats_a_configuration_that_failed_with_oom(default_policy):
    j = job({"per_device_train_batch_size": 2})
    d1 = first(j, oom(), default_policy)
    assert d1.rung == "micro_batch"
    # Pretend the user's own config (attempt 1) equals what the next rung would produce.
    h = [attempt(1, d1.overrides, oom()), attempt(2, Overrides(), oom())]
    d2 = decide(j, h, oom(), default_policy)
    assert d2.overrides.fingerprint() not in {a.overrides.fingerprint() for a in h}
    assert "micro_batch: that configuration already failed with an OOM" in d2.reason


def test_grad_checkpointing_only_when_off_then_unsloth(default_policy):
    off = job({"disable_gradient_checkpointing": True, "per_device_train_batch_size": 1})
    d = first(off, oom(), default_policy)
    assert d.rung == "grad_checkpointing" and d.overrides.yaml == {"disable_gradient_checkpointing": False}
    on = job({"per_device_train_batch_size": 1})
    d = first(on, oom(), default_policy)
    assert d.rung == "grad_checkpointing" and d.overrides.yaml == {"use_unsloth_gc": True}


def test_lora_skips_optimizer_offload_when_it_cannot_help(default_policy):
    j = job({"finetuning_type": "lora", "per_device_train_batch_size": 1}, param_count=8_000_000_000)
    ov = Overrides(yaml={"use_unsloth_gc": True})
    d = first(j, oom(short_gib=6, cap_gib=24), default_policy, ov)
    assert d.rung == "zero3_offload_param"
    assert "zero3_offload_optimizer: frees" in d.reason


def test_command_jobs_get_only_environment_remedies(default_policy):
    d = first(job(kind="command"), oom(), default_policy)
    assert d.rung in ("allocator", "memory_fraction")
    assert not d.overrides.yaml and d.overrides.deepspeed is None


def test_micro_batch_on_resume_with_old_transformers_is_still_taken(default_policy):
    # The resume plan patches trainer_state.json for transformers < 5.2 (#43708).
    d = first(job(transformers_version="5.1.0"), oom(), default_policy, ckpt=20)
    assert d.rung == "micro_batch"


def test_cutoff_len_only_where_the_policy_allows_data_changes(default_policy, long_context_policy):
    j = job({"per_device_train_batch_size": 1, "cutoff_len": 4096})
    ov = Overrides(yaml={"use_unsloth_gc": True},
                   deepspeed={"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                    "offload_param": {"device": "cpu"}}},
                   env={"OOM_SUPERVISOR_MEMORY_FRACTION": "0.88",
                        "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.8,max_split_size_mb:128"})
    assert first(j, oom(), default_policy, ov).kind == DecisionKind.FAIL
    d = first(j, oom(), long_context_policy, ov)
    assert d.rung == "cutoff_len" and d.overrides.yaml["cutoff_len"] == 2048
    assert "CHANGES THE DATA" in d.reason


def test_conservative_never_changes_batch_or_data(conservative_policy):
    d = first(job(), oom(), conservative_policy)
    assert d.rung in ("allocator", "zero3_offload_optimizer")
    assert "per_device_train_batch_size" not in d.overrides.yaml


# --- other causes ---------------------------------------------------------------------------

@pytest.mark.parametrize("category,kind", [
    (Category.SUCCESS, DecisionKind.DONE),
    (Category.CONFIG_ERROR, DecisionKind.FAIL),
    (Category.DISK_FULL, DecisionKind.PAUSE),
    (Category.COMM_FAILURE, DecisionKind.RETRY),
    (Category.HANG, DecisionKind.RETRY),
    (Category.DEVICE_FAULT, DecisionKind.RETRY),
    (Category.NUMERIC, DecisionKind.FAIL),
])
def test_cause_to_decision(default_policy, category, kind):
    assert first(job(), diag(category, "x"), default_policy).kind == kind


def test_config_error_fails_with_the_message(default_policy):
    d = first(job(), diag(Category.CONFIG_ERROR, "Some keys are not used: ['compute_type']"), default_policy)
    assert "compute_type" in d.reason


def test_transient_retries_keep_config_with_growing_backoff_then_fail(default_policy):
    ov = Overrides(yaml={"per_device_train_batch_size": 4})
    h, delays = [], []
    for n in range(1, 6):
        h.append(attempt(n, ov, diag(Category.COMM_FAILURE), ckpt=n * 10))
        d = decide(job(), h, diag(Category.COMM_FAILURE), default_policy)
        if d.kind != DecisionKind.RETRY:
            break
        assert d.overrides == ov
        delays.append(d.delay_s)
    assert len(delays) == 3 and d.kind == DecisionKind.FAIL
    assert delays[0] < delays[1] < delays[2]


def test_backoff_is_pure_and_bounded(default_policy):
    assert backoff_delay(default_policy, 2, 5) == backoff_delay(default_policy, 2, 5)
    assert 60 <= backoff_delay(default_policy, 2, 5) <= 70
    assert backoff_delay(default_policy, 30, 5) <= default_policy.backoff.max_s


def test_device_fault_retries_once_then_fails(default_policy):
    f = diag(Category.DEVICE_FAULT)
    h = [attempt(1, Overrides(), f), attempt(2, Overrides(), f)]
    assert decide(job(), h, f, default_policy).kind == DecisionKind.FAIL


def test_numeric_retry_only_when_policy_allows():
    p = parse_policy_text("name: p\nladder: [allocator]\nretry_numeric: true\nbudgets: {numeric_retries: 1}\n")
    assert first(job(), diag(Category.NUMERIC), p).kind == DecisionKind.RETRY


def test_total_attempt_budget(default_policy):
    h = [attempt(n, Overrides(), diag(Category.COMM_FAILURE), ckpt=n) for n in range(1, 4)]
    assert decide(job(max_attempts=3), h, diag(Category.COMM_FAILURE), default_policy).kind == DecisionKind.FAIL


def test_oom_escalation_budget():
    p = parse_policy_text("name: p\nladder: [micro_batch]\nbudgets: {oom_escalations: 2}\n")
    j = job({"per_device_train_batch_size": 64})
    h = []
    ov = Overrides()
    kinds = []
    for n in range(1, 5):
        h.append(attempt(n, ov, oom(), ckpt=n))
        d = decide(j, h, oom(), p)
        kinds.append(d.kind)
        ov = d.overrides or ov
    assert kinds == [DecisionKind.ESCALATE, DecisionKind.ESCALATE, DecisionKind.FAIL, DecisionKind.FAIL]
    assert "escalation budget" in d.reason


def test_no_progress_budget_stops_a_crash_loop():
    p = parse_policy_text("name: p\nladder: [allocator]\nbudgets: {no_progress_attempts: 2, transient_retries: 9}\n")
    h = [attempt(1, Overrides(), diag(Category.HANG), ckpt=50), attempt(2, Overrides(), diag(Category.HANG), ckpt=50),
         attempt(3, Overrides(), diag(Category.HANG), ckpt=50)]
    d = decide(job(), h, diag(Category.HANG), p)
    assert d.kind == DecisionKind.FAIL and "no checkpoint progress" in d.reason
    progressing = [attempt(1, Overrides(), diag(Category.HANG), ckpt=50),
                   attempt(2, Overrides(), diag(Category.HANG), ckpt=60)]
    assert decide(job(), progressing, diag(Category.HANG), p).kind == DecisionKind.RETRY


def test_decide_is_pure(default_policy):
    j, d = job(), oom(frag=True)
    h = [attempt(1, Overrides(), d)]
    assert decide(j, h, d, default_policy) == decide(j, h, d, default_policy)


def test_changes_name_the_users_value_not_none(default_policy):
    j = job({"per_device_train_batch_size": 16, "gradient_accumulation_steps": 1})
    d = first(j, oom(), default_policy)
    olds = {c.key: (c.old, c.new) for c in d.changes}
    assert olds["per_device_train_batch_size"] == (16, 8)
    assert olds["gradient_accumulation_steps"] == (1, 2)
