"""Real processes: the whole tree goes, nothing is left, the exit record is true."""

import os
import sys
import time

import psutil

from supervisor.core.paths import AttemptPaths
from supervisor.run import proctree

from ..conftest import fakejob


def wait_for(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def start(tmp_path, *args, **kw):
    paths = AttemptPaths(tmp_path / "attempt-1")
    h = proctree.launch(paths, argv=fakejob(*args), cwd=tmp_path, env=dict(os.environ), **kw)
    return paths, h


def alive(pids):
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_exit_code_and_log_are_recorded(tmp_path):
    paths, h = start(tmp_path, "--steps", "2", "--sleep", "0", "--exit", "3", "--print", "boom")
    assert wait_for(lambda: not h.alive())
    rec = proctree.read_exit(paths)
    assert rec["returncode"] == 3 and rec["signal"] is None and rec["duration_s"] >= 0
    assert "step 2/2" in paths.log.read_text() and "boom" in paths.log.read_text()


def test_terminate_kills_detached_workers_that_ignore_sigterm(tmp_path):
    """Like torchrun: workers in their own session, ignoring SIGTERM. All must go."""
    paths, h = start(tmp_path, "--steps", "1000", "--sleep", "0.1", "--children", "2",
                     "--detached-child", "--ignore-term")
    assert wait_for(lambda: len(h.processes()) >= 3)
    tree = [p.pid for p in h.processes()]
    sids = {os.getsid(p) for p in tree}
    assert len(sids) >= 2, "the workers really left the launcher's session"
    took = proctree.terminate(h, grace_s=0.5)
    assert took < 5
    assert alive(tree) == [] and not h.alive()
    rec = proctree.read_exit(paths)
    assert rec["signal"] == "SIGKILL"  # it ignored SIGTERM, so the deadline hit


def test_graceful_term_within_deadline(tmp_path):
    paths, h = start(tmp_path, "--steps", "1000", "--sleep", "0.1", "--children", "1")
    assert wait_for(lambda: len(h.processes()) >= 2)
    proctree.terminate(h, grace_s=5)
    assert proctree.read_exit(paths)["signal"] == "SIGTERM"


def test_orphans_left_by_the_main_process_are_reaped_by_the_shim(tmp_path):
    paths, h = start(tmp_path, "--steps", "1", "--sleep", "0", "--children", "2", "--detached-child")
    assert wait_for(lambda: not h.alive(), timeout=15)
    kids = [int(line.split()[-1]) for line in paths.log.read_text().splitlines() if line.startswith("child pid")]
    assert len(kids) == 2 and alive(kids) == []
    assert proctree.read_exit(paths)["returncode"] == 0


def test_missing_executable_is_a_clear_127(tmp_path):
    paths = AttemptPaths(tmp_path / "attempt-1")
    h = proctree.launch(paths, argv=["/nonexistent/llamafactory-cli", "train"], cwd=tmp_path, env=dict(os.environ))
    assert wait_for(lambda: not h.alive())
    assert proctree.read_exit(paths)["returncode"] == 127
    assert "cannot start '/nonexistent/llamafactory-cli'" in paths.log.read_text()


def test_rlimit_data_makes_allocation_fail_inside_the_program(tmp_path):
    paths = AttemptPaths(tmp_path / "attempt-1")
    code = "b = bytearray(400 * 1024 * 1024); print('allocated')"
    h = proctree.launch(paths, argv=[sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ),
                        rlimits={"RLIMIT_DATA": 200 * 1024 * 1024})
    assert wait_for(lambda: not h.alive())
    assert proctree.read_exit(paths)["returncode"] == 1
    assert "MemoryError" in paths.log.read_text()


def test_identity_survives_pid_reuse_check(tmp_path):
    _paths, h = start(tmp_path, "--steps", "1000", "--sleep", "0.1")
    adopted = proctree.Handle(h.pid, h.create_time)
    assert adopted.alive() and adopted.shim() is not None
    wrong = proctree.Handle(h.pid, h.create_time - 100)
    assert not wrong.alive()
    proctree.terminate(adopted, grace_s=1)
    h.reap()
    assert not adopted.alive()
