"""Plan one attempt: from what is known about a job to what to launch, or a refusal. Pure.

`plan_attempt(facts)` decides everything about the next attempt before anything is done: which
configuration it runs (the escalation the last verdict chose, else a learned start for a first
attempt, else the job as written), how it resumes (the complete checkpoint, the fixups, the
incomplete ones to move aside), the files and environment it is launched with, and the events
that say so. The runner gathers the facts at the edge (`supervisor.daemon.facts`), carries the
plan out and records it; every refusal and every remedy source is a millisecond test over
plain values (tests/core/test_plan_attempt.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.core.models import Overrides
from supervisor.intake.jobspec import JobSpec
from supervisor.intake.llamafactory.launch import VISIBILITY_VARS
from supervisor.judge.kinds import JobKind, kind_of
from supervisor.judge.load_check import LoadCheck, check_load
from supervisor.judge.policy.render import (
    DS_UNIVERSAL_FIX_ENV,
    EMERGENCY_BUDGET_ENV,
    EMERGENCY_CKPT_ENV,
    RenderedAttempt,
    render_attempt,
)
from supervisor.judge.policy.schema import Policy
from supervisor.judge.resume import (
    ARCHIVE_DIR,
    Fixup,
    Incomplete,
    ResumePlan,
    Scan,
    plan_resume,
    run_shape,
)
from supervisor.judge.user_resume import UserCheckpoint, choose_checkpoint, user_value


@dataclass(frozen=True)
class Refuse:
    """The job must not run (now or again on its own): the reason is its failure."""

    reason: str


@dataclass(frozen=True)
class Learned:
    """What earlier attempts of jobs of this kind say about a job's first attempt."""

    refusal: str | None = None
    overrides: Overrides = field(default_factory=Overrides)
    why: str | None = None


@dataclass(frozen=True)
class ResumeFacts:
    scan: Scan  # the output folder as it is now
    prev_overrides: Overrides | None  # what the attempt that wrote the newest checkpoint ran with
    transformers_version: str | None  # of the job's own environment
    user: UserCheckpoint | None = None  # what is at the job's own resume_from_checkpoint path, if any


@dataclass(frozen=True)
class JobFacts:
    """Everything the plan may know, gathered by the caller (no file, store or process in here)."""

    job_id: int
    number: int  # of the attempt to plan
    spec: JobSpec | None
    spec_error: str | None = None
    policy: Policy | None = None
    policy_error: str | None = None
    escalation: Overrides | None = None  # the remedy the last verdict chose
    learned: Learned | None = None
    crash_interruptions: int = 0
    max_interruptions: int = 5
    world_size: int = 1  # ranks the launch really has
    asked_world_size: int | None = None  # ranks it has with every GPU it asked for (None: the same)
    launcher: tuple[str, ...] = ()
    attempt_dir: Path = Path(".")
    base_env: Mapping[str, str] = field(default_factory=dict)  # what every job starts from
    visibility: Mapping[str, str] = field(default_factory=dict)  # the GPUs the daemon assigned
    job_deepspeed: Mapping[str, Any] | None = None  # the job's own DeepSpeed config, read at the edge
    resume: ResumeFacts | None = None
    default_hang_timeout: float = 0.0
    # The box, for the check that a checkpoint can be loaded at all (judge.load_check).
    host_ram_bytes: int | None = None
    host_used_by_others_bytes: int | None = None
    gpu_capacity_bytes: int | None = None  # per GPU of the attempt; None: no GPU


@dataclass(frozen=True)
class PlannedEvent:
    kind: str
    message: str
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AttemptPlan:
    number: int
    spec: JobSpec
    overrides: Overrides  # recorded with the attempt (the remedies it runs with)
    source: str  # where they come from: "escalation", "learned" or "job" (as written)
    rendered: RenderedAttempt
    env: Mapping[str, str]
    output_dir: Path | None
    hang_timeout: float
    resume: ResumePlan | None = None
    world_size: int = 1  # ranks it is launched with
    quarantine: tuple[Incomplete, ...] = ()
    retention: tuple[int, int] | None = None  # (keep_quarantined, keep_archived) when reclaiming
    before_launch: tuple[PlannedEvent, ...] = ()  # recorded once the resume is prepared
    at_start: tuple[PlannedEvent, ...] = ()  # recorded in the transaction that starts it
    started: str = ""  # the reason of the transition to running
    remedy: str | None = None

    @property
    def resumed_from(self) -> str | None:
        ckpt = self.resume.checkpoint if self.resume else None
        return str(ckpt.path) if ckpt is not None else None

    @property
    def resumed_step(self) -> int | None:
        ckpt = self.resume.checkpoint if self.resume else None
        return ckpt.step if ckpt is not None else None


def plan_attempt(facts: JobFacts) -> Refuse | AttemptPlan:
    if facts.crash_interruptions >= facts.max_interruptions:
        return Refuse(f"the supervisor was restarted {facts.max_interruptions} times while this job's "
                      "attempts ran (it may be crashing the supervisor or the box); not starting it again "
                      f"on its own: `oom-supervisor retry {facts.job_id}` does")
    spec = facts.spec
    if spec is None:
        return Refuse(f"job file no longer valid: {facts.spec_error}")
    kind = kind_of(spec)
    chosen = choose_overrides(facts, learns=kind.learns)
    if isinstance(chosen, Refuse):
        return chosen
    overrides, source = chosen
    output_dir = kind.output_dir(spec) if kind.resumes else None
    asked = facts.asked_world_size or facts.world_size
    fit = fit_world(spec, overrides, asked=asked, world=facts.world_size) if kind.learns else WorldFit()
    if isinstance(fit, Refuse):
        return fit
    launched = fit.apply(overrides)  # what really runs on this world size (recorded: `overrides`)

    before: list[PlannedEvent] = []
    if fit.note:
        before.append(PlannedEvent("world_size_change", fit.note, {"asked": asked, "world": facts.world_size,
                                                                   "yaml": dict(fit.yaml)}))
    resume = None
    if output_dir is not None and facts.resume is not None:
        resume = _plan_resume(facts, overrides, launched, before)
        if isinstance(resume, Refuse):
            return resume
    rendered = _render(facts, kind, launched, resume, world_changed=bool(fit.note))
    if isinstance(rendered, Refuse):
        return rendered

    remedy = remedy_text(overrides)
    if fit.note:
        remedy = f"{remedy}; {fit.note}" if remedy else fit.note
    plan = AttemptPlan(
        number=facts.number, spec=spec, overrides=overrides, source=source, rendered=rendered,
        env=compose_environment(facts.base_env, spec.sup.env, rendered.env, facts.visibility),
        output_dir=output_dir, hang_timeout=spec.sup.hang_timeout or facts.default_hang_timeout,
        resume=resume, world_size=facts.world_size, quarantine=tuple(facts.resume.scan.incomplete) if resume is not None else (),
        retention=((facts.policy.retention.keep_quarantined, facts.policy.retention.keep_archived)
                   if resume is not None and facts.policy is not None else None),
        before_launch=tuple(before), remedy=remedy)
    learned_why = facts.learned.why if source == "learned" and facts.learned else None
    at_start = ((PlannedEvent("learned_plan", learned_why, {"overrides": overrides.to_dict()}),)
                if learned_why else ())
    started = (f"attempt {facts.number} started" + (f" (remedy: {remedy})" if remedy else "")
               + (f", resuming from {plan.resumed_from}" if plan.resumed_from else "")
               + (f"; {learned_why}" if learned_why else ""))
    return dataclasses.replace(plan, at_start=at_start, started=started)


def _plan_resume(facts: JobFacts, overrides: Overrides, launched: Overrides,
                 before: list[PlannedEvent]) -> Refuse | ResumePlan:
    """Where the attempt resumes from, and whether that checkpoint can be loaded at all; the
    notes for the record go to `before` (events recorded before the launch)."""
    resume = plan_the_resume(facts, overrides, launched=launched)
    if isinstance(resume, Refuse):
        return resume
    if resume.user_note:
        before.append(PlannedEvent("resume_choice", resume.user_note))
    if resume.checkpoint is not None or resume.mode != "fresh":
        before.append(PlannedEvent("resume_plan", resume.reason,
                                   {"mode": resume.mode, "semantic_change": resume.semantic_change}))
    if resume.semantic_change:
        before.append(PlannedEvent("semantic_change", f"TRAINING SEMANTICS CHANGE: {resume.semantic_change}"))
    load = load_check_of(facts, launched, resume)
    if load.refuse:
        return Refuse(f"cannot resume: {load.refuse}")
    if load.note:
        before.append(PlannedEvent("load_check", load.note, load.numbers))
    return resume


def _render(facts: JobFacts, kind: JobKind, launched: Overrides, resume: ResumePlan | None, *,
            world_changed: bool) -> Refuse | RenderedAttempt:
    """The files the attempt really launches, checked together the way transformers will."""
    spec = facts.spec
    rendering = launched
    ds_now = deepspeed_of(launched, facts.job_deepspeed)
    if resume is not None and resume.deepspeed:
        if ds_now is None:
            return Refuse(f"the resume needs DeepSpeed settings {sorted(resume.deepspeed)} but attempt "
                          f"{facts.number} runs without DeepSpeed")
        # The attempt's own copy of its DeepSpeed JSON (the user's file is never edited).
        rendering = dataclasses.replace(rendering, deepspeed=merged(ds_now, resume.deepspeed), notes=(
            *rendering.notes, ("DeepSpeed: the attempt's own copy of the job's DeepSpeed config with "
                               f"{_keys(resume.deepspeed)} merged, to resume from the universal checkpoint")))
        if resume.checkpoint is not None and resume.checkpoint.zero_stage == 3:
            rendering = dataclasses.replace(rendering, env={**rendering.env, DS_UNIVERSAL_FIX_ENV: "1"})
    if world_changed and (synced := _synced_batch_fields(deepspeed_of(rendering, facts.job_deepspeed), launched,
                                                         spec, facts.world_size)) is not None:
        rendering = dataclasses.replace(rendering, deepspeed=synced, notes=(
            *rendering.notes, f"DeepSpeed: explicit batch fields of the attempt's copy set for {facts.world_size} ranks"))
    try:
        rendered = render_attempt(spec, with_policy_switches(rendering, facts.policy),
                                  attempt_dir=facts.attempt_dir,
                                  resume_yaml=dict(resume.yaml) if resume else {}, launcher=list(facts.launcher))
    except Exception as exc:  # noqa: BLE001 - a render bug refuses the attempt with its reason instead of stalling the job
        return Refuse(f"cannot render attempt {facts.number}: {exc}")
    mismatched = kind.check(rendered, spec, world_size=facts.world_size, user_deepspeed=facts.job_deepspeed)
    if mismatched:
        return Refuse(f"attempt {facts.number} would launch a YAML and a DeepSpeed JSON that transformers "
                      "refuses together: " + "; ".join(map(str, mismatched)))
    return rendered


def choose_overrides(facts: JobFacts, *, learns: bool) -> Refuse | tuple[Overrides, str]:
    """The escalation the last verdict chose; for a first attempt of a kind that learns, what earlier
    nights observed (or their refusal); else the job as written."""
    if facts.escalation is not None:
        return facts.escalation, "escalation"
    if facts.number == 1 and learns and facts.learned is not None:
        if facts.learned.refusal:
            return Refuse(f"this box cannot run the job, not even at the last remedy: {facts.learned.refusal}")
        if facts.learned.overrides.rungs or facts.learned.why:
            return facts.learned.overrides, "learned"
    return Overrides(), "job"


def plan_the_resume(facts: JobFacts, overrides: Overrides, *, launched: Overrides | None = None
                    ) -> Refuse | ResumePlan:
    """How the attempt continues from the newest complete checkpoint (or why it cannot).
    `launched`: the overrides fitted to the world size it really runs on (default: `overrides`)."""
    assert facts.resume is not None and facts.spec is not None
    if facts.policy is None:
        return Refuse(f"cannot plan the resume: {facts.policy_error}")
    r = facts.resume
    spec = facts.spec
    launched = launched or overrides
    output_dir = kind_of(spec).output_dir(spec)
    choice = choose_checkpoint(user_value(spec.config), scan=r.scan, user=r.user,
                               first_attempt=facts.number == 1, output_dir=output_dir)
    if choice.refuse:
        return Refuse(choice.refuse)
    asked = facts.asked_world_size or facts.world_size
    try:
        nxt = run_shape({**spec.config, **launched.yaml}, world_size=facts.world_size,
                        deepspeed_cfg=deepspeed_of(launched, facts.job_deepspeed))
        nxt = dataclasses.replace(nxt, lean_load="universal_load" in launched.rungs)
        prev = None
        if r.prev_overrides is not None:
            # The run that wrote the checkpoint, on the ranks that wrote it, as fitted to them.
            ck_world = (choice.checkpoint.world_size if choice.checkpoint is not None else None) or facts.world_size
            fitted = fit_world(spec, r.prev_overrides, asked=asked, world=ck_world)
            was = fitted.apply(r.prev_overrides) if isinstance(fitted, WorldFit) else r.prev_overrides
            prev = run_shape({**spec.config, **was.yaml}, world_size=ck_world,
                             deepspeed_cfg=deepspeed_of(was, facts.job_deepspeed))
        plan = plan_resume(choice.checkpoint, prev=prev, nxt=nxt, transformers_version=r.transformers_version,
                           allow_weights_only=facts.policy.allow_weights_only,
                           allow_universal=facts.policy.allow_universal_checkpoint,
                           archive_name=f"attempt-{facts.number}", output_dir=output_dir)
    except Exception as exc:  # noqa: BLE001 - a resume-planning bug refuses the attempt with its reason
        return Refuse(f"cannot plan the resume: {exc}")
    if plan.mode == "refuse":
        return Refuse(plan.reason)
    if choice.archive_above is not None and output_dir is not None:
        above = None if choice.archive_above < 0 else choice.archive_above
        name = f"attempt-{facts.number}-" + ("before-this-job" if above is None else f"newer-than-step-{above}")
        plan = dataclasses.replace(plan, fixups=(Fixup("archive_checkpoints", output_dir, value=above,
                                                       target=output_dir / ARCHIVE_DIR / name), *plan.fixups))
    if choice.note:
        plan = dataclasses.replace(plan, user_note=choice.note)
    return plan


def load_check_of(facts: JobFacts, launched: Overrides, resume: ResumePlan) -> LoadCheck:
    """The optimizer state the resume must load, against the host's and the GPUs' memory."""
    assert facts.spec is not None
    shape = run_shape({**facts.spec.config, **launched.yaml}, world_size=facts.world_size,
                      deepspeed_cfg=deepspeed_of(launched, facts.job_deepspeed))
    limit = facts.spec.sup.host_memory_limit
    budget = limit
    if budget is None and facts.host_ram_bytes:
        reserve = facts.policy.host_ram_reserve if facts.policy is not None else 0.1
        budget = max(0, int(facts.host_ram_bytes * (1 - reserve)) - (facts.host_used_by_others_bytes or 0))
    return check_load(resume.checkpoint, mode=resume.mode, world=facts.world_size,
                      offload_optimizer=shape.offload_optimizer, host_limit=limit, host_ram=facts.host_ram_bytes,
                      host_budget=budget, gpu_capacity=facts.gpu_capacity_bytes,
                      lean="universal_load" in launched.rungs)


def deepspeed_of(overrides: Overrides, job_deepspeed: Mapping[str, Any] | None) -> dict | None:
    """The DeepSpeed config an attempt runs with: the remedy's generated one, else the job's."""
    if overrides.deepspeed is not None:
        return dict(overrides.deepspeed)
    return dict(job_deepspeed) if job_deepspeed is not None else None


def with_policy_switches(overrides: Overrides, policy: Policy | None) -> Overrides:
    """What the policy switches off for every attempt (rendered, not recorded as a remedy)."""
    if policy is not None and not policy.emergency_checkpoint:
        return dataclasses.replace(overrides, env={**overrides.env, EMERGENCY_CKPT_ENV: "0"})
    if policy is not None and policy.emergency_budget_s is not None:
        return dataclasses.replace(overrides, env={**overrides.env, EMERGENCY_BUDGET_ENV: f"{policy.emergency_budget_s:g}"})
    return overrides


def merged(cfg: Mapping[str, Any], keys: Mapping[str, Any]) -> dict[str, Any]:
    """`cfg` with `keys` merged in (one level deep: `checkpoint: {load_universal: true}` keeps the
    section's other keys)."""
    out = dict(cfg)
    for k, v in keys.items():
        out[k] = {**out[k], **v} if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def _keys(keys: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in keys.items())


# --------------------------------------------------------------------------- world size


@dataclass(frozen=True)
class WorldFit:
    """What an attempt on `world` ranks changes so that the effective batch stays what it is on
    the ranks the job asked for: gradient accumulation first, the micro-batch only downwards."""

    yaml: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    note: str | None = None

    def apply(self, overrides: Overrides) -> Overrides:
        if not self.yaml and not self.env:
            return overrides
        return dataclasses.replace(overrides, yaml={**overrides.yaml, **self.yaml}, env={**overrides.env, **self.env})


def batch_split(config: Mapping[str, Any], overrides: Overrides) -> tuple[int, int]:
    cfg = {**config, **overrides.yaml}
    return int(cfg.get("per_device_train_batch_size", 8)), int(cfg.get("gradient_accumulation_steps", 1))


def fit_world(spec: JobSpec, overrides: Overrides, *, asked: int, world: int) -> WorldFit | Refuse:
    """Keep micro x accumulation x ranks exactly when the attempt runs on `world` ranks instead of
    the `asked` ones (a GPU taken, faulted or removed; `fewer_gpus` in the policy)."""
    if world == asked or world < 1:
        return WorldFit()
    micro, accum = batch_split(spec.config, overrides)
    effective = micro * accum * asked
    if effective % world:
        return Refuse(f"runs on {world} ranks instead of {asked}, and its effective batch {micro}x{accum}x{asked} "
                      f"= {effective} cannot be split exactly over {world}: wait for the GPUs it asked for, or "
                      "change the batch or `gpus:`")
    per_rank = effective // world
    new_micro = max(d for d in range(1, min(micro, per_rank) + 1) if per_rank % d == 0)
    new_accum = per_rank // new_micro
    yaml: dict[str, Any] = {}
    if new_micro != micro:
        yaml["per_device_train_batch_size"] = new_micro
    if new_accum != accum:
        yaml["gradient_accumulation_steps"] = new_accum
    env = {}
    if "NPROC_PER_NODE" in {**spec.sup.env, **overrides.env} or spec.sup.nproc_per_node:
        env["NPROC_PER_NODE"] = str(world)  # the ranks are pinned: pin them to what it really has
    changed = ", ".join([f"per_device_train_batch_size {micro} -> {new_micro}"] * (new_micro != micro)
                        + [f"gradient_accumulation_steps {accum} -> {new_accum}"] * (new_accum != accum))
    note = (f"world size {asked} -> {world}: {changed or 'no batch change'}; effective batch "
            f"{micro}x{accum}x{asked} = {new_micro}x{new_accum}x{world} = {effective} kept")
    return WorldFit(yaml, env, note)


def world_keeping_batch(config: Mapping[str, Any], asked: int, free: int) -> int | None:
    """The most ranks, at most `free`, over which the job's effective batch splits exactly."""
    micro, accum = batch_split(config, Overrides())
    effective = micro * accum * asked
    return next((k for k in range(min(free, asked), 0, -1) if effective % k == 0), None)


def _synced_batch_fields(ds: Mapping[str, Any] | None, launched: Overrides, spec: JobSpec,
                         world: int) -> dict[str, Any] | None:
    """The DeepSpeed config with its explicit batch fields set for `world` ranks (None: none)."""
    if not ds:
        return None
    from supervisor.intake.deepspeed_config import with_batch_fields

    micro, accum = batch_split(spec.config, launched)
    return with_batch_fields(ds, micro=micro, accum=accum, world_size=world)


def compose_environment(base: Mapping[str, str], job_env: Mapping[str, str], attempt_env: Mapping[str, str],
                        visibility: Mapping[str, str]) -> dict[str, str]:
    """The job's environment: the base, the job's own `env:`, the GPUs assigned, then what this
    attempt sets (the start-up hook's PYTHONPATH and the launcher's bin directory on PATH go first;
    what the job would have had follows)."""
    env = {**base, **job_env}
    if visibility:
        env.update(visibility)
        for name in VISIBILITY_VARS:
            if name not in visibility:
                env.pop(name, None)  # one filter only: ROCR then HIP would index twice
    inherited = {k: env.get(k) for k in ("PYTHONPATH", "PATH")}
    env.update(attempt_env)
    for name, before in inherited.items():  # what the attempt puts first, then what the job had
        if name == "PATH" and name in attempt_env and name not in job_env:
            before = before or os.defpath  # a PATH of the launcher's directory alone finds no shell
        if name in attempt_env and before and name not in job_env and before != attempt_env[name]:
            env[name] = f"{attempt_env[name]}{os.pathsep}{before}"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def remedy_text(overrides: Overrides) -> str | None:
    """'micro_batch x2 (per_device_train_batch_size=4, gradient_accumulation_steps=4)'."""
    if not overrides.rungs:
        return None
    names = list(dict.fromkeys(overrides.rungs))
    counted = [f"{n} x{overrides.rungs.count(n)}" if overrides.rungs.count(n) > 1 else n for n in names]
    settings = [f"{k}={v}" for k, v in overrides.yaml.items()]
    if overrides.deepspeed is not None:
        settings.append("deepspeed=the attempt's own ds_config.json"
                        + (" (checkpoint.load_universal)" if "universal_load" in overrides.rungs else
                           " (generated ZeRO-3)"))
    settings += [f"{k}={v}" for k, v in overrides.env.items() if k.endswith("ALLOC_CONF")][:1]
    return " + ".join(counted) + (f" ({', '.join(settings)})" if settings else "")
