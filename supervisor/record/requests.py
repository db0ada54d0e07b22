"""What a user asks of a job, written into the record: cancel, retry, unpause.

These are durable intents the daemon's loop acts on (a cancel is a flag nothing resets; a retry
queues the job again). The CLI writes them directly where it can open the record (root, or the
daemon's own user); on a shared box the control socket writes them for the user, after checking
that the job is theirs. Both go through these functions, so the record reads the same either way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from supervisor.core.states import JobState
from supervisor.record.store import Store

EXIT_OK, EXIT_USAGE = 0, 2


@dataclass(frozen=True)
class Reply:
    code: int
    message: str
    error: bool = False  # said on stderr


def _by(who: str | None) -> str:
    return f"by {who}" if who else "by the user"


def requested_by(store: Store, job_id: int) -> str | None:
    """Who asked for the job's latest cancel (the daemon settles it later, in its own words)."""
    for e in reversed(store.events(job_id)):
        if e.kind == "cancel_requested":
            return (json.loads(e.data) or {}).get("by") if e.data else None
    return None


def cancel(store: Store, job_id: int, *, who: str | None = None) -> Reply:
    with store.tx():
        job = store.job(job_id)
        if job is None:
            return Reply(EXIT_USAGE, f"oom-supervisor: no job {job_id}", error=True)
        if job.state.terminal:
            return Reply(EXIT_OK if job.state == JobState.CANCELLED else EXIT_USAGE,
                         f"job {job.id} is already {job.state}")
        if job.state == JobState.RUNNING:
            store.update_job(job.id, cancel_requested=1)
            store.event(job.id, "cancel_requested", f"cancel requested {_by(who)}; the daemon stops the attempt",
                        data={"by": who})
            return Reply(EXIT_OK, f"job {job.id}: cancel requested; the daemon stops its attempt")
        store.transition(job.id, JobState.CANCELLED, f"cancelled {_by(who)}")
    return Reply(EXIT_OK, f"job {job_id}: cancelled")


def retry(store: Store, job_id: int, *, who: str | None = None) -> Reply:
    with store.tx():
        job = store.job(job_id)
        if job is None:
            return Reply(EXIT_USAGE, f"oom-supervisor: no job {job_id}", error=True)
        if job.state in (JobState.RUNNING, JobState.QUEUED, JobState.SUCCEEDED):
            return Reply(EXIT_USAGE, f"oom-supervisor: job {job.id} is {job.state}; only failed, cancelled, "
                                     "interrupted or waiting jobs can be retried", error=True)
        store.transition(job.id, JobState.QUEUED, f"retry requested {_by(who)}", not_before=None,
                         cancel_requested=0)
    return Reply(EXIT_OK, f"job {job_id}: queued again (it resumes from its last complete checkpoint)")


def unpause(store: Store, *, who: str | None = None) -> Reply:
    reason = store.get_meta("queue_paused")
    if not reason:
        return Reply(EXIT_OK, "the queue is not paused")
    with store.tx() as c:
        c.execute("DELETE FROM meta WHERE key='queue_paused'")
        store.event(None, "queue_unpaused", f"unpaused {_by(who)} (was: {reason})")
    return Reply(EXIT_OK, f"queue unpaused (was: {reason})")
