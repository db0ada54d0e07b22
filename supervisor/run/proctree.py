"""Start, watch and stop an attempt's whole process tree.

An attempt is the shim (session leader, subreaper) and everything under it.
We identify it by pid plus start time, so a recycled pid is never mistaken
for our job after a daemon restart. Stopping is SIGTERM to every process of
the tree (the group is not enough: torchrun workers leave the launcher's
process group), then SIGKILL to whatever is left at ONE deadline, then the
shim reaps and exits.

The attempt's `Owner` (ownership.py) is the last word on whether anything of
it still lives: the shim's descendants are only what is still attached.
Stopping is split into `signal_tree` and `kill_tree` so the daemon can stop
many attempts at once, each against one deadline, without blocking its loop;
`terminate` is the blocking form for one attempt.
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
from typing import Any

import psutil

from supervisor import SOURCE_ROOT
from supervisor.core.jobenv import inherited
from supervisor.core.paths import AttemptPaths
from supervisor.judge.nodes import combine_exits
from supervisor.run import attemptdir
from supervisor.run.fsutil import atomic_write_json
from supervisor.run.identity import Identity
from supervisor.run.limits import JobCgroup
from supervisor.run.ownership import Owner
from supervisor.run.procstat import tree_charged_bytes
from supervisor.run.shim import INIT_COMM, LINGER_COMM

SHIM_GRACE_S = 10.0  # after its job is gone, how long the shim may take to reap and write exit.json


@dataclass
class Handle:
    """A live (or adopted) attempt. `popen` is None after a daemon restart."""

    pid: int
    create_time: float
    popen: subprocess.Popen | None = None
    cgroup: JobCgroup | None = None  # the memory cgroup, when a limit asked for one
    owner: Owner | None = None

    def shim(self) -> psutil.Process | None:
        if self.pid <= 0:
            return None
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

    def processes(self, *, scan: bool = False) -> list[psutil.Process]:
        """Every live process of the attempt except the shim: its descendants, the
        members of its ownership and memory cgroups (and, with `scan` and no
        ownership cgroup, every process carrying the attempt's marker)."""
        procs: dict[int, psutil.Process] = {}
        shim = self.shim()
        if shim is not None:
            try:
                for p in shim.children(recursive=True):
                    procs[p.pid] = p
            except psutil.NoSuchProcess:
                pass
        extra: list[psutil.Process] = []
        if self.owner is not None:
            extra += self.owner.members(scan=scan)
        if self.cgroup is not None:
            for pid in self.cgroup.pids():
                try:
                    extra.append(psutil.Process(pid))
                except psutil.NoSuchProcess:
                    pass
        for p in extra:
            if p.pid not in procs and p.pid != self.pid:
                try:
                    if p.status() != psutil.STATUS_ZOMBIE:
                        procs[p.pid] = p
                except psutil.Error:
                    pass
        return list(procs.values())

    def over(self) -> bool:
        """True only when the shim and every process of the attempt are gone."""
        self.reap()
        return not self.alive() and not self.processes(scan=True)

    def memory_bytes(self) -> tuple[int, str]:
        """(bytes, measure): what the kernel charges the job (shim excluded), the cgroup's own
        count when there is one, else the sum of its processes' PSS."""
        if self.cgroup is not None:
            cur = self.cgroup.current_bytes()
            if cur is not None:
                return cur, "the cgroup's memory.current"
        return tree_charged_bytes(p.pid for p in self.processes())

    def reap(self) -> None:
        if self.popen is not None:
            try:
                self.popen.wait(timeout=0)
            except subprocess.TimeoutExpired:
                pass

    # --- what every backend's handle answers (see supervisor.run.backends) --------------------
    def describe(self) -> str:
        return f"pid {self.pid}"

    def waiting(self) -> bool:
        """Not yet running (a scheduler's queue): silence then is not a hang."""
        return False

    def same_run(self) -> bool:
        return True  # pid + start time already identify it

    def signal_all(self, sig: int = signal.SIGTERM) -> None:
        signal_tree(self, sig)

    def kill_all(self, shim_too: bool = False) -> None:
        kill_tree(self, shim_too=shim_too)

    def force_stop(self, overdue_s: float) -> bool:
        """Past the stop deadline by `overdue_s`: SIGKILL what is left; True when a kill went out
        to the job's processes (a shim stuck after its job is gone is killed too, later; never one
        that waits for room to write the exit record: it holds the verdict)."""
        if self.processes():
            kill_tree(self)
            return True
        if self.alive() and overdue_s > SHIM_GRACE_S and not self.lingering():
            kill_tree(self, shim_too=True)
        return False

    def lingering(self) -> bool:
        """The command has ended and the shim waits for room to write its exit record."""
        shim = self.shim()
        if shim is None:
            return False
        try:
            return shim.name() == LINGER_COMM
        except psutil.Error:
            return False


def launch(paths: AttemptPaths, *, argv: list[str], cwd: Path, env: dict[str, str],
           rlimits: dict[str, int] | None = None, cgroup: JobCgroup | None = None,
           owner: Owner | None = None, max_log_bytes: int | None = None,
           identity: Identity | None = None, require_identity: bool = False) -> Handle:
    """Write launch.json and start the shim in a new session (no shell). With `identity` the
    shim (root) runs the command as that user; `require_identity`: it runs nothing without one."""
    write_launch(paths, argv=argv, cwd=cwd, env=env, rlimits=rlimits, cgroup=cgroup, owner=owner,
                 max_log_bytes=max_log_bytes, identity=identity, require_identity=require_identity)
    with open(os.open(paths.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600), "ab") as log:
        if identity is not None and os.geteuid() == 0:
            # The log is its user's (they read it); this descriptor, opened while it was root's, stays
            # writable for the shim, which writes through it (it needs no CAP_DAC_OVERRIDE).
            os.fchown(log.fileno(), identity.uid, identity.gid)
        popen = subprocess.Popen(
            [sys.executable, "-m", "supervisor.run.shim", str(paths.launch)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True, close_fds=True,
            # The shim needs nothing of the daemon's environment (its secrets included); the command
            # gets launch.json's env only.
            env={**inherited(os.environ), "PYTHONPATH": _package_root()},
        )
    try:
        create_time = psutil.Process(popen.pid).create_time()
    except psutil.NoSuchProcess:  # died at once; exit.json or its absence will tell
        create_time = time.time()
    return Handle(popen.pid, create_time, popen, cgroup, owner)


def write_launch(paths: AttemptPaths, *, argv: list[str], cwd: Path, env: dict[str, str],
                 rlimits: dict[str, int] | None = None, cgroup: JobCgroup | None = None,
                 owner: Owner | None = None, max_log_bytes: int | None = None,
                 identity: Identity | None = None, require_identity: bool = False,
                 exit_record: Path | None = None, scheduler: bool = False) -> Path:
    """What the shim runs with (it is also what a Slurm job's shim reads; `exit_record` where that
    shim, running as the job's user, may write it). `scheduler`: the shim runs inside a scheduler's
    job, on one node or several: it merges the scheduler's environment with the attempt's
    (`shim.job_environment`) and each node writes its own exit record (`exit-<node>.json`)."""
    paths.root.mkdir(parents=True, exist_ok=True, mode=0o700)
    spec = {
        "argv": list(argv),
        "cwd": str(cwd),
        "env": env,
        "log": str(paths.log),
        "exit_record": str(exit_record or paths.exit_record),
        "rlimits": rlimits or {},
        "cgroup_procs": str(cgroup.procs_file) if cgroup else None,
        "owner_procs": str(owner.procs_file) if owner is not None and owner.procs_file else None,
        "max_log_bytes": max_log_bytes,
        # No cgroup: the shim makes the attempt a PID namespace of its own (see ownership.Owner).
        "pid_namespace": owner is not None and owner.pidns_file is not None,
        "pidns_file": str(owner.pidns_file) if owner is not None and owner.pidns_file else None,
        "identity": identity.to_dict() if identity is not None else None,
        "require_identity": require_identity,
        "scheduler_env": scheduler,
        "exit_per_node": scheduler,
    }
    atomic_write_json(paths.launch, spec, mode=0o600)  # the environment may hold tokens
    return paths.launch


def package_root() -> str:
    return str(SOURCE_ROOT)


def _package_root() -> str:
    root = package_root()
    extra = os.environ.get("PYTHONPATH")
    return f"{root}{os.pathsep}{extra}" if extra else root


def signal_tree(handle: Handle, sig: int = signal.SIGTERM) -> None:
    """Send `sig` to every process of the attempt (not the shim: it forwards and waits)."""
    _signal(handle.processes(scan=True), sig)


def kill_tree(handle: Handle, *, shim_too: bool = False) -> None:
    """SIGKILL every process of the attempt. The shim is spared (it reaps and writes the
    exit record) unless `shim_too`: for a shim that is stuck although its job is gone."""
    shim = handle.shim()
    if handle.owner is not None:
        handle.owner.kill(spare=None if (shim is None or shim_too) else shim.pid)
    if handle.cgroup is not None and (handle.owner is None or handle.owner.cgroup != handle.cgroup.path):
        handle.cgroup.kill_all()
    _signal(handle.processes(scan=True), signal.SIGKILL)
    if shim_too and shim is not None:
        _signal([shim], signal.SIGKILL)
    handle.reap()


def terminate(handle: Handle, *, grace_s: float, clock=time.monotonic) -> float:
    """SIGTERM the whole tree, SIGKILL what is left at one deadline; wait until it is over.

    Returns the seconds it took until every process of the attempt was gone (it
    gives up after 10 s more: processes in uninterruptible sleep keep the
    attempt alive, and the caller must keep the job held).
    """
    start = clock()
    deadline = start + grace_s
    signal_tree(handle, signal.SIGTERM)
    while clock() < deadline:
        if not handle.processes():
            break
        time.sleep(0.02)
    if handle.processes(scan=True):
        kill_tree(handle)
    end = clock() + SHIM_GRACE_S
    while not handle.over() and clock() < end:
        if handle.processes():
            kill_tree(handle)
        time.sleep(0.02)
    if not handle.over() and not handle.processes(scan=True):
        kill_tree(handle, shim_too=True)  # its job is gone but it is stuck: force it
        handle.reap()
    return clock() - start


def _signal(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def read_exits(paths: AttemptPaths) -> dict[str, dict]:
    """Every exit record of the attempt: {"": exit.json} (one shim), {node: exit-<node>.json}
    (a shim per node of a scheduler's job); in the attempt folder, or in its user's folder where the
    shim ran as the job's user (read as the job's own file: no link followed, bounded). An
    unreadable one counts as not written."""
    out: dict[str, dict] = {}
    for folder, own in ((paths.root, True), (paths.user_dir, False)):
        names = [folder / paths.exit_record.name, *sorted(folder.glob("exit-*.json"))]
        for path in names:
            rec = _read_json(path) if own else attemptdir.read_job_json(path)
            if isinstance(rec, dict):
                out.setdefault("" if path.name == paths.exit_record.name else path.name[len("exit-"):-len(".json")], rec)
    return out


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_exit(paths: AttemptPaths, expected_nodes: list[str] | None = None) -> dict | None:
    """The attempt's exit record: the shim's, or every node's judged together
    (`supervisor.judge.nodes.combine_exits`: one node's failure never hides behind another's
    success). None when nothing was written."""
    return combine_exits(read_exits(paths), expected_nodes or ())


def find_shim_by_launch_file(launch_file: Path) -> psutil.Process | None:
    """Fallback identity when a crash hit between launch and recording the pid."""
    target = str(launch_file)
    for p in psutil.process_iter(["cmdline", "name"]):
        cmd = p.info.get("cmdline") or []
        if "supervisor.run.shim" in cmd and target in cmd and p.info.get("name") != INIT_COMM:
            return p  # the outer shim, not the init of the attempt's PID namespace
    return None
