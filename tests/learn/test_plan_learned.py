"""`oom-supervisor plan` with a state folder that holds observations: the real CLI, a real file."""

from __future__ import annotations

import json
import subprocess
import sys

from supervisor.cli import plan
from supervisor.intake.jobspec import parse_job_text
from supervisor.judge.policy import observed as LO
from supervisor.judge.policy.estimate import read_model_shape
from supervisor.record import observations as O

from .builders import GiB, host_oom, split

TINY = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 688, "vocab_size": 4000,
        "num_attention_heads": 4, "num_key_value_heads": 4}
JOB = """\
model_name_or_path: model
stage: sft
do_train: true
finetuning_type: full
dataset: alpaca_zh
template: llama3
cutoff_len: 512
output_dir: saves/x
per_device_train_batch_size: 16
gradient_accumulation_steps: 1
supervisor:
  name: demo-like
  host_memory_limit: 2000000KiB
"""


def _setup(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY))
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    spec = parse_job_text(JOB, source=str(job), submit_dir=tmp_path)
    ctx = plan._context(spec, read_model_shape(tmp_path / "model"), None)
    return job, ctx


def _cli(*args):
    from pathlib import Path

    # From the job's folder: plan resolves `model_name_or_path: model` against where it runs, as submit does.
    return subprocess.run([sys.executable, "-m", "supervisor.cli", "plan", *args], check=False,
                          capture_output=True, text=True, cwd=Path(args[0]).parent,
                          env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
                          timeout=120)


def test_plan_shows_prediction_observations_and_margin(tmp_path):
    job, ctx = _setup(tmp_path)
    state = tmp_path / "state"
    limit = ctx.host_memory_limit_bytes
    with O.ObservationStore.in_state(state) as store:
        for n, (micro, ok) in enumerate(((16, False), (8, False), (4, True)), 1):
            store.add(LO.observation(ctx, split(ctx, micro), None if ok else host_oom(), succeeded=ok,
                                    peak_rss_bytes=int(1.32 * GiB), memory_limit_bytes=limit, max_step=30,
                                    job="demo-like", attempt=n, time=float(n)))
    res = _cli(str(job), "--state-dir", str(state))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    # The same job name resubmitted: its own attempts are the closest evidence (same_job).
    assert "learned: host estimate x" in out and "from 3 observation(s) (same_job" in out
    # same_job's 3% plus the error the estimate showed: each OOM's lower bound above what the
    # others' ratios said (issue 27: a margin comes from the evidence, never from the tier alone)
    assert "margin 16% on predictions, on top of the policy's fit_headroom 5%" in out
    assert "demo-like attempt 1 (same_job): 16x1 cutoff_len 512: host_oom, peak >=1.91 GiB" in out
    assert "demo-like attempt 3 (same_job): 4x4 cutoff_len 512: fit, peak 1.32 GiB" in out
    assert " 1. learned  [learned: host ~1.32 GiB (observed); fits]" in out
    assert "starting at 4x4 (observed to fit)" in out
    assert "yaml.per_device_train_batch_size: 16 -> 4" in out
    doc = json.loads(_cli(str(job), "--state-dir", str(state), "--json").stdout)
    assert doc["learned"]["chosen"] == "4x4" and doc["learned"]["refused"] is None
    assert round(doc["learned"]["host"]["margin"], 2) == 0.16 and len(doc["learned"]["observations"]) == 3
    assert doc["steps"][0]["estimate"]["source"] == "observed"


def test_plan_without_observations_says_the_estimator_alone(tmp_path):
    job, _ = _setup(tmp_path)
    res = _cli(str(job), "--state-dir", str(tmp_path / "empty"))
    assert res.returncode == 0, res.stderr
    assert "learned: no observations of a similar run; the estimator alone" in res.stdout
    assert " 1. as submitted" in res.stdout


LLAMA70B = {"hidden_size": 8192, "num_hidden_layers": 80, "intermediate_size": 28672, "vocab_size": 128256,
            "num_attention_heads": 64, "num_key_value_heads": 8}


def test_plan_says_a_job_the_box_cannot_run_would_be_refused(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA70B))
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("  host_memory_limit: 2000000KiB\n", ""))
    res = _cli(str(job), "--state-dir", str(tmp_path / "state"), "--gpu-memory", "24", "--host-memory", "128")
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stdout.splitlines() if x.startswith("refused at submit: "))
    assert "cannot run on this box" in line and "of the 24.00 GiB GPU" in line and "host RAM" in line
    # The optimistic bound it was judged on, named, with each configuration's numbers (issue 16).
    assert ("even under the most optimistic credible estimate, DeepSpeed's estimate_zero3_model_states_mem_needs_all"
            "_cold without its additional_buffer_factor") in line
    assert "optimistic bound (DeepSpeed's estimate_zero3_model_states_mem_needs_all_cold" in res.stdout
    assert "  16x1 + ZeRO-3 parameter+optimizer offload: GPU ~3.9 GiB, host ~1182.7 GiB (too much)" in res.stdout
    doc = json.loads(_cli(str(job), "--state-dir", str(tmp_path / "state"), "--gpu-memory", "24", "--host-memory",
                          "128", "--json").stdout)
    assert doc["learned"]["refusal"]["host_capacity_bytes"] == 128 * GiB
    # With the RAM a big box has, ZeRO-3 parameter offload makes it possible: no refusal.
    ok = _cli(str(job), "--state-dir", str(tmp_path / "state"), "--gpu-memory", "24", "--host-memory", "2048")
    assert "refused at submit" not in ok.stdout
