"""A learned start that ran out of memory (pure): its prediction was wrong, so the next attempt is
the configuration last seen to fit for this kind, not a climb from the failed guess.

Why (issue 27): night 2 of a job started at a cheaper learned configuration (24x1 + ZeRO-3
optimizer offload), ran out of host memory, and the ladder then cut the micro-batch under the
offload (12, 6, 3, 1) until it failed; 3x8, which fit the night before, was never tried again.

Rules kept:
  * Only the learned start itself falls back: the attempt that failed ran the configuration its
    `Overrides.learned` account was made for, and nothing else ran before it in this job. What it
    falls back to carries no account, so its own OOM climbs the ladder as any attempt's.
  * The fallback is the account's known fit (same effective batch, allowed by the job's policy);
    one that already ran out in this job is not taken again.
  * Without a known fit, what learning added beyond the micro-batch split (checkpointing, an
    offload) is taken away first: the ordinary ladder goes on from the split alone, never cutting
    the micro-batch under what learning added.
  * The failed start is recorded as an OOM observation (record/observations.py) like every
    attempt, so a later learned start does not choose it again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from supervisor.core.models import (
    AttemptRecord,
    Category,
    Change,
    Decision,
    DecisionKind,
    Diagnosis,
    JobContext,
    Overrides,
)
from supervisor.judge.policy.learn import label
from supervisor.judge.policy.schema import Policy

OOM = frozenset({Category.GPU_OOM, Category.HOST_OOM})


def changes_between(job: JobContext, old: Overrides, new: Overrides, why: str,
                    defaults: Mapping[str, Any]) -> tuple[Change, ...]:
    """Every key that differs, those the new configuration drops included (back to the job's own
    value, or LLaMA-Factory's default)."""
    out: list[Change] = []
    for k in sorted({*old.yaml, *new.yaml}):
        before = old.yaml.get(k, job.config.get(k, defaults.get(k)))
        after = new.yaml.get(k, job.config.get(k, defaults.get(k)))
        if before != after:
            out.append(Change("yaml", k, before, after, why))
    for k in sorted({*old.env, *new.env}):
        if old.env.get(k) != new.env.get(k):
            out.append(Change("env", k, old.env.get(k), new.env.get(k), why))
    if old.deepspeed != new.deepspeed:
        out.append(Change("deepspeed", "(generated ds_config.json)", old.deepspeed, new.deepspeed, why))
    return tuple(out)


def learned_fallback(job: JobContext, history: Sequence[AttemptRecord], diag: Diagnosis, policy: Policy,
                     current: Overrides, ladder: Callable[..., Decision],
                     defaults: Mapping[str, Any]) -> Decision | None:
    """The decision after a learned start's OOM; None when the attempt was no learned start (the
    ladder decides). `ladder` is decide's OOM ladder, asked from the split without what learning
    added when no fit is known."""
    info = current.learned
    if not info or diag.category not in OOM:
        return None
    fp = current.fingerprint()
    if any(a.overrides.fingerprint() != fp for a in history):
        return None
    failed = {a.overrides.fingerprint() for a in history if a.diagnosis is not None and a.diagnosis.category in OOM}
    ran_out = "GPU memory" if diag.category == Category.GPU_OOM else "host memory"
    head = f"the learned start {label(job, current)} ran out of {ran_out}"
    if info.get("fallback"):
        back = Overrides.from_dict({**info["fallback"], "learned": None})
        if back.fingerprint() not in failed:
            why = f"back to {info.get('fallback_label')}, which fit {info.get('fallback_seen')}"
            back = Overrides(back.rungs, back.yaml, back.env, back.deepspeed, (*back.notes, f"learned_fallback: {why}"))
            return Decision(DecisionKind.ESCALATE, f"{head}; {why}: the prediction was wrong ({diag.summary})",
                            rung="learned_fallback", overrides=back,
                            changes=changes_between(job, current, back, f"{head}; {why}", defaults))
    added, without = info.get("added") or [], info.get("without")
    if not added or without is None:
        return None  # nothing learning added: the ladder goes on from the split as it is
    base = Overrides.from_dict(without)
    sub = ladder(job, history, diag, policy, base)
    what = (f"{head} and no configuration of this kind is known to fit: what learning added "
            f"({', '.join(added)}) is taken away first, and the micro-batch is cut without it")
    if sub.kind != DecisionKind.ESCALATE or sub.overrides is None:
        return Decision(sub.kind, f"{what}; {sub.reason}", delay_s=sub.delay_s, rung=sub.rung,
                        overrides=sub.overrides, changes=sub.changes)
    return Decision(DecisionKind.ESCALATE, f"{what}; {sub.reason}", rung=sub.rung, overrides=sub.overrides,
                    changes=changes_between(job, current, sub.overrides, what, defaults))
