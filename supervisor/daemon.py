"""The daemon: one loop of named steps over the durable record.

Each tick runs intake -> control -> monitor -> schedule. A step that raises is
logged (and recorded as a daemon event) and the loop goes on: one bad job must
not stop the others. Signals only set a flag; the loop notices it, stops
intake, stops running attempts gracefully (they become `interrupted`, which
is resumable and not a failure) and exits 0.

Crash rules (start-up `recover`): an attempt whose shim is still alive is
re-adopted (pid + start time) or stopped, per config; one whose shim is gone
is finished from the exit record the shim wrote, or marked interrupted when
there is none. Either way nothing is lost and nothing runs twice: the state
lock keeps a second daemon off the same state folder.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import attempts as attempt_mod
from .config import DaemonConfig
from .logsetup import log
from .notify import Notifier
from .paths import StatePaths
from .spool import intake
from .states import JobState
from .store import JobRow, Store


class DaemonLocked(RuntimeError):
    pass


@dataclass
class StateLock:
    """An flock on the state folder: one daemon per state, released by the kernel on death."""

    path: Path
    fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise DaemonLocked(f"another oom-supervisor daemon (pid {holder}) holds {self.path}; "
                               "stop it first or use another --state-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@dataclass
class Daemon:
    cfg: DaemonConfig
    clock: Any = time.time
    active: dict[int, attempt_mod.Active] = field(default_factory=dict)
    stopping: bool = False

    def __post_init__(self) -> None:
        self.state: StatePaths = self.cfg.state
        self.state.ensure()
        self.cfg.spool.ensure()
        self.lock = StateLock(self.state.lock)
        self.store: Store | None = None
        self.notifier = Notifier(self.cfg.notify, log=log)
        self.steps = [("intake", self.step_intake), ("control", self.step_control),
                      ("monitor", self.step_monitor), ("schedule", self.step_schedule)]

    # --- lifecycle ----------------------------------------------------------------
    def run(self) -> int:
        self.lock.acquire()
        self.store = Store(self.state.db, clock=self.clock)
        self.runner = attempt_mod.Runner(self.cfg, self.store, self.notifier, clock=self.clock)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        log.info("daemon_started", pid=os.getpid(), state_dir=str(self.state.root),
                 spool_dir=str(self.cfg.spool.root), cgroups=str(self.runner.cgroup_support))
        self.store.event(None, "daemon", f"daemon started (pid {os.getpid()})")
        try:
            self.recover()
            while not self.stopping:
                self.tick()
                self._sleep(self.cfg.poll_interval)
        finally:
            self.shutdown()
            for s, h in old.items():
                signal.signal(s, h)
            self.store.event(None, "daemon", "daemon stopped")
            self.store.close()
            self.lock.release()
            log.info("daemon_stopped")
        return 0

    def _on_signal(self, signum, _frame) -> None:
        if not self.stopping:
            log.info("shutdown_requested", signal=signal.Signals(signum).name)
        self.stopping = True

    def _sleep(self, seconds: float) -> None:
        """Wait for the next tick, but wake at once when an attempt's log grows:
        an OOM line must not wait a whole poll interval to be acted on."""
        end = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < end:
            time.sleep(min(0.02, max(0.0, end - time.monotonic())))
            if any(_log_grew(act) for act in self.active.values()):
                self._run_step("monitor", self.step_monitor)  # only the cheap step, not a full tick

    def tick(self) -> None:
        for name, step in self.steps:
            if self.stopping and name in ("intake", "schedule"):
                continue
            self._run_step(name, step)
        self.notifier.reap()

    def _run_step(self, name: str, step) -> None:
        try:
            step()
        except Exception as exc:  # one failing step must not stop the loop
            log.exception("step_failed", step=name)
            try:
                self.store.event(None, "daemon_error", f"step {name} failed: {exc!r}")
            except Exception:
                pass

    def _per_job(self, job_id: int, what: str, fn, *args):
        """Run fn for one job; an error fails THAT job (retry-able) instead of every tick."""
        try:
            return fn(*args)
        except Exception as exc:
            log.exception("job_step_failed", job=job_id, step=what)
            self.active.pop(job_id, None)
            try:
                self.runner.internal_failure(job_id, f"{what}: {exc!r}")
            except Exception:
                log.exception("internal_failure_not_recorded", job=job_id)
            return None

    def shutdown(self) -> None:
        """Stop running attempts gracefully; they are interrupted, not failed."""
        for job_id in list(self.active):
            act = self.active.pop(job_id)
            try:
                self.runner.stop(act, reason="shutdown", grace_s=self.cfg.stop_grace)
                self.runner.finish(act)
            except Exception:
                log.exception("shutdown_stop_failed", job=job_id)
        self.notifier.reap(wait=True)

    # --- steps ----------------------------------------------------------------------
    def step_intake(self) -> None:
        intake(self.cfg.spool, self.state, self.store, settle_s=self.cfg.settle_time,
               max_bytes=self.cfg.max_job_file_bytes, now=self.clock(), log=log)

    def step_control(self) -> None:
        """Act on requests the CLI left in the record (cancel of a running job)."""
        for job_id, act in list(self.active.items()):
            job = self.store.job(job_id)
            if job is not None and job.cancel_requested and act.stopped_by is None:
                self._per_job(job_id, "cancel", self.runner.stop, act, "cancel", self.cfg.stop_grace)

    def step_monitor(self) -> None:
        for job_id, act in list(self.active.items()):
            if self._per_job(job_id, "follow", self.runner.poll, act):
                del self.active[job_id]
                self._per_job(job_id, "judge the attempt", self.runner.finish, act)

    def step_schedule(self) -> None:
        paused = self.store.get_meta("queue_paused")
        if paused:
            return
        now = self.clock()
        runnable = [j for j in self.store.jobs({JobState.QUEUED, JobState.INTERRUPTED, JobState.WAITING_RETRY})
                    if j.id not in self.active and (j.not_before is None or j.not_before <= now)]
        runnable.sort(key=lambda j: (-j.priority, j.id))
        for job in runnable:
            if len(self.active) >= self.cfg.max_parallel:
                break
            if not self._gpus_free(job):
                continue
            act = self._per_job(job.id, "start an attempt", self.runner.start, job)
            if act is not None:
                self.active[job.id] = act

    def _gpus_free(self, job: JobRow) -> bool:
        want = self.runner.gpus_of(job.id)
        for act in self.active.values():
            have = act.gpus
            if want is None or have is None or set(want) & set(have):
                return False
        return True

    # --- crash recovery ----------------------------------------------------------------
    def recover(self) -> None:
        for job in self.store.jobs({JobState.RUNNING}):
            act = self._per_job(job.id, "recover after restart", self.runner.recover, job,
                                self.cfg.on_restart == "adopt")
            if act is not None:
                self.active[job.id] = act


def _log_grew(act: attempt_mod.Active) -> bool:
    try:
        return os.stat(act.paths.log).st_size > act.offset
    except OSError:
        return False
