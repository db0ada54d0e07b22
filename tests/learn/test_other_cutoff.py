"""Issue 27, "a second job of the same kind with another cutoff_len starts within one attempt of the
first fit". Seen on the demo's night 2 (a real LLaMA-Factory run, CPU-only, 1.91 GiB RLIMIT): night 1
found 16x1 and 8x2 out of host memory (lower bounds at the limit) and 4x4 fit at 1.13 GiB with
cutoff_len 2048. The same job at cutoff_len 1024 got no learned start at all: the one factor that
both OOMs raised (x1.44) put even 1x16 over the budget, so it started as submitted and climbed the
whole ladder again, though a configuration that fit at a longer cutoff_len needs no more at a
shorter one (same model, setup and split)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from supervisor.core.models import JobContext
from supervisor.judge.policy import learn as L
from supervisor.judge.policy import observed as LO
from supervisor.judge.policy import rungs as R
from supervisor.record import observations as O
from supervisor.run.gpus import probe_capacities

from .builders import POLICY, GiB, host_oom, split

LIMIT = 2_048_000_000  # the demo's 2000000KiB


def job(cutoff: int, name: str = "demo") -> JobContext:
    """The demo's job as the daemon sees it on a CPU-only box (its model's shape, LLaMA-Factory 0.9.5)."""
    cfg = {"model_name_or_path": "/cache/demo/model", "stage": "sft", "finetuning_type": "full",
           "per_device_train_batch_size": 16, "gradient_accumulation_steps": 1, "cutoff_len": cutoff}
    return JobContext(id=1, name=name, kind="llamafactory", config=cfg, param_count=3_625_216,
                      largest_layer_params=791_040, model_shape={"hidden_size": 256, "num_layers": 4, "vocab_size": 900},
                      host_memory_limit_bytes=LIMIT, host_ram_bytes=8 * GiB, visible_gpu_count=0,
                      torch_version="2.14.1", transformers_version="5.6.0")


def night_at(cutoff: int) -> list[LO.Observation]:
    """16x1 and 8x2 ran out (their lower bound: the limit, as RLIMIT_DATA leaves it), 4x4 fit at 1.13 GiB."""
    ctx = job(cutoff)
    limit, out = LIMIT, []
    for n, (micro, ok) in enumerate(((16, False), (8, False), (4, True)), 1):
        o = LO.observation(ctx, split(ctx, micro), None if ok else host_oom(), succeeded=ok,
                           peak_rss_bytes=int(1.13 * GiB) if ok else limit, memory_limit_bytes=limit,
                           max_step=30 if ok else 8, job="demo", attempt=n, time=float(n))
        assert o is not None
        out.append(o)
    return out


def test_a_shorter_cutoff_len_starts_at_the_split_that_fit_at_the_longer_one():
    obs = night_at(2048)
    ctx = job(1024, "demo-short")
    start, why = L.initial_overrides(ctx, POLICY, obs)
    assert why is not None, "no learned start: the ladder from 16x1 again"
    assert R.view_of(ctx, start).micro == 4 and R.view_of(ctx, start).accum == 4, why
    assert "starting at 4x4 (observed to fit at cutoff_len 2048 (peak 1.13 GiB, the largest seen), which needs no less" in why, why


def test_a_longer_cutoff_len_is_not_bounded_by_a_shorter_fit():
    obs = night_at(1024)
    ctx = job(2048, "demo-long")
    _, why = L.initial_overrides(ctx, POLICY, obs)
    assert why is None or "observed to fit at cutoff_len" not in why, why


def test_a_split_that_ran_out_at_the_shorter_cutoff_is_not_started_from_the_longer_fit():
    """The job's own kind decides first: 4x4 ran out at 1024 itself (the data changed), so the fit at
    2048 is no licence for it."""
    ctx = job(1024, "demo-short")
    limit = ctx.host_memory_limit_bytes
    own = LO.observation(ctx, split(ctx, 4), host_oom(), succeeded=False, peak_rss_bytes=limit,
                         memory_limit_bytes=limit, max_step=8, job="demo-short", attempt=1, time=10.0)
    start, why = L.initial_overrides(ctx, POLICY, [*night_at(2048), own])
    assert not (R.view_of(ctx, start).micro == 4 and why and "observed to fit" in why), why


DEMO_MODEL = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 688,
              "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 4, "head_dim": 64,
              "vocab_size": 900, "tie_word_embeddings": False, "model_type": "llama"}


@pytest.mark.slow
@pytest.mark.skipif(bool(probe_capacities()), reason="plans a run without a GPU: this box has one")
def test_plan_on_a_box_without_a_gpu_shows_the_start_the_daemon_takes_and_why(tmp_path):
    """`plan` judged the job as if a GPU might be there: it showed '16x1 + ZeRO-3 optimizer offload'
    (estimator x1.00) where the daemon, which probes the box, never offloads a run without a GPU."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(DEMO_MODEL))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model_name_or_path": str(tmp_path / "model"), "stage": "sft", "do_train": True, "finetuning_type": "full",
        "dataset": "demo_sft", "template": "default", "cutoff_len": 1024, "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 16, "gradient_accumulation_steps": 1,
        "supervisor": {"name": "demo-short", "host_memory_limit": "2000000KiB"}}))
    with O.ObservationStore.in_state(tmp_path / "state") as store:
        for o in night_at(2048):
            store.add(o)
    res = subprocess.run([sys.executable, "-m", "supervisor.cli", "plan", str(job), "--state-dir",
                          str(tmp_path / "state")], capture_output=True, text=True, timeout=120, check=False,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "no GPU here (none probed, none named, no --gpu-memory): planned as a run without a GPU" in out, out
    assert "learned start: 4x4\n" in out and "ZeRO-3" not in out, out
    assert "demo attempt 3 (other_seq): 4x4 cutoff_len 2048: fit, peak 1.13 GiB" in out, out
    assert ("starting at 4x4 (observed to fit at cutoff_len 2048 (peak 1.13 GiB, the largest seen), which needs no less than "
            "cutoff_len 1024; margin 0%)") in out, out
