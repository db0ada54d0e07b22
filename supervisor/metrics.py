"""Prometheus metrics, from the durable record plus what only the running loop knows.

`update(store, running)` runs on the daemon's thread: it reads the SQLite record (SELECTs
only) and the live facts the daemon passes in, and swaps in a snapshot; the HTTP endpoint
(prometheus_client's own server, on its thread) and the node-exporter textfile only ever read
that snapshot, so a scrape never touches SQLite and never waits on the loop. Totals come from
the record, so they survive daemon restarts (and are counters: the record only grows).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .fsutil import atomic_write_bytes
from .states import JobState

PREFIX = "oom_supervisor"
OOM_CATEGORIES = ("gpu_oom", "host_oom")


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


def attempt_outcome(ended_at, interrupted, diagnosis_json: str | None) -> str:
    if ended_at is None:
        return "running"
    if interrupted:
        return "interrupted"
    if diagnosis_json:
        return str(json.loads(diagnosis_json).get("category") or "unknown")
    return "unknown"


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
        """Rebuild the snapshot from the record and the live facts, then the textfile if due."""
        self._snapshot.families = build_families(store, running)
        self.write_textfile()


def build_families(store, running: list[RunningJob] = ()) -> list:
    c = store.conn
    fam = []

    jobs = GaugeMetricFamily(f"{PREFIX}_jobs", "Jobs by state", labels=["state"])
    by_state = Counter(r[0] for r in c.execute("SELECT state FROM jobs"))
    for s in JobState:
        jobs.add_metric([str(s)], by_state.get(str(s), 0))
    fam.append(jobs)

    paused = store.get_meta("queue_paused")
    fam.append(GaugeMetricFamily(f"{PREFIX}_queue_paused", "1 while the queue is paused (see `status`)",
                                 value=1 if paused else 0))

    outcomes, ooms, remedies = Counter(), Counter(), Counter()
    lost = 0
    for ended, interrupted, diag, decision, max_step, ckpt_after, resumed_step in c.execute(
            "SELECT ended_at, interrupted, diagnosis, decision, max_step, checkpoint_step_after,"
            " resumed_from_step FROM attempts"):
        outcome = attempt_outcome(ended, interrupted, diag)
        outcomes[outcome] += 1
        if outcome in OOM_CATEGORIES:
            ooms[(outcome, json.loads(diag).get("vendor") or "unknown")] += 1
        dec = json.loads(decision) if decision else {}
        if dec.get("kind") == "escalate" and dec.get("rung"):
            remedies[dec["rung"]] += 1
        if ended is not None and outcome != "success" and max_step is not None:
            kept = ckpt_after if ckpt_after is not None else (resumed_step or 0)
            lost += max(0, max_step - kept)

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
    quarantined = c.execute("SELECT COUNT(*) FROM events WHERE kind='checkpoint_quarantined'").fetchone()[0]
    fam.append(CounterMetricFamily(f"{PREFIX}_checkpoints_quarantined",
                                   "Incomplete checkpoints moved aside", value=quarantined))

    labels = ["job", "name", "attempt"]
    step = GaugeMetricFamily(f"{PREFIX}_job_step", "Global step of a running job", labels=labels)
    total = GaugeMetricFamily(f"{PREFIX}_job_total_steps", "Total steps of a running job", labels=labels)
    tps = GaugeMetricFamily(f"{PREFIX}_job_tokens_per_second", "Tokens/s of a running attempt", labels=labels)
    host = GaugeMetricFamily(f"{PREFIX}_job_peak_host_memory_bytes", "Peak host memory (RSS sum) of a "
                             "running attempt", labels=labels)
    gpu = GaugeMetricFamily(f"{PREFIX}_job_peak_gpu_memory_bytes", "Peak GPU memory of a running attempt, "
                            "summed over its GPUs", labels=labels)
    for r in running:
        row = store.attempt(r.job_id, r.attempt)
        lv = [str(r.job_id), r.name, str(r.attempt)]
        for family, live, stored in ((step, r.step, row and row.max_step),
                                     (total, r.total_steps, row and row.total_steps),
                                     (tps, r.tokens_per_s, row and row.tokens_per_s),
                                     (host, r.peak_host_bytes, row and row.peak_rss_bytes),
                                     (gpu, r.peak_gpu_bytes, None)):
            value = live if live is not None else stored
            if value is not None:
                family.add_metric(lv, value)
    fam += [step, total, tps, host, gpu]
    return fam
