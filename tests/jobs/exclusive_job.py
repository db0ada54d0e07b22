"""A training stand-in that PROVES it never runs twice: chaos tests' workload.

It takes an exclusive, non-blocking flock on `<outdir>/owner.lock`. If another
live instance of the same job holds it (two attempts at once, the failure the
supervisor must make impossible), it appends a line to `<outdir>/TWICE` and
exits 3. Otherwise it trains: one progress line per step, an atomic
`checkpoint-N/` (temp folder + fsync + rename) every `--checkpoint-every`
steps, resuming from the newest one, and exits 0 (or `--exit CODE`).

The `--outdir` path is on every process's command line (grandchildren too), so
a test finds every live process of a job by scanning /proc for it.

Chaos options: --ignore-term; --escape SECONDS (a grandchild that setsid()s
away from the process group and lives on after we exit, holding the lock);
--flood (print `[rank0]: Error: sample N skipped` lines at full speed instead
of training); --oom-at-step N (print a CUDA OOM traceback and exit 1);
--exit-file PATH (touched just before exiting, so a test knows the moment);
--quiet-tail SECONDS (silent before exiting); --tolerate-write-errors (train on
when stdout fails, as on a full disk).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

OOM_TRACEBACK = """Traceback (most recent call last):
  File "/opt/train.py", line 88, in train_step
    loss.backward()
  File "/usr/lib/python3/dist-packages/torch/_tensor.py", line 626, in backward
    torch.autograd.backward(
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of \
79.15 GiB of which 1.02 GiB is free. Process 4242 has 78.12 GiB memory in use. Of the allocated memory \
75.10 GiB is allocated by PyTorch, and 1.50 GiB is reserved by PyTorch but unallocated.
"""


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--outdir", required=True, type=Path)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--interval", type=float, default=0.1, help="seconds per step")
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--exit", type=int, default=0, help="exit code once the steps are done")
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--escape", type=float, default=0.0, metavar="SECONDS")
    p.add_argument("--flood", action="store_true")
    p.add_argument("--flood-seconds", type=float, default=0.0, help="0: flood until killed")
    p.add_argument("--oom-at-step", type=int, default=0)
    p.add_argument("--exit-file", type=Path)
    p.add_argument("--quiet-tail", type=float, default=0.0, metavar="SECONDS",
                   help="stay silent this long after the last step before exiting")
    p.add_argument("--tolerate-write-errors", action="store_true",
                   help="keep training when stdout fails (the log's disk is full)")
    p.add_argument("--grandchild", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def take_lock(outdir: Path) -> int:
    fd = os.open(outdir / "owner.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
        with open(outdir / "TWICE", "a") as f:
            f.write(f"{time.time():.3f} pid {proc_pid()} found the lock held by pid {holder}\n")
        print(f"TWO LIVE INSTANCES: lock held by pid {holder}", flush=True)
        sys.exit(3)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{proc_pid()}\n".encode(), 0)
    return fd


def last_checkpoint(outdir: Path) -> int:
    steps = []
    for d in outdir.glob("checkpoint-*"):
        tail = d.name.split("-", 1)[1]
        if tail.isdigit() and (d / "state.json").exists():
            steps.append(int(tail))
    return max(steps, default=0)


def save_checkpoint(outdir: Path, step: int) -> None:
    final = outdir / f"checkpoint-{step}"
    if final.exists():
        return
    tmp = outdir / f".checkpoint-{step}.tmp-{proc_pid()}"
    tmp.mkdir()
    with open(tmp / "state.json", "w") as f:
        json.dump({"step": step, "pid": proc_pid(), "ts": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, final)
    dfd = os.open(outdir, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def flood(seconds: float) -> None:
    """Keyword lines as fast as a pipe/file takes them: the log-follower stress."""
    out = sys.stdout.buffer
    end = time.monotonic() + seconds if seconds > 0 else float("inf")
    n = 0
    while time.monotonic() < end:
        out.write(b"".join(b"[rank0]: Error: sample %d skipped\n" % (n + i) for i in range(2000)))
        out.flush()
        n += 2000


def proc_pid() -> int:
    """Our pid as the /proc we see numbers it: the host's, unless the attempt runs in a PID
    namespace of its own, which has its own /proc too (tests find the host's pid from outside,
    harness.grandchild_of)."""
    try:
        return int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return os.getpid()


def grandchild(a: argparse.Namespace) -> None:
    os.setsid()  # leave the attempt's process group and session
    if a.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(a.outdir / "grandchild.pid", "w") as f:
        f.write(str(proc_pid()))
    end = time.monotonic() + a.escape
    while time.monotonic() < end:
        time.sleep(0.1)
    with open(a.outdir / "grandchild.done", "w") as f:
        f.write(str(time.time()))


def main(argv: list[str]) -> int:
    a = parse(argv)
    a.outdir.mkdir(parents=True, exist_ok=True)
    if a.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if a.grandchild:
        grandchild(a)
        return 0
    lock_fd = take_lock(a.outdir)
    start = last_checkpoint(a.outdir)
    with open(a.outdir / "starts", "a") as f:
        f.write(f"{time.time():.3f} pid {proc_pid()} from step {start}\n")
    print(f"started pid {proc_pid()}, resuming from step {start}", flush=True)
    if a.escape > 0:  # inherits the lock fd: a second instance fails while it lives
        subprocess.Popen([sys.executable, __file__, *argv, "--grandchild"], pass_fds=(lock_fd,),
                         stdin=subprocess.DEVNULL)
    if a.flood:
        flood(a.flood_seconds)
    for step in range(start + 1, a.steps + 1):
        time.sleep(a.interval)
        if a.oom_at_step and step == a.oom_at_step:
            sys.stdout.write(OOM_TRACEBACK)
            sys.stdout.flush()
            finish(a)
            return 1
        say(a, f"step {step}/{a.steps} loss {1.0 / step:.4f}\n"
               f"{100 * step // a.steps:3d}%|#| {step}/{a.steps} [00:01<00:01,  1.00it/s]\n")
        if a.checkpoint_every and step % a.checkpoint_every == 0:
            save_checkpoint(a.outdir, step)
    time.sleep(a.quiet_tail)
    if a.exit == 0:
        with open(a.outdir / "DONE", "a") as f:
            f.write(f"{time.time():.3f} pid {proc_pid()}\n")
    finish(a)
    return a.exit


def say(a: argparse.Namespace, text: str) -> None:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError:
        if not a.tolerate_write_errors:
            raise


def finish(a: argparse.Namespace) -> None:
    if a.exit_file:
        a.exit_file.touch()


if __name__ == "__main__":
    code = main(sys.argv[1:])
    try:
        sys.stdout.flush()
    except OSError:  # a full disk under the log: the exit code must still be ours
        os._exit(code)
    sys.exit(code)
