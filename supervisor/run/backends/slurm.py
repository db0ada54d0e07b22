"""Attempts as Slurm jobs: one `sbatch` per attempt, running the launch shim inside the job.

Slurm's job cgroup owns the processes and `--mem` keeps the memory limit; Slurm allocates the
GPUs. The shim inside the job writes exit.json and forwards Slurm's SIGTERM to every worker, so
the true exit status and a graceful stop are those of a local attempt (`supervisor.run.slurm`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from supervisor.core.paths import AttemptPaths
from supervisor.intake.jobspec import JobSpec
from supervisor.intake.llamafactory.launch import pinned_nproc
from supervisor.intake.slurm_request import SlurmJobRequest
from supervisor.judge.nodes import expand_nodelist
from supervisor.run import attemptdir, proctree, slurm
from supervisor.run.backends.base import Launched, Reservation
from supervisor.run.fsutil import tail_text
from supervisor.run.slurm_handle import SlurmHandle


class SlurmBackend:
    name = "slurm"
    allocates_gpus = True
    keeps_verdicts = True  # Slurm knows how a job ended even when its shim could not say
    gpu_vendor = "unknown"  # Slurm sets the visibility variables itself

    def __init__(self, cfg) -> None:
        self.settings = cfg.slurm_settings
        self.max_log_bytes = cfg.max_log_bytes
        self.state_tag = hashlib.sha256(str(cfg.state.root).encode()).hexdigest()[:8]
        self.owner_support = None
        self.cgroup_support = None

    def describe(self) -> str:
        return "Slurm job cgroups (each attempt is one sbatch job)"

    def attempt_tag(self, job_id: int, number: int) -> str:
        return f"job-{job_id}-attempt-{number}-{self.state_tag}"

    # --- the cluster --------------------------------------------------------------------------------
    def gpu_capacities(self) -> dict[int, int]:
        return {}  # not this box's GPUs: Slurm allocates them

    def request(self, spec: JobSpec) -> SlurmJobRequest:
        request = spec.sup.slurm_request or SlurmJobRequest()
        if request.mem is None and spec.sup.host_memory_limit:
            request = request.model_copy(update={"mem": spec.sup.host_memory_limit})
        return request

    def world_size(self, spec: JobSpec) -> int:
        return self.request(spec).world_size(self.settings)

    def launch_fields(self, spec: JobSpec, gpus: list[int] | None, env: dict[str, str]) -> dict[str, Any]:
        """Ranks per node (the job's pinned count, else its GPUs per node) and the nodes: the
        world the policy keeps the effective batch across is nodes x ranks per node."""
        req = self.request(spec)
        gpn = req.gpus_per_node if req.gpus_per_node is not None else self.settings.gpus_per_node
        nproc = spec.sup.nproc_per_node or pinned_nproc(env) or max(1, gpn)
        return {"nproc_per_node": nproc, "gpus": None, "visible_gpu_count": gpn,
                "nnodes": req.nodes or self.settings.nodes}

    # --- one attempt --------------------------------------------------------------------------------
    def reserve(self, tag: str, paths: AttemptPaths, memory_limit: int | None) -> Reservation:
        return Reservation(tag=tag, mechanism="slurm-cgroup" if memory_limit else None)

    def release(self, res: Reservation) -> None:
        pass

    def launch(self, res: Reservation, paths: AttemptPaths, *, argv: list[str], cwd: Path,
               env: dict[str, str], spec: JobSpec, identity: Any = None) -> Launched:
        """One attempt = one sbatch job running the launch shim (exit records, SIGTERM to every worker).
        A shared box submits it as its user (sbatch --uid/--gid): the shim in the job is then that
        user, reads launch.json as them and writes the exit records into the job's own folder.
        scheduler=True: the shim merges Slurm's environment (its allocation, the batch script's
        rendezvous) with the attempt's, and each node writes its own exit record."""
        run_as = (identity.uid, identity.gid) if identity is not None and identity.uid != os.geteuid() else None
        proctree.write_launch(paths, argv=argv, cwd=cwd, env=env, max_log_bytes=self.max_log_bytes,
                              exit_record=paths.user_dir / "exit.json" if run_as else None, scheduler=True)
        if run_as:
            attemptdir.give(paths.launch, identity)
            paths.log.touch(mode=0o600)
            attemptdir.give(paths.log, identity)  # the Slurm step opens it (--output) as the user
        sub = slurm.submit(paths.root, paths.log, [sys.executable, "-m", "supervisor.run.shim", str(paths.launch)],
                           cwd, {**env, "PYTHONPATH": proctree.package_root()},
                           settings=self.settings, request=self.request(spec), job_name=f"oomsv-{res.tag}",
                           run_as=run_as)
        handle = SlurmHandle(sub.job_id, sub.to_dict())
        return Launched(handle, {"backend_ref": json.dumps({"slurm": handle.record})},
                        [("slurm_submitted", f"is Slurm job {sub.job_id}", {"slurm_job": sub.job_id})])

    def unlaunched(self, res: Reservation) -> proctree.Handle:
        return proctree.Handle(0, 0.0)

    def adopt(self, row: Any, paths: AttemptPaths, tag: str) -> SlurmHandle | None:
        ref = row.json("backend_ref") or {}
        if "slurm" not in ref:
            return None  # never submitted (the crash came before sbatch answered)
        return SlurmHandle(str(ref["slurm"]["job_id"]), dict(ref["slurm"]))

    def verdict(self, handle: Any, paths: AttemptPaths, memory_limit: int | None) -> dict[str, Any] | None:
        """Slurm's verdict (`slurm.verdict`) plus the job's nodes and those Slurm holds as failed;
        `{"lost": ...}` when neither scontrol nor the jobcomp file knows the job any more."""
        if not isinstance(handle, SlurmHandle):
            return None
        st = handle.refresh(force=True)
        if st is None:
            if handle.lost:
                return {"lost": f"neither scontrol nor the jobcomp file knows Slurm job {handle.job_id} any more "
                                "(the controller lost it, or forgot it long ago)"}
            return None
        v = slurm.verdict(st, tail_text(paths.log, 64 << 10), requested_mem_bytes=memory_limit,
                          killed_by_supervisor=handle.killed_by_supervisor)
        v["nodes"] = expand_nodelist(st.node_list)
        v["down_nodes"] = {}
        if len(v["nodes"]) > 1 or v["interrupted"]:
            try:
                v["down_nodes"] = slurm.down_nodes(slurm.node_states(v["nodes"]))
            except slurm.SlurmError as exc:
                v["evidence"].append(f"node states unavailable: {str(exc)[:200]}")
            v["evidence"] += list(v["down_nodes"].values())
        if handle.commands:
            v["stop_commands"] = list(handle.commands)
        return v  # the shims' own records (the user's folder on a shared box): proctree.read_exits

    def telemetry(self, handle: Any, gpus: list[int] | None) -> None:
        return None  # no access to the nodes' GPUs from here

    def cleanup(self, handle: Any) -> None:
        pass

    def close(self) -> None:
        pass

