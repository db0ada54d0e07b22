"""The launch shim: the session leader of every attempt.

`python -m supervisor.run.shim LAUNCH_JSON` runs the attempt's argv (no shell)
with its log on stdout/stderr and, when the command ends, writes the exit
record atomically next to it. Because the shim (not the daemon) waits for the
job, the true exit status survives a daemon crash: a restarted daemon reads
exit.json instead of guessing. The shim is a child subreaper, so descendants
that lose their parent (torchrun workers, dataloader workers) stay in its tree
and are reaped here; when the main command ends, stragglers are stopped, so an
attempt never leaves orphans behind, with or without the daemon.

Ownership: before it forks the command, the shim joins the attempt's
ownership cgroup (when the daemon made one), so every process of the attempt,
whatever it does to its session or parent, stays countable and killable after
the shim itself is gone. If it cannot join, it runs nothing: an attempt the
daemon could lose track of is worse than one that did not start.

Log cap: the log is the command's own stdout/stderr (no pipe through us, so a
dead shim never breaks the training's output). A small thread checks its size;
past `max_log_bytes` it keeps the head once (`<log>.head`) and the latest part
(`<log>.1`), then truncates the log in place (the command writes with
O_APPEND, so its next line lands at the new start).

Identity (a shared box): the shim runs as root and stays so (it joins the owner cgroup, writes
exit.json, stops the tree); only the command drops to its submitter, in the child between fork
and exec: limits and cgroup membership first (they need the privilege), then setgroups, setgid,
setuid (all three ids of each), checked, then chdir as the user. A spec that asks for an identity
and has none, or a drop that did not take, runs nothing.

It stays tiny on purpose: stdlib only, no torch, no supervisor imports beyond
`run/procstat` (itself stdlib only).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import resource
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from supervisor.run.procstat import stat_field, tree_charged_bytes

PR_SET_CHILD_SUBREAPER = 36
PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1
CLONE_NEWPID = 0x20000000
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_SLAVE = 0x2, 0x4, 0x8, 0x4000, 0x80000
IN_PID_NAMESPACE = False  # this shim is the init of the attempt's own PID namespace
EXIT_RESERVE_BYTES = 64 << 10
INIT_COMM = "oomsv-init"  # the shim as PID 1 of the attempt's own PID namespace
LINGER_COMM = "oomsv-exitwait"  # the shim's name while it waits for room to write the exit record
STRAGGLER_GRACE_S = 5.0
# What a scheduler gives the job and the attempt must never drop: its allocation (SLURM_*, the GPUs
# it assigned on this node) and the multi-node rendezvous its batch script exports per node.
ALLOCATION_PREFIXES = ("SLURM_", "SLURMD_")
ALLOCATION_VARS = frozenset({"CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
                             "GPU_DEVICE_ORDINAL", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"})
SHIM_OWN_VARS = frozenset({"PYTHONPATH"})  # set for the shim itself (to import it), not for the job


def job_environment(attempt_env: dict, scheduler_env: dict | None) -> dict:
    """The command's environment. Locally: exactly the attempt's. Inside a scheduler's job, merged:
    1. the scheduler's environment (what it set, and what the batch script exported) is the base;
    2. the attempt's environment wins over it (its remedies, the job's own `env:`, its PYTHONPATH);
    3. the scheduler's allocation wins over both (ALLOCATION_PREFIXES / ALLOCATION_VARS as the
       scheduler set them: the job id, this node's rank, its GPUs, the rendezvous host and port).
    A multi-node job also gets FORCE_TORCHRUN=1 where the batch script exported it (LLaMA-Factory
    starts torchrun only then; an attempt that set it keeps its own value)."""
    if scheduler_env is None:
        return dict(attempt_env)
    env = {k: v for k, v in scheduler_env.items() if k not in SHIM_OWN_VARS}
    env.update(attempt_env)
    env.update({k: v for k, v in scheduler_env.items() if k.startswith(ALLOCATION_PREFIXES) or k in ALLOCATION_VARS})
    return env


def _become_subreaper() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the daemon's tree walk still covers most cases
        pass


def _self_pid() -> int:
    """Our pid as /proc shows it (the host's numbering, also inside our own PID namespace)."""
    try:
        return int(os.readlink("/proc/self"))
    except (OSError, ValueError):
        return os.getpid()


def _descendants() -> list[int]:
    """Pids (as /proc numbers them) whose parent chain leads to us (via /proc; stdlib only)."""
    me = _self_pid()
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        ppid = stat_field(entry, 4)
        if ppid is not None:
            parents[int(entry)] = ppid
    out, frontier = [], {me}
    while frontier:
        nxt = {pid for pid, pp in parents.items() if pp in frontier and pid not in out and pid != me}
        out.extend(nxt)
        frontier = nxt
    return out


def _local_pid(proc_pid: int) -> int:
    """A /proc pid as our own PID namespace numbers it (what kill() takes from us)."""
    if not IN_PID_NAMESPACE:
        return proc_pid
    try:
        with open(f"/proc/{proc_pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return -1


def _proc_pid_of(local: int) -> int:
    """Our child `local` (our namespace's number) as /proc numbers it: the kernel's log says that."""
    if not IN_PID_NAMESPACE:
        return local
    for pid in _descendants():
        if _local_pid(pid) == local:
            return pid
    return local


def _signal_all(sig: int) -> None:
    for pid in _descendants():
        local = _local_pid(pid)
        if local <= 0:
            continue
        try:
            os.kill(local, sig)
        except ProcessLookupError:
            pass


def _name_namespace(path: Path, init: int) -> None:
    """`pid:[inode] INIT_PID INIT_START` for the daemon: a namespace's inode number is reused once
    it is gone, so the daemon trusts the name only while this init (pid and start time, as /proc
    tells them outside the namespace) lives; when it dies the kernel has killed the rest."""
    try:
        ns = os.readlink(f"/proc/{init}/ns/pid")
        start = stat_field(init, 22)
        if start is None:
            return
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(f"{ns} {init} {start}\n")
        os.replace(tmp, path)
    except OSError:
        pass  # the daemon still has the marker and the pids it sees


def _enter_pid_namespace(pidns_file: str | None) -> int | None:
    """Run the rest of the shim as PID 1 of a new PID namespace, the attempt's owner where no
    cgroup could be made: when this init dies, the kernel kills every process in the namespace,
    a helper that double-forked with an empty environment into its own session included.

    In the process the daemon started (the outer one) this waits for the init, passes signals on
    and returns its exit code; in the init it returns None. The init dies with the outer process
    (PR_SET_PDEATHSIG), so `kill -9` of the shim the daemon follows still takes everything."""
    global IN_PID_NAMESPACE
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWPID) != 0:
        return None  # not allowed here: the daemon said at start-up what it has instead
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        os.set_blocking(r, False)
        try:
            if os.read(r, 1) == b"":
                os._exit(137)  # the outer shim died before we could ask to die with it
        except BlockingIOError:
            pass
        os.close(r)
        IN_PID_NAMESPACE = True
        _set_comm(INIT_COMM)  # so the shim the daemon follows (the outer one) is told apart
        return None
    os.close(r)
    if pidns_file:
        _name_namespace(Path(pidns_file), pid)

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
        except ChildProcessError:
            return 1
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def _own_proc() -> None:
    """In the job (our PID namespace's child), a /proc of that namespace in a mount namespace of
    its own: the host's /proc numbers nothing by the job's pids, so `/proc/<os.getpid()>` (psutil,
    DeepSpeed's CPU accelerator in every LLaMA-Factory rank) read another process, or none. The
    shim keeps the host's /proc, which its pid translation and the daemon rely on; the host's
    later mounts still reach the job (a slave, not a private, copy)."""
    libc = ctypes.CDLL(None, use_errno=True)
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    if (libc.unshare(CLONE_NEWNS) != 0 or libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None) != 0
            or libc.mount(b"proc", b"/proc", b"proc", flags, None) != 0):
        os.write(2, f"oom-supervisor: the job sees the host's /proc (own /proc: errno {ctypes.get_errno()})\n"
                 .encode())


def _preexec(spec: dict) -> None:
    """Runs in the child between fork and exec: limits, then cgroup membership."""
    os.setpgid(0, 0)  # its own group, so a terminal-style killpg never hits the shim
    if IN_PID_NAMESPACE:
        _own_proc()
    for name, value in (spec.get("rlimits") or {}).items():
        res = getattr(resource, name)
        resource.setrlimit(res, (int(value), int(value)))
    procs = spec.get("cgroup_procs")
    if procs and procs != spec.get("owner_procs"):  # v1: memory is another hierarchy
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _drop_privileges(identity: dict | None) -> None:
    """Become the job's user for good (in the child, after what needs root); raises if it did not take."""
    if identity is None:
        return
    uid, gid = int(identity["uid"]), int(identity["gid"])
    groups = [int(g) for g in identity.get("groups") or [gid]]
    if os.getuid() != uid or os.getgroups() != groups:
        os.setgroups(groups)
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        raise PermissionError(f"could not become uid {uid} gid {gid}")
    if uid != 0:
        try:
            os.setuid(0)
        except PermissionError:
            return
        raise PermissionError("the job could take root back after the drop; not running it")


def _own(path: str, identity: dict | None) -> None:
    """A file the shim made for the job's log (head, latest part): the job's owner's, like the log."""
    if identity is not None and os.geteuid() == 0:
        os.chown(path, int(identity["uid"]), int(identity["gid"]), follow_symlinks=False)


def _open_log(path: str) -> int:
    """The log for the command: our stdout when that is it (the daemon opened it for us: on a shared
    box the file is the job's user's, which root without CAP_DAC_OVERRIDE cannot open for writing),
    else opened here (a Slurm job's shim, a test)."""
    try:
        out, st = os.fstat(1), os.stat(path, follow_symlinks=False)
        if (out.st_dev, out.st_ino) == (st.st_dev, st.st_ino):
            return os.dup(1)
    except OSError:
        pass
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)


def _signal_name(signum: int) -> str:
    """SIGKILL, or SIGRTMIN+3 for real-time signals (no name in the enum)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        if signal.SIGRTMIN <= signum <= signal.SIGRTMAX:
            return f"SIGRTMIN+{signum - signal.SIGRTMIN}"
        return f"SIG{signum}"


def _join_owner(spec: dict) -> str | None:
    """Join the attempt's ownership cgroup; the reason when that is impossible."""
    procs = spec.get("owner_procs")
    if not procs:
        return None
    try:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    except OSError as exc:
        return f"cannot join the attempt's ownership cgroup {procs}: {exc}"
    return None


def _cap_log(log_path: str, log_fd: int, cap: int, stop: threading.Event, identity: dict | None = None) -> None:
    """Keep the log under `cap` bytes: head once, the latest part, then truncate in place."""
    head_bytes = min(cap // 4, 64 << 20)
    keep = cap // 4
    head_done = os.path.exists(log_path + ".head")
    dropped = 0
    wait = 0.1
    while not stop.wait(wait):
        try:
            size = os.fstat(log_fd).st_size
            # Look again soon when the log nears its cap: a flood must not overshoot it by much.
            wait = 0.005 if size > cap // 2 else 0.1
            if size <= cap:
                continue
            with open(log_path, "rb") as src:
                if not head_done:
                    _copy_to(src, 0, head_bytes, log_path + ".head", identity)
                    head_done = True
                # Copy up to what is there right now, then truncate at once: what the command writes
                # in between is the only part lost (microseconds of a flood).
                end = os.fstat(log_fd).st_size
                _copy_to(src, max(0, end - keep), end - max(0, end - keep), log_path + ".1", identity)
                size = max(size, end)
            os.ftruncate(log_fd, 0)
            dropped += size
            os.write(log_fd, (f"[oom-supervisor] log over {cap} bytes: truncated here "
                              f"({dropped} bytes so far; first {head_bytes} in {log_path}.head, "
                              f"the latest {keep} before this line in {log_path}.1)\n").encode())
        except OSError:
            continue


def _tree_rss() -> int:
    """What the kernel charges the tree (PSS; RSS where a kernel lacks it), as the daemon counts."""
    return tree_charged_bytes(_descendants())[0]


def _sample_peak(peak: list[int], stop: threading.Event) -> None:
    """Peak resident memory of the command's tree, for the exit record: where the daemon cannot
    sample it itself (inside a Slurm job on another node), this is the only figure there is."""
    while not stop.wait(0.5):
        try:
            peak[0] = max(peak[0], _tree_rss())
        except OSError:
            pass


def _copy_to(src, offset: int, length: int, dest: str, identity: dict | None = None) -> None:
    src.seek(offset)
    data = src.read(length)
    tmp = dest + ".tmp"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as f:
        f.write(data)
    _own(tmp, identity)
    os.replace(tmp, dest)


class ExitRecord:
    """The exit record, with its space taken when the attempt starts.

    A training that finished must never be run again because its exit status could not be
    written: the temp file's blocks are allocated at launch (posix_fallocate), so a disk that
    fills while the job runs cannot lose how it ended. If the record still cannot be written
    (no room even at launch), the shim stays, renamed `oomsv-exitwait` so the daemon can tell,
    and retries until it can: the daemon holds the job meanwhile and says so.
    The temp name is unique per host and process: every node of a multi-node job writes its
    own record beside the others.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
        self.fd: int | None = None
        try:
            self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            os.posix_fallocate(self.fd, 0, EXIT_RESERVE_BYTES)
        except OSError:
            pass  # no room even now: write() lingers until there is

    def write(self, record: dict) -> None:
        data = json.dumps(record).encode()
        delay, renamed = 0.5, False
        while True:
            try:
                self._write_once(data)
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                if not renamed:
                    _set_comm(LINGER_COMM)
                    renamed = True
                time.sleep(delay)
                delay = min(delay * 2, 30.0)

    def _write_once(self, data: bytes) -> None:
        if self.fd is None:
            self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        written = 0
        while written < len(data):
            written += os.pwrite(self.fd, data[written:], written)
        os.ftruncate(self.fd, len(data))
        os.fsync(self.fd)
        os.replace(self.tmp, self.path)
        os.close(self.fd)
        self.fd = None


def _set_comm(name: str) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the name is for `ps` only


def node_identity() -> tuple[str, int | None]:
    """This node's name (Slurm's, else the host's), made safe for a file name, and its rank
    among the job's nodes (SLURM_NODEID) when a scheduler runs us."""
    name = os.environ.get("SLURMD_NODENAME") or socket.gethostname() or "node"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name).lstrip(".")[:100] or "node"
    try:
        rank = int(os.environ["SLURM_NODEID"])
    except (KeyError, ValueError):
        rank = None
    return safe, rank


def exit_record_path(spec: dict, node: str) -> Path:
    """exit.json; `exit-<node>.json` when every node of the attempt writes its own (a scheduler's
    multi-node job: one node's failure must never be overwritten by another's success)."""
    path = Path(spec["exit_record"])
    return path.with_name(f"exit-{node}.json") if spec.get("exit_per_node") else path


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    if spec.get("pid_namespace"):
        outer = _enter_pid_namespace(spec.get("pidns_file"))
        if outer is not None:
            return outer
    node, node_rank = node_identity()
    exit_record = ExitRecord(exit_record_path(spec, node))
    where = {"node": node, "node_rank": node_rank} if spec.get("exit_per_node") else {}
    _become_subreaper()

    # Someone signalling only the shim (a user, systemd): pass it on to the job,
    # keep waiting so the exit record is still written.
    def forward(signum, _frame):
        _signal_all(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)

    identity = spec.get("identity")
    log_fd = _open_log(spec["log"])
    started = time.time()
    refused = _join_owner(spec)
    if refused is None and spec.get("require_identity") and identity is None:
        refused = "this attempt must run as its submitter and names nobody"
    if refused is not None:
        os.write(log_fd, f"oom-supervisor: {refused}; nothing was started\n".encode())
        exit_record.write({"returncode": 126, "signal": None, "launch_error": refused,
                           "started_at": started, "ended_at": time.time(), "duration_s": 0.0, **where})
        return 126
    try:
        pid, launch_error = _start_command(spec, log_fd)
    except OSError as exc:
        exit_record.write({"returncode": 127, "signal": None, "launch_error": f"fork failed: {exc}",
                           "started_at": started, "ended_at": time.time(), "duration_s": 0.0, **where})
        return 127
    command_pid = _proc_pid_of(pid)
    stop_cap = threading.Event()
    cap = int(spec.get("max_log_bytes") or 0)
    if cap > 0:
        threading.Thread(target=_cap_log, args=(spec["log"], log_fd, cap, stop_cap, identity), daemon=True).start()
    peak = [0]
    threading.Thread(target=_sample_peak, args=(peak, stop_cap), daemon=True).start()
    status = _wait_for(pid)
    ended = time.time()
    stop_cap.set()
    _stop_stragglers()
    os.close(log_fd)
    record = _exit_fields(status, launch_error, peak[0])
    record.update(started_at=started, ended_at=ended, duration_s=round(ended - started, 3), pid=command_pid, **where)
    exit_record.write(record)
    code = record["returncode"]
    return 128 + (-code) if isinstance(code, int) and code < 0 else (code if code is not None else 1)


def _start_command(spec: dict, log_fd: int) -> tuple[int, bytes]:
    """Fork and exec the attempt's argv with its log as stdout/stderr; (pid, exec error text).
    Exec errors come back on a close-on-exec pipe: empty when exec succeeded."""
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(err_r)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            _preexec(spec)  # limits and cgroups need the privilege: before the drop
            _drop_privileges(spec.get("identity"))
            os.chdir(spec["cwd"])  # as the user: their permissions decide
            os.execvpe(spec["argv"][0], spec["argv"],
                       job_environment(spec["env"], dict(os.environ) if spec.get("scheduler_env") else None))
        except BaseException as exc:  # noqa: BLE001 - exec failed: say so in the log, exit like a shell would
            try:
                msg = f"cannot start {spec['argv'][0]!r} in {spec.get('cwd')!r}: {exc}"
                os.write(err_w, msg.encode()[:4000])
                os.write(2, f"oom-supervisor: {msg}\n".encode())
            finally:
                os._exit(127)
    os.close(err_w)
    launch_error = b""
    while True:
        try:
            part = os.read(err_r, 4096)
        except InterruptedError:
            continue
        if not part:
            break
        launch_error += part
    os.close(err_r)
    return pid, launch_error


def _wait_for(pid: int) -> int | None:
    """Reap every child until the main command ends; its wait status (None: lost)."""
    while True:
        try:
            wpid, wstatus = os.waitpid(-1, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            return None
        if wpid == pid:
            return wstatus


def _stop_stragglers() -> None:
    """The main command is gone: stop whatever it left behind, then reap it all."""
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


def _exit_fields(status: int | None, launch_error: bytes, peak: int) -> dict:
    if status is None:
        record = {"returncode": None, "signal": None, "error": "lost track of the main process"}
    else:
        code = os.waitstatus_to_exitcode(status)
        record = {"returncode": code, "signal": _signal_name(-code) if code < 0 else None}
    if launch_error:
        record["launch_error"] = launch_error.decode("utf-8", "replace")
    if peak:
        record["peak_rss_bytes"] = peak
    return record


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
