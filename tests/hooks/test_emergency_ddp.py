"""The emergency checkpoint of a replicated run: 2 CPU ranks under real torchrun (gloo), DDP.

Every rank holds the whole model and optimizer state, so the rank that hits the OOM writes
checkpoint-N alone; the other rank's RNG state of step N comes through torchrun's store from a
thread of that rank while its main thread waits in the gradient all-reduce (replica.py).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import pytest

from supervisor.hooks.markers import describe, parse_emergency
from supervisor.run.checkpoints import scan_output_dir
from tests.hooks.test_emergency_plain import SAVED_RE, VENV_BIN, frozen_rank0, losses, markers, run

pytestmark = [pytest.mark.slow, pytest.mark.ml]

NOTE = "oom-supervisor-emergency.json"


def torchrun(port: int) -> list[str]:
    launcher = [str(VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(port)]
    if not Path(launcher[0]).exists():
        pytest.skip("no torchrun")
    return launcher


def close(a: dict[int, float], b: dict[int, float]) -> bool:
    return sorted(a) == sorted(b) and all(math.isclose(a[k], b[k], rel_tol=1e-5) for k in a)


@pytest.fixture(scope="module")
def ddp_reference():
    from tests.hooks.reference import ddp_losses

    return ddp_losses(torchrun(29571))  # made once per box, shared with the ZeRO tests


def test_forward_oom_on_rank_1_saves_the_replica_and_a_2_rank_resume_is_exact(tmp_path, ddp_reference):
    out = tmp_path / "out"
    # Rank 1's 16th forward is the second micro-batch of step 8: steps 6 and 7 are newer than checkpoint-5.
    t0 = time.monotonic()
    rc, log = run(out, "--oom-forward", "16", "--oom-rank", "1", "--rank-seed", launcher=torchrun(29572), timeout=400)
    took = time.monotonic() - t0
    assert rc != 0
    saved = SAVED_RE.search(log)
    assert saved and saved[1] == "7" and saved[2] == str(out / "checkpoint-7"), markers(log)
    em = parse_emergency(log.splitlines())
    assert (em.outcome, em.step, em.rank, em.world_size, em.rng_ranks) == ("saved", 7, 1, 2, (0, 1)), em
    scan = scan_output_dir(out, expected_world_size=2)
    assert [c.step for c in scan.complete] == [5, 7] and scan.incomplete == ()
    assert not list(out.glob("tmp-*"))
    regular = {p.name for p in (out / "checkpoint-5").iterdir()}
    assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= regular
    assert {p.name for p in (out / "checkpoint-7").iterdir()} == regular | {NOTE}  # a regular 2-rank save's files
    note = json.loads((out / "checkpoint-7" / NOTE).read_text())
    assert (note["step"], note["failing_rank"], note["writer_rank"], note["rng_from_ranks"]) == (7, 1, 1, [0, 1])
    print(f"OOM run {took:.0f} s; save {note['save_s']} s (RNG answers after {note['rng_wait_s']} s)")

    rc, log2 = run(out, "--resume", str(out / "checkpoint-7"), "--rank-seed", launcher=torchrun(29573), timeout=400)
    assert rc == 0, log2[-3000:]
    got = {**losses(log), **losses(log2)}
    assert sorted(got) == list(range(1, 13))  # 0 finished steps lost
    # Attention dropout is on and each rank draws from its own seed: steps 8-12 match only with
    # each rank's own RNG of step 7's end.
    assert close(got, ddp_reference), (got, ddp_reference)
    print("max relative loss delta vs the uninterrupted run:",
          max(abs(got[k] - ddp_reference[k]) / abs(ddp_reference[k]) for k in got))
    # Control: rank 1's RNG file in rank 0's place (what a save without rank 0's answer could
    # at best do) changes the losses after the resume.
    wrong = tmp_path / "wrong"
    shutil.copytree(out / "checkpoint-7", wrong / "checkpoint-7")
    shutil.copy(wrong / "checkpoint-7" / "rng_state_1.pth", wrong / "checkpoint-7" / "rng_state_0.pth")
    rc, log3 = run(wrong, "--resume", str(wrong / "checkpoint-7"), "--rank-seed", launcher=torchrun(29580),
                   timeout=400)
    assert rc == 0, log3[-3000:]
    assert not math.isclose(losses(log3)[8], ddp_reference[8], rel_tol=1e-5), (losses(log3), ddp_reference)


def test_a_rank_that_never_answers_means_no_save_within_the_budget(tmp_path):
    out = tmp_path / "out"
    # Rank 1 stops rank 0 (SIGSTOP) right before its OOM: rank 0's watcher can never answer.
    with frozen_rank0(out, "oom-supervisor: no emergency checkpoint:"):
        rc, log = run(out, "--oom-forward", "16", "--oom-rank", "1", "--freeze-rank0", launcher=torchrun(29575),
                      timeout=400, env_extra={"OOM_SUPERVISOR_EMERGENCY_BUDGET_S": "6"})
    assert rc != 0
    said = [m for m in markers(log) if m.startswith("oom-supervisor: no emergency checkpoint:")]
    assert len(said) == 1, markers(log)
    assert "rank 1 of 2" in said[0] and "rank(s) [0]" in said[0] and "did not answer within 3.0 s" in said[0]
    assert "budget 6 s" in said[0], said[0]
    em = parse_emergency(log.splitlines())
    assert em.outcome == "not_attempted"
    assert [c.step for c in scan_output_dir(out, expected_world_size=2).complete] == [5]
    assert not (out / "checkpoint-7").exists() and not list(out.glob("tmp-*"))


def test_a_save_slower_than_its_budget_leaves_no_checkpoint_and_show_says_so(tmp_path):
    """The budget bounds the save itself, not only the wait for the other ranks: the writer's
    watchdog ends the process, the staging never becomes checkpoint-7, the resume point stays 5."""
    out = tmp_path / "out"
    t0 = time.monotonic()
    rc, log = run(out, "--oom-forward", "16", "--oom-rank", "1", "--slow-save", "120", launcher=torchrun(29577),
                  timeout=400, env_extra={"OOM_SUPERVISOR_EMERGENCY_BUDGET_S": "6"})
    took = time.monotonic() - t0
    assert rc != 0 and took < 100, (rc, took)  # ended by the budget, not by the 120 s save
    said = [m for m in markers(log) if "emergency checkpoint at step 7 failed: not done within the budget of 6 s" in m]
    assert len(said) == 1, markers(log)
    em = parse_emergency(log.splitlines())
    assert (em.outcome, em.step) == ("failed", 7), em
    words, data = describe(em)  # what `show` prints for the attempt, and what the report and metrics read
    assert "not done within the budget of 6 s" in words and data["outcome"] == "failed", words
    assert [c.step for c in scan_output_dir(out, expected_world_size=2).complete] == [5]
    assert not (out / "checkpoint-7").exists() and not list(out.glob("tmp-*"))


def test_both_ranks_oom_in_the_same_forward_one_writes_the_other_waits(tmp_path):
    out = tmp_path / "out"
    # Replicas run the same shapes: an OOM often hits every rank at once. The first to claim writes.
    rc, log = run(out, "--oom-forward", "16", launcher=torchrun(29576), timeout=400)
    assert rc != 0
    assert len(SAVED_RE.findall(log)) == 1, markers(log)
    waited = [m for m in markers(log) if "leaves the save of step 7 to the rank that claimed it first" in m]
    assert len(waited) == 1, markers(log)
    em = parse_emergency(log.splitlines())
    assert (em.outcome, em.step, em.rng_ranks) == ("saved", 7, (0, 1)), em
    scan = scan_output_dir(out, expected_world_size=2)
    assert [c.step for c in scan.complete] == [5, 7] and scan.incomplete == ()
    assert not list(out.glob("tmp-*"))


# Sharded state (DeepSpeed ZeRO-2/3 on 2 ranks): every rank writes its own shard; see
# test_emergency_sharded.py (it replaced the ZeRO-3 test here that said nothing was saved).


# --- real LLaMA-Factory, LoRA under DDP, 2 CPU ranks -----------------------------------------

LF_SCRIPT = Path(__file__).resolve().parent / "lf_ddp_train.py"


def lf_job(out: Path, **overrides) -> dict:
    from supervisor.demo.assets import build_demo_assets, demo_job_config

    cache = Path(__file__).resolve().parents[2] / ".cache" / "demo-assets"  # shared with the e2e demo
    # 2 ranks x 4 x accumulation 2 = 16 samples a step: 9 steps (the 9th the long samples); lora_dropout
    # makes every rank's RNG state matter for an exact resume.
    cfg = demo_job_config(build_demo_assets(cache), out, micro_batch=4, grad_accum=2, save_steps=4, epochs=1.0)
    cfg.update(finetuning_type="lora", lora_target="all", lora_rank=8, lora_dropout=0.1, **overrides)
    return cfg


def lf_run(root: Path, name: str, cfg: dict, port: int, oom_forward: int = 0, oom_rank: int = -1):
    import subprocess

    import yaml

    from supervisor.judge.policy.render import HOOK_DIR
    from tests.conftest_ml import TRAIN_ENV, needs_llamafactory

    needs_llamafactory()
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOM_SUPERVISOR_") and k != "PYTHONPATH"}
    env.update(TRAIN_ENV, PYTHONPATH=str(HOOK_DIR), OOM_SUPERVISOR_EMERGENCY_CKPT="1",
               PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}")
    log = root / f"{name}.log"
    with open(log, "wb") as fh:
        rc = subprocess.run([*torchrun(port), str(LF_SCRIPT), str(path), str(oom_forward), str(oom_rank)],
                            stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=root, timeout=900,
                            check=False).returncode
    return rc, log.read_text(errors="replace")


# The real LLaMA-Factory LoRA-under-DDP replica save and its 2-rank resume are proven through the
# daemon in tests/e2e/test_multirank_night.py (which replaced the direct run that stood here).
