"""Writing the story of a job: events, state changes, failures, and notifications held until commit.

Every step of the attempt path tells the record through one `Journal`, so an event is logged the
same way everywhere, a failure always notifies, and a notification never goes out for a
transaction that rolled back (they wait in the outbox until `flush`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from supervisor.core.states import JobState
from supervisor.record.store import Store
from supervisor.service.logsetup import log
from supervisor.service.notify import Notifier


class Journal:
    def __init__(self, store: Store, notifier: Notifier, *, clock: Callable[[], float] = time.time,
                 job_notify: Callable[[int], list] = lambda _job_id: [],
                 job_identity: Callable[[int], Any] | None = None) -> None:
        self.store = store
        self.notifier = notifier
        self.clock = clock
        self.job_notify = job_notify  # the job file's own notify commands
        self.job_identity = job_identity  # a shared box: whom they run as (None: the daemon's user)
        self._outbox: list[dict[str, Any]] = []

    def event(self, job_id: int, kind: str, message: str, attempt: int | None = None, **data: Any) -> None:
        self.store.event(job_id, kind, message, attempt=attempt, data=data or None)
        log.info(kind, job=job_id, attempt=attempt, message=message,
                 **{k: v for k, v in data.items() if k != "message"})

    def transition(self, job_id: int, to: JobState, reason: str, **fields: Any):
        return self.store.transition(job_id, to, reason, **fields)

    def fail(self, job_id: int, reason: str) -> None:
        self.store.transition(job_id, JobState.FAILED, reason)
        self.notify(job_id, "failed", reason)

    def refuse(self, job_id: int, reason: str) -> None:
        """A job that must not run (nothing of it was started): failed with the reason."""
        self.store.transition(job_id, JobState.RUNNING, "preparing attempt")
        self.fail(job_id, reason)

    def cancelled(self, job_id: int, reason: str = "cancelled by the user") -> None:
        self.store.transition(job_id, JobState.CANCELLED, reason)
        self.notify(job_id, "cancelled", reason)

    # --- notifications -------------------------------------------------------------------------
    def notify(self, job_id: int, kind: str, message: str, **extra: Any) -> None:
        """Queue a notification; sent by `flush` once the record is committed."""
        job = self.store.job(job_id)
        try:
            spec_notify = self.job_notify(job_id)
        except Exception:  # noqa: BLE001 - a job file gone bad must not cost the notification itself
            spec_notify = []
        self._outbox.append({"event": kind, "job": job_id, "name": job.name if job else None, "message": message,
                             "attempts": len(self.store.attempts(job_id)), "ts": self.clock(),
                             "_job_notify": spec_notify,
                             "_job_identity": self.job_identity(job_id) if self.job_identity else None,
                             "_job_needs_identity": self.job_identity is not None, **extra})

    def flush(self) -> None:
        out, self._outbox = self._outbox, []
        for event in out:
            try:
                self.notifier.send(event)
            except Exception:  # noqa: BLE001 - a notifier's failure is logged; the record is already committed
                log.exception("notify_failed", event=event.get("event"))

    def discard(self) -> None:
        """A transaction rolled back: what it would have announced did not happen."""
        self._outbox = []
