"""Issue 27 through the real daemon: the second night is never worse than the first, even when what
learning recorded is wrong. The trainer is a stand-in for `llamafactory-cli train`
(tests/jobs/lf_memory_trainer.py): a real process whose host memory grows with its micro-batch,
held to the job's host_memory_limit by RLIMIT_DATA, that writes LLaMA-Factory's trainer log and
checkpoints; a night costs seconds, not a LLaMA-Factory run."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest
import yaml

from supervisor.record.observations import ObservationStore

from ..conftest import REPO, DaemonProc, drop, pids_with_marker, write_config

pytestmark = pytest.mark.slow

TRAINER = REPO / "tests" / "jobs" / "lf_memory_trainer.py"
TINY = {"hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 688, "vocab_size": 4000,
        "num_attention_heads": 4, "num_key_value_heads": 4}
MiB = 1 << 20
# Under 250 MiB of RLIMIT_DATA, with 32 MiB of activations per sample after step 3 (the long
# batch, after checkpoint-3): 16x1 and 8x2 run out, 4x4 fits (~170 MiB).
LIMIT, HEAVY = "250MiB", 32
STANDIN = {"STANDIN_STEPS": "6", "STANDIN_SHORT_STEPS": "3", "STANDIN_BASE_MIB": "20", "STANDIN_HOLD_S": "0.05"}


def lf_job(work: Path, out: str, *, per_sample: float, name: str = "nightly", cutoff: int = 1024) -> str:
    (work / "model").mkdir(parents=True, exist_ok=True)
    (work / "model" / "config.json").write_text(json.dumps(TINY))
    (work / "data").mkdir(exist_ok=True)
    (work / "data" / "dataset_info.json").write_text(json.dumps({"tiny": {"file_name": "tiny.json"}}))
    (work / "data" / "tiny.json").write_text(json.dumps([{"instruction": "hi " * 8, "input": "", "output": "ok"}] * 4))
    return yaml.safe_dump({
        "model_name_or_path": str(work / "model"), "stage": "sft", "do_train": True, "finetuning_type": "full",
        "dataset": "tiny", "dataset_dir": str(work / "data"), "template": "default", "cutoff_len": cutoff,
        "output_dir": str(work / out), "per_device_train_batch_size": 16, "gradient_accumulation_steps": 1,
        "save_steps": 3,
        "supervisor": {"name": name, "launcher": [sys.executable, str(TRAINER)], "workdir": str(work),
                       "host_memory_limit": LIMIT, "max_attempts": 5,
                       "env": {**STANDIN, "STANDIN_MIB_PER_SAMPLE": str(per_sample)}}})


def run_night(d: DaemonProc, job: int, text: str) -> dict:
    drop(d.spool, f"night-{job}.yaml", text)
    d.wait_state(job, {"succeeded", "failed"}, timeout=120)
    shown = d.show(job)
    assert shown["state"] == "succeeded", json.dumps(shown, indent=1, default=str)[-4000:]
    return shown


def split(d: DaemonProc, job: int, attempt: int) -> str:
    eff = yaml.safe_load((d.state / f"jobs/{job}/attempt-{attempt}/effective.yaml").read_text())
    return f"{eff['per_device_train_batch_size']}x{eff['gradient_accumulation_steps']}"


def steps_trained(shown: dict) -> int:
    """Optimizer steps the night ran, redone ones included: what its attempts cost in training."""
    return sum((a["max_step"] or 0) - (a["resumed_from_step"] or 0) for a in shown["attempt_list"])


def test_a_recorded_fit_that_no_longer_fits_falls_back_to_the_known_good_one(tmp_path):
    """Night 1 learns nothing: 16x1 and 8x2 run out after checkpoint-3, 4x4 fits. Then learning is
    made wrong: two fits of 8x2 are recorded (as lighter nights would leave them), outweighing its
    one OOM, so night 2 starts at 8x2, which no longer fits. The next attempt is 4x4, the fit night
    1 saw (not a climb from the failed guess), from the checkpoint night 2 saved, and night 2 ends
    no later than night 1: fewer attempts, no more steps."""
    work = tmp_path / "work"
    d = DaemonProc(tmp_path / "state", tmp_path / "spool", write_config(tmp_path / "daemon.yaml"),
                   tmp_path / "daemon.log").start()
    try:
        night1 = run_night(d, 1, lf_job(work, "out-1", per_sample=HEAVY))
        assert [split(d, 1, a["number"]) for a in night1["attempt_list"]] == ["16x1", "8x2", "4x4"]
        assert not [e for e in night1["events"] if e["kind"] == "learned_plan"]

        with ObservationStore.in_state(d.state) as store:
            seen = store.all()
            oom = next(o for o in seen if o.attempt == 2 and o.outcome == "host_oom")
            assert [o.outcome for o in seen] == ["host_oom", "host_oom", "fit"], seen
            for n in (1, 2):  # newer than night 1: the job was lighter for two nights
                store.add(dataclasses.replace(oom, outcome="fit", host_peak=150 * MiB, job="nightly",
                                              attempt=n, time=time.time(), extra={}))

        night2 = run_night(d, 2, lf_job(work, "out-2", per_sample=HEAVY))
    finally:
        d.stop()
    learned = [e["message"] for e in night2["events"] if e["kind"] == "learned_plan"]
    assert learned and "starting at 8x2 (observed to fit)" in learned[0], learned
    first, second = night2["attempt_list"][:2]
    assert split(d, 2, 1) == "8x2" and first["diagnosis"]["category"] == "host_oom"
    # The next attempt is the configuration last seen to fit, said so, resumed from night 2's checkpoint.
    assert first["decision"]["rung"] == "learned_fallback", first["decision"]
    assert "back to 4x4, which fit" in first["decision"]["reason"] and "attempt 3)" in first["decision"]["reason"]
    assert split(d, 2, 2) == "4x4" and second["resumed_from_step"] == 3
    assert night2["attempts"] == 2 < night1["attempts"] == 3
    assert steps_trained(night2) <= steps_trained(night1) and second["max_step"] == second["total_steps"] == 6
    assert pids_with_marker(str(d.state)) == []
