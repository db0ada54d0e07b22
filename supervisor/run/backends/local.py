"""Attempts on this box: the launch shim in a new session, an owner per attempt, a memory limit.

The owner (a cgroup where one can be made, else the attempt's marker plus the pids seen) and the
memory limit (a memory cgroup, else RLIMIT_DATA plus the sampled sum of PSS) are made before the attempt
is recorded as started, so that nothing the shim forks can escape them; they are removed once
the attempt is over.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from supervisor.core.paths import AttemptPaths
from supervisor.intake.jobspec import JobSpec
from supervisor.intake.llamafactory.launch import launch_fields
from supervisor.run import proctree
from supervisor.run.backends.base import Launched, Reservation
from supervisor.run.gpus import VramSampler, detect_vendor, probe_capacities
from supervisor.run.limits import CgroupSupport, JobCgroup, detect_cgroup, rlimits_for
from supervisor.run.ownership import Owner, detect_owner_support, pid_namespaces_available
from supervisor.service.logsetup import log


class LocalBackend:
    name = "local"
    allocates_gpus = False
    keeps_verdicts = False  # how an attempt ended is only what its shim wrote

    def __init__(self, cfg) -> None:
        self.state_root = cfg.state.root
        self.max_log_bytes = cfg.max_log_bytes
        self.gpu_devices = cfg.gpu_devices
        self.system_mode = cfg.system_mode  # every attempt runs as its submitter, and none without one
        self.state_tag = hashlib.sha256(str(self.state_root).encode()).hexdigest()[:8]
        self.cgroup_support = detect_cgroup() if cfg.cgroups == "auto" else None
        self.owner_support = detect_owner_support(self.state_tag) if cfg.cgroups == "auto" else None
        # Where no cgroup can be made, each attempt gets a PID namespace of its own (root only).
        self.pid_namespaces = (self.owner_support is None and cfg.pid_namespace == "auto"
                               and pid_namespaces_available())
        self.gpu_vendor = detect_vendor() if cfg.gpu_vendor == "auto" else cfg.gpu_vendor
        self._gpu_caps: dict[int, int] | None = None  # probed once, when first needed

    def describe(self) -> str:
        if self.owner_support is not None:
            return self.owner_support.describe()
        if self.pid_namespaces:
            return ("a PID namespace per attempt (no cgroup could be made here): the kernel kills every process "
                    "of an attempt when its shim dies, escaped helpers included; not seen without a cgroup: "
                    "memory per attempt is a sampled sum of PSS, and per-attempt kernel OOM counters do not exist")
        return ("process tree + attempt marker + the pids seen (no cgroup and no PID namespace could be made "
                "here: run as root or with a delegated cgroup); NOT seen: a process that leaves the tree, "
                "clears its environment and outlives a killed shim")

    def attempt_tag(self, job_id: int, number: int) -> str:
        """Unique per state folder: two daemons on one box must never share a job's cgroup."""
        return f"job-{job_id}-attempt-{number}-{self.state_tag}"

    # --- the box ------------------------------------------------------------------------------------
    def gpu_capacities(self) -> dict[int, int]:
        if self._gpu_caps is None:
            self._gpu_caps = probe_capacities()
        return self._gpu_caps

    def world_size(self, spec: JobSpec) -> int:
        return spec.world_size

    def launch_fields(self, spec: JobSpec, gpus: list[int] | None, env: dict[str, str]) -> dict[str, Any]:
        """The world size the launch really has (pinned ranks, its GPUs, else every visible GPU)."""
        gpus = gpus if gpus is not None else (list(spec.sup.gpus) if spec.sup.gpus else None)
        return launch_fields(nproc_per_node=spec.sup.nproc_per_node or spec.sup.gpu_count, gpus=gpus, env=env,
                             probed_gpus=len(self.gpu_capacities()))

    # --- one attempt --------------------------------------------------------------------------------
    def reserve(self, tag: str, paths: AttemptPaths, memory_limit: int | None) -> Reservation:
        owner = Owner.for_attempt(self.owner_support, tag, paths.root / "procs.json", create=True,
                                  pidns_file=paths.root / "pidns" if self.pid_namespaces else None)
        res = Reservation(tag=tag, owner=owner)
        if not memory_limit:
            return res
        if owner.kind == "cgroup-v2" and owner.cgroup is not None and (owner.cgroup / "memory.max").exists():
            res.cgroup = JobCgroup.create(CgroupSupport(2, owner.cgroup.parent), owner.cgroup.name, memory_limit)
        elif self.cgroup_support is not None:
            try:
                res.cgroup = JobCgroup.create(self.cgroup_support, tag, memory_limit)
            except OSError as exc:
                log.warning("cgroup_create_failed", attempt=tag, error=str(exc))
        if res.cgroup is not None:
            res.mechanism = res.cgroup.mechanism
        else:
            res.rlimits, res.mechanism = rlimits_for(memory_limit), "rlimit-data+sampled-pss"
        return res

    def release(self, res: Reservation) -> None:
        """An attempt reserved but never launched."""
        res.owner.remove()
        if res.cgroup is not None and res.cgroup.path != res.owner.cgroup:
            res.cgroup.remove(timeout_s=0.1)

    def launch(self, res: Reservation, paths: AttemptPaths, *, argv: list[str], cwd: Path,
               env: dict[str, str], spec: JobSpec, identity: Any = None) -> Launched:
        """The shim (root on a shared box) runs the command as `identity`, and nothing at all without
        one in system mode."""
        handle = proctree.launch(paths, argv=argv, cwd=cwd, env=env, rlimits=res.rlimits, cgroup=res.cgroup,
                                 owner=res.owner, max_log_bytes=self.max_log_bytes, identity=identity,
                                 require_identity=self.system_mode)
        return Launched(handle, {"pid": handle.pid, "pid_create_time": handle.create_time})

    def unlaunched(self, res: Reservation) -> proctree.Handle:
        """A handle for an attempt whose launch raised: followed like any other (its owner is
        checked empty) so that its end is recorded."""
        return proctree.Handle(0, 0.0, cgroup=res.cgroup, owner=res.owner)

    def adopt(self, row: Any, paths: AttemptPaths, tag: str) -> proctree.Handle:
        """The attempt of `row` after a restart, from the record alone (never the job file): its
        owner and memory cgroup found by name, its shim by pid + start time (or by its launch file,
        when the crash came before the pid was recorded)."""
        pidns = paths.root / "pidns"
        owner = Owner.for_attempt(self.owner_support, tag, paths.root / "procs.json", create=False,
                                  pidns_file=pidns if pidns.exists() else None)
        cg = None
        if owner.cgroup is not None and _limited(owner.cgroup / "memory.max"):
            cg = JobCgroup(owner.cgroup, 2)
        elif self.cgroup_support is not None and (self.cgroup_support.parent / tag).exists():
            cg = JobCgroup(self.cgroup_support.parent / tag, self.cgroup_support.version)
        handle = proctree.Handle(row.pid or 0, row.pid_create_time or 0.0, cgroup=cg, owner=owner)
        if handle.shim() is None:
            p = proctree.find_shim_by_launch_file(paths.launch)
            if p is not None:
                handle.pid, handle.create_time = p.pid, p.create_time()
        return handle

    def verdict(self, handle: Any, paths: AttemptPaths, memory_limit: int | None) -> dict[str, Any] | None:
        return None  # the exit record, the log and the host evidence say it all

    def telemetry(self, handle: proctree.Handle, gpus: list[int] | None) -> VramSampler:
        return VramSampler(gpus, pids=lambda: [p.pid for p in handle.processes()]).start()

    def cleanup(self, handle: proctree.Handle) -> None:
        """The attempt is over: its owner and memory cgroups go."""
        if handle.owner is not None:
            handle.owner.remove(timeout_s=0.5)
        if handle.cgroup is not None and (handle.owner is None or handle.cgroup.path != handle.owner.cgroup):
            handle.cgroup.remove(timeout_s=0.5)

    def close(self) -> None:
        if self.owner_support is not None:
            try:  # our attempts' parent cgroup, once no attempt (held or adopted later) is in it
                self.owner_support.parent.rmdir()
            except OSError:
                pass


def _limited(memory_max: Path) -> bool:
    """A cgroup v2 memory.max that holds a limit (the attempt's memory cgroup is its owner then)."""
    try:
        return memory_max.read_text().strip() != "max"
    except OSError:
        return False
