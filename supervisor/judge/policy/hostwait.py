"""Host RAM that other processes hold: wait for it, bounded; never refuse, never change the job.

Why: what other processes hold is weather. Counted against the job it refused runnable jobs for
good (the same 8B job passed on an idle 512 GiB box and was refused while others held 300 GiB)
or changed their remedies. So the policy judges a job against the box's capacity only
(rungs.host_budget / host_capacity), and this pure answer tells the daemon, each time an attempt
is about to start, whether to hold it back a while: "others hold X, the attempt needs ~Y, it may
use ~Z now; retry in N s", bounded by the policy's host_wait_max_s, after which it starts anyway.

The daemon's edge, before it launches an attempt (any attempt, the first included):

    w = host_wait(ctx, policy, overrides, waited_s=<seconds this attempt has waited so far>,
                  observations=<learned observations of ctx's kind>)
    if w is not None and w.wait:    # keep the job queued (not failed, not changed), say w.reason
        ...                         # in `status`, ask again after w.retry_in_s
    elif w is not None:             # the bound ran out: start now, record w.reason with the attempt
        ...
    # None: nothing to wait for

ctx.host_used_by_others_bytes must be what others hold NOW (total - available - what this
daemon's own live attempts hold), read at that moment.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.core.models import JobContext, Overrides
from supervisor.judge.policy import rungs as R
from supervisor.judge.policy.learn import host_need
from supervisor.judge.policy.observed import Observation
from supervisor.judge.policy.schema import Policy

GiB = 1 << 30


@dataclass(frozen=True)
class HostWait:
    """What to do about host RAM others hold, with the numbers `status` shows."""

    wait: bool  # True: hold the attempt back and ask again in retry_in_s; False: the bound ran out, start
    need: int  # host RAM the attempt is expected to use (bytes)
    target: int  # the room it waits for: its need, at most its budget on an empty box
    available: int  # what it may use now: its budget less what others hold
    others: int  # what other processes hold now
    waited_s: float
    retry_in_s: float
    max_wait_s: float
    reason: str


def _gib(n: int) -> str:
    return f"{n / GiB:.0f} GiB"


def host_wait(ctx: JobContext, policy: Policy, ov: Overrides, *, waited_s: float = 0.0,
              observations: Sequence[Observation] = ()) -> HostWait | None:
    """Whether the attempt running `ov` should wait for host RAM other processes hold.

    None: nothing to wait for (nobody else holds much, the need is unknown, or it fits now).
    It waits for the room it needs while the room now is below that, until host_wait_max_s has
    passed, then `wait=False`: start anyway, unchanged. An attempt whose need is over its budget
    even on an empty box gets `wait=False` at once: others freeing memory cannot make it fit."""
    others = ctx.host_used_by_others_bytes or 0
    if others <= 0 or not ctx.host_ram_bytes:
        return None
    need = host_need(ctx, policy, ov, observations)
    budget = R.host_budget(ctx, policy)
    if need is None or budget is None:
        return None
    box_now = max(0, int(ctx.host_ram_bytes * (1 - policy.host_ram_reserve)) - others)
    available = min(budget, box_now)
    target = min(need, budget)
    if available >= target:
        return None
    head = (f"other processes hold {_gib(others)} of the box's {_gib(ctx.host_ram_bytes)} host RAM; this attempt "
            f"needs ~{_gib(need)} and may use ~{_gib(available)} now ({policy.host_ram_reserve:.0%} reserve kept)")
    if need > budget:
        # Waiting helps only when what others hold is what stands between the job and a fit.
        return HostWait(False, need, target, available, others, waited_s, 0.0, policy.host_wait_max_s,
                        f"{head}; more than its budget of ~{_gib(budget)} even on an empty box, so waiting "
                        "cannot make it fit: starting now, the job unchanged")
    bound = policy.host_wait_max_s
    if waited_s >= bound:
        return HostWait(False, need, target, available, others, waited_s, 0.0, bound,
                        f"{head}; waited {waited_s:.0f} s, the bound ({bound:.0f} s): starting anyway, "
                        "the job unchanged")
    retry = min(policy.host_wait_poll_s, bound - waited_s)
    return HostWait(True, need, target, available, others, waited_s, retry, bound,
                    f"{head}: waiting for them, the job unchanged; retry in {retry:.0f} s "
                    f"(waited {waited_s:.0f} s of at most {bound:.0f} s, then it starts anyway)")
