"""One attempt, three steps: plan (pure), run (a backend), judge (one transaction).

`start` gathers the job's facts (`facts.py`), asks the pure plan what to launch or why not
(`supervisor.judge.plan`), carries the plan out (checkpoint fixups, the attempt's files), records
the start in one transaction and launches through the backend (`supervisor.run.backends`).
`poll` follows the live attempt (`follow.py`), `finish` judges it (`verdict.py`), `recover`
takes one back after a restart (`recovery.py`). The runner holds no backend or job-kind branch.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import yaml

from supervisor.core.states import JobState
from supervisor.daemon.config import DaemonConfig
from supervisor.daemon.facts import Facts
from supervisor.daemon.follow import Active, Follower
from supervisor.daemon.journal import Journal
from supervisor.daemon.recovery import Recovery
from supervisor.daemon.verdict import Verdicts
from supervisor.intake.llamafactory.validate import validate_config
from supervisor.judge.diagnosis import LogScanner
from supervisor.judge.plan import AttemptPlan, Refuse, plan_attempt
from supervisor.judge.policy.render import EFFECTIVE_YAML
from supervisor.record import requests
from supervisor.record.store import JobRow, Store
from supervisor.run import attemptdir
from supervisor.run.backends import make_backend
from supervisor.run.backends.base import Reservation
from supervisor.run.checkpoints import apply_fixups, quarantine, reclaim
from supervisor.run.diskfull import is_disk_full
from supervisor.run.fsutil import atomic_write_json, atomic_write_text
from supervisor.run.identity import Identity, UnknownUser
from supervisor.run.ownership import MARKER_ENV
from supervisor.service.logsetup import log
from supervisor.service.notify import Notifier

RUNNABLE = (JobState.QUEUED, JobState.INTERRUPTED, JobState.WAITING_RETRY)
PEAK_FILE_ENV = "OOM_SUPERVISOR_PEAK_FILE"  # where the start-up hook writes the GPU peaks it saw


class Runner:
    def __init__(self, cfg: DaemonConfig, store: Store, notifier: Notifier, *, clock=time.time,
                 backend=None) -> None:
        self.cfg = cfg
        self.store = store
        self.clock = clock
        self.backend = backend or make_backend(cfg)
        self.facts = Facts(cfg, store, self.backend)
        self.journal = Journal(store, notifier, clock=clock, job_notify=lambda j: self.facts.spec_of(j).sup.notify,
                               job_identity=self.facts.identity_quietly if cfg.system_mode else None)
        self.follower = Follower(self.journal, stop_grace=cfg.stop_grace, fatal_grace=cfg.fatal_grace, clock=clock)
        self.verdicts = Verdicts(self.journal, self.facts, self.backend, clock=clock)
        self.recovery = Recovery(self.journal, self.facts, self.backend, self.follower, stop_grace=cfg.stop_grace,
                                 hang_timeout=cfg.hang_timeout)

    # --- what the loop calls ------------------------------------------------------------------------
    def spec_of(self, job_id: int):
        return self.facts.spec_of(job_id)

    def poll(self, act: Active) -> bool:
        return self.follower.poll(act)

    def stop(self, act: Active, reason: str, grace_s: float) -> None:
        self.follower.stop(act, reason, grace_s)

    def broke(self, act: Active, what: str) -> None:
        self.follower.broke(act, what)

    def finish(self, act: Active) -> None:
        self.verdicts.finish(act)

    def recover(self, job: JobRow, adopt: bool) -> Active | None:
        return self.recovery.recover(job, adopt)

    def refuse(self, job: JobRow, reason: str) -> None:
        self.journal.refuse(job.id, reason)

    def flush_notifications(self) -> None:
        self.journal.flush()

    def discard_notifications(self) -> None:
        self.journal.discard()

    def internal_failure(self, job_id: int, what: str) -> None:
        """Our own error while handling a job that has no live attempt: fail it loudly so
        `retry` can take it again, rather than leave it `running` with nobody following it."""
        job = self.store.job(job_id)
        if job is None:
            return
        msg = (f"internal error while trying to {what}; `oom-supervisor retry {job_id}` resumes it "
               "from its last complete checkpoint")
        self.store.event(job_id, "internal_error", msg)
        if job.state in (JobState.QUEUED, JobState.INTERRUPTED):
            job = self.store.transition(job_id, JobState.RUNNING, "preparing an attempt")
        if job.state in (JobState.RUNNING, JobState.WAITING_RETRY):
            self.journal.fail(job_id, msg)

    # --- start: plan, prepare, launch ---------------------------------------------------------------
    def start(self, job: JobRow, gpus: list[int] | None = None) -> Active | None:
        """Prepare and launch the next attempt on `gpus` (the daemon's assignment; None: the
        whole box), or settle the job if it must not run."""
        job = self.store.job(job.id) or job
        if job.cancel_requested or job.state not in RUNNABLE:
            return self._settle_cancel(job)
        try:
            ident = self.facts.identity_of(job)
        except UnknownUser as exc:
            self.journal.refuse(job.id, f"cannot run it as its submitter ({job.owner or 'unknown'}): {exc}")
            return None
        last = self.store.last_attempt(job.id)
        number = (last.number if last else 0) + 1
        paths = self.cfg.state.job(job.id).attempt(number)
        if paths.root.exists():
            # No attempt row names it, so it was prepared and never launched (the row is committed
            # before the launch): nothing of it ran, and it is rendered again from the record.
            shutil.rmtree(paths.root)
        attemptdir.make(paths, ident)  # a shared box: in attempts_dir, the log and scratch folder its user's
        with self.facts.acting(ident):  # the output folder, the model, the job's interpreter: as its user
            plan = plan_attempt(self.facts.for_attempt(job, number, paths.root, gpus))
        if isinstance(plan, Refuse):
            self.journal.refuse(job.id, plan.reason)
            return None
        if self.held_for_host_memory(job, plan):
            return None
        refused = self.prepare(job.id, plan, paths.root, ident)
        if refused:
            self.journal.refuse(job.id, refused)
            return None
        return self.launch(job, plan, gpus, ident)

    def held_for_host_memory(self, job: JobRow, plan: AttemptPlan) -> bool:
        """Host RAM that other processes hold means wait (bounded by the policy), never refuse and
        never change the job: the attempt is held back, `status` says why, and it is asked again
        later; once the bound has passed it starts anyway, unchanged (judge/policy/hostwait.py)."""
        from supervisor.record.observations import wait_for_host

        try:
            with self.facts.acting(self.facts.identity_quietly(job.id)):
                ctx = self.facts.context(job, plan.spec)
            policy = self.facts.policy(plan.spec, job)
        except Exception:  # noqa: BLE001 - the wait for memory others hold is a courtesy: without it the job starts
            log.exception("host_wait_unavailable", job=job.id)
            return False
        since = self.facts.host_wait_since(job.id)
        now = self.clock()
        w = wait_for_host(self.cfg.state.root, ctx, policy, plan.overrides,
                          waited_s=now - since if since is not None else 0.0)
        if w is None:
            return False
        if w.wait:
            with self.store.tx():
                if since is None:  # said once per wait, not at every look
                    self.journal.event(job.id, "host_memory_wait", w.reason, attempt=plan.number,
                                       others_bytes=w.others, need_bytes=w.need, available_bytes=w.available)
                self.store.update_job(job.id, not_before=now + w.retry_in_s, reason=w.reason)
            return True
        kind = "host_memory_wait_over" if since is not None else "host_memory_not_waited"
        self.journal.event(job.id, kind, w.reason, attempt=plan.number, waited_s=w.waited_s)
        return False

    def prepare(self, job_id: int, plan: AttemptPlan, attempt_dir: Path, ident: Identity | None = None) -> str | None:
        """Carry out what the plan needs on disk; the reason to refuse the job if it cannot be. On
        a shared box the output folder is changed as the job's user, and the files are theirs."""
        try:
            with self.facts.acting(ident):
                self.prepare_resume(job_id, plan)
        except Exception as exc:
            if is_disk_full(exc):
                raise
            return f"cannot plan the resume: {exc}"
        for name, content in plan.rendered.files.items():
            atomic_write_text(attempt_dir / name, content, mode=0o600)
            attemptdir.give(attempt_dir / name, ident)  # the job reads them as its user
        if EFFECTIVE_YAML in plan.rendered.files:  # checked as it will really be launched
            with self.facts.acting(ident):
                problems = validate_config(yaml.safe_load((attempt_dir / EFFECTIVE_YAML).read_text()),
                                           workdir=plan.spec.workdir)
            if problems:
                return "the rendered configuration is invalid: " + "; ".join(map(str, problems))
        return None

    def prepare_resume(self, job_id: int, plan: AttemptPlan) -> None:
        resume, n = plan.resume, plan.number
        if resume is None:
            return
        for inc in plan.quarantine:
            moved = quarantine(inc)
            self.journal.event(job_id, "checkpoint_quarantined",
                               f"{inc.path.name} is incomplete ({inc.reason}); moved aside to {moved}",
                               attempt=n, path=str(moved))
        if resume.checkpoint is not None or resume.mode != "fresh":
            for fx in resume.fixups:
                began = time.monotonic()
                done = apply_fixups(dataclasses.replace(resume, fixups=(fx,)), python=self.facts.job_python(plan.spec),
                                    run_as=self.facts._acting)
                took = time.monotonic() - began
                for text in done:  # a conversion's time is checkpoint-load time (goodput)
                    self.journal.event(job_id, "resume_fixup", text, attempt=n, fixup=fx.kind,
                                       seconds=round(took, 3) if fx.kind == "ds_to_universal" else None)
        for ev in plan.before_launch:
            self.journal.event(job_id, ev.kind, ev.message, attempt=n, **ev.data)
        if plan.retention is not None and plan.output_dir is not None:
            keep_quarantined, keep_archived = plan.retention
            for removed in reclaim(plan.output_dir, keep_quarantined=keep_quarantined, keep_archived=keep_archived):
                self.journal.event(job_id, "checkpoint_reclaimed", removed.describe(), attempt=n,
                                   path=str(removed.aside.path), bytes=removed.aside.size_bytes)

    def launch(self, job: JobRow, plan: AttemptPlan, gpus: list[int] | None,
               ident: Identity | None = None) -> Active | None:
        """Record the start in one transaction (unless a cancel came first), then launch."""
        n, spec = plan.number, plan.spec
        paths = self.cfg.state.job(job.id).attempt(n)
        tag = self.backend.attempt_tag(job.id, n)
        # The hook's in-process peaks go to the attempt's folder of the job's own (never the state's).
        env = {**plan.env, MARKER_ENV: tag, PEAK_FILE_ENV: str(paths.peak_file)}
        atomic_write_json(paths.environment, {"argv": plan.rendered.argv, "cwd": str(spec.workdir), "env": env,
                                              "set_by_attempt": plan.rendered.env}, mode=0o600)
        attemptdir.give(paths.environment, ident)
        res = self.backend.reserve(tag, paths, spec.sup.host_memory_limit)
        if not self._commit_start(job, plan, res, gpus):
            return None
        act = Active(job_id=job.id, number=n, paths=paths, handle=None,
                     scanner=LogScanner(initial_step=plan.resumed_step), spec=spec, gpus=gpus,
                     output_dir=plan.output_dir, hang_timeout=plan.hang_timeout, last_step=plan.resumed_step,
                     progress_offset=_size(plan.output_dir / "trainer_log.jsonl") if plan.output_dir else None,
                     identity=ident)
        if self.store.job(job.id).cancel_requested:
            # The cancel landed right after the start was committed: run nothing, settle it now.
            self.store.update_attempt(job.id, n, ended_at=self.clock(), decision=json.dumps({"kind": "cancelled"}))
            who = requests.requested_by(self.store, job.id) or "the user"
            self.journal.cancelled(job.id, f"cancelled by {who} before the attempt launched")
            self.backend.release(res)
            return None
        try:
            launched = self.backend.launch(res, paths, argv=plan.rendered.argv, cwd=spec.workdir, env=env, spec=spec,
                                           identity=ident)
        except Exception as exc:  # noqa: BLE001 - the attempt is recorded as started: its end must be recorded, whatever failed
            # The attempt is recorded as started: follow it through the usual path (its owner is
            # checked empty there) so that its end is recorded even on a full disk.
            log.error("launch_failed", job=job.id, attempt=n, error=str(exc))
            act.handle = self.backend.unlaunched(res)
            act.launch_failure = f"could not launch: {exc}"
            if is_disk_full(exc):
                act.stopped_by = "vanished"  # nothing ran; it is resumed once there is room
            return act
        act.handle = launched.handle
        for kind, message, data in launched.events:
            self.journal.event(job.id, kind, f"attempt {n} {message}", attempt=n, **data)
        self.store.update_attempt(job.id, n, **launched.record)
        self.journal.event(job.id, "attempt_started", f"attempt {n}: {' '.join(plan.rendered.argv)}", attempt=n,
                           pid=launched.handle.pid, changes=[c.to_dict() for c in plan.rendered.changes],
                           memory_limit=spec.sup.host_memory_limit, limit_mechanism=res.mechanism,
                           world_size=plan.world_size,
                           ownership=res.owner.mechanism if res.owner is not None else self.backend.name)
        act.vram = self.backend.telemetry(launched.handle, gpus)
        return act

    def _commit_start(self, job: JobRow, plan: AttemptPlan, res: Reservation, gpus: list[int] | None) -> bool:
        n = plan.number
        with self.store.tx():
            current = self.store.job(job.id)
            if current is None or current.state not in RUNNABLE or current.cancel_requested:
                # Cancelled (or otherwise moved) by the CLI while we prepared: launch nothing.
                self.backend.release(res)
                self.journal.event(job.id, "attempt_abandoned",
                                   f"attempt {n} was prepared but not launched: the job is now "
                                   f"{current.state if current else 'gone'}"
                                   + (" with a cancel requested" if current and current.cancel_requested else ""),
                                   attempt=n)
                if current is not None and current.cancel_requested and current.state in RUNNABLE:
                    self.journal.cancelled(job.id)
                return False
            self.store.add_attempt(job.id, n, overrides=json.dumps(plan.overrides.to_dict()), remedy=plan.remedy,
                                   resumed_from=plan.resumed_from, resumed_from_step=plan.resumed_step,
                                   gpus=json.dumps(gpus) if gpus is not None else None)
            self.journal.transition(job.id, JobState.RUNNING, plan.started, not_before=None)
            for ev in plan.at_start:
                self.journal.event(job.id, ev.kind, ev.message, attempt=n, **ev.data)
        return True

    def _settle_cancel(self, job: JobRow) -> None:
        """A cancel recorded before we began (durable intent): settle it, run nothing, fix nothing up."""
        with self.store.tx():
            current = self.store.job(job.id)
            if current is not None and current.cancel_requested and current.state in RUNNABLE:
                self.journal.cancelled(job.id)
        return


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
