"""A rendered escalated attempt, run for real: LLaMA-Factory + DeepSpeed ZeRO-3 offload on the CPU.

The attempt carries what three rungs render (generated ds_config.json with optimizer and
parameter offload + FORCE_TORCHRUN/NPROC_PER_NODE, the memory-fraction startup hook on
PYTHONPATH, allocator variables with OPTIM_TORCH=0) and must train and checkpoint, with the
hook loaded in the torchrun rank (no GPU here, so the cap itself stays queued).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from supervisor.core.models import Overrides, Phase
from supervisor.intake.jobspec import parse_job_text
from supervisor.judge.policy import decide, render_attempt
from tests.conftest_ml import (
    LLAMAFACTORY_CLI,
    TRAIN_ENV,
    kill_tree,
    log_records,
    needs_deepspeed,
    needs_llamafactory,
    tiny_job,
)

from .builders import attempt, job, oom

pytestmark = [pytest.mark.slow, pytest.mark.ml]


def test_escalated_attempt_trains_under_the_generated_deepspeed_config(tmp_path, default_policy):
    needs_llamafactory()
    needs_deepspeed()
    work = tmp_path / "work"
    work.mkdir()
    cfg = tiny_job(Path("out"), max_steps=4, save_steps=2)  # relative output_dir: cwd = workdir
    spec = parse_job_text(yaml.safe_dump(cfg), source="tiny.yaml", submit_dir=work)

    ctx = job(dict(spec.config), torch_version="2.5.1", visible_gpu_count=0)  # this CPU box
    h, ov = [], Overrides()
    for n, d_oom in enumerate([oom(Phase.MODEL_LOAD), oom(subkind="library"), oom(frag=True)], 1):
        h.append(attempt(n, ov, d_oom))
        ov = decide(ctx, h, d_oom, default_policy).overrides
    assert ov.rungs == ("zero3_offload_param", "memory_fraction", "allocator")

    attempt_dir = tmp_path / "attempt_4"
    attempt_dir.mkdir()
    r = render_attempt(spec, ov, attempt_dir=attempt_dir, resume_yaml={}, launcher=[str(LLAMAFACTORY_CLI)])
    for name, text in r.files.items():
        (attempt_dir / name).write_text(text)
    trace = attempt_dir / "hook.trace"
    env = {**os.environ, **TRAIN_ENV, **r.env, "OOM_SUPERVISOR_HOOK_TRACE": str(trace)}
    log = attempt_dir / "log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(r.argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=spec.workdir,
                                start_new_session=True)
    try:
        rc = proc.wait(timeout=900)
    finally:
        kill_tree(proc)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    steps = [rec["current_steps"] for rec in log_records(work / "out") if "loss" in rec]
    assert steps[-1] == 4
    ckpt = work / "out" / "checkpoint-4"
    # A DeepSpeed checkpoint: `latest` names the global_step folder with the ZeRO shards.
    assert (ckpt / "latest").read_text().strip() == "global_step4", sorted(p.name for p in ckpt.iterdir())
    assert any((ckpt / "global_step4").glob("*optim_states.pt"))
    assert "oom-supervisor hook" not in text  # no warnings from the hook
    # The cap was queued in the launcher (which imports torch but never starts CUDA) and in the rank.
    lines = trace.read_text().splitlines()
    assert any("local_rank=0" in ln for ln in lines) and all("fraction=0.88" in ln for ln in lines), lines
