"""The Slurm backend against a real slurmctld/slurmd/munge (scripts/slurm.sh), cgroup v1 here.

The TIMEOUT job is submitted when the module starts and checked last, so its wait (time limit
plus slurmctld's 30 s check period) overlaps the other tests.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil
import pytest

from supervisor.core.models import Category
from supervisor.judge.diagnosis import diagnose_bytes
from supervisor.run import slurm as sl

from .conftest import ALLOC, go, py, wait_file, wait_state, wait_terminal

TERM_HANDLER = ("import signal, sys, time, pathlib\n"
                "def on_term(n, f):\n    pathlib.Path(sys.argv[1]).write_text('got SIGTERM')\n    sys.exit(0)\n"
                "signal.signal(signal.SIGTERM, on_term)\nprint('ready', flush=True)\n"
                "while True:\n    time.sleep(0.1)\n")


@pytest.fixture(scope="module", autouse=True)
def timeout_job(slurm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("timeout")
    return go(tmp, py("import time\nprint('sleeping', flush=True)\ntime.sleep(600)"), "timeout",
              request=sl.SlurmJobRequest(mem="100M", time="0:15"))


IGNORE_TERM = ("import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
               "print('ignoring pid', os.getpid(), flush=True)\nwhile True:\n    time.sleep(0.1)\n")


@pytest.fixture(scope="module", autouse=True)
def hard_cancelled_job(slurm, timeout_job, tmp_path_factory):
    """A process that ignores SIGTERM, hard-cancelled now; judged at the end (KillWait is 30 s).
    After the TIMEOUT job is running: while this one is COMPLETING no new job starts."""
    wait_state(timeout_job[0].job_id, lambda s: s.state == "RUNNING", timeout=30)
    sub, log = go(tmp_path_factory.mktemp("hard"), py(IGNORE_TERM), "hard", request=sl.SlurmJobRequest(mem="100M"))
    text = wait_file(log, lambda t: "ignoring pid" in t)
    sl.cancel(sub.job_id, hard=True)
    return sub, log, time.monotonic(), int(text.split("ignoring pid")[1].split()[0])


def _diagnose(state, log: Path):
    v = sl.verdict(state, log.read_text(errors="replace"))
    exit_rec, host = sl.records(v)
    return v, diagnose_bytes(log.read_bytes(), exit_rec, host)


def test_attempt_env_and_gres_reach_the_job(slurm, tmp_path):
    code = "import os; print('probe=' + os.environ['OOMSUP_PROBE'], 'cvd=' + os.environ.get('CUDA_VISIBLE_DEVICES', '-'))"
    sub, log = go(tmp_path, py(code), "env", env={"OOMSUP_PROBE": "a b;c", "SLURM_JOB_ID": "stale"},
                  request=sl.SlurmJobRequest(mem="100M", gpus_per_node=2))
    st = wait_terminal(sub.job_id)
    assert st.state == "COMPLETED", log.read_text()
    assert "probe=a b;c cvd=0,1" in log.read_text()  # --export=ALL; two fake GPUs by gres


def test_exit_0_and_exit_3(slurm, tmp_path):
    ok, ok_log = go(tmp_path, py("print('fine')"), "ok")
    bad, bad_log = go(tmp_path, py("import sys; print('bad'); sys.exit(3)"), "bad")
    s_ok, s_bad = wait_terminal(ok.job_id), wait_terminal(bad.job_id)
    assert (s_ok.state, s_ok.exit_code, s_ok.signal) == ("COMPLETED", 0, 0)
    assert (s_bad.state, s_bad.exit_code, s_bad.reason) == ("FAILED", 3, "NonZeroExitCode")
    assert sl.verdict(s_ok, ok_log.read_text())["exit"] == {"returncode": 0, "signal": None}
    v = sl.verdict(s_bad, bad_log.read_text())
    assert v["exit"] == {"returncode": 3, "signal": None} and not v["interrupted"] and not v["cancelled"]
    assert "fine" in ok_log.read_text() and "bad" in bad_log.read_text()
    # The batch script sbatch ran is the one in the attempt folder, and it execs the command.
    assert ok.script.parent == tmp_path / "ok" and "\nexec " in ok.script.read_text()
    # The jobcomp fallback (scontrol forgets after MinJobAge) tells the same story.
    jc = wait_state_jobcomp(bad.job_id)
    assert (jc.state, jc.exit_code, jc.source) == ("FAILED", 3, "sacct-jobcomp")


def wait_state_jobcomp(job_id: str, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = sl.query_jobcomp(job_id)
        if st is not None:
            return st
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not in the jobcomp file")


def test_jobcomp_fallback_never_reports_a_wrong_submit_time(slurm, tmp_path):
    """Measured: `sacct -c`'s Submit column is the start time. same_run compares submit times,
    so the fallback must say "unknown" rather than a later time than the real submit."""
    sub, _ = go(tmp_path, ["true"], "held", request=sl.SlurmJobRequest(mem="100M"),
                settings=sl.SlurmSettings(extra_args=["--hold"]))
    time.sleep(2.2)
    subprocess.run(["scontrol", "release", sub.job_id], check=True, timeout=30)
    st = wait_terminal(sub.job_id)
    assert st.start_time - st.submit_time >= 2
    jc = wait_state_jobcomp(sub.job_id)
    assert jc.state == "COMPLETED" and jc.submit_time in (None, st.submit_time), (jc, st)


def test_over_mem_is_out_of_memory_with_oom_kill_evidence(slurm, tmp_path):
    sub, log = go(tmp_path, py(ALLOC), "oom", request=sl.SlurmJobRequest(mem="200M"))
    st = wait_terminal(sub.job_id)
    assert (st.state, st.reason, st.signal) == ("OUT_OF_MEMORY", "OutOfMemory", 125)
    assert st.memory_limit_bytes == 200 << 20
    text = wait_file(log, lambda t: "oom-kill event" in t)
    v, diag = _diagnose(st, log)
    assert v["host"]["cgroup_oom_kills"] >= 1 and v["host"]["limit_mechanism"] == "slurm-cgroup"
    assert v["host"]["memory_limit_bytes"] == 200 << 20 and v["scheduler_state"] == "OUT_OF_MEMORY"
    assert v["exit"] == {"returncode": -9, "signal": "SIGKILL"}
    assert any(f"StepId={sub.job_id}.batch" in e for e in v["evidence"]), v["evidence"]
    assert "allocated" in text
    assert diag.category == Category.HOST_OOM, diag.summary


def test_oom_in_srun_step_while_batch_script_exits_0(slurm, tmp_path):
    alloc = tmp_path / "alloc.py"
    alloc.write_text(ALLOC)
    import sys
    sub, log = go(tmp_path, ["bash", "-c", f"srun {sys.executable} {alloc}; echo step done; exit 0"],
                  "srun_oom", request=sl.SlurmJobRequest(mem="200M"))
    st = wait_terminal(sub.job_id)
    assert (st.state, st.exit_code, st.signal) == ("COMPLETED", 0, 0)
    assert st.derived_signal == 125  # only `scontrol -d` / jobcomp say so
    wait_file(log, lambda t: "oom-kill event" in t and "step done" in t)
    v, diag = _diagnose(st, log)
    assert v["host"]["cgroup_oom_kills"] >= 1 and v["exit"]["signal"] == "SIGKILL"
    assert diag.category == Category.HOST_OOM, diag.summary


def test_soft_cancel_reaches_the_trainer_with_sigterm(slurm, tmp_path):
    marker = tmp_path / "got_term"
    sub, log = go(tmp_path, [*py(TERM_HANDLER), str(marker)], "cancel")
    wait_file(log, lambda t: "ready" in t)
    assert wait_state(sub.job_id, lambda s: s.state == "RUNNING").start_time is not None
    t0 = time.monotonic()
    sl.cancel(sub.job_id, hard=False)
    wait_file(marker, timeout=15)
    assert marker.read_text() == "got SIGTERM"  # exec: no shell between Slurm and the trainer
    sl.cancel(sub.job_id, hard=True)            # the caller's escalation; Slurm records CANCELLED
    st = wait_terminal(sub.job_id, timeout=45)
    assert st.state in ("CANCELLED", "COMPLETED"), st
    if st.state == "CANCELLED":
        assert sl.verdict(st, log.read_text())["cancelled"]
    assert time.monotonic() - t0 < 40
    sl.cancel(sub.job_id, hard=True)            # cancelling a finished job is not an error


def test_requeue_appends_output_and_is_not_the_same_run(slurm, tmp_path):
    sub, log = go(tmp_path, ["bash", "-c", 'echo "run ${SLURM_RESTART_COUNT:-0}"; exec sleep 300'], "requeue",
                  request=sl.SlurmJobRequest(mem="100M"), settings=sl.SlurmSettings(extra_args=["--requeue"]))
    first = wait_state(sub.job_id, lambda s: s.state == "RUNNING")
    wait_file(log, lambda t: "run 0" in t)
    rec = sl.observed(sub, first)
    assert sl.same_run(rec, first) and sl.same_run(rec, sl.query(sub.job_id))
    subprocess.run(["scontrol", "requeue", sub.job_id], check=True, timeout=30)
    wait_state(sub.job_id, lambda s: s.restarts == 1 and s.state == "PENDING", timeout=20, what="requeued")

    def started(s):  # a requeued job waits for its begin time (~135 s) unless told to start now
        if s.state == "PENDING":
            # It may start between our look and this ("no longer pending"): harmless.
            subprocess.run(["scontrol", "update", f"JobId={sub.job_id}", "StartTime=now"], check=False,
                           capture_output=True, timeout=30)
        return s.state == "RUNNING" and s.restarts == 1

    again = wait_state(sub.job_id, started, timeout=30)
    text = wait_file(log, lambda t: "run 1" in t)
    assert "run 0" in text and text.index("run 0") < text.index("run 1")  # appended, not truncated
    assert not sl.same_run(rec, again)
    sl.cancel(sub.job_id, hard=True, kill_now=True)
    wait_terminal(sub.job_id, timeout=30)


def test_query_many_one_call_and_unknown_ids(slurm, tmp_path):
    sub, _ = go(tmp_path, py("import time; time.sleep(2)"), "many", request=sl.SlurmJobRequest(mem="100M"))
    got = sl.query_many([sub.job_id, "999999"], max_age_s=0)
    assert set(got) == {sub.job_id} and got[sub.job_id].running and got[sub.job_id].source == "squeue"
    assert sl.query_many(["999999"], max_age_s=0) == {}
    assert set(sl.find_by_name("oomsup-test-many")) >= {sub.job_id}
    with pytest.raises(ValueError, match="not Slurm job ids"):
        sl.query_many(["12; rm -rf /"])
    assert sl.query("999999") is None


def test_submit_refused_says_why(slurm, tmp_path):
    with pytest.raises(sl.SlurmError, match=r"(?i)partition"):
        go(tmp_path, py("pass"), "badpart", settings=sl.SlurmSettings(partition="no-such-partition"))


def test_up_is_idempotent(slurm):
    t0 = time.monotonic()
    res = subprocess.run(["bash", "scripts/slurm.sh", "up"], check=False, capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == f"SLURM_CONF={slurm}"
    assert time.monotonic() - t0 < 10


def test_time_limit_is_timeout(slurm, timeout_job):
    sub, log = timeout_job
    st = wait_terminal(sub.job_id, timeout=120)
    assert st.state == "TIMEOUT", st
    v = sl.verdict(st, log.read_text(errors="replace"))
    assert v["timeout"] and not v["interrupted"] and v["host"]["cgroup_oom_kills"] == 0
    assert "DUE TO TIME LIMIT" in log.read_text()


def test_hard_cancel_kills_a_term_ignoring_process_after_killwait(slurm, hard_cancelled_job):
    sub, log, t0, pid = hard_cancelled_job
    st = wait_terminal(sub.job_id, timeout=90)
    elapsed = time.monotonic() - t0
    assert st.state == "CANCELLED" and sl.verdict(st, log.read_text())["cancelled"]
    assert f"JOB {sub.job_id} ON" in log.read_text() and "CANCELLED AT" in log.read_text()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert elapsed > 20  # it ignored SIGTERM: only KillWait's SIGKILL ended it


def test_query_many_is_cached_for_its_max_age(slurm, tmp_path):
    sub, _ = go(tmp_path, ["true"], "cache", request=sl.SlurmJobRequest(mem="100M"),
                settings=sl.SlurmSettings(extra_args=["--hold"]))
    held = sl.query_many([sub.job_id], max_age_s=0)[sub.job_id]
    assert held.state == "PENDING" and held.start_time is None
    subprocess.run(["scontrol", "release", sub.job_id], check=True, timeout=30)
    wait_terminal(sub.job_id)
    assert sl.query_many([sub.job_id], max_age_s=60)[sub.job_id].state == "PENDING"  # the cached answer
    assert sl.query_many([sub.job_id], max_age_s=0)[sub.job_id].state == "COMPLETED"


def test_query_many_one_squeue_serves_every_handle(slurm, tmp_path):
    """Handles that each ask for their own job: the answers are cached per job, so asking for
    A, then B, then A again costs no squeue for the second A (one id-set cache re-asked)."""
    hold = sl.SlurmSettings(extra_args=["--hold"])
    a, _ = go(tmp_path, ["true"], "share-a", request=sl.SlurmJobRequest(mem="100M"), settings=hold)
    b, _ = go(tmp_path, ["true"], "share-b", request=sl.SlurmJobRequest(mem="100M"), settings=hold)
    assert sl.query_many([b.job_id], max_age_s=0)[b.job_id].state == "PENDING"
    assert sl.query_many([a.job_id], max_age_s=0)[a.job_id].state == "PENDING"  # squeue for a and b
    subprocess.run(["scontrol", "release", b.job_id], check=True, timeout=30)
    wait_terminal(b.job_id)
    assert sl.query_many([b.job_id], max_age_s=60)[b.job_id].state == "PENDING"  # cached: no squeue
    sl.cancel(a.job_id, hard=True, kill_now=True)


def test_multinode_script_runs_one_task_per_node_with_llamafactory_names(slurm, tmp_path):
    """The script's srun wiring on a one-node allocation: NNODES=1, NODE_RANK=0, MASTER_ADDR = the
    first host (two nodes for real: test_slurm_multinode.py on scripts/slurm2.sh)."""
    att = tmp_path / "multi"
    att.mkdir()
    log = att / "train.log"
    code = ("import os; print('env', *[k + '=' + os.environ.get(k, '-') for k in "
            "('NNODES', 'NODE_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'FORCE_TORCHRUN')])")
    script = att / sl.BATCH_SCRIPT
    script.write_text(sl.batch_script(py(code), launcher_prefix=[], nodes=2))
    args = sl.sbatch_args(log, tmp_path, settings=sl.SlurmSettings(), request=sl.SlurmJobRequest(mem="100M"),
                          job_name="oomsup-test-multi")
    res = subprocess.run(["sbatch", *args, str(script)], capture_output=True, text=True, check=True, timeout=30)
    st = wait_terminal(res.stdout.strip().split(";")[0])
    host = subprocess.run(["hostname", "-s"], capture_output=True, text=True, check=True).stdout.strip()
    assert st.state == "COMPLETED", log.read_text()
    assert f"env NNODES=1 NODE_RANK=0 MASTER_ADDR={host} MASTER_PORT=29500 FORCE_TORCHRUN=1" in log.read_text()
