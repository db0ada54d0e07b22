"""The daemon never loses control of a training (issue 9), driven in-process through real ticks.

The daemon object runs here, in the test's process, over a real SQLite record, real shims and
real job processes; where a test needs our own code to fail (an internal error while following),
that one call is made to raise and everything else is real.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from supervisor.core.paths import AttemptPaths
from supervisor.core.states import JobState
from supervisor.daemon.config import DaemonConfig
from supervisor.daemon.loop import Daemon
from supervisor.intake.jobspec import parse_job_text
from supervisor.intake.spool import accept
from supervisor.record.store import Store
from supervisor.run import proctree
from supervisor.run.logfollow import LogFollower
from supervisor.run.ownership import MARKER_ENV, Owner, detect_owner_support, marked_pids

from ..conftest import fakejob

IS_ROOT = os.geteuid() == 0


def make_daemon(tmp_path: Path, **cfg) -> Daemon:
    conf = DaemonConfig(state_dir=tmp_path / "state", spool_dir=tmp_path / "spool", poll_interval=0.05,
                        settle_time=0, stop_grace=cfg.pop("stop_grace", 2.0), fatal_grace=0.3,
                        cgroups=cfg.pop("cgroups", "off"), **cfg)
    d = Daemon(conf)
    d.lock.acquire()
    d.store = Store(conf.state.db)
    from supervisor.daemon.runner import Runner
    d.runner = Runner(conf, d.store, d.notifier)
    return d


def add_job(d: Daemon, tmp_path: Path, argv: list[str], **sup) -> int:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    text = yaml.safe_dump({"supervisor": {"command": argv, "workdir": str(work), **sup}})
    spec = parse_job_text(text, source="t.yaml", submit_dir=work)
    return accept(d.state, d.store, spec, text=text, source="t.yaml", key=None)


def run_until(d: Daemon, pred, timeout: float = 30.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        d.tick()
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def live(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def marker_of(tmp_path: Path) -> str:
    return f"--lock={tmp_path}/job.lock"


def job_pids(tmp_path: Path) -> list[int]:
    token = marker_of(tmp_path)
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if token in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


@pytest.fixture
def daemon_factory(tmp_path):
    made: list[Daemon] = []

    def make(**cfg):
        d = make_daemon(tmp_path, **cfg)
        made.append(d)
        return d

    yield make
    for d in made:
        for act in list(d.active.values()):
            proctree.kill_tree(act.handle, shim_too=True)
        d.lock.release()
    for pid in job_pids(tmp_path):
        os.kill(pid, signal.SIGKILL)


def test_internal_error_while_following_stops_the_tree_before_the_job_is_released(daemon_factory, tmp_path):
    """Seen: the scanner raised on a log line; the job was failed and released while its training ran
    on, and the next job started on the same GPU."""
    d = daemon_factory()
    first = add_job(d, tmp_path, fakejob(marker_of(tmp_path), "--steps", "600", "--sleep", "0.1",
                                         "--ignore-term"), gpus=[0], max_attempts=1)
    second = add_job(d, tmp_path, [sys.executable, "-c", "print('second')"], gpus=[0])
    run_until(d, lambda: job_pids(tmp_path), what="the training to run")
    act = d.active[first]

    def choke(_chunk):
        raise ValueError("invalid literal for int() with base 10: ''")  # what `steps = ,` did

    act.scanner.feed = choke
    with open(act.paths.log, "a") as f:
        f.write("  Total optimization steps = ,\n")
    pids = job_pids(tmp_path)
    saw_released_while_alive = False
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        d.tick()
        job = d.store.job(first)
        if job.state != JobState.RUNNING and live(pids):
            saw_released_while_alive = True
        if d.store.job(second).state != JobState.QUEUED and live(pids):
            saw_released_while_alive = True
        if job.state == JobState.FAILED and d.store.job(second).state == JobState.SUCCEEDED:
            break
        time.sleep(0.05)
    assert not saw_released_while_alive, "a job was released (or the next started) while its training lived"
    job = d.store.job(first)
    assert job.state == JobState.FAILED and "internal error while following attempt 1" in job.reason
    assert live(pids) == []
    assert d.store.job(second).state == JobState.SUCCEEDED


def test_a_cancel_recorded_before_the_next_attempt_is_never_reset(daemon_factory, tmp_path):
    """Seen: a cancel just after an attempt exited, while the next was being prepared, was reset by
    the start of the next attempt, and the job ran attempts 2 and 3."""
    d = daemon_factory()
    job_id = add_job(d, tmp_path, fakejob(marker_of(tmp_path), "--steps", "1", "--sleep", "0", "--exit", "1"))
    # The state the race produced: the attempt failed and was judged "retry"; the user's cancel landed.
    with d.store.tx():
        d.store.transition(job_id, JobState.RUNNING, "attempt 1 started")
        d.store.add_attempt(job_id, 1)
        d.store.update_attempt(job_id, 1, ended_at=time.time(), decision=json.dumps({"kind": "retry"}))
        d.store.transition(job_id, JobState.WAITING_RETRY, "retry", not_before=0)
        d.store.update_job(job_id, cancel_requested=1)
    for _ in range(10):
        d.tick()
    job = d.store.job(job_id)
    assert job.state == JobState.CANCELLED
    assert len(d.store.attempts(job_id)) == 1, "no attempt may start after a cancel"
    assert job.cancel_requested == 1


def test_cancel_while_the_daemon_is_down_and_the_attempt_died(daemon_factory, tmp_path):
    d = daemon_factory()
    job_id = add_job(d, tmp_path, fakejob(marker_of(tmp_path), "--steps", "600", "--sleep", "0.1"))
    run_until(d, lambda: job_pids(tmp_path), what="the training to run")
    act = d.active[job_id]
    d.active.clear()  # the daemon is gone (kill -9): nobody follows the attempt
    d.lock.release()
    proctree.kill_tree(act.handle, shim_too=True)  # and the attempt died too
    run_until(d, lambda: not job_pids(tmp_path) and not act.handle.alive(), what="all gone")
    d.store.update_job(job_id, cancel_requested=1)  # `oom-supervisor cancel` while it was down
    d2 = daemon_factory()
    d2.recover()
    run_until(d2, lambda: d2.store.job(job_id).state.terminal, what="a verdict")
    assert d2.store.job(job_id).state == JobState.CANCELLED
    assert len(d2.store.attempts(job_id)) == 1


def test_restart_after_the_shim_was_killed_does_not_start_next_to_the_live_training(daemon_factory, tmp_path):
    """Seen: kill -9 of the daemon, then of the shim, while the training lived: on restart the attempt
    'vanished', and attempt 2 started next to the still-running attempt 1. (Without a PID namespace
    too: the marker and the pids seen must find the orphaned training.)"""
    d = daemon_factory(pid_namespace="off")
    job_id = add_job(d, tmp_path, fakejob(marker_of(tmp_path), "--steps", "600", "--sleep", "0.1",
                                          "--ignore-term"))
    run_until(d, lambda: job_pids(tmp_path), what="the training to run")
    act = d.active[job_id]
    training = job_pids(tmp_path)
    d.active.clear()
    d.lock.release()
    os.kill(act.handle.pid, signal.SIGKILL)  # the shim
    act.handle.reap()
    time.sleep(0.3)
    assert live(training), "the training outlives its shim"
    d2 = daemon_factory(pid_namespace="off")
    d2.recover()
    started_next_to_it = False
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        d2.tick()
        if len(d2.store.attempts(job_id)) > 1 and live(training):
            started_next_to_it = True
        if d2.store.job(job_id).state != JobState.RUNNING and not live(training):
            break
        time.sleep(0.05)
    assert not started_next_to_it
    assert live(training) == []
    events = [e.kind for e in d2.store.events(job_id)]
    assert "orphans_stopped" in events


def test_truncated_log_is_followed_again_and_a_later_oom_is_seen(daemon_factory, tmp_path):
    """Seen: after `> output.log` the reader's offset stayed past the end: a healthy job was declared
    hung and a later OOM line was missed."""
    d = daemon_factory()
    script = tmp_path / "work" / "late_oom.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(
        "import sys, time\n"
        "for i in range(40):\n    print('x' * 200, i, flush=True); time.sleep(0.02)\n"
        "time.sleep(0.5)\n"
        "for i in range(3):\n    print('tick', i, flush=True); time.sleep(0.3)\n"
        "print('Traceback (most recent call last):', flush=True)\n"
        "print('  File \"train.py\", line 1, in <module>', flush=True)\n"
        "print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
        "capacity of 79.15 GiB of which 1.02 GiB is free.', flush=True)\n"
        "time.sleep(30)\n")
    job_id = add_job(d, tmp_path, [sys.executable, str(script), marker_of(tmp_path)], hang_timeout=1.2,
                     max_attempts=1)
    run_until(d, lambda: job_id in d.active and d.active[job_id].offset > 8000, what="log read")
    act = d.active[job_id]
    os.truncate(act.paths.log, 0)
    run_until(d, lambda: d.store.job(job_id).state != JobState.RUNNING, timeout=40, what="a verdict")
    a = d.store.attempts(job_id)[0]
    diag = a.json("diagnosis")
    assert a.json("exit")["stopped_by"] == "fatal_signal", a.json("exit")
    assert diag["category"] == "gpu_oom"
    assert any(e.kind == "log_changed" for e in d.store.events(job_id))


def test_deleted_log_is_still_read_through_the_open_file(tmp_path):
    log = tmp_path / "output.log"
    w = open(log, "ab", buffering=0)  # noqa: SIM115 - the writer stays open across the follower's polls, as a training's would
    w.write(b"one\n")
    f = LogFollower(log)
    assert b"".join(f.read(1 << 20, 1.0)) == b"one\n"
    log.unlink()
    w.write(b"two\n")
    assert b"".join(f.read(1 << 20, 1.0)) == b"two\n"
    w.close()


def test_a_log_truncated_and_refilled_past_the_offset_is_read_from_its_start(tmp_path):
    """Issue 18 case 4: the shim's cap truncates the log in place; if the training writes more than
    the old offset before the next poll, the size alone does not show it."""
    log = tmp_path / "output.log"
    w = open(log, "ab", buffering=0)  # noqa: SIM115 - the writer stays open across the follower's polls, as a training's would
    w.write(b"a" * 1000 + b"\n")
    f = LogFollower(log)
    assert len(b"".join(f.read(1 << 20, 1.0))) == 1001
    os.ftruncate(w.fileno(), 0)  # as the shim's log cap does (O_APPEND writer)
    fresh = b"[oom-supervisor] log over 1000 bytes: truncated here\n" + b"torch.OutOfMemoryError: CUDA out of memory\n" * 40
    w.write(fresh)
    assert len(fresh) > 1001 and f.pending() > 0
    assert b"".join(f.read(1 << 20, 1.0)) == fresh
    assert any("truncated and written again" in n for n in f.notes)
    w.write(b"more\n")
    assert b"".join(f.read(1 << 20, 1.0)) == b"more\n", "and followed normally afterwards"
    w.close()


def test_follower_reads_within_its_budget(tmp_path):
    log = tmp_path / "output.log"
    log.write_bytes(b"y" * (5 << 20))
    f = LogFollower(log)
    got = sum(len(c) for c in f.read(1 << 20, 5.0, chunk=256 << 10))
    assert got == 1 << 20 and f.pending() == 4 << 20


def test_exec_failure_is_recorded_by_the_shim_as_a_launch_error(tmp_path):
    paths = AttemptPaths(tmp_path / "attempt-1")
    h = proctree.launch(paths, argv=[sys.executable, "-c", "pass"], cwd=tmp_path / "no-such-dir",
                        env=dict(os.environ))
    proctree.terminate(h, grace_s=5)
    rec = proctree.read_exit(paths)
    assert rec["returncode"] == 127
    assert "no-such-dir" in rec["launch_error"] and "cannot start" in rec["launch_error"]


def test_shim_records_death_by_a_real_time_signal(tmp_path):
    """Seen: the shim crashed before writing exit.json when the child died of a real-time signal."""
    paths = AttemptPaths(tmp_path / "attempt-1")
    code = "import os, signal; os.kill(os.getpid(), signal.SIGRTMIN + 3)"
    h = proctree.launch(paths, argv=[sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ))
    deadline = time.monotonic() + 10
    while not h.over() and time.monotonic() < deadline:
        time.sleep(0.05)
    rec = proctree.read_exit(paths)
    assert rec is not None and rec["signal"] == "SIGRTMIN+3"


def test_log_cap_keeps_head_and_latest_part(tmp_path):
    paths = AttemptPaths(tmp_path / "attempt-1")
    code = ("import sys, time\nsys.stdout.write('HEAD-LINE\\n')\n"
            "for i in range(60):\n    sys.stdout.write(('%06d ' % i) + 'z' * (1 << 19) + '\\n'); sys.stdout.flush()\n"
            "    time.sleep(0.02)\nprint('LAST-LINE', flush=True)\ntime.sleep(1.2)\n")
    h = proctree.launch(paths, argv=[sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ),
                        max_log_bytes=4 << 20)
    peak = 0
    deadline = time.monotonic() + 30
    while not h.over() and time.monotonic() < deadline:
        peak = max(peak, paths.log.stat().st_size)
        time.sleep(0.05)
    assert peak < 10 << 20, f"the log grew to {peak} bytes past a 4 MiB cap"
    head = Path(str(paths.log) + ".head").read_bytes()
    assert head.startswith(b"HEAD-LINE")
    latest = Path(str(paths.log) + ".1").read_bytes() + paths.log.read_bytes()
    assert b"LAST-LINE" in latest
    assert b"[oom-supervisor] log over" in paths.log.read_bytes()


def test_host_memory_limit_without_cgroup_binds_the_job_as_a_whole(daemon_factory, tmp_path):
    """Seen: without a cgroup, 4 processes x 200 MiB under a 300 MiB limit all ran (peak 857 MiB)."""
    d = daemon_factory()
    script = tmp_path / "work" / "four.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(
        "import multiprocessing as mp, time\n"
        "def hold():\n    b = bytearray(200 << 20)\n    for i in range(0, len(b), 4096): b[i] = 1\n"
        "    time.sleep(60)\n"
        "if __name__ == '__main__':\n"
        "    ps = [mp.Process(target=hold) for _ in range(4)]\n"
        "    [p.start() for p in ps]\n    [p.join() for p in ps]\n")
    job_id = add_job(d, tmp_path, [sys.executable, str(script), marker_of(tmp_path)],
                     host_memory_limit="300MiB", max_attempts=1)
    run_until(d, lambda: d.store.job(job_id).state != JobState.RUNNING and job_id not in d.active,
              timeout=60, what="a verdict")
    a = d.store.attempts(job_id)[0]
    assert a.json("exit")["stopped_by"] == "memory_limit"
    assert any(e.kind == "memory_limit_enforced" for e in d.store.events(job_id))
    assert a.json("diagnosis")["category"] == "host_oom"
    assert a.peak_rss_bytes < 900 << 20
    assert job_pids(tmp_path) == []


def test_crash_interruptions_are_budgeted(daemon_factory, tmp_path):
    """Seen: interrupted attempts count against no budget, so a job that crashes the daemon loops forever."""
    d = daemon_factory(max_interruptions=3)
    job_id = add_job(d, tmp_path, [sys.executable, "-c", "pass"])
    with d.store.tx():
        for n in (1, 2, 3):
            d.store.add_attempt(job_id, n, ended_at=time.time(), interrupted=1,
                                decision=json.dumps({"kind": "interrupted", "cause": "crash"}))
        d.store.transition(job_id, JobState.RUNNING, "x")
        d.store.transition(job_id, JobState.INTERRUPTED, "x")
    run_until(d, lambda: d.store.job(job_id).state.terminal, what="a verdict")
    job = d.store.job(job_id)
    assert job.state == JobState.FAILED and "restarted 3 times" in job.reason
    assert len(d.store.attempts(job_id)) == 3


def test_shutdown_after_the_attempt_exited_on_its_own_judges_it(daemon_factory, tmp_path):
    """Seen: an attempt that exited just before the daemon's SIGTERM was recorded interrupted and re-run."""
    d = daemon_factory()
    job_id = add_job(d, tmp_path, [sys.executable, "-c", "print('done')"])
    run_until(d, lambda: job_id in d.active, what="started")
    act = d.active[job_id]
    deadline = time.monotonic() + 10
    while act.handle.alive() and time.monotonic() < deadline:
        act.handle.reap()
        time.sleep(0.02)
    time.sleep(0.05)
    d.shutdown()
    assert d.store.job(job_id).state == JobState.SUCCEEDED


@pytest.mark.skipif(not IS_ROOT, reason="cgroups need root here")
def test_cgroup_ownership_sees_a_process_that_left_every_tree(tmp_path):
    support = detect_owner_support("t" + os.urandom(3).hex())
    assert support is not None, "as root on this box a cgroup (v2 or v1 pids) can be made"
    owner = Owner.for_attempt(support, "job-1-attempt-1", tmp_path / "procs.json", create=True)
    paths = AttemptPaths(tmp_path / "attempt-1")
    code = ("import os, time, subprocess, sys\n"
            "subprocess.Popen([sys.executable, '-c', 'import os,time; os.setsid(); time.sleep(60)'],"
            " start_new_session=True)\n")
    h = proctree.launch(paths, argv=[sys.executable, "-c", code], cwd=tmp_path,
                        env={**os.environ, MARKER_ENV: owner.tag}, owner=owner)
    deadline = time.monotonic() + 10
    while h.alive() and time.monotonic() < deadline:
        h.reap()
        time.sleep(0.05)
    # The shim stopped its straggler itself; start one that escapes by double fork after the shim is gone.
    assert not h.alive()
    assert owner.members() == [] or all(p.status() == psutil.STATUS_ZOMBIE for p in owner.members())
    owner.remove()
    support.parent.rmdir()


def test_marker_finds_processes_without_a_cgroup(tmp_path):
    tag = "job-9-attempt-9-" + os.urandom(3).hex()
    p = psutil.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env={**os.environ, MARKER_ENV: tag},
                     start_new_session=True)
    try:
        deadline = time.monotonic() + 5
        while p.pid not in marked_pids(tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.pid in marked_pids(tag)
        owner = Owner(tag=tag)
        assert not owner.empty()
        owner.kill()
        p.wait(5)
        assert owner.empty()
    finally:
        if p.poll() is None:
            p.kill()


def test_a_policy_can_switch_the_emergency_checkpoint_off(daemon_factory, tmp_path):
    from supervisor.core.models import Overrides
    from supervisor.judge.plan import with_policy_switches
    from supervisor.judge.policy import render_attempt

    pol = tmp_path / "policies"
    pol.mkdir()
    default = (Path(__file__).resolve().parents[2] / "policies" / "default.yaml").read_text()
    (pol / "nockpt.yaml").write_text(default.replace("name: default", "name: nockpt", 1)
                                     + "\nemergency_checkpoint: false\n")
    d = daemon_factory(policy_dirs=[pol])
    on = add_job(d, tmp_path, [sys.executable, "-c", "pass"])
    off = add_job(d, tmp_path, [sys.executable, "-c", "pass"], policy="nockpt")
    envs = {}
    for job_id in (on, off):
        spec, job = d.runner.spec_of(job_id), d.store.job(job_id)
        over = with_policy_switches(Overrides(), d.runner.facts.policy(spec, job))
        envs[job_id] = render_attempt(spec, over, attempt_dir=tmp_path / f"a{job_id}", resume_yaml={},
                                      launcher=["x"]).env
    assert envs[on].get("OOM_SUPERVISOR_EMERGENCY_CKPT") == "1"
    assert "OOM_SUPERVISOR_EMERGENCY_CKPT" not in envs[off] or envs[off]["OOM_SUPERVISOR_EMERGENCY_CKPT"] == "0"


def test_a_job_that_cannot_be_taken_back_stays_held_and_nothing_starts(daemon_factory, tmp_path, monkeypatch):
    """Issue 18 case 1, the last resort: if even the attempt's owner cannot be looked up after a
    restart (here the backend raises), the job is not failed beside its live training: it stays
    running, nothing else is scheduled, and it is taken back once that works."""
    d = daemon_factory()
    first = add_job(d, tmp_path, fakejob(marker_of(tmp_path), "--steps", "600", "--sleep", "0.1"))
    second = add_job(d, tmp_path, [sys.executable, "-c", "print('second')"])
    run_until(d, lambda: job_pids(tmp_path), what="the training to run")
    training = job_pids(tmp_path)
    d.active.clear()
    d.lock.release()  # the daemon "crashed"; its training lives on
    d2 = daemon_factory()
    broken = {"on": True}
    real_adopt = d2.runner.backend.adopt

    def adopt(*args, **kw):
        if broken["on"]:
            raise OSError("the record of attempt 1 cannot be read")
        return real_adopt(*args, **kw)

    monkeypatch.setattr(d2.runner.backend, "adopt", adopt)
    d2.recover()
    for _ in range(20):
        d2.tick()
        time.sleep(0.05)
    assert d2.store.job(first).state == JobState.RUNNING and live(training)
    assert d2.store.job(second).state == JobState.QUEUED, "the second job started beside a live training"
    assert [e.kind for e in d2.store.events(first)].count("recovery_failed") == 1
    broken["on"] = False
    run_until(d2, lambda: first in d2.active, what="job 1 taken back")
    assert any(e.kind == "attempt_adopted" for e in d2.store.events(first))


ESCAPING_HELPER = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # the helper: its own session, its parent gone, an empty environment
        os.execve(sys.executable, [sys.executable, "-c", "import time\\nwhile True: time.sleep(0.1)", sys.argv[1]], {})
    os._exit(0)
time.sleep(600)
"""


@pytest.mark.skipif(not IS_ROOT, reason="a PID namespace needs root (CI runs as root)")
def test_without_a_cgroup_a_helper_that_escapes_the_marker_dies_with_its_shim(daemon_factory, tmp_path):
    """Issue 18 case 2: no cgroup can be made (cgroups: off). A helper double-forks with an empty
    environment into its own session, then the shim is killed: before, nothing found the helper,
    job 1 was judged and job 2 started while it lived. Now the attempt is a PID namespace whose
    init is the shim: the kernel kills the helper with it."""
    d = daemon_factory()
    assert "PID namespace" in d.runner.backend.describe()
    token = f"escaped-helper-{tmp_path}"
    (tmp_path / "work").mkdir(exist_ok=True)
    (tmp_path / "work" / "helper.py").write_text(ESCAPING_HELPER)
    first = add_job(d, tmp_path, [sys.executable, "helper.py", token], max_attempts=1)
    second = add_job(d, tmp_path, [sys.executable, "-c", "print('second')"])

    def helpers():  # the escaped helper only (not the job's main process, which names the token too)
        return [p.pid for p in psutil.process_iter(["cmdline"])
                if (p.info["cmdline"] or [])[-2:-1] != ["helper.py"] and token in (p.info["cmdline"] or [])[-1:]]

    run_until(d, lambda: first in d.active, what="job 1 to launch")
    deadline = time.monotonic() + 30
    while not helpers() and time.monotonic() < deadline:  # no tick meanwhile: the daemon never saw it
        time.sleep(0.05)
    assert helpers(), "the helper did not start"
    time.sleep(0.3)  # its exec with the empty environment is done
    os.kill(d.active[first].handle.pid, signal.SIGKILL)  # the shim the daemon follows
    started_beside = False
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and d.store.job(second).state != JobState.SUCCEEDED:
        d.tick()
        if d.store.attempts(second) and helpers():
            started_beside = True
        time.sleep(0.05)
    alive_helpers = helpers()
    for pid in alive_helpers:
        os.kill(pid, signal.SIGKILL)
    assert not started_beside and alive_helpers == [], "job 2 started while job 1's helper lived"
    assert d.store.job(second).state == JobState.SUCCEEDED


def _full_finetune(d, tmp_path, layers: int) -> int:
    """A Llama full fine-tune with `layers` layers (1B-class shapes), the whole training in host RAM
    on this CPU box: 16 layers need more than a 24 GiB box's budget, 4 about 17 GiB."""
    work = tmp_path / "work"
    model = work / f"llama-{layers}l"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": layers,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 8192}))
    cfg = {"model_name_or_path": str(model), "stage": "sft", "do_train": True, "finetuning_type": "full",
           "dataset": "alpaca", "template": "default", "output_dir": str(work / "out"), "cutoff_len": 1024,
           "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
           "supervisor": {"name": "big", "policy": "quickwait", "workdir": str(work),
                          "launcher": [sys.executable, "-c", "print('trained')"]}}
    text = yaml.safe_dump(cfg)
    return accept(d.state, d.store, parse_job_text(text, source="t.yaml", submit_dir=work, check_lf=False),
                  text=text, source="t.yaml", key=None)


def _quickwait(daemon_factory, tmp_path):
    pol = tmp_path / "policies"
    pol.mkdir()
    default = (Path(__file__).resolve().parents[2] / "policies" / "default.yaml").read_text()
    (pol / "quickwait.yaml").write_text(default.replace("name: default", "name: quickwait", 1)
                                        + "\nhost_wait_max_s: 3\nhost_wait_poll_s: 1\n")
    return daemon_factory(policy_dirs=[pol])


@pytest.fixture
def others_hold_6gib():
    """Another process of the box holding 6 GiB (written, so resident) while the test runs."""
    import subprocess

    hold = "import time\nb = b'x' * (6 << 30)\nprint('held', flush=True)\ntime.sleep(300)"
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    yield holder
    holder.kill()
    holder.wait()


def test_host_ram_others_hold_holds_the_attempt_back_bounded_then_it_starts_unchanged(
        daemon_factory, tmp_path, others_hold_6gib):
    """Issue 16 case 6, the daemon's side: memory other processes hold means wait, said in
    `status`, never a refusal and never a changed job; past the policy's bound it starts anyway.
    A 4-layer full fine-tune (~17 GiB, the whole training in host RAM) fits a 24 GiB box's budget
    but not while another process holds 6 GiB: its first attempt is held back (the estimate may
    be wrong: it is not refused)."""
    d = _quickwait(daemon_factory, tmp_path)
    job_id = _full_finetune(d, tmp_path, layers=4)
    run_until(d, lambda: any(e.kind == "host_memory_wait" for e in d.store.events(job_id)), what="held back")
    job = d.store.job(job_id)
    assert job.state == JobState.QUEUED and d.store.attempts(job_id) == []
    assert "other processes hold" in job.reason and "waiting for them, the job unchanged" in job.reason
    run_until(d, lambda: d.store.job(job_id).state == JobState.SUCCEEDED, timeout=60, what="started anyway")
    kinds = [e.kind for e in d.store.events(job_id)]
    assert kinds.count("host_memory_wait") == 1 and "host_memory_wait_over" in kinds
    (attempt,) = d.store.attempts(job_id)
    assert attempt.json("overrides")["rungs"] == [], "the job was not changed for memory others held"


def test_a_job_over_the_boxs_budget_is_not_held_back_for_memory_others_hold(daemon_factory, tmp_path):
    """Issue 27 item 5, the daemon's side: the 16-layer job needs more than this box's budget
    even empty; whatever others hold, waiting cannot make it fit: it starts at once."""
    d = _quickwait(daemon_factory, tmp_path)
    job_id = _full_finetune(d, tmp_path, layers=16)
    run_until(d, lambda: d.store.job(job_id).state == JobState.SUCCEEDED, timeout=60, what="the job to run")
    events = d.store.events(job_id)
    assert not [e for e in events if e.kind == "host_memory_wait"], [e.message for e in events]
    said = [e.message for e in events if e.kind == "host_memory_not_waited"]
    assert all("waiting cannot make it fit" in m for m in said), said


def test_a_namespace_whose_init_is_gone_is_never_scanned_its_inode_is_another_attempts_later(tmp_path):
    """A PID namespace's inode number is reused as soon as it is gone: named by its inode alone, a
    finished attempt's namespace later named another attempt's live one, and stopping the
    finished attempt's leftovers killed the other job's training (seen under two test workers).
    Here the name is one this test's own process is in: it must never count as the attempt's."""
    import subprocess

    own_ns = os.readlink("/proc/self/ns/pid")
    bare = tmp_path / "bare"
    bare.write_text(own_ns)  # what the shim wrote before: the inode alone
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    with open(f"/proc/{gone.pid}/stat", "rb") as f:
        stat = f.read()
    start = int(stat[stat.rindex(b")") + 2:].split()[19])
    gone.wait()
    dead_init = tmp_path / "dead-init"
    dead_init.write_text(f"{own_ns} {gone.pid} {start}\n")
    for name in (bare, dead_init):
        owner = Owner.for_attempt(None, "t-ns", None, create=False, pidns_file=name)
        assert os.getpid() not in [p.pid for p in owner.members(scan=True)], name.name
    me = tmp_path / "live-init"  # while its init lives, the namespace is the attempt's
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    me.write_text(f"{own_ns} {os.getpid()} {int(stat[stat.rindex(b')') + 2:].split()[19])}\n")
    owner = Owner.for_attempt(None, "t-ns", None, create=False, pidns_file=me)
    assert os.getpid() in [p.pid for p in owner.members(scan=True)]


def test_procs_json_is_private_like_every_other_file_about_a_job(tmp_path):
    """procs.json names the pids of a job's processes: 0600 like the rest of the attempt's
    record (it was written 0644 through the umask)."""
    import stat

    old = os.umask(0o022)
    try:
        owner = Owner.for_attempt(None, "job-1-attempt-1", tmp_path / "procs.json", create=True)
        owner.remember([psutil.Process()])
    finally:
        os.umask(old)
    assert json.loads((tmp_path / "procs.json").read_text()) == {str(os.getpid()): psutil.Process().create_time()}
    assert stat.S_IMODE((tmp_path / "procs.json").stat().st_mode) == 0o600
