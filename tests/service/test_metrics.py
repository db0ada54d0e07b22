"""Metrics from a real Store, served by prometheus_client's real HTTP server, scraped over HTTP
and parsed with the library's own parser."""

from __future__ import annotations

import socket
import stat
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from supervisor.daemon.config import MetricsSpec
from supervisor.service.metrics import Metrics, RunningJob

from .night import GiB, build_night


def samples(text: str) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(addr) -> str:
    with urllib.request.urlopen(f"http://{addr[0]}:{addr[1]}/metrics", timeout=5) as r:
        assert r.status == 200
        return r.read().decode()


def test_scrape_the_real_endpoint(tmp_path, rlog):
    _, store = build_night(tmp_path)
    m = Metrics(MetricsSpec(address="127.0.0.1:0", textfile=tmp_path / "prom" / "oom.prom"), log=rlog.log)
    addr = m.start()
    try:
        assert addr is not None and addr[1] > 0
        for t in (0.004, 0.03, 0.2):
            m.observe_tick(t)
        m.update(store, [RunningJob(2, "qwen-7b-sft", 2, step=41, total_steps=100, tokens_per_s=1500.0,
                                    peak_host_bytes=11 * GiB, peak_gpu_bytes=int(50.5 * GiB))])
        got = samples(scrape(addr))
    finally:
        m.close()
    p = "oom_supervisor_"
    assert got[(p + "jobs", (("state", "succeeded"),))] == 1
    assert got[(p + "jobs", (("state", "running"),))] == 1
    assert got[(p + "jobs", (("state", "queued"),))] == 1
    assert got[(p + "jobs", (("state", "failed"),))] == 0
    assert got[(p + "attempts_total", (("outcome", "host_oom"),))] == 2
    assert got[(p + "attempts_total", (("outcome", "gpu_oom"),))] == 1
    assert got[(p + "attempts_total", (("outcome", "success"),))] == 1
    assert got[(p + "attempts_total", (("outcome", "running"),))] == 1
    assert got[(p + "ooms_total", (("kind", "host_oom"), ("vendor", "cpu")))] == 2
    assert got[(p + "ooms_total", (("kind", "gpu_oom"), ("vendor", "hip")))] == 1
    assert got[(p + "remedies_total", (("remedy", "micro_batch"),))] == 2
    assert got[(p + "remedies_total", (("remedy", "gradient_checkpointing"),))] == 1
    assert got[(p + "steps_lost_total", ())] == 10, "job 1: 0 + 0 (nothing logged); job 2: 30 - 20"
    assert got[(p + "checkpoints_quarantined_total", ())] == 1
    assert got[(p + "queue_paused", ())] == 0
    job = (("attempt", "2"), ("job", "2"))
    assert got[(p + "job_step", job)] == 41, "the live value beats the stored one"
    assert got[(p + "job_total_steps", job)] == 100
    assert got[(p + "job_tokens_per_second", job)] == 1500.0
    assert got[(p + "job_peak_host_memory_bytes", job)] == 11 * GiB
    assert got[(p + "job_peak_gpu_memory_bytes", job)] == int(50.5 * GiB)
    assert got[(p + "loop_latency_seconds_count", ())] == 3
    assert got[(p + "loop_latency_seconds_bucket", (("le", "0.05"),))] == 2

    prom = tmp_path / "prom" / "oom.prom"
    assert stat.S_IMODE(prom.stat().st_mode) == 0o644, "node-exporter runs as another user"
    assert samples(prom.read_text())[(p + "jobs", (("state", "succeeded"),))] == 1
    assert [f.name for f in (tmp_path / "prom").iterdir()] == ["oom.prom"], "no temp file left"


def test_running_job_falls_back_to_the_record_and_the_queue_pause_shows(tmp_path):
    _, store = build_night(tmp_path)
    store.set_meta("queue_paused", "job 2: disk full")
    m = Metrics(None)
    m.update(store, [RunningJob(2, "qwen-7b-sft", 2)])
    got = samples(m.render())
    job = (("attempt", "2"), ("job", "2"))
    assert got[("oom_supervisor_job_step", job)] == 40 and got[("oom_supervisor_queue_paused", ())] == 1
    assert ("oom_supervisor_job_peak_gpu_memory_bytes", job) not in got, "unknown is absent, not 0"


def test_a_port_in_use_is_logged_not_fatal(tmp_path, rlog):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        m = Metrics(MetricsSpec(address=f"127.0.0.1:{s.getsockname()[1]}"), log=rlog.log)
        assert m.start() is None
        assert rlog.events("warning") == ["metrics_endpoint_failed"]
    finally:
        s.close()


def test_textfile_is_rewritten_at_its_interval(tmp_path):
    _, store = build_night(tmp_path)
    t = [0.0]
    m = Metrics(MetricsSpec(address=None, textfile=tmp_path / "m.prom", interval=15), clock=lambda: t[0])
    assert m.start() is None
    m.update(store)
    first = (tmp_path / "m.prom").stat().st_mtime_ns
    t[0] = 5.0
    assert not m.write_textfile()
    t[0] = 15.0
    assert m.write_textfile()
    assert (tmp_path / "m.prom").stat().st_mtime_ns >= first


def test_totals_are_reread_at_most_every_few_seconds_live_facts_every_tick(tmp_path):
    _, store = build_night(tmp_path)
    t = [100.0]
    m = Metrics(None, clock=lambda: t[0])
    m.update(store, [RunningJob(2, "qwen-7b-sft", 2, step=41)])
    store.add_job(name="late", kind="command", priority=0, policy=None, workdir="/", source=None, spool_key=None)
    t[0] += 1
    m.update(store, [RunningJob(2, "qwen-7b-sft", 2, step=42)])
    got = samples(m.render())
    job = (("attempt", "2"), ("job", "2"))
    assert got[("oom_supervisor_job_step", job)] == 42
    assert got[("oom_supervisor_jobs", (("state", "queued"),))] == 1, "the record is not re-read every tick"
    t[0] += 5
    m.update(store, [])
    got = samples(m.render())
    assert got[("oom_supervisor_jobs", (("state", "queued"),))] == 2
    assert ("oom_supervisor_job_step", job) not in got, "a job that stopped running is gone"


def test_environment_failures_and_waits_are_counted_and_who_waits_now_is_a_gauge(tmp_path):
    """Issue 29: an outage of the network is a category of its own in the metrics."""
    from supervisor.core.states import JobState

    from .night import Clock, _attempt

    _, store = build_night(tmp_path)
    env = {"category": "environment", "subkind": "network", "summary": "huggingface.co unreachable"}
    job_id = store.add_job(name="hub", kind="command", priority=0, policy="default", workdir=str(tmp_path),
                           source="hub.yaml", spool_key="hub")
    clock = Clock(store.clock())
    _attempt(store, clock, job_id, 1, minutes=1, max_step=None, total=0, diag=env,
             decision={"kind": "retry", "reason": "environment failure; retry 1 of 1", "delay_s": 30})
    _attempt(store, clock, job_id, 2, minutes=1, max_step=None, total=0, diag=env,
             decision={"kind": "wait", "reason": "waiting for the network: huggingface.co unreachable",
                       "delay_s": 720})
    store.transition(job_id, JobState.WAITING_RETRY, "waiting for the network: huggingface.co unreachable")
    got = samples(_render(store))
    p = "oom_supervisor_"
    assert got[(p + "environment_failures_total", ())] == 2
    assert got[(p + "environment_waits_total", ())] == 1
    assert got[(p + "jobs_waiting_for_environment", ())] == 1
    assert got[(p + "attempts_total", (("outcome", "environment"),))] == 2


def _render(store) -> str:
    m = Metrics(None)
    m.update(store, [])
    return m.render()
