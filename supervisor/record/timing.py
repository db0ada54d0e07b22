"""The record as the goodput computation's plain inputs (`supervisor.judge.goodput`).

One reading for every view (`show`, `status --json`, the report, the metrics): the job's state
changes, its attempts (with the timing marks the daemon recorded as `attempt_timing` events),
the decisions' backoffs, and the waits the loop and the runner recorded (GPUs taken, VRAM not yet
given back, checkpoint conversions before launch).
"""

from __future__ import annotations

import json
import time
from typing import Any

from supervisor.judge.goodput import (
    AttemptSpan,
    Interval,
    JobGoodput,
    JobRecord,
    Marks,
    job_goodput,
)


def job_record(store, job) -> JobRecord:
    events = store.events(job.id)
    data = {e.id: (json.loads(e.data) if e.data else {}) for e in events}
    attempts = store.attempts(job.id)
    marks = {e.attempt: Marks.from_dict(data[e.id]) for e in events if e.kind == "attempt_timing"}
    hangs = {e.attempt: (e.ts, data[e.id].get("hang_timeout")) for e in events if e.kind == "hang_detected"}
    spans = []
    backoffs = []
    for a in attempts:
        diag = a.json("diagnosis") or {}
        dec = a.json("decision") or {}
        outcome = ("running" if a.ended_at is None else "interrupted" if a.interrupted
                   else str(diag.get("category") or "unknown"))
        hang_at, hang_timeout = hangs.get(a.number, (None, None))
        spans.append(AttemptSpan(
            number=a.number, started_at=a.started_at, ended_at=a.ended_at, outcome=outcome,
            resumed_from_step=a.resumed_from_step, max_step=a.max_step,
            checkpoint_step_after=a.checkpoint_step_after, steps_per_s=a.steps_per_s,
            marks=marks.get(a.number), hang_at=hang_at, hang_timeout=hang_timeout))
        if a.ended_at is not None and dec.get("kind") in ("retry", "wait", "escalate", "pause"):
            backoffs.append((a.ended_at, float(dec.get("delay_s") or 0.0)))
    starts = sorted(a.started_at for a in attempts)
    waits: list[Interval] = []
    states = []
    for e in events:
        d = data[e.id]
        if e.kind == "state" and d.get("to"):
            states.append((e.ts, str(d["to"])))
        elif e.kind in ("vram_released", "vram_not_released") and d.get("waited_s"):
            waits.append(Interval(e.ts - float(d["waited_s"]), e.ts, "waiting_gpus"))
        elif e.kind == "waiting_for_gpus":
            until = next((s for s in starts if s >= e.ts), None)
            stop = min([t for t in (until, _next_state(events, data, e.ts)) if t is not None], default=None)
            waits.append(Interval(e.ts, stop if stop is not None else time.time(), "waiting_gpus"))
        elif e.kind == "resume_fixup" and d.get("seconds"):
            waits.append(Interval(e.ts - float(d["seconds"]), e.ts, "checkpoint_load"))
    return JobRecord(job_id=job.id, name=job.name, submitted_at=job.submitted_at, states=tuple(states),
                     attempts=tuple(spans), backoffs=tuple(backoffs), waits=tuple(waits))


def _next_state(events, data, after: float) -> float | None:
    """A wait ends at the job's next state change at the latest (started, cancelled, ...)."""
    return next((e.ts for e in events if e.kind == "state" and e.ts > after and data[e.id].get("to")), None)


def goodput_of(store, job, *, now: float | None = None) -> JobGoodput:
    return job_goodput(job_record(store, job), now=time.time() if now is None else now)


def goodput_dict(store, job, *, now: float | None = None) -> dict[str, Any]:
    return goodput_of(store, job, now=now).to_dict()
