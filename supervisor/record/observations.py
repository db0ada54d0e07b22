"""What finished attempts really used, kept for learned plans (`<state>/observations.sqlite3`).

A file of its own, not the job record: it is a bounded cache (MAX_ROWS, oldest dropped), may
be deleted at any time without losing a job, and is written after the verdict's transaction
so a failure here never touches a verdict. The pure part (record, key, correction, choice)
is `supervisor.judge.policy.learn`; this module only stores, reads and queries.

The daemon edge makes four calls (each opens and closes the file, none raises):
  * `record_finished(state_root, ctx, overrides, diagnosis, succeeded=, max_step=,
    resumed_from_step=, peak_file=<attempt dir>/gpu_peak.json, host=HostEvidence, job=, attempt=,
    time=)` after an attempt's verdict is committed (the hook writes the peak file when the
    attempt's environment has OOM_SUPERVISOR_PEAK_FILE=<that path>);
  * `first_attempt(state_root, ctx, policy) -> (Overrides, reason | None)` when attempt 1 is
    prepared: run with those overrides, record the reason with the attempt;
  * `refusal(state_root, ctx, policy) -> str | None` at submit: a str refuses the job with it
    (learn.refusal_bound: only when even the most optimistic credible estimate rules out every
    configuration; the box's capacity, never what other processes hold at the moment);
  * `wait_for_host(state_root, ctx, policy, overrides, waited_s=) -> HostWait | None` before ANY
    attempt is launched, with ctx.host_used_by_others_bytes read at that moment: `.wait` keeps the
    job queued, unchanged, `.reason` in `status`, asked again after `.retry_in_s`; once the
    policy's bound has passed it answers wait=False and the attempt starts (hostwait.py).
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.core.models import Diagnosis, HostEvidence, JobContext, Overrides
from supervisor.judge.policy.evidence import GPU_CAPACITY_TOLERANCE
from supervisor.judge.policy.hostwait import HostWait, host_wait
from supervisor.judge.policy.learn import initial_overrides
from supervisor.judge.policy.observed import (
    GpuPeak,
    Observation,
    memory_key,
    observation,
    parse_peak_file,
)
from supervisor.judge.policy.refusal import infeasible
from supervisor.judge.policy.schema import Policy

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)

FILE_NAME = "observations.sqlite3"
MAX_ROWS = 10_000
QUERY_LIMIT = 2_000  # newest rows of the job's GPU/world/finetuning kind considered per query

_SCHEMA = """
CREATE TABLE IF NOT EXISTS observations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    job TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    finetuning_type TEXT,
    gpu_capacity INTEGER,
    world_size INTEGER,
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS observations_kind ON observations (finetuning_type, gpu_capacity, world_size, id);
"""


def read_peak_file(path: str | Path) -> GpuPeak | None:
    """The hook's peak GPU file (absent, unreadable or empty: None, as on a CPU run). The job wrote
    it, in a folder its user may change: a regular file only, no link followed (on a shared box
    a link could make the daemon read another user's file into this job's record)."""
    from supervisor.run.attemptdir import read_job_json

    data = read_job_json(Path(path))
    try:
        return parse_peak_file(data) if data is not None else None
    except (ValueError, TypeError, AttributeError):
        return None


class ObservationStore:
    """A small SQLite table; one short transaction per call (WAL, like the record)."""

    def __init__(self, path: str | Path, *, max_rows: int = MAX_ROWS) -> None:
        self.path = Path(path)
        self.max_rows = max_rows
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), timeout=10, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    @classmethod
    def in_state(cls, state_root: str | Path) -> ObservationStore:
        return cls(Path(state_root) / FILE_NAME)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, obs: Observation) -> int:
        """Store one observation; drop the oldest beyond max_rows. Returns its row id."""
        k = obs.key
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            cur = self._db.execute(
                "INSERT INTO observations (time, job, attempt, outcome, finetuning_type, gpu_capacity, world_size,"
                " body) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (obs.time, obs.job, obs.attempt, obs.outcome, k.get("finetuning_type"), k.get("gpu_capacity"),
                 k.get("world_size"), json.dumps(obs.to_dict(), sort_keys=True, default=str)))
            self._db.execute("DELETE FROM observations WHERE id <= (SELECT max(id) FROM observations) - ?",
                             (self.max_rows,))
        return int(cur.lastrowid or 0)

    def count(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM observations").fetchone()[0])

    def all(self) -> list[Observation]:
        return [Observation.from_dict(json.loads(b))
                for (b,) in self._db.execute("SELECT body FROM observations ORDER BY id")]

    def similar(self, ctx: JobContext) -> list[Observation]:
        """Observations that may bear on `ctx` (same fine-tuning type and world size, a GPU of the
        same capacity within learn.same_gpu's tolerance: what every tier of learn.tier() shares),
        oldest first."""
        key = memory_key(ctx, Overrides())
        cap = key["gpu_capacity"]
        if cap is None:
            where, args = "gpu_capacity IS NULL", ()
        else:
            tol = int(cap * GPU_CAPACITY_TOLERANCE)
            where, args = "gpu_capacity BETWEEN ? AND ?", (cap - tol, cap + tol)
        rows = self._db.execute(
            f"SELECT body FROM observations WHERE finetuning_type IS ? AND world_size IS ? AND {where}"
            " ORDER BY id DESC LIMIT ?",
            (key["finetuning_type"], key["world_size"], *args, QUERY_LIMIT)).fetchall()
        out = []
        for (body,) in reversed(rows):
            try:
                out.append(Observation.from_dict(json.loads(body)))
            except (ValueError, TypeError):
                continue  # a row another version wrote: skip, never fail a job on the cache
        return out


def record_attempt(store: ObservationStore, ctx: JobContext, ov: Overrides, diagnosis: Diagnosis | None, *,
                   succeeded: bool, max_step: int | None, resumed_from_step: int | None,
                   peak_file: str | Path | None, peak_rss_bytes: int | None, memory_limit_bytes: int | None,
                   deepspeed_version: str | None = None, job: str = "", attempt: int = 0,
                   time: float = 0.0) -> Observation | None:
    """Build (learn.observation) and store one finished attempt's record; None when it says
    nothing about memory. Call it after the verdict's transaction."""
    peak = read_peak_file(peak_file) if peak_file else None
    obs = observation(ctx, ov, diagnosis, succeeded=succeeded, max_step=max_step,
                      resumed_from_step=resumed_from_step, peak=peak, peak_rss_bytes=peak_rss_bytes,
                      memory_limit_bytes=memory_limit_bytes, deepspeed_version=deepspeed_version,
                      job=job, attempt=attempt, time=time)
    if obs is not None:
        store.add(obs)
    return obs


def load_for(state_root: str | Path, ctx: JobContext) -> Sequence[Observation]:
    """The observations for `ctx` from a state folder; none when the file does not exist yet."""
    path = Path(state_root) / FILE_NAME
    if not path.exists():
        return []
    with ObservationStore(path) as store:
        return store.similar(ctx)


# --- the three calls the daemon edge makes (each opens, uses and closes the file; never raises:
# a cache that cannot be read or written costs the learning, never a job or a verdict) ----------

def record_finished(state_root: str | Path, ctx: JobContext, ov: Overrides, diagnosis: Diagnosis | None, *,
                    succeeded: bool, max_step: int | None, resumed_from_step: int | None,
                    peak_file: str | Path | None, host: HostEvidence | None, job: str = "", attempt: int = 0,
                    time: float = 0.0, deepspeed_version: str | None = None) -> Observation | None:
    """After the verdict's transaction: store what the attempt used (None when nothing, or on error)."""
    try:
        with ObservationStore.in_state(state_root) as store:
            return record_attempt(store, ctx, ov, diagnosis, succeeded=succeeded, max_step=max_step,
                                  resumed_from_step=resumed_from_step, peak_file=peak_file,
                                  peak_rss_bytes=host.peak_rss_bytes if host else None,
                                  memory_limit_bytes=host.memory_limit_bytes if host else None,
                                  deepspeed_version=deepspeed_version, job=job, attempt=attempt, time=time)
    except (OSError, sqlite3.Error, ValueError) as exc:
        log.warning("observation of job %s attempt %s not recorded: %s", job, attempt, exc)
        return None


def first_attempt(state_root: str | Path, ctx: JobContext, policy: Policy) -> tuple[Overrides, str | None]:
    """When a job's FIRST attempt is prepared: learn.initial_overrides over the stored observations."""
    try:
        obs = load_for(state_root, ctx)
    except (OSError, sqlite3.Error) as exc:
        log.warning("observations unreadable, first attempt as submitted: %s", exc)
        return Overrides(), None
    return initial_overrides(ctx, policy, obs)


def refusal(state_root: str | Path, ctx: JobContext, policy: Policy) -> str | None:
    """At submit: learn.infeasible over the stored observations (None: submit it)."""
    try:
        obs = load_for(state_root, ctx)
    except (OSError, sqlite3.Error):
        obs = []
    return infeasible(ctx, policy, obs)


def wait_for_host(state_root: str | Path, ctx: JobContext, policy: Policy, overrides: Overrides, *,
                  waited_s: float) -> HostWait | None:
    """Before an attempt is launched: hostwait.host_wait over the stored observations (None: go)."""
    try:
        obs = load_for(state_root, ctx)
    except (OSError, sqlite3.Error):
        obs = []
    return host_wait(ctx, policy, overrides, waited_s=waited_s, observations=obs)
