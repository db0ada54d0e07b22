"""The daemon: one loop of named steps over the durable record.

Each tick runs intake -> control -> monitor -> schedule. A step that raises is
logged (and recorded as a daemon event) and the loop goes on: one bad job must
not stop the others. Signals only set a flag; the loop notices it, stops
intake, stops running attempts gracefully (they become `interrupted`, which
is resumable and not a failure) and exits 0.

The rule it keeps: a job is never released while a process of its previous
attempt lives. An attempt leaves `active` only when `Handle.over()` says the
shim and every member of its owner (cgroup, or marker + known pids) are gone
AND its verdict is recorded; our own error while following it stops its tree
first; a full state disk keeps it followed until the record can be written.

Crash rules (start-up `recover`): whatever of the last attempt still lives is
re-adopted or stopped, per config, through the same path; one that ended
while we were down is judged from the exit record the shim wrote, and one
that left nothing is interrupted (resumed, within `max_interruptions`).

Nothing one job or file does may stall the loop: log reading has a budget per
poll, stops never block (SIGTERM now, SIGKILL at a deadline, checked every
poll), and intake has its own limits.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.core.paths import StatePaths
from supervisor.core.states import JobState
from supervisor.daemon import system
from supervisor.daemon.config import DaemonConfig
from supervisor.daemon.follow import STUCK_AFTER_S, Active, describe
from supervisor.daemon.runner import Runner
from supervisor.intake.spool import CheckContext, intake, output_dir_of_job
from supervisor.record.store import JobRow, Store
from supervisor.run.diskfull import describe_full, free_bytes, is_disk_full
from supervisor.service import control
from supervisor.service.logsetup import log
from supervisor.service.metrics import Metrics, RunningJob
from supervisor.service.notify import Notifier
from supervisor.service.sdnotify import ServiceNotifier, status_from_store


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
    active: dict[int, Active] = field(default_factory=dict)
    stopping: bool = False
    disk_full: str | None = None  # why the state folder cannot be written, while it cannot
    finish_failures: dict[int, int] = field(default_factory=dict)
    vram_waits: dict[int, Any] = field(default_factory=dict)
    said_blocked: set = field(default_factory=set)
    unrecovered: dict[int, str] = field(default_factory=dict)  # job id -> why it could not be taken back
    output_dirs: dict[int, str | None] = field(default_factory=dict)
    gpu_waits: dict[int, float] = field(default_factory=dict)  # job id -> since when it waits for GPUs
    last_tick_s: float = 0.0

    def __post_init__(self) -> None:
        self.state: StatePaths = self.cfg.state
        self.state.ensure()
        self.cfg.spool.ensure()
        self.gate = system.prepare(self.cfg, log=log)  # system mode: who may submit; private folders
        self.lock = StateLock(self.state.lock)
        self.store: Store | None = None
        self.notifier = Notifier(self.cfg.notify, log=log, webhooks=self.cfg.webhooks)
        self.service = ServiceNotifier.from_env(log=log)
        self.metrics = Metrics(self.cfg.metrics, log=log) if self.cfg.metrics is not None else None
        self.steps = [("intake", self.step_intake), ("control", self.step_control),
                      ("monitor", self.step_monitor), ("schedule", self.step_schedule)]

    # --- lifecycle ----------------------------------------------------------------
    def run(self) -> int:
        self.lock.acquire()
        self.store = Store(self.state.db, clock=self.clock)
        self.runner = Runner(self.cfg, self.store, self.notifier, clock=self.clock)
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        ownership = self.runner.backend.describe()
        log.info("daemon_started", pid=os.getpid(), state_dir=str(self.state.root),
                 spool_dir=str(self.cfg.spool.root), memory_cgroups=str(getattr(self.runner.backend, 'cgroup_support', None)),
                 ownership=ownership)
        self.store.event(None, "daemon", f"daemon started (pid {os.getpid()}); attempt ownership: {ownership}")
        if self.metrics is not None:
            self.metrics.start()
        self.control = control.serve(self.cfg, log=log)  # a shared box: users' queries and requests
        try:
            self.recover()
            self.service.ready(self._status_line())
            while not self.stopping:
                self.tick()
                self._sleep(self.cfg.poll_interval)
        finally:
            self.service.stopping(f"stopping {len(self.active)} attempt(s)")
            self.shutdown()
            if self.metrics is not None:
                self.metrics.close()
            if self.control is not None:
                self.control.stop()
            self.runner.backend.close()
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
            if any(act.log.pending() > 0 or act.stop_deadline is not None for act in self.active.values()):
                # (a stopping attempt is watched closely too: its SIGKILL is due at a deadline)
                # only the cheap steps, not a full tick: a cancel must not wait behind a flood
                self._run_step("control", self.step_control)
                self._run_step("monitor", self.step_monitor)

    def tick(self) -> None:
        began = time.monotonic()
        if self.disk_full is not None:
            self._check_disk_back()
        for name, step in self.steps:
            if (self.stopping or self.disk_full) and name in ("intake", "schedule"):
                continue
            self._run_step(name, step)
        self.runner.flush_notifications()
        self.notifier.reap()
        self.last_tick_s = time.monotonic() - began
        self._tell(self.last_tick_s)

    def _status_line(self) -> str:
        try:
            line = status_from_store(self.store, running=len(self.active))
        except Exception:  # noqa: BLE001 - the status line is cosmetic: a count stands in
            line = f"{len(self.active)} running"
        return f"{line}; STATE DISK FULL" if self.disk_full else line

    def _tell(self, tick_s: float) -> None:
        """The loop itself proves it is alive (WATCHDOG=1), says how it stands, updates metrics."""
        self.service.watchdog()
        if self.metrics is not None:
            self.metrics.observe_tick(tick_s)
        now = time.monotonic()
        if now < getattr(self, "_next_report", 0.0):
            return
        self._next_report = now + 2.0
        self.service.status(self._status_line())
        if self.metrics is not None:
            try:
                self.metrics.update(self.store, [self._running_info(a) for a in self.active.values()])
            except Exception:  # noqa: BLE001 - metrics are best effort; the loop goes on
                log.exception("metrics_update_failed")

    def _running_info(self, act) -> RunningJob:
        name = act.spec.name if act.spec is not None else f"job {act.job_id}"
        return RunningJob(job_id=act.job_id, name=name, attempt=act.number, step=act.last_step,
                          total_steps=act.scanner.total_steps, peak_host_bytes=act.peak_rss or None)

    def _run_step(self, name: str, step) -> None:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - one failing step must not stop the loop
            if is_disk_full(exc):
                self._on_disk_full(exc)
                return
            log.exception("step_failed", step=name)
            try:
                self.store.event(None, "daemon_error", f"step {name} failed: {exc!r}")
            except Exception:  # noqa: BLE001, S110 - recording the failure is best effort; it is logged above
                pass

    def _on_disk_full(self, exc: BaseException) -> None:
        self.runner.discard_notifications()
        if self.disk_full is None:
            self.disk_full = describe_full(self.state.root, exc)
            log.error("state_disk_full", message=self.disk_full, running=sorted(self.active))

    def _check_disk_back(self) -> None:
        """Recover by ourselves once the state folder takes writes again."""
        free = free_bytes(self.state.root)
        if free is not None and free < (1 << 20):
            return
        try:
            self.store.set_meta("state_disk_ok_at", str(self.clock()))
            self.store.event(None, "daemon", f"the state folder has room again; resuming ({self.disk_full})")
        except Exception as exc:  # noqa: BLE001 - a probe of the state disk; anything but a full disk is logged
            if not is_disk_full(exc):
                log.exception("disk_probe_failed")
            return
        log.info("state_disk_recovered", was=self.disk_full)
        self.disk_full = None

    def _per_job(self, job_id: int, what: str, fn, *args):
        """Run fn for one job; an error is THAT job's problem, never every tick's.

        A job with a live attempt is never released here: its tree is stopped first and the
        verdict recorded once it is gone (Runner.broke). A full state disk fails nothing:
        the record waits for room.
        """
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - one job's failure must not stall the loop or the others (rule 9)
            if is_disk_full(exc):
                self._on_disk_full(exc)
                return None
            log.exception("job_step_failed", job=job_id, step=what)
            act = self.active.get(job_id)
            if act is not None:
                try:
                    self.runner.broke(act, f"{what}: {exc!r}")
                except Exception:  # noqa: BLE001 - the job is being failed already; this stop is logged
                    log.exception("stop_after_internal_error_failed", job=job_id)
                return None
            try:
                self.runner.internal_failure(job_id, f"{what}: {exc!r}")
            except Exception as inner:  # noqa: BLE001 - one job's failure must not stall the loop or the others (rule 9)
                if is_disk_full(inner):
                    self._on_disk_full(inner)
                else:
                    log.exception("internal_failure_not_recorded", job=job_id)
            return None

    def shutdown(self) -> None:
        """Stop every running attempt at once against one deadline; they are interrupted, not
        failed. An attempt that ended on its own meanwhile is judged as usual. One whose
        processes will not die keeps its job `running` (held) and is said so."""
        for job_id, act in list(self.active.items()):
            try:
                self.runner.stop(act, reason="shutdown", grace_s=self.cfg.stop_grace)
            except Exception:  # noqa: BLE001 - at shutdown every attempt gets its stop, whatever one of them raises
                log.exception("shutdown_stop_failed", job=job_id)
        deadline = time.monotonic() + self.cfg.stop_grace + STUCK_AFTER_S
        while self.active and time.monotonic() < deadline:
            self._run_step("monitor", self.step_monitor)
            if self.active:
                time.sleep(0.05)
        for job_id, act in self.active.items():
            msg = (f"the supervisor stops but attempt {act.number} still has processes "
                   f"({describe(act.handle.processes())}); the job stays running (held) and "
                   "the next start of the supervisor takes it back")
            log.error("shutdown_left_processes", job=job_id, message=msg)
            try:
                self.store.event(job_id, "attempt_stuck", msg, attempt=act.number)
            except Exception:  # noqa: BLE001, S110 - the stuck processes are logged above; the event is best effort
                pass
        self.runner.flush_notifications()
        self.notifier.reap(wait=True)

    # --- steps ----------------------------------------------------------------------
    def step_intake(self) -> None:
        # The pre-launch checks see what attempts will: the part of this environment attempts get
        # (an allowlist), the config's env, and whether attempts run on this box.
        env = self.runner.facts.inherited_env()
        context = CheckContext(base_env=env, daemon_env=dict(self.cfg.env),
                               launch_here=self.cfg.backend != "slurm", where="intake")
        intake(self.cfg.spool, self.state, self.store, settle_s=self.cfg.settle_time,
               max_bytes=self.cfg.max_job_file_bytes, now=self.clock(), log=log,
               policy_dirs=self.cfg.policy_search_dirs(), context=context, gate=self.gate)

    def step_control(self) -> None:
        """Act on requests the CLI left in the record (cancel of a running job)."""
        if not self.active:
            return
        wanted = self.store.cancel_requested_ids()
        for job_id, act in list(self.active.items()):
            if job_id in wanted and act.stopped_by != "cancel":
                self._per_job(job_id, "cancel", self.runner.stop, act, "cancel", self.cfg.stop_grace)
                if act.stopped_by != "cancel" and act.stopped_by not in ("shutdown",):
                    act.stopped_by = "cancel"  # already stopping for another reason: the user's word wins

    def step_monitor(self) -> None:
        for job_id, act in list(self.active.items()):
            if not self._per_job(job_id, "follow", self.runner.poll, act):
                continue
            try:
                self.runner.finish(act)
            except Exception as exc:  # noqa: BLE001 - one job's verdict failing must not stall the loop or the others (rule 9)
                self.runner.discard_notifications()
                if is_disk_full(exc):
                    self._on_disk_full(exc)  # its processes are gone; the verdict waits for room
                    continue
                n = self.finish_failures[job_id] = self.finish_failures.get(job_id, 0) + 1
                log.exception("judge_failed", job=job_id, failures=n)
                if n < 3:
                    continue
                # Everything of it is gone (poll said so): releasing the job is safe now.
                self.finish_failures.pop(job_id, None)
                del self.active[job_id]
                self._per_job(job_id, "judge the attempt", self._give_up_judging, job_id, exc)
                continue
            self.finish_failures.pop(job_id, None)
            del self.active[job_id]

    def _give_up_judging(self, job_id: int, exc: BaseException) -> None:
        self.runner.internal_failure(job_id, f"judge the attempt: {exc!r}")

    def step_schedule(self) -> None:
        if self.unrecovered:
            self.recover()  # held jobs first: their processes may hold any GPU
            if self.unrecovered:
                return
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
            if not job.cancel_requested and not self._dependencies_met(job):
                continue
            if not job.cancel_requested and self._output_dir_taken(job):
                continue
            ok, gpus = self._assign(job)
            if not ok or not self._vram_released(job, gpus):
                continue
            act = self._per_job(job.id, "start an attempt", self.runner.start, job, gpus)
            if act is not None:
                self.active[job.id] = act

    def _dependencies_met(self, job: JobRow) -> bool:
        """`after:` jobs must have succeeded; one that failed or was cancelled is said once."""
        try:
            after = self.runner.spec_of(job.id).sup.after
        except Exception:  # noqa: BLE001 - start() reports the unreadable job file, with its reason
            return True  # start() reports the unreadable job file
        for dep in after:
            other = self.store.job(dep)
            if other is not None and other.state == JobState.SUCCEEDED:
                continue
            if other is None or other.state in (JobState.FAILED, JobState.CANCELLED):
                key = (job.id, dep, other.state if other else None)
                if key not in self.said_blocked:
                    self.said_blocked.add(key)
                    what = (f"is {other.state}: retry job {dep}, or cancel job {job.id}" if other else
                            f"does not exist: cancel job {job.id} and submit it again without job {dep}")
                    self.store.event(job.id, "waiting_for_dependency",
                                     f"job {job.id} runs after job {dep}, which {what}")
            return False
        return True

    def _output_dir_taken(self, job: JobRow) -> bool:
        """Two trainings never write one output_dir at once: a job waits while a running one, or
        an earlier one not ended yet, has the same output_dir (said once, and in `status`)."""
        mine = self._output_dir(job)
        if mine is None:
            return False
        for other in self.store.jobs({JobState.QUEUED, JobState.RUNNING, JobState.INTERRUPTED,
                                      JobState.WAITING_RETRY}):
            if other.id == job.id or (other.id > job.id and other.id not in self.active):
                continue
            if self._output_dir(other) != mine:
                continue
            why = (f"waiting: output_dir {mine} is also job {other.id}'s ({other.state}); "
                   f"starts when job {other.id} has ended")
            if ("output_dir", job.id, other.id) not in self.said_blocked:
                self.said_blocked.add(("output_dir", job.id, other.id))
                self.store.update_job(job.id, reason=why)
                self.store.event(job.id, "waiting_for_output_dir", why)
            return True
        return False

    def _output_dir(self, job: JobRow) -> str | None:
        if job.id not in self.output_dirs:
            self.output_dirs[job.id] = output_dir_of_job(self.state, job.id, job.workdir)
        return self.output_dirs[job.id]

    def _assign(self, job: JobRow) -> tuple[bool, list[int] | None]:
        """(may start now, the GPUs it gets). A job naming GPUs gets those when none is taken; one
        asking for N gets the lowest N free ones of the box; one with neither takes the whole box
        and runs alone (as LLaMA-Factory then uses every visible GPU)."""
        if job.cancel_requested or self.runner.backend.allocates_gpus:
            return True, None  # start() settles a cancel; a scheduler allocates its own GPUs
        try:
            sup = self.runner.spec_of(job.id).sup
        except Exception:  # noqa: BLE001 - start() reports an unreadable job file, with its reason
            return True, None
        taken: set[int] = set()
        for act in self.active.values():
            if act.gpus is None:
                return False, None  # something holds the whole box
            taken |= set(act.gpus)
        if sup.gpus is not None:
            asked, pool, box = len(sup.gpus), [g for g in sup.gpus if g not in taken], None
        elif sup.gpu_count:
            box = self._inventory()
            asked, pool = sup.gpu_count, [d for d in box if d not in taken]
        else:
            return not self.active, None
        if len(pool) >= asked:
            self.gpu_waits.pop(job.id, None)
            return True, list(sup.gpus) if sup.gpus is not None else pool[:asked]
        return self._short_of_gpus(job, asked, pool, box)

    def _short_of_gpus(self, job: JobRow, asked: int, pool: list[int], box: list[int] | None):
        """Fewer free GPUs than asked: wait (said once), and after the policy's `fewer_gpus.after_s`
        run on the free ones where it allows (the plan keeps the effective batch on them)."""
        from supervisor.judge.plan import world_keeping_batch
        from supervisor.judge.policy.schema import FewerGpus

        spec = self.runner.spec_of(job.id)
        try:
            fewer = self.runner.facts.policy(spec, job).fewer_gpus
        except Exception:  # noqa: BLE001 - start() reports an unreadable policy, with its reason
            fewer = FewerGpus()  # start() reports an unreadable policy
        if box is not None and asked > len(box) and not fewer.allow:
            self._per_job(job.id, "assign GPUs", self.runner.refuse, job,
                          f"asks for {asked} GPUs; this box has {len(box)} ({box or 'none found'}): lower "
                          "`gpus:` or run it elsewhere (its policy does not allow fewer_gpus)")
            return False, None
        now = self.clock()
        since = self.gpu_waits.setdefault(job.id, now)
        usable = world_keeping_batch(spec.config, asked, len(pool)) if pool else None
        if since == now:
            then = (f"after {fewer.after_s:.0f}s it runs on the free ones" + (f" ({usable})" if usable else "")
                    + ", the effective batch kept" if fewer.allow else "it waits for them (fewer_gpus not allowed)")
            self.store.event(job.id, "waiting_for_gpus", f"asks for {asked} GPUs; {len(pool)} free now {pool}"
                             + (f" of the box's {box}" if box is not None else "") + f"; {then}",
                             data={"asked": asked, "free": pool})
        if not fewer.allow or not usable or now - since < fewer.after_s:
            return False, None
        self.gpu_waits.pop(job.id, None)
        self.store.event(job.id, "fewer_gpus", f"waited {now - since:.0f}s for {asked} GPUs; running on "
                         f"{usable} ({pool[:usable]}) as its policy allows (fewer_gpus): the effective batch is "
                         "kept (gradient accumulation adjusted), a checkpoint of another world size is resumed "
                         "through DeepSpeed's universal format where it is a ZeRO one",
                         data={"asked": asked, "gpus": pool[:usable], "waited_s": round(now - since, 3)})
        return True, pool[:usable]

    def _inventory(self) -> list[int]:
        if self.cfg.gpu_devices is not None:
            return sorted(self.cfg.gpu_devices)
        return sorted(self.runner.backend.gpu_capacities())

    def _vram_released(self, job: JobRow, gpus: list[int] | None) -> bool:
        """A job's attempt waits (bounded, in a worker thread: GPU tools can hang) until the memory
        of the attempt that ran on its GPUs before is given back; then it starts, said either way."""
        last = self.store.last_attempt(job.id)
        if last is None or job.cancel_requested or self.runner.backend.allocates_gpus or self.cfg.vram_release_timeout <= 0:
            return True
        fut = self.vram_waits.get(job.id)
        if fut is None:
            from supervisor.run.gpus import wait_vram_released

            self.vram_waits[job.id] = self._pool().submit(wait_vram_released, gpus, self.cfg.vram_release_timeout)
            return False
        if not fut.done():
            return False
        del self.vram_waits[job.id]
        try:
            res = fut.result()
        except Exception:  # noqa: BLE001 - the wait is only a courtesy: the job starts and the error is logged
            log.exception("vram_wait_failed", job=job.id)
            return True
        if res.released is False:
            self.store.event(job.id, "vram_not_released", res.message, data={"waited_s": res.waited_s})
            self.runner.journal.notify(job.id, "vram_not_released", res.message)
        elif res.released and res.waited_s >= 1.0:
            self.store.event(job.id, "vram_released", res.message, data={"waited_s": res.waited_s})
        return True

    def _pool(self):
        if getattr(self, "_executor", None) is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="vram-wait")
        return self._executor

    # --- crash recovery ----------------------------------------------------------------
    def recover(self) -> None:
        """Take back every `running` job (whatever of its attempt lives) before scheduling anything.

        A job that cannot even be looked at (its attempt's owner cannot be found: the record or the
        backend fails) stays `running` and held: nothing is scheduled while any is, since its
        processes may hold any GPU, and taking it back is tried again every tick."""
        for job in self.store.jobs({JobState.RUNNING}):
            if job.id in self.active:
                continue
            try:
                act = self.runner.recover(job, self.cfg.on_restart == "adopt")
            except Exception as exc:  # noqa: BLE001 - a job that cannot be taken back is held and said; the others go on
                if is_disk_full(exc):
                    self._on_disk_full(exc)
                    return
                if job.id not in self.unrecovered:
                    log.exception("recovery_impossible", job=job.id)
                    try:
                        self.store.event(job.id, "recovery_failed",
                                         f"cannot take job {job.id} back after the restart ({exc!r}); it stays "
                                         "held and nothing else starts until it can be (tried again every tick)")
                    except Exception:  # noqa: BLE001, S110 - the hold itself is what matters; the event is best effort
                        pass
                self.unrecovered[job.id] = repr(exc)
                continue
            self.unrecovered.pop(job.id, None)
            if act is not None:
                self.active[job.id] = act
