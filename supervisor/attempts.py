"""One attempt from preparation to verdict: the acting half of the daemon.

`start` renders the attempt (policy overrides + explicit resume point), writes
every file it runs with into `attempt-<n>/`, records it, then launches it.
`poll` follows the log live (fatal lines tear the attempt down at once),
watches for hangs and samples memory. `finish` turns the exit record, the log
and the host's memory evidence into a Diagnosis, asks the pure policy what to
do, and records the decision with its reason.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from . import jobspec as jobspec_mod
from . import proctree
from .config import DaemonConfig
from .diagnosis import LogScanner
from .fsutil import atomic_write_json, atomic_write_text, read_json
from .limits import JobCgroup, detect_cgroup, kernel_oom_lines, rlimits_for
from .logsetup import log
from .models import (
    AttemptRecord,
    Category,
    Decision,
    DecisionKind,
    Diagnosis,
    ExitRecord,
    HostEvidence,
    JobContext,
    Overrides,
)
from .notify import Notifier
from .paths import AttemptPaths
from .states import JobState
from .store import JobRow, Store

READ_CHUNK = 1 << 20
ENV_DROP_PREFIXES = ("OOM_SUPERVISOR_",)


@dataclass
class Active:
    """A running attempt as the daemon follows it (memory only; the record is in SQLite)."""

    job_id: int
    number: int
    paths: AttemptPaths
    handle: proctree.Handle
    scanner: LogScanner
    spec: jobspec_mod.JobSpec
    gpus: list[int] | None
    output_dir: Path | None
    hang_timeout: float
    offset: int = 0
    last_output_mono: float = field(default_factory=time.monotonic)
    last_step: int | None = None
    peak_rss: int = 0
    min_available: int | None = None
    stopped_by: str | None = None
    detected_at: float | None = None
    teardown_s: float | None = None
    fatal: list = field(default_factory=list)
    progress_offset: int | None = None  # trainer_log.jsonl size at launch: later lines are this attempt's
    next_sample_mono: float = 0.0
    known: dict = field(default_factory=dict)  # pid -> create_time of every process seen in the tree
    published_step: int | None = None


class Runner:
    def __init__(self, cfg: DaemonConfig, store: Store, notifier: Notifier, *, clock=time.time) -> None:
        self.cfg = cfg
        self.store = store
        self.notifier = notifier
        self.clock = clock
        self.cgroup_support = detect_cgroup() if cfg.cgroups == "auto" else None
        self._versions: dict[str, dict[str, str | None]] = {}
        self._specs: dict[int, jobspec_mod.JobSpec] = {}  # job.yaml never changes once accepted
        self._gpu_caps: dict[int, int] | None = None  # probed once, when a decision first needs it

    # --- helpers -----------------------------------------------------------------------
    def spec_of(self, job_id: int) -> jobspec_mod.JobSpec:
        if job_id not in self._specs:
            jp = self.cfg.state.job(job_id)
            job = self.store.job(job_id)
            text = jp.job_file.read_text()
            self._specs[job_id] = jobspec_mod.parse_job_text(
                text, source=job.source or "", submit_dir=Path(job.workdir), check_lf=False)
        return self._specs[job_id]

    def gpus_of(self, job_id: int) -> list[int] | None:
        try:
            return self.spec_of(job_id).sup.gpus
        except Exception:
            return None

    def launcher_for(self, spec: jobspec_mod.JobSpec) -> list[str]:
        return list(spec.sup.launcher or self.cfg.launcher)

    def _event(self, job_id: int, kind: str, message: str, attempt: int | None = None, **data: Any) -> None:
        self.store.event(job_id, kind, message, attempt=attempt, data=data or None)
        log.info(kind, job=job_id, attempt=attempt, message=message, **{k: v for k, v in data.items()
                                                                        if k not in ("message",)})

    # --- start --------------------------------------------------------------------------
    def start(self, job: JobRow) -> Active | None:
        from .policy import render_attempt

        try:
            spec = self.spec_of(job.id)
        except Exception as exc:
            self.store.transition(job.id, JobState.RUNNING, "preparing attempt")
            self._fail(job.id, f"job file no longer valid: {exc}")
            return None
        last = self.store.last_attempt(job.id)
        number = (last.number if last else 0) + 1
        paths = self.cfg.state.job(job.id).attempt(number)
        if paths.root.exists():  # prepared before a crash, never launched: keep it aside
            paths.root.rename(paths.root.with_name(f"{paths.root.name}.unlaunched-{time.time_ns()}"))
        paths.root.mkdir(parents=True)
        overrides = Overrides.from_dict(json.loads(job.next_overrides) if job.next_overrides else None)

        resume_yaml: dict[str, Any] = {}
        resumed_from = resumed_step = None
        output_dir = plan = None
        if spec.kind == "llamafactory":
            output_dir = spec.resolve(spec.config["output_dir"]) if spec.config.get("output_dir") else None
            try:
                plan = self._plan_resume(job, spec, overrides, output_dir, number)
            except Exception as exc:
                self.store.transition(job.id, JobState.RUNNING, "preparing attempt")
                self._fail(job.id, f"cannot plan the resume: {exc}")
                return None
            if plan is not None:
                if plan.mode == "refuse":
                    self.store.transition(job.id, JobState.RUNNING, "preparing attempt")
                    self._fail(job.id, plan.reason)
                    return None
                resume_yaml = dict(plan.yaml)
                if plan.checkpoint is not None:
                    resumed_from, resumed_step = str(plan.checkpoint.path), plan.checkpoint.step

        try:
            rendered = render_attempt(spec, overrides, attempt_dir=paths.root, resume_yaml=resume_yaml,
                                      launcher=self.launcher_for(spec))
            if plan is not None and plan.deepspeed:
                _merge_ds(rendered.files, plan.deepspeed)
        except Exception as exc:
            self.store.transition(job.id, JobState.RUNNING, "preparing attempt")
            self._fail(job.id, f"cannot render attempt {number}: {exc}")
            return None
        for name, content in rendered.files.items():
            atomic_write_text(paths.root / name, content)
        if spec.kind == "llamafactory":
            problems = self._validate_rendered(paths.root / "effective.yaml", spec)
            if problems:
                self.store.transition(job.id, JobState.RUNNING, "preparing attempt")
                self._fail(job.id, "the rendered configuration is invalid: " + "; ".join(map(str, problems)))
                return None

        env = self._environment(spec, rendered.env)
        atomic_write_json(paths.environment, {"argv": rendered.argv, "cwd": str(spec.workdir),
                                              "env": env, "set_by_attempt": rendered.env}, mode=0o600)

        rlimits, cgroup, mechanism = self._limits(spec, job.id, number)
        progress_offset = _size(output_dir / "trainer_log.jsonl") if output_dir else None
        remedy = _remedy_text(overrides)
        with self.store.tx():
            current = self.store.job(job.id)
            if current is None or current.state not in (JobState.QUEUED, JobState.INTERRUPTED,
                                                        JobState.WAITING_RETRY):
                # Cancelled (or otherwise moved) by the CLI while we prepared: launch nothing.
                if cgroup is not None:
                    cgroup.remove(timeout_s=0.1)
                self._event(job.id, "attempt_abandoned",
                            f"attempt {number} was prepared but not launched: the job is now "
                            f"{current.state if current else 'gone'}", attempt=number)
                return None
            self.store.add_attempt(job.id, number, overrides=json.dumps(overrides.to_dict()),
                                   remedy=remedy, resumed_from=resumed_from,
                                   resumed_from_step=resumed_step)
            self.store.transition(job.id, JobState.RUNNING,
                                  f"attempt {number} started" + (f" (remedy: {remedy})" if overrides.rungs else "")
                                  + (f", resuming from {resumed_from}" if resumed_from else ""),
                                  not_before=None, cancel_requested=0)
        try:
            handle = proctree.launch(paths, argv=rendered.argv, cwd=spec.workdir, env=env,
                                     rlimits=rlimits, cgroup=cgroup)
        except Exception as exc:
            if cgroup is not None:
                cgroup.remove(timeout_s=0.1)
            self.store.update_attempt(job.id, number, ended_at=self.clock(),
                                      exit=json.dumps({"returncode": None, "error": str(exc)}))
            self._fail(job.id, f"could not launch: {exc}")
            return None
        self.store.update_attempt(job.id, number, pid=handle.pid, pid_create_time=handle.create_time)
        changes = [c.to_dict() for c in rendered.changes]
        self._event(job.id, "attempt_started", f"attempt {number}: {' '.join(rendered.argv)}", attempt=number,
                    pid=handle.pid, changes=changes, memory_limit=spec.sup.host_memory_limit,
                    limit_mechanism=mechanism)
        return Active(job_id=job.id, number=number, paths=paths, handle=handle,
                      scanner=LogScanner(initial_step=resumed_step),
                      spec=spec, gpus=spec.sup.gpus, output_dir=output_dir,
                      hang_timeout=spec.sup.hang_timeout or self.cfg.hang_timeout,
                      last_step=resumed_step, progress_offset=progress_offset)

    def _plan_resume(self, job: JobRow, spec, overrides: Overrides, output_dir: Path | None, number: int):
        if output_dir is None:
            return None
        from .checkpoints import apply_fixups, plan_resume, quarantine, run_shape, scan_output_dir

        scan = scan_output_dir(output_dir, expected_world_size=spec.world_size)
        for inc in scan.incomplete:
            moved = quarantine(inc)
            self._event(job.id, "checkpoint_quarantined",
                        f"{inc.path.name} is incomplete ({inc.reason}); moved aside to {moved}",
                        attempt=number, path=str(moved))
        ckpt = scan.latest
        prev_attempt = self.store.last_attempt(job.id)
        prev_over = Overrides.from_dict(prev_attempt.json("overrides")) if prev_attempt else None
        nxt = run_shape({**spec.config, **overrides.yaml}, world_size=spec.world_size,
                        deepspeed_cfg=_ds_of(spec, overrides))
        prev = (run_shape({**spec.config, **prev_over.yaml}, world_size=spec.world_size,
                          deepspeed_cfg=_ds_of(spec, prev_over)) if prev_over is not None else None)
        versions = self._versions_for(spec)
        policy = self._policy(spec, job)
        plan = plan_resume(ckpt, prev=prev, nxt=nxt, transformers_version=versions.get("transformers"),
                           allow_weights_only=policy.allow_weights_only,
                           allow_universal=policy.allow_universal_checkpoint,
                           archive_name=f"attempt-{number}")
        if plan.checkpoint is not None or plan.mode != "fresh":
            for done in apply_fixups(plan, python=self._job_python(spec)):
                self._event(job.id, "resume_fixup", done, attempt=number)
            self._event(job.id, "resume_plan", plan.reason, attempt=number, mode=plan.mode,
                        semantic_change=plan.semantic_change)
        if plan.semantic_change:
            self._event(job.id, "semantic_change", f"TRAINING SEMANTICS CHANGE: {plan.semantic_change}",
                        attempt=number)
        return plan

    def _job_python(self, spec) -> str | None:
        import shutil

        exe = shutil.which(self.launcher_for(spec)[0])
        cand = Path(exe).parent / "python" if exe else None
        return str(cand) if cand and cand.exists() else None

    def _validate_rendered(self, path: Path, spec) -> list:
        import yaml

        from .llamafactory.validate import validate_config

        cfg = yaml.safe_load(path.read_text())
        return validate_config(cfg, workdir=spec.workdir)

    def _environment(self, spec: jobspec_mod.JobSpec, attempt_env: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_DROP_PREFIXES)}
        env.update(self.cfg.env)
        env.update(spec.sup.env)
        if spec.sup.gpus is not None:
            ids = ",".join(str(g) for g in spec.sup.gpus)
            for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
                env[name] = ids
        env.update(attempt_env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _limits(self, spec, job_id: int, number: int):
        limit = spec.sup.host_memory_limit
        if not limit:
            return None, None, None
        if self.cgroup_support is not None:
            try:
                cg = JobCgroup.create(self.cgroup_support, self._cgroup_name(job_id, number), limit)
                return None, cg, cg.mechanism
            except OSError as exc:
                log.warning("cgroup_create_failed", job=job_id, error=str(exc))
        return rlimits_for(limit), None, "rlimit-data"

    def _cgroup_name(self, job_id: int, number: int) -> str:
        """Unique per state folder: two daemons on one box must never share a job's cgroup."""
        import hashlib

        tag = hashlib.sha256(str(self.cfg.state.root).encode()).hexdigest()[:8]
        return f"job-{job_id}-attempt-{number}-{tag}"

    def _versions_for(self, spec) -> dict[str, str | None]:
        """transformers/torch versions of the environment the job runs in (not ours)."""
        launcher = self.launcher_for(spec)
        key = launcher[0]
        if key in self._versions:
            return self._versions[key]
        import shutil
        import subprocess

        found: dict[str, str | None] = {"transformers": None, "torch": None}
        exe = shutil.which(key) or key
        python = Path(exe).parent / "python"
        probe = ("import importlib.metadata as m, json\nout={}\nfor n in ('transformers','torch'):\n"
                 "    try: out[n]=m.version(n)\n    except Exception: out[n]=None\nprint(json.dumps(out))")
        if python.exists():
            try:
                res = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=30)
                found.update(json.loads(res.stdout.strip().splitlines()[-1]))
            except Exception:
                pass
        self._versions[key] = found
        return found

    def _policy(self, spec, job: JobRow):
        from .policy import load_policy

        return load_policy(spec.sup.policy or job.policy or self.cfg.default_policy,
                           search_dirs=self.cfg.policy_search_dirs())

    # --- follow -------------------------------------------------------------------------------
    def poll(self, act: Active) -> bool:
        """Advance one attempt; True when its process tree is gone."""
        self._read_log(act)
        if act.fatal and act.stopped_by is None and act.spec.sup.stop_on_fatal_line:
            act.stopped_by = "fatal_signal"
            act.detected_at = self.clock()
            ev = act.fatal[0]
            self._event(act.job_id, "fatal_detected",
                        f"line {ev.line_no}: {ev.text[:300]} -> stopping the attempt now", attempt=act.number,
                        rule=ev.rule)
            act.teardown_s = proctree.terminate(act.handle, grace_s=self.cfg.fatal_grace)
        now = time.monotonic()
        if now >= act.next_sample_mono:  # the log may wake us 50 times a second: sample less often
            act.next_sample_mono = now + 0.5
            self._sample(act)
            if act.last_step is not None and act.last_step != act.published_step:
                act.published_step = act.last_step  # so `status` shows progress while it runs
                self.store.update_attempt(act.job_id, act.number, max_step=act.last_step,
                                          total_steps=act.scanner.total_steps)
        if (act.stopped_by is None and act.hang_timeout and now - act.last_output_mono > act.hang_timeout):
            act.stopped_by = "hang"
            act.detected_at = self.clock()
            self._event(act.job_id, "hang_detected",
                        f"no output and no step advance for {act.hang_timeout:.0f}s (last step "
                        f"{act.last_step}); stopping the attempt", attempt=act.number)
            proctree.terminate(act.handle, grace_s=self.cfg.stop_grace)
        act.handle.reap()
        if act.handle.alive():
            return False
        if self._kill_orphans(act):
            return False  # the shim died before its job (killed from outside): not over yet
        self._read_log(act)
        return True

    def _kill_orphans(self, act: Active) -> bool:
        """Processes of this attempt that outlived its shim (reparented to init). True while any live."""
        left = []
        for pid, ctime in act.known.items():
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - ctime) < 0.05 and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.Error:
                pass
        if act.handle.cgroup is not None:
            left += [psutil.Process(pid) for pid in act.handle.cgroup.pids() if psutil.pid_exists(pid)]
        if not left:
            return False
        if act.stopped_by is None:
            act.stopped_by = "orphaned"
            self._event(act.job_id, "orphans_stopped",
                        f"the attempt's shim is gone but {len(left)} of its processes still run "
                        f"(pids {sorted(p.pid for p in left)[:8]}); stopping them before anything else "
                        "may use their GPUs", attempt=act.number)
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        return True

    def _read_log(self, act: Active) -> None:
        try:
            with open(act.paths.log, "rb") as f:
                f.seek(act.offset)
                while True:
                    chunk = f.read(READ_CHUNK)
                    if not chunk:
                        break
                    act.offset += len(chunk)
                    act.last_output_mono = time.monotonic()
                    act.fatal.extend(act.scanner.feed(chunk))
        except FileNotFoundError:
            return
        step = act.scanner.last_step
        if step is not None and (act.last_step is None or step > act.last_step):
            act.last_step = step

    def _sample(self, act: Active) -> None:
        try:
            for p in act.handle.processes():
                act.known.setdefault(p.pid, p.create_time())
            rss = act.handle.rss_bytes()
            avail = psutil.virtual_memory().available
        except Exception:
            return
        act.peak_rss = max(act.peak_rss, rss)
        act.min_available = avail if act.min_available is None else min(act.min_available, avail)

    def internal_failure(self, job_id: int, what: str) -> None:
        """Our own error while handling a job: fail it loudly so `retry` can take it again,
        rather than leave it `running` with nobody following it."""
        job = self.store.job(job_id)
        if job is None:
            return
        msg = (f"internal error while trying to {what}; `oom-supervisor retry {job_id}` resumes it "
               "from its last complete checkpoint")
        self.store.event(job_id, "internal_error", msg)
        if job.state in (JobState.QUEUED, JobState.INTERRUPTED):
            job = self.store.transition(job_id, JobState.RUNNING, "preparing an attempt")
        if job.state in (JobState.RUNNING, JobState.WAITING_RETRY):
            self._fail(job_id, msg)

    def stop(self, act: Active, reason: str, grace_s: float) -> None:
        if act.stopped_by is None:
            act.stopped_by = reason
            act.detected_at = self.clock()
        proctree.terminate(act.handle, grace_s=grace_s)

    # --- verdict ----------------------------------------------------------------------------------
    def finish(self, act: Active) -> None:
        raw = proctree.read_exit(act.paths) or {}
        exit_rec = ExitRecord(returncode=raw.get("returncode"), signal=raw.get("signal"),
                              duration_s=raw.get("duration_s"), stopped_by=act.stopped_by)
        host = self._host_evidence(act, raw)
        if act.handle.cgroup is not None:
            act.handle.cgroup.remove()
        diagnosis = act.scanner.finish(exit_rec, host)
        atomic_write_json(act.paths.diagnosis, diagnosis.to_dict())
        progress = self._progress(act)
        fields: dict[str, Any] = dict(
            ended_at=raw.get("ended_at") or self.clock(), exit=json.dumps(exit_rec.to_dict()),
            diagnosis=json.dumps(diagnosis.to_dict()), detected_at=act.detected_at,
            peak_rss_bytes=host.peak_rss_bytes, **progress)
        self.store.update_attempt(act.job_id, act.number, **fields)
        self._event(act.job_id, "attempt_ended",
                    f"attempt {act.number} ended: {_exit_words(exit_rec)}; diagnosis {diagnosis.category}"
                    + (f"/{diagnosis.subkind}" if diagnosis.subkind else "") + f": {diagnosis.summary}",
                    attempt=act.number, teardown_s=act.teardown_s)

        job_now = self.store.job(act.job_id)
        if act.stopped_by == "cancel" or (job_now is not None and job_now.cancel_requested):
            self.store.update_attempt(act.job_id, act.number, decision=json.dumps({"kind": "cancelled"}))
            self.store.transition(act.job_id, JobState.CANCELLED, "cancelled by the user")
            self.notifier.send(self._job_event(act.job_id, "cancelled", "cancelled by the user"))
            return
        if act.stopped_by == "shutdown":
            self.store.update_attempt(act.job_id, act.number, interrupted=1,
                                      decision=json.dumps({"kind": "interrupted"}))
            self.store.transition(act.job_id, JobState.INTERRUPTED,
                                  "the supervisor stopped; resumes from the last complete checkpoint")
            return
        self.decide_and_apply(act.job_id, act.number, diagnosis)

    def _progress(self, act: Active) -> dict[str, Any]:
        out: dict[str, Any] = {"max_step": act.last_step}
        if act.output_dir is None:
            return out
        try:
            from .checkpoints import scan_output_dir
            from .progress import read_progress

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
        except Exception:
            log.exception("progress_read_failed", job=act.job_id)
        return out

    def _host_evidence(self, act: Active, raw: dict) -> HostEvidence:
        cg = act.handle.cgroup
        pids = {p for p in (raw.get("pid"),) if p}
        peak = act.peak_rss
        kills = None
        if cg is not None:
            kills = cg.oom_kills()
            peak = max(peak, cg.peak_bytes() or 0)
        kernel = ()
        if raw.get("signal") == "SIGKILL" or raw.get("returncode") in (137, -9) or kills:
            kernel = kernel_oom_lines(pids, since_s=raw.get("started_at") or 0)
        mechanism = cg.mechanism if cg else ("rlimit-data" if act.spec.sup.host_memory_limit else None)
        return HostEvidence(cgroup_oom_kills=kills, kernel_oom_lines=kernel,
                            min_available_bytes=act.min_available, peak_rss_bytes=peak or None,
                            memory_limit_bytes=act.spec.sup.host_memory_limit, limit_mechanism=mechanism)

    def decide_and_apply(self, job_id: int, number: int, diagnosis: Diagnosis) -> Decision:
        from .policy import decide

        job = self.store.job(job_id)
        spec = self.spec_of(job_id)
        if diagnosis.category == Category.SUCCESS:
            decision = Decision(DecisionKind.DONE, "the training command exited 0")
        else:
            try:
                policy = self._policy(spec, job)
                decision = decide(self._context(job, spec), self._history(job_id), diagnosis, policy)
            except Exception as exc:
                log.exception("decide_failed", job=job_id)
                decision = Decision(DecisionKind.FAIL, f"the policy could not decide: {exc!r}")
        self.store.update_attempt(job_id, number, decision=json.dumps(decision.to_dict()))
        now = self.clock()
        if decision.kind == DecisionKind.DONE:
            self.store.transition(job_id, JobState.SUCCEEDED, decision.reason)
            self.notifier.send(self._job_event(job_id, "succeeded", decision.reason))
        elif decision.kind == DecisionKind.FAIL:
            self._fail(job_id, decision.reason)
        elif decision.kind == DecisionKind.RETRY:
            self.store.transition(job_id, JobState.WAITING_RETRY,
                                  f"retry the same configuration in {decision.delay_s:.0f}s: {decision.reason}",
                                  not_before=now + decision.delay_s)
        elif decision.kind == DecisionKind.ESCALATE:
            over = decision.overrides or Overrides()
            changes = "; ".join(f"{c.key}: {c.old!r} -> {c.new!r} ({c.why})" for c in decision.changes)
            self.store.transition(job_id, JobState.WAITING_RETRY,
                                  f"escalate to {decision.rung}: {decision.reason}" + (f" [{changes}]" if changes else ""),
                                  not_before=now + decision.delay_s, next_overrides=json.dumps(over.to_dict()))
            self.notifier.send(self._job_event(job_id, "escalated", f"{decision.rung}: {decision.reason}",
                                               changes=[c.to_dict() for c in decision.changes]))
        elif decision.kind == DecisionKind.PAUSE:
            self.store.transition(job_id, JobState.WAITING_RETRY, f"queue paused: {decision.reason}",
                                  not_before=now + decision.delay_s)
            self.store.set_meta("queue_paused", f"job {job_id}: {decision.reason}")
            self.store.event(job_id, "queue_paused", decision.reason)
            self.notifier.send(self._job_event(job_id, "paused", decision.reason))
        return decision

    def _fail(self, job_id: int, reason: str) -> None:
        self.store.transition(job_id, JobState.FAILED, reason)
        self.notifier.send(self._job_event(job_id, "failed", reason))

    def _job_event(self, job_id: int, kind: str, message: str, **extra: Any) -> dict[str, Any]:
        job = self.store.job(job_id)
        spec_notify = []
        try:
            spec_notify = self.spec_of(job_id).sup.notify
        except Exception:
            pass
        return {"event": kind, "job": job_id, "name": job.name if job else None, "message": message,
                "attempts": len(self.store.attempts(job_id)), "ts": self.clock(),
                "_job_notify": spec_notify, **extra}

    def _context(self, job: JobRow, spec) -> JobContext:
        """What the pure policy may know, gathered here at the edge."""
        shape_fields: dict[str, Any] = {}
        model = spec.config.get("model_name_or_path")
        if model:
            from .policy.estimate import context_fields, read_model_shape

            local = spec.resolve(str(model))
            shape_fields = context_fields(read_model_shape(local)) if local.exists() else {}
        versions = self._versions_for(spec) if spec.kind == "llamafactory" else {}
        if self._gpu_caps is None:
            from .gpus import probe_capacities

            self._gpu_caps = probe_capacities()
        from .gpus import capacity_for

        return JobContext(
            id=job.id, name=job.name, kind=spec.kind, config=dict(spec.config), world_size=spec.world_size,
            max_attempts=spec.sup.max_attempts or 8, host_ram_bytes=psutil.virtual_memory().total,
            gpu_capacity_bytes=capacity_for(self._gpu_caps, spec.sup.gpus),
            torch_version=versions.get("torch"), transformers_version=versions.get("transformers"),
            uses_vllm=str(spec.config.get("infer_backend", "")).lower() == "vllm",
            deepspeed_config=_ds_of(spec, Overrides()), **shape_fields)

    def _history(self, job_id: int) -> list[AttemptRecord]:
        out = []
        for a in self.store.attempts(job_id):
            if a.interrupted or a.ended_at is None:
                continue
            d = a.json("diagnosis")
            e = a.json("exit")
            dec = a.json("decision")
            out.append(AttemptRecord(
                number=a.number, overrides=Overrides.from_dict(a.json("overrides")),
                diagnosis=Diagnosis.from_dict(d) if d else None,
                exit=ExitRecord.from_dict(e) if e else None, resumed_from_step=a.resumed_from_step,
                max_step=a.max_step, checkpoint_step_after=a.checkpoint_step_after,
                decision=dec.get("kind") if dec else None))
        return out

    # --- crash recovery -------------------------------------------------------------------------------
    def recover(self, job: JobRow, adopt: bool) -> Active | None:
        attempt = self.store.last_attempt(job.id)
        if attempt is None:
            self.store.transition(job.id, JobState.INTERRUPTED, "daemon restarted before the attempt started")
            return None
        paths = self.cfg.state.job(job.id).attempt(attempt.number)
        handle = None
        if attempt.pid:
            handle = proctree.Handle(attempt.pid, attempt.pid_create_time or 0.0)
            if handle.shim() is None:
                handle = None
        if handle is None and attempt.ended_at is None:
            p = proctree.find_shim_by_launch_file(paths.launch)
            if p is not None:
                handle = proctree.Handle(p.pid, p.create_time())
        spec = self.spec_of(job.id)
        cg = None
        if self.cgroup_support is not None and spec.sup.host_memory_limit:
            path = self.cgroup_support.parent / self._cgroup_name(job.id, attempt.number)
            if path.exists():
                cg = JobCgroup(path, self.cgroup_support.version)
        output_dir = spec.resolve(spec.config["output_dir"]) if spec.config.get("output_dir") else None
        if handle is not None:
            handle.cgroup = cg
            act = Active(job_id=job.id, number=attempt.number, paths=paths, handle=handle,
                         scanner=LogScanner(initial_step=attempt.resumed_from_step),
                         spec=spec, gpus=spec.sup.gpus, output_dir=output_dir,
                         hang_timeout=spec.sup.hang_timeout or self.cfg.hang_timeout,
                         last_step=attempt.resumed_from_step)
            if adopt:
                self._event(job.id, "attempt_adopted",
                            f"daemon restarted; attempt {attempt.number} (pid {handle.pid}) is still running: "
                            "following it again", attempt=attempt.number)
                return act
            self._event(job.id, "attempt_stopped_on_restart",
                        f"daemon restarted; stopping attempt {attempt.number} (pid {handle.pid}) "
                        "before a new one starts", attempt=attempt.number)
            self.stop(act, reason="shutdown", grace_s=self.cfg.stop_grace)
            self.finish(act)
            return None
        raw = proctree.read_exit(paths)
        if raw is not None:
            # It ended while we were down: judge it from what it left.
            act = Active(job_id=job.id, number=attempt.number, paths=paths,
                         handle=proctree.Handle(attempt.pid or 0, 0.0, cgroup=cg),
                         scanner=LogScanner(initial_step=attempt.resumed_from_step),
                         spec=spec, gpus=spec.sup.gpus, output_dir=output_dir,
                         hang_timeout=0, last_step=attempt.resumed_from_step)
            self._read_log(act)
            self._event(job.id, "attempt_ended_while_down",
                        f"attempt {attempt.number} ended while the daemon was down; judging it from its "
                        "exit record and log", attempt=attempt.number)
            self.finish(act)
            return None
        self.store.update_attempt(job.id, attempt.number, ended_at=self.clock(), interrupted=1,
                                  decision=json.dumps({"kind": "interrupted"}))
        self.store.transition(job.id, JobState.INTERRUPTED,
                              f"attempt {attempt.number} vanished with the daemon (no exit record); "
                              "resumes from the last complete checkpoint")
        if cg is not None:
            cg.remove(timeout_s=0.1)
        return None


def _ds_of(spec, overrides: Overrides) -> dict | None:
    if overrides.deepspeed is not None:
        return dict(overrides.deepspeed)
    ds = spec.config.get("deepspeed")
    if isinstance(ds, dict):
        return ds
    if isinstance(ds, str):
        text = ds.strip()
        if text.startswith("{"):
            try:
                return json.loads(text)
            except ValueError:
                return None
        return read_json(spec.resolve(text))
    return None


def _merge_ds(files: dict[str, str], keys: dict[str, Any]) -> None:
    """Resume needs DeepSpeed keys (e.g. load_universal) in the attempt's generated JSON."""
    if "ds_config.json" not in files:
        raise RuntimeError("the resume needs DeepSpeed settings "
                           f"{sorted(keys)} but this attempt has no generated DeepSpeed config")
    cfg = json.loads(files["ds_config.json"])
    for k, v in keys.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    files["ds_config.json"] = json.dumps(cfg, indent=2) + "\n"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _remedy_text(overrides: Overrides) -> str | None:
    """'micro_batch x2 (per_device_train_batch_size=4, gradient_accumulation_steps=4)'."""
    if not overrides.rungs:
        return None
    names: list[str] = []
    for r in overrides.rungs:
        if r not in names:
            names.append(r)
    counted = [f"{n} x{overrides.rungs.count(n)}" if overrides.rungs.count(n) > 1 else n for n in names]
    settings = [f"{k}={v}" for k, v in overrides.yaml.items()]
    if overrides.deepspeed is not None:
        settings.append("deepspeed=generated ZeRO-3 config")
    settings += [f"{k}={v}" for k, v in overrides.env.items() if k.endswith("ALLOC_CONF")][:1]
    return " + ".join(counted) + (f" ({', '.join(settings)})" if settings else "")


def _exit_words(e: ExitRecord) -> str:
    if e.returncode is None:
        return "exit status unknown"
    if e.signal:
        return f"killed by {e.signal}" + (f" (stopped by the supervisor: {e.stopped_by})" if e.stopped_by else "")
    return f"exit code {e.returncode}" + (f" (stopped by the supervisor: {e.stopped_by})" if e.stopped_by else "")
