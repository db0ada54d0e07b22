"""What the pure plan and policy may know about a job, gathered here at the edge.

Reading the job file, the policy files, the record (history, interruptions), the observations of
earlier nights, the output folder's checkpoints, the job environment's library versions and the
box (GPUs, host RAM) all happens in this module, once per decision; `supervisor.judge.plan` and
`supervisor.judge.policy` get plain values.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from supervisor.core.jobenv import inherited
from supervisor.core.models import AttemptRecord, Diagnosis, ExitRecord, JobContext, Overrides
from supervisor.daemon.config import DaemonConfig
from supervisor.intake import jobspec as jobspec_mod
from supervisor.intake.llamafactory.launch import visibility_env
from supervisor.judge.kinds import kind_of
from supervisor.judge.plan import JobFacts, Learned, ResumeFacts, compose_environment
from supervisor.record.store import JobRow, Store
from supervisor.run.fsutil import read_json
from supervisor.run.identity import Identity, UnknownUser, acting_as, as_user_kwargs, lookup, myself
from supervisor.service.logsetup import log


class Facts:
    def __init__(self, cfg: DaemonConfig, store: Store, backend) -> None:
        self.cfg = cfg
        self.store = store
        self.backend = backend
        self._specs: dict[int, jobspec_mod.JobSpec] = {}  # job.yaml never changes once accepted
        self._versions: dict[str, dict[str, str | None]] = {}
        self._acting: Identity | None = None  # whose files and programs the daemon touches now (acting)

    # --- whose job it is -----------------------------------------------------------------------------
    def identity_of(self, job: JobRow) -> Identity | None:
        """A shared box: who the job runs as, from the user database now (its submitter). Raises
        UnknownUser with the reason when nobody can be: a job from before owners were recorded, a
        removed account. Single-user mode: None (the daemon's own user)."""
        if not self.cfg.system_mode:
            return None
        if job.owner_uid is None:
            raise UnknownUser("the job was recorded before jobs had owners: there is nobody to run it as on a "
                              "shared box; resubmit it")
        who = lookup(job.owner_uid)
        if who.uid != job.owner_uid:  # never run as someone else (root included) than the submitter
            raise UnknownUser(f"uid {job.owner_uid} resolves to uid {who.uid}")
        return who

    def identity_quietly(self, job_id: int) -> Identity | None:
        job = self.store.job(job_id)
        try:
            return self.identity_of(job) if job is not None else None
        except UnknownUser:
            return None

    @contextmanager
    def acting(self, identity: Identity | None) -> Iterator[None]:
        """The daemon's work in a job's own folders (output_dir, model, datasets) and programs of the
        job's (its interpreter), done as the job's user: a path or link they chose reaches nothing
        they could not reach themselves (run.identity.acting_as)."""
        before, self._acting = self._acting, identity
        try:
            with acting_as(identity):
                yield
        finally:
            self._acting = before

    # --- the job ----------------------------------------------------------------------------------
    def spec_of(self, job_id: int) -> jobspec_mod.JobSpec:
        if job_id not in self._specs:
            job = self.store.job(job_id)
            text = self.cfg.state.job(job_id).job_file.read_text()
            self._specs[job_id] = jobspec_mod.parse_job_text(
                text, source=job.source or "", submit_dir=Path(job.workdir), check_lf=False)
        return self._specs[job_id]

    def launcher_for(self, spec: jobspec_mod.JobSpec) -> list[str]:
        return list(spec.sup.launcher or self.cfg.launcher)

    def policy(self, spec: jobspec_mod.JobSpec, job: JobRow):
        from supervisor.judge.policy import load_policy
        from supervisor.judge.policy.schema import load_policy_by_name

        named = spec.sup.policy or job.policy
        if named:  # a job names its policy; it never points at a file (`policy: /etc/shadow`)
            return load_policy_by_name(named, search_dirs=self.cfg.policy_search_dirs())
        return load_policy(self.cfg.default_policy, search_dirs=self.cfg.policy_search_dirs())  # the admin's

    def job_deepspeed(self, spec: jobspec_mod.JobSpec) -> dict | None:
        """The job's own DeepSpeed config (a mapping, inline JSON, or a file)."""
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

    def inherited_env(self) -> dict[str, str]:
        """The part of the daemon's environment a job gets (core/jobenv.py): PATH, locale, TZ,
        proxies, CA bundles, GPU visibility, plus the config's pass_env; never a webhook's URL
        variable (nor anything else of the daemon's)."""
        secrets = {h.url_env for h in self.cfg.webhooks if h.url_env}
        return inherited(os.environ, pass_env=self.cfg.pass_env, secrets=secrets)

    def base_env(self, identity: Identity | None = None) -> dict[str, str]:
        """What a job's environment starts from, never the daemon's: the allowlist, its user's
        HOME/USER/LOGNAME (`identity`, or the one acted as; single-user: the daemon's own), then
        the config's `env:` (the job's own `env:` and the remedy come after, in the plan)."""
        who = identity or self._acting
        env = self.inherited_env()
        if who is not None:
            env.update(who.login_env())
        else:  # single-user: the daemon's own user
            env.update({k: os.environ[k] for k in ("HOME", "USER", "LOGNAME") if os.environ.get(k)}
                       or myself().login_env())
        env.update(self.cfg.env)
        return env

    def visibility(self, spec: jobspec_mod.JobSpec, gpus: list[int] | None) -> dict[str, str]:
        if gpus is None and spec.sup.gpus is not None:
            gpus = list(spec.sup.gpus)
        return visibility_env(gpus, self.backend.gpu_vendor) if gpus is not None else {}

    def environment(self, spec: jobspec_mod.JobSpec, gpus: list[int] | None) -> dict[str, str]:
        return compose_environment(self.base_env(), spec.sup.env, {}, self.visibility(spec, gpus))

    # --- the record ---------------------------------------------------------------------------------
    def crash_interruptions(self, job_id: int) -> int:
        """Attempts in a row cut short by a supervisor crash (not a clean shutdown)."""
        n = 0
        for a in reversed(self.store.attempts(job_id)):
            dec = a.json("decision") or {}
            if dec.get("kind") == "interrupted" and dec.get("cause") == "crash":
                n += 1
            elif dec.get("kind") != "interrupted":
                break
        return n

    def host_wait_since(self, job_id: int) -> float | None:
        """When the job's next attempt was first held back for host RAM others hold (None: it is
        not waiting), from the record: a restart keeps the bound."""
        for e in reversed(self.store.events(job_id)):
            if e.kind == "host_memory_wait":
                return e.ts
            if e.kind in ("attempt_started", "host_memory_wait_over"):
                return None
        return None

    def history(self, job_id: int) -> list[AttemptRecord]:
        out = []
        for a in self.store.attempts(job_id):
            if a.interrupted or a.ended_at is None:
                continue
            d, e, dec = a.json("diagnosis"), a.json("exit"), a.json("decision")
            out.append(AttemptRecord(
                number=a.number, overrides=Overrides.from_dict(a.json("overrides")),
                diagnosis=Diagnosis.from_dict(d) if d else None,
                exit=ExitRecord.from_dict(e) if e else None, resumed_from_step=a.resumed_from_step,
                max_step=a.max_step, checkpoint_step_after=a.checkpoint_step_after,
                decision=dec.get("kind") if dec else None))
        return out

    # --- the job's environment and the box ------------------------------------------------------------
    def versions(self, spec: jobspec_mod.JobSpec) -> dict[str, str | None]:
        """transformers/torch versions of the environment the job runs in (not ours), probed with the
        job's interpreter as the job's user (a shared box: never the job's code as root)."""
        who = self._acting
        key = f"{self.launcher_for(spec)[0]}@{who.uid if who else ''}"
        if key in self._versions:
            return self._versions[key]
        found: dict[str, str | None] = {"transformers": None, "torch": None}
        python = self.job_python(spec)
        probe = ("import importlib.metadata as m, json\nout={}\nfor n in ('transformers','torch'):\n"
                 "    try: out[n]=m.version(n)\n    except Exception: out[n]=None\nprint(json.dumps(out))")
        if python and (who is not None or not self.cfg.system_mode):
            try:
                res = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=30, cwd="/",
                                     **as_user_kwargs(who), check=False)
                found.update(json.loads(res.stdout.strip().splitlines()[-1]))
            except (OSError, subprocess.SubprocessError, ValueError, IndexError, TypeError):
                pass  # a probe that cannot run, or says nothing readable: the versions stay unknown
        self._versions[key] = found
        return found

    def job_python(self, spec: jobspec_mod.JobSpec) -> str | None:
        exe = shutil.which(self.launcher_for(spec)[0])
        cand = Path(exe).parent / "python" if exe else None
        return str(cand) if cand and cand.exists() else None

    def world_size(self, spec: jobspec_mod.JobSpec, gpus: list[int] | None = None) -> int:
        """Ranks per node the launch really runs (a remedy must never change it). On fewer GPUs
        than the job asked for (the policy's `fewer_gpus`), its ranks shrink with them."""
        asked = JobContext(id=0, name="", kind=spec.kind, config={}, world_size=spec.world_size,
                           **self.backend.launch_fields(spec, None, self.environment(spec, None))
                           ).launched_world_size()
        if gpus is None:
            return asked
        wanted = spec.sup.gpu_count or (len(spec.sup.gpus) if spec.sup.gpus else None)
        if wanted and len(gpus) < wanted:
            return max(1, asked * len(gpus) // wanted)
        return JobContext(id=0, name="", kind=spec.kind, config={}, world_size=spec.world_size,
                          **self.backend.launch_fields(spec, gpus, self.environment(spec, gpus))
                          ).launched_world_size()

    def writers_world(self, job_id: int) -> int | None:
        """The ranks every earlier attempt of the job ran with, when they all agree (then a
        checkpoint missing a rank's files is incomplete for sure); None when unknown or mixed."""
        seen = {(json.loads(e.data) if e.data else {}).get("world_size")
                for e in self.store.events(job_id) if e.kind == "attempt_started"}
        return seen.pop() if len(seen) == 1 and None not in seen else None

    def context(self, job: JobRow, spec: jobspec_mod.JobSpec) -> JobContext:
        """What the pure policy may know about the job and the box."""
        shape_fields: dict[str, Any] = {}
        model = spec.config.get("model_name_or_path")
        if model:
            from supervisor.judge.policy.estimate import context_fields, read_model_shape

            local = spec.resolve(str(model))
            shape_fields = context_fields(read_model_shape(local)) if local.exists() else {}
        versions = self.versions(spec) if kind_of(spec).learns else {}
        from supervisor.run.gpus import capacity_for

        vm = psutil.virtual_memory()
        return JobContext(
            id=job.id, name=job.name, kind=spec.kind, config=dict(spec.config),
            world_size=self.backend.world_size(spec), max_attempts=spec.sup.max_attempts or 8,
            host_ram_bytes=vm.total,
            gpu_capacity_bytes=capacity_for(self.backend.gpu_capacities(), spec.sup.gpus),
            torch_version=versions.get("torch"), transformers_version=versions.get("transformers"),
            uses_vllm=str(spec.config.get("infer_backend", "")).lower() == "vllm",
            deepspeed_config=self.job_deepspeed(spec),
            host_memory_limit_bytes=spec.sup.host_memory_limit,
            # The attempt has ended when the policy decides: what is in use now is others'.
            host_used_by_others_bytes=vm.total - vm.available,
            **self.backend.launch_fields(spec, None, self.environment(spec, None)), **shape_fields)

    # --- one attempt's facts -------------------------------------------------------------------------
    def for_attempt(self, job: JobRow, number: int, attempt_dir: Path, gpus: list[int] | None) -> JobFacts:
        """Everything `plan_attempt` needs for attempt `number` (read once, here)."""
        try:
            spec = self.spec_of(job.id)
        except Exception as exc:  # noqa: BLE001 - an unreadable job file of any kind is said in the plan (spec_error), not raised into the loop
            return JobFacts(job_id=job.id, number=number, spec=None, spec_error=str(exc),
                            crash_interruptions=self.crash_interruptions(job.id),
                            max_interruptions=self.cfg.max_interruptions)
        kind = kind_of(spec)
        policy = policy_error = None
        try:
            policy = self.policy(spec, job)
        except Exception as exc:  # noqa: BLE001 - a policy that cannot be read is said in the plan (policy_error), whatever the reason
            policy_error = str(exc)
        escalation = Overrides.from_dict(json.loads(job.next_overrides)) if job.next_overrides else None
        learned = self.learned_start(job, spec, policy) if (number == 1 and escalation is None and kind.learns) else None
        world = self.world_size(spec, gpus)
        asked = self.world_size(spec, None)
        resume = None
        output_dir = kind.output_dir(spec) if kind.resumes else None
        if output_dir is not None:
            from supervisor.judge.user_resume import user_value
            from supervisor.run.checkpoints import inspect_path, scan_output_dir

            prev = self.store.last_attempt(job.id)
            named = user_value(spec.config)
            user = (inspect_path(spec.resolve(named), output_dir)
                    if named is not None and named not in ("true", "false", "auto") else None)
            resume = ResumeFacts(scan=scan_output_dir(output_dir, expected_world_size=self.writers_world(job.id)),
                                 prev_overrides=Overrides.from_dict(prev.json("overrides")) if prev else None,
                                 transformers_version=self.versions(spec).get("transformers"), user=user)
        vm = psutil.virtual_memory()
        capacities = self.backend.gpu_capacities() or {}
        mine = [capacities[g] for g in (gpus if gpus is not None else spec.sup.gpus or capacities) if g in capacities]
        return JobFacts(
            host_ram_bytes=vm.total, host_used_by_others_bytes=vm.total - vm.available,
            gpu_capacity_bytes=min(mine) if mine else None,
            job_id=job.id, number=number, spec=spec, policy=policy, policy_error=policy_error,
            escalation=escalation, learned=learned, crash_interruptions=self.crash_interruptions(job.id),
            max_interruptions=self.cfg.max_interruptions, world_size=world, asked_world_size=asked,
            launcher=tuple(self.launcher_for(spec)), attempt_dir=attempt_dir, base_env=self.base_env(),
            visibility=self.visibility(spec, gpus), job_deepspeed=self.job_deepspeed(spec), resume=resume,
            default_hang_timeout=self.cfg.hang_timeout)

    def learned_start(self, job: JobRow, spec: jobspec_mod.JobSpec, policy) -> Learned | None:
        """What earlier nights observed for jobs of this kind (None when nothing can be said)."""
        if policy is None:
            return None
        from supervisor.record.observations import first_attempt, refusal

        try:
            ctx = self.context(job, spec)
            refused = refusal(self.cfg.state.root, ctx, policy)
            if refused:
                return Learned(refusal=refused)
            overrides, why = first_attempt(self.cfg.state.root, ctx, policy)
            return Learned(overrides=overrides, why=why)
        except Exception:  # noqa: BLE001 - a learned start is an optimisation: without it the job starts as written, never stalls
            log.exception("learned_plan_unavailable", job=job.id)
            return None
