"""A job's environment is its own, never the daemon's (issue 17 case 2: a webhook URL configured
with `url_env` was copied into every job's environment and into environment.json and launch.json;
only OOM_SUPERVISOR_* names were dropped). A real daemon, a real job printing its environment."""

from __future__ import annotations

import json
import re

from ..conftest import DaemonProc, command_job, drop, write_config

SECRET = "https://hooks.slack.example/services/T0CASE2/B0CASE2/case2secrettoken"


def _job_env(dirs, tmp_path, **config) -> tuple[str, dict, object]:
    state, spool, work = dirs
    d = DaemonProc(state, spool, write_config(tmp_path / "c.yaml", **config), tmp_path / "d.log").start()
    try:
        drop(spool, "j.yaml", command_job(work, ["sh", "-c", "env | sort"], env={"JOB_OWN": "mine"}))
        d.wait_state(1, "succeeded")
        log = d.cli("logs", "1").stdout
    finally:
        d.stop()
    env = dict(line.split("=", 1) for line in log.splitlines() if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", line))
    return log, env, state / "jobs/1/attempt-1"


def test_case2_the_daemons_environment_never_reaches_a_job(dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("SLACK_WEBHOOK_URL", SECRET)
    monkeypatch.setenv("HF_TOKEN", "hf_the_daemons_own_token")
    monkeypatch.setenv("LC_MESSAGES", "C.UTF-8")
    log, env, attempt = _job_env(dirs, tmp_path, webhooks=[{"url_env": "SLACK_WEBHOOK_URL", "on": ["failed"]}],
                                 env={"FROM_CONFIG": "yes"})
    assert "case2secrettoken" not in log and "SLACK_WEBHOOK_URL" not in env
    assert "hf_the_daemons_own_token" not in log
    assert env["PATH"] and env["LC_MESSAGES"] == "C.UTF-8" and env["HOME"]
    assert env["JOB_OWN"] == "mine" and env["FROM_CONFIG"] == "yes"
    for f in ("environment.json", "launch.json"):
        text = (attempt / f).read_text()
        assert "case2secrettoken" not in text and "hf_the_daemons_own_token" not in text, f
        assert json.loads(text)["env"]["JOB_OWN"] == "mine"


def test_pass_env_adds_what_the_admin_lists_but_never_a_secret(dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("SLACK_WEBHOOK_URL", SECRET)
    monkeypatch.setenv("SITE_TOOLCHAIN", "/opt/site/toolchain")
    log, env, attempt = _job_env(dirs, tmp_path, webhooks=[{"url_env": "SLACK_WEBHOOK_URL", "on": ["failed"]}],
                                 pass_env=["SITE_*", "SLACK_WEBHOOK_URL"])
    assert env["SITE_TOOLCHAIN"] == "/opt/site/toolchain"
    assert "case2secrettoken" not in log, "a webhook's variable, even listed in pass_env"
    assert not [k for k in env if k.startswith("OOM_SUPERVISOR_") and k not in (
        "OOM_SUPERVISOR_ATTEMPT", "OOM_SUPERVISOR_PEAK_FILE", "OOM_SUPERVISOR_EMERGENCY_CKPT")]
    assert env["OOM_SUPERVISOR_PEAK_FILE"] == str(attempt / "user/gpu_peak.json"), "the job's own folder"
