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
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from supervisor.core.models import (
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
from supervisor.core.paths import AttemptPaths
from supervisor.core.states import JobState
from supervisor.daemon.config import DaemonConfig
from supervisor.intake import jobspec as jobspec_mod
from supervisor.intake.llamafactory.launch import VISIBILITY_VARS
from supervisor.judge.diagnosis import LogScanner
from supervisor.record.store import JobRow, Store
from supervisor.run import proctree
from supervisor.run.diskfull import free_bytes, is_disk_full
from supervisor.run.fsutil import atomic_write_json, atomic_write_text, read_json
from supervisor.run.gpus import VramSampler, detect_vendor, visibility_env
from supervisor.run.limits import (
    CgroupSupport,
    JobCgroup,
    detect_cgroup,
    kernel_oom_lines,
    rlimits_for,
)
from supervisor.run.logfollow import LogFollower
from supervisor.run.ownership import MARKER_ENV, Owner, detect_owner_support
from supervisor.run.slurm_handle import SlurmHandle
from supervisor.service.logsetup import log
from supervisor.service.notify import Notifier

# Per poll and job: one job's output never holds the loop for long (the rest waits a tick).
READ_BUDGET_BYTES = 8 << 20
READ_BUDGET_S = 0.05
TAIL_KEEP_BYTES = 32 << 20  # of a backlog left when an attempt is over, the part that is read
STUCK_AFTER_S = 10.0
SLURM_KILL_AFTER_S = 60.0  # after a hard scancel, SIGKILL at once if the job still is not gone
ENV_DROP_PREFIXES = ("OOM_SUPERVISOR_",)
RUNNABLE = (JobState.QUEUED, JobState.INTERRUPTED, JobState.WAITING_RETRY)


@dataclass
class Active:
    """A running attempt as the daemon follows it (memory only; the record is in SQLite).

    Nothing here decides that the attempt is over: only `Handle.over()` (the
    shim and every member of the attempt's owner gone) does.
    """

    job_id: int
    number: int
    paths: AttemptPaths
    handle: proctree.Handle
    scanner: LogScanner
    spec: jobspec_mod.JobSpec
    gpus: list[int] | None
    output_dir: Path | None
    hang_timeout: float
    log: LogFollower = None  # type: ignore[assignment]
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
    published_step: int | None = None
    # Stopping without blocking the loop: SIGTERM sent at stop_sent_mono, SIGKILL at stop_deadline.
    stop_sent_mono: float | None = None
    stop_sent_wall: float | None = None
    stop_deadline: float | None = None
    kill_sent: bool = False
    interrupt_cause: str = "shutdown"
    launch_failure: str | None = None
    vram: VramSampler | None = None
    stuck_reported: bool = False
    broken: str | None = None  # our own error while following it: stop it, then record
    limit_killed: bool = False  # stopped for going over host_memory_limit (sampled, no cgroup)

    def __post_init__(self) -> None:
        if self.log is None:
            self.log = LogFollower(self.paths.log)

    @property
    def offset(self) -> int:
        return self.log.offset


class Runner:
    def __init__(self, cfg: DaemonConfig, store: Store, notifier: Notifier, *, clock=time.time) -> None:
        self.cfg = cfg
        self.store = store
        self.notifier = notifier
        self.clock = clock
        self.cgroup_support = detect_cgroup() if cfg.cgroups == "auto" else None
        self.owner_support = (detect_owner_support(self._state_tag()) if cfg.cgroups == "auto" else None)
        self._outbox: list[dict[str, Any]] = []
        self.gpu_vendor = detect_vendor() if cfg.gpu_vendor == "auto" else cfg.gpu_vendor
        self.slurm = cfg.backend == "slurm"
        if self.slurm:
            self.owner_support = None  # Slurm's job cgroup owns the processes
            self.cgroup_support = None
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

    def launcher_for(self, spec: jobspec_mod.JobSpec) -> list[str]:
        return list(spec.sup.launcher or self.cfg.launcher)

    def _event(self, job_id: int, kind: str, message: str, attempt: int | None = None, **data: Any) -> None:
        self.store.event(job_id, kind, message, attempt=attempt, data=data or None)
        log.info(kind, job=job_id, attempt=attempt, message=message, **{k: v for k, v in data.items()
                                                                        if k not in ("message",)})

    # --- start --------------------------------------------------------------------------
    def start(self, job: JobRow, gpus: list[int] | None = None) -> Active | None:
        """Prepare and launch the next attempt on `gpus` (the daemon's assignment; None: the
        whole box), or settle the job if it must not run."""
        from supervisor.judge.policy import render_attempt

        job = self.store.job(job.id) or job
        if job.cancel_requested or job.state not in RUNNABLE:
            return self._abandon_before_prepare(job)
        if self._crash_interruptions(job.id) >= self.cfg.max_interruptions:
            self.store.transition(job.id, JobState.RUNNING, "preparing attempt")
            self._fail(job.id, f"the supervisor was restarted {self.cfg.max_interruptions} times while this "
                               "job's attempts ran (it may be crashing the supervisor or the box); not "
                               f"starting it again on its own: `oom-supervisor retry {job.id}` does")
            return None
        try:
            spec = self.spec_of(job.id)
        except Exception as exc:
            self.store.transition(job.id, JobState.RUNNING, "preparing attempt")
            self._fail(job.id, f"job file no longer valid: {exc}")
            return None
        last = self.store.last_attempt(job.id)
        number = (last.number if last else 0) + 1
        paths = self.cfg.state.job(job.id).attempt(number)
        if paths.root.exists():
            # No attempt row names it, so it was prepared and never launched (the row is committed
            # before the launch): nothing of it ran, and it is rendered again from the record.
            shutil.rmtree(paths.root)
        paths.root.mkdir(parents=True, mode=0o700)
        overrides = Overrides.from_dict(json.loads(job.next_overrides) if job.next_overrides else None)
        learned = None
        if number == 1 and not job.next_overrides and spec.kind == "llamafactory":
            refused, overrides, learned = self._learned_start(job, spec)
            if refused:
                self.refuse(job, refused)
                return None

        resume_yaml: dict[str, Any] = {}
        resumed_from = resumed_step = None
        output_dir = plan = None
        if spec.kind == "llamafactory":
            output_dir = spec.resolve(spec.config["output_dir"]) if spec.config.get("output_dir") else None
            try:
                plan = self._plan_resume(job, spec, overrides, output_dir, number)
            except Exception as exc:
                if is_disk_full(exc):
                    raise
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
            rendered = render_attempt(spec, self._with_policy_switches(spec, job, overrides),
                                      attempt_dir=paths.root, resume_yaml=resume_yaml,
                                      launcher=self.launcher_for(spec))
            if plan is not None and plan.deepspeed:
                _merge_ds(rendered.files, plan.deepspeed)
        except Exception as exc:
            self.store.transition(job.id, JobState.RUNNING, "preparing attempt")
            self._fail(job.id, f"cannot render attempt {number}: {exc}")
            return None
        if spec.kind == "llamafactory":
            from supervisor.judge.policy import check_rendered

            mismatched = check_rendered(rendered, user_deepspeed=_ds_of(spec, Overrides()),
                                        world_size=self.launched_world_size(spec))
            if mismatched:
                self.store.transition(job.id, JobState.RUNNING, "preparing attempt")
                self._fail(job.id, f"attempt {number} would launch a YAML and a DeepSpeed JSON that "
                                   "transformers refuses together: " + "; ".join(map(str, mismatched)))
                return None
        for name, content in rendered.files.items():
            atomic_write_text(paths.root / name, content, mode=0o600)
        if spec.kind == "llamafactory":
            problems = self._validate_rendered(paths.root / "effective.yaml", spec)
            if problems:
                self.store.transition(job.id, JobState.RUNNING, "preparing attempt")
                self._fail(job.id, "the rendered configuration is invalid: " + "; ".join(map(str, problems)))
                return None

        tag = self.attempt_tag(job.id, number)
        env = self._environment(spec, rendered.env, gpus)
        env[MARKER_ENV] = tag
        env["OOM_SUPERVISOR_PEAK_FILE"] = str(paths.root / "gpu_peak.json")  # the hook's in-process peaks
        atomic_write_json(paths.environment, {"argv": rendered.argv, "cwd": str(spec.workdir),
                                              "env": env, "set_by_attempt": rendered.env}, mode=0o600)

        owner = Owner.for_attempt(self.owner_support, tag, paths.root / "procs.json", create=True)
        rlimits, cgroup, mechanism = self._limits(spec, job.id, number, owner)
        progress_offset = _size(output_dir / "trainer_log.jsonl") if output_dir else None
        remedy = _remedy_text(overrides)
        with self.store.tx():
            current = self.store.job(job.id)
            if current is None or current.state not in RUNNABLE or current.cancel_requested:
                # Cancelled (or otherwise moved) by the CLI while we prepared: launch nothing.
                owner.remove()
                if cgroup is not None and cgroup.path != owner.cgroup:
                    cgroup.remove(timeout_s=0.1)
                self._event(job.id, "attempt_abandoned",
                            f"attempt {number} was prepared but not launched: the job is now "
                            f"{current.state if current else 'gone'}"
                            + (" with a cancel requested" if current and current.cancel_requested else ""),
                            attempt=number)
                if current is not None and current.cancel_requested and current.state in RUNNABLE:
                    self.store.transition(job.id, JobState.CANCELLED, "cancelled by the user")
                    self._notify(job.id, "cancelled", "cancelled by the user")
                return None
            self.store.add_attempt(job.id, number, overrides=json.dumps(overrides.to_dict()),
                                   remedy=remedy, resumed_from=resumed_from,
                                   resumed_from_step=resumed_step,
                                   gpus=json.dumps(gpus) if gpus is not None else None)
            self.store.transition(job.id, JobState.RUNNING,
                                  f"attempt {number} started" + (f" (remedy: {remedy})" if overrides.rungs else "")
                                  + (f", resuming from {resumed_from}" if resumed_from else "")
                                  + (f"; {learned}" if learned else ""),
                                  not_before=None)
            if learned:
                self._event(job.id, "learned_plan", learned, attempt=number, overrides=overrides.to_dict())
        act_args = dict(job_id=job.id, number=number, paths=paths, scanner=LogScanner(initial_step=resumed_step),
                        spec=spec, gpus=gpus, output_dir=output_dir,
                        hang_timeout=spec.sup.hang_timeout or self.cfg.hang_timeout,
                        last_step=resumed_step, progress_offset=progress_offset)
        if self.store.job(job.id).cancel_requested:
            # The cancel landed right after the start was committed: run nothing, settle it now.
            self.store.update_attempt(job.id, number, ended_at=self.clock(),
                                      decision=json.dumps({"kind": "cancelled"}))
            self.store.transition(job.id, JobState.CANCELLED, "cancelled by the user before the attempt launched")
            owner.remove()
            self._notify(job.id, "cancelled", "cancelled by the user")
            return None
        try:
            if self.slurm:
                handle = self._submit_slurm(job, number, paths, rendered.argv, spec, env, tag)
            else:
                handle = proctree.launch(paths, argv=rendered.argv, cwd=spec.workdir, env=env,
                                         rlimits=rlimits, cgroup=cgroup, owner=owner,
                                         max_log_bytes=self.cfg.max_log_bytes)
        except Exception as exc:
            # The attempt is recorded as started: follow it through the usual path (its owner is
            # checked empty there) so that its end is recorded even on a full disk.
            log.error("launch_failed", job=job.id, attempt=number, error=str(exc))
            act = Active(handle=proctree.Handle(0, 0.0, cgroup=cgroup, owner=owner), **act_args)
            act.launch_failure = f"could not launch: {exc}"
            if is_disk_full(exc):
                act.stopped_by = "vanished"  # nothing ran; it is resumed once there is room
            return act
        if isinstance(handle, SlurmHandle):
            self.store.update_attempt(job.id, number, backend_ref=json.dumps({"slurm": handle.record}))
        else:
            self.store.update_attempt(job.id, number, pid=handle.pid, pid_create_time=handle.create_time)
        changes = [c.to_dict() for c in rendered.changes]
        self._event(job.id, "attempt_started", f"attempt {number}: {' '.join(rendered.argv)}", attempt=number,
                    pid=handle.pid, changes=changes, memory_limit=spec.sup.host_memory_limit,
                    limit_mechanism=mechanism, ownership=owner.mechanism)
        act = Active(handle=handle, **act_args)
        if not self.slurm:
            act.vram = VramSampler(gpus, pids=lambda: [p.pid for p in handle.processes()]).start()
        return act

    def _submit_slurm(self, job: JobRow, number: int, paths: AttemptPaths, argv: list[str], spec,
                      env: dict[str, str], tag: str) -> SlurmHandle:
        """One attempt = one sbatch job running the launch shim (exit.json, SIGTERM to every worker)."""
        from supervisor.run import slurm

        proctree.write_launch(paths, argv=argv, cwd=spec.workdir, env=env,
                              max_log_bytes=self.cfg.max_log_bytes)
        request = spec.sup.slurm_request or slurm.SlurmJobRequest()
        if request.mem is None and spec.sup.host_memory_limit:
            request = request.model_copy(update={"mem": spec.sup.host_memory_limit})
        sub = slurm.submit(paths.root, paths.log, [sys.executable, "-m", "supervisor.run.shim", str(paths.launch)],
                           spec.workdir, {**env, "PYTHONPATH": proctree.package_root()},
                           settings=self.cfg.slurm_settings, request=request, job_name=f"oomsv-{tag}")
        self._event(job.id, "slurm_submitted", f"attempt {number} is Slurm job {sub.job_id}", attempt=number,
                    slurm_job=sub.job_id)
        return SlurmHandle(sub.job_id, sub.to_dict())

    def _learned_start(self, job: JobRow, spec) -> tuple[str | None, Overrides, str | None]:
        """(refusal, overrides, why) for a job's first attempt, from what earlier nights observed."""
        from supervisor.record.observations import first_attempt, refusal

        try:
            ctx = self._context(job, spec)
            policy = self._policy(spec, job)
        except Exception:
            log.exception("learned_plan_unavailable", job=job.id)
            return None, Overrides(), None
        refused = refusal(self.cfg.state.root, ctx, policy)
        if refused:
            return f"this box cannot run the job, not even at the last remedy: {refused}", Overrides(), None
        overrides, why = first_attempt(self.cfg.state.root, ctx, policy)
        return None, overrides, why

    def _observe(self, act: Active, this: AttemptRecord, diagnosis: Diagnosis, host: HostEvidence,
                 progress: dict[str, Any]) -> None:
        """What this attempt used, for the next job of its kind (after the verdict is committed)."""
        if act.spec.kind != "llamafactory":
            return
        from supervisor.record.observations import record_finished

        try:
            job = self.store.job(act.job_id)
            record_finished(self.cfg.state.root, self._context(job, act.spec), this.overrides, diagnosis,
                            succeeded=diagnosis.category == Category.SUCCESS, max_step=progress.get("max_step"),
                            resumed_from_step=this.resumed_from_step, peak_file=act.paths.root / "gpu_peak.json",
                            host=host, job=job.name if job else "", attempt=act.number, time=self.clock())
        except Exception:
            log.exception("observation_not_recorded", job=act.job_id)

    def refuse(self, job: JobRow, reason: str) -> None:
        """A job that can never run here (nothing of it was started)."""
        self.store.transition(job.id, JobState.RUNNING, "preparing attempt")
        self._fail(job.id, reason)

    def _with_policy_switches(self, spec, job: JobRow, overrides: Overrides) -> Overrides:
        """What the policy switches off for every attempt (rendered, not recorded as a remedy)."""
        import dataclasses

        from supervisor.judge.policy.render import EMERGENCY_CKPT_ENV

        try:
            if not self._policy(spec, job).emergency_checkpoint:
                return dataclasses.replace(overrides, env={**overrides.env, EMERGENCY_CKPT_ENV: "0"})
        except Exception:
            pass  # an unreadable policy is reported where it is decided on
        return overrides

    def _abandon_before_prepare(self, job: JobRow) -> None:
        """A cancel recorded before we began (durable intent): settle it, run nothing, fix nothing up."""
        with self.store.tx():
            current = self.store.job(job.id)
            if current is not None and current.cancel_requested and current.state in RUNNABLE:
                self.store.transition(job.id, JobState.CANCELLED, "cancelled by the user")
                self._notify(job.id, "cancelled", "cancelled by the user")
        return None

    def _crash_interruptions(self, job_id: int) -> int:
        """Attempts in a row cut short by a supervisor crash (not a clean shutdown)."""
        n = 0
        for a in reversed(self.store.attempts(job_id)):
            dec = a.json("decision") or {}
            if dec.get("kind") == "interrupted" and dec.get("cause") == "crash":
                n += 1
            elif dec.get("kind") != "interrupted":
                break
        return n

    def _plan_resume(self, job: JobRow, spec, overrides: Overrides, output_dir: Path | None, number: int):
        if output_dir is None:
            return None
        from supervisor.judge.resume import plan_resume, run_shape
        from supervisor.run.checkpoints import apply_fixups, quarantine, scan_output_dir

        world = self.launched_world_size(spec)
        scan = scan_output_dir(output_dir, expected_world_size=world)
        for inc in scan.incomplete:
            moved = quarantine(inc)
            self._event(job.id, "checkpoint_quarantined",
                        f"{inc.path.name} is incomplete ({inc.reason}); moved aside to {moved}",
                        attempt=number, path=str(moved))
        ckpt = scan.latest
        prev_attempt = self.store.last_attempt(job.id)
        prev_over = Overrides.from_dict(prev_attempt.json("overrides")) if prev_attempt else None
        nxt = run_shape({**spec.config, **overrides.yaml}, world_size=world,
                        deepspeed_cfg=_ds_of(spec, overrides))
        prev = (run_shape({**spec.config, **prev_over.yaml}, world_size=world,
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
        from supervisor.run.checkpoints import reclaim

        for removed in reclaim(output_dir, keep_quarantined=policy.retention.keep_quarantined,
                               keep_archived=policy.retention.keep_archived):
            self._event(job.id, "checkpoint_reclaimed", removed.describe(), attempt=number,
                        path=str(removed.aside.path), bytes=removed.aside.size_bytes)
        return plan

    def _job_python(self, spec) -> str | None:
        import shutil

        exe = shutil.which(self.launcher_for(spec)[0])
        cand = Path(exe).parent / "python" if exe else None
        return str(cand) if cand and cand.exists() else None

    def _validate_rendered(self, path: Path, spec) -> list:
        import yaml

        from supervisor.intake.llamafactory.validate import validate_config

        cfg = yaml.safe_load(path.read_text())
        return validate_config(cfg, workdir=spec.workdir)

    def _environment(self, spec: jobspec_mod.JobSpec, attempt_env: dict[str, str],
                     gpus: list[int] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_DROP_PREFIXES)}
        env.update(self.cfg.env)
        env.update(spec.sup.env)
        if gpus is None and spec.sup.gpus is not None:
            gpus = list(spec.sup.gpus)
        if gpus is not None:
            env.update(visibility_env(gpus, self.gpu_vendor))
            for name in VISIBILITY_VARS:
                if name not in visibility_env(gpus, self.gpu_vendor):
                    env.pop(name, None)  # one filter only: ROCR then HIP would index twice
        inherited_path = env.get("PYTHONPATH")
        env.update(attempt_env)
        if "PYTHONPATH" in attempt_env and inherited_path and "PYTHONPATH" not in spec.sup.env:
            # the start-up hook goes first; what the job would have had still follows it
            env["PYTHONPATH"] = f"{attempt_env['PYTHONPATH']}{os.pathsep}{inherited_path}"
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _limits(self, spec, job_id: int, number: int, owner: Owner):
        """(rlimits, memory cgroup, mechanism) for the job's host_memory_limit."""
        limit = spec.sup.host_memory_limit
        if not limit:
            return None, None, None
        if self.slurm:
            return None, None, "slurm-cgroup"  # sbatch --mem, enforced by Slurm's cgroup
        if owner.kind == "cgroup-v2" and owner.cgroup is not None and (owner.cgroup / "memory.max").exists():
            cg = JobCgroup.create(CgroupSupport(2, owner.cgroup.parent), owner.cgroup.name, limit)
            return None, cg, cg.mechanism
        if self.cgroup_support is not None:
            try:
                cg = JobCgroup.create(self.cgroup_support, self._cgroup_name(job_id, number), limit)
                return None, cg, cg.mechanism
            except OSError as exc:
                log.warning("cgroup_create_failed", job=job_id, error=str(exc))
        return rlimits_for(limit), None, "rlimit-data+sampled-sum"

    def attempt_tag(self, job_id: int, number: int) -> str:
        """The attempt's name for its cgroups and its marker (unique per state folder)."""
        return self._cgroup_name(job_id, number)

    def _state_tag(self) -> str:
        import hashlib

        return hashlib.sha256(str(self.cfg.state.root).encode()).hexdigest()[:8]

    def _cgroup_name(self, job_id: int, number: int) -> str:
        """Unique per state folder: two daemons on one box must never share a job's cgroup."""
        return f"job-{job_id}-attempt-{number}-{self._state_tag()}"

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
        from supervisor.judge.policy import load_policy
        from supervisor.judge.policy.schema import load_policy_by_name

        named = spec.sup.policy or job.policy
        if named:  # a job names its policy; it never points at a file (`policy: /etc/shadow`)
            return load_policy_by_name(named, search_dirs=self.cfg.policy_search_dirs())
        return load_policy(self.cfg.default_policy, search_dirs=self.cfg.policy_search_dirs())  # the admin's

    # --- follow -------------------------------------------------------------------------------
    def poll(self, act: Active) -> bool:
        """Advance one attempt within this tick's budget; True only when all of it is gone."""
        if act.broken is None:
            self._read_log(act)
            self._act_on_fatal(act)
        now = time.monotonic()
        if now >= act.next_sample_mono:  # the log may wake us 50 times a second: sample less often
            act.next_sample_mono = now + 0.5
            self._sample(act)
            if act.last_step is not None and act.last_step != act.published_step:
                act.published_step = act.last_step  # so `status` shows progress while it runs
                self.store.update_attempt(act.job_id, act.number, max_step=act.last_step,
                                          total_steps=act.scanner.total_steps)
        self._advance_stop(act)
        act.handle.reap()
        if not act.handle.alive():
            left = act.handle.processes(scan=True)
            if left:
                self._stop_orphans(act, left)
                return False
            if act.broken is None:
                self._read_log_to_end(act)
            if act.stop_sent_mono is not None and act.teardown_s is None:
                act.teardown_s = time.monotonic() - act.stop_sent_mono
            return True
        # Alive. The exit check came first: a job that ended while we were stalled is not a hang.
        if isinstance(act.handle, SlurmHandle) and (act.handle.state is None or act.handle.state.state != "RUNNING"):
            act.last_output_mono = now  # waiting in Slurm's queue is not a hang
        if (act.stopped_by is None and act.broken is None and act.hang_timeout
                and now - act.last_output_mono > act.hang_timeout):
            self._event(act.job_id, "hang_detected",
                        f"no output and no step advance for {act.hang_timeout:.0f}s (last step "
                        f"{act.last_step}); stopping the attempt", attempt=act.number)
            self.stop(act, "hang", self.cfg.stop_grace)
        return False

    def _act_on_fatal(self, act: Active) -> None:
        if act.fatal and act.stopped_by is None and act.spec.sup.stop_on_fatal_line:
            ev = act.fatal[0]
            self._event(act.job_id, "fatal_detected",
                        f"line {ev.line_no}: {ev.text[:300]} -> stopping the attempt now", attempt=act.number,
                        rule=ev.rule)
            self.stop(act, "fatal_signal", self.cfg.fatal_grace)

    def _advance_stop(self, act: Active) -> None:
        """SIGKILL at the stop deadline, again while anything is left; say once if it will not die."""
        if act.stop_deadline is None:
            return
        now = time.monotonic()
        if now < act.stop_deadline:
            return
        if isinstance(act.handle, SlurmHandle):
            if not act.kill_sent:
                proctree.kill_tree(act.handle)  # scancel: Slurm's TERM, KillWait, then SIGKILL of the cgroup
                act.kill_sent = True
            elif now - act.stop_deadline > SLURM_KILL_AFTER_S and "kill" not in act.handle.cancels:
                proctree.kill_tree(act.handle, shim_too=True)
        elif act.handle.processes():
            proctree.kill_tree(act.handle)
            act.kill_sent = True
        elif act.handle.alive() and now - act.stop_deadline > proctree.SHIM_GRACE_S:
            proctree.kill_tree(act.handle, shim_too=True)  # its job is gone but it is stuck
        if (act.kill_sent and not act.stuck_reported and now - act.stop_deadline > STUCK_AFTER_S
                and act.handle.processes()):
            act.stuck_reported = True
            stuck = _describe(act.handle.processes())
            self._event(act.job_id, "attempt_stuck",
                        f"attempt {act.number}: processes survive SIGKILL for {STUCK_AFTER_S:.0f}s ({stuck}); "
                        "probably in uninterruptible sleep (a hung driver or file system). The job stays "
                        "held: nothing else starts on its GPUs until they are gone", attempt=act.number)

    def _stop_orphans(self, act: Active, left: list) -> None:
        """The shim is gone but processes of the attempt live (it was killed from outside)."""
        if act.stopped_by is None:
            act.stopped_by = "orphaned"
            act.detected_at = self.clock()
        if act.stop_deadline is None or not act.kill_sent:
            self._event(act.job_id, "orphans_stopped",
                        f"the attempt's shim is gone but {len(left)} of its processes still run "
                        f"({_describe(left)}); stopping them before anything else may use their GPUs",
                        attempt=act.number)
            act.stop_sent_mono = act.stop_sent_mono or time.monotonic()
            act.stop_sent_wall = act.stop_sent_wall or self.clock()
            act.stop_deadline = time.monotonic()
            proctree.kill_tree(act.handle)
            act.kill_sent = True

    def _read_log(self, act: Active, budget_bytes: int = READ_BUDGET_BYTES, budget_s: float = READ_BUDGET_S) -> None:
        for chunk in act.log.read(budget_bytes, budget_s):
            act.last_output_mono = time.monotonic()
            act.fatal.extend(act.scanner.feed(chunk))
        if act.log.notes:
            act.last_output_mono = time.monotonic()
            for note in act.log.notes:
                self._event(act.job_id, "log_changed", note, attempt=act.number)
            act.log.notes.clear()
        step = act.scanner.last_step
        if step is not None and (act.last_step is None or step > act.last_step):
            act.last_step = step

    def _read_log_to_end(self, act: Active) -> None:
        """The attempt is over: read what is left (a flood backlog only by its tail)."""
        act.log.skip_to_tail(TAIL_KEEP_BYTES)
        self._read_log(act, budget_bytes=TAIL_KEEP_BYTES + READ_BUDGET_BYTES, budget_s=10.0)

    def _sample(self, act: Active) -> None:
        try:
            procs = act.handle.processes()
            if act.handle.owner is not None:
                act.handle.owner.remember(procs)
            rss = act.handle.rss_bytes()
            avail = psutil.virtual_memory().available
        except Exception:
            return
        act.peak_rss = max(act.peak_rss, rss)
        act.min_available = avail if act.min_available is None else min(act.min_available, avail)
        limit = act.spec.sup.host_memory_limit
        if limit and act.handle.cgroup is None and rss > limit and act.stopped_by is None:
            # No cgroup: RLIMIT_DATA binds each process alone, so the job as a whole is held to its
            # limit here, by the sampled sum of its processes.
            act.limit_killed = True
            self._event(act.job_id, "memory_limit_enforced",
                        f"the job's processes use {_gib(rss)} together ({len(procs)} processes), over its "
                        f"host_memory_limit of {_gib(limit)} (no cgroup here: enforced on the sampled sum); "
                        "stopping the attempt", attempt=act.number, rss_bytes=rss, limit_bytes=limit)
            self.stop(act, "memory_limit", 0.0)

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
            self._fail(job_id, msg)

    def broke(self, act: Active, what: str) -> None:
        """Our own error while following a live attempt: stop its tree first; record once it is gone."""
        if act.broken is None:
            act.broken = what
            log.error("attempt_follow_failed", job=act.job_id, attempt=act.number, error=what)
            try:
                self._event(act.job_id, "internal_error",
                            f"internal error while following attempt {act.number} ({what}); stopping the "
                            "attempt before the job is released", attempt=act.number)
            except Exception:
                pass
        self.stop(act, "internal_error", self.cfg.stop_grace)

    def stop(self, act: Active, reason: str, grace_s: float) -> None:
        """Ask the attempt to stop: SIGTERM now, SIGKILL at the deadline (never blocks the loop)."""
        now = time.monotonic()
        if act.stopped_by is None:
            act.stopped_by = reason
            act.detected_at = self.clock()
        if act.stop_sent_mono is None:
            act.stop_sent_mono, act.stop_sent_wall = now, self.clock()
            act.stop_deadline = now + grace_s
            proctree.signal_tree(act.handle, signal.SIGTERM)
        else:
            act.stop_deadline = min(act.stop_deadline or now + grace_s, now + grace_s)
        self._advance_stop(act)

    # --- verdict ----------------------------------------------------------------------------------
    def finish(self, act: Active) -> None:
        """Judge an attempt that is over and record it all in ONE transaction.

        Raises (e.g. a full disk) with nothing recorded; the daemon keeps the attempt and
        calls again, so a verdict is never half-written and the job never left behind.
        """
        raw = proctree.read_exit(act.paths) or {}
        stopped_by = act.stopped_by
        slurm_v = self._slurm_verdict(act) if isinstance(act.handle, SlurmHandle) else None
        if slurm_v is not None:
            if not raw or raw.get("returncode") is None:
                raw = {**raw, **slurm_v["exit"]}
            if stopped_by is None and (slurm_v["interrupted"] or slurm_v["timeout"]):
                stopped_by, act.interrupt_cause = "vanished", f"slurm {slurm_v['scheduler_state']}"
            elif stopped_by is None and slurm_v["cancelled"]:
                stopped_by = "cancelled_outside"
        if (stopped_by == "shutdown" and raw.get("ended_at") and act.stop_sent_wall
                and raw["ended_at"] < act.stop_sent_wall and raw.get("returncode") is not None):
            stopped_by = None  # it ended on its own just before our stop: judge it as such
        exit_rec = ExitRecord(returncode=raw.get("returncode"), signal=raw.get("signal"),
                              duration_s=raw.get("duration_s"), stopped_by=stopped_by,
                              launch_error=raw.get("launch_error") or raw.get("error") or act.launch_failure)
        host = self._host_evidence(act, raw)
        if slurm_v is not None:
            import dataclasses

            host = dataclasses.replace(host, **{k: v for k, v in slurm_v["host"].items() if v is not None})
        try:
            diagnosis = act.scanner.finish(exit_rec, host)
        except Exception as exc:
            log.exception("diagnosis_failed", job=act.job_id)
            act.broken = act.broken or f"diagnosis failed: {exc!r}"
            diagnosis = Diagnosis(Category.UNKNOWN, f"the supervisor could not diagnose the log ({exc!r})")
        atomic_write_json(act.paths.diagnosis, diagnosis.to_dict(), mode=0o600)
        progress = self._progress(act)
        job = self.store.job(act.job_id)
        cancel = stopped_by == "cancel" or bool(job and job.cancel_requested)
        decision = None
        if not cancel and stopped_by not in ("shutdown", "vanished", "cancelled_outside") and act.broken is None:
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
        emergency = _emergency_of(act.paths.log)
        if emergency is not None and emergency.steps_saved and emergency.step is not None:
            # The hook saved the last finished step: that checkpoint is what this attempt kept.
            fields["checkpoint_step_after"] = max(emergency.step, progress.get("checkpoint_step_after") or 0)
        with self.store.tx():
            job = self.store.job(act.job_id)
            self.store.update_attempt(act.job_id, act.number, **fields)
            if emergency is not None:
                words = {"saved": f"emergency checkpoint at step {emergency.step}: {emergency.path}",
                         "already_saved": f"emergency checkpoint at step {emergency.step}: already saved by the "
                                          "regular schedule",
                         }.get(emergency.outcome, f"no emergency checkpoint ({emergency.outcome}): "
                                                  f"{emergency.reason or emergency.text}")
                self._event(act.job_id, "emergency_checkpoint", words, attempt=act.number,
                            outcome=emergency.outcome, step=emergency.step, path=emergency.path,
                            seconds=emergency.seconds)
            if vram and vram.get("samples"):
                peaks = ", ".join(f"GPU {d}: {b / (1 << 30):.2f} GiB" for d, b in vram["peak_bytes"].items())
                self._event(act.job_id, "gpu_telemetry", f"peak VRAM {peaks or 'none seen'} ({vram['source']})",
                            attempt=act.number, **vram)
            self._event(act.job_id, "attempt_ended",
                        f"attempt {act.number} ended: {_exit_words(exit_rec)}; diagnosis {diagnosis.category}"
                        + (f"/{diagnosis.subkind}" if diagnosis.subkind else "") + f": {diagnosis.summary}",
                        attempt=act.number, teardown_s=act.teardown_s)
            last = self.store.last_attempt(act.job_id)
            if job is None or job.state != JobState.RUNNING or last is None or last.number != act.number:
                # Compare-and-set on (state, attempt): the record moved on without this verdict.
                self._event(act.job_id, "attempt_orphan_record",
                            f"attempt {act.number} ended while the job was {job.state if job else 'gone'}"
                            f" (last attempt {last.number if last else None}); nothing more to do",
                            attempt=act.number)
            elif job.cancel_requested or stopped_by == "cancel":
                self.store.update_attempt(act.job_id, act.number, decision=json.dumps({"kind": "cancelled"}))
                self.store.transition(act.job_id, JobState.CANCELLED, "cancelled by the user")
                self._notify(act.job_id, "cancelled", "cancelled by the user")
            elif stopped_by == "cancelled_outside":
                self.store.update_attempt(act.job_id, act.number, decision=json.dumps(
                    {"kind": "fail", "reason": "cancelled in Slurm"}))
                self._fail(act.job_id, f"attempt {act.number} (Slurm job {act.handle.job_id}) was cancelled "
                                       "in Slurm by someone else (scancel); not started again on its own: "
                                       f"`oom-supervisor retry {act.job_id}` resumes it")
            elif stopped_by in ("shutdown", "vanished"):
                cause = act.interrupt_cause if act.interrupt_cause.startswith("slurm") else (
                    "crash" if stopped_by == "vanished" else act.interrupt_cause)
                self.store.update_attempt(act.job_id, act.number, interrupted=1,
                                          decision=json.dumps({"kind": "interrupted", "cause": cause}))
                why = (f"Slurm ended attempt {act.number} ({cause[6:]}): not a failure of the job"
                       if cause.startswith("slurm") else "the supervisor stopped" if cause != "crash" else
                       f"attempt {act.number} vanished with the daemon (no exit record)")
                self.store.transition(act.job_id, JobState.INTERRUPTED,
                                      f"{why}; resumes from the last complete checkpoint")
            elif act.broken is not None:
                self.store.update_attempt(act.job_id, act.number, decision=json.dumps(
                    {"kind": "fail", "reason": f"internal error: {act.broken}"}))
                self._fail(act.job_id, f"internal error while following attempt {act.number} "
                                       f"({act.broken}); its processes are gone. `oom-supervisor retry "
                                       f"{act.job_id}` resumes it from its last complete checkpoint")
            else:
                self.apply(act.job_id, act.number, decision)
        act.log.close()
        if decision is not None:
            self._observe(act, this, diagnosis, host, progress)
        if act.handle.owner is not None:
            act.handle.owner.remove(timeout_s=0.5)
        if act.handle.cgroup is not None and (act.handle.owner is None or act.handle.cgroup.path != act.handle.owner.cgroup):
            act.handle.cgroup.remove(timeout_s=0.5)

    def _slurm_verdict(self, act: Active) -> dict[str, Any] | None:
        from supervisor.run import slurm

        st = act.handle.refresh(force=True)
        if st is None:
            return None
        tail = _tail_text(act.paths.log, 64 << 10)
        return slurm.verdict(st, tail, requested_mem_bytes=act.spec.sup.host_memory_limit)

    def _progress(self, act: Active) -> dict[str, Any]:
        out: dict[str, Any] = {"max_step": act.last_step}
        if act.output_dir is None:
            return out
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
        except Exception:
            log.exception("progress_read_failed", job=act.job_id)
        return out

    def _host_evidence(self, act: Active, raw: dict) -> HostEvidence:
        cg = act.handle.cgroup
        pids = {p for p in (raw.get("pid"),) if p}
        peak = max(act.peak_rss, int(raw.get("peak_rss_bytes") or 0))  # the shim's own samples too
        kills = None
        if cg is not None:
            kills = cg.oom_kills()
            peak = max(peak, cg.peak_bytes() or 0)
        kernel = ()
        if raw.get("signal") == "SIGKILL" or raw.get("returncode") in (137, -9) or kills:
            kernel = kernel_oom_lines(pids, since_s=raw.get("started_at") or 0)
        mechanism = cg.mechanism if cg else ("rlimit-data+sampled-sum" if act.spec.sup.host_memory_limit else None)
        return HostEvidence(cgroup_oom_kills=kills, kernel_oom_lines=kernel,
                            min_available_bytes=act.min_available, peak_rss_bytes=peak or None,
                            memory_limit_bytes=act.spec.sup.host_memory_limit, limit_mechanism=mechanism,
                            limit_enforced_kill=act.limit_killed,
                            free_bytes=_free_bytes([act.output_dir, act.paths.root]))

    def decide(self, job_id: int, diagnosis: Diagnosis, this: AttemptRecord | None = None) -> Decision:
        """What to do next (the pure policy over the record plus `this`, the attempt being judged,
        not yet recorded as ended); no writes."""
        from supervisor.judge.policy import decide

        if diagnosis.category == Category.SUCCESS:
            return Decision(DecisionKind.DONE, "the training command exited 0")
        job = self.store.job(job_id)
        try:
            spec = self.spec_of(job_id)
            policy = self._policy(spec, job)
            history = [a for a in self._history(job_id) if this is None or a.number != this.number]
            if this is not None:
                history.append(this)
            return decide(self._context(job, spec), history, diagnosis, policy)
        except Exception as exc:
            log.exception("decide_failed", job=job_id)
            return Decision(DecisionKind.FAIL, f"the policy could not decide: {exc!r}")

    def apply(self, job_id: int, number: int, decision: Decision) -> None:
        """Record the decision and move the job (called inside finish's transaction)."""
        self.store.update_attempt(job_id, number, decision=json.dumps(decision.to_dict()))
        now = self.clock()
        if decision.kind == DecisionKind.DONE:
            self.store.transition(job_id, JobState.SUCCEEDED, decision.reason)
            self._notify(job_id, "succeeded", decision.reason)
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
            self._notify(job_id, "escalated", f"{decision.rung}: {decision.reason}",
                         changes=[c.to_dict() for c in decision.changes])
        elif decision.kind == DecisionKind.PAUSE:
            self.store.transition(job_id, JobState.WAITING_RETRY, f"queue paused: {decision.reason}",
                                  not_before=now + decision.delay_s)
            self.store.set_meta("queue_paused", f"job {job_id}: {decision.reason}")
            self.store.event(job_id, "queue_paused", decision.reason)
            self._notify(job_id, "paused", decision.reason)

    def decide_and_apply(self, job_id: int, number: int, diagnosis: Diagnosis) -> Decision:
        """For an attempt already recorded as ended."""
        decision = self.decide(job_id, diagnosis)
        with self.store.tx():
            self.apply(job_id, number, decision)
        self.flush_notifications()
        return decision

    def _fail(self, job_id: int, reason: str) -> None:
        self.store.transition(job_id, JobState.FAILED, reason)
        self._notify(job_id, "failed", reason)

    def _notify(self, job_id: int, kind: str, message: str, **extra: Any) -> None:
        """Queue a notification; sent by `flush_notifications` once the record is committed."""
        self._outbox.append(self._job_event(job_id, kind, message, **extra))

    def flush_notifications(self) -> None:
        out, self._outbox = self._outbox, []
        for event in out:
            try:
                self.notifier.send(event)
            except Exception:
                log.exception("notify_failed", event=event.get("event"))

    def discard_notifications(self) -> None:
        """A transaction rolled back: what it would have announced did not happen."""
        self._outbox = []

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

    def _gpu_capacities(self) -> dict[int, int]:
        if self._gpu_caps is None:
            from supervisor.run.gpus import probe_capacities

            self._gpu_caps = probe_capacities()
        return self._gpu_caps

    def _launch_fields(self, spec, gpus: list[int] | None = None) -> dict[str, Any]:
        """The world size the launch really has (pinned ranks, its GPUs, else every visible GPU)."""
        from supervisor.intake.llamafactory.launch import launch_fields

        if self.slurm:  # Slurm allocates: GPUs per node from the job's request or the site's default
            from supervisor.run.slurm import SlurmJobRequest

            req = spec.sup.slurm_request or SlurmJobRequest()
            settings = self.cfg.slurm_settings
            gpn = req.gpus_per_node if req.gpus_per_node is not None else settings.gpus_per_node
            return {"nproc_per_node": max(1, gpn), "gpus": None, "visible_gpu_count": gpn}
        gpus = gpus if gpus is not None else (list(spec.sup.gpus) if spec.sup.gpus else None)
        env = self._environment(spec, {}, gpus)
        return launch_fields(nproc_per_node=spec.sup.nproc_per_node or spec.sup.gpu_count, gpus=gpus, env=env,
                             probed_gpus=len(self._gpu_capacities()))

    def launched_world_size(self, spec) -> int:
        return JobContext(id=0, name="", kind=spec.kind, config={}, world_size=spec.world_size,
                          **self._launch_fields(spec)).launched_world_size()

    def _context(self, job: JobRow, spec) -> JobContext:
        """What the pure policy may know, gathered here at the edge."""
        shape_fields: dict[str, Any] = {}
        model = spec.config.get("model_name_or_path")
        if model:
            from supervisor.judge.policy.estimate import context_fields, read_model_shape

            local = spec.resolve(str(model))
            shape_fields = context_fields(read_model_shape(local)) if local.exists() else {}
        versions = self._versions_for(spec) if spec.kind == "llamafactory" else {}
        from supervisor.run.gpus import capacity_for

        vm = psutil.virtual_memory()
        world = spec.world_size
        if self.slurm:
            from supervisor.run.slurm import SlurmJobRequest

            world = (spec.sup.slurm_request or SlurmJobRequest()).world_size(self.cfg.slurm_settings)
        return JobContext(
            id=job.id, name=job.name, kind=spec.kind, config=dict(spec.config), world_size=world,
            max_attempts=spec.sup.max_attempts or 8, host_ram_bytes=vm.total,
            gpu_capacity_bytes=capacity_for(self._gpu_capacities(), spec.sup.gpus),
            torch_version=versions.get("torch"), transformers_version=versions.get("transformers"),
            uses_vllm=str(spec.config.get("infer_backend", "")).lower() == "vllm",
            deepspeed_config=_ds_of(spec, Overrides()),
            host_memory_limit_bytes=spec.sup.host_memory_limit,
            # The attempt has ended when the policy decides: what is in use now is others'.
            host_used_by_others_bytes=vm.total - vm.available,
            **self._launch_fields(spec), **shape_fields)

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
        """Take a `running` job back after a restart. Whatever of its last attempt lives is
        followed (adopted) or stopped; nothing new starts until all of it is gone."""
        attempt = self.store.last_attempt(job.id)
        if attempt is None or attempt.ended_at is not None:
            self.store.transition(job.id, JobState.INTERRUPTED,
                                  "daemon restarted before the attempt started" if attempt is None else
                                  f"daemon restarted after attempt {attempt.number} ended, before its "
                                  "verdict was recorded")
            return None
        paths = self.cfg.state.job(job.id).attempt(attempt.number)
        spec = self.spec_of(job.id)
        tag = self.attempt_tag(job.id, attempt.number)
        ref = attempt.json("backend_ref") or {}
        if "slurm" in ref:
            return self._recover_slurm(job, attempt, paths, spec, ref["slurm"], adopt)
        owner = Owner.for_attempt(self.owner_support, tag, paths.root / "procs.json", create=False)
        cg = None
        if spec.sup.host_memory_limit:
            if owner.cgroup is not None and (owner.cgroup / "memory.max").exists():
                cg = JobCgroup(owner.cgroup, 2)
            elif self.cgroup_support is not None:
                path = self.cgroup_support.parent / self._cgroup_name(job.id, attempt.number)
                if path.exists():
                    cg = JobCgroup(path, self.cgroup_support.version)
        handle = proctree.Handle(attempt.pid or 0, attempt.pid_create_time or 0.0, cgroup=cg, owner=owner)
        if handle.shim() is None:
            p = proctree.find_shim_by_launch_file(paths.launch)
            if p is not None:
                handle.pid, handle.create_time = p.pid, p.create_time()
        output_dir = spec.resolve(spec.config["output_dir"]) if spec.config.get("output_dir") else None
        assigned = attempt.json("gpus") if attempt.gpus else (list(spec.sup.gpus) if spec.sup.gpus else None)
        act = Active(job_id=job.id, number=attempt.number, paths=paths, handle=handle,
                     scanner=LogScanner(initial_step=attempt.resumed_from_step),
                     spec=spec, gpus=assigned, output_dir=output_dir,
                     hang_timeout=spec.sup.hang_timeout or self.cfg.hang_timeout,
                     last_step=attempt.resumed_from_step)
        alive = handle.alive()
        left = handle.processes(scan=True)
        if alive or left:
            if job.cancel_requested:
                self._event(job.id, "attempt_stopped_on_restart",
                            f"daemon restarted; attempt {attempt.number} still runs and a cancel was "
                            "requested: stopping it", attempt=attempt.number)
                self.stop(act, "cancel", self.cfg.stop_grace)
            elif not alive:
                self._stop_orphans(act, left)
            elif adopt:
                self._event(job.id, "attempt_adopted",
                            f"daemon restarted; attempt {attempt.number} (pid {handle.pid}) is still running: "
                            f"following it again (ownership: {owner.mechanism})", attempt=attempt.number)
            else:
                self._event(job.id, "attempt_stopped_on_restart",
                            f"daemon restarted; stopping attempt {attempt.number} (pid {handle.pid}) "
                            "before a new one starts", attempt=attempt.number)
                act.interrupt_cause = "restart"
                self.stop(act, "shutdown", self.cfg.stop_grace)
            return act
        if proctree.read_exit(paths) is not None:
            self._event(job.id, "attempt_ended_while_down",
                        f"attempt {attempt.number} ended while the daemon was down; judging it from its "
                        "exit record and log", attempt=attempt.number)
        else:
            act.stopped_by = "vanished"  # nothing lives and nothing was written: resume it
        return act

    def _recover_slurm(self, job: JobRow, attempt, paths: AttemptPaths, spec, record: dict, adopt: bool) -> Active:
        """A Slurm attempt after a restart: followed again by job id, once Slurm confirms it is the
        same run (a controller restart can relaunch a job under the same id)."""
        handle = SlurmHandle(str(record["job_id"]), dict(record))
        output_dir = spec.resolve(spec.config["output_dir"]) if spec.config.get("output_dir") else None
        act = Active(job_id=job.id, number=attempt.number, paths=paths, handle=handle,
                     scanner=LogScanner(initial_step=attempt.resumed_from_step), spec=spec, gpus=None,
                     output_dir=output_dir, hang_timeout=spec.sup.hang_timeout or self.cfg.hang_timeout,
                     last_step=attempt.resumed_from_step)
        if not handle.same_run():
            self._event(job.id, "slurm_relaunch_detected",
                        f"Slurm job {handle.job_id} is not the run attempt {attempt.number} started (relaunched "
                        "under the same id; its output was truncated): stopping it and resuming from the last "
                        "complete checkpoint", attempt=attempt.number)
            act.interrupt_cause = "slurm relaunch"
            self.stop(act, "vanished", 0.0)
            return act
        if job.cancel_requested:
            self.stop(act, "cancel", self.cfg.stop_grace)
        elif handle.alive():
            if adopt:
                self._event(job.id, "attempt_adopted", f"daemon restarted; attempt {attempt.number} is Slurm job "
                            f"{handle.job_id} ({handle.state.state if handle.state else 'state unknown'}): "
                            "following it again", attempt=attempt.number)
            else:
                act.interrupt_cause = "restart"
                self.stop(act, "shutdown", self.cfg.stop_grace)
        return act


def _emergency_of(log_path: Path):
    """The start-up hook's last marker in the log's tail (it comes right before the traceback)."""
    from supervisor.hooks.markers import parse_emergency

    try:
        return parse_emergency(_tail_text(log_path, 256 << 10).splitlines())
    except Exception:
        log.exception("emergency_marker_unreadable")
        return None


def _tail_text(path: Path, n: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - n))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


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


def _free_bytes(folders: list[Path | None]) -> dict[str, int]:
    return {str(d): free for d in folders if d is not None and (free := free_bytes(d)) is not None}


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _describe(procs) -> str:
    parts = []
    for p in list(procs)[:6]:
        try:
            parts.append(f"pid {p.pid} {p.name()} [{p.status()}]")
        except psutil.Error:
            parts.append(f"pid {p.pid}")
    more = len(list(procs)) - len(parts)
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")


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
