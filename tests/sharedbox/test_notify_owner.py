"""A job's own notification commands are the job's: they run as its submitter with the job's clean
environment, never as root with the daemon's (a job file could otherwise run anything as root)."""

from __future__ import annotations

import os
import time

from supervisor.intake.jobspec import NotifySpec
from supervisor.run.identity import lookup
from supervisor.service.notify import Notifier


def test_job_commands_run_as_the_submitter_and_admin_commands_as_the_daemon(box_dir, box_users, rlog, monkeypatch):
    monkeypatch.setenv("SLACK_WEBHOOK_URL", "https://hooks.example/T0/B0/daemon-secret")
    alice = lookup(box_users["alice"].uid)
    out = box_dir / "out"
    out.mkdir(mode=0o777)
    out.chmod(0o777)
    admin = NotifySpec(command=["sh", "-c", f"id -u > {out}/admin"], on=["failed"])
    theirs = NotifySpec(command=["sh", "-c", f"id -u > {out}/job; env > {out}/job.env"], on=["failed"])
    n = Notifier([admin], log=rlog.log)
    n.send({"event": "failed", "job": 1, "_job_notify": [theirs], "_job_identity": alice, "_job_needs_identity": True})
    n.reap(wait=True)
    assert (out / "admin").read_text().strip() == "0"
    assert (out / "job").read_text().strip() == str(alice.uid)
    env = (out / "job.env").read_text()
    assert "daemon-secret" not in env and f"HOME={alice.home}" in env and "USER=alice" in env
    # no submitter known on a shared box: the job's commands do not run at all
    n.send({"event": "failed", "job": 2, "_job_notify": [NotifySpec(command=["touch", f"{out}/nobody"], on=["failed"])],
            "_job_identity": None, "_job_needs_identity": True})
    n.reap(wait=True)
    time.sleep(0.2)
    assert not (out / "nobody").exists() and "notify_job_commands_skipped" in rlog.events("warning")
    assert os.geteuid() == 0
