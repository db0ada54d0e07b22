"""Job states and the only transitions allowed between them.

The names are a public interface (`status --json`, scripts): keep them stable.

- queued: accepted, waiting for a slot.
- running: an attempt's process tree is alive (or being started / stopped).
- waiting_retry: an attempt ended and the policy chose another one; it starts
  at `not_before` (backoff) or when the queue is unpaused.
- interrupted: the supervisor stopped (graceful shutdown, crash, power loss)
  while an attempt ran. Not a failure: it resumes from its last complete
  checkpoint without spending the job's failure budgets.
- succeeded / failed / cancelled: terminal. `retry` moves failed, cancelled
  (and interrupted/waiting_retry, to start now) back to queued.
"""

from __future__ import annotations

from supervisor.core.compat import StrEnum


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    WAITING_RETRY = "waiting_retry"
    INTERRUPTED = "interrupted"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

S = JobState
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.QUEUED: frozenset({S.RUNNING, S.CANCELLED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.WAITING_RETRY, S.INTERRUPTED, S.CANCELLED}),
    S.WAITING_RETRY: frozenset({S.RUNNING, S.QUEUED, S.CANCELLED, S.FAILED}),
    S.INTERRUPTED: frozenset({S.RUNNING, S.QUEUED, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset({S.QUEUED}),
    S.CANCELLED: frozenset({S.QUEUED}),
}


class IllegalTransition(RuntimeError):
    def __init__(self, job_id: int, old: JobState, new: JobState) -> None:
        allowed = ", ".join(sorted(TRANSITIONS[old])) or "none (terminal)"
        super().__init__(f"job {job_id}: {old} -> {new} is not allowed (from {old}: {allowed})")
        self.old, self.new = old, new


def check_transition(job_id: int, old: JobState, new: JobState) -> None:
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(job_id, old, new)
