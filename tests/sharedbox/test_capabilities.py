"""The unit's capability set, run for real: the daemon as root under exactly the unit's bounding
set (setpriv, with no_new_privs as NoNewPrivileges=yes) runs alice's job as alice and stops it on
cancel; without any one of the five, something a shared box needs fails, and says so."""

from __future__ import annotations

import re
import signal
import time

import psutil
import pytest

from supervisor.core.paths import SpoolPaths
from supervisor.intake.spool import prepare_spool
from supervisor.run.identity import SubmitGate

from .conftest import SUBMIT, UNITS_CAPS, unit_privileges

JOB = {"command": ["sh", "-c", "echo uid=$(id -u); exec sleep 120"]}


def _daemon(box, caps: list[str]):
    b = box()
    b.spool.mkdir()
    for d in ("incoming", "rejected"):
        (b.spool / d).mkdir()
    prepare_spool(SpoolPaths(b.spool), SubmitGate(SUBMIT))  # as tmpfiles would: the daemon need not chown it
    return b.start(prefix=unit_privileges(caps))


def _submit(b, user: str = "alice"):
    work = b.workdir(user)
    (work / "j.yaml").write_text(f"supervisor: {{name: capcheck, command: {JOB['command']!r}}}\n".replace("'", '"'))
    import os

    u = b.users[user]
    os.chown(work / "j.yaml", u.uid, u.gid)
    return b.cli(user, "submit", str(work / "j.yaml"), "--wait", "30", cwd=work)


def _job_procs(uid: int) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["uids", "cmdline"])
            if p.info["uids"] and p.info["uids"].real == uid and "sleep" in (p.info["cmdline"] or [])]


def _cleanup(uid: int) -> None:
    for p in _job_procs(uid):
        p.send_signal(signal.SIGKILL)


def test_the_units_five_capabilities_run_a_job_as_its_user_and_stop_it(box, box_users):
    b = _daemon(box, UNITS_CAPS)
    res = _submit(b)
    assert res.returncode == 0, res.stderr
    job = int(res.stdout.split()[-1])
    b.wait_for(lambda: "uid=" in b.cli("alice", "logs", str(job)).stdout, 60, "the job's output")
    assert f"uid={box_users['alice'].uid}" in b.cli("alice", "logs", str(job)).stdout
    assert b.cli("alice", "cancel", str(job)).returncode == 0
    b.wait_state(job, "cancelled", 60)
    assert not _job_procs(box_users["alice"].uid)


@pytest.mark.parametrize("missing", UNITS_CAPS)
def test_each_capability_is_needed(box, box_users, missing):
    caps = [c for c in UNITS_CAPS if c != missing]
    uid = box_users["alice"].uid
    b = _daemon(box, caps)
    try:
        res = _submit(b)
        if missing == "CAP_DAC_READ_SEARCH":  # alice's job file (0600, hers) cannot be read
            assert res.returncode == 2 and "Permission denied" in res.stderr, res.stdout + res.stderr
            return
        if missing in ("CAP_SETUID", "CAP_SETGID"):  # the daemon cannot act as alice (intake reads her
            # job's paths as her), nor could the shim become her: nothing is accepted, nothing runs
            assert res.returncode == 2, res.stdout + res.stderr
            assert re.search(r"could not act as uid|setgroups on this thread failed", res.stderr), res.stderr
            assert not _job_procs(uid)
            return
        assert res.returncode == 0, res.stderr
        job = int(res.stdout.split()[-1])
        if missing == "CAP_CHOWN":  # alice's log and config cannot be handed to her
            b.wait_state(job, "failed", 60)
            assert "Operation not permitted" in b.cli("root", "show", str(job)).stdout
        elif missing == "CAP_KILL":  # her processes cannot be stopped: the job stays held
            b.wait_for(lambda: _job_procs(uid), 60, "the job's process")
            assert b.cli("alice", "cancel", str(job)).returncode == 0
            time.sleep(8)  # stop_grace 3 s, then SIGKILL, then more
            assert _job_procs(uid) and b.status()[0]["state"] == "running", "not stopped, still held"
            assert "attempt_stuck" in b.log_path.read_text() or _job_procs(uid)
    finally:
        _cleanup(uid)
        b.stop()
