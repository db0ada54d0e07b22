"""Judging an attempt that is over: evidence -> diagnosis -> decision -> ONE transaction.

The evidence is the exit record the shim wrote (or the scheduler's verdict), the log the scanner
read, and the host's counters (cgroup, kernel, sampled memory, statvfs). The diagnosis is the pure
scanner's, the decision the pure policy's; the verdict (attempt row, events, decision, state) is
one transaction that lands only on the attempt it is about (compare-and-set on state and attempt
number). Raising (e.g. a full disk) records nothing: the daemon keeps the attempt and calls again.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from supervisor.core.models import (
    AttemptRecord,
    Category,
    Decision,
    DecisionKind,
    Diagnosis,
    ExitRecord,
    HostEvidence,
    Overrides,
)
from supervisor.core.states import JobState
from supervisor.daemon.facts import Facts
from supervisor.daemon.follow import Active
from supervisor.daemon.journal import Journal
from supervisor.intake.llamafactory.launch import pinned_nproc
from supervisor.judge.kinds import kind_of
from supervisor.judge.nodes import locate, node_of_rank
from supervisor.record import requests
from supervisor.run import kernel_log, proctree
from supervisor.run.diskfull import free_bytes
from supervisor.run.fsutil import atomic_write_json, tail_text
from supervisor.run.procstat import PSS
from supervisor.service.logsetup import log

INTERRUPTING = ("shutdown", "vanished", "cancelled_outside")


class Verdicts:
    def __init__(self, journal: Journal, facts: Facts, backend, *, clock) -> None:
        self.journal = journal
        self.store = journal.store
        self.facts = facts
        self.backend = backend
        self.clock = clock

    def finish(self, act: Active) -> None:
        """Judge an attempt that is over and record it all in ONE transaction."""
        raw, stopped_by = self.exit_evidence(act)
        exit_rec = ExitRecord(returncode=raw.get("returncode"), signal=raw.get("signal"),
                              duration_s=raw.get("duration_s"), stopped_by=stopped_by,
                              launch_error=raw.get("launch_error") or raw.get("error") or act.launch_failure,
                              node=raw.get("node") if raw.get("nodes") else None)
        host = self.host_evidence(act, raw)
        try:
            diagnosis = self.place(act, act.scanner.finish(exit_rec, host), raw)
        except Exception as exc:  # noqa: BLE001 - a diagnosis bug must still end in a recorded verdict (act.broken)
            log.exception("diagnosis_failed", job=act.job_id)
            act.broken = act.broken or f"diagnosis failed: {exc!r}"
            diagnosis = Diagnosis(Category.UNKNOWN, f"the supervisor could not diagnose the log ({exc!r})")
        atomic_write_json(act.paths.diagnosis, diagnosis.to_dict(), mode=0o600)
        progress = self.progress(act)
        job = self.store.job(act.job_id)
        cancel = stopped_by == "cancel" or bool(job and job.cancel_requested)
        decision = this = None
        if not cancel and stopped_by not in INTERRUPTING and act.broken is None:
            row = self.store.attempt(act.job_id, act.number)
            this = AttemptRecord(
                number=act.number, overrides=Overrides.from_dict(row.json("overrides") if row else None),
                diagnosis=diagnosis, exit=exit_rec, resumed_from_step=row.resumed_from_step if row else None,
                max_step=progress.get("max_step"), checkpoint_step_after=progress.get("checkpoint_step_after"))
            decision = self.decide(act.job_id, diagnosis, this)
        fields: dict[str, Any] = dict(
            ended_at=raw.get("ended_at") or self.clock(), exit=json.dumps(exit_rec.to_dict()),
            diagnosis=json.dumps(diagnosis.to_dict()), detected_at=act.detected_at,
            peak_rss_bytes=host.peak_rss_bytes, **progress)
        vram = act.vram.stop() if act.vram is not None else None
        emergency = emergency_of(act.paths.log)
        note = self.emergency_note(act, emergency)
        if emergency is not None and emergency.steps_saved and emergency.step is not None:
            # The hook saved the last finished step: that checkpoint is what this attempt kept.
            fields["checkpoint_step_after"] = max(emergency.step, progress.get("checkpoint_step_after") or 0)
        self.follower_close_save(act)
        with self.store.tx():
            self.store.update_attempt(act.job_id, act.number, **fields)
            self.record_telemetry(act, emergency, vram, note=note, node=diagnosis.node)
            self.record_scheduler(act)
            # When steps, checkpoint loads and saves were seen: the goodput buckets (judge.goodput).
            self.store.event(act.job_id, "attempt_timing", f"attempt {act.number}: {len(act.marks.steps)} step "
                             f"marks, {len(act.marks.loads)} checkpoint loads, {len(act.marks.saves)} saves seen",
                             attempt=act.number, data=act.marks.to_dict())
            self.journal.event(act.job_id, "attempt_ended",
                               f"attempt {act.number} ended: {exit_words(exit_rec)}; diagnosis {diagnosis.category}"
                               + (f"/{diagnosis.subkind}" if diagnosis.subkind else "") + f": {diagnosis.summary}",
                               attempt=act.number, teardown_s=act.teardown_s, node=diagnosis.node,
                               rank=diagnosis.rank, nodes=raw.get("nodes"), peak_host_measure=peak_measure(act, host))
            self.settle(act, stopped_by, decision)
        act.log.close()
        if decision is not None and this is not None:
            self.observe(act, this, diagnosis, host, progress)
        self.backend.cleanup(act.handle)

    def follower_close_save(self, act: Active) -> None:
        """A save still open when the attempt ended (the final model's) ends at its files' time."""
        from supervisor.daemon.follow import close_save

        try:
            close_save(act)
        except Exception:  # noqa: BLE001 - save timing is for the goodput lines only
            log.exception("save_time_unreadable", job=act.job_id)

    def exit_evidence(self, act: Active) -> tuple[dict[str, Any], str | None]:
        """The exit record's fields (the shim's, every node's judged together, else the
        scheduler's) and why the attempt stopped."""
        sched = self.backend.verdict(act.handle, act.paths, act.memory_limit)
        nodes = (sched or {}).get("nodes") or []
        raw = proctree.read_exit(act.paths, nodes if len(nodes) > 1 else None) or {}
        stopped_by = act.stopped_by
        if sched is not None and sched.get("lost"):
            # The scheduler no longer knows the job and no shim wrote how it ended: as a local
            # attempt that vanished with no exit record, it is interrupted, not charged.
            if not raw and stopped_by is None:
                stopped_by, act.interrupt_cause = "vanished", f"slurm lost: {sched['lost']}"
            sched = None
        if sched is not None:
            if not raw or raw.get("returncode") is None:
                raw = {**raw, **sched["exit"]}
            if stopped_by is None and (sched["interrupted"] or sched["timeout"]):
                stopped_by, act.interrupt_cause = "vanished", f"slurm {sched['scheduler_state']}"
            elif stopped_by is None and sched["cancelled"]:
                stopped_by = "cancelled_outside"
            act.scheduler = sched
        if (stopped_by == "shutdown" and raw.get("ended_at") and act.stop_sent_wall
                and raw["ended_at"] < act.stop_sent_wall and raw.get("returncode") is not None):
            stopped_by = None  # it ended on its own just before our stop: judge it as such
        return raw, stopped_by

    def place(self, act: Active, diagnosis: Diagnosis, raw: dict[str, Any]) -> Diagnosis:
        """On several nodes: which node (and rank) it happened on; the scheduler's own words as
        evidence where its state decided (never the log's last lines)."""
        sched = act.scheduler or {}
        nodes = sched.get("nodes") or []
        if len(nodes) <= 1:
            return locate(diagnosis, exit_node=None, rank_node=None, scheduler_words=sched.get("evidence") or ())
        failed: list[str] = []
        if sched.get("scheduler_state") in ("NODE_FAIL", "BOOT_FAIL"):
            failed = [n for n in nodes if n in (sched.get("down_nodes") or {})] or list(raw.get("missing_nodes") or [])
        return locate(diagnosis, exit_node=raw.get("node"), failed_nodes=failed,
                      rank_node=node_of_rank(diagnosis.rank, self.ranks_per_node(act), nodes),
                      scheduler_words=sched.get("evidence") or (), node_ends=raw.get("nodes"))

    def ranks_per_node(self, act: Active) -> int | None:
        """Ranks each node's launcher starts, where the attempt's launch says so (NPROC_PER_NODE,
        or a LLaMA-Factory job's ranks per node); None for a command whose ranks we do not know."""
        try:
            env = json.loads(act.paths.environment.read_text()).get("env") or {}
        except (OSError, ValueError):
            env = {}
        pinned = pinned_nproc(env)
        if pinned or act.spec is None or act.spec.kind != "llamafactory":
            return pinned
        return self.backend.launch_fields(act.spec, None, env).get("nproc_per_node")

    def record_scheduler(self, act: Active) -> None:
        """The scheduler's verdict and the words it rests on, as an event (inside finish's tx)."""
        sched = act.scheduler
        if not sched:
            return
        words = list(sched.get("evidence") or [])
        self.journal.event(act.job_id, "scheduler_verdict",
                           f"attempt {act.number} ({act.handle.describe()}): " + "; ".join(words[:6])
                           + (f"; the supervisor's stop ran: {'; '.join(sched['stop_commands'])}"
                              if sched.get("stop_commands") else ""),
                           attempt=act.number, state=sched.get("scheduler_state"), evidence=words,
                           nodes=sched.get("nodes"), down_nodes=sched.get("down_nodes"),
                           stop_commands=sched.get("stop_commands"))

    def emergency_note(self, act: Active, emergency):
        """What a multi-rank emergency checkpoint says of itself (its note file), read as the job's
        user; None for any other outcome or an unreadable note."""
        from supervisor.hooks.markers import NOTE_FILE, parse_note
        from supervisor.run.attemptdir import read_job_json

        if emergency is None or emergency.outcome != "saved" or not emergency.path:
            return None
        try:  # a regular file only, bounded, no link followed: the path comes from the job's log
            with self.facts.acting(act.identity):
                return parse_note(read_job_json(Path(emergency.path) / NOTE_FILE))
        except Exception:  # noqa: BLE001 - the note is the job's file: evidence, never a condition of the verdict
            log.exception("emergency_note_unreadable", job=act.job_id)
            return None

    def record_telemetry(self, act: Active, emergency, vram, *, note=None, node: str | None = None) -> None:
        if emergency is not None:
            from supervisor.hooks.markers import describe

            words, data = describe(emergency, note, node)
            self.journal.event(act.job_id, "emergency_checkpoint", words, attempt=act.number, **data)
        if vram and vram.get("samples"):
            peaks = ", ".join(f"GPU {d}: {b / (1 << 30):.2f} GiB" for d, b in vram["peak_bytes"].items())
            self.journal.event(act.job_id, "gpu_telemetry", f"peak VRAM {peaks or 'none seen'} ({vram['source']})",
                               attempt=act.number, **vram)

    def settle(self, act: Active, stopped_by: str | None, decision: Decision | None) -> None:
        """Move the job (inside finish's transaction), only if the record is still at this attempt."""
        job = self.store.job(act.job_id)
        last = self.store.last_attempt(act.job_id)
        j = self.journal
        if job is None or job.state != JobState.RUNNING or last is None or last.number != act.number:
            j.event(act.job_id, "attempt_orphan_record",
                    f"attempt {act.number} ended while the job was {job.state if job else 'gone'}"
                    f" (last attempt {last.number if last else None}); nothing more to do", attempt=act.number)
        elif job.cancel_requested or stopped_by == "cancel":
            self.store.update_attempt(act.job_id, act.number, decision=json.dumps({"kind": "cancelled"}))
            j.cancelled(act.job_id, f"cancelled by {requests.requested_by(self.store, act.job_id) or 'the user'}")
        elif stopped_by == "cancelled_outside":
            self.store.update_attempt(act.job_id, act.number, decision=json.dumps(
                {"kind": "fail", "reason": "cancelled in Slurm"}))
            j.fail(act.job_id, f"attempt {act.number} ({act.handle.describe()}) was cancelled in Slurm by someone "
                               f"else (scancel); not started again on its own: `oom-supervisor retry {act.job_id}` "
                               "resumes it")
        elif stopped_by in ("shutdown", "vanished"):
            cause = act.interrupt_cause if act.interrupt_cause.startswith("slurm") else (
                "crash" if stopped_by == "vanished" else act.interrupt_cause)
            lost = cause.startswith("slurm lost: ")
            self.store.update_attempt(act.job_id, act.number, interrupted=1, decision=json.dumps(
                {"kind": "interrupted", "cause": "slurm lost" if lost else cause}))
            why = (f"attempt {act.number} left no exit record and {cause[len('slurm lost: '):]}: its end is "
                   "unknown, not a failure of the job" if lost else
                   f"Slurm ended attempt {act.number} ({cause[6:]}): not a failure of the job"
                   if cause.startswith("slurm") else "the supervisor stopped" if cause != "crash" else
                   f"attempt {act.number} vanished with the daemon (no exit record)")
            j.transition(act.job_id, JobState.INTERRUPTED, f"{why}; resumes from the last complete checkpoint")
        elif act.broken is not None:
            self.store.update_attempt(act.job_id, act.number, decision=json.dumps(
                {"kind": "fail", "reason": f"internal error: {act.broken}"}))
            j.fail(act.job_id, f"internal error while following attempt {act.number} ({act.broken}); its processes "
                               f"are gone. `oom-supervisor retry {act.job_id}` resumes it from its last complete "
                               "checkpoint")
        else:
            self.apply(act.job_id, act.number, decision)

    # --- deciding and applying ------------------------------------------------------------------------
    def decide(self, job_id: int, diagnosis: Diagnosis, this: AttemptRecord | None = None) -> Decision:
        """What to do next (the pure policy over the record plus `this`, the attempt being judged,
        not yet recorded as ended); no writes."""
        from supervisor.judge.policy import decide

        if diagnosis.category == Category.SUCCESS:
            return Decision(DecisionKind.DONE, "the training command exited 0")
        job = self.store.job(job_id)
        try:
            spec = self.facts.spec_of(job_id)
            policy = self.facts.policy(spec, job)
            history = [a for a in self.facts.history(job_id) if this is None or a.number != this.number]
            if this is not None:
                history.append(this)
            with self.facts.acting(self.facts.identity_of(job)):  # the model's config, the job's interpreter
                context = self.facts.context(job, spec)
            return decide(context, history, diagnosis, policy)
        except Exception as exc:  # noqa: BLE001 - a policy bug fails the job with the reason, never loses the verdict
            log.exception("decide_failed", job=job_id)
            return Decision(DecisionKind.FAIL, f"the policy could not decide: {exc!r}")

    def apply(self, job_id: int, number: int, decision: Decision) -> None:
        """Record the decision and move the job (inside the verdict's transaction)."""
        self.store.update_attempt(job_id, number, decision=json.dumps(decision.to_dict()))
        now = self.clock()
        j = self.journal
        if decision.kind == DecisionKind.DONE:
            j.transition(job_id, JobState.SUCCEEDED, decision.reason)
            j.notify(job_id, "succeeded", decision.reason)
        elif decision.kind == DecisionKind.FAIL:
            j.fail(job_id, decision.reason)
        elif decision.kind == DecisionKind.RETRY:
            j.transition(job_id, JobState.WAITING_RETRY,
                         f"retry the same configuration in {decision.delay_s:.0f}s: {decision.reason}",
                         not_before=now + decision.delay_s)
        elif decision.kind == DecisionKind.WAIT:  # the surroundings failed: waiting, said with its time
            parts = decision.reason.split("; ", 2)  # "waiting for X: why; next try in 12m00s; ..."
            at = time.strftime("%H:%M", time.localtime(now + decision.delay_s))
            if len(parts) > 1 and parts[1].startswith("next try in "):
                parts[1] = f"next try at {at} ({parts[1].removeprefix('next try ')})"
            j.transition(job_id, JobState.WAITING_RETRY, "; ".join(parts), not_before=now + decision.delay_s)
        elif decision.kind == DecisionKind.ESCALATE:
            over = decision.overrides or Overrides()
            changes = "; ".join(f"{c.key}: {c.old!r} -> {c.new!r} ({c.why})" for c in decision.changes)
            j.transition(job_id, JobState.WAITING_RETRY,
                         f"escalate to {decision.rung}: {decision.reason}" + (f" [{changes}]" if changes else ""),
                         not_before=now + decision.delay_s, next_overrides=json.dumps(over.to_dict()))
            j.notify(job_id, "escalated", f"{decision.rung}: {decision.reason}",
                     changes=[c.to_dict() for c in decision.changes])
        elif decision.kind == DecisionKind.PAUSE:
            j.transition(job_id, JobState.WAITING_RETRY, f"queue paused: {decision.reason}",
                         not_before=now + decision.delay_s)
            self.store.set_meta("queue_paused", f"job {job_id}: {decision.reason}")
            self.store.event(job_id, "queue_paused", decision.reason)
            j.notify(job_id, "paused", decision.reason)

    # --- evidence -------------------------------------------------------------------------------------
    def progress(self, act: Active) -> dict[str, Any]:
        out: dict[str, Any] = {"max_step": act.last_step}
        if act.output_dir is None:
            return out
        try:
            with self.facts.acting(act.identity):  # the job's output folder, as its user sees it
                return self._read_progress(act, out)
        except Exception:  # noqa: BLE001 - progress is evidence, not a condition of the verdict
            log.exception("progress_read_failed", job=act.job_id)
        return out

    def _read_progress(self, act: Active, out: dict[str, Any]) -> dict[str, Any]:
        try:
            from supervisor.run.checkpoints import scan_output_dir
            from supervisor.run.progress import read_progress

            row = self.store.attempt(act.job_id, act.number)
            prog = read_progress(act.output_dir, since_step=row.resumed_from_step if row else None,
                                 since_offset=act.progress_offset)
            if prog.max_step is not None:
                out["max_step"] = max(prog.max_step, act.last_step or 0)
            out["total_steps"] = prog.total_steps
            out["steps_per_s"] = prog.steps_per_s
            out["tokens_per_s"] = prog.tokens_per_s
            latest = scan_output_dir(act.output_dir).latest
            out["checkpoint_step_after"] = latest.step if latest else None
        except Exception:  # noqa: BLE001 - progress is evidence, not a condition of the verdict
            log.exception("progress_read_failed", job=act.job_id)
        return out

    def host_evidence(self, act: Active, raw: dict) -> HostEvidence:
        cg = act.handle.cgroup
        pids = attempt_pids(raw, act.handle)
        peak = max(act.peak_rss, int(raw.get("peak_rss_bytes") or 0))  # the shim's own samples too
        kills = None
        if cg is not None:
            kills = cg.oom_kills()
            peak = max(peak, cg.peak_bytes() or 0)
        # Once, at verdict time, bounded: OOM kills of this attempt's processes or cgroup, GPU faults.
        klog = kernel_log.read_window(raw.get("started_at") or 0, raw.get("ended_at"), pids=pids,
                                      cgroup=cg.path.name if cg is not None else None)
        mechanism = cg.mechanism if cg else ("rlimit-data+sampled-pss" if act.memory_limit else None)
        host = HostEvidence(cgroup_oom_kills=kills, kernel_lines=klog.lines, kernel_log_read=klog.read,
                            min_available_bytes=act.min_available, peak_rss_bytes=peak or None,
                            memory_limit_bytes=act.memory_limit, limit_mechanism=mechanism,
                            limit_enforced_kill=act.limit_killed,
                            free_bytes=free_space([act.output_dir, act.paths.root]))
        if act.scheduler is not None:
            host = dataclasses.replace(host, **{k: v for k, v in act.scheduler["host"].items() if v is not None})
        return host

    def observe(self, act: Active, this: AttemptRecord, diagnosis: Diagnosis, host: HostEvidence,
                progress: dict[str, Any]) -> None:
        """What this attempt used, for the next job of its kind (after the verdict is committed)."""
        if act.spec is None or not kind_of(act.spec).learns:
            return
        from supervisor.record.observations import record_finished

        try:
            job = self.store.job(act.job_id)
            with self.facts.acting(act.identity):
                context = self.facts.context(job, act.spec)
            record_finished(self.facts.cfg.state.root, context, this.overrides,
                            diagnosis, succeeded=diagnosis.category == Category.SUCCESS,
                            max_step=progress.get("max_step"), resumed_from_step=this.resumed_from_step,
                            peak_file=act.paths.peak_file, host=host, job=job.name if job else "",
                            attempt=act.number, time=self.clock())
        except Exception:  # noqa: BLE001 - learning is best effort; the verdict lands without it
            log.exception("observation_not_recorded", job=act.job_id)


def emergency_of(log_path: Path):
    """The start-up hook's last marker in the log's tail (it comes right before the traceback)."""
    from supervisor.hooks.markers import parse_emergency

    try:
        return parse_emergency(tail_text(log_path, 256 << 10).splitlines())
    except Exception:  # noqa: BLE001 - the hook's marker is untrusted text from the job's log
        log.exception("emergency_marker_unreadable")
        return None


def free_space(folders: list[Path | None]) -> dict[str, int]:
    return {str(d): free for d in folders if d is not None and (free := free_bytes(d)) is not None}


def exit_words(e: ExitRecord) -> str:
    if e.returncode is None:
        return "exit status unknown"
    how = f"killed by {e.signal}" if e.signal else f"exit code {e.returncode}"
    how += f" on node {e.node}" if e.node else ""
    return how + (f" (stopped by the supervisor: {e.stopped_by})" if e.stopped_by else "")


def peak_measure(act: Active, host: HostEvidence) -> str | None:
    """What the attempt's peak host memory counts, for `show`: the daemon's samples' measure when
    they set the peak, else the shim's (PSS, as the daemon counts) or the cgroup's peak."""
    if not host.peak_rss_bytes:
        return None
    if act.peak_measure and act.peak_rss >= host.peak_rss_bytes:
        return act.peak_measure
    return "the cgroup's own peak count" if act.handle.cgroup is not None else PSS


def attempt_pids(raw: dict, handle: proctree.Handle) -> set[int]:
    """Every process the attempt was seen to have: a kernel OOM kill names the rank it killed, which
    without a cgroup is not the main process the shim reports (torchrun's agent outlives it)."""
    known = handle.owner.known if handle.owner is not None else {}
    return {int(p) for p in (raw.get("pid"), *known) if p}
