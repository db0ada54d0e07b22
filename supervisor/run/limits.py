"""Host-memory limits per job: a cgroup when we can make one, else an rlimit.

CPU offload can exhaust host RAM and take the whole box down, so a job may
carry `supervisor.host_memory_limit`. Mechanisms, best first:

- cgroup v2 (`memory.max`, `memory.swap.max=0`, `memory.events` oom_kill,
  `memory.peak`, `cgroup.kill`), needs write access to a delegated subtree;
- cgroup v1 (`memory.limit_in_bytes`, `memory.oom_control` oom_kill,
  `memory.max_usage_in_bytes`), needs root;
- RLIMIT_DATA (per process, private writable memory only). Not RLIMIT_AS: it
  counts every mapping, and the CUDA build of torch maps gigabytes just to
  import (`import torch` aborts with std::bad_alloc under a 3 GB RLIMIT_AS,
  measured here), so an AS limit would have to be so loose it protects nothing.

An rlimit makes allocations fail inside the program (PyTorch then prints
`DefaultCPUAllocator: can't allocate memory`); a cgroup makes the kernel kill
the largest process (exit 137, no message), and only the cgroup's oom_kill
counter tells that apart from an outside `kill -9`: we read it for diagnosis.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_PARENT = "oom-supervisor"


@dataclass(frozen=True)
class CgroupSupport:
    version: int  # 1 or 2
    parent: Path  # where job cgroups are created


def _mounts() -> list[tuple[str, str, str]]:
    try:
        with open("/proc/self/mounts") as f:
            return [tuple(line.split()[1:4]) for line in f]  # type: ignore[misc]
    except OSError:
        return []


def _own_cgroup_path(version: int, controller: str = "memory") -> str:
    """Our cgroup in the v2 tree, or in the v1 hierarchy of `controller`."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "/"
    for line in lines:
        hid, controllers, path = line.split(":", 2)
        if version == 2 and hid == "0":
            return path
        if version == 1 and controller in controllers.split(","):
            return path
    return "/"


def detect_cgroup(root_override: Path | None = None) -> CgroupSupport | None:
    """Find a cgroup hierarchy with the memory controller that we may write to."""
    if root_override is not None:
        return CgroupSupport(2 if (root_override / "cgroup.controllers").exists() else 1, root_override)
    for mountpoint, fstype, opts in _mounts():
        if fstype == "cgroup2":
            try:
                controllers = (Path(mountpoint) / "cgroup.controllers").read_text().split()
            except OSError:
                continue
            if "memory" not in controllers:
                continue
            own = Path(mountpoint) / _own_cgroup_path(2).lstrip("/")
            support = _try_parent(2, [own / CGROUP_PARENT, Path(mountpoint) / CGROUP_PARENT])
            if support:
                return support
        elif fstype == "cgroup" and "memory" in opts.split(","):
            own = Path(mountpoint) / _own_cgroup_path(1).lstrip("/")
            support = _try_parent(1, [own / CGROUP_PARENT, Path(mountpoint) / CGROUP_PARENT])
            if support:
                return support
    return None


def _try_parent(version: int, candidates: list[Path]) -> CgroupSupport | None:
    for parent in candidates:
        try:
            parent.mkdir(exist_ok=True)
            if version == 2 and not _enable_memory_v2(parent):
                continue
            probe = parent / f"probe-{os.getpid()}"
            probe.mkdir(exist_ok=True)
            limit_file = probe / ("memory.max" if version == 2 else "memory.limit_in_bytes")
            ok = limit_file.exists()
            probe.rmdir()
            if ok:
                return CgroupSupport(version, parent)
        except OSError:
            continue
    return None


def _enable_memory_v2(parent: Path) -> bool:
    """Delegate the memory controller down to `parent`'s children."""
    ctl = parent / "cgroup.subtree_control"
    try:
        if "memory" in ctl.read_text().split():
            return True
        # The parent of `parent` must delegate memory too.
        up = parent.parent / "cgroup.subtree_control"
        if "memory" not in up.read_text().split():
            up.write_text("+memory")
        ctl.write_text("+memory")
        return True
    except OSError:
        return False


@dataclass
class JobCgroup:
    """One attempt's cgroup (created before launch, removed after reaping)."""

    path: Path
    version: int

    @classmethod
    def create(cls, support: CgroupSupport, name: str, limit_bytes: int) -> JobCgroup:
        path = support.parent / name
        path.mkdir(exist_ok=True)
        cg = cls(path, support.version)
        if support.version == 2:
            (path / "memory.max").write_text(str(limit_bytes))
            try:
                (path / "memory.swap.max").write_text("0")
            except OSError:
                pass
        else:
            (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
            try:  # no swap either, where swap accounting exists
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
            except OSError:
                pass
        return cg

    @property
    def procs_file(self) -> Path:
        return self.path / "cgroup.procs"

    @property
    def mechanism(self) -> str:
        return f"cgroup-v{self.version}"

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in self.procs_file.read_text().split()]
        except (OSError, ValueError):
            return []

    def oom_kills(self) -> int | None:
        if self.version == 2:
            return _kv(self.path / "memory.events").get("oom_kill")
        return _kv(self.path / "memory.oom_control").get("oom_kill")

    def peak_bytes(self) -> int | None:
        return self._first_int("memory.peak" if self.version == 2 else "memory.max_usage_in_bytes")

    def current_bytes(self) -> int | None:
        return self._first_int("memory.current" if self.version == 2 else "memory.usage_in_bytes")

    def _first_int(self, name: str) -> int | None:
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill_all(self) -> None:
        if self.version == 2 and (self.path / "cgroup.kill").exists():
            try:
                (self.path / "cgroup.kill").write_text("1")
                return
            except OSError:
                pass
        import signal

        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    return False
                time.sleep(0.05)


def _kv(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].lstrip("-").isdigit():
                out[parts[0]] = int(parts[1])
    except OSError:
        pass
    return out


def rlimits_for(limit_bytes: int) -> dict[str, int]:
    """The rlimit fallback (see module docstring for why DATA and not AS)."""
    return {"RLIMIT_DATA": int(limit_bytes)}
