"""The real daemon with `backend: slurm` over a real single-node Slurm: each attempt is one sbatch
job; diagnosis, policy and resume are the same as on one box."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from supervisor.run import slurm as sl

from ..conftest import QUIET_OMP, DaemonProc, command_job, drop, write_config
from .conftest import wait_terminal


def slurm_daemon(tmp_path: Path, **cfg) -> DaemonProc:
    conf = write_config(tmp_path / "daemon.yaml", backend="slurm", poll_interval=0.2, stop_grace=5,
                        slurm={"time_limit": "10m"}, **cfg)
    return DaemonProc(tmp_path / "state", tmp_path / "spool", conf, tmp_path / "daemon.log")


def slurm_job_of(d: DaemonProc, job: int, attempt: int = 1) -> str:
    ev = next(e for e in d.show(job)["events"] if e["kind"] == "slurm_submitted" and e["attempt"] == attempt)
    return ev["data"]["slurm_job"]


TERM_AWARE = """
import signal, sys, time
out = sys.argv[1]
def bye(*_):
    open(out, "w").write("got SIGTERM\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
for i in range(int(sys.argv[2])):
    print("step", i + 1, flush=True)
    time.sleep(0.2)
"""


def test_a_host_oom_under_mem_is_diagnosed_from_slurms_verdict(slurm, tmp_path):
    from .conftest import ALLOC

    d = slurm_daemon(tmp_path).start()
    try:
        (tmp_path / "work").mkdir(exist_ok=True)
        (tmp_path / "work" / "alloc.py").write_text(ALLOC)
        drop(d.spool, "oom.yaml", command_job(tmp_path / "work", [sys.executable, "alloc.py"],
                                              host_memory_limit="300MiB", max_attempts=1))
        d.wait_state(1, {"failed", "succeeded", "waiting_retry"}, timeout=180)
        a = d.show(1)["attempt_list"][0]
        assert a["diagnosis"]["category"] == "host_oom", a["diagnosis"]
        st = sl.query(slurm_job_of(d, 1))
        assert st is not None and st.state in ("OUT_OF_MEMORY", "FAILED", "COMPLETED")
        started = next(e for e in d.show(1)["events"] if e["kind"] == "attempt_started")
        assert started["data"]["limit_mechanism"] == "slurm-cgroup"
        shown = d.cli("show", "1").stdout
        assert "host_oom" in shown
    finally:
        d.stop(signal.SIGTERM, timeout=60)


def test_cancel_reaches_the_trainer_as_sigterm_through_slurm(slurm, tmp_path):
    d = slurm_daemon(tmp_path).start()
    try:
        (tmp_path / "work").mkdir(exist_ok=True)
        (tmp_path / "work" / "term.py").write_text(TERM_AWARE)
        flag = tmp_path / "work" / "term.txt"
        drop(d.spool, "c.yaml", command_job(tmp_path / "work", [sys.executable, "term.py", str(flag), "600"]))
        d.wait_for(lambda: "step 3" in d.cli("logs", "1").stdout, timeout=120, what="running in Slurm")
        assert d.cli("cancel", "1").returncode == 0
        d.wait_state(1, "cancelled", timeout=90)
        assert flag.read_text() == "got SIGTERM\n", "the trainer got SIGTERM, not a SIGKILL of a shell"
        st = sl.query(slurm_job_of(d, 1))
        assert st is not None and st.terminal
    finally:
        d.stop(signal.SIGTERM, timeout=60)


def test_kill9_of_the_daemon_readopts_the_slurm_job(slurm, tmp_path):
    d = slurm_daemon(tmp_path).start()
    try:
        (tmp_path / "work").mkdir(exist_ok=True)
        (tmp_path / "work" / "term.py").write_text(TERM_AWARE)
        drop(d.spool, "r.yaml", command_job(tmp_path / "work", [sys.executable, "term.py",
                                                                 str(tmp_path / "t.txt"), "60"]))
        d.wait_for(lambda: "step 3" in d.cli("logs", "1").stdout, timeout=120, what="running in Slurm")
        first_id = slurm_job_of(d, 1)
        d.kill9()
        time.sleep(0.5)
        d.start()
        d.wait_state(1, "succeeded", timeout=120)
        shown = d.show(1)
        assert shown["attempts"] == 1, "re-adopted by job id, not submitted again"
        assert any(e["kind"] == "attempt_adopted" for e in shown["events"])
        assert sl.query(first_id).state == "COMPLETED"
    finally:
        d.stop(signal.SIGTERM, timeout=60)


@pytest.mark.slow
@pytest.mark.ml
def test_the_demo_night_runs_on_slurm(slurm, tmp_path):
    """The demo's real LLaMA-Factory run, each attempt an sbatch job under --mem: the OOM is the
    job cgroup's, seen by Slurm, and the night ends the same way as on one box."""
    from supervisor.demo.run import DEMO_CGROUP_LIMIT, default_launcher, demo_job

    from ..e2e.test_overnight_demo import CACHE, check_night

    if shutil.which(default_launcher()[0]) is None and not Path(default_launcher()[0]).exists():
        pytest.skip("llamafactory-cli is not installed")
    root = tmp_path / "demo"
    (root / "work").mkdir(parents=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    (root / "cache").symlink_to(CACHE)
    job = demo_job(root, memory_limit=DEMO_CGROUP_LIMIT, launcher=default_launcher())
    job["supervisor"]["env"].update(QUIET_OMP)
    d = slurm_daemon(tmp_path).start()
    try:
        drop(d.spool, "demo.yaml", yaml.safe_dump(job))
        d.wait_state(1, {"succeeded", "failed"}, timeout=900)
    finally:
        d.stop(signal.SIGTERM, timeout=60)  # before the check: its own command line names the state folder
    check_night(d, job, mechanism="slurm-cgroup")
    shown = d.show(1)
    first = shown["attempt_list"][0]
    assert first["exit"]["signal"] == "SIGKILL", first["exit"]  # the job cgroup's OOM killer
    ids = [e["data"]["slurm_job"] for e in shown["events"] if e["kind"] == "slurm_submitted"]
    assert len(ids) == len(shown["attempt_list"]) and len(set(ids)) == len(ids), "one sbatch job per attempt"
    assert sl.query(ids[0]).state in ("OUT_OF_MEMORY", "FAILED")
    assert os.environ.get("SLURM_CONF")


PRINT_ENV = ("import os\n"
             "for k in ('SLURM_JOB_ID', 'CUDA_VISIBLE_DEVICES', 'SLURM_JOB_GPUS', 'OOMSUP_PROBE'):\n"
             "    print('env', k + '=' + str(os.environ.get(k)), flush=True)\n")


def test_the_trainer_sees_slurms_job_environment_and_the_attempts(slurm, tmp_path):
    """Issue 21 case 1: the shim ran the command with exactly launch.json's environment, so the
    trainer saw SLURM_JOB_ID=None, CUDA_VISIBLE_DEVICES=None while the batch script's own line in
    the same log said "slurm job 36": the GPUs Slurm gave were ignored."""
    d = slurm_daemon(tmp_path).start()
    try:
        (tmp_path / "work").mkdir(exist_ok=True)
        (tmp_path / "work" / "env.py").write_text(PRINT_ENV)
        drop(d.spool, "env.yaml", command_job(tmp_path / "work", [sys.executable, "env.py"], max_attempts=1,
                                              slurm={"gpus_per_node": 2},
                                              env={"OOMSUP_PROBE": "the job's own", "CUDA_VISIBLE_DEVICES": "7"}))
        d.wait_state(1, {"failed", "succeeded"}, timeout=120)
        text = d.cli("logs", "1").stdout
        job_id = slurm_job_of(d, 1)
        assert f"env SLURM_JOB_ID={job_id}\n" in text, text
        assert "env CUDA_VISIBLE_DEVICES=0,1\n" in text  # Slurm's gres, not the job file's "7"
        assert "env SLURM_JOB_GPUS=0,1\n" in text and "env OOMSUP_PROBE=the job's own\n" in text
        assert d.job_state(1) == "succeeded"
        shown = d.show(1)
        ev = next(e for e in shown["events"] if e["kind"] == "scheduler_verdict")
        assert ev["data"]["state"] == "COMPLETED" and ev["data"]["evidence"][0].startswith("Slurm COMPLETED")
    finally:
        d.stop(signal.SIGTERM, timeout=60)


DONE_ON_A_LATER_ATTEMPT = """import os, sys, time
if "-attempt-1-" not in os.environ["OOM_SUPERVISOR_ATTEMPT"]:
    print("later attempt: done", flush=True)
    sys.exit(0)
print("attempt 1 running", flush=True)
time.sleep(600)
"""


def test_a_job_slurm_no_longer_knows_with_no_exit_record_is_interrupted_not_charged(slurm, tmp_path):
    """Issue 18 case 4: a job that neither scontrol nor the jobcomp file knows (a controller that
    lost it: submitted after its last state save, then killed -9), with no exit record, was judged
    an ordinary failure charged to the budget, where a local attempt that vanished is interrupted.
    Reproduced from the record: the daemon is killed -9, its Slurm job SIGKILLed (no shim writes
    anything), and the attempt's record made to name a job id this controller never had."""
    import sqlite3

    d = slurm_daemon(tmp_path).start()
    try:
        (tmp_path / "work").mkdir(exist_ok=True)
        (tmp_path / "work" / "lost.py").write_text(DONE_ON_A_LATER_ATTEMPT)
        drop(d.spool, "lost.yaml", command_job(tmp_path / "work", [sys.executable, "lost.py"], max_attempts=1))
        d.wait_for(lambda: "attempt 1 running" in d.cli("logs", "1").stdout, timeout=120, what="running in Slurm")
        real = slurm_job_of(d, 1)
        d.kill9()
        sl.kill_at_once(real)
        wait_terminal(real, timeout=60)
        never = str(int(real) + 900000)
        assert sl.query(never) is None  # neither scontrol nor the jobcomp file
        db = sqlite3.connect(d.state / "state.sqlite3")
        ref = json.loads(db.execute("SELECT backend_ref FROM attempts WHERE job_id=1 AND number=1").fetchone()[0])
        ref["slurm"]["job_id"] = never
        db.execute("UPDATE attempts SET backend_ref=? WHERE job_id=1 AND number=1", (json.dumps(ref),))
        db.commit()
        db.close()
        assert not list((d.state / "jobs" / "1" / "attempt-1").glob("exit*.json"))
        d.start()
        d.wait_state(1, {"succeeded", "failed"}, timeout=180)
        shown = d.show(1)
        first = shown["attempt_list"][0]
        assert first["decision"] == {"kind": "interrupted", "cause": "slurm lost"}, first["decision"]
        assert shown["state"] == "succeeded" and len(shown["attempt_list"]) == 2  # max_attempts 1: not charged
        said = [e["message"] for e in shown["events"] if f"knows Slurm job {never}" in e["message"]]
        assert said and "left no exit record" in said[0] and "not a failure of the job" in said[0], shown["events"]
    finally:
        d.stop(signal.SIGTERM, timeout=60)


IGNORE_TERM = """import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("pid", os.getpid(), flush=True)
while True:
    time.sleep(0.2)
"""


def test_the_stop_deadline_kills_at_once_not_after_slurms_killwait(slurm, tmp_path):
    """Issue 21 case 3: at the stop deadline the daemon ran `scancel` (SIGTERM, KillWait, SIGKILL),
    so a trainer ignoring SIGTERM lived another 30 s. Now every step, then the batch step, is
    SIGKILLed at the deadline (see supervisor.run.slurm.kill_at_once), and the verdict says so."""
    import psutil

    d = slurm_daemon(tmp_path).start()  # stop_grace 5 s
    try:
        (tmp_path / "work").mkdir(exist_ok=True)
        (tmp_path / "work" / "ignore.py").write_text(IGNORE_TERM)
        drop(d.spool, "i.yaml", command_job(tmp_path / "work", [sys.executable, "ignore.py"]))
        text = d.wait_for(lambda: "pid " in (t := d.cli("logs", "1").stdout) and t, timeout=120,
                          what="running in Slurm")
        pid = int(text.split("pid ")[1].split()[0])
        kill_wait = sl.kill_wait_s()
        t0 = time.monotonic()
        assert d.cli("cancel", "1").returncode == 0
        d.wait_state(1, "cancelled", timeout=120)
        took = time.monotonic() - t0
        print(f"cancel of a TERM-ignoring job: cancelled after {took:.1f} s (stop_grace 5 s, KillWait {kill_wait:g} s)")
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert took < 5 + kill_wait, f"{took:.1f} s: the kill waited for Slurm's KillWait"
        ev = next(e for e in d.show(1)["events"] if e["kind"] == "scheduler_verdict")
        assert ev["data"]["stop_commands"][-1] == f"scancel --signal=KILL --batch {slurm_job_of(d, 1)}", ev["data"]
    finally:
        d.stop(signal.SIGTERM, timeout=60)
