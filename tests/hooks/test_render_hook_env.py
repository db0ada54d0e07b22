"""The rendered environment switches the start-up hook on for every attempt, off per job or policy."""

from __future__ import annotations

from pathlib import Path

from supervisor.core.models import Overrides
from supervisor.intake.jobspec import parse_job_text
from supervisor.judge.policy import render_attempt
from supervisor.judge.policy.render import EMERGENCY_CKPT_ENV, HOOK_DIR

ATTEMPT = Path("/var/lib/oom-supervisor/jobs/1/attempt-2")


def render(env_yaml: str = "", overrides: Overrides | None = None):
    spec = parse_job_text(f"supervisor:\n  command: [python, train.py]\n{env_yaml}", submit_dir=Path("/w"))
    return render_attempt(spec, overrides or Overrides(), attempt_dir=ATTEMPT, resume_yaml={}, launcher=["x"])


def test_on_by_default_with_the_hook_first_on_pythonpath_and_said_why():
    r = render("  env: {PYTHONPATH: /opt/lib}\n")
    assert r.env == {EMERGENCY_CKPT_ENV: "1", "PYTHONPATH": f"{HOOK_DIR}:/opt/lib"}
    why = {c.key: c.why for c in r.changes}
    assert "last finished step" in why[EMERGENCY_CKPT_ENV] and "start-up hook" in why["PYTHONPATH"]
    assert (HOOK_DIR / "sitecustomize.py").is_file()


def test_a_job_turns_it_off():
    r = render(f"  env: {{{EMERGENCY_CKPT_ENV}: '0'}}\n")
    assert r.env == {}  # the job's own "0" reaches the process through the job's env


def test_a_policy_turns_it_off_and_the_memory_cap_still_gets_the_hook():
    r = render(overrides=Overrides(env={EMERGENCY_CKPT_ENV: "0"}))
    assert r.env == {EMERGENCY_CKPT_ENV: "0"}
    r = render(overrides=Overrides(rungs=("memory_fraction",),
                                   env={EMERGENCY_CKPT_ENV: "0", "OOM_SUPERVISOR_MEMORY_FRACTION": "0.88"}))
    assert r.env == {EMERGENCY_CKPT_ENV: "0", "OOM_SUPERVISOR_MEMORY_FRACTION": "0.88", "PYTHONPATH": str(HOOK_DIR)}
