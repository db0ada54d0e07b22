"""Following a live attempt: its log read within a budget, fatal lines acted on, hangs noticed,
memory sampled, stops that never block the loop (SIGTERM now, SIGKILL at one deadline).

Nothing here decides that an attempt is over: only its handle does (`over`: the shim and every
member of the attempt's owner gone, or the scheduler's terminal state).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from supervisor.core.paths import AttemptPaths
from supervisor.daemon.journal import Journal
from supervisor.intake.jobspec import JobSpec
from supervisor.judge.diagnosis import LogScanner
from supervisor.judge.goodput import TimingMarks
from supervisor.run.logfollow import LogFollower
from supervisor.service.logsetup import log

# Per poll and job: one job's output never holds the loop for long (the rest waits a tick).
READ_BUDGET_BYTES = 8 << 20
READ_BUDGET_S = 0.05
TAIL_KEEP_BYTES = 32 << 20  # of a backlog left when an attempt is over, the part that is read
STUCK_AFTER_S = 10.0
SAMPLE_EVERY_S = 0.5


@dataclass
class Active:
    """A running attempt as the daemon follows it (memory only; the record is in SQLite)."""

    job_id: int
    number: int
    paths: AttemptPaths
    handle: Any  # a backend's handle (supervisor.run.backends)
    scanner: LogScanner
    spec: JobSpec | None  # None: its job file no longer parses (an adopted attempt after an upgrade)
    gpus: list[int] | None
    output_dir: Path | None
    hang_timeout: float
    log: LogFollower = None  # type: ignore[assignment]
    last_output_mono: float = field(default_factory=time.monotonic)
    last_step: int | None = None
    peak_rss: int = 0
    peak_measure: str | None = None  # what peak_rss counts (procstat.PSS, a cgroup's memory.current)
    min_available: int | None = None
    stopped_by: str | None = None
    detected_at: float | None = None
    teardown_s: float | None = None
    fatal: list = field(default_factory=list)
    progress_offset: int | None = None  # trainer_log.jsonl size at launch: later lines are this attempt's
    next_sample_mono: float = 0.0
    published_step: int | None = None
    # Stopping without blocking the loop: SIGTERM sent at stop_sent_mono, SIGKILL at stop_deadline.
    stop_sent_mono: float | None = None
    stop_sent_wall: float | None = None
    stop_deadline: float | None = None
    kill_sent: bool = False
    interrupt_cause: str = "shutdown"
    launch_failure: str | None = None
    vram: Any = None
    stuck_reported: bool = False
    late_reported: bool = False  # said that the exit record waits for room
    broken: str | None = None  # our own error while following it: stop it, then record
    limit_killed: bool = False  # stopped for going over host_memory_limit (sampled, no cgroup)
    scheduler: dict | None = None  # the scheduler's own verdict (Slurm), read once it is over
    identity: Any = None  # a shared box: the submitter it runs as (run.identity.Identity)
    marks: TimingMarks = field(default_factory=TimingMarks)  # when steps, loads and saves were seen (goodput)

    def __post_init__(self) -> None:
        if self.log is None:
            self.log = LogFollower(self.paths.log)

    @property
    def offset(self) -> int:
        return self.log.offset

    @property
    def memory_limit(self) -> int | None:
        return self.spec.sup.host_memory_limit if self.spec is not None else None

    @property
    def stop_on_fatal(self) -> bool:
        return self.spec.sup.stop_on_fatal_line if self.spec is not None else True


class Follower:
    def __init__(self, journal: Journal, *, stop_grace: float, fatal_grace: float,
                 clock=time.time) -> None:
        self.journal = journal
        self.stop_grace = stop_grace
        self.fatal_grace = fatal_grace
        self.clock = clock

    def poll(self, act: Active) -> bool:
        """Advance one attempt within this tick's budget; True only when all of it is gone."""
        if act.broken is None:
            self.read_log(act)
            self.act_on_fatal(act)
        now = time.monotonic()
        if now >= act.next_sample_mono:  # the log may wake us 50 times a second: sample less often
            act.next_sample_mono = now + SAMPLE_EVERY_S
            self.sample(act)
            if act.last_step is not None and act.last_step != act.published_step:
                act.published_step = act.last_step  # so `status` shows progress while it runs
                self.journal.store.update_attempt(act.job_id, act.number, max_step=act.last_step,
                                                  total_steps=act.scanner.total_steps)
        self.advance_stop(act)
        act.handle.reap()
        if not act.handle.alive():
            left = act.handle.processes(scan=True)
            if left:
                self.stop_orphans(act, left)
                return False
            if act.broken is None:
                self.read_to_end(act)
            if act.stop_sent_mono is not None and act.teardown_s is None:
                act.teardown_s = time.monotonic() - act.stop_sent_mono
            return True
        # Alive. The exit check came first: a job that ended while we were stalled is not a hang.
        if act.handle.waiting():
            act.last_output_mono = now  # waiting in a scheduler's queue is not a hang
        if act.handle.lingering():
            act.last_output_mono = now  # ended; its exit record waits for room: not a hang either
            if not act.late_reported:
                self.journal.event(act.job_id, "exit_record_late",
                                   f"attempt {act.number}: the command has ended but its exit record cannot be "
                                   f"written yet (no space in {act.paths.root.parent}); the job stays held until "
                                   "the shim can write it, and is judged then", attempt=act.number)
                act.late_reported = True
        if (act.stopped_by is None and act.broken is None and act.hang_timeout
                and now - act.last_output_mono > act.hang_timeout):
            self.journal.event(act.job_id, "hang_detected",
                               f"no output and no step advance for {act.hang_timeout:.0f}s (last step "
                               f"{act.last_step}); stopping the attempt", attempt=act.number,
                               hang_timeout=act.hang_timeout)
            self.stop(act, "hang", self.stop_grace)
        return False

    def act_on_fatal(self, act: Active) -> None:
        if act.fatal and act.stopped_by is None and act.stop_on_fatal:
            ev = act.fatal[0]
            self.journal.event(act.job_id, "fatal_detected",
                               f"line {ev.line_no}: {ev.text[:300]} -> stopping the attempt now",
                               attempt=act.number, rule=ev.rule)
            self.stop(act, "fatal_signal", self.fatal_grace)

    def stop(self, act: Active, reason: str, grace_s: float) -> None:
        """Ask the attempt to stop: SIGTERM now, SIGKILL at the deadline (never blocks the loop)."""
        now = time.monotonic()
        if act.stopped_by is None:
            act.stopped_by = reason
            act.detected_at = self.clock()
        if act.stop_sent_mono is None:
            act.stop_sent_mono, act.stop_sent_wall = now, self.clock()
            act.stop_deadline = now + grace_s
            act.handle.signal_all(signal.SIGTERM)
        else:
            act.stop_deadline = min(act.stop_deadline or now + grace_s, now + grace_s)
        self.advance_stop(act)

    def advance_stop(self, act: Active) -> None:
        """SIGKILL at the stop deadline, again while anything is left; say once if it will not die."""
        if act.stop_deadline is None:
            return
        now = time.monotonic()
        if now < act.stop_deadline:
            return
        if act.handle.force_stop(now - act.stop_deadline):
            act.kill_sent = True
        if (act.kill_sent and not act.stuck_reported and now - act.stop_deadline > STUCK_AFTER_S
                and act.handle.processes()):
            act.stuck_reported = True
            self.journal.event(act.job_id, "attempt_stuck",
                               f"attempt {act.number}: processes survive SIGKILL for {STUCK_AFTER_S:.0f}s "
                               f"({describe(act.handle.processes())}); probably in uninterruptible sleep (a "
                               "hung driver or file system). The job stays held: nothing else starts on its "
                               "GPUs until they are gone", attempt=act.number)

    def stop_orphans(self, act: Active, left: list) -> None:
        """The shim is gone but processes of the attempt live (it was killed from outside)."""
        if act.stopped_by is None:
            act.stopped_by = "orphaned"
            act.detected_at = self.clock()
        if act.stop_deadline is None or not act.kill_sent:
            self.journal.event(act.job_id, "orphans_stopped",
                               f"the attempt's shim is gone but {len(left)} of its processes still run "
                               f"({describe(left)}); stopping them before anything else may use their GPUs",
                               attempt=act.number)
            act.stop_sent_mono = act.stop_sent_mono or time.monotonic()
            act.stop_sent_wall = act.stop_sent_wall or self.clock()
            act.stop_deadline = time.monotonic()
            act.handle.kill_all()
            act.kill_sent = True

    def broke(self, act: Active, what: str) -> None:
        """Our own error while following a live attempt: stop its tree first; record once it is gone."""
        if act.broken is None:
            act.broken = what
            log.error("attempt_follow_failed", job=act.job_id, attempt=act.number, error=what)
            try:
                self.journal.event(act.job_id, "internal_error",
                                   f"internal error while following attempt {act.number} ({what}); stopping "
                                   "the attempt before the job is released", attempt=act.number)
            except Exception:  # noqa: BLE001, S110 - the attempt is stopped next whatever the journal does; a second failure here must not skip the stop
                pass
        self.stop(act, "internal_error", self.stop_grace)

    # --- the log and the memory -------------------------------------------------------------------
    def read_log(self, act: Active, budget_bytes: int = READ_BUDGET_BYTES, budget_s: float = READ_BUDGET_S) -> None:
        for chunk in act.log.read(budget_bytes, budget_s):
            act.last_output_mono = time.monotonic()
            act.fatal.extend(act.scanner.feed(chunk))
            now = self.clock()
            step = act.scanner.last_step
            if step is not None and (act.last_step is None or step > act.last_step):
                act.last_step = step
                close_save(act)
                act.marks.on_step(now, step)
            act.marks.on_text(now, chunk)
        if act.log.notes:
            act.last_output_mono = time.monotonic()
            for note in act.log.notes:
                self.journal.event(act.job_id, "log_changed", note, attempt=act.number)
            act.log.notes.clear()

    def read_to_end(self, act: Active) -> None:
        """The attempt is over: read what is left (a flood backlog only by its tail)."""
        act.log.skip_to_tail(TAIL_KEEP_BYTES)
        self.read_log(act, budget_bytes=TAIL_KEEP_BYTES + READ_BUDGET_BYTES, budget_s=10.0)

    def sample(self, act: Active) -> None:
        try:
            procs = act.handle.processes()
            if act.handle.owner is not None:
                act.handle.owner.remember(procs)
            rss, measure = act.handle.memory_bytes()
            avail = psutil.virtual_memory().available
        except Exception:  # noqa: BLE001 - a sample is best effort (the tree may be gone, /proc racing); the next tick samples again
            return
        if rss >= act.peak_rss:
            act.peak_rss, act.peak_measure = rss, measure
        act.min_available = avail if act.min_available is None else min(act.min_available, avail)
        limit = act.memory_limit
        if limit and act.handle.cgroup is None and rss > limit and act.stopped_by is None:
            # No cgroup: RLIMIT_DATA binds each process alone, so the job as a whole is held to its
            # limit here, by the sampled sum of what the kernel charges its processes (PSS).
            act.limit_killed = True
            self.journal.event(act.job_id, "memory_limit_enforced",
                               f"the job's processes use {gib(rss)} together ({len(procs)} processes; {measure}), "
                               f"over its host_memory_limit of {gib(limit)} (no cgroup here: enforced on the "
                               "sampled sum); stopping the attempt", attempt=act.number, rss_bytes=rss,
                               limit_bytes=limit, measure=measure)
            self.stop(act, "memory_limit", 0.0)


def close_save(act: Active) -> None:
    """A save seen beginning ended when its checkpoint's files were last written."""
    pending = act.marks.pending_save()
    if pending is None:
        return
    begin, where = pending
    path = Path(where)
    if not path.is_absolute() and act.spec is not None:
        path = act.spec.resolve(where)
    end = saved_at(path, begin)
    if end is not None:
        act.marks.close_save(end)


def saved_at(path: Path, begin: float) -> float | None:
    """When a save into `path` finished: trainer_state.json is written last into a checkpoint
    (transformers' _save_checkpoint); for the final model, the newest file of the folder."""
    try:
        return max(t for t in [(path / "trainer_state.json").stat().st_mtime] if t >= begin - 1)
    except (OSError, ValueError):
        pass
    try:
        times = [e.stat().st_mtime for e in os.scandir(path) if e.is_file()]
    except OSError:
        return None
    return max((t for t in times if t >= begin - 1), default=None)


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def describe(procs) -> str:
    parts = []
    for p in list(procs)[:6]:
        try:
            parts.append(f"pid {p.pid} {p.name()} [{p.status()}]")
        except psutil.Error:
            parts.append(f"pid {p.pid}")
    more = len(list(procs)) - len(parts)
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")
