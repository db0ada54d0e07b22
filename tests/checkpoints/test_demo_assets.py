"""The demo's local model/dataset, and the mid-run host OOM its job reproduces."""

from __future__ import annotations

import json
import os
import resource
import subprocess

import pytest

from supervisor.demo.assets import build_demo_assets, demo_job_config
from supervisor.judge.resume import plan_resume, run_shape
from supervisor.run.checkpoints import scan_output_dir
from supervisor.run.progress import read_progress
from tests.conftest_ml import CACHE, LLAMAFACTORY_CLI, TRAIN_ENV, needs_llamafactory, write_job


def test_assets_are_built_once_atomically_with_short_then_long_samples(tmp_path):
    a = build_demo_assets(tmp_path, hidden=32, layers=1, heads=2, n_short=5, n_long=2, long_tokens=300)
    again = build_demo_assets(tmp_path, hidden=32, layers=1, heads=2, n_short=5, n_long=2, long_tokens=300)
    assert a == again
    assert [p.name for p in tmp_path.iterdir()] == [a.model_dir.parent.name]  # no temp dirs left
    other = build_demo_assets(tmp_path, hidden=32, layers=1, heads=2, n_short=5, n_long=2, long_tokens=200)
    assert other.model_dir != a.model_dir  # the cache key covers every parameter

    info = json.loads((a.dataset_dir / "dataset_info.json").read_text())
    rows = json.loads((a.dataset_dir / info[a.dataset_name]["file_name"]).read_text())
    assert len(rows) == 7 and all(set(r) == {"instruction", "input", "output"} for r in rows)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.model_dir)
    sizes = [len(tok.encode(r["instruction"] + " " + r["output"], add_special_tokens=False)) for r in rows]
    assert max(sizes[:5]) < 80
    assert all(270 <= s <= 300 for s in sizes[5:]), sizes
    assert 700 <= len(tok) <= 1000
    cfg = json.loads((a.model_dir / "config.json").read_text())
    assert cfg["vocab_size"] == len(tok) and cfg["hidden_size"] == 32
    assert not list(a.model_dir.glob("*.bin"))  # safetensors only


@pytest.mark.slow
@pytest.mark.ml
def test_demo_job_dies_of_host_oom_after_a_checkpoint_and_the_micro_batch_remedy_finishes(tmp_path):
    """RLIMIT_DATA 2,000,000 KiB: steps 1-8 (short batches) fit, step 9 (16 long samples) does not.

    Measured here: 7 of 7 runs failed at step 9 after checkpoint-8; the remedy finished every time.
    """
    needs_llamafactory()
    import transformers

    assets = build_demo_assets(CACHE / "assets")
    out = tmp_path / "out"
    limit = 2_000_000 * 1024

    def run(cfg: dict, name: str) -> tuple[int, str]:
        job = write_job(tmp_path / f"{name}.yaml", cfg)
        proc = subprocess.run(
            [str(LLAMAFACTORY_CLI), "train", str(job)], check=False, capture_output=True, text=True,
            env={**os.environ, **TRAIN_ENV}, cwd=tmp_path, timeout=600,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_DATA, (limit, limit)),
        )
        return proc.returncode, proc.stdout + proc.stderr

    rc, log = run(demo_job_config(assets, out), "first")
    assert rc == 1 and "DefaultCPUAllocator: can't allocate memory" in log, log[-3000:]
    assert read_progress(out).max_step == 8
    scan = scan_output_dir(out)
    assert scan.latest is not None and scan.latest.step == 8 and scan.incomplete == ()

    first = demo_job_config(assets, out)
    remedy = demo_job_config(assets, out, micro_batch=4, grad_accum=4)
    plan = plan_resume(scan.latest, prev=run_shape(first, world_size=1, deepspeed_cfg=None),
                       nxt=run_shape(remedy, world_size=1, deepspeed_cfg=None),
                       transformers_version=transformers.__version__)
    assert plan.mode == "exact"
    rc, log = run({**remedy, **plan.yaml}, "remedy")
    assert rc == 0, log[-3000:]
    assert "Fast-forwarding the dataloader past 0 epochs and 32 batches" in log
    assert read_progress(out, since_step=8).max_step == 9
