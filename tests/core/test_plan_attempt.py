"""The plan step over plain values: every refusal and every remedy source, in milliseconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from supervisor.core.models import Overrides
from supervisor.intake.jobspec import parse_job_text
from supervisor.judge.plan import (
    AttemptPlan,
    JobFacts,
    Learned,
    Refuse,
    ResumeFacts,
    compose_environment,
    plan_attempt,
    world_keeping_batch,
)
from supervisor.judge.policy import BUILTIN_POLICY_DIR, load_policy
from supervisor.judge.resume import Checkpoint, Incomplete, Scan

WORK = Path("/srv/work")
OUT = WORK / "out"
POLICY = load_policy("default", search_dirs=[BUILTIN_POLICY_DIR])
MICRO = Overrides(rungs=("micro_batch",), yaml={"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4})


def lf_spec(**extra):
    cfg = {"model_name_or_path": "/models/tiny", "stage": "sft", "do_train": True, "finetuning_type": "full",
           "dataset": "alpaca", "template": "default", "output_dir": "out", "per_device_train_batch_size": 16,
           "gradient_accumulation_steps": 1, **extra}
    return parse_job_text(yaml.safe_dump(cfg), source="job.yaml", submit_dir=WORK, check_lf=False)


def command_spec(**sup):
    text = yaml.safe_dump({"supervisor": {"command": ["python", "train.py"], "workdir": str(WORK), **sup}})
    return parse_job_text(text, source="job.yaml", submit_dir=WORK, check_lf=False)


def ckpt(step=8, **kw) -> Checkpoint:
    fields = dict(path=OUT / f"checkpoint-{step}", step=step, deepspeed=False, zero_stage=None, world_size=1,
                  train_batch_size=16, has_weights=True, adapter=False, has_optimizer=True)
    return Checkpoint(**{**fields, **kw})


def facts(spec=None, **kw) -> JobFacts:
    spec = spec or lf_spec()
    base = dict(job_id=7, number=1, spec=spec, policy=POLICY, launcher=("llamafactory-cli",),
                attempt_dir=Path("/state/jobs/7/attempt-1"), base_env={"PATH": "/usr/bin"},
                resume=ResumeFacts(scan=Scan((), ()), prev_overrides=None, transformers_version="5.6.0")
                if spec.kind == "llamafactory" else None, default_hang_timeout=2700.0)
    return JobFacts(**{**base, **kw})


def planned(f: JobFacts) -> AttemptPlan:
    out = plan_attempt(f)
    assert isinstance(out, AttemptPlan), out
    return out


def effective(p: AttemptPlan) -> dict:
    return yaml.safe_load(p.rendered.files["effective.yaml"])


# --- refusals ---------------------------------------------------------------------------------------

def test_too_many_crash_interruptions_refuse():
    out = plan_attempt(facts(crash_interruptions=5, max_interruptions=5))
    assert isinstance(out, Refuse) and "restarted 5 times" in out.reason and "retry 7" in out.reason


def test_an_unreadable_job_file_refuses_with_its_error():
    out = plan_attempt(JobFacts(job_id=7, number=2, spec=None, spec_error="supervisor.frobnicate: unknown key"))
    assert out == Refuse("job file no longer valid: supervisor.frobnicate: unknown key")


def test_a_learned_refusal_refuses_a_first_attempt():
    out = plan_attempt(facts(learned=Learned(refusal="needs 2 TiB of host RAM")))
    assert isinstance(out, Refuse) and "this box cannot run the job" in out.reason and "2 TiB" in out.reason


def test_no_policy_refuses_only_where_a_resume_needs_one():
    out = plan_attempt(facts(policy=None, policy_error="no policy named 'x'"))
    assert out == Refuse("cannot plan the resume: no policy named 'x'")
    assert isinstance(plan_attempt(facts(command_spec(), policy=None, policy_error="x")), AttemptPlan)


def test_a_resume_the_policy_cannot_allow_refuses_or_restarts_loudly():
    """A ZeRO-3 checkpoint of 2 ranks, a next attempt on 1 without DeepSpeed: the optimizer state
    cannot follow; the default policy allows no weights-only continuation, so the run restarts,
    said as a semantic change, and the checkpoints are archived (a fixup), never deleted."""
    ds = ckpt(deepspeed=True, zero_stage=3, world_size=2, ds_tag="global_step8")
    p = planned(facts(resume=ResumeFacts(scan=Scan((ds,), ()), prev_overrides=None, transformers_version="5.6.0")))
    assert p.resume.mode == "restart" and p.resume.fixups[0].kind == "archive_checkpoints"
    assert [e.kind for e in p.before_launch] == ["resume_plan", "semantic_change"]
    assert effective(p)["resume_from_checkpoint"] is None


def test_a_universal_resume_writes_the_attempts_own_copy_of_the_users_deepspeed_json():
    """Issue 19: the job's own DeepSpeed JSON (no generated ds_config.json) was refused ("the resume
    needs DeepSpeed settings ['checkpoint'] but this attempt has no generated DeepSpeed config").
    Now the attempt gets its own copy with the key merged, and the effective batch is kept on the
    one rank it runs on (16x1x2 = 16x2x1)."""
    ds = ckpt(deepspeed=True, zero_stage=3, world_size=2, ds_tag="global_step8")
    zero3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
             "checkpoint": {"tag_validation": "warn"}}
    p = planned(facts(lf_spec(deepspeed="ds.json"), job_deepspeed=zero3, world_size=1, asked_world_size=2,
                      resume=ResumeFacts(scan=Scan((ds,), ()), prev_overrides=None, transformers_version="5.6")))
    assert p.resume.mode == "universal" and [f.kind for f in p.resume.fixups] == ["ds_to_universal"]
    copy = json.loads(p.rendered.files["ds_config.json"])
    assert copy == {**zero3, "checkpoint": {"tag_validation": "warn", "load_universal": True}}
    assert zero3["checkpoint"] == {"tag_validation": "warn"}, "the user's config is never edited"
    eff = effective(p)
    assert eff["deepspeed"] == "/state/jobs/7/attempt-1/ds_config.json"
    assert (eff["per_device_train_batch_size"], eff["gradient_accumulation_steps"]) == (16, 2)
    assert p.overrides == Overrides(), "the recorded remedies stay those of the asked world size"
    assert "world size 2 -> 1: gradient_accumulation_steps 1 -> 2; effective batch 16x1x2 = 16x2x1 = 32 kept" \
        in p.remedy and p.remedy in p.started
    assert [e.kind for e in p.before_launch] == ["world_size_change", "resume_plan"]
    assert p.resume.semantic_change is None and p.world_size == 1


def test_explicit_batch_fields_of_the_users_json_follow_the_new_world_size():
    ds = ckpt(deepspeed=True, zero_stage=3, world_size=2, ds_tag="global_step8")
    fixed = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 16,
             "gradient_accumulation_steps": 1, "train_batch_size": 32}
    p = planned(facts(lf_spec(deepspeed="ds.json"), job_deepspeed=fixed, world_size=1, asked_world_size=2,
                      resume=ResumeFacts(scan=Scan((ds,), ()), prev_overrides=None, transformers_version="5.6")))
    copy = json.loads(p.rendered.files["ds_config.json"])
    assert (copy["train_micro_batch_size_per_gpu"], copy["gradient_accumulation_steps"], copy["train_batch_size"]) \
        == (16, 2, 32) and copy["checkpoint"] == {"load_universal": True}


def test_a_ddp_checkpoint_across_a_world_size_change_resumes_exactly_and_says_what_carries_over():
    plain = ckpt(world_size=2)
    p = planned(facts(world_size=1, asked_world_size=2, resume=ResumeFacts(
        scan=Scan((plain,), ()), prev_overrides=Overrides(), transformers_version="5.6.0")))
    assert p.resume.mode == "exact" and p.resume.semantic_change is None
    assert "world size 2 -> 1" in p.resume.reason and "per parameter, not per rank" in p.resume.reason
    assert effective(p)["gradient_accumulation_steps"] == 2


def test_back_on_every_asked_gpu_nothing_is_adjusted_and_a_pinned_rank_count_follows_the_gpus():
    assert planned(facts(world_size=2, asked_world_size=2)).remedy is None
    pinned = lf_spec()
    pinned = pinned.__class__(**{**pinned.__dict__, "sup": pinned.sup.model_copy(
        update={"env": {"NPROC_PER_NODE": "4", "FORCE_TORCHRUN": "1"}})})
    p = planned(facts(pinned, world_size=2, asked_world_size=4))
    assert p.env["NPROC_PER_NODE"] == "2" and effective(p)["gradient_accumulation_steps"] == 2


def test_an_effective_batch_that_cannot_be_split_over_the_ranks_left_refuses_with_numbers():
    out = plan_attempt(facts(lf_spec(per_device_train_batch_size=3), world_size=2, asked_world_size=3))
    assert isinstance(out, Refuse) and "3x1x3 = 9 cannot be split exactly over 2" in out.reason
    assert world_keeping_batch({"per_device_train_batch_size": 3}, 3, 2) == 1
    assert world_keeping_batch({"per_device_train_batch_size": 4}, 4, 3) == 2


def test_a_yaml_and_deepspeed_json_transformers_would_refuse_together_refuse():
    fixed = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 3}
    out = plan_attempt(facts(lf_spec(deepspeed="ds.json"), job_deepspeed=fixed))
    assert isinstance(out, Refuse) and "transformers refuses together" in out.reason


# --- remedy sources ---------------------------------------------------------------------------------

def test_the_job_as_written():
    p = planned(facts())
    assert p.source == "job" and p.overrides == Overrides() and p.remedy is None
    assert p.started == "attempt 1 started" and p.at_start == ()
    assert effective(p)["per_device_train_batch_size"] == 16 and effective(p)["resume_from_checkpoint"] is None
    assert p.hang_timeout == 2700.0 and p.output_dir == OUT


def test_the_escalation_the_last_verdict_chose_wins_over_anything_learned():
    p = planned(facts(number=3, escalation=MICRO, learned=Learned(refusal="never used")))
    assert p.source == "escalation" and p.overrides == MICRO
    assert p.remedy == "micro_batch (per_device_train_batch_size=4, gradient_accumulation_steps=4)"
    assert "remedy: micro_batch" in p.started and effective(p)["gradient_accumulation_steps"] == 4


def test_a_learned_start_for_a_first_attempt_is_said_when_it_starts():
    why = "learned: jobs of this kind ran out of memory at 16x1; starting at 4x4"
    p = planned(facts(learned=Learned(overrides=MICRO, why=why)))
    assert p.source == "learned" and p.overrides == MICRO and why in p.started
    assert [(e.kind, e.message) for e in p.at_start] == [("learned_plan", why)]
    assert p.at_start[0].data["overrides"]["yaml"]["per_device_train_batch_size"] == 4


@pytest.mark.parametrize("case", ["second attempt", "command job"])
def test_learned_starts_apply_only_to_first_attempts_of_kinds_that_learn(case):
    learned = Learned(overrides=MICRO, why="learned")
    f = facts(number=2, learned=learned) if case == "second attempt" else facts(command_spec(), learned=learned)
    p = planned(f)
    assert p.source == "job" and p.overrides == Overrides()


def test_resume_fixups_and_quarantine_come_with_the_plan():
    """transformers 5.1 restores the old micro-batch from trainer_state.json: the plan patches it."""
    bad = Incomplete(OUT / "checkpoint-12", 12, "no trainer_state.json")
    scan = Scan((ckpt(8),), (bad,))
    f = facts(number=2, escalation=MICRO,
              resume=ResumeFacts(scan=scan, prev_overrides=Overrides(), transformers_version="5.1.2"))
    p = planned(f)
    assert p.quarantine == (bad,)
    assert p.resume.mode == "exact" and p.resumed_from == str(OUT / "checkpoint-8") and p.resumed_step == 8
    assert [fx.kind for fx in p.resume.fixups] == ["patch_train_batch_size"]
    assert effective(p)["resume_from_checkpoint"] == str(OUT / "checkpoint-8")
    assert [e.kind for e in p.before_launch] == ["resume_plan"]
    assert "resuming from" in p.started and p.retention == (2, 2)


def test_a_policy_can_switch_the_emergency_checkpoint_off_for_every_attempt():
    off = POLICY.model_copy(update={"emergency_checkpoint": False})
    assert planned(facts(policy=off)).env["OOM_SUPERVISOR_EMERGENCY_CKPT"] == "0"
    assert planned(facts(policy=off)).overrides == Overrides(), "a switch, not a remedy"
    assert planned(facts()).env.get("OOM_SUPERVISOR_EMERGENCY_CKPT") != "0"


def test_a_policy_sets_the_budget_of_a_multi_rank_emergency_save():
    assert "OOM_SUPERVISOR_EMERGENCY_BUDGET_S" not in planned(facts()).env  # the hook's default
    timed = POLICY.model_copy(update={"emergency_budget_s": 90.0})
    assert planned(facts(policy=timed)).env["OOM_SUPERVISOR_EMERGENCY_BUDGET_S"] == "90"
    assert planned(facts(policy=timed)).overrides == Overrides(), "a switch, not a remedy"


def test_a_generated_deepspeed_config_is_rendered_and_checked():
    zero3 = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
             "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    p = planned(facts(number=2, escalation=Overrides(rungs=("zero3_offload_optimizer",), deepspeed=zero3)))
    assert json.loads(p.rendered.files["ds_config.json"]) == zero3
    assert effective(p)["deepspeed"] == "/state/jobs/7/attempt-1/ds_config.json"


# --- the environment --------------------------------------------------------------------------------

def test_the_environment_puts_the_assigned_gpus_and_the_hook_first():
    env = compose_environment({"PATH": "/bin", "HIP_VISIBLE_DEVICES": "0,1", "PYTHONPATH": "/user/lib"},
                              {"HSA_FORCE_FINE_GRAIN_PCIE": "1"}, {"PYTHONPATH": "/hooks"},
                              {"ROCR_VISIBLE_DEVICES": "2,3"})
    assert env["ROCR_VISIBLE_DEVICES"] == "2,3" and "HIP_VISIBLE_DEVICES" not in env
    assert env["PYTHONPATH"] == "/hooks:/user/lib" and env["HSA_FORCE_FINE_GRAIN_PCIE"] == "1"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_a_command_job_runs_its_argv_with_its_own_env_and_no_resume():
    p = planned(facts(command_spec(env={"A": "1"}, hang_timeout="10m")))
    assert p.rendered.argv == ["python", "train.py"] and p.env["A"] == "1" and p.env["PATH"] == "/usr/bin"
    assert p.resume is None and p.output_dir is None and p.hang_timeout == 600
