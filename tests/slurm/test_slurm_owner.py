"""A shared box submits each attempt as its job's owner (`sbatch --uid/--gid`, root only), on the real
single-node cluster with a real non-root user (made here with useradd, removed after).

The submission side is `supervisor.run.slurm.submit(..., run_as=(uid, gid))`. Measured by hand on scripts/slurm.sh's cluster:
`sbatch --uid=1005 --gid=1007` as root -> UserId=<user>(1005) GroupId=(1007), the job's `id -u` 1005,
its output file the user's."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from supervisor.run import slurm as sl

from .conftest import wait_file, wait_terminal


@pytest.fixture
def user():
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to make a real user")
    name = f"oomsv{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True, timeout=30)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False, timeout=30)


def test_an_attempt_is_submitted_and_runs_as_its_owner(slurm, user):
    # Outside pytest's temp folders (0700, root's) and with /bin/sh (the venv may live in /root):
    # what the user's job needs must be theirs to reach.
    att = Path(tempfile.mkdtemp(prefix="oomsup-owner-"))
    try:
        att.chmod(0o755)
        os.chown(att, user.pw_uid, user.pw_gid)
        log = att / "train.log"
        sub = sl.submit(att, log, ["sh", "-c", 'echo "runs as $(id -u) $(id -g) $(id -un)"'], att, dict(os.environ),
                        settings=sl.SlurmSettings(), request=sl.SlurmJobRequest(mem="100M"),
                        job_name="oomsup-test-owner", run_as=(user.pw_uid, user.pw_gid))
        st = wait_terminal(sub.job_id)
        text = wait_file(log, lambda t: "runs as" in t)
        assert st.state == "COMPLETED", text
        assert f"runs as {user.pw_uid} {user.pw_gid} {user.pw_name}" in text
        assert log.stat().st_uid == user.pw_uid  # Slurm opened the output as the user
        shown = subprocess.run(["scontrol", "show", "job", sub.job_id], capture_output=True, text=True,
                               timeout=30, check=False).stdout
        assert f"UserId={user.pw_name}({user.pw_uid})" in shown
    finally:
        shutil.rmtree(att, ignore_errors=True)
