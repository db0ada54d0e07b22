"""Prometheus metrics, from the durable record plus what only the running loop knows.

`update(store, running)` runs on the daemon's thread: it reads the SQLite record (SELECTs
only) and the live facts the daemon passes in, and swaps in a snapshot; the HTTP endpoint
(prometheus_client's own server, on its thread) and the node-exporter textfile only ever read
that snapshot, so a scrape never touches SQLite and never waits on the loop. Totals come from
the record, so they survive daemon restarts (and are counters: the record only grows).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from supervisor.core.states import JobState
from supervisor.run.fsutil import atomic_write_bytes

PREFIX = "oom_supervisor"
OOM_CATEGORIES = ("gpu_oom", "host_oom")
RECORD_REFRESH_S = 5.0
GOODPUT_WINDOW_S = 24 * 3600.0


@dataclass(frozen=True)
class RunningJob:
    """Live facts about one running attempt (None: not known yet)."""

    job_id: int
    name: str
    attempt: int
    step: int | None = None
    total_steps: int | None = None
    tokens_per_s: float | None = None
    peak_host_bytes: int | None = None
    peak_gpu_bytes: int | None = None


class _Snapshot:
    """A collector that serves the families of the last update."""

    def __init__(self) -> None:
        self.families: list = []

    def collect(self):
        return iter(self.families)


class Metrics:
    def __init__(self, spec=None, *, log=None, clock=time.monotonic) -> None:
        self.spec, self.log, self.clock = spec, log, clock
        self.registry = CollectorRegistry(auto_describe=True)
        self._snapshot = _Snapshot()
        self.registry.register(self._snapshot)
        self.loop_latency = Histogram(
            f"{PREFIX}_loop_latency_seconds", "Duration of one daemon loop tick",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=self.registry)
        self.httpd = None
        self.address: tuple[str, int] | None = None
        self._last_textfile = float("-inf")
        self._record: list | None = None
        self._record_at = float("-inf")

    # --- outputs -------------------------------------------------------------------
    def start(self) -> tuple[str, int] | None:
        """Serve /metrics on spec.address; a port in use is logged, never fatal."""
        if self.spec is None or not self.spec.address:
            return None
        host, _, port = self.spec.address.rpartition(":")
        host = host.strip("[]")
        try:
            self.httpd, _thread = start_http_server(int(port), addr=host, registry=self.registry)
        except OSError as exc:
            if self.log is not None:
                self.log.warning("metrics_endpoint_failed", address=self.spec.address, error=str(exc))
            return None
        self.address = (host, self.httpd.server_address[1])
        if self.log is not None:
            self.log.info("metrics_endpoint", address=f"{self.spec.address.rpartition(':')[0]}:{self.address[1]}")
        return self.address

    def write_textfile(self, path: Path | None = None, *, force: bool = False) -> bool:
        """Atomic rewrite of the textfile (0644: node-exporter runs as another user)."""
        path = path or (self.spec.textfile if self.spec is not None else None)
        if path is None:
            return False
        now = self.clock()
        if not force and now - self._last_textfile < self.spec.interval:
            return False
        self._last_textfile = now
        try:
            atomic_write_bytes(Path(path), generate_latest(self.registry), mode=0o644)
            return True
        except OSError as exc:
            if self.log is not None:
                self.log.warning("metrics_textfile_failed", path=str(path), error=str(exc))
            return False

    def render(self) -> str:
        return generate_latest(self.registry).decode()

    def close(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None

    # --- inputs --------------------------------------------------------------------------
    def observe_tick(self, seconds: float) -> None:
        self.loop_latency.observe(seconds)

    def update(self, store, running: list[RunningJob] = ()) -> None:
        """Call every tick. Live facts are taken each time; the record's totals are re-read at
        most every `RECORD_REFRESH_S` (a few ms per thousand attempts). Then the textfile if due."""
        now = self.clock()
        if self._record is None or now - self._record_at >= RECORD_REFRESH_S:
            self._record, self._record_at = record_families(store), now
        self._snapshot.families = [*self._record, *running_families(
            store, running, names=bool(self.spec is not None and self.spec.job_names))]
        self.write_textfile()


_OUTCOME = ("CASE WHEN ended_at IS NULL THEN 'running' WHEN interrupted THEN 'interrupted' "
            "WHEN json_valid(diagnosis) THEN COALESCE(json_extract(diagnosis, '$.category'), 'unknown') "
            "ELSE 'unknown' END")


def record_families(store) -> list:
    """The totals, aggregated in SQLite (json_extract): one pass, no JSON decoded in Python."""
    c = store.conn
    fam = []
    jobs = GaugeMetricFamily(f"{PREFIX}_jobs", "Jobs by state", labels=["state"])
    by_state = dict(c.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall())
    for s in JobState:
        jobs.add_metric([str(s)], by_state.get(str(s), 0))
    fam.append(jobs)
    paused = store.get_meta("queue_paused")
    fam.append(GaugeMetricFamily(f"{PREFIX}_queue_paused", "1 while the queue is paused (see `status`)",
                                 value=1 if paused else 0))

    rows = c.execute(
        f"SELECT {_OUTCOME} AS outcome,"
        " CASE WHEN json_valid(diagnosis) THEN COALESCE(json_extract(diagnosis, '$.vendor'), 'unknown') END,"
        " CASE WHEN json_valid(decision) AND json_extract(decision, '$.kind') = 'escalate'"
        "      THEN json_extract(decision, '$.rung') END,"
        " SUM(CASE WHEN ended_at IS NOT NULL AND max_step IS NOT NULL"
        "          THEN MAX(0, max_step - COALESCE(checkpoint_step_after, resumed_from_step, 0)) ELSE 0 END),"
        " COUNT(*) FROM attempts GROUP BY 1, 2, 3").fetchall()
    outcomes, ooms, remedies = Counter(), Counter(), Counter()
    lost = 0
    for outcome, vendor, rung, steps, n in rows:
        outcomes[outcome] += n
        if outcome in OOM_CATEGORIES:
            ooms[(outcome, vendor or "unknown")] += n
        if rung:
            remedies[rung] += n
        if outcome != "success":
            lost += steps or 0

    f = CounterMetricFamily(f"{PREFIX}_attempts", "Attempts by outcome (a diagnosis category, running, "
                            "interrupted)", labels=["outcome"])
    for k, v in sorted(outcomes.items()):
        f.add_metric([k], v)
    fam.append(f)
    f = CounterMetricFamily(f"{PREFIX}_ooms", "Out-of-memory failures by kind and vendor",
                            labels=["kind", "vendor"])
    for (kind, vendor), v in sorted(ooms.items()):
        f.add_metric([kind, vendor], v)
    fam.append(f)
    f = CounterMetricFamily(f"{PREFIX}_remedies", "Remedies applied (escalations) by rung", labels=["remedy"])
    for k, v in sorted(remedies.items()):
        f.add_metric([k], v)
    fam.append(f)
    fam.append(CounterMetricFamily(f"{PREFIX}_steps_lost", "Training steps thrown away by failed attempts "
                                   "(reached minus kept by a checkpoint)", value=lost))
    fam += environment_families(store, outcomes.get("environment", 0))
    fam += emergency_families(store)
    quarantined = c.execute("SELECT COUNT(*) FROM events WHERE kind='checkpoint_quarantined'").fetchone()[0]
    fam.append(CounterMetricFamily(f"{PREFIX}_checkpoints_quarantined",
                                   "Incomplete checkpoints moved aside", value=quarantined))
    fam += goodput_families(store)
    return fam


def emergency_families(store) -> list:
    """The start-up hook's emergency checkpoints after a catchable OOM (`emergency_checkpoint` events):
    how each ended, and the seconds the saves took (several ranks: from the OOM rank asking for the
    others' RNG state to checkpoint-N renamed into place)."""
    rows = store.conn.execute(
        "SELECT COALESCE(json_extract(data, '$.outcome'), 'unknown'), COUNT(*),"
        " SUM(CASE WHEN json_extract(data, '$.outcome') = 'saved'"
        "          THEN MAX(0, COALESCE(json_extract(data, '$.seconds'), 0)) ELSE 0 END)"
        " FROM events WHERE kind = 'emergency_checkpoint' AND json_valid(data) GROUP BY 1").fetchall()
    count = CounterMetricFamily(f"{PREFIX}_emergency_checkpoints", "Emergency checkpoints after a catchable OOM "
                                "by outcome (saved, already_saved, failed, not_attempted, interrupted)",
                                labels=["outcome"])
    seconds = 0.0
    for outcome, n, took in rows:
        count.add_metric([str(outcome)], n)
        seconds += float(took or 0)
    return [count, CounterMetricFamily(f"{PREFIX}_emergency_save_seconds", "Seconds the saved emergency "
                                       "checkpoints took to write", value=round(seconds, 3))]


def environment_families(store, failures: int) -> list:
    """Outages of the surroundings (issue 29): failures, the waits they led to, who waits now."""
    c = store.conn
    waits = c.execute("SELECT COUNT(*) FROM attempts WHERE json_valid(decision) "
                      "AND json_extract(decision, '$.kind') = 'wait'").fetchone()[0]
    waiting = c.execute(
        "SELECT COUNT(*) FROM jobs j WHERE j.state = 'waiting_retry' AND (SELECT json_extract(a.decision, "
        "'$.kind') FROM attempts a WHERE a.job_id = j.id AND json_valid(a.decision) "
        "ORDER BY a.number DESC LIMIT 1) = 'wait'").fetchone()[0]
    return [
        CounterMetricFamily(f"{PREFIX}_environment_failures", "Attempts ended by the surroundings (DNS, the hub, "
                            "a proxy, a node), not the job", value=failures),
        CounterMetricFamily(f"{PREFIX}_environment_waits", "Waits for the surroundings to come back, once an "
                            "environment failure's retries were spent", value=waits),
        GaugeMetricFamily(f"{PREFIX}_jobs_waiting_for_environment", "Jobs waiting now for the network (or a "
                          "healthy node); `status` says why and until when", value=waiting),
    ]


def goodput_families(store, *, now: float | None = None, window_s: float = GOODPUT_WINDOW_S) -> list:
    """Where the wall time of the jobs active in the last `window_s` went (supervisor.judge.goodput):
    gauges, since a running attempt's steps move from productive to redone if it fails."""
    from supervisor.judge.goodput import BUCKETS, breakdown
    from supervisor.record.timing import goodput_of

    now = time.time() if now is None else now
    jobs = [j for j in store.jobs() if not j.state.terminal or j.updated_at >= now - window_s]
    per = []
    for j in jobs:
        try:
            per.append((j, goodput_of(store, j, now=now)))
        except Exception:  # noqa: BLE001, S112 - one unreadable job must not take the metrics down
            continue
    night = breakdown(g.total for _j, g in per)
    seconds = GaugeMetricFamily(f"{PREFIX}_time_seconds", "Wall time of the jobs active in the last 24 h, by "
                                "where it went (queued, waiting_gpus, startup, checkpoint_load, productive, "
                                "checkpoint_save, emergency_save, redone, failed, hang, backoff, held); adds up to "
                                "their wall time",
                                labels=["bucket"])
    for b in BUCKETS:
        seconds.add_metric([b], round(night.buckets.get(b, 0.0), 3))
    ratio = GaugeMetricFamily(f"{PREFIX}_goodput_ratio", "Productive training time / wall time of the jobs "
                              "active in the last 24 h (NaN: none)", value=night.goodput if night.goodput is not None
                              else float("nan"))
    job_ratio = GaugeMetricFamily(f"{PREFIX}_job_goodput_ratio", "Productive training time / wall time of a job "
                                  "that has not ended (by id: names are not labels)", labels=["job"])
    for j, g in per:
        if not j.state.terminal and g.total.goodput is not None:
            job_ratio.add_metric([str(j.id)], round(g.total.goodput, 4))
    return [seconds, ratio, job_ratio]


def running_families(store, running: list[RunningJob] = (), *, names: bool = False) -> list:
    """Per running job, by id (and by name with `names`: metrics.job_names). Label values are
    escaped by prometheus_client's exposition, so no name can add a sample or a line."""
    labels = ["job", "name", "attempt"] if names else ["job", "attempt"]
    step = GaugeMetricFamily(f"{PREFIX}_job_step", "Global step of a running job", labels=labels)
    total = GaugeMetricFamily(f"{PREFIX}_job_total_steps", "Total steps of a running job", labels=labels)
    tps = GaugeMetricFamily(f"{PREFIX}_job_tokens_per_second", "Tokens/s of a running attempt", labels=labels)
    host = GaugeMetricFamily(f"{PREFIX}_job_peak_host_memory_bytes", "Peak host memory (RSS sum) of a "
                             "running attempt", labels=labels)
    gpu = GaugeMetricFamily(f"{PREFIX}_job_peak_gpu_memory_bytes", "Peak GPU memory of a running attempt, "
                            "summed over its GPUs", labels=labels)
    for r in running:
        row = store.attempt(r.job_id, r.attempt)
        lv = [str(r.job_id), r.name, str(r.attempt)] if names else [str(r.job_id), str(r.attempt)]
        for family, live, stored in ((step, r.step, row and row.max_step),
                                     (total, r.total_steps, row and row.total_steps),
                                     (tps, r.tokens_per_s, row and row.tokens_per_s),
                                     (host, r.peak_host_bytes, row and row.peak_rss_bytes),
                                     (gpu, r.peak_gpu_bytes, None)):
            value = live if live is not None else stored
            if value is not None:
                family.add_metric(lv, value)
    return [step, total, tps, host, gpu]


def build_families(store, running: list[RunningJob] = (), *, names: bool = False) -> list:
    return record_families(store) + running_families(store, running, names=names)
