"""The state folder on a full disk (issue 9 item 5): a small tmpfs filled while a job runs.

While full, the daemon must keep following the training, say what is full and where,
start no new attempt and not make a new `attempt-N.unlaunched-*` folder every tick. Once
space returns it recovers by itself: the job ends correctly and nothing recorded is lost.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time

import pytest

from tests.conftest import drop

from .harness import TERMINAL, exclusive_job, explain, trainings

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root"),
]


def fill(folder) -> int:
    """Write until the file system refuses; returns the bytes written."""
    written = 0
    with open(folder / "filler", "wb", buffering=0) as f:
        chunk = b"\0" * 65536
        while True:
            try:
                written += f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        for size in (4096, 512, 1):  # the last crumbs too
            while True:
                try:
                    written += f.write(b"\0" * size)
                except OSError:
                    break
    return written


def test_full_state_disk_keeps_control_and_recovers(chaos):
    state = chaos.state
    state.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(state)], check=False,
                         capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        d = chaos.start()
        out = chaos.out("full")
        drop(chaos.spool, "full.yaml", exclusive_job(chaos.work, out, "--steps=70", "--interval=0.1",
                                                     "--checkpoint-every=5", "--tolerate-write-errors",
                                                     name="full", max_attempts=20))
        chaos.rec.wait(lambda: (out / "checkpoint-10").exists(), 30, "training at step 10", d)
        time.sleep(0.3)
        before = {e["id"]: e["message"] for e in chaos.rec.events()}
        assert fill(state) > 0
        full_since = time.monotonic()
        job_dir = state / "jobs" / "1"
        unlaunched_max = 0
        while time.monotonic() - full_since < 10:  # the training ends (exit 0) during this time
            unlaunched_max = max(unlaunched_max, len(list(job_dir.glob("attempt-*.unlaunched-*"))))
            assert len((out / "starts").read_text().splitlines()) == 1, "a new attempt started on a full disk"
            assert d.proc.poll() is None, "the daemon died of the full disk"
            time.sleep(0.1)
        assert (out / "DONE").exists() and not trainings(chaos.work), "the training finished while full"
        said = [line for line in (chaos.root / "daemon.log").read_text(errors="replace").splitlines()
                if str(state) in line and ("full" in line.lower() or "no space" in line.lower())]
        (state / "filler").unlink()
        chaos.rec.wait(lambda: chaos.rec.state(1) in TERMINAL, 40, "job 1 terminal after space returned", d)
        events = {e["id"]: e["message"] for e in chaos.rec.events()}
        said += [m for m in events.values() if str(state) in m and ("full" in m.lower() or "no space" in m.lower())]
        why = f"\n{explain(chaos.rec, 1)}\n" + (chaos.root / "daemon.log").read_text(errors="replace")[-2500:]
        assert chaos.rec.state(1) == "succeeded", why
        assert unlaunched_max <= 1, f"{unlaunched_max} attempt-N.unlaunched-* folders while full" + why
        assert said, f"nothing said that {state} is full" + why
        assert all(events.get(i) == m for i, m in before.items()), "events recorded before the fill were lost"
        assert chaos.rec.integrity() == "ok"
        assert len((out / "starts").read_text().splitlines()) <= 2
        assert d.proc.poll() is None, "recovered by itself, without a restart"
    finally:
        if chaos.daemon is not None and chaos.daemon.proc.poll() is None:
            chaos.daemon.kill9()
        from .harness import kill_all, shims

        kill_all(trainings(chaos.work) + shims(state))
        time.sleep(0.2)
        subprocess.run(["umount", "-l", str(state)], check=False)
