"""What a job sees of /proc when its attempt is a PID namespace of its own (root, no cgroup)."""

import sys

import pytest

from ..conftest import command_job, drop

# DeepSpeed's CPU accelerator, imported by every multi-rank LLaMA-Factory rank, does exactly this:
# psutil reads /proc/<os.getpid()>, and in the host's /proc the namespace's pid 2 is kthreadd.
PROBE = ("import os, psutil; psutil.Process().memory_info(); "
         "assert os.readlink('/proc/self') == str(os.getpid()), (os.readlink('/proc/self'), os.getpid()); "
         "print('own /proc ok')")


@pytest.mark.slow  # a real daemon
def test_a_job_in_its_own_pid_namespace_sees_its_own_pids_in_proc(daemon, tmp_path):
    daemon.start()
    drop(daemon.spool, "probe.yaml", command_job(tmp_path / "work", [sys.executable, "-c", PROBE], name="probe"))
    state = daemon.wait_state(1, {"succeeded", "failed"})
    shown = daemon.show(1)
    started = next(e for e in shown["events"] if e["kind"] == "attempt_started")
    if started["data"]["ownership"] != "pid-namespace":
        pytest.skip(f"the attempt's owner here is {started['data']['ownership']}, not a PID namespace")
    assert state == "succeeded", daemon.cli("logs", "1").stdout[-2000:]
    assert "own /proc ok" in daemon.cli("logs", "1").stdout
