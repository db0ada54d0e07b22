"""The real daemon process, driven through the spool and the CLI, with real job processes."""

import json
import os
import signal
import subprocess
import sys
import time

import yaml

from ..conftest import REPO, DaemonProc, command_job, drop, fakejob, pids_with_marker, write_config

CUDA_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
            "capacity of 79.15 GiB of which 1.02 GiB is free. Process 4242 has 78.12 GiB memory in use. Of the "
            "allocated memory 75.10 GiB is allocated by PyTorch, and 1.50 GiB is reserved by PyTorch but "
            "unallocated.")
# How a rank really reports it: the exception line that ends a traceback (structural evidence).
CUDA_OOM_TRACEBACK = ("[rank0]: Traceback (most recent call last):\n"
                      '[rank0]:   File "/opt/train.py", line 42, in <module>\n'
                      "[rank0]:     loss.backward()\n"
                      f"[rank0]: {CUDA_OOM}")


def marker(tmp_path) -> str:
    """A unique argv token so a test can find every process of its job."""
    return f"--lock={tmp_path}/job.lock"


def job(tmp_path, *args, **sup):
    return command_job(tmp_path / "work", fakejob(marker(tmp_path), *args), **sup)


def no_job_processes(tmp_path) -> bool:
    return pids_with_marker(marker(tmp_path)) == []


def test_job_runs_to_success_and_leaves_nothing(daemon, tmp_path):
    daemon.start()
    drop(daemon.spool, "ok.yaml", job(tmp_path, "--steps", "3", "--sleep", "0.05", name="ok"))
    daemon.wait_state(1, "succeeded")
    status = daemon.status()
    assert status[0]["id"] == 1 and status[0]["name"] == "ok" and status[0]["attempts"] == 1
    shown = daemon.show(1)
    a = shown["attempt_list"][0]
    assert a["exit"]["returncode"] == 0 and a["diagnosis"]["category"] == "success"
    assert a["decision"]["kind"] == "done"
    attempt_dir = daemon.state / "jobs" / "1" / "attempt-1"
    assert {"output.log", "exit.json", "launch.json", "environment.json", "diagnosis.json"} <= {
        p.name for p in attempt_dir.iterdir()}
    assert "step 3/3" in daemon.cli("logs", "1").stdout
    assert no_job_processes(tmp_path)
    assert daemon.stop() == 0


def test_fatal_line_tears_the_attempt_down_at_once(daemon, tmp_path):
    """An OOM on one rank while the others block: we do not wait for them."""
    daemon.start()
    script = ("import sys,time,signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              f"print({CUDA_OOM_TRACEBACK!r}, flush=True)\ntime.sleep(600)\n")
    (tmp_path / "work" / "oom.py").write_text(script)
    drop(daemon.spool, "oom.yaml", command_job(tmp_path / "work", [sys.executable, "oom.py", marker(tmp_path)],
                                               max_attempts=1))
    daemon.wait_state(1, {"failed", "waiting_retry"}, timeout=30)
    a = daemon.show(1)["attempt_list"][0]
    assert a["exit"]["stopped_by"] == "fatal_signal"
    assert a["diagnosis"]["category"] == "gpu_oom"
    assert a["diagnosis"]["numbers"]["tried_to_allocate"] == 2 * 1024 ** 3
    assert a["detected_at"] - a["started_at"] < 10
    assert a["ended_at"] - a["detected_at"] < 3, "torn down promptly despite SIGTERM being ignored"
    assert no_job_processes(tmp_path)


def test_kill9_daemon_then_restart_adopts_and_finishes(daemon, tmp_path):
    progress, gate = tmp_path / "progress.txt", tmp_path / "go-on"
    daemon.start()
    # The job holds at step 3 until the test lets it go on, so it is still running when the restarted
    # daemon comes up however loaded the box is (a 3 s job once ended first: no attempt_adopted).
    drop(daemon.spool, "long.yaml", job(tmp_path, "--steps", "30", "--sleep", "0.01", f"--progress={progress}",
                                        f"--gate={gate}", "--gate-step=3"))
    daemon.wait_for(lambda: progress.exists() and len(progress.read_text().split()) >= 3, what="progress")
    daemon.kill9()
    assert not no_job_processes(tmp_path), "the attempt outlives the daemon in its own session"
    daemon.start()
    daemon.wait_for(lambda: any(e["kind"] == "attempt_adopted" for e in daemon.show(1)["events"]),
                    what="the restarted daemon adopting the attempt")
    gate.write_text("")
    daemon.wait_state(1, "succeeded", timeout=60)
    shown = daemon.show(1)
    assert shown["attempts"] == 1, "re-adopted, not started twice"
    assert any(e["kind"] == "attempt_adopted" for e in shown["events"])
    assert "TWO ATTEMPTS AT ONCE" not in daemon.cli("logs", "1").stdout
    steps = [int(x) for x in progress.read_text().split()]
    assert steps == list(range(1, 31))
    assert no_job_processes(tmp_path)


def test_kill9_daemon_with_stop_on_restart_starts_a_new_attempt(dirs, tmp_path):
    state, spool, _ = dirs
    d = DaemonProc(state, spool, write_config(tmp_path / "c.yaml", on_restart="stop"), tmp_path / "d.log")
    progress, gate = tmp_path / "progress.txt", tmp_path / "go-on"
    d.start()
    try:
        # The job holds at step 3 until the restarted daemon has stopped it (however loaded the box is,
        # it is still running then); the next attempt goes on past the gate once it is opened.
        drop(spool, "long.yaml", job(tmp_path, "--steps", "20", "--sleep", "0.01", f"--progress={progress}",
                                     f"--gate={gate}", "--gate-step=3"))
        d.wait_for(lambda: progress.exists() and len(progress.read_text().split()) >= 3, what="progress")
        d.kill9()
        d.start()
        d.wait_for(lambda: any(e["kind"] == "attempt_stopped_on_restart" for e in d.show(1)["events"]),
                   what="the restarted daemon stopping the attempt")
        gate.write_text("")
        d.wait_state(1, "succeeded", timeout=60)
        shown = d.show(1)
        assert shown["attempts"] == 2
        first, second = shown["attempt_list"]
        assert first["interrupted"] and second["exit"]["returncode"] == 0
        assert "TWO ATTEMPTS AT ONCE" not in d.cli("logs", "1", "--attempt", "2").stdout
        steps = [int(x) for x in progress.read_text().split()]
        assert steps[-1] == 20 and len(steps) == len(set(steps)), "continued, never ran twice at once"
    finally:
        d.stop(signal.SIGKILL)
    assert no_job_processes(tmp_path)


def test_power_loss_job_gone_without_exit_record_is_interrupted_and_resumed(daemon, tmp_path):
    progress, gate = tmp_path / "progress.txt", tmp_path / "go-on"
    daemon.start()
    # The job holds at step 2 until the power is back (on a loaded box it could otherwise finish
    # before the cut, and nothing would be interrupted).
    drop(daemon.spool, "long.yaml", job(tmp_path, "--steps", "20", "--sleep", "0.1", f"--progress={progress}",
                                        f"--gate={gate}", "--gate-step=2"))
    daemon.wait_for(lambda: progress.exists() and len(progress.read_text().split()) >= 2, what="progress")
    daemon.kill9()
    # (only this test's shim: its command line names the launch file in this test's state folder)
    for pid in pids_with_marker(marker(tmp_path)) + pids_with_marker(str(daemon.state)):
        try:
            os.kill(pid, signal.SIGKILL)  # the box lost power: everything died at once
        except ProcessLookupError:
            pass
    time.sleep(0.3)
    daemon.start()
    gate.write_text("")
    daemon.wait_state(1, "succeeded", timeout=60)
    shown = daemon.show(1)
    assert shown["attempt_list"][0]["interrupted"] is True
    assert any("vanished with the daemon" in e["message"] for e in shown["events"])
    assert [int(x) for x in progress.read_text().split()][-1] == 20


def test_graceful_stop_interrupts_and_restart_resumes(daemon, tmp_path):
    progress = tmp_path / "progress.txt"
    daemon.start()
    drop(daemon.spool, "long.yaml", job(tmp_path, "--steps", "20", "--sleep", "0.1", f"--progress={progress}"))
    daemon.wait_for(lambda: progress.exists(), what="progress")
    assert daemon.stop(signal.SIGTERM) == 0
    assert no_job_processes(tmp_path)
    assert daemon.job_state(1) == "interrupted"
    daemon.start()
    daemon.wait_state(1, "succeeded", timeout=60)
    shown = daemon.show(1)
    assert shown["attempts"] == 2 and shown["attempt_list"][0]["interrupted"]


def test_cancel_running_and_queued_jobs(daemon, tmp_path):
    daemon.start()
    drop(daemon.spool, "a.yaml", job(tmp_path, "--steps", "1000", "--sleep", "0.1", "--ignore-term", name="a"))
    daemon.wait_state(1, "running")
    drop(daemon.spool, "b.yaml", command_job(tmp_path / "work", ["true"], name="b"))
    daemon.wait_state(2, "queued")
    out = daemon.cli("cancel", "2", check=True).stdout
    assert "cancelled" in out
    assert "cancel requested" in daemon.cli("cancel", "1", check=True).stdout
    daemon.wait_state(1, "cancelled", timeout=30)
    assert no_job_processes(tmp_path)
    assert daemon.cli("cancel", "99").returncode == 2


def test_retry_requeues_a_failed_job(daemon, tmp_path):
    daemon.start()
    state_file = tmp_path / "runs"
    drop(daemon.spool, "f.yaml", job(tmp_path, "--steps", "1", "--sleep", "0", "--exit", "2",
                                     "--print", "Segmentation fault (core dumped)", "--fail-first", "1",
                                     f"--state={state_file}", max_attempts=1))
    daemon.wait_state(1, "failed", timeout=30)
    assert daemon.cli("retry", "1", check=True).returncode == 0
    daemon.wait_state(1, "succeeded", timeout=30)
    assert daemon.status()[0]["attempts"] == 2
    assert daemon.cli("retry", "1").returncode == 2  # succeeded jobs are not retried


def test_hang_is_detected_and_stopped(daemon, tmp_path):
    daemon.start()
    drop(daemon.spool, "h.yaml", job(tmp_path, "--steps", "1", "--sleep", "600", hang_timeout=1, max_attempts=1))
    daemon.wait_state(1, {"failed", "waiting_retry"}, timeout=30)
    a = daemon.show(1)["attempt_list"][0]
    assert a["exit"]["stopped_by"] == "hang" and a["diagnosis"]["category"] == "hang"
    assert no_job_processes(tmp_path)


def test_second_daemon_on_same_state_is_refused(daemon, tmp_path):
    daemon.start()
    daemon.wait_for(lambda: (daemon.state / "daemon.lock").exists(), what="lock")
    time.sleep(0.3)
    res = subprocess.run([sys.executable, "-m", "supervisor.cli", "daemon", *daemon.cli_args()],
                         capture_output=True, text=True, cwd=REPO, timeout=30, check=False)
    assert res.returncode == 1 and "holds" in res.stderr


def test_rejected_file_explains_itself(daemon, tmp_path):
    daemon.start()
    drop(daemon.spool, "typo.yaml", "supervisor:\n  comand: [true]\n")
    err = daemon.spool / "rejected" / "typo.yaml.error.txt"
    daemon.wait_for(err.exists, what="rejection")
    assert "did you mean 'command'" in err.read_text()


def test_cli_submit_wait_and_bad_input_exit_codes(daemon, tmp_path):
    daemon.start()
    good = tmp_path / "good.yaml"
    good.write_text(yaml_text := command_job(tmp_path / "work", ["true"], name="g"))
    res = daemon.cli("submit", str(good), "--wait", "30")
    assert res.returncode == 0 and "job 1" in res.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("supervisor:\n  command: [true]\n  gpu: [0]\n")
    res = daemon.cli("submit", str(bad))
    assert res.returncode == 2 and "did you mean 'gpus'" in res.stderr
    assert daemon.cli("show", "42").returncode == 2
    assert yaml_text


def test_status_shows_progress_while_running_and_notifications_run(dirs, tmp_path):
    state, spool, _ = dirs
    sink = tmp_path / "notified.jsonl"
    notify = [sys.executable, "-c", f"import sys; open({str(sink)!r}, 'a').write(sys.stdin.read())"]
    d = DaemonProc(state, spool, write_config(tmp_path / "c.yaml", notify=[{"command": notify,
                                                                             "on": ["succeeded"]}]),
                   tmp_path / "d.log")
    progress = tmp_path / "progress.txt"
    d.start()
    try:
        drop(spool, "p.yaml", job(tmp_path, "--steps", "40", "--sleep", "0.1", f"--progress={progress}"))
        def running_with_progress():
            rows = d.status()
            return rows and rows[0]["state"] == "running" and (rows[0]["progress"] or "").startswith("step ")

        d.wait_for(running_with_progress, what="live progress in status")
        assert d.status()[0]["progress"].endswith("/40")
        d.wait_state(1, "succeeded", timeout=60)
        d.wait_for(sink.exists, what="notification")
        event = json.loads(sink.read_text().splitlines()[0])
        assert event["event"] == "succeeded" and event["job"] == 1
        assert "daemon_error" not in d.log_path.read_text()
    finally:
        d.stop()


def test_relative_state_dir_still_works(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    cfg = write_config(tmp_path / "c.yaml")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "daemon", "--state-dir", "st",
                             "--spool-dir", "sp", "--config", str(cfg)], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        drop(tmp_path / "sp", "r.yaml", command_job(work, [sys.executable, "-c", "print('ok')"]))
        d = DaemonProc(tmp_path / "st", tmp_path / "sp", cfg, tmp_path / "unused.log")
        d.wait_state(1, "succeeded", timeout=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_launch_files_holding_the_environment_are_private(daemon, tmp_path):
    daemon.start()
    drop(daemon.spool, "s.yaml", command_job(tmp_path / "work", ["true"], env={"HF_TOKEN": "secret"}))
    daemon.wait_state(1, "succeeded")
    attempt = daemon.state / "jobs" / "1" / "attempt-1"
    for name in ("launch.json", "environment.json"):
        assert (attempt / name).stat().st_mode & 0o077 == 0, name


def test_shim_killed_from_outside_leaves_no_orphan_training(dirs, tmp_path):
    """Someone kill -9s the shim: its job is reparented to init, and we must still stop it
    before another attempt could take its GPUs (the marker path: no cgroup, no PID namespace)."""
    state, spool, _ = dirs
    daemon = DaemonProc(state, spool, write_config(tmp_path / "c.yaml", pid_namespace="off"), tmp_path / "d.log")
    daemon.start()
    drop(daemon.spool, "o.yaml", job(tmp_path, "--steps", "1000", "--sleep", "0.1", "--ignore-term",
                                     max_attempts=1))
    daemon.wait_for(lambda: len(pids_with_marker(marker(tmp_path))) == 1 and daemon.job_state(1) == "running",
                    what="running job")
    time.sleep(1.0)  # let the daemon sample the tree
    shims = [p for p in pids_with_marker(str(daemon.state)) if p != daemon.proc.pid]
    assert len(shims) == 1
    os.kill(shims[0], signal.SIGKILL)
    daemon.wait_state(1, {"failed", "waiting_retry"}, timeout=30)
    assert no_job_processes(tmp_path)
    assert any(e["kind"] == "orphans_stopped" for e in daemon.show(1)["events"])
    daemon.stop()


def test_a_program_that_survives_its_own_oom_can_opt_out_of_early_teardown(daemon, tmp_path):
    """accelerate's find_executable_batch_size catches the OOM, halves the batch and goes on."""
    daemon.start()
    script = (f"import time\nprint({CUDA_OOM_TRACEBACK!r}, flush=True)\nprint('retrying with a smaller batch', "
              "flush=True)\ntime.sleep(1.5)\nprint('done', flush=True)\n")
    (tmp_path / "work" / "recovers.py").write_text(script)
    drop(daemon.spool, "r.yaml", command_job(tmp_path / "work", [sys.executable, "recovers.py"],
                                             stop_on_fatal_line=False, max_attempts=1))
    daemon.wait_state(1, {"succeeded", "failed"}, timeout=30)
    a = daemon.show(1)["attempt_list"][0]
    assert daemon.job_state(1) == "succeeded" and a["exit"]["stopped_by"] is None
    assert a["diagnosis"]["category"] == "success"


WAIT_FOR_FILE = ("import os, sys, time\nopen(sys.argv[1] + '.started', 'w').close()\n"
                 "while not os.path.exists(sys.argv[1]):\n    time.sleep(0.05)\nprint('released', flush=True)\n")


def test_recovery_that_cannot_read_the_job_file_keeps_the_live_training(daemon, tmp_path):
    """Issue 18 case 1: after `kill -9` of the daemon, job 1's job.yaml holds a key the restarted
    version refuses (an upgrade with KillMode=process). Its training still runs: job 1 must not be
    failed and job 2 must not start beside it; it is adopted and finishes."""
    work = tmp_path / "work"
    (work / "wait.py").write_text(WAIT_FOR_FILE)
    release, ran = tmp_path / "release", tmp_path / "job2-ran"
    daemon.start()
    drop(daemon.spool, "a.yaml", command_job(work, [sys.executable, "wait.py", str(release)], name="first"))
    daemon.wait_state(1, "running")
    drop(daemon.spool, "b.yaml", command_job(work, [sys.executable, "-c", f"open({str(ran)!r}, 'w')"], name="second"))
    daemon.wait_for(lambda: (tmp_path / "release.started").exists(), what="job 1 running")
    daemon.wait_for(lambda: daemon.job_state(2) == "queued", what="job 2 queued")
    daemon.kill9()
    job_file = daemon.state / "jobs" / "1" / "job.yaml"
    doc = yaml.safe_load(job_file.read_text())
    doc["supervisor"]["frobnicate"] = True  # what the new version refuses
    job_file.write_text(yaml.safe_dump(doc))
    daemon.start()
    time.sleep(3)  # many ticks of the restarted daemon
    assert daemon.job_state(1) == "running", daemon.show(1)["reason"]
    assert daemon.job_state(2) == "queued" and not ran.exists(), "job 2 started beside a live training"
    release.touch()
    daemon.wait_state(1, "succeeded", timeout=60)
    daemon.wait_state(2, "succeeded", timeout=60)
    adopted = [e["message"] for e in daemon.show(1)["events"] if e["kind"] == "attempt_adopted"]
    assert adopted and "no longer parses" in adopted[0]
