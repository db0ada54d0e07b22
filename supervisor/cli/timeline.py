"""The record as plain data for `status`, `show` and `watch` (and their --json)."""

from __future__ import annotations

import json
from typing import Any


def job_summary(store, job) -> dict[str, Any]:
    attempts = store.attempts(job.id)
    last = attempts[-1] if attempts else None
    progress = None
    if last and last.max_step is not None:
        progress = f"step {last.max_step}" + (f"/{last.total_steps}" if last.total_steps else "")
    diag = last.json("diagnosis") if last else None
    return {
        "id": job.id, "name": job.name, "owner": job.owner, "state": str(job.state), "attempts": len(attempts),
        "kind": job.kind, "priority": job.priority,
        "remedy": _short_remedy(last),
        "next_remedy": (json.loads(job.next_overrides).get("rungs") if job.next_overrides else None),
        "progress": progress,
        "last_diagnosis": diag.get("category") if diag else None,
        "last": _last(job, last, diag),
        "reason": job.reason, "submitted_at": job.submitted_at, "updated_at": job.updated_at,
        "not_before": job.not_before,
        "goodput": _goodput(store, job),
    }


def _last(job, attempt, diag: dict | None) -> str | None:
    """What ended the last attempt, in status's LAST column: a cancel is said as one (with the
    job's reason, which names who asked), not as the stopped attempt's `unknown` diagnosis."""
    decision = (attempt.json("decision") or {}) if attempt else {}
    if str(job.state) == "cancelled" or decision.get("kind") == "cancelled":
        reason = job.reason or ""
        return reason if reason.startswith("cancelled") else "cancelled"
    return diag.get("category") if diag else None


def _goodput(store, job) -> dict[str, Any] | None:
    """Where the job's wall time went (supervisor.judge.goodput); None if it cannot be read."""
    from supervisor.record.timing import goodput_dict

    try:
        return goodput_dict(store, job)
    except Exception:  # noqa: BLE001 - a view must show the rest of the record whatever one computation does
        return None


def _short_remedy(attempt) -> str | None:
    """'micro_batch x2' for the status table; `show` has the full settings."""
    rungs = ((attempt.json("overrides") or {}).get("rungs") or []) if attempt else []
    names = list(dict.fromkeys(rungs))
    return " + ".join(f"{n} x{rungs.count(n)}" if rungs.count(n) > 1 else n for n in names) or None



def job_timeline(store, job_id: int) -> dict[str, Any]:
    job = store.job(job_id)
    attempts = []
    for a in store.attempts(job_id):
        attempts.append({
            "number": a.number, "started_at": a.started_at, "ended_at": a.ended_at,
            "duration_s": (a.ended_at - a.started_at) if a.ended_at else None,
            "remedy": a.remedy, "overrides": a.json("overrides"),
            "resumed_from": a.resumed_from, "resumed_from_step": a.resumed_from_step,
            "max_step": a.max_step, "total_steps": a.total_steps,
            "checkpoint_step_after": a.checkpoint_step_after, "steps_lost": a.steps_lost,
            "peak_host_memory_bytes": a.peak_rss_bytes, "steps_per_s": a.steps_per_s,
            "tokens_per_s": a.tokens_per_s, "exit": a.json("exit"), "diagnosis": a.json("diagnosis"),
            "decision": a.json("decision"), "interrupted": bool(a.interrupted),
            "detected_at": a.detected_at,
        })
    events = [{"ts": e.ts, "attempt": e.attempt, "kind": e.kind, "message": e.message,
               "data": json.loads(e.data) if e.data else None} for e in store.events(job_id)]
    for a in attempts:  # what the start-up hook saved when the attempt ran out of memory
        a["emergency_checkpoint"] = next((e["message"] for e in events if e["kind"] == "emergency_checkpoint"
                                          and e["attempt"] == a["number"]), None)
        a["peak_host_memory_measure"] = next((e["data"].get("peak_host_measure") for e in events
                                              if e["kind"] == "attempt_ended" and e["attempt"] == a["number"]
                                              and e["data"]), None)
    summary = job_summary(store, job)
    per = ((summary.get("goodput") or {}).get("attempts") or {})
    for a in attempts:  # the attempt's own time and the wait just before it
        a["time"] = per.get(str(a["number"]))
    return {**summary, "workdir": job.workdir, "source": job.source,
            "attempt_list": attempts, "events": events}
