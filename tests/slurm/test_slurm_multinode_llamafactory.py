"""A real two-node LLaMA-Factory night on scripts/slurm2.sh: one torchrun per node (gloo on the CPU),
an OOM on node2's rank, the daemon's own stop of both nodes, the diagnosis naming node2 and rank 1,
a remedy that keeps the effective batch across the whole world (micro x accumulation x 2 nodes x 1
rank), a resume from the checkpoint both nodes share, and a kill -9 of the daemon that re-adopts
the running two-node job.

How the OOM is made (measured, one rank, this tiny model with eager attention, 2000-token samples):
the rank's peak private memory (RLIMIT_DATA counts it) is ~2.35 GiB on the short batches, 3.14 GiB
with 2 long samples in a micro-batch, 3.91 GiB with 4. The dataset is 68 short samples then 4 long
ones, read in order; accelerate deals global batches round-robin to the ranks, so with micro-batch 4
on 2 ranks step 9 gives rank 1 (node2) all 4 long samples and rank 0 none; after the remedy
(micro-batch 2, accumulation 2) each rank meets 2 of them in one micro-batch. node2's launcher (the
job's own `launcher:`, a shell line) sets RLIMIT_DATA 3.5 GiB on node2 only (SLURM_NODEID 1, which
case 1 now gives it): the first attempt dies at step 9 with checkpoint-8 saved, the second fits.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from supervisor.run import slurm as sl

from ..conftest import QUIET_OMP, pids_with_marker
from ..conftest_ml import CACHE, VENV_BIN, needs_llamafactory
from .test_slurm_multinode import events, judged_or_ended, two_node_daemon

NODE2_LIMIT_KIB = 3500 * 1024  # between 3.14 GiB (2 long samples) and 3.91 GiB (4), far above 2.35 (short)


def launcher(folder: Path) -> list[str]:
    """The job's launcher: llamafactory-cli, with a host-memory limit on node2's processes only.
    A `python` beside it, so the daemon finds the job's interpreter (versions, resume fixups)."""
    folder.mkdir()
    script = folder / "llamafactory-cli"
    script.write_text("#!/bin/bash\n# node2 (SLURM_NODEID 1) runs under a host-memory limit; node1 does not\n"
                      f'if [ "$SLURM_NODEID" = 1 ]; then ulimit -d {NODE2_LIMIT_KIB}; fi\n'
                      f'exec {VENV_BIN / "llamafactory-cli"} "$@"\n')
    script.chmod(0o755)
    (folder / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (folder / "python").chmod(0o755)
    return [str(script)]


@pytest.mark.slow
@pytest.mark.ml
def test_a_two_node_night_oom_on_node2_remedy_resume_and_readoption(slurm2, tmp_path):
    needs_llamafactory()
    from supervisor.demo.assets import DEMO_ENV, build_demo_assets, demo_job_config

    assets = build_demo_assets(CACHE / "assets", hidden=64, layers=2, heads=8, n_short=68, n_long=4,
                               long_tokens=2000, max_positions=4096)
    work = tmp_path / "work"
    work.mkdir()
    out = work / "output"
    job = demo_job_config(assets, out, micro_batch=4, grad_accum=1, save_steps=4)
    job.update(cutoff_len=2048, flash_attn="disabled")
    job["supervisor"] = {
        "name": "two-nodes", "workdir": str(work), "max_attempts": 4, "hang_timeout": "10m",
        "launcher": launcher(tmp_path / "bin"),
        # ACCELERATE_TORCH_DEVICE: with more than one rank transformers 5.6 loads the optimizer state
        # with map_location=args.device, which accelerate makes `cpu:0` on a CPU run, and torch.load
        # cannot restore "cpu:0" ("don't know how to restore data location ... (tagged with cpu:0)",
        # seen here on the resume). "cpu" is the same device. Not an issue on GPUs (cuda:N).
        "env": {**DEMO_ENV, **QUIET_OMP, "NPROC_PER_NODE": "1", "ACCELERATE_TORCH_DEVICE": "cpu",
                "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"},
        "slurm": {"nodes": 2, "mem": "8G"},
    }
    d = two_node_daemon(tmp_path).start()
    t0 = time.monotonic()
    try:
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
        assert d.cli("submit", str(tmp_path / "job.yaml")).returncode == 0
        d.wait_for(lambda: judged_or_ended(d, 1),
                   timeout=600, what="attempt 1 judged")
        first_s = time.monotonic() - t0
        assert d.job_state(1) not in ("failed", "succeeded"), json.dumps(d.show(1)["attempt_list"], default=str)[-4000:]
        # Attempt 2 runs on both nodes: the daemon is killed -9 and must take the same Slurm job back.
        d.wait_for(lambda: d.cli("logs", "1", "--attempt", "2").stdout.count("Multi-node training enabled") >= 2, timeout=400,
                   what="attempt 2's torchrun on both nodes")
        second_job = [e["data"]["slurm_job"] for e in events(d, 1, "slurm_submitted")][-1]
        d.kill9()
        time.sleep(1)
        d.start()
        d.wait_state(1, {"succeeded", "failed"}, timeout=600)
    finally:
        d.stop(signal.SIGTERM, timeout=60)
    total_s = time.monotonic() - t0
    shown = d.show(1)
    print(d.cli("show", "1").stdout)
    print(f"two-node night: attempt 1 judged after {first_s:.0f} s, all done after {total_s:.0f} s")
    assert shown["state"] == "succeeded", json.dumps(shown, indent=1, default=str)[-6000:]
    attempts = shown["attempt_list"]
    first, last = attempts[0], attempts[-1]

    # The OOM on node2's rank 1, seen by the daemon as a fatal line: it stopped both nodes itself,
    # and the verdict is the OOM (never "someone cancelled the job"), with its node and rank.
    diag = first["diagnosis"]
    assert (diag["category"], diag["rank"], diag["node"]) == ("host_oom", 1, "node2"), diag
    assert "On node node2 (rank 1)" in diag["summary"] and "can't allocate memory" in json.dumps(diag["evidence"])
    assert any(e["attempt"] == 1 for e in events(d, 1, "fatal_detected"))
    ended = next(e for e in events(d, 1, "attempt_ended") if e["attempt"] == 1)
    assert (ended["data"]["node"], ended["data"]["rank"]) == ("node2", 1), ended
    assert first["max_step"] == 8 and first["checkpoint_step_after"] == 8
    assert first["decision"]["kind"] == "escalate" and first["decision"]["rung"] == "micro_batch", first["decision"]
    v1 = next(e for e in events(d, 1, "scheduler_verdict") if e["attempt"] == 1)
    assert v1["data"]["nodes"] == ["node1", "node2"] and v1["data"]["evidence"][0].startswith("Slurm ")

    # The remedy keeps the effective batch across the world: micro x accumulation x 2 nodes x 1 rank.
    eff = yaml.safe_load((d.state / "jobs/1/attempt-2/effective.yaml").read_text())
    assert eff["per_device_train_batch_size"] < 4
    assert eff["per_device_train_batch_size"] * eff["gradient_accumulation_steps"] * 2 * 1 == 4 * 1 * 2 * 1
    assert "x2 =" in json.dumps(first["decision"]), first["decision"]  # the world of 2 in the remedy's words
    assert eff["resume_from_checkpoint"].endswith("checkpoint-8") and attempts[1]["resumed_from_step"] == 8

    # Re-adopted after kill -9: the same Slurm job, not a new submission.
    assert any(e["attempt"] == 2 and second_job in e["message"] for e in events(d, 1, "attempt_adopted")), \
        [e["message"] for e in events(d, 1, "attempt_adopted")]
    ids = [e["data"]["slurm_job"] for e in events(d, 1, "slurm_submitted")]
    assert len(ids) == len(attempts) and len(set(ids)) == len(ids)

    # Both nodes trained: each rank saved its RNG state into the shared checkpoints; the global step
    # went on from 8 to 9, and the last attempt succeeded on both nodes.
    for ckpt in ("checkpoint-4", "checkpoint-8"):
        assert {p.name for p in (out / ckpt).glob("rng_state_*.pth")} == {"rng_state_0.pth", "rng_state_1.pth"}
    steps = [json.loads(ln)["current_steps"] for ln in (out / "trainer_log.jsonl").read_text().splitlines() if ln.strip()]
    assert steps[-1] == 9 and steps.count(9) >= 1 and 1 not in steps[steps.index(8) + 1:], steps
    assert last["exit"]["returncode"] == 0 and last["diagnosis"]["category"] == "success"
    records = sorted(p.name for p in (d.state / f"jobs/1/attempt-{last['number']}").glob("exit*.json"))
    assert records == ["exit-node1.json", "exit-node2.json"]
    assert sl.query(ids[-1]).state == "COMPLETED"
    assert pids_with_marker(str(d.state)) == []
