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
from supervisor.judge.kinds import kind_of
from supervisor.judge.policy.render import (
    DS_CONFIG,
    EMERGENCY_CKPT_ENV,
    RenderedAttempt,
    render_attempt,
)
from supervisor.judge.policy.schema import Policy
from supervisor.judge.resume import ARCHIVE_DIR, Fixup, Incomplete, ResumePlan, Scan, plan_resume, run_shape
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
    launcher: tuple[str, ...] = ()
    attempt_dir: Path = Path(".")
    base_env: Mapping[str, str] = field(default_factory=dict)  # what every job starts from
    visibility: Mapping[str, str] = field(default_factory=dict)  # the GPUs the daemon assigned
    job_deepspeed: Mapping[str, Any] | None = None  # the job's own DeepSpeed config, read at the edge
    resume: ResumeFacts | None = None
    default_hang_timeout: float = 0.0


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

    resume = None
    before: list[PlannedEvent] = []
    if output_dir is not None and facts.resume is not None:
        planned = plan_the_resume(facts, overrides)
        if isinstance(planned, Refuse):
            return planned
        resume = planned
        if resume.user_note:
            before.append(PlannedEvent("resume_choice", resume.user_note))
        if resume.checkpoint is not None or resume.mode != "fresh":
            before.append(PlannedEvent("resume_plan", resume.reason,
                                       {"mode": resume.mode, "semantic_change": resume.semantic_change}))
        if resume.semantic_change:
            before.append(PlannedEvent("semantic_change", f"TRAINING SEMANTICS CHANGE: {resume.semantic_change}"))

    try:
        rendered = render_attempt(spec, with_policy_switches(overrides, facts.policy),
                                  attempt_dir=facts.attempt_dir,
                                  resume_yaml=dict(resume.yaml) if resume else {}, launcher=list(facts.launcher))
        if resume is not None and resume.deepspeed:
            merge_deepspeed(rendered.files, resume.deepspeed)
    except Exception as exc:
        return Refuse(f"cannot render attempt {facts.number}: {exc}")
    mismatched = kind.check(rendered, spec, world_size=facts.world_size, user_deepspeed=facts.job_deepspeed)
    if mismatched:
        return Refuse(f"attempt {facts.number} would launch a YAML and a DeepSpeed JSON that transformers "
                      "refuses together: " + "; ".join(map(str, mismatched)))

    remedy = remedy_text(overrides)
    plan = AttemptPlan(
        number=facts.number, spec=spec, overrides=overrides, source=source, rendered=rendered,
        env=compose_environment(facts.base_env, spec.sup.env, rendered.env, facts.visibility),
        output_dir=output_dir, hang_timeout=spec.sup.hang_timeout or facts.default_hang_timeout,
        resume=resume, quarantine=tuple(facts.resume.scan.incomplete) if resume is not None else (),
        retention=((facts.policy.retention.keep_quarantined, facts.policy.retention.keep_archived)
                   if resume is not None and facts.policy is not None else None),
        before_launch=tuple(before), remedy=remedy)
    learned_why = facts.learned.why if source == "learned" and facts.learned else None
    at_start = ((PlannedEvent("learned_plan", learned_why, {"overrides": overrides.to_dict()}),)
                if learned_why else ())
    started = (f"attempt {facts.number} started" + (f" (remedy: {remedy})" if overrides.rungs else "")
               + (f", resuming from {plan.resumed_from}" if plan.resumed_from else "")
               + (f"; {learned_why}" if learned_why else ""))
    return dataclasses.replace(plan, at_start=at_start, started=started)


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


def plan_the_resume(facts: JobFacts, overrides: Overrides) -> Refuse | ResumePlan:
    """How the attempt continues from the newest complete checkpoint (or why it cannot)."""
    assert facts.resume is not None and facts.spec is not None
    if facts.policy is None:
        return Refuse(f"cannot plan the resume: {facts.policy_error}")
    r = facts.resume
    spec = facts.spec
    output_dir = kind_of(spec).output_dir(spec)
    choice = choose_checkpoint(user_value(spec.config), scan=r.scan, user=r.user,
                               first_attempt=facts.number == 1, output_dir=output_dir)
    if choice.refuse:
        return Refuse(choice.refuse)
    try:
        nxt = run_shape({**spec.config, **overrides.yaml}, world_size=facts.world_size,
                        deepspeed_cfg=deepspeed_of(overrides, facts.job_deepspeed))
        prev = (run_shape({**spec.config, **r.prev_overrides.yaml}, world_size=facts.world_size,
                          deepspeed_cfg=deepspeed_of(r.prev_overrides, facts.job_deepspeed))
                if r.prev_overrides is not None else None)
        plan = plan_resume(choice.checkpoint, prev=prev, nxt=nxt, transformers_version=r.transformers_version,
                           allow_weights_only=facts.policy.allow_weights_only,
                           allow_universal=facts.policy.allow_universal_checkpoint,
                           archive_name=f"attempt-{facts.number}", output_dir=output_dir)
    except Exception as exc:
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


def deepspeed_of(overrides: Overrides, job_deepspeed: Mapping[str, Any] | None) -> dict | None:
    """The DeepSpeed config an attempt runs with: the remedy's generated one, else the job's."""
    if overrides.deepspeed is not None:
        return dict(overrides.deepspeed)
    return dict(job_deepspeed) if job_deepspeed is not None else None


def with_policy_switches(overrides: Overrides, policy: Policy | None) -> Overrides:
    """What the policy switches off for every attempt (rendered, not recorded as a remedy)."""
    if policy is not None and not policy.emergency_checkpoint:
        return dataclasses.replace(overrides, env={**overrides.env, EMERGENCY_CKPT_ENV: "0"})
    return overrides


def merge_deepspeed(files: dict[str, str], keys: Mapping[str, Any]) -> None:
    """Resume needs DeepSpeed keys (e.g. load_universal) in the attempt's generated JSON."""
    import json

    if DS_CONFIG not in files:
        raise RuntimeError("the resume needs DeepSpeed settings "
                           f"{sorted(keys)} but this attempt has no generated DeepSpeed config")
    cfg = json.loads(files[DS_CONFIG])
    for k, v in keys.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    files[DS_CONFIG] = json.dumps(cfg, indent=2) + "\n"


def compose_environment(base: Mapping[str, str], job_env: Mapping[str, str], attempt_env: Mapping[str, str],
                        visibility: Mapping[str, str]) -> dict[str, str]:
    """The job's environment: the base, the job's own `env:`, the GPUs assigned, then what this
    attempt sets (the start-up hook's PYTHONPATH goes first; what the job would have had follows)."""
    env = {**base, **job_env}
    if visibility:
        env.update(visibility)
        for name in VISIBILITY_VARS:
            if name not in visibility:
                env.pop(name, None)  # one filter only: ROCR then HIP would index twice
    inherited_path = env.get("PYTHONPATH")
    env.update(attempt_env)
    if "PYTHONPATH" in attempt_env and inherited_path and "PYTHONPATH" not in job_env:
        env["PYTHONPATH"] = f"{attempt_env['PYTHONPATH']}{os.pathsep}{inherited_path}"
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
        settings.append("deepspeed=generated ZeRO-3 config")
    settings += [f"{k}={v}" for k, v in overrides.env.items() if k.endswith("ALLOC_CONF")][:1]
    return " + ".join(counted) + (f" ({', '.join(settings)})" if settings else "")
