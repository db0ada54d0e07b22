"""The cgroup path, for real, where this machine lets us make one (CI runs as root)."""

import os
import sys
import time

import pytest

from supervisor.core.paths import AttemptPaths
from supervisor.run import proctree
from supervisor.run.limits import JobCgroup, detect_cgroup

SUPPORT = detect_cgroup()
pytestmark = pytest.mark.skipif(SUPPORT is None, reason="no writable cgroup memory controller here (needs root)")


def test_kernel_kills_inside_the_cgroup_and_the_counter_says_so(tmp_path):
    cg = JobCgroup.create(SUPPORT, f"test-{os.getpid()}", 150 * 1024 * 1024)
    paths = AttemptPaths(tmp_path / "attempt-1")
    code = "import time\nchunks=[]\nwhile True:\n    chunks.append(bytearray(20*1024*1024))\n    time.sleep(0.01)"
    h = proctree.launch(paths, argv=[sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ), cgroup=cg)
    deadline = time.monotonic() + 30
    while h.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not h.alive()
    rec = proctree.read_exit(paths)
    assert rec["signal"] == "SIGKILL"
    assert cg.oom_kills() >= 1
    assert cg.peak_bytes() >= 100 * 1024 * 1024
    assert cg.remove()


def test_attempt_processes_are_found_through_the_cgroup(tmp_path):
    cg = JobCgroup.create(SUPPORT, f"test2-{os.getpid()}", 1 << 30)
    paths = AttemptPaths(tmp_path / "attempt-1")
    h = proctree.launch(paths, argv=[sys.executable, "-c", "import time; time.sleep(60)"], cwd=tmp_path,
                        env=dict(os.environ), cgroup=cg)
    deadline = time.monotonic() + 10
    while not cg.pids() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cg.pids() and h.pid not in cg.pids()  # the job is inside; the shim is not
    proctree.terminate(h, grace_s=1)
    assert cg.pids() == [] and cg.remove()
