"""Who owns an attempt's processes: one cgroup per attempt, or a tree proven empty.

The rule the daemon keeps: a job is never released while a process of its
previous attempt lives. Parent/child links cannot carry that rule (a worker
that `setsid()`s and double-forks leaves the tree; a killed shim orphans its
children to init), and pids are recycled. A cgroup can: every process forked
inside it stays inside it, whatever it does to its session or parent, and the
kernel keeps the list. So each attempt gets an *ownership* cgroup, joined by
the shim before it forks the command, and its membership is the truth for "is
this attempt over", for stopping it, for adopting it after a restart and for
cleaning up:

- cgroup v2 (no controller needed: `cgroup.procs`, `cgroup.events`
  populated, `cgroup.kill`). When the daemon runs in a delegated non-root
  cgroup (systemd `Delegate=yes`), it moves itself into a `supervisor/` leaf
  and creates attempts under the sibling `attempts/`, as the v2
  no-internal-process rule requires.
- cgroup v1: a `pids` (or `freezer`) hierarchy, which exists for exactly this.

Where none can be made (no root, no delegation), ownership falls back to the
attempt's marker: every process of an attempt inherits the environment
variable `OOM_SUPERVISOR_ATTEMPT=<tag>` (a process would have to scrub its own
environment to lose it), plus the pid + start time of every process seen in
the tree, kept on disk so a restarted daemon knows them too. The daemon says
at start-up which mechanism it has.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from supervisor.run.fsutil import atomic_write_text
from supervisor.run.limits import _mounts, _own_cgroup_path
from supervisor.run.procstat import stat_field

MARKER_ENV = "OOM_SUPERVISOR_ATTEMPT"


@dataclass(frozen=True)
class OwnerSupport:
    """Where attempt cgroups go, and how they are read."""

    kind: str  # "cgroup-v2" | "cgroup-v1-pids" | "cgroup-v1-freezer"
    parent: Path

    @property
    def version(self) -> int:
        return 2 if self.kind == "cgroup-v2" else 1

    def describe(self) -> str:
        return f"{self.kind} under {self.parent}"


def detect_owner_support(tag: str, *, move_self: bool = True) -> OwnerSupport | None:
    """The best ownership mechanism this process may use, or None (marker fallback).

    `tag` separates daemons of different state folders on one box.
    """
    mounts = _mounts()
    for mountpoint, fstype, _opts in mounts:
        if fstype != "cgroup2":
            continue
        root = Path(mountpoint)
        own = _own_cgroup_path(2)
        if own not in ("/", ""):
            base = root / own.lstrip("/")
            if move_self and _delegated(base):
                parent = _v2_delegated_layout(base)
                if parent is not None:
                    return OwnerSupport("cgroup-v2", parent)
        parent = root / f"oom-supervisor-{tag}"
        if _try_dir(parent, "cgroup.procs"):
            return OwnerSupport("cgroup-v2", parent)
    for controller in ("pids", "freezer"):
        for mountpoint, fstype, opts in mounts:
            if fstype == "cgroup" and controller in opts.split(","):
                own = _own_cgroup_path(1, controller)
                base = Path(mountpoint) / own.lstrip("/")
                parent = base / f"oom-supervisor-{tag}"
                if _try_dir(parent, "cgroup.procs"):
                    return OwnerSupport(f"cgroup-v1-{controller}", parent)
    return None


def _delegated(base: Path) -> bool:
    """Our own v2 cgroup is ours to manage (systemd Delegate=yes, or a user's delegated slice)."""
    try:
        return os.access(base / "cgroup.procs", os.W_OK) and os.access(base / "cgroup.subtree_control", os.W_OK)
    except OSError:
        return False


def _v2_delegated_layout(base: Path) -> Path | None:
    """Move the daemon into `base/supervisor` and put attempts under `base/attempts`.

    A v2 cgroup with processes cannot hand domain controllers (memory) to
    children, so the daemon leaves the unit's cgroup for a leaf of its own.
    """
    try:
        leaf = base / "supervisor"
        leaf.mkdir(exist_ok=True)
        for pid in _read_pids(base / "cgroup.procs"):
            try:
                (leaf / "cgroup.procs").write_text(str(pid))
            except OSError:
                pass  # a process that is not ours to move: it stays
        attempts = base / "attempts"
        attempts.mkdir(exist_ok=True)
        controllers = (base / "cgroup.controllers").read_text().split()
        wanted = [c for c in ("memory", "pids") if c in controllers]
        for target in (base, attempts):
            for c in wanted:
                try:
                    (target / "cgroup.subtree_control").write_text(f"+{c}")
                except OSError:
                    pass
        return attempts
    except OSError:
        return None


def _try_dir(parent: Path, must_have: str) -> bool:
    try:
        parent.mkdir(exist_ok=True)
        probe = parent / f"probe-{os.getpid()}"
        probe.mkdir(exist_ok=True)
        ok = (probe / must_have).exists()
        probe.rmdir()
        return ok
    except OSError:
        return False


def _read_pids(path: Path) -> list[int]:
    try:
        return [int(x) for x in path.read_text().split()]
    except (OSError, ValueError):
        return []


@dataclass
class Owner:
    """One attempt's processes: its cgroup when there is one, its marker and known pids always."""

    tag: str
    cgroup: Path | None = None
    kind: str | None = None
    known_file: Path | None = None  # pid -> start time of every process seen, kept for a restarted daemon
    known: dict[int, float] = field(default_factory=dict)
    # Without a cgroup: the attempt's own PID namespace (its init is the shim), named in this file
    # by the shim as `pid:[inode] INIT_PID INIT_START`. Every process in it is the attempt's,
    # whatever it did to its environment, session or parent, and the kernel kills them all when
    # the init dies. The inode alone is not a name: it is reused by a later namespace (another
    # attempt's), so the namespace is scanned only while its init lives.
    pidns_file: Path | None = None
    _pidns: tuple[str, int, int] | None = None

    @classmethod
    def for_attempt(cls, support: OwnerSupport | None, tag: str, known_file: Path | None,
                    *, create: bool, pidns_file: Path | None = None) -> Owner:
        owner = cls(tag=tag, known_file=known_file, pidns_file=pidns_file if support is None else None)
        if known_file is not None:
            try:
                owner.known = {int(k): float(v) for k, v in json.loads(known_file.read_text()).items()}
            except (OSError, ValueError, AttributeError):
                owner.known = {}
        if support is not None:
            path = support.parent / tag
            if create:
                path.mkdir(exist_ok=True)
            if path.exists():
                owner.cgroup, owner.kind = path, support.kind
        return owner

    @property
    def procs_file(self) -> Path | None:
        return self.cgroup / "cgroup.procs" if self.cgroup is not None else None

    @property
    def mechanism(self) -> str:
        return self.kind or ("pid-namespace" if self.pidns_file is not None else "process-tree")

    def pidns(self) -> str | None:
        """The attempt's PID namespace while its init lives, else None (gone, or never named)."""
        if self._pidns is None and self.pidns_file is not None:
            try:
                ns, init, start = self.pidns_file.read_text().split()
                self._pidns = (ns, int(init), int(start))
            except (OSError, ValueError):
                return None  # not written yet, or an older shim's bare inode: not trusted
        ns, init, start = self._pidns or ("", 0, 0)
        if not ns or stat_field(init, 22) != start:
            return None
        try:
            return ns if os.readlink(f"/proc/{init}/ns/pid") == ns else None
        except OSError:
            return None

    # --- membership ------------------------------------------------------------------
    def remember(self, procs: list[psutil.Process]) -> None:
        changed = False
        for p in procs:
            try:
                if p.pid not in self.known:
                    self.known[p.pid] = p.create_time()
                    changed = True
            except psutil.Error:
                pass
        if changed and self.known_file is not None:
            try:  # 0600 like every file about a job; not fsynced: the cgroup/marker still tell
                atomic_write_text(self.known_file, json.dumps({str(k): v for k, v in self.known.items()}),
                                  durable=False)
            except OSError:
                pass  # a full disk must not stop us following; the cgroup/marker still tell

    def members(self, *, scan: bool = False) -> list[psutil.Process]:
        """Live processes of the attempt (zombies excluded).

        With a cgroup, its member list is the whole truth. Without one, the known
        pids (checked by start time) and, when `scan`, every process whose
        environment carries the marker: slower, so done when the answer decides
        a release, not on every poll.
        """
        found: dict[int, psutil.Process] = {}
        if self.cgroup is not None:
            for pid in _read_pids(self.cgroup / "cgroup.procs"):
                _add(found, pid)
            return list(found.values())
        for pid, ctime in self.known.items():
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - ctime) < 0.05:
                    _add(found, pid, p)
            except psutil.Error:
                pass
        if scan:
            for pid in marked_pids(self.tag):
                _add(found, pid)
            ns = self.pidns()
            if ns is not None:
                for pid in namespace_pids(ns):
                    _add(found, pid)
        return list(found.values())

    def empty(self) -> bool:
        return not self.members(scan=True)

    def kill(self, *, spare: int | None = None) -> None:
        """SIGKILL every member but `spare` (the live shim, which must still write the exit
        record); with nothing to spare, `cgroup.kill` where the kernel has it (no fork race)."""
        if spare is not None:
            for p in self.members(scan=True):
                if p.pid != spare:
                    try:
                        p.send_signal(signal.SIGKILL)
                    except psutil.Error:
                        pass
            return
        if self.cgroup is not None and (self.cgroup / "cgroup.kill").exists():
            try:
                (self.cgroup / "cgroup.kill").write_text("1")
                return
            except OSError:
                pass
        for p in self.members(scan=True):
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass

    def signal_all(self, sig: int) -> None:
        for p in self.members(scan=True):
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass

    def remove(self, timeout_s: float = 0.0) -> bool:
        """Remove the cgroup (only possible once it is empty)."""
        if self.cgroup is None:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.cgroup.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                    return False
                time.sleep(0.05)


def _add(found: dict[int, psutil.Process], pid: int, proc: psutil.Process | None = None) -> None:
    if pid in found:
        return
    try:
        p = proc or psutil.Process(pid)
        if p.status() != psutil.STATUS_ZOMBIE:
            found[pid] = p
    except psutil.Error:
        pass


def marked_pids(tag: str) -> list[int]:
    """Processes whose environment says they belong to attempt `tag` (readable ones only)."""
    needle = f"\0{MARKER_ENV}={tag}\0".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = b"\0" + f.read() + b"\0"
        except OSError:
            continue
        if needle in env:
            out.append(int(entry))
    return out


def namespace_pids(ns: str) -> list[int]:
    """Processes in the PID namespace named `ns` (`pid:[inode]`, as /proc/PID/ns/pid reads)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                out.append(int(entry))
        except OSError:
            continue
    return out


CLONE_NEWPID = 0x20000000


def pid_namespaces_available() -> bool:
    """Whether this process may give each attempt a PID namespace (root, or CAP_SYS_ADMIN): tried
    for real in a short-lived child."""
    try:
        pid = os.fork()
    except OSError:
        return False
    if pid == 0:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            os._exit(0 if libc.unshare(CLONE_NEWPID) == 0 else 1)
        except BaseException:  # noqa: BLE001 - a forked child reports through its exit status only, whatever happened
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0
