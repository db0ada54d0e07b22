"""Issue 27 item 2: without a cgroup the job is held to its host_memory_limit by the daemon's own
samples. They summed RSS, which counts every shared page in every process that maps it (forked
DataLoader workers, a launcher and its ranks): a 4-process job was stopped far below its real use.
The limit, the peak shown and what learning records are what the kernel charges: PSS."""

from __future__ import annotations

import sys

import pytest

from supervisor.core.states import JobState
from tests.core.test_control import add_job, daemon_factory, run_until  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

MiB = 1 << 20
# A parent fills 250 MiB, then forks three children. SHARED: they only read it (copy-on-write:
# four RSS of 250 MiB, one page each in PSS). OWN: each child also fills 250 MiB of its own.
TREE = """
import os, sys, time
block = b"x" * (250 << 20)
own = sys.argv[1] == "own"
kids = []
for _ in range(3):
    pid = os.fork()
    if pid == 0:
        mine = b"y" * (250 << 20) if own else b""
        assert block[-1:] == b"x"
        time.sleep(6)
        os._exit(0)
    kids.append(pid)
print("tree up", flush=True)
for pid in kids:
    os.waitpid(pid, 0)
print("done", flush=True)
"""


def _run(factory, tmp_path, mode: str):
    d = factory()
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "tree.py").write_text(TREE)
    job = add_job(d, tmp_path, [sys.executable, "tree.py", mode], host_memory_limit="900MiB", max_attempts=1)
    run_until(d, lambda: d.store.job(job).state in (JobState.SUCCEEDED, JobState.FAILED), timeout=60,
              what="the job to end")
    return d, job, [e for e in d.store.events(job) if e.kind == "memory_limit_enforced"]


def test_shared_pages_count_once_a_job_under_its_limit_runs_to_the_end(daemon_factory, tmp_path):  # noqa: F811 - the fixture
    d, job, enforced = _run(daemon_factory, tmp_path, "shared")
    assert enforced == [], enforced[0].message
    assert d.store.job(job).state == JobState.SUCCEEDED
    (attempt,) = d.store.attempts(job)
    assert 250 * MiB < attempt.peak_rss_bytes < 600 * MiB, attempt.peak_rss_bytes  # charged once


def test_a_job_whose_charged_memory_is_over_its_limit_is_stopped_and_told_by_which_measure(daemon_factory, tmp_path):  # noqa: F811 - the fixture
    d, job, enforced = _run(daemon_factory, tmp_path, "own")
    assert d.store.job(job).state == JobState.FAILED
    assert enforced and "proportional set size" in enforced[0].message, [e.message for e in enforced]
