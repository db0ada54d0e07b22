"""Why the integrator should put the launch shim between Slurm and a torchrun-like launcher.

slurm.md: workers in their own sessions never get Slurm's SIGTERM (not even with --full); the
batch step's end then SIGKILLs them, so they cannot save. The shim (exec'd by the batch script,
launcher_prefix) forwards SIGTERM to every descendant and writes exit.json inside the job."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from supervisor.core.models import Category, ExitRecord, HostEvidence
from supervisor.judge.diagnosis import diagnose_bytes
from supervisor.run import slurm as sl

from .conftest import ALLOC, go, wait_file, wait_terminal

REPO = Path(__file__).resolve().parents[2]
AGENT = """import subprocess, sys, time
worker = '''import signal, sys, time, pathlib
def on_term(n, f):
    pathlib.Path(sys.argv[1]).write_text("worker got SIGTERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("worker ready", flush=True)
while True:
    time.sleep(0.1)
'''
p = subprocess.Popen([sys.executable, "-c", worker, sys.argv[1]], start_new_session=True)
p.wait()
"""


def via_shim(tmp_path: Path, argv: list[str], name: str, **kw):
    """The attempt as the integrator would wire it: launch.json + the shim exec'd by Slurm."""
    att = tmp_path / name
    att.mkdir()
    launch = att / "launch.json"
    launch.write_text(json.dumps({
        "argv": argv, "cwd": str(tmp_path), "env": dict(os.environ), "log": str(att / "train.log"),
        "exit_record": str(att / "exit.json"), "rlimits": {}, "cgroup_procs": None, "owner_procs": None,
        "max_log_bytes": None}))
    sub, log = go(tmp_path, [str(launch)], name, env={"PYTHONPATH": str(REPO)},
                  settings=sl.SlurmSettings(launcher_prefix=[sys.executable, "-m", "supervisor.run.shim"]), **kw)
    return sub, log, att


def test_shim_forwards_sigterm_to_workers_in_their_own_session(slurm, tmp_path):
    direct_marker, shim_marker = tmp_path / "direct.term", tmp_path / "shim.term"
    direct, direct_log = go(tmp_path, [sys.executable, "-c", AGENT, str(direct_marker)], "direct")
    via, via_log, att = via_shim(tmp_path, [sys.executable, "-c", AGENT, str(shim_marker)], "viashim")
    wait_file(direct_log, lambda t: "worker ready" in t)
    wait_file(via_log, lambda t: "worker ready" in t)
    sl.cancel(direct.job_id, hard=False)
    sl.cancel(via.job_id, hard=False)
    wait_file(shim_marker, timeout=15)
    st = wait_terminal(via.job_id, timeout=45)
    assert shim_marker.read_text() == "worker got SIGTERM"
    exit_rec = json.loads(wait_file(att / "exit.json", timeout=15))
    assert exit_rec["returncode"] == -15 and exit_rec["signal"] == "SIGTERM"  # the agent's own end
    assert st.state in ("CANCELLED", "FAILED", "COMPLETED")
    wait_terminal(direct.job_id, timeout=45)
    assert not direct_marker.exists()  # without the shim the worker never heard of it


def test_oom_through_the_shim_is_host_oom_with_both_witnesses(slurm, tmp_path):
    sub, log, att = via_shim(tmp_path, [sys.executable, "-c", ALLOC], "shimoom",
                             request=sl.SlurmJobRequest(mem="200M"))
    st = wait_terminal(sub.job_id)
    assert st.state == "OUT_OF_MEMORY", log.read_text()[-2000:]
    raw = json.loads(wait_file(att / "exit.json", timeout=15))
    assert raw["returncode"] == -9 and raw["signal"] == "SIGKILL"  # the shim survived the trainer
    v = sl.verdict(st, log.read_text(errors="replace"))
    diag = diagnose_bytes(log.read_bytes(), ExitRecord(returncode=raw["returncode"], signal=raw["signal"]),
                          HostEvidence(**v["host"]))
    assert diag.category == Category.HOST_OOM, diag.summary
