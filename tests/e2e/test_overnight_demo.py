"""The product's most important test: a real LLaMA-Factory run hits a real OOM mid-run and
still finishes, through the real daemon, once per memory-limit mechanism."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import yaml

from supervisor.demo.run import (
    DEMO_CGROUP_LIMIT,
    DEMO_RLIMIT,
    DEMO_SAVE_STEPS,
    default_launcher,
    demo_job,
)
from supervisor.run.limits import detect_cgroup

from ..conftest import QUIET_OMP, DaemonProc, drop, pids_with_marker, write_config

pytestmark = [pytest.mark.slow, pytest.mark.ml]

if shutil.which(default_launcher()[0]) is None and not Path(default_launcher()[0]).exists():
    pytest.skip("llamafactory-cli is not installed (pip install -e '.[llamafactory]')", allow_module_level=True)

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "demo-assets"


def run_demo(tmp_path: Path, *, cgroups: str, limit: str, save_steps: int = 4) -> tuple[DaemonProc, dict]:
    root = tmp_path / "demo"
    (root / "work").mkdir(parents=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    (root / "cache").symlink_to(CACHE)
    job = demo_job(root, memory_limit=limit, launcher=default_launcher(), save_steps=save_steps)
    job["supervisor"]["env"].update(QUIET_OMP)
    d = DaemonProc(tmp_path / "state", tmp_path / "spool",
                   write_config(tmp_path / "daemon.yaml", cgroups=cgroups, stop_grace=10, poll_interval=0.2),
                   tmp_path / "daemon.log")
    d.start()
    try:
        drop(d.spool, "demo.yaml", yaml.safe_dump(job))
        d.wait_state(1, {"succeeded", "failed"}, timeout=600)
        return d, job
    finally:
        d.stop(signal.SIGTERM)


def check_night(d: DaemonProc, job: dict, *, mechanism: str) -> None:
    shown = d.show(1)
    assert shown["state"] == "succeeded", json.dumps(shown, indent=1, default=str)[-6000:]
    attempts = shown["attempt_list"]
    first, second, last = attempts[0], attempts[1], attempts[-1]

    # 1. a real OOM, mid-run, diagnosed from the real log and exit status
    diag = first["diagnosis"]
    assert diag["category"] == "host_oom", diag
    assert (diag["evidence"] and "can't allocate memory" in diag["evidence"][0]["text"]) or \
        first["exit"]["signal"] == "SIGKILL"
    assert first["max_step"] == 8 and first["checkpoint_step_after"] == 8, "the OOM came after checkpoint-8"
    assert first["peak_host_memory_bytes"] and first["peak_host_memory_bytes"] > 100 * 2**20
    started = next(e for e in shown["events"] if e["kind"] == "attempt_started" and e["attempt"] == 1)
    assert started["data"]["limit_mechanism"] == mechanism
    assert first["decision"]["kind"] == "escalate" and first["decision"]["rung"] == "micro_batch"

    # 2. the remedy: a smaller micro-batch with exactly the same effective batch, every time
    micro0, accum0 = job["per_device_train_batch_size"], job["gradient_accumulation_steps"]
    for a in attempts[1:]:
        eff = yaml.safe_load((d.state / f"jobs/1/attempt-{a['number']}/effective.yaml").read_text())
        assert eff["per_device_train_batch_size"] < micro0
        assert eff["per_device_train_batch_size"] * eff["gradient_accumulation_steps"] == micro0 * accum0
        # 3. ... resumed explicitly from the checkpoint the first attempt saved
        assert eff["resume_from_checkpoint"].endswith("checkpoint-8")
        assert a["resumed_from_step"] == 8 and a["resumed_from"].endswith("checkpoint-8")
    for a in attempts[:-1]:
        assert a["diagnosis"]["category"] == "host_oom"
    assert second["remedy"]

    out = Path(job["output_dir"])
    steps = [json.loads(line)["current_steps"] for line in (out / "trainer_log.jsonl").read_text().splitlines()
             if line.strip()]
    assert steps[-1] == 9 and 1 not in steps[steps.index(8) + 1:], f"global step continued from 8: {steps}"

    # 4. finished, final model saved, nothing left running
    assert last["exit"]["returncode"] == 0 and last["diagnosis"]["category"] == "success"
    assert last["max_step"] == last["total_steps"] == 9
    assert any(out.glob("model*.safetensors")), sorted(p.name for p in out.iterdir())
    assert pids_with_marker(str(d.state)) == []

    # 5. where the night went: buckets that add up to the wall time, per attempt and for the job
    check_goodput(shown)


def check_goodput(shown: dict) -> None:
    g = shown["goodput"]
    assert abs(sum(g["buckets"].values()) - g["wall_s"]) <= 0.01 * g["wall_s"], g
    for a in shown["attempt_list"]:
        t = a["time"]
        assert abs(sum(t["buckets"].values()) - t["wall_s"]) <= 0.01 * t["wall_s"], (a["number"], t)
    b = g["buckets"]
    assert b["productive"] > 0 and b["startup"] > 0 and b["checkpoint_save"] > 0, b
    assert b["checkpoint_load"] > 0, "the resumed attempts loaded checkpoint-8 ('Loading model from')"
    assert b["failed"] + b["redone"] > 0, b  # (escalations start at once: no backoff in the demo)
    print(f"demo night: wall {g['wall_s']:.1f}s, goodput {g['goodput']:.1%}: "
          + ", ".join(f"{k} {v:.1f}s" for k, v in b.items() if v))


def test_overnight_run_survives_a_real_oom_rlimit(tmp_path):
    """Checkpoints every 5 steps: the OOM at step 9 is 4 steps after checkpoint-5, and the start-up
    hook's emergency checkpoint of step 8 makes it cost nothing."""
    d, job = run_demo(tmp_path, cgroups="off", limit=DEMO_RLIMIT, save_steps=DEMO_SAVE_STEPS)
    check_night(d, job, mechanism="rlimit-data+sampled-pss")
    first = d.show(1)["attempt_list"][0]
    assert first["emergency_checkpoint"].startswith("emergency checkpoint at step 8"), first
    assert first["steps_lost"] == 0
    assert "emergency checkpoint at step 8" in d.cli("show", "1").stdout

    # The second night: the same job again (fresh output folder) starts where it fits, no OOM; then a
    # second job of its kind at another cutoff_len starts within one attempt of that fit, and `plan`,
    # asked before it runs, shows why (the observation it rests on, the margin).
    d2 = DaemonProc(d.state, d.spool, d.config, tmp_path / "daemon2.log").start()
    try:
        job2 = night_two_job(tmp_path / "demo2")
        drop(d2.spool, "demo-again.yaml", yaml.safe_dump(job2))
        d2.wait_state(2, {"succeeded", "failed"}, timeout=600)
        job3 = night_two_job(tmp_path / "demo3", cutoff_len=1024, name="demo-tiny-llama-1024")
        (tmp_path / "demo3" / "job.yaml").write_text(yaml.safe_dump(job3))
        planned = d2.cli("plan", str(tmp_path / "demo3" / "job.yaml"))
        drop(d2.spool, "demo-1024.yaml", yaml.safe_dump(job3))
        d2.wait_state(3, {"succeeded", "failed"}, timeout=900)
    finally:
        d2.stop(signal.SIGTERM)
    again = d2.show(2)
    assert again["state"] == "succeeded" and again["attempts"] == 1, json.dumps(again, default=str)[-3000:]
    learned = [e["message"] for e in again["events"] if e["kind"] == "learned_plan"]
    assert learned and "starting at 4x4" in learned[0], learned
    eff = yaml.safe_load((d2.state / "jobs/2/attempt-1/effective.yaml").read_text())
    assert eff["per_device_train_batch_size"] * eff["gradient_accumulation_steps"] == 16

    other = d2.show(3)
    assert other["state"] == "succeeded" and other["attempts"] <= 2, json.dumps(other, default=str)[-3000:]
    learned = [e["message"] for e in other["events"] if e["kind"] == "learned_plan"]
    why = "starting at 4x4 (observed to fit at cutoff_len 2048 (peak "
    assert learned and why in learned[0] and "which needs no less than cutoff_len 1024; margin 0%" in learned[0], \
        learned
    eff = yaml.safe_load((d2.state / "jobs/3/attempt-1/effective.yaml").read_text())
    assert (eff["cutoff_len"], eff["per_device_train_batch_size"], eff["gradient_accumulation_steps"]) == (1024, 4, 4)
    assert planned.returncode == 0, planned.stderr
    out = planned.stdout
    assert "learned start: 4x4\n" in out and why in out, out
    assert "(other_seq): 4x4 cutoff_len 2048: fit, peak" in out and "margin 0%" in out, out
    print(f"night 2: job 2 {again['attempts']} attempt, job 3 (cutoff_len 1024) {other['attempts']}; "
          f"plan: {next(ln for ln in out.splitlines() if 'starting at' in ln).strip()}")


def night_two_job(root: Path, **config) -> dict:
    """The demo's job again, in a fresh output folder; `name` and LLaMA-Factory keys may change."""
    (root / "work").mkdir(parents=True)
    (root / "cache").symlink_to(CACHE)
    job = demo_job(root, memory_limit=DEMO_RLIMIT, launcher=default_launcher(), save_steps=DEMO_SAVE_STEPS)
    job["supervisor"]["env"].update(QUIET_OMP)
    name = config.pop("name", None)
    job.update(config)
    if name:
        job["supervisor"]["name"] = name
    return job


@pytest.mark.skipif(detect_cgroup() is None, reason="no writable cgroup memory controller (needs root)")
def test_overnight_run_survives_a_real_oom_cgroup(tmp_path):
    d, job = run_demo(tmp_path, cgroups="auto", limit=DEMO_CGROUP_LIMIT)
    support = detect_cgroup()
    check_night(d, job, mechanism=f"cgroup-v{support.version}")
    first = d.show(1)["attempt_list"][0]
    assert first["exit"]["signal"] == "SIGKILL" or first["exit"]["returncode"] in (137, -9)
