"""Start, watch and stop an attempt's whole process tree.

An attempt is the shim (session leader, subreaper) and everything under it.
We identify it by pid plus start time, so a recycled pid is never mistaken
for our job after a daemon restart. Stopping is SIGTERM to every process of
the tree (the group is not enough: torchrun workers leave the launcher's
process group), then SIGKILL to whatever is left at ONE deadline, then the
shim reaps and exits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from .fsutil import atomic_write_json
from .limits import JobCgroup
from .paths import AttemptPaths


@dataclass
class Handle:
    """A live (or adopted) attempt. `popen` is None after a daemon restart."""

    pid: int
    create_time: float
    popen: subprocess.Popen | None = None
    cgroup: JobCgroup | None = None

    def shim(self) -> psutil.Process | None:
        try:
            p = psutil.Process(self.pid)
            if abs(p.create_time() - self.create_time) > 0.05 or p.status() == psutil.STATUS_ZOMBIE:
                return None
            return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return self.shim() is not None

    def processes(self) -> list[psutil.Process]:
        """The shim's descendants plus anything in the attempt's cgroup."""
        procs: dict[int, psutil.Process] = {}
        shim = self.shim()
        if shim is not None:
            try:
                for p in shim.children(recursive=True):
                    procs[p.pid] = p
            except psutil.NoSuchProcess:
                pass
        if self.cgroup is not None:
            for pid in self.cgroup.pids():
                if pid not in procs and pid != self.pid:
                    try:
                        procs[pid] = psutil.Process(pid)
                    except psutil.NoSuchProcess:
                        pass
        return list(procs.values())

    def rss_bytes(self) -> int:
        """Resident memory of the job (shim excluded), cgroup usage when there is one."""
        if self.cgroup is not None:
            cur = self.cgroup.current_bytes()
            if cur is not None:
                return cur
        total = 0
        for p in self.processes():
            try:
                total += p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return total

    def reap(self) -> None:
        if self.popen is not None:
            try:
                self.popen.wait(timeout=0)
            except subprocess.TimeoutExpired:
                pass


def launch(paths: AttemptPaths, *, argv: list[str], cwd: Path, env: dict[str, str],
           rlimits: dict[str, int] | None = None, cgroup: JobCgroup | None = None) -> Handle:
    """Write launch.json and start the shim in a new session (no shell)."""
    paths.root.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": list(argv),
        "cwd": str(cwd),
        "env": env,
        "log": str(paths.log),
        "exit_record": str(paths.exit_record),
        "rlimits": rlimits or {},
        "cgroup_procs": str(cgroup.procs_file) if cgroup else None,
    }
    atomic_write_json(paths.launch, spec, mode=0o600)  # the environment may hold tokens
    with open(paths.log, "ab") as log:
        popen = subprocess.Popen(
            [sys.executable, "-m", "supervisor.shim", str(paths.launch)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True, close_fds=True,
            env={**os.environ, "PYTHONPATH": _package_root()},
        )
    try:
        create_time = psutil.Process(popen.pid).create_time()
    except psutil.NoSuchProcess:  # died at once; exit.json or its absence will tell
        create_time = time.time()
    return Handle(popen.pid, create_time, popen, cgroup)


def _package_root() -> str:
    root = str(Path(__file__).resolve().parent.parent)
    extra = os.environ.get("PYTHONPATH")
    return f"{root}{os.pathsep}{extra}" if extra else root


def terminate(handle: Handle, *, grace_s: float, clock=time.monotonic) -> float:
    """SIGTERM the whole tree, SIGKILL what is left at one deadline; wait for the shim.

    Returns the seconds it took until every process of the attempt was gone.
    """
    start = clock()
    deadline = start + grace_s
    _signal(handle.processes(), signal.SIGTERM)
    while clock() < deadline:
        if not handle.processes():
            break
        time.sleep(0.02)
    left = handle.processes()
    if left:
        if handle.cgroup is not None:
            handle.cgroup.kill_all()
        _signal(left, signal.SIGKILL)
    # The shim now reaps, writes exit.json and exits; give it a moment.
    shim_deadline = clock() + 10.0
    while handle.alive() and clock() < shim_deadline:
        _signal(handle.processes(), signal.SIGKILL)
        time.sleep(0.02)
    if handle.alive() and not handle.processes():
        shim = handle.shim()  # its job is gone but it is stuck: force it
        if shim is not None:
            _signal([shim], signal.SIGKILL)
    # Processes that survive SIGKILL (uninterruptible sleep in a hung driver) keep the shim, and
    # so the attempt, alive: it is not over, and no new attempt may take its GPUs, until they go.
    if handle.popen is not None and not handle.processes():
        try:
            handle.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    return clock() - start


def _signal(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def read_exit(paths: AttemptPaths) -> dict | None:
    try:
        return json.loads(paths.exit_record.read_text())
    except (FileNotFoundError, ValueError):
        return None


def find_shim_by_launch_file(launch_file: Path) -> psutil.Process | None:
    """Fallback identity when a crash hit between launch and recording the pid."""
    target = str(launch_file)
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if "supervisor.shim" in cmd and target in cmd:
            return p
    return None
