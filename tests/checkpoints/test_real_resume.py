"""Real LLaMA-Factory runs on the CPU (tiny local Llama), killed with SIGKILL and resumed.

Runs once per module: an uninterrupted reference run, a run killed mid-training, a run killed
mid-save. Each test then works on a copy of those folders, so the tests stay independent.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from supervisor.judge.resume import plan_resume, run_shape
from supervisor.run.checkpoints import QUARANTINE_DIR, apply_fixups, quarantine, scan_output_dir
from supervisor.run.progress import read_progress, steps_lost
from tests.conftest_ml import (
    copy_run,
    kill_when,
    needs_llamafactory,
    start_train,
    steps_logged,
    tiny_job,
    train,
    write_job,
)

pytestmark = [pytest.mark.slow, pytest.mark.ml]

MAX_STEPS = 12  # save_steps 3 -> checkpoints 3, 6, 9, 12


def _tf_version() -> str:
    import transformers

    return transformers.__version__


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    needs_llamafactory()
    root = tmp_path_factory.mktemp("runs")

    ref = root / "ref"
    assert train(write_job(root / "ref.yaml", tiny_job(ref)), root / "ref.log") == 0

    # Killed mid-training: after step 7 is logged (checkpoint-6 complete), before the next save.
    mid = root / "mid_train"
    proc = start_train(write_job(root / "mid.yaml", tiny_job(mid)), root / "mid.log")
    killed = kill_when(proc, lambda: max(steps_logged(mid), default=0) >= 7)
    assert killed, "the run finished before it could be killed"

    # Killed mid-save: the moment checkpoint-6/ exists but its trainer_state.json (written last)
    # does not yet. The save takes tens of milliseconds; a missed window is retried.
    for attempt in range(3):
        save = root / f"mid_save{attempt}"
        proc = start_train(write_job(root / f"save{attempt}.yaml", tiny_job(save)), root / "save.log")
        ck6 = save / "checkpoint-6"
        if kill_when(proc, lambda ck=ck6: ck.is_dir() and not (ck / "trainer_state.json").exists(),
                     poll=0.0005):
            break
    else:
        pytest.fail("never caught checkpoint-6 mid-save in 3 runs")
    return {"root": root, "ref": ref, "mid_train": mid, "mid_save": save}


def _resume(root: Path, out: Path, name: str, plan_yaml: dict, **overrides) -> tuple[int, str]:
    cfg = tiny_job(out, **overrides)
    cfg.update({k: v for k, v in plan_yaml.items() if v is not None})
    log = root / f"{name}.log"
    rc = train(write_job(root / f"{name}.yaml", cfg), log)
    return rc, log.read_text(errors="replace")


def test_sigkill_mid_training_resumes_from_last_complete_checkpoint(runs, tmp_path):
    out = copy_run(runs["mid_train"], tmp_path / "out")
    reached = read_progress(out).max_step
    scan = scan_output_dir(out)
    for inc in scan.incomplete:  # the kill may also have hit the save of checkpoint-9
        assert inc.step == 9
        quarantine(inc)
    latest = scan.latest
    assert latest is not None and latest.step in (6, 9) and latest.step <= reached
    assert steps_lost(reached, latest.step) == reached - latest.step

    shape = run_shape(tiny_job(out), world_size=1, deepspeed_cfg=None)
    plan = plan_resume(latest, prev=shape, nxt=shape, transformers_version=_tf_version())
    assert plan.mode == "exact" and plan.fixups == ()
    size_before = (out / "trainer_log.jsonl").stat().st_size

    rc, log = _resume(tmp_path, out, "resume", dict(plan.yaml))
    assert rc == 0, log[-3000:]
    ref, got = steps_logged(runs["ref"]), steps_logged(out)
    for step in range(latest.step + 1, MAX_STEPS + 1):
        assert got[step]["lr"] == ref[step]["lr"]
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-6)  # same batches, same RNG
    # This attempt's lines only: the first one is the step after the checkpoint.
    p = read_progress(out, since_offset=size_before)
    assert p.first_step == latest.step + 1 and p.max_step == MAX_STEPS
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == MAX_STEPS


def test_sigkill_mid_save_is_quarantined_and_micro_batch_remedy_keeps_lr_and_batch(runs, tmp_path):
    out = copy_run(runs["mid_save"], tmp_path / "out")
    scan = scan_output_dir(out)
    assert [i.path.name for i in scan.incomplete] == ["checkpoint-6"]
    assert "trainer_state.json" in scan.incomplete[0].reason
    assert scan.latest is not None and scan.latest.step == 3

    moved = quarantine(scan.incomplete[0])
    assert moved.parent == out / QUARANTINE_DIR and moved.is_dir()
    assert not (out / "checkpoint-6").exists()
    # Out of sight of transformers' last-checkpoint lookup and of its rotation glob.
    from transformers.trainer_utils import get_last_checkpoint

    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-3")
    assert not list(out.glob("checkpoint-*.*"))

    prev = run_shape(tiny_job(out), world_size=1, deepspeed_cfg=None)
    nxt = run_shape(tiny_job(out, per_device_train_batch_size=2, gradient_accumulation_steps=2),
                    world_size=1, deepspeed_cfg=None)
    plan = plan_resume(scan.latest, prev=prev, nxt=nxt, transformers_version=_tf_version())
    assert plan.mode == "exact" and plan.semantic_change is None
    apply_fixups(plan)

    rc, log = _resume(tmp_path, out, "resume", dict(plan.yaml),
                      per_device_train_batch_size=2, gradient_accumulation_steps=2)
    assert rc == 0, log[-3000:]
    assert "Instantaneous batch size per device = 2" in log
    assert re.search(r"Total train batch size \(w\. parallel, distributed & accumulation\) = 4\b", log)
    # 3 optimizer steps x 2 accumulation = 6 micro-batches of 2 = the same 12 samples skipped.
    assert "Fast-forwarding the dataloader past 0 epochs and 6 batches" in log
    ref, got = steps_logged(runs["ref"]), steps_logged(out)
    assert min(s for s in got if s > 3) == 4  # steps continue at 4, not from 0 or 7
    for step in range(4, MAX_STEPS + 1):
        assert got[step]["lr"] == pytest.approx(ref[step]["lr"], rel=1e-12, abs=1e-15)
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-4)
    final = json.loads((out / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    # transformers 5.6 trains with the new micro-batch but carries the checkpoint's recorded
    # train_batch_size forward: a checkpoint's value says nothing about what the run used.
    assert final["global_step"] == MAX_STEPS and final["train_batch_size"] == 4
    assert moved.is_dir()  # never deleted


def test_truncated_trainer_state_and_missing_rng_state_are_incomplete(runs, tmp_path):
    out = copy_run(runs["ref"], tmp_path / "out")
    state = out / "checkpoint-12" / "trainer_state.json"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    (out / "checkpoint-9" / "rng_state.pth").unlink()
    scan = scan_output_dir(out)
    reasons = {i.path.name: i.reason for i in scan.incomplete}
    assert set(reasons) == {"checkpoint-9", "checkpoint-12"}
    assert "unreadable" in reasons["checkpoint-12"]
    assert "rng_state" in reasons["checkpoint-9"]
    assert scan.latest is not None and scan.latest.step == 6


def test_llamafactory_auto_resume_would_crash_on_the_mid_save_checkpoint(runs, tmp_path):
    """Why we never trust auto-resume: it picks the highest checkpoint-N with no check."""
    out = copy_run(runs["mid_save"], tmp_path / "out")
    rc, log = _resume(tmp_path, out, "auto", {})
    assert rc != 0
    # Which file is missing first depends on where the save was cut: trainer_state.json, or the
    # weights ("Can't find a valid checkpoint at .../checkpoint-6").
    assert re.search(r"Error: .*checkpoint-6", log), log[-2000:]


def test_old_transformers_trap_fixup_patches_a_real_trainer_state_with_backup(runs, tmp_path):
    out = copy_run(runs["ref"], tmp_path / "out")
    ck = scan_output_dir(out).latest
    assert ck is not None and ck.train_batch_size == 4
    nxt = run_shape(tiny_job(out, per_device_train_batch_size=1, gradient_accumulation_steps=4),
                    world_size=1, deepspeed_cfg=None)
    plan = plan_resume(ck, prev=run_shape(tiny_job(out), world_size=1, deepspeed_cfg=None), nxt=nxt,
                       transformers_version="4.57.1")
    original = (ck.path / "trainer_state.json").read_text()
    done = apply_fixups(plan)
    again = apply_fixups(plan)  # idempotent: the first backup is kept
    assert "4 -> 1" in done[0] and "already 1" in again[0]
    assert json.loads((ck.path / "trainer_state.json").read_text())["train_batch_size"] == 1
    assert plan.fixups[0].backup.read_text() == original
    assert scan_output_dir(out).latest.train_batch_size == 1  # still complete


def test_demo_assets_load_with_transformers(runs):
    """The built tokenizer/model are what LLaMA-Factory's `template: default` needs. In this process:
    its other tests imported transformers already (a fresh interpreter paid ~6 s of CPU for it)."""
    from transformers import AutoConfig, AutoTokenizer

    from tests.conftest_ml import tiny_assets

    a = tiny_assets()
    t = AutoTokenizer.from_pretrained(str(a.model_dir))
    assert None not in (t.bos_token_id, t.eos_token_id, t.pad_token_id, t.unk_token_id)
    assert AutoConfig.from_pretrained(str(a.model_dir)).vocab_size == len(t)
