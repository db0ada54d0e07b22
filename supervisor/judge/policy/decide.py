"""decide(): one pure function from (job, history, diagnosis, policy) to a Decision.

The order of remedies comes from the policy's ladder, reshaped by what the
diagnosis says: where the OOM happened (model load, evaluation, resume), what
kind it was (fragmentation, outside the caching allocator, host RAM) and how
large the shortfall is. A configuration that already failed with an OOM is
never tried again; budgets are counted per cause from the history.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from tenacity import RetryCallState, wait_exponential

from supervisor.core.models import (
    AttemptRecord,
    Category,
    Change,
    Decision,
    DecisionKind,
    Diagnosis,
    JobContext,
    Overrides,
    Phase,
)
from supervisor.judge.policy import rungs as R
from supervisor.judge.policy import search as S
from supervisor.judge.policy.estimate import model_states
from supervisor.judge.policy.outage import decide_environment
from supervisor.judge.policy.schema import ENV_ONLY_RUNGS, Policy

GiB = 1 << 30
OOM = frozenset({Category.GPU_OOM, Category.HOST_OOM})
TRANSIENT = frozenset({Category.COMM_FAILURE, Category.HANG, Category.CRASH_OTHER, Category.UNKNOWN})

_RUNGS: dict[str, Callable[..., Any]] = {
    "allocator": R.allocator, "memory_fraction": R.memory_fraction, "micro_batch": R.micro_batch,
    "eval_batch": R.eval_batch, "grad_checkpointing": R.grad_checkpointing,
    "zero3_offload_optimizer": R.zero3_offload_optimizer, "zero3_offload_param": R.zero3_offload_param,
    "cutoff_len": R.cutoff_len, "universal_load": R.universal_load, "sharded_save": R.sharded_save,
}
# What can help while a checkpoint is being loaded (nothing here changes what the model learns):
# a smaller micro-batch changes nothing there, so it is never offered for that phase.
LOAD_TIME = {
    "host_oom": ("universal_load",),
    "gpu_oom": ("zero3_offload_optimizer", "zero3_offload_param", "allocator"),
}
_OFFLOAD = ("zero3_offload_optimizer", "zero3_offload_param")


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GiB:.2f} GiB"


def backoff_delay(policy: Policy, retry_number: int, job_id: int) -> float:
    """tenacity's exponential wait for the n-th retry (1-based) plus a jitter drawn
    from a generator seeded by (job, n): the same inputs always give the same delay."""
    b = policy.backoff
    state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = max(1, retry_number)
    base = wait_exponential(multiplier=b.initial_s, max=b.max_s, exp_base=b.exp_base)(state)
    jitter = random.Random(f"{job_id}:{retry_number}").uniform(0, b.jitter_s)
    return round(min(b.max_s, base + jitter), 3)


def memory_picture(job: JobContext, ov: Overrides, diag: Diagnosis) -> R.Memory:
    """Split the failed attempt's demand into model states and activations, where numbers allow."""
    n = diag.numbers
    capacity = n.get("total_capacity") or job.gpu_capacity_bytes
    tried, free = n.get("tried_to_allocate"), n.get("free")
    shortfall = n.get("shortfall")
    if shortfall is None and tried is not None and free is not None:
        room = free
        if n.get("allowed") is not None and capacity is not None:
            # Under a memory cap the GPU's free memory is not PyTorch's: only allowed - in use is.
            room = min(free, max(0, n["allowed"] - (capacity - free - (n.get("held_by_others") or 0))))
        shortfall = max(0, tried - room)
    in_use = None
    if capacity is not None and free is not None:
        in_use = capacity - free - (n.get("held_by_others") or 0)  # this job's share only
    elif n.get("allocated_by_pytorch") is not None:
        in_use = n["allocated_by_pytorch"] + (n.get("reserved_unallocated") or 0)
    demand = in_use + tried if in_use is not None and tried is not None else None
    ms = act = None
    if job.param_count:
        v = R.view_of(job, ov)
        lil = job.largest_layer_params or job.param_count // 40
        ms, _ = model_states(job.param_count, lil, job.launched_world_size(), v.setup)
        if demand is not None and diag.phase not in (Phase.MODEL_LOAD, Phase.CHECKPOINT_LOAD):
            act = max(0, demand - ms)
    held = None
    if n.get("allocated_by_pytorch") is not None:
        held = n["allocated_by_pytorch"] + (n.get("reserved_unallocated") or 0)
    return R.Memory(shortfall=shortfall, capacity=capacity, demand=demand, model_states=ms,
                    activations=act, reserved_unallocated=n.get("reserved_unallocated"), pytorch_held=held)


def _order(job: JobContext, diag: Diagnosis, policy: Policy, ov: Overrides) -> list[str]:
    ladder = list(policy.ladder)
    if diag.phase == Phase.CHECKPOINT_LOAD:
        # Load-time remedies only, those the ladder lists (a universal load is allowed by
        # `allow_universal_checkpoint`: it changes how, not what, is loaded).
        order = [r for r in LOAD_TIME[str(diag.category)] if r in ladder or r == "universal_load"]
    elif diag.category == Category.HOST_OOM:
        first = ["micro_batch", "grad_checkpointing", "cutoff_len"]
        order = [r for r in first if r in ladder] + [r for r in ladder if r not in first and r not in _OFFLOAD
                                                      and r not in ("allocator", "memory_fraction")
                                                      and (r != "eval_batch" or diag.phase == Phase.EVALUATION)]
    elif diag.phase == Phase.EVALUATION:
        first = ["eval_batch", "allocator", "memory_fraction"]
        order = [r for r in first if r in ladder] + [r for r in ladder if r in _OFFLOAD]
    elif diag.phase == Phase.MODEL_LOAD:
        first = [*(["zero3_offload_optimizer"] if job.launched_world_size() > 1 else []), "zero3_offload_param"]
        order = [r for r in first if r in ladder] + [r for r in ("memory_fraction", "allocator") if r in ladder]
    else:
        order = list(ladder)
        if diag.subkind in R.NON_CACHING_SUBKINDS and "memory_fraction" in order:
            order.remove("memory_fraction")
            order.insert(0, "memory_fraction")
        elif diag.fragmentation and "allocator" in order:
            order.remove("allocator")
            order.insert(0, "allocator")
        elif "allocator" in order:
            # No sign of fragmentation: allocator tuning is unlikely to be the fix, try it late.
            order.remove("allocator")
            order.append("allocator")
        if diag.subkind not in R.NON_CACHING_SUBKINDS and "memory_fraction" in order:
            # A cap gives PyTorch less, never more: last resort for caching-allocator OOMs.
            order.remove("memory_fraction")
            order.append("memory_fraction")
        order = [r for r in order if r != "eval_batch"]
    if diag.phase == Phase.CHECKPOINT_SAVE:
        # The save's own memory first: under ZeRO-3 it gathers the whole model onto rank 0, which no
        # batch size changes (allowed by `allow_sharded_save`, as a universal load is by its flag).
        order = ["sharded_save", *order]
    if job.kind != "llamafactory":
        order = [r for r in order if r in ENV_ONLY_RUNGS]
    return order


def _changes(old: Overrides, new: Overrides, why: str) -> tuple[Change, ...]:
    out: list[Change] = []
    for k, v in new.yaml.items():
        if old.yaml.get(k, ...) != v:
            out.append(Change("yaml", k, old.yaml.get(k), v, why))
    for k, v in new.env.items():
        if old.env.get(k) != v:
            out.append(Change("env", k, old.env.get(k), v, why))
    if new.deepspeed != old.deepspeed:
        out.append(Change("deepspeed", "(generated ds_config.json)", old.deepspeed, new.deepspeed, why))
    return tuple(out)


def _escalate(ov: Overrides, applied: R.Applied, rung: str, reason: str) -> Decision:
    return Decision(DecisionKind.ESCALATE, reason, rung=rung, overrides=applied.overrides,
                    changes=_changes(ov, applied.overrides, applied.what))


def _no_progress_run(history: Sequence[AttemptRecord]) -> int:
    """Attempts since the last one that left a newer complete checkpoint.

    OOM attempts do not count: each runs a new configuration and the OOM
    budget bounds them; nor do outages of the surroundings (outage.py bounds them); this
    budget is for loops that repeat without gain.
    """
    best, run = -1, 0
    for a in history:
        step = a.checkpoint_step_after if a.checkpoint_step_after is not None else -1
        if step > best:
            best, run = step, 0
        elif not (a.diagnosis is not None and (a.diagnosis.category in OOM
                                               or a.diagnosis.category == Category.ENVIRONMENT)):
            run += 1
    return run


def decide(job: JobContext, history: Sequence[AttemptRecord], diagnosis: Diagnosis,
           policy: Policy) -> Decision:
    """What to do after an attempt ended. `history[-1]` is that attempt. The rules are asked in
    DECISION_STEPS' order; the first that decides wins."""
    current = history[-1].overrides if history else Overrides()
    for step in DECISION_STEPS:
        d = step(job, history, diagnosis, policy, current)
        if d is not None:
            return d
    return Decision(DecisionKind.FAIL, f"no rule for {diagnosis.category}: {diagnosis.summary}")


def _done(job: JobContext, history: Sequence[AttemptRecord], diagnosis: Diagnosis, policy: Policy,
          current: Overrides) -> Decision | None:
    """Training finished."""
    cat = diagnosis.category
    if cat == Category.SUCCESS:
        return Decision(DecisionKind.DONE, "training finished", overrides=current)
    return None


def _hint_only(job: JobContext, history: Sequence[AttemptRecord], diagnosis: Diagnosis, policy: Policy,
               current: Overrides) -> Decision | None:
    """A terminal category from free text only: retried, never final."""
    cat = diagnosis.category
    hint = getattr(diagnosis, "strength", "structural") == "hint"
    if hint and cat in (Category.CONFIG_ERROR, Category.DISK_FULL, Category.NUMERIC, Category.DEVICE_FAULT):
        # Free text in the log, not the exception that ended it: never a terminal verdict.
        n = sum(1 for a in history if a.diagnosis is not None
                and getattr(a.diagnosis, "strength", "structural") == "hint")
        if n <= policy.budgets.transient_retries and len(history) < min(policy.budgets.max_attempts,
                                                                        job.max_attempts):
            return _retry(job, current, policy, n, f"{cat} only as a hint (a log line, not the error that "
                                                   f"ended the attempt: {diagnosis.summary}); same configuration "
                                                   f"again, retry {n} of {policy.budgets.transient_retries}")
        return Decision(DecisionKind.FAIL, f"{n} attempts ended with only a hint of {cat} "
                                           f"(budget {policy.budgets.transient_retries}): {diagnosis.summary}")
    return None


def _config_error(job: JobContext, history: Sequence[AttemptRecord], diagnosis: Diagnosis, policy: Policy,
                  current: Overrides) -> Decision | None:
    """The user's configuration: final, unless this configuration trained before."""
    cat = diagnosis.category
    if cat == Category.CONFIG_ERROR:
        trained = _trained_before(history, current)
        suspects = sum(1 for a in history[:-1] if a.diagnosis is not None
                       and a.diagnosis.category == Category.CONFIG_ERROR
                       and a.overrides.fingerprint() == current.fingerprint())
        if trained is not None and suspects == 0:
            return _retry(job, current, policy, 1, (
                f"configuration error ({diagnosis.summary}), but attempt {trained.number} trained this same "
                f"configuration to step {trained.max_step}: suspect (a file or service that came and went), "
                "retrying once"))
        return Decision(DecisionKind.FAIL, f"configuration error, no retry can fix it: {diagnosis.summary}"
                        + (" (a retry of this configuration, which trained before, failed the same way)"
                           if trained is not None else ""))
    return None


def _environment(job: JobContext, history: Sequence[AttemptRecord], diagnosis: Diagnosis, policy: Policy,
                 current: Overrides) -> Decision | None:
    """The hub, DNS, the network: retried with backoff, then waited for (outage.py)."""
    if diagnosis.category == Category.ENVIRONMENT:
        return decide_environment(job, history, diagnosis, policy, current, _retry)
    return None


def _disk_full(job: JobContext, history: Sequence[AttemptRecord], diagnosis: Diagnosis, policy: Policy,
               current: Overrides) -> Decision | None:
    """The queue pauses until space is freed."""
    cat = diagnosis.category
    if cat == Category.DISK_FULL:
        return Decision(DecisionKind.PAUSE, f"disk full: the queue pauses until space is freed "
                                            f"({diagnosis.summary})", overrides=current)
    return None


def _budget_spent(job: JobContext, history: Sequence[AttemptRecord], diagnosis: Diagnosis, policy: Policy,
                  current: Overrides) -> Decision | None:
    """The attempt budget (outages of the surroundings are not the job's attempts: outage.py bounds them)."""
    cat = diagnosis.category
    limit = min(policy.budgets.max_attempts, job.max_attempts)
    used = sum(1 for a in history if a.diagnosis is None or a.diagnosis.category != Category.ENVIRONMENT)
    if used >= limit:
        return Decision(DecisionKind.FAIL, f"attempt budget spent ({used} of {limit}); "
                                           f"last failure: {cat}: {diagnosis.summary}")
    return None


def _stalled(job: JobContext, history: Sequence[AttemptRecord], diagnosis: Diagnosis, policy: Policy,
             current: Overrides) -> Decision | None:
    """Attempts in a row without checkpoint progress."""
    stalled = _no_progress_run(history)
    if stalled >= policy.budgets.no_progress_attempts:
        return Decision(DecisionKind.FAIL, f"{stalled} attempts in a row made no checkpoint progress "
                                           f"(budget {policy.budgets.no_progress_attempts}); last: {diagnosis.summary}")
    return None


def _numeric(job: JobContext, history: Sequence[AttemptRecord], diagnosis: Diagnosis, policy: Policy,
             current: Overrides) -> Decision | None:
    """NaN/inf: final unless the policy retries it."""
    cat = diagnosis.category
    count = sum(1 for a in history if a.diagnosis is not None and a.diagnosis.category == cat)
    if cat == Category.NUMERIC:
        if policy.retry_numeric and count <= policy.budgets.numeric_retries:
            return _retry(job, current, policy, count, f"numeric failure, retry {count} allowed by the policy")
        return Decision(DecisionKind.FAIL, f"numeric failure ({diagnosis.summary}); {_last_good(history, diagnosis)}; "
                                           "lower the learning rate, check the data for empty or extreme "
                                           "samples, prefer bf16 over fp16 (retry_numeric in the policy retries)")
    return None


def _device_fault(job: JobContext, history: Sequence[AttemptRecord], diagnosis: Diagnosis, policy: Policy,
                  current: Overrides) -> Decision | None:
    """A GPU fault: retried within its budget, then check the GPU."""
    cat = diagnosis.category
    count = sum(1 for a in history if a.diagnosis is not None and a.diagnosis.category == cat)
    if cat == Category.DEVICE_FAULT:
        if count <= policy.budgets.device_fault_retries:
            return _retry(job, current, policy, count, f"device fault, retry {count} of "
                                                       f"{policy.budgets.device_fault_retries}")
        return Decision(DecisionKind.FAIL, f"device fault again ({diagnosis.summary}): check the GPU "
                                           "(dmesg, rocm-smi / nvidia-smi) before resubmitting")
    return None


def _repeated_crash(job: JobContext, history: Sequence[AttemptRecord], diagnosis: Diagnosis, policy: Policy,
                    current: Overrides) -> Decision | None:
    """The same crash twice with no progress: a retry would repeat it."""
    cat = diagnosis.category
    if cat in (Category.CRASH_OTHER, Category.UNKNOWN) and _same_twice(history, diagnosis):
        return Decision(DecisionKind.FAIL, f"the same {cat} twice in a row with no progress between "
                                           f"({diagnosis.fingerprint}): a retry would repeat it, so the backoff "
                                           f"budget is not spent on it: {diagnosis.summary}")
    return None


def _transient(job: JobContext, history: Sequence[AttemptRecord], diagnosis: Diagnosis, policy: Policy,
               current: Overrides) -> Decision | None:
    """Crashes worth a retry of the same configuration."""
    cat = diagnosis.category
    if cat in TRANSIENT:
        n = sum(1 for a in history if a.diagnosis is not None and a.diagnosis.category in TRANSIENT)
        if n <= policy.budgets.transient_retries:
            return _retry(job, current, policy, n, f"{cat} ({diagnosis.summary}): same configuration again, "
                                                   f"retry {n} of {policy.budgets.transient_retries}")
        return Decision(DecisionKind.FAIL, f"{cat} persisted over {n} attempts "
                                           f"(budget {policy.budgets.transient_retries}): {diagnosis.summary}")
    return None


def _foreign_gpu_memory(job: JobContext, history: Sequence[AttemptRecord], diagnosis: Diagnosis, policy: Policy,
                        current: Overrides) -> Decision | None:
    """Others hold the GPU's memory: wait, the job unchanged."""
    cat = diagnosis.category
    if cat == Category.GPU_OOM and foreign_oom(diagnosis, policy):
        held = diagnosis.numbers["held_by_others"]
        n = sum(1 for a in history if a.diagnosis is not None and foreign_oom(a.diagnosis, policy))
        who = f"other processes hold {_gib(held)} of the GPU"
        if job.gpu_memory_holders:
            who += " (" + ", ".join(job.gpu_memory_holders[:5]) + ")"
        if n <= policy.budgets.foreign_memory_retries:
            return _retry(job, current, policy, n, f"{cat}: {who} (the job was short by only "
                                                   f"{_gib(_shortfall(diagnosis))}); waiting for it to be freed, "
                                                   f"the job unchanged; retry {n} of "
                                                   f"{policy.budgets.foreign_memory_retries}")
        return Decision(DecisionKind.FAIL, f"{cat}: {who}, still after {n} attempts (budget "
                                           f"{policy.budgets.foreign_memory_retries}): free that GPU or pin the "
                                           "job to others (gpus:); its own configuration was never the cause")
    return None


def _out_of_memory(job: JobContext, history: Sequence[AttemptRecord], diagnosis: Diagnosis, policy: Policy,
                   current: Overrides) -> Decision | None:
    """The escalation ladder."""
    cat = diagnosis.category
    if cat in OOM:
        from supervisor.judge.policy.fallback import learned_fallback

        back = learned_fallback(job, history, diagnosis, policy, current, _decide_oom, LF_DEFAULTS)
        return _with_original_values(job, back or _decide_oom(job, history, diagnosis, policy, current))
    return None


# The order the rules are asked in: success; a hint is never final; the terminal and paused
# categories; then the budgets; then per category, memory last.
DECISION_STEPS = (
    _done,
    _hint_only,
    _config_error,
    _environment,
    _disk_full,
    _budget_spent,
    _stalled,
    _numeric,
    _device_fault,
    _repeated_crash,
    _transient,
    _foreign_gpu_memory,
    _out_of_memory,
)


def _shortfall(d: Diagnosis) -> int | None:
    n = d.numbers
    if n.get("shortfall") is not None:
        return n["shortfall"]
    if n.get("tried_to_allocate") is not None and n.get("free") is not None:
        return max(0, n["tried_to_allocate"] - n["free"])
    return None


def foreign_oom(d: Diagnosis, policy: Policy) -> bool:
    """A GPU OOM that memory held by OTHER processes explains: without them it would have fit."""
    if d.category != Category.GPU_OOM:
        return False
    held = d.numbers.get("held_by_others")
    if not held or held < GiB:
        return False
    short = _shortfall(d)
    return short is not None and held >= short * policy.shortfall_margin


def _trained_before(history: Sequence[AttemptRecord], current: Overrides) -> AttemptRecord | None:
    """An earlier attempt of this same configuration that got past step 0, if any."""
    fp = current.fingerprint()
    return next((a for a in reversed(history[:-1]) if a.overrides.fingerprint() == fp and (a.max_step or 0) > 0),
                None)


def _same_twice(history: Sequence[AttemptRecord], diag: Diagnosis) -> bool:
    """The last two attempts: same category and fingerprint, same configuration, no progress."""
    if len(history) < 2 or not getattr(diag, "fingerprint", None):
        return False
    a, b = history[-2], history[-1]
    if a.diagnosis is None or a.diagnosis.category != diag.category:
        return False
    if getattr(a.diagnosis, "fingerprint", None) != diag.fingerprint:
        return False
    if a.overrides.fingerprint() != b.overrides.fingerprint():
        return False
    progressed = ((b.checkpoint_step_after or -1) > (a.checkpoint_step_after or -1)
                  or (b.max_step or 0) > (a.max_step or 0))
    return not progressed


def _last_good(history: Sequence[AttemptRecord], diag: Diagnosis) -> str:
    """Name the newest complete checkpoint written before the numbers went bad."""
    bad = diag.numbers.get("step")
    steps = sorted({a.checkpoint_step_after for a in history if a.checkpoint_step_after is not None})
    good = [s for s in steps if bad is None or s < bad]
    if good:
        return (f"the last good checkpoint is checkpoint-{good[-1]} (step {good[-1]}"
                + (f", before the first bad step {bad})" if bad is not None else ")"))
    if steps:
        return (f"checkpoint-{steps[-1]} was written at or after the first bad step {bad}: do not resume from it; "
                "an earlier checkpoint-N in output_dir may be good")
    return "no complete checkpoint was written before it"


def _with_original_values(job: JobContext, decision: Decision) -> Decision:
    """A key the overrides never set before had the user's value (or LLaMA-Factory's
    default), not None: say '16 -> 8', not 'None -> 8'."""
    import dataclasses

    fixed = tuple(
        dataclasses.replace(c, old=job.config.get(c.key, LF_DEFAULTS.get(c.key)))
        if c.target == "yaml" and c.old is None else c
        for c in decision.changes)
    return dataclasses.replace(decision, changes=fixed)


# LLaMA-Factory / transformers defaults of the keys the rungs change (facts.md).
LF_DEFAULTS = {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
               "per_device_eval_batch_size": 8, "cutoff_len": 2048,
               "disable_gradient_checkpointing": False, "use_unsloth_gc": False}


def _retry(job: JobContext, current: Overrides, policy: Policy, n: int, reason: str) -> Decision:
    delay = backoff_delay(policy, n, job.id)
    return Decision(DecisionKind.RETRY, f"{reason}; waiting {delay:.0f} s", delay_s=delay, overrides=current)


def _first_rung_that_fits(job: JobContext, current: Overrides, diag: Diagnosis, policy: Policy, mem: R.Memory,
                          order: Sequence[str], failed: set[str], kwargs_for: Any, said: str,
                          skipped: list[str]) -> Decision | None:
    """The first rung in `order` that applies, is new and closes the shortfall; else the one that
    frees most; None when none applies (`skipped` then says why, rung by rung)."""
    partial: list[tuple[int, str, R.Applied]] = []
    for name in order:
        fn = _RUNGS[name]
        result = fn(job, current, diag, policy, mem, **kwargs_for(name))
        if isinstance(result, R.Skipped):
            skipped.append(f"{name}: {result.why}")
            continue
        if result.overrides.fingerprint() in failed:
            skipped.append(f"{name}: that configuration already failed with an OOM")
            continue
        if (diag.category == Category.GPU_OOM and mem.shortfall is not None and result.frees is not None
                and result.frees < mem.shortfall * policy.shortfall_margin):
            skipped.append(f"{name}: frees ~{_gib(result.frees)}, cannot close {_gib(mem.shortfall)}")
            if result.frees > 0:
                partial.append((result.frees, name, result))
            continue
        reason = f"{said}; {name}: {result.what}"
        if skipped:
            reason += " [skipped: " + "; ".join(skipped) + "]"
        return _escalate(current, result, name, reason)
    if partial:
        frees, name, result = max(partial, key=lambda t: t[0])
        reason = (f"{said}; no single remedy closes it, taking the one that frees most: "
                  f"{name} (~{_gib(frees)}): {result.what} [skipped: " + "; ".join(skipped) + "]")
        return _escalate(current, result, name, reason)
    return None


def _no_remedy_left(job: JobContext, diag: Diagnosis, policy: Policy, setup: Any, said: str,
                    skipped: list[str]) -> Decision:
    """The failure that says what every rung said."""
    extra = ""
    if diag.phase == Phase.CHECKPOINT_LOAD:
        extra = ("; while loading a checkpoint a smaller micro-batch frees nothing (no activations exist yet), "
                 "so the batch is left alone")
    elif diag.category == Category.HOST_OOM and job.param_count:
        extra = _host_ram_note(job, setup, policy)
    return Decision(DecisionKind.FAIL, f"{said}: no remedy left in policy {policy.name!r}"
                                       f"{extra} [" + "; ".join(skipped) + "]")


def _decide_oom(job: JobContext, history: Sequence[AttemptRecord], diag: Diagnosis, policy: Policy,
                current: Overrides, host_check: str = "budget") -> Decision:
    # OOMs that other processes' memory explained say nothing about this job's configuration.
    own = [a for a in history if a.diagnosis is not None and a.diagnosis.category in OOM
           and not foreign_oom(a.diagnosis, policy)]
    ooms = len(own)
    if ooms > policy.budgets.oom_escalations:
        return Decision(DecisionKind.FAIL, f"out of memory {ooms} times; the OOM escalation budget "
                                           f"({policy.budgets.oom_escalations}) is spent: {diag.summary}")
    failed = {a.overrides.fingerprint() for a in own}
    failed.add(current.fingerprint())
    has_checkpoint = any(a.checkpoint_step_after is not None for a in history)
    mem = memory_picture(job, current, diag)
    v = R.view_of(job, current)
    where = f"{diag.category} in {diag.phase}"
    short = f", short by {_gib(mem.shortfall)}" if mem.shortfall is not None else ""

    if diag.category == Category.HOST_OOM and diag.phase != Phase.CHECKPOINT_LOAD:
        back = _step_back(job, history, diag, policy, current)
        if back is not None:
            return back
    if diag.category == Category.HOST_OOM and v.setup.offload_param and diag.phase != Phase.CHECKPOINT_LOAD:
        return _step_back_from_param_offload(job, current, diag, policy, failed, has_checkpoint)

    def kwargs_for(name: str) -> dict[str, Any]:
        if name == "micro_batch":
            return {"resuming": has_checkpoint, "margin": policy.shortfall_margin}
        if name in _OFFLOAD:
            return {"has_checkpoint": has_checkpoint, "host_check": host_check}
        if name == "grad_checkpointing":
            return {"host_pressure": diag.category == Category.HOST_OOM}
        return {}

    order = _order(job, diag, policy, current)
    if (diag.category == Category.GPU_OOM and diag.subkind not in R.NON_CACHING_SUBKINDS
            and diag.phase in (Phase.TRAIN_STEP, Phase.UNKNOWN, Phase.MODEL_LOAD)):
        rest = [r for r in policy.ladder if r in order or (diag.phase == Phase.MODEL_LOAD and r != "eval_batch"
                                                          and (job.kind == "llamafactory" or r in ENV_ONLY_RUNGS))]
        expand = S.expansions_for(job, diag, policy, mem, _RUNGS, kwargs_for)
        step = S.choose(job, current, diag, policy, mem, history, order, rest, expand, failed)
        if step is not None:
            what = S.describe(step)
            reason = (f"{where}{short}; predicted to fit at ~{_gib(step.need)} of {_gib(mem.capacity)} "
                      f"(estimated speed x{step.speed / max(1e-9, S.speed(job, current)):.2f}): {what}")
            return Decision(DecisionKind.ESCALATE, reason, rung="+".join(step.names), overrides=step.overrides,
                            changes=_changes(current, step.overrides, what))

    skipped: list[str] = []
    if diag.subkind in R.NON_CACHING_SUBKINDS and "memory_fraction" in order:
        if mem.pytorch_held is None:
            # A library's own OOM text carries no PyTorch numbers: predict PyTorch's share instead.
            import dataclasses

            mem = dataclasses.replace(mem, pytorch_held=S.predicted_need(job, current, diag, mem, history))
        combo = _capped_smaller_batch(job, current, diag, policy, mem, failed, kwargs_for("micro_batch"), history)
        if combo is not None:
            return combo
    found = _first_rung_that_fits(job, current, diag, policy, mem, order, failed, kwargs_for, where + short, skipped)
    if found is not None:
        return found
    if host_check == "budget" and any(s.startswith(_OFFLOAD) and "the job may use" in s for s in skipped):
        # Refuse only the impossible: an offload whose buffered host estimate is over the budget
        # but whose unbuffered one fits the box is the last resort, tried rather than failing.
        last = _decide_oom(job, history, diag, policy, current, host_check="possible")
        if last.kind == DecisionKind.ESCALATE:
            return last
    return _no_remedy_left(job, diag, policy, v.setup, where + short, skipped)


def _capped_smaller_batch(job: JobContext, current: Overrides, diag: Diagnosis, policy: Policy, mem: R.Memory,
                          failed: set[str], mb_kwargs: dict[str, Any],
                          history: Sequence[AttemptRecord] = ()) -> Decision | None:
    """An OOM outside PyTorch's allocator where a cap alone would starve PyTorch: the largest
    exact micro-batch split that brings PyTorch under the cap, with the cap, in one step."""
    import dataclasses

    f = policy.rungs.memory_fraction.fraction
    if not mem.capacity or mem.pytorch_held is None or mem.pytorch_held <= f * mem.capacity:
        return None
    if "micro_batch" not in policy.ladder:
        return None
    for target in R.micro_batch_options(job, current, policy):
        mb = R.micro_batch(job, current, diag, policy, mem, **mb_kwargs, target=target)
        if not isinstance(mb, R.Applied):
            continue
        predicted = S.predicted_need(job, mb.overrides, diag, mem, history)
        held = predicted if predicted is not None else (
            mem.pytorch_held - mb.frees if mb.frees is not None else None)
        if held is None:
            continue
        cap = R.memory_fraction(job, mb.overrides, diag, policy, dataclasses.replace(mem, pytorch_held=held))
        if not isinstance(cap, R.Applied) or cap.overrides.fingerprint() in failed:
            continue
        what = f"micro_batch: {mb.what}; memory_fraction: {cap.what}"
        reason = (f"{diag.category} outside PyTorch's allocator ({diag.subkind}); memory_fraction alone "
                  f"would leave PyTorch less than the ~{_gib(mem.pytorch_held)} it held, so first "
                  f"{what}")
        return Decision(DecisionKind.ESCALATE, reason, rung="micro_batch+memory_fraction",
                        overrides=cap.overrides, changes=_changes(current, cap.overrides, what))
    return None


def _host_ram_note(job: JobContext, setup: Any, policy: Policy) -> str:
    """What the model's states alone hold in host RAM: on a run with no GPU all of them (the
    offloaded share alone said '~0.00 GiB' for a LoRA), said only where it rounds to something."""
    lil = job.largest_layer_params or (job.param_count or 0) // 40
    gpu, host = model_states(job.param_count or 0, lil, job.launched_world_size(), setup)
    if R.without_gpu(job):
        host += gpu
    budget = R.host_budget(job, policy)
    have = (f" of the ~{_gib(budget)} the job may use ({R.host_budget_source(job, policy)})"
            if budget is not None else "")
    return f"; model states alone need ~{_gib(host)} host RAM{have}" if host >= GiB // 100 else ""


# Rungs that move memory from the GPU to host RAM: the ones a new host OOM steps back from.
_HOST_MOVING = frozenset({*_OFFLOAD, "grad_checkpointing"})


def _step_back(job: JobContext, history: Sequence[AttemptRecord], diag: Diagnosis, policy: Policy,
               current: Overrides) -> Decision | None:
    """A host OOM that a remedy of ours caused (the configuration before it hit a GPU OOM, not
    this): go back to that configuration and remedy its GPU OOM without the host-hungry rung,
    instead of shrinking a batch that is not what fills the host."""
    prior = None
    for a in reversed(history[:-1]):
        r = a.overrides.rungs
        if (len(r) < len(current.rungs) and tuple(current.rungs[:len(r)]) == tuple(r)
                and a.diagnosis is not None and a.diagnosis.category == Category.GPU_OOM):
            prior = a
            break
    if prior is None:
        return None
    culprits = [r for r in current.rungs[len(prior.overrides.rungs):] if r in _HOST_MOVING]
    if not culprits or culprits == ["zero3_offload_param"]:
        return None  # parameter offload alone: _step_back_from_param_offload keeps the optimizer's
    # Parameter offload needs more host RAM than optimizer offload: one ran out, both go.
    ban = set(culprits) | (set(_OFFLOAD) if set(culprits) & set(_OFFLOAD) else set())
    banned = policy.model_copy(update={"ladder": [r for r in policy.ladder if r not in ban]})
    sub = _decide_oom(job, history, prior.diagnosis, banned, prior.overrides)  # type: ignore[arg-type]
    need = _host_ram_note(job, R.view_of(job, current).setup, policy) if job.param_count else ""
    head = (f"host OOM in {diag.phase} after {'+'.join(culprits)}{need}: stepping back to attempt "
            f"{prior.number}'s configuration and remedying its GPU OOM without {', '.join(culprits)}")
    if sub.kind == DecisionKind.ESCALATE and sub.overrides is not None:
        return Decision(DecisionKind.ESCALATE, f"{head}: {sub.reason}", rung=sub.rung, overrides=sub.overrides,
                        changes=_changes(current, sub.overrides, f"stepped back from {'+'.join(culprits)}; "
                                         + "; ".join(c.why for c in sub.changes[:1])))
    return Decision(DecisionKind.FAIL, f"{head}; nothing else is left: {sub.reason}")


def _step_back_from_param_offload(job: JobContext, current: Overrides, diag: Diagnosis, policy: Policy,
                                  failed: set[str], has_checkpoint: bool) -> Decision:
    """Host RAM ran out with parameters offloaded: keep only the optimizer offload."""
    from supervisor.judge.policy.estimate import Setup

    v = R.view_of(job, current)
    need = _host_ram_note(job, v.setup, policy)
    cfg = v.config
    from supervisor.intake.deepspeed_config import zero3_offload_config

    ds = zero3_offload_config(offload_param=False, bf16=cfg.get("bf16") if "bf16" in cfg else None,
                              fp16=cfg.get("fp16") if "fp16" in cfg else None)
    what = ("parameters back on the GPU (ZeRO-3 keeps only the optimizer state in host RAM)"
            + (f"; host RAM for that ~{_gib(model_states(job.param_count, job.largest_layer_params or job.param_count // 40, job.launched_world_size(), Setup(3, True, False, v.setup.trainable_fraction))[1])}"
               if job.param_count else ""))
    new = R.with_changes(current, "zero3_offload_optimizer", what, deepspeed=ds)
    if new.fingerprint() in failed:
        return Decision(DecisionKind.FAIL, f"host RAM ran out with parameter offload{need}, and "
                                           "optimizer-only offload already failed with an OOM: "
                                           "the box needs more RAM (or fewer jobs at once)")
    reason = f"host OOM with parameter offload{need}; stepping back: {what}"
    return Decision(DecisionKind.ESCALATE, reason, rung="zero3_offload_optimizer", overrides=new,
                    changes=_changes(current, new, what))
