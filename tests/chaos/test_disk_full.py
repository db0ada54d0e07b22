"""The state folder on a full disk (issue 9 item 5): a small tmpfs filled while a job runs.

While full, the daemon must keep following the training, say what is full and where,
start no new attempt and not make a new `attempt-N.unlaunched-*` folder every tick. Once
space returns it recovers by itself: the job ends correctly and nothing recorded is lost.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time

import psutil
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


def test_a_success_is_never_run_again_because_its_exit_record_could_not_be_written(chaos):
    """Issue 18 case 3: three jobs exit 0 while the state folder (a small tmpfs) is full. Their
    shims must still record the exit (space reserved at launch, or lingering until there is room):
    each job succeeds with exactly one attempt, none is run a second time."""
    state = chaos.state
    state.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(state)], check=False,
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs here (root is needed): {res.stderr.strip()}")
    outs = [chaos.out(f"job{i}") for i in range(3)]
    try:
        d = chaos.start(max_parallel=3, vram_release_timeout=0)
        for i, out in enumerate(outs):
            drop(chaos.spool, f"j{i}.yaml", exclusive_job(chaos.work, out, "--steps=40", "--interval=0.1",
                                                          "--tolerate-write-errors", name=f"j{i}", gpus=[i],
                                                          max_attempts=5))
        chaos.rec.wait(lambda: all((o / "starts").exists() for o in outs), 60, "three trainings running", d)
        assert fill(state) > 0
        chaos.rec.wait(lambda: all((o / "DONE").exists() for o in outs) and not trainings(chaos.work), 60,
                       "three trainings exited 0 on the full disk", d)
        time.sleep(1.0)  # the shims try to write their exit records now
        (state / "filler").unlink()
        chaos.rec.wait(lambda: all(chaos.rec.state(j) in TERMINAL for j in (1, 2, 3)), 60, "all three judged", d)
        for j, out in zip((1, 2, 3), outs):
            why = f"\n{explain(chaos.rec, j)}"
            assert chaos.rec.state(j) == "succeeded", why
            assert len(chaos.rec.attempts(j)) == 1, "a finished training was run again" + why
            assert len((out / "starts").read_text().splitlines()) == 1, why
    finally:
        if chaos.daemon is not None and chaos.daemon.proc.poll() is None:
            chaos.daemon.kill9()
        from .harness import kill_all, shims

        kill_all(trainings(chaos.work) + shims(state))
        time.sleep(0.2)
        subprocess.run(["umount", "-l", str(state)], check=False)


def test_the_shim_waits_for_room_to_write_the_exit_record_and_says_so(tmp_path):
    """No room even at launch (nothing could be reserved): the shim outlives its command, renamed
    so the daemon can tell (the local handle's `lingering`), and writes the record once there is
    room again; a stop never kills it meanwhile."""
    from supervisor.core.paths import AttemptPaths
    from supervisor.run import proctree

    disk = tmp_path / "disk"
    disk.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs here (root is needed): {res.stderr.strip()}")
    try:
        paths = AttemptPaths(disk / "attempt-1")
        paths.root.mkdir()
        paths.log.touch()
        proctree.write_launch(paths, argv=["true"], cwd=tmp_path, env={"PATH": os.environ["PATH"]})
        fill(disk)  # after launch.json, before the shim starts: it cannot reserve anything
        shim = subprocess.Popen([sys.executable, "-m", "supervisor.run.shim", str(paths.launch)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "PYTHONPATH": proctree.package_root()})
        h = proctree.Handle(shim.pid, psutil.Process(shim.pid).create_time(), shim)
        deadline = time.monotonic() + 20
        while not h.lingering() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h.lingering() and h.alive() and not paths.exit_record.exists()
        assert not h.force_stop(overdue_s=60.0) and h.alive(), "a stop must not kill the verdict's holder"
        (disk / "filler").unlink()
        deadline = time.monotonic() + 60
        while h.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not h.alive()
        assert proctree.read_exit(paths)["returncode"] == 0
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
