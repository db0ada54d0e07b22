"""The emergency checkpoint of a sharded run: DeepSpeed ZeRO on 2 CPU ranks under real torchrun (gloo).

No rank holds the whole optimizer state, so every rank must write its own shard of the last
finished step while the failing rank's peer waits in a collective the failing rank will never
join (sharded.py: told through torchrun's store, its gloo connections broken, a fresh gloo
backend in each existing process group, then DeepSpeed's own save on every rank).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from supervisor.core.models import ExitRecord
from supervisor.hooks.markers import parse_emergency
from supervisor.judge.diagnosis import diagnose_file
from supervisor.run.checkpoints import scan_output_dir
from tests.hooks.reference import ddp_losses
from tests.hooks.test_emergency_ddp import NOTE, close, torchrun
from tests.hooks.test_emergency_plain import SAVED_RE, frozen_rank0, losses, markers, run

pytestmark = [pytest.mark.slow, pytest.mark.ml]

# LLaMA-Factory's own preset (examples/deepspeed/ds_z2_config.json, v0.9.5).
DS_Z2 = Path(__file__).resolve().parents[1] / "fixtures" / "llamafactory-v0.9.5" / "examples" / "deepspeed" / \
    "ds_z2_config.json"


@pytest.fixture(scope="module")
def ds_env():
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"deepspeed not importable: {e}")
    from tests.conftest_ml import DS_ENV

    return dict(DS_ENV)


@pytest.mark.parametrize("stage", [2, 3])
def test_forward_oom_on_rank_1_every_rank_saves_its_shard_and_a_resume_is_exact(tmp_path, ds_env, stage):
    from tests.conftest_ml import ds_z3

    cfg = DS_Z2
    if stage == 3:  # LLaMA-Factory's ds_z3_config.json (stage3_gather_16bit_weights_on_model_save: the save gathers)
        cfg = tmp_path / "z3.json"
        cfg.write_text(json.dumps(ds_z3(offload=False)))
    ds = ("--deepspeed", str(cfg), "--rank-seed")
    port = 29591 + 10 * (stage - 2)
    out = tmp_path / "out"
    # Rank 1's 16th forward is the second micro-batch of step 8: steps 6 and 7 are newer than checkpoint-5.
    # Rank 0 is then in (or about to enter) a collective rank 1 never joins: ZeRO-2's gradient reduction,
    # ZeRO-3's parameter gathers of that forward (left in flight: sharded.settle_zero3).
    t0 = time.monotonic()
    rc, log = run(out, *ds, "--oom-forward", "16", "--oom-rank", "1", "--oom-type", "cuda",
                  launcher=torchrun(port + 1), env_extra=ds_env, timeout=400)
    took = time.monotonic() - t0
    assert rc != 0 and "torch.OutOfMemoryError: CUDA out of memory." in log, log[-3000:]
    saved = SAVED_RE.search(log)
    assert saved and saved[1] == "7" and saved[2] == str(out / "checkpoint-7"), markers(log)
    em = parse_emergency(log.splitlines())
    assert (em.outcome, em.step, em.path) == ("saved", 7, str(out / "checkpoint-7")), em
    # The diagnosis reads rank 1's OOM: rank 0's broken collective prints no error of its own.
    diag = diagnose_file(tmp_path / "out.0.log", ExitRecord(returncode=rc))
    assert diag.category.value == "gpu_oom", diag.summary
    assert not any("oom-supervisor" in e.text or "Connection closed" in e.text for e in diag.evidence)
    scan = scan_output_dir(out, expected_world_size=2)
    assert [(c.step, c.zero_stage) for c in scan.complete] == [(5, stage), (7, stage)] and scan.incomplete == ()
    assert not list(out.glob("tmp-*"))
    ck = out / "checkpoint-7"
    assert (ck / "latest").read_text().strip() == "global_step7"
    shards = sorted(p.name for p in (ck / "global_step7").iterdir())
    assert shards == sorted(p.name for p in (out / "checkpoint-5" / "global_step5").iterdir())
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= set(shards)
    regular = {p.name.replace("global_step5", "global_step7") for p in (out / "checkpoint-5").iterdir()}
    assert {p.name for p in ck.iterdir()} == regular | {NOTE}  # a regular 2-rank save's files
    note = json.loads((ck / NOTE).read_text())
    assert (note["step"], note["failing_rank"], note["shards_from_ranks"]) == (7, 1, [0, 1]), note
    print(f"ZeRO-{stage} OOM run {took:.0f} s; from the OOM to checkpoint-7 {em.seconds} s on rank 1; rank 0: save "
          f"{note['save_s']} s, of which {note['regroup_s']} s to a fresh backend in {note['groups']} groups")

    rc, log2 = run(out, *ds, "--resume", str(ck), launcher=torchrun(port + 2), env_extra=ds_env, timeout=400)
    assert rc == 0, log2[-3000:]
    got = {**losses(log), **losses(log2)}
    assert sorted(got) == list(range(1, 13))  # 0 finished steps lost
    want = ddp_losses(torchrun(29571))  # the uninterrupted 2-rank run (tests/hooks/reference.py)
    assert close(got, want), (got, want)
    print("max relative loss delta vs the uninterrupted run:",
          max(abs(got[k] - want[k]) / abs(want[k]) for k in got))
    assert math.isfinite(got[12])


def test_zero2_oom_inside_rank_1s_optimizer_step_saves_nothing_and_names_the_rank(tmp_path, ds_env):
    out = tmp_path / "out"
    # DeepSpeed steps the two parameter groups (decay, no decay) one at a time: the 16th AdamW.step is
    # step 8's second, on rank 1, after its first group was updated (inside engine.step).
    rc, log = run(out, "--deepspeed", str(DS_Z2), "--oom-optimizer", "16", "--oom-rank", "1",
                  launcher=torchrun(29611), env_extra=ds_env, timeout=400)
    assert rc != 0
    said = [m for m in markers(log) if m.startswith("oom-supervisor: no emergency checkpoint:")]
    assert len(said) == 1, markers(log)
    assert "the OOM hit the optimizer step of step 8 on rank 1 of 2" in said[0] and "half-updated" in said[0]
    assert parse_emergency(log.splitlines()).outcome == "not_attempted"
    assert [c.step for c in scan_output_dir(out, expected_world_size=2).complete] == [5]
    assert not (out / "checkpoint-7").exists() and not list(out.glob("tmp-*"))


def test_zero2_a_rank_that_never_reports_its_phase_means_no_save_within_the_budget(tmp_path, ds_env):

    out = tmp_path / "out"
    # Rank 1 stops rank 0 (SIGSTOP) right before its OOM: rank 0's watcher can never report.
    with frozen_rank0(out, "oom-supervisor: no emergency checkpoint:"):
        rc, log = run(out, "--deepspeed", str(DS_Z2), "--oom-forward", "16", "--oom-rank", "1", "--freeze-rank0",
                      launcher=torchrun(29612), env_extra={**ds_env, "OOM_SUPERVISOR_EMERGENCY_BUDGET_S": "6"},
                      timeout=400)
    assert rc != 0
    said = [m for m in markers(log) if m.startswith("oom-supervisor: no emergency checkpoint:")]
    assert len(said) == 1, markers(log)
    assert "rank 1 of 2 (DeepSpeed ZeRO-2)" in said[0] and "rank(s) [0] did not report their phase within 3.0 s" \
        in said[0], said[0]
    assert parse_emergency(log.splitlines()).outcome == "not_attempted"
    assert [c.step for c in scan_output_dir(out, expected_world_size=2).complete] == [5]
    assert not (out / "checkpoint-7").exists() and not list(out.glob("tmp-*"))
