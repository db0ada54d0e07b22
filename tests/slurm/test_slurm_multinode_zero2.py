"""The 2-rank ZeRO-2 night across two Slurm nodes (scripts/slurm2.sh: node1 and node2, each its own
network namespace, one rank per node, gloo between them): real LLaMA-Factory 0.9.5 with its own
ZeRO-2 preset and DeepSpeed, rank 1 (node2) out of GPU-style memory in the forward of the long
step, three steps after its last regular checkpoint. Every rank writes its own shard of the last
finished step on its own node, the daemon names the node and rank that ran out, the remedy keeps the
effective batch across the world, and the night's per-step losses are the uninterrupted 2-rank
run's (the same job on one node: the same world of 2 ranks, the same arithmetic). The daemon is
killed -9 while the second attempt runs on both nodes and takes the same Slurm job back.

The OOM comes from the test-only hook of tests/e2e/rank_oom (see test_multirank_night.py); the
product contains no injection.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from supervisor.hooks.markers import parse_emergency
from supervisor.run import slurm as sl
from supervisor.run.checkpoints import scan_output_dir

from ..conftest import QUIET_OMP, pids_with_marker
from ..conftest_ml import TRAIN_ENV, VENV_BIN, needs_llamafactory, steps_logged
from ..e2e.test_multirank_night import (
    ACCUM,
    CACHE,
    DS_Z2,
    HOOK,
    MAX_TOKENS,
    MICRO,
    NOTE,
    cached_reference,
    lf_config,
)
from .test_slurm_multinode import events, judged_or_ended, two_node_daemon


def launcher(folder: Path) -> list[str]:
    """The job's own launcher, a shell line that runs llamafactory-cli on each node, with a `python`
    beside it so that the daemon finds the job's interpreter (versions, resume fixups)."""
    folder.mkdir()
    script = folder / "llamafactory-cli"
    script.write_text(f'#!/bin/bash\nexec {VENV_BIN / "llamafactory-cli"} "$@"\n')
    script.chmod(0o755)
    (folder / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (folder / "python").chmod(0o755)
    return [str(script)]


@pytest.mark.slow
@pytest.mark.ml
def test_a_two_node_zero2_night_rank_1_on_node2_oom_every_rank_saves_its_shard_and_nothing_is_lost(slurm2, tmp_path):
    needs_llamafactory()
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure of DeepSpeed means this path cannot run here
        pytest.skip(f"deepspeed not importable: {e}")
    from supervisor.demo.assets import DEMO_ENV

    _, ref = cached_reference(full=False)
    if ref is None:
        pytest.skip("no uninterrupted 2-rank reference for this stack and CPU (tests/e2e/test_multirank_night.py "
                    "measures and caches it)")
    CACHE.mkdir(parents=True, exist_ok=True)
    work = tmp_path / "work"
    work.mkdir()
    out = work / "output"
    job = lf_config(out, DS_Z2)
    job["supervisor"] = {
        "name": "zero2-two-nodes", "workdir": str(work), "max_attempts": 3, "hang_timeout": "10m",
        "launcher": launcher(tmp_path / "bin"),
        # ACCELERATE_TORCH_DEVICE: with more than one rank transformers 5.6 loads the optimizer state with
        # map_location=args.device, which accelerate makes `cpu:0` on a CPU run, and torch.load cannot
        # restore "cpu:0" (seen on a 2-node resume). "cpu" is the same device; GPUs (cuda:N) are unaffected.
        "env": {**DEMO_ENV, **QUIET_OMP, "NPROC_PER_NODE": "1", "ACCELERATE_TORCH_DEVICE": "cpu",
                "PYTHONPATH": str(HOOK), "TORCH_EXTENSIONS_DIR": TRAIN_ENV["TORCH_EXTENSIONS_DIR"], "OOMTEST_RANKS": "1", "OOMTEST_MAX_TOKENS": str(MAX_TOKENS),
                "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"},
        "slurm": {"nodes": 2, "mem": "8G"},
    }
    d = two_node_daemon(tmp_path).start()
    t0 = time.monotonic()
    try:
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
        assert d.cli("submit", str(tmp_path / "job.yaml")).returncode == 0
        d.wait_for(lambda: judged_or_ended(d, 1), timeout=600, what="attempt 1 judged")
        assert d.job_state(1) not in ("failed", "succeeded"), json.dumps(d.show(1)["attempt_list"], default=str)[-4000:]
        # Attempt 2 runs on both nodes: the daemon is killed -9 and must take the same Slurm job back.
        d.wait_for(lambda: d.cli("logs", "1", "--attempt", "2").stdout.count("Multi-node training enabled") >= 2,
                   timeout=400, what="attempt 2's torchrun on both nodes")
        second_job = [e["data"]["slurm_job"] for e in events(d, 1, "slurm_submitted")][-1]
        d.kill9()
        time.sleep(1)
        d.start()
        d.wait_state(1, {"succeeded", "failed"}, timeout=900)
    finally:
        d.stop(signal.SIGTERM, timeout=60)
    took = time.monotonic() - t0
    shown = d.show(1)
    assert shown["state"] == "succeeded", json.dumps(shown, indent=1, default=str)[-6000:]
    attempts = shown["attempt_list"]
    first, last = attempts[0], attempts[-1]

    # 1. rank 1 on node2 ran out in step 9's forward; the attempt record names both
    diag = first["diagnosis"]
    assert (diag["category"], diag["rank"], diag["node"]) == ("gpu_oom", 1, "node2"), diag
    assert "On node node2 (rank 1)" in diag["summary"], diag["summary"]
    ended = next(e for e in events(d, 1, "attempt_ended") if e["attempt"] == 1)
    assert (ended["data"]["node"], ended["data"]["rank"]) == ("node2", 1), ended
    # the daemon stopped both nodes itself on the fatal line; Slurm's verdict is kept beside it
    assert any(e["attempt"] == 1 for e in events(d, 1, "fatal_detected"))
    v1 = next(e for e in events(d, 1, "scheduler_verdict") if e["attempt"] == 1)
    assert v1["data"]["nodes"] == ["node1", "node2"] and v1["data"]["evidence"][0].startswith("Slurm ")
    assert first["decision"]["kind"] == "escalate" and first["decision"]["rung"] == "micro_batch", first["decision"]
    assert "x2 =" in json.dumps(first["decision"]), first["decision"]  # the world of 2 in the remedy's words

    # 2. step 8 saved by both ranks, each on its own node, as a checkpoint that loads like a regular one
    assert first["emergency_checkpoint"].startswith("emergency checkpoint at step 8"), first
    log1 = "\n".join(p.read_text(errors="replace") for p in sorted((d.state / "jobs/1/attempt-1").glob("*.log")))
    em = parse_emergency(log1.splitlines())
    assert (em.outcome, em.step, em.oom_rank, em.world_size) == ("saved", 8, 1, 2), em
    scan = scan_output_dir(out, expected_world_size=2)
    assert [c.step for c in scan.complete] == [5, 8, 9]
    assert [c.zero_stage for c in scan.complete[:2]] == [2, 2]
    regular = {p.name.replace("global_step5", "global_step8") for p in (out / "checkpoint-5").iterdir()}
    assert {p.name for p in (out / "checkpoint-8").iterdir()} == regular | {NOTE}
    shards = {p.name for p in (out / "checkpoint-8" / "global_step8").iterdir()}
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= shards
    note = json.loads((out / "checkpoint-8" / NOTE).read_text())
    assert (note["step"], note["failing_rank"], note["shards_from_ranks"]) == (8, 1, [0, 1]), note
    # each rank's own shard, written on its own node, and how long it took there; `show` says it per rank
    assert {r: v["node"] for r, v in note["ranks"].items()} == {"0": "node1", "1": "node2"}, note
    assert note["failing_node"] == "node2" and all(v["save_s"] > 0 for v in note["ranks"].values()), note
    assert "per rank 0: " in first["emergency_checkpoint"] and "(node2)" in first["emergency_checkpoint"], first

    # 3. 0 steps lost; later attempts resumed from checkpoint-8, effective batch kept over 2 nodes x 1 rank
    assert all(a["steps_lost"] == 0 for a in attempts[:-1]), [(a["number"], a["steps_lost"]) for a in attempts]
    for a in attempts[1:]:
        eff = yaml.safe_load((d.state / f"jobs/1/attempt-{a['number']}/effective.yaml").read_text())
        assert eff["per_device_train_batch_size"] < MICRO
        assert eff["per_device_train_batch_size"] * eff["gradient_accumulation_steps"] == MICRO * ACCUM
        assert a["resumed_from_step"] == 8, a
    assert last["exit"]["returncode"] == 0 and last["max_step"] == last["total_steps"] == 9
    assert pids_with_marker(str(d.state)) == []

    # Re-adopted after kill -9: the same Slurm job, not a new submission; each node's end kept
    assert any(e["attempt"] == 2 and second_job in e["message"] for e in events(d, 1, "attempt_adopted")), \
        [e["message"] for e in events(d, 1, "attempt_adopted")]
    ids = [e["data"]["slurm_job"] for e in events(d, 1, "slurm_submitted")]
    assert len(ids) == len(attempts) and len(set(ids)) == len(ids)
    records = sorted(p.name for p in (d.state / f"jobs/1/attempt-{last['number']}").glob("exit*.json"))
    assert records == ["exit-node1.json", "exit-node2.json"]
    assert sl.query(ids[-1]).state == "COMPLETED"

    # 4. the night's losses are the uninterrupted 2-rank run's
    got = {s: r["loss"] for s, r in steps_logged(out).items()}
    assert sorted(got) == sorted(ref) == list(range(1, 10))
    rel = {s: abs(got[s] - ref[s]) / abs(ref[s]) for s in ref}
    assert all(math.isclose(got[s], ref[s], rel_tol=1e-5) for s in ref), (got, ref, rel)
    print(f"two-node ZeRO-2 night: {len(attempts)} attempts, save {note['save_s']} s, "
          f"max relative loss diff {max(rel.values()):.2e}, {took:.0f} s")
