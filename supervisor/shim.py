"""The launch shim: the session leader of every attempt.

`python -m supervisor.shim LAUNCH_JSON` runs the attempt's argv (no shell)
with its log on stdout/stderr and, when the command ends, writes the exit
record atomically next to it. Because the shim (not the daemon) waits for the
job, the true exit status survives a daemon crash: a restarted daemon reads
exit.json instead of guessing. The shim is a child subreaper, so descendants
that lose their parent (torchrun workers, dataloader workers) stay in its tree
and are reaped here; when the main command ends, stragglers are stopped, so an
attempt never leaves orphans behind, with or without the daemon.

It stays tiny on purpose: stdlib only, no torch, no supervisor imports beyond
atomic writes.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
STRAGGLER_GRACE_S = 5.0


def _become_subreaper() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except Exception:  # not Linux: the daemon's tree walk still covers most cases
        pass


def _descendants() -> list[int]:
    """Pids whose parent chain leads to us (via /proc; stdlib only)."""
    me = os.getpid()
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError):
            continue
        parents[int(entry)] = ppid
    out, frontier = [], {me}
    while frontier:
        nxt = {pid for pid, pp in parents.items() if pp in frontier and pid not in out and pid != me}
        out.extend(nxt)
        frontier = nxt
    return out


def _signal_all(sig: int) -> None:
    for pid in _descendants():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _preexec(spec: dict) -> None:
    """Runs in the child between fork and exec: limits, then cgroup membership."""
    os.setpgid(0, 0)  # its own group, so a terminal-style killpg never hits the shim
    for name, value in (spec.get("rlimits") or {}).items():
        res = getattr(resource, name)
        resource.setrlimit(res, (int(value), int(value)))
    procs = spec.get("cgroup_procs")
    if procs:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _write_exit(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    exit_path = Path(spec["exit_record"])
    _become_subreaper()

    # Someone signalling only the shim (a user, systemd): pass it on to the job,
    # keep waiting so the exit record is still written.
    def forward(signum, _frame):
        _signal_all(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)

    log_fd = os.open(spec["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    started = time.time()
    try:
        pid = os.fork()
    except OSError as exc:
        _write_exit(exit_path, {"returncode": 127, "signal": None, "error": f"fork failed: {exc}",
                                "started_at": started, "ended_at": time.time(), "duration_s": 0.0})
        return 127
    if pid == 0:  # child
        try:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.chdir(spec["cwd"])
            _preexec(spec)
            os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
        except BaseException as exc:  # exec failed: say so in the log, exit like a shell would
            try:
                os.write(2, f"oom-supervisor: cannot start {spec['argv'][0]!r}: {exc}\n".encode())
            finally:
                os._exit(127)
    os.close(log_fd)

    status = None
    while status is None:
        try:
            wpid, wstatus = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            break
        if wpid == pid:
            status = wstatus
    ended = time.time()

    # The main command is gone: stop whatever it left behind, then reap it all.
    deadline = time.monotonic() + STRAGGLER_GRACE_S
    if _descendants():
        _signal_all(signal.SIGTERM)
    while _descendants() and time.monotonic() < deadline:
        _reap_nohang()
        time.sleep(0.05)
    if _descendants():
        _signal_all(signal.SIGKILL)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue

    if status is None:
        record = {"returncode": None, "signal": None, "error": "lost track of the main process"}
    else:
        code = os.waitstatus_to_exitcode(status)
        record = {"returncode": code,
                  "signal": signal.Signals(-code).name if code < 0 else None}
    record.update(started_at=started, ended_at=ended, duration_s=round(ended - started, 3), pid=pid)
    _write_exit(exit_path, record)
    code = record["returncode"]
    return 128 + (-code) if isinstance(code, int) and code < 0 else (code if code is not None else 1)


def _reap_nohang() -> None:
    while True:
        try:
            wpid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if wpid == 0:
            return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
