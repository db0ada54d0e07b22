"""The observation store: a real SQLite file, the hook's real peak file, a real second process."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

from supervisor.core.models import Overrides
from supervisor.judge.policy import evidence as LE
from supervisor.judge.policy import learn as L
from supervisor.judge.policy import observed as LO
from supervisor.judge.policy import rungs as R
from supervisor.record import observations as O

from .builders import POLICY, GiB, cpu_job, demo_night, gpu_job, host_oom, split

HOOK_DIR = Path(__file__).resolve().parents[2] / "supervisor" / "hooks" / "startup"


def _write_peak_file_like_the_hook(path: Path, entries: list[dict]) -> None:
    """The hook's own merge(), in a separate process per rank, as at exit."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from oom_supervisor_hooks import peak;"
            "peak.merge(sys.argv[2], json.loads(sys.argv[3]))")
    for e in entries:
        subprocess.run([sys.executable, "-c", code, str(HOOK_DIR), str(path), json.dumps(e)], check=True,
                       timeout=60)


def test_demo_night_stored_then_resubmitted_starts_at_4x4(tmp_path):
    ctx = cpu_job()
    with O.ObservationStore.in_state(tmp_path) as store:
        for o in demo_night(ctx):
            store.add(o)
    # A new connection (the next submit, another process's view) reads them back.
    obs = O.load_for(tmp_path, ctx)
    assert [o.outcome for o in obs] == ["host_oom", "host_oom", "fit"]
    ov, reason = L.initial_overrides(ctx, POLICY, obs)
    assert (R.view_of(ctx, ov).micro, R.view_of(ctx, ov).accum) == (4, 4)
    assert reason.startswith("learned: 3 attempts of this kind on this box")
    assert (tmp_path / O.FILE_NAME).exists() and O.load_for(tmp_path / "none", ctx) == []


def test_record_attempt_reads_the_hooks_peak_file(tmp_path):
    ctx = gpu_job(micro=8, accum=2)
    peak = tmp_path / "attempt-1" / "gpu_peak.json"
    peak.parent.mkdir()
    dev = {"index": 0, "name": "NVIDIA H200", "total_bytes": ctx.gpu_capacity_bytes}
    _write_peak_file_like_the_hook(peak, [
        {"pid": 11, "rank": 0, "when": "exit", "devices": [{**dev, "max_allocated_bytes": 17 * GiB,
                                                            "max_reserved_bytes": 19 * GiB}]},
        {"pid": 12, "rank": 1, "when": "exit", "devices": [{**dev, "index": 1, "max_allocated_bytes": 18 * GiB,
                                                            "max_reserved_bytes": 20 * GiB}]}])
    with O.ObservationStore(tmp_path / O.FILE_NAME) as store:
        o = O.record_attempt(store, ctx, Overrides(), None, succeeded=True, max_step=100, resumed_from_step=None,
                             peak_file=peak, peak_rss_bytes=5 * GiB, memory_limit_bytes=None, job="j", attempt=1,
                             time=1.0)
        assert o is not None and o.gpu_peak == 20 * GiB and o.gpu_name == "NVIDIA H200"
        # No peak file (a CPU run, a crash before exit): a GPU fit without its peak is not stored.
        assert O.record_attempt(store, ctx, Overrides(), None, succeeded=True, max_step=5, resumed_from_step=0,
                                peak_file=tmp_path / "absent.json", peak_rss_bytes=None,
                                memory_limit_bytes=None) is None
        assert store.count() == 1
        assert store.all()[0] == o


def test_store_is_bounded_oldest_dropped(tmp_path):
    ctx = gpu_job()
    with O.ObservationStore(tmp_path / "o.sqlite3", max_rows=50) as store:
        for n in range(120):
            store.add(LO.observation(ctx, split(ctx, 4), None, succeeded=True, job=f"j{n}", attempt=n,
                                    peak=LO.GpuPeak(GiB, GiB, None, None, 1)))
        assert store.count() == 50
        assert [o.job for o in store.all()][:2] == ["j70", "j71"]
    rows = sqlite3.connect(tmp_path / "o.sqlite3").execute("SELECT min(id), max(id) FROM observations").fetchone()
    assert rows == (71, 120)


def test_similar_filters_by_gpu_world_and_finetuning(tmp_path):
    a, b = gpu_job(), gpu_job(cap_gib=80)
    with O.ObservationStore(tmp_path / O.FILE_NAME) as store:
        store.add(LO.observation(a, Overrides(), None, succeeded=True, peak=LO.GpuPeak(GiB, GiB, None, None, 1)))
        store.add(LO.observation(b, Overrides(), None, succeeded=True, peak=LO.GpuPeak(GiB, GiB, None, None, 1)))
        # A row another version wrote that this one cannot read is skipped, never an error.
        store._db.execute("INSERT INTO observations (time, job, attempt, outcome, finetuning_type, gpu_capacity,"
                          " world_size, body) VALUES (0, 'x', 1, 'fit', 'full', ?, 1, '{\"bogus\": 1}')",
                          (a.gpu_capacity_bytes,))
        assert [o.key["gpu_capacity"] for o in store.similar(a)] == [a.gpu_capacity_bytes]
        assert [o.key["gpu_capacity"] for o in store.similar(b)] == [b.gpu_capacity_bytes]


def test_the_three_daemon_calls_round_trip_and_never_raise(tmp_path):
    from supervisor.core.models import HostEvidence

    ctx = cpu_job()
    state = tmp_path / "state"
    assert O.first_attempt(state, ctx, POLICY) == (Overrides(), None)  # no file yet
    limit = ctx.host_memory_limit_bytes
    for n, (micro, ok) in enumerate(((16, False), (8, False), (4, True)), 1):
        got = O.record_finished(state, ctx, split(ctx, micro), None if ok else host_oom(), succeeded=ok,
                                max_step=30 if ok else 3, resumed_from_step=None,
                                peak_file=tmp_path / "attempt" / "gpu_peak.json",  # a CPU run writes none
                                host=HostEvidence(peak_rss_bytes=int(1.32 * GiB) if ok else int(1.8 * GiB),
                                                  memory_limit_bytes=limit),
                                job="demo", attempt=n, time=float(n))
        assert got is not None and got.outcome == ("fit" if ok else "host_oom")
    ov, reason = O.first_attempt(state, ctx, POLICY)
    assert R.view_of(ctx, ov).micro == 4 and "4x4 fit (peak 1.32 GiB of 1.91 GiB)" in reason
    assert O.refusal(state, ctx, POLICY) is None
    # A state folder that is not a database: the learning is lost, the job is not.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / O.FILE_NAME).write_text("not sqlite" * 100)
    assert O.record_finished(bad, ctx, Overrides(), None, succeeded=True, max_step=1, resumed_from_step=0,
                             peak_file=None, host=None) is None
    assert O.first_attempt(bad, ctx, POLICY) == (Overrides(), None)
    assert O.refusal(bad, ctx, POLICY) is None


def test_the_same_gpu_probed_a_little_differently_is_one_kind(tmp_path):
    """nvidia-smi's MiB, sysfs and torch's total_memory differ by a fraction of a percent; plan's
    --gpu-memory 80 and the daemon's probed 79.6 GiB must find the same observations."""
    probed, said = gpu_job(cap_gib=79.6), gpu_job(cap_gib=80)
    with O.ObservationStore(tmp_path / O.FILE_NAME) as store:
        store.add(LO.observation(probed, split(probed, 4), None, succeeded=True,
                                peak=LO.GpuPeak(30 * GiB, 29 * GiB, None, None, 1)))
        assert len(store.similar(said)) == 1 and len(store.similar(gpu_job(cap_gib=94))) == 0
        assert LE.tier(LO.memory_key(said, Overrides()), store.similar(said)[0].key) == "same_kind"


DEMO_MODEL = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 688, "vocab_size": 900,
              "num_attention_heads": 4, "num_key_value_heads": 4, "tie_word_embeddings": False}
# Measured: `python -m supervisor.demo.run --root /tmp/demo_h` on the build machine (RLIMIT_DATA
# 2,000,000 KiB): the record's attempts (number, peak_rss_bytes, max_step, resumed_from_step).
DEMO_ATTEMPTS = ((1, 16, 1_563_549_696, 8, None, "host_oom"), (2, 8, 1_656_037_376, 8, 8, "host_oom"),
                 (3, 4, 1_420_922_880, 9, 8, "success"))


def test_measured_demo_night_resubmitted_starts_at_4x4_with_the_reason(tmp_path):
    from supervisor.cli import plan
    from supervisor.core.models import Category, Diagnosis, HostEvidence
    from supervisor.intake.jobspec import parse_job_text
    from supervisor.judge.policy.estimate import read_model_shape

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(DEMO_MODEL))
    text = ("model_name_or_path: model\nstage: sft\ndo_train: true\nfinetuning_type: full\ndataset: demo\n"
            "template: default\ncutoff_len: 2048\noutput_dir: out\nper_device_train_batch_size: 16\n"
            "gradient_accumulation_steps: 1\nsupervisor:\n  name: demo-tiny-llama\n"
            "  host_memory_limit: 2000000KiB\n")
    spec = parse_job_text(text, source="demo-job.yaml", submit_dir=tmp_path)
    ctx = plan._context(spec, read_model_shape(tmp_path / "model"), None)
    host = HostEvidence(memory_limit_bytes=spec.sup.host_memory_limit)
    for n, micro, rss, step, resumed, outcome in DEMO_ATTEMPTS:
        d = None if outcome == "success" else Diagnosis(Category.HOST_OOM, "DefaultCPUAllocator", vendor="cpu")
        O.record_finished(tmp_path, ctx, split(ctx, micro), d, succeeded=d is None, max_step=step,
                          resumed_from_step=resumed, peak_file=None,
                          host=dataclasses.replace(host, peak_rss_bytes=rss), job=spec.name, attempt=n, time=n)
    ov, reason = O.first_attempt(tmp_path, ctx, POLICY)
    assert ov == split(ctx, 4)
    assert reason == ("learned: 3 attempts of this kind on this box: micro-batch 16 and 8 ran out of host memory, "
                      "4x4 fit (peak 1.32 GiB of 1.91 GiB); starting at 4x4 (observed to fit)")
    assert O.refusal(tmp_path, ctx, POLICY) is None
