"""The durable record: jobs, attempts and events in one SQLite file.

WAL + synchronous=FULL: a committed change survives power loss. Every state
change goes through `transition`, which checks the table in states.py and
writes an event row in the same transaction, so the timeline in `show` is
complete by construction. The schema is versioned (PRAGMA user_version) and
migrated forward on open.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from supervisor.core.states import JobState, check_transition

MIGRATIONS: list[str] = [
    # 1: initial schema
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE jobs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL,
        kind TEXT NOT NULL,
        state TEXT NOT NULL,
        priority INTEGER NOT NULL DEFAULT 0,
        policy TEXT,
        workdir TEXT NOT NULL,
        source TEXT,
        spool_key TEXT UNIQUE,
        submitted_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        not_before REAL,
        cancel_requested INTEGER NOT NULL DEFAULT 0,
        next_overrides TEXT,
        reason TEXT
    );
    CREATE TABLE attempts (
        job_id INTEGER NOT NULL REFERENCES jobs(id),
        number INTEGER NOT NULL,
        started_at REAL NOT NULL,
        ended_at REAL,
        pid INTEGER,
        pid_create_time REAL,
        overrides TEXT,
        remedy TEXT,
        resumed_from TEXT,
        resumed_from_step INTEGER,
        max_step INTEGER,
        total_steps INTEGER,
        checkpoint_step_after INTEGER,
        exit TEXT,
        diagnosis TEXT,
        decision TEXT,
        detected_at REAL,
        peak_rss_bytes INTEGER,
        steps_per_s REAL,
        tokens_per_s REAL,
        interrupted INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (job_id, number)
    );
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id INTEGER,
        attempt INTEGER,
        ts REAL NOT NULL,
        kind TEXT NOT NULL,
        message TEXT NOT NULL,
        data TEXT
    );
    CREATE INDEX events_job ON events(job_id, id);
    CREATE INDEX jobs_state ON jobs(state);
    """,
    # 2: the GPUs the daemon assigned to an attempt (JSON list; NULL: the whole box), so a
    # restarted daemon knows which devices a still-running attempt holds.
    """
    ALTER TABLE attempts ADD COLUMN gpus TEXT;
    """,
    # 3: where the attempt runs when not a local process tree (JSON: {"slurm": submission...}).
    """
    ALTER TABLE attempts ADD COLUMN backend_ref TEXT;
    """,
    # 4: who submitted the job (the owner of the spool file as `submit` created it): on a shared
    # box its attempts run as that user, and only they (or an admin) may see or control it. NULL:
    # a job recorded before this, which ran as the daemon's own user.
    """
    ALTER TABLE jobs ADD COLUMN owner_uid INTEGER;
    ALTER TABLE jobs ADD COLUMN owner TEXT;
    """,
]

SCHEMA_VERSION = len(MIGRATIONS)


@dataclass(frozen=True)
class JobRow:
    id: int
    name: str
    kind: str
    state: JobState
    priority: int
    policy: str | None
    workdir: str
    source: str | None
    spool_key: str | None
    submitted_at: float
    updated_at: float
    not_before: float | None
    cancel_requested: int
    next_overrides: str | None
    reason: str | None
    owner_uid: int | None = None  # the submitter (None: recorded before owners were)
    owner: str | None = None      # their user name when it was submitted

    @classmethod
    def from_row(cls, r: sqlite3.Row) -> JobRow:
        d = {f.name: r[f.name] for f in fields(cls)}
        d["state"] = JobState(d["state"])
        return cls(**d)


@dataclass(frozen=True)
class AttemptRow:
    job_id: int
    number: int
    started_at: float
    ended_at: float | None
    pid: int | None
    pid_create_time: float | None
    overrides: str | None
    remedy: str | None
    resumed_from: str | None
    resumed_from_step: int | None
    max_step: int | None
    total_steps: int | None
    checkpoint_step_after: int | None
    exit: str | None
    diagnosis: str | None
    decision: str | None
    detected_at: float | None
    peak_rss_bytes: int | None
    steps_per_s: float | None
    tokens_per_s: float | None
    interrupted: int
    gpus: str | None = None
    backend_ref: str | None = None

    @classmethod
    def from_row(cls, r: sqlite3.Row) -> AttemptRow:
        return cls(**{f.name: r[f.name] for f in fields(cls)})

    def json(self, column: str) -> Any:
        raw = getattr(self, column)
        return json.loads(raw) if raw else None

    @property
    def steps_lost(self) -> int | None:
        """Steps reached that no checkpoint kept, for an attempt that ended without finishing (a
        finished run saved its final model; a running one has lost nothing yet)."""
        if self.max_step is None or self.ended_at is None:
            return None
        if ((self.json("diagnosis") or {}).get("category")) == "success":
            return None
        kept = self.checkpoint_step_after if self.checkpoint_step_after is not None else (
            self.resumed_from_step or 0)
        return max(0, self.max_step - kept)


@dataclass(frozen=True)
class EventRow:
    id: int
    job_id: int | None
    attempt: int | None
    ts: float
    kind: str
    message: str
    data: str | None


def _locked(exc: BaseException) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)


class SchemaTooNew(RuntimeError):
    pass


class StateChanged(RuntimeError):
    """A compare-and-set transition found the job in another state."""


class Store:
    def __init__(self, path: Path, *, clock=time.time) -> None:
        self.path = path
        self.clock = clock
        path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(str(path), isolation_level=None, timeout=30.0)
        self.conn.row_factory = sqlite3.Row
        self._wal()
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.execute("PRAGMA foreign_keys=ON")
        self.conn.execute("PRAGMA busy_timeout=30000")
        self._depth = 0
        self._migrate()

    def _wal(self) -> None:
        """Switch to WAL. On a new file this takes an exclusive lock, and SQLite answers a second
        switch at that moment 'database is locked' without calling the busy handler (the daemon and
        a CLI command creating the state together): retried within the same 30 s as any lock."""
        for attempt in Retrying(stop=stop_after_delay(30), wait=wait_exponential(multiplier=0.005, max=0.5),
                                retry=retry_if_exception(_locked), reraise=True):
            with attempt:
                self.conn.execute("PRAGMA journal_mode=WAL")

    def close(self) -> None:
        self.conn.close()

    # --- transactions -------------------------------------------------------
    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (BEGIN IMMEDIATE); nested calls join the outer one."""
        if self._depth:
            self._depth += 1
            try:
                yield self.conn
            finally:
                self._depth -= 1
            return
        self.conn.execute("BEGIN IMMEDIATE")
        self._depth = 1
        try:
            yield self.conn
        except BaseException:
            self._depth = 0
            self.conn.execute("ROLLBACK")
            raise
        self._depth = 0
        self.conn.execute("COMMIT")

    def _migrate(self) -> None:
        version = self.conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise SchemaTooNew(
                f"{self.path} has schema version {version}; this oom-supervisor knows up to "
                f"{SCHEMA_VERSION}. Upgrade oom-supervisor instead of downgrading the state.")
        while version < SCHEMA_VERSION:
            with self.tx() as c:
                # Re-read under the write lock: another process may have migrated meanwhile.
                version = c.execute("PRAGMA user_version").fetchone()[0]
                if version >= SCHEMA_VERSION:
                    break
                for stmt in _statements(MIGRATIONS[version]):
                    c.execute(stmt)
                c.execute(f"PRAGMA user_version={version + 1}")
            version += 1

    # --- meta -----------------------------------------------------------------
    def get_meta(self, key: str, default: str | None = None) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else default

    def set_meta(self, key: str, value: str) -> None:
        with self.tx() as c:
            c.execute("INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                      (key, value))

    # --- events ---------------------------------------------------------------
    def event(self, job_id: int | None, kind: str, message: str, *, attempt: int | None = None,
              data: Any = None) -> None:
        with self.tx() as c:
            c.execute("INSERT INTO events(job_id, attempt, ts, kind, message, data) VALUES(?,?,?,?,?,?)",
                      (job_id, attempt, self.clock(), kind, message,
                       json.dumps(data, default=str) if data is not None else None))

    def events(self, job_id: int) -> list[EventRow]:
        rows = self.conn.execute("SELECT * FROM events WHERE job_id=? ORDER BY id", (job_id,))
        return [EventRow(**dict(r)) for r in rows]

    # --- jobs -----------------------------------------------------------------
    def add_job(self, *, name: str, kind: str, priority: int, policy: str | None, workdir: str,
                source: str | None, spool_key: str | None, owner_uid: int | None = None,
                owner: str | None = None) -> int:
        now = self.clock()
        with self.tx() as c:
            cur = c.execute(
                "INSERT INTO jobs(name, kind, state, priority, policy, workdir, source, spool_key,"
                " submitted_at, updated_at, owner_uid, owner) VALUES(?,?,?,?,?,?,?,?,?,?,?,?)",
                (name, kind, JobState.QUEUED, priority, policy, workdir, source, spool_key, now, now,
                 owner_uid, owner))
            job_id = int(cur.lastrowid)
            self.event(job_id, "state", f"queued: accepted from {source or 'submit'}"
                       + (f", submitted by {owner}" if owner else ""), data={"to": "queued"})
        return job_id

    def job(self, job_id: int) -> JobRow | None:
        row = self.conn.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        return JobRow.from_row(row) if row else None

    def job_by_spool_key(self, key: str) -> JobRow | None:
        row = self.conn.execute("SELECT * FROM jobs WHERE spool_key=?", (key,)).fetchone()
        return JobRow.from_row(row) if row else None

    def jobs(self, states: set[JobState] | None = None) -> list[JobRow]:
        rows = [JobRow.from_row(r) for r in self.conn.execute("SELECT * FROM jobs ORDER BY id")]
        return [j for j in rows if states is None or j.state in states]

    def cancel_requested_ids(self) -> set[int]:
        return {r[0] for r in self.conn.execute("SELECT id FROM jobs WHERE cancel_requested=1")}

    def transition(self, job_id: int, new: JobState, reason: str, *, expect: set[JobState] | None = None,
                   **fields_: Any) -> JobRow:
        """Move a job to `new` (checked against the table) and record why.

        `expect`: compare-and-set; the move happens only if the job is in one of these states
        under the write lock (raises StateChanged otherwise), so a decision made on a state
        read earlier never lands on a job that has moved since.
        """
        with self.tx() as c:
            job = self.job(job_id)
            if job is None:
                raise KeyError(f"no job {job_id}")
            if expect is not None and job.state not in expect:
                raise StateChanged(f"job {job_id} is {job.state}, not {'/'.join(sorted(expect))}")
            check_transition(job_id, job.state, new)
            sets = {"state": str(new), "updated_at": self.clock(), "reason": reason, **fields_}
            c.execute(f"UPDATE jobs SET {', '.join(f'{k}=?' for k in sets)} WHERE id=?",
                      (*sets.values(), job_id))
            self.event(job_id, "state", f"{job.state} -> {new}: {reason}",
                       data={"from": str(job.state), "to": str(new)})
        return self.job(job_id)  # type: ignore[return-value]

    def update_job(self, job_id: int, **fields_: Any) -> None:
        with self.tx() as c:
            fields_["updated_at"] = self.clock()
            c.execute(f"UPDATE jobs SET {', '.join(f'{k}=?' for k in fields_)} WHERE id=?",
                      (*fields_.values(), job_id))

    # --- attempts ---------------------------------------------------------------
    def add_attempt(self, job_id: int, number: int, **fields_: Any) -> None:
        cols = {"job_id": job_id, "number": number, "started_at": self.clock(), **fields_}
        with self.tx() as c:
            c.execute(f"INSERT INTO attempts({', '.join(cols)}) VALUES({', '.join('?' * len(cols))})",
                      tuple(cols.values()))

    def update_attempt(self, job_id: int, number: int, **fields_: Any) -> None:
        if not fields_:
            return
        with self.tx() as c:
            c.execute(f"UPDATE attempts SET {', '.join(f'{k}=?' for k in fields_)} WHERE job_id=? AND number=?",
                      (*fields_.values(), job_id, number))

    def attempts(self, job_id: int) -> list[AttemptRow]:
        rows = self.conn.execute("SELECT * FROM attempts WHERE job_id=? ORDER BY number", (job_id,))
        return [AttemptRow.from_row(r) for r in rows]

    def attempt(self, job_id: int, number: int) -> AttemptRow | None:
        row = self.conn.execute("SELECT * FROM attempts WHERE job_id=? AND number=?",
                                (job_id, number)).fetchone()
        return AttemptRow.from_row(row) if row else None

    def last_attempt(self, job_id: int) -> AttemptRow | None:
        row = self.conn.execute("SELECT * FROM attempts WHERE job_id=? ORDER BY number DESC LIMIT 1",
                                (job_id,)).fetchone()
        return AttemptRow.from_row(row) if row else None


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]
