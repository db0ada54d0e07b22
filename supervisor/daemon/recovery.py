"""Taking a `running` job back after a restart, through the same backend protocol as a launch.

Whatever of its last attempt lives is followed again (adopted) or stopped; one that ended while
the daemon was down is judged from the exit record the shim wrote (or the scheduler's verdict);
one that left nothing is interrupted. The attempt's owner is found from the record alone (job id,
attempt number, backend reference), never from the job file: a job file that this version of
the supervisor refuses (the ordinary case after an upgrade with `KillMode=process`) must not turn
a live training into a failed job with another one started beside it. Any error here leaves the
job held: its tree is followed and stopped first, and if even that cannot be set up the daemon
keeps the job `running` and schedules nothing until it can (`Daemon.unrecovered`).
"""

from __future__ import annotations

from supervisor.core.states import JobState
from supervisor.daemon.facts import Facts
from supervisor.daemon.follow import Active, Follower
from supervisor.daemon.journal import Journal
from supervisor.judge.diagnosis import LogScanner
from supervisor.judge.kinds import kind_of
from supervisor.record.store import JobRow
from supervisor.run import proctree
from supervisor.run.backends.base import Reservation
from supervisor.service.logsetup import log


class Recovery:
    def __init__(self, journal: Journal, facts: Facts, backend, follower: Follower, *, stop_grace: float,
                 hang_timeout: float) -> None:
        self.journal = journal
        self.store = journal.store
        self.facts = facts
        self.backend = backend
        self.follower = follower
        self.stop_grace = stop_grace
        self.hang_timeout = hang_timeout

    def recover(self, job: JobRow, adopt: bool) -> Active | None:
        """Take a `running` job back. Nothing new starts until all of its last attempt is gone."""
        attempt = self.store.last_attempt(job.id)
        if attempt is None or attempt.ended_at is not None:
            self.journal.transition(job.id, JobState.INTERRUPTED,
                                    "daemon restarted before the attempt started" if attempt is None else
                                    f"daemon restarted after attempt {attempt.number} ended, before its "
                                    "verdict was recorded")
            return None
        try:
            return self._take_back(job, attempt, adopt)
        except Exception as exc:  # noqa: BLE001 - any failure taking a job back holds it (said), never loses it
            log.exception("recovery_failed", job=job.id)
            return self._hold(job, attempt, f"recovery failed: {exc!r}")

    def _active(self, job: JobRow, attempt, handle, spec) -> Active:
        kind = kind_of(spec) if spec is not None else None
        output_dir = kind.output_dir(spec) if kind is not None and kind.resumes else None
        assigned = attempt.json("gpus") if attempt.gpus else (
            list(spec.sup.gpus) if spec is not None and spec.sup.gpus else None)
        return Active(job_id=job.id, number=attempt.number, paths=self.facts.cfg.state.job(job.id).attempt(attempt.number),
                      handle=handle, scanner=LogScanner(initial_step=attempt.resumed_from_step), spec=spec,
                      gpus=assigned, output_dir=output_dir,
                      hang_timeout=(spec.sup.hang_timeout if spec is not None else None) or self.hang_timeout,
                      last_step=attempt.resumed_from_step, identity=self.facts.identity_quietly(job.id))

    def _take_back(self, job: JobRow, attempt, adopt: bool) -> Active:
        spec, spec_error = None, None
        try:
            spec = self.facts.spec_of(job.id)
        except Exception as exc:  # noqa: BLE001 - an unreadable job file is judged as missing evidence, not raised
            spec_error = str(exc)
        paths = self.facts.cfg.state.job(job.id).attempt(attempt.number)
        tag = self.backend.attempt_tag(job.id, attempt.number)
        handle = self.backend.adopt(attempt, paths, tag) or self.backend.unlaunched(Reservation(tag=tag))
        act = self._active(job, attempt, handle, spec)
        n = attempt.number
        if not handle.same_run():
            self.journal.event(job.id, "slurm_relaunch_detected",
                               f"{handle.describe()} is not the run attempt {n} started (relaunched under the same "
                               "id; its output was truncated): stopping it and resuming from the last complete "
                               "checkpoint", attempt=n)
            act.interrupt_cause = "slurm relaunch"
            self.follower.stop(act, "vanished", 0.0)
            return act
        alive = handle.alive()
        left = handle.processes(scan=True)
        if alive or left:
            if job.cancel_requested:
                self.journal.event(job.id, "attempt_stopped_on_restart",
                                   f"daemon restarted; attempt {n} still runs and a cancel was requested: "
                                   "stopping it", attempt=n)
                self.follower.stop(act, "cancel", self.stop_grace)
            elif not alive:
                self.follower.stop_orphans(act, left)
            elif adopt:
                degraded = (f"; its job file no longer parses under this version ({spec_error}): followed with "
                            "the daemon's defaults until it ends" if spec is None else "")
                self.journal.event(job.id, "attempt_adopted",
                                   f"daemon restarted; attempt {n} ({handle.describe()}) is still running: following "
                                   f"it again (ownership: {self.backend.describe()}){degraded}", attempt=n)
            else:
                self.journal.event(job.id, "attempt_stopped_on_restart",
                                   f"daemon restarted; stopping attempt {n} ({handle.describe()}) before a new one "
                                   "starts", attempt=n)
                act.interrupt_cause = "restart"
                self.follower.stop(act, "shutdown", self.stop_grace)
            return act
        if proctree.read_exit(paths) is not None:
            self.journal.event(job.id, "attempt_ended_while_down",
                               f"attempt {n} ended while the daemon was down; judging it from its exit record "
                               "and log", attempt=n)
        elif not self.backend.keeps_verdicts:
            act.stopped_by = "vanished"  # nothing lives and nothing was written: resume it
        return act

    def _hold(self, job: JobRow, attempt, why: str) -> Active:
        """Our own error while taking the job back: follow and stop its tree, record once it is gone.
        Raises only when not even its owner can be found (the daemon then holds the job)."""
        paths = self.facts.cfg.state.job(job.id).attempt(attempt.number)
        tag = self.backend.attempt_tag(job.id, attempt.number)
        handle = self.backend.adopt(attempt, paths, tag) or self.backend.unlaunched(Reservation(tag=tag))
        act = self._active(job, attempt, handle, None)
        self.follower.broke(act, why)
        return act
