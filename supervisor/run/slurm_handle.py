"""An attempt that runs as a Slurm job, seen through the same handle as a local process tree.

The runner asks a handle whether the attempt is over, to stop it and to kill it; for a
Slurm job the answers come from Slurm (`slurm.py`). The release rule holds the same way:
the attempt is over only when Slurm says the job is terminal (COMPLETING is not: its
processes are still being killed), and a controller that does not answer means "not
over" (the attempt stays held), never "gone". Inside the job runs the launch shim, so the
true exit status (exit.json) and the SIGTERM forwarding to every worker are those of a
local attempt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from supervisor.run import slurm
from supervisor.service.logsetup import log

# After the SIGKILL at once (every step, then the batch step), a job-level `scancel` if the job is
# still not gone this much later (a step started between our listing and our kill): Slurm's own
# SIGKILL then follows after its KillWait.
FALLBACK_CANCEL_AFTER_S = 10.0


@dataclass
class SlurmHandle:
    job_id: str
    record: dict[str, Any]  # the submission, plus start time and restarts once seen started
    state: slurm.SlurmJobState | None = None
    lost: bool = False  # neither scontrol nor the jobcomp file knows the job any more
    unavailable_since: float | None = None
    last_refresh: float = 0.0
    pid: int = 0
    create_time: float = 0.0
    popen: Any = None
    cgroup: Any = None
    owner: Any = None
    cancels: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)  # the scancel commands run, for the record

    # --- what Slurm says ----------------------------------------------------------------------
    def refresh(self, *, force: bool = False) -> slurm.SlurmJobState | None:
        now = time.monotonic()
        if not force and now - self.last_refresh < 1.0:
            return self.state
        self.last_refresh = now
        try:
            # While we stop it, ask scontrol itself (the shared squeue answer may be 5 s old): the
            # job's end releases the attempt as soon as Slurm knows it.
            seen = None if self.cancels else slurm.query_many([self.job_id]).get(self.job_id)
            if seen is None or seen.terminal or force:
                seen = slurm.query(self.job_id)  # exit codes, or the jobcomp file once forgotten
                self.lost = seen is None
            self.state = seen
            self.unavailable_since = None
        except slurm.SlurmError as exc:
            if self.unavailable_since is None:
                self.unavailable_since = now
                log.warning("slurm_unavailable", job=self.job_id, error=str(exc)[:300])
        if self.state is not None and self.state.running:
            self.record = slurm.observed(self.record, self.state)
        return self.state

    def alive(self) -> bool:
        st = self.refresh()
        if self.unavailable_since is not None:
            return True  # no answer is not an answer: keep it held
        if st is None:
            return not self.lost
        return not st.terminal

    def over(self) -> bool:
        return not self.alive()

    def same_run(self) -> bool:
        st = self.refresh(force=True)
        return st is None or slurm.same_run(self.record, st)

    # --- the process-tree interface of proctree.Handle ---------------------------------------------
    def processes(self, *, scan: bool = False) -> list:
        return []  # Slurm's job cgroup holds them; `alive` is the truth

    def reap(self) -> None:
        pass

    def shim(self):
        return None

    def memory_bytes(self) -> tuple[int, str]:
        return 0, "not sampled here (each node's shim records its own peak)"

    def signal_all(self, _sig: int) -> None:
        """SIGTERM to every step and the batch process (the shims, which forward it to every worker)."""
        self._cancel(hard=False)

    def kill_all(self, shim_too: bool = False) -> None:
        """SIGKILL every process of the job now, on every node (`slurm.kill_at_once`)."""
        self._cancel(hard=True, kill_now=True)

    def force_stop(self, overdue_s: float) -> bool:
        """Past the stop deadline: SIGKILL at once, as locally (a job-level scancel would wait
        KillWait, 30 s here, before its SIGKILL); if the job is still there 10 s later, a
        job-level scancel as well."""
        if "kill" not in self.cancels:
            self.kill_all()
            return True
        if overdue_s > FALLBACK_CANCEL_AFTER_S and "hard" not in self.cancels:
            self._cancel(hard=True)
        return False

    @property
    def killed_by_supervisor(self) -> bool:
        return "kill" in self.cancels

    def waiting(self) -> bool:
        """In Slurm's queue (or not yet seen): silence then is not a hang."""
        return self.state is None or self.state.state != "RUNNING"

    def describe(self) -> str:
        return f"Slurm job {self.job_id}"

    def lingering(self) -> bool:
        return False  # inside the job, on a node: Slurm ends the job when the shim gives up

    def _cancel(self, *, hard: bool, kill_now: bool = False) -> None:
        try:
            self.commands += slurm.cancel(self.job_id, hard=hard, kill_now=kill_now,
                                          steps_only=int(self.record.get("nodes") or 1) > 1)
            self.cancels.append("kill" if kill_now else "hard" if hard else "term")
        except slurm.SlurmError as exc:
            log.warning("slurm_cancel_failed", job=self.job_id, error=str(exc)[:300])
        self.last_refresh = 0.0
