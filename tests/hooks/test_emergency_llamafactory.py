"""The emergency checkpoint for real: the demo's LLaMA-Factory job runs out of host memory.

The demo job (3.5M-param Llama, 128 short then 16 long samples in order, micro-batch 16 x 1,
two epochs = 18 steps) under RLIMIT_DATA 2,000,000 KiB fails at step 9, the first long batch,
in PyTorch's CPU allocator. With `save_steps: 5` the last regular checkpoint is 5: without the
hook steps 6-8 are lost. With it the run leaves a complete checkpoint-8, and the remedy
attempt (micro-batch 4 x 4, same effective batch, same limit) resumes there and finishes.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
from pathlib import Path

import pytest
import yaml

from supervisor.core.models import ExitRecord
from supervisor.demo.assets import build_demo_assets, demo_job_config
from supervisor.demo.run import DEMO_RLIMIT
from supervisor.hooks.markers import parse_emergency
from supervisor.judge.diagnosis import diagnose_file
from supervisor.judge.policy.render import HOOK_DIR
from supervisor.judge.resume import plan_resume, run_shape
from supervisor.run.checkpoints import scan_output_dir
from supervisor.run.progress import read_progress, steps_lost
from tests.conftest_ml import (
    LLAMAFACTORY_CLI,
    TRAIN_ENV,
    kept_steps,
    needs_llamafactory,
    steps_logged,
)

pytestmark = [pytest.mark.slow, pytest.mark.ml]

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "demo-assets"  # shared with the e2e demo
LIMIT_BYTES = int(DEMO_RLIMIT.removesuffix("KiB")) * 1024
SAVED_RE = re.compile(r"^oom-supervisor: emergency checkpoint at step (\d+): (\S+) \(saved in", re.MULTILINE)


def job(out: Path, **overrides) -> dict:
    cfg = demo_job_config(build_demo_assets(CACHE), out, micro_batch=16, grad_accum=1, save_steps=5,
                          epochs=2.0)
    cfg.update(overrides)
    return cfg


def train(root: Path, name: str, cfg: dict, *, limit: int | None, hook: bool = True) -> tuple[int, str]:
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOM_SUPERVISOR_") and k != "PYTHONPATH"}
    env.update(TRAIN_ENV)
    if hook:  # what the renderer sets for every attempt
        env.update(PYTHONPATH=str(HOOK_DIR), OOM_SUPERVISOR_EMERGENCY_CKPT="1")

    def rlimit():
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    log = root / f"{name}.log"
    with open(log, "wb") as fh:
        rc = subprocess.run([str(LLAMAFACTORY_CLI), "train", str(path)], stdout=fh, stderr=subprocess.STDOUT,
                            env=env, cwd=root, preexec_fn=rlimit, timeout=900, check=False).returncode
    return rc, log.read_text(errors="replace")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    needs_llamafactory()
    root = tmp_path_factory.mktemp("lf")

    def uninterrupted() -> Path:
        rc, log = train(root, "ref", job(root / "ref"), limit=None, hook=False)
        assert rc == 0, log[-3000:]
        return root / "ref"

    ref = kept_steps("lf-rlimit-demo", job(root / "ref"), uninterrupted)  # no hook, no limit: the reference
    rc, log = train(root, "oom", job(root / "out"), limit=LIMIT_BYTES)
    return {"root": root, "oom_rc": rc, "oom_log": log, "ref": ref}


def test_oom_between_checkpoints_leaves_a_complete_checkpoint_of_the_last_step(runs):
    root, log = runs["root"], runs["oom_log"]
    out = root / "out"
    assert runs["oom_rc"] == 1, log[-3000:]
    assert "DefaultCPUAllocator: can't allocate memory" in log
    saved = SAVED_RE.search(log)
    assert saved, [line for line in log.splitlines() if "oom-supervisor" in line]
    assert saved[1] == "8" and saved[2] == str(out / "checkpoint-8")
    em = parse_emergency(log.splitlines())
    assert (em.outcome, em.step, em.path) == ("saved", 8, str(out / "checkpoint-8"))
    # The line saying the save started is a line of its own, although LLaMA-Factory's progress bar
    # had left the cursor mid-line (it was glued to "44%|...| 8/18 [...]" before the fix); a log
    # cut there reads as a save that was interrupted.
    started = log.splitlines()[: em.line_no - 1]
    assert parse_emergency(started).outcome == "interrupted", [ln for ln in started if "oom-supervisor" in ln]
    scan = scan_output_dir(out, expected_world_size=1)
    assert [c.step for c in scan.complete] == [5, 8] and scan.incomplete == ()
    assert scan.latest.train_batch_size == 16
    reached = read_progress(out).max_step
    assert reached == 8 and steps_lost(reached, scan.latest.step) == 0  # 3 without the hook
    # The supervisor's diagnosis of this real log: still a host OOM in a training step.
    diag = diagnose_file(root / "oom.log", ExitRecord(returncode=1))
    assert diag.category.value == "host_oom" and diag.subkind == "cpu_allocator", diag.summary
    assert diag.phase is not None and diag.phase.value == "train_step", diag.summary


def test_resuming_the_emergency_checkpoint_with_the_remedy_matches_an_uninterrupted_run(runs):
    root = runs["root"]
    out = root / "out"
    ckpt = scan_output_dir(out).latest
    prev = run_shape(job(out), world_size=1, deepspeed_cfg=None)
    nxt_cfg = job(out, per_device_train_batch_size=4, gradient_accumulation_steps=4)
    import transformers

    plan = plan_resume(ckpt, prev=prev, nxt=run_shape(nxt_cfg, world_size=1, deepspeed_cfg=None),
                       transformers_version=transformers.__version__)
    assert plan.mode == "exact" and plan.fixups == ()
    rc, log = train(root, "resume", {**nxt_cfg, **plan.yaml}, limit=LIMIT_BYTES)
    assert rc == 0, log[-3000:]
    assert "Fast-forwarding the dataloader past 0 epochs and 32 batches" in log  # 8 steps x 4 micro-batches

    ref, got = runs["ref"], steps_logged(out)
    assert sorted(got) == sorted(ref) == list(range(1, 19))
    for step in range(1, 9):  # attempt 1, same configuration as the reference until it failed
        assert got[step]["loss"] == ref[step]["loss"]
    deltas = {s: abs(got[s]["loss"] - ref[s]["loss"]) for s in range(9, 19)}
    print("loss deltas after the resume (micro-batch 4 x 4 vs 16 x 1):", json.dumps(deltas))
    for step in range(9, 19):
        assert got[step]["lr"] == pytest.approx(ref[step]["lr"], rel=1e-12, abs=1e-15)
        # Measured: max |delta| 4.9e-06 on losses ~6.5 (a different summation order only).
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step
    final = json.loads((out / "trainer_state.json").read_text())
    assert final["global_step"] == 18
