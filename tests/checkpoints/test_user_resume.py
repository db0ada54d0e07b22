"""A user's own resume_from_checkpoint (a path, true, auto, false): honoured or replaced, said why.

Checkpoint folders are laid out on disk the way transformers 5.6 writes them (names; contents
faked as in test_scan); the plan is the real plan_attempt, the fixups the real apply_fixups.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from supervisor.intake.jobspec import parse_job_text
from supervisor.intake.llamafactory.validate import validate_config
from supervisor.judge.plan import AttemptPlan, JobFacts, Refuse, ResumeFacts, plan_attempt
from supervisor.judge.policy import BUILTIN_POLICY_DIR, load_policy
from supervisor.judge.resume import ARCHIVE_DIR
from supervisor.judge.user_resume import choose_checkpoint, user_value
from supervisor.run.checkpoints import apply_fixups, inspect_path, scan_output_dir
from tests.checkpoints.test_scan import PLAIN, make

POLICY = load_policy("default", search_dirs=[BUILTIN_POLICY_DIR])


def spec_for(work: Path, value):
    cfg = {"model_name_or_path": "/models/tiny", "stage": "sft", "do_train": True, "finetuning_type": "full",
           "dataset": "alpaca", "template": "default", "output_dir": "out", "per_device_train_batch_size": 4}
    if value is not ...:
        cfg["resume_from_checkpoint"] = value
    return parse_job_text(yaml.safe_dump(cfg), source="job.yaml", submit_dir=work, check_lf=False)


def plan_for(work: Path, value, *, number: int = 1) -> AttemptPlan | Refuse:
    """The facts as daemon/facts.py gathers them, then the pure plan."""
    spec = spec_for(work, value)
    out = work / "out"
    asked = user_value(spec.config)
    user = inspect_path(spec.resolve(asked), out) if asked not in (None, "true", "false", "auto") else None
    facts = JobFacts(job_id=3, number=number, spec=spec, policy=POLICY, launcher=("llamafactory-cli",),
                     attempt_dir=work / f"attempt-{number}",
                     resume=ResumeFacts(scan=scan_output_dir(out), prev_overrides=None,
                                        transformers_version="5.6.0", user=user))
    return plan_attempt(facts)


def rendered_resume(p: AttemptPlan):
    return yaml.safe_load(p.rendered.files["effective.yaml"])["resume_from_checkpoint"]


def note(p: AttemptPlan) -> str:
    return next(e.message for e in p.before_launch if e.kind == "resume_choice")


@pytest.fixture
def work(tmp_path):
    out = tmp_path / "out"
    make(out, 4, PLAIN)
    make(out, 8, PLAIN)
    make(out, 12, PLAIN, state=None)  # killed while saving: no trainer_state.json
    return tmp_path


@pytest.mark.parametrize("raw,read", [(True, "true"), ("True", "true"), (False, "false"), ("auto", "auto"),
                                      (" out/checkpoint-4 ", "out/checkpoint-4"), (None, None), ("", None)])
def test_the_value_is_read_as_yaml_and_transformers_give_it(raw, read):
    assert user_value({"resume_from_checkpoint": raw}) == read


def test_true_is_valid_in_a_job_file():
    """transformers' Trainer.train takes a bool; the frozen key list types the field `str` only,
    which refused `resume_from_checkpoint: true` at submit (failed before the fix)."""
    assert validate_config({"resume_from_checkpoint": True}, workdir=Path("/w")) == []
    assert validate_config({"resume_from_checkpoint": "out/checkpoint-4"}, workdir=Path("/w")) == []
    assert validate_config({"do_train": "yes"}, workdir=Path("/w")) != []  # other keys stay strict


def test_true_takes_the_newest_complete_checkpoint_not_the_half_written_one(work):
    p = plan_for(work, True)
    assert rendered_resume(p) == str(work / "out" / "checkpoint-8")
    assert "checkpoint-8" in note(p) and "checkpoint-12, which is incomplete" in note(p)
    assert [i.path.name for i in p.quarantine] == ["checkpoint-12"]


def test_true_with_nothing_complete_refuses_the_first_attempt_with_what_was_found(tmp_path):
    make(tmp_path / "out", 12, PLAIN, state=None)
    out = plan_for(tmp_path, True)
    assert isinstance(out, Refuse) and "no complete checkpoint" in out.reason
    assert "checkpoint-12 is incomplete" in out.reason and "No valid checkpoint found" in out.reason


def test_auto_is_read_as_the_newer_trainer_reads_it(work, tmp_path):
    p = plan_for(work, "auto")
    assert rendered_resume(p) == str(work / "out" / "checkpoint-8") and "0.9.5 would" in note(p)
    empty = tmp_path / "empty"
    empty.mkdir()
    fresh = plan_for(empty, "auto")
    assert fresh.resume.mode == "fresh" and "from step 0 as `auto` does" in note(fresh)


def test_a_complete_path_is_honoured_and_newer_checkpoints_are_set_aside(work):
    p = plan_for(work, "out/checkpoint-4")
    assert rendered_resume(p) == str(work / "out" / "checkpoint-4") and "as asked" in note(p)
    assert "checkpoint-8, checkpoint-12" in note(p) and "set aside" in note(p)
    apply_fixups(p.resume)
    assert [x.name for x in (work / "out").glob("checkpoint-*")] == ["checkpoint-4"]
    assert (work / "out" / ARCHIVE_DIR / "attempt-1-newer-than-step-4" / "checkpoint-8").is_dir()
    # The second attempt continues from what this job wrote after the user's choice, not before it.
    make(work / "out", 6, PLAIN)
    later = plan_for(work, "out/checkpoint-4", number=2)
    assert rendered_resume(later) == str(work / "out" / "checkpoint-6") and "this job wrote" in note(later)


def test_an_incomplete_path_is_replaced_by_the_newest_complete_one_with_the_reason(work):
    p = plan_for(work, "out/checkpoint-12")
    assert rendered_resume(p) == str(work / "out" / "checkpoint-8")
    assert "out/checkpoint-12 is incomplete (no trainer_state.json" in note(p)
    assert "the newest complete one there is checkpoint-8" in note(p)


def test_a_path_of_another_run_is_read_there_and_its_folder_is_never_archived(work, tmp_path):
    other = tmp_path / "other-run"
    make(other, 20, PLAIN)
    make(other, 30, PLAIN, state='{"global_step": 30, "lo')
    p = plan_for(work, str(other / "checkpoint-30"))
    assert rendered_resume(p) == str(other / "checkpoint-20") and "checkpoint-20: resuming from it" in note(p)
    assert all(fx.path == work / "out" for fx in p.resume.fixups)  # only our output_dir is ever touched


def test_a_missing_path_refuses_the_first_attempt_and_names_what_exists(work):
    out = plan_for(work, "out/checkpoint-99")
    assert isinstance(out, Refuse) and "does not exist" in out.reason and "checkpoint-4, checkpoint-8" in out.reason


def test_false_starts_from_zero_and_sets_an_earlier_runs_checkpoints_aside(work):
    p = plan_for(work, False)
    assert p.resume.mode == "fresh" and rendered_resume(p) is None
    assert "an earlier run's" in note(p)
    apply_fixups(p.resume)
    assert list((work / "out").glob("checkpoint-*")) == []
    assert (work / "out" / ARCHIVE_DIR / "attempt-1-before-this-job" / "checkpoint-8").is_dir()
    make(work / "out", 2, PLAIN)  # attempt 1 saved, then failed: attempt 2 continues from it
    later = plan_for(work, False, number=2)
    assert rendered_resume(later) == str(work / "out" / "checkpoint-2") and "held for the first attempt" in note(later)


def test_without_the_key_nothing_is_said(work):
    p = plan_for(work, ...)
    assert rendered_resume(p) == str(work / "out" / "checkpoint-8")
    assert not [e for e in p.before_launch if e.kind == "resume_choice"]
    assert choose_checkpoint(None, scan=scan_output_dir(work / "out"), user=None, first_attempt=True).note is None
