"""A night in the record, written through the real Store the way the daemon writes it, with
LLaMA-Factory's trainer_log.jsonl lines in its own format (one file across attempts: steps
restart from the checkpoint, the timer restarts at 0, total_tokens carries on)."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import yaml

from supervisor.core.paths import StatePaths
from supervisor.core.states import JobState
from supervisor.record.store import Store

GiB = 1 << 30


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _lf_line(step: int, total: int, loss: float, elapsed_s: float, tokens: int) -> str:
    return json.dumps({"current_steps": step, "total_steps": total, "loss": round(loss, 4),
                       "lr": 5e-05 * (1 - step / total), "epoch": round(step / total * 3, 2),
                       "percentage": round(step / total * 100, 2),
                       "elapsed_time": str(timedelta(seconds=int(elapsed_s))),
                       "remaining_time": "0:00:10", "total_tokens": tokens})


def _attempt(store: Store, clock: Clock, job_id: int, n: int, *, minutes: float, max_step: int | None,
             total: int, diag: dict | None, decision: dict, remedy: str | None = None,
             rungs: list[str] = (), resumed_step: int | None = None, ckpt_after: int | None = None,
             peak_rss: int | None = None, steps_per_s: float | None = None, tokens_per_s: float | None = None,
             limit: int | None = None, gpu_peak: dict | None = None, interrupted: int = 0) -> None:
    store.add_attempt(job_id, n, overrides=json.dumps({"rungs": list(rungs)}), remedy=remedy,
                      resumed_from=f"/out/checkpoint-{resumed_step}" if resumed_step else None,
                      resumed_from_step=resumed_step)
    if store.job(job_id).state != JobState.RUNNING:
        store.transition(job_id, JobState.RUNNING, f"attempt {n} started")
    store.event(job_id, "attempt_started", f"attempt {n}", attempt=n,
                data={"memory_limit": limit, "limit_mechanism": "rlimit-data" if limit else None})
    clock.t += minutes * 60
    if gpu_peak is not None:
        store.event(job_id, "gpu_telemetry", "peak VRAM", attempt=n,
                    data={"peak_bytes": gpu_peak, "capacity_bytes": dict.fromkeys(gpu_peak, 64 * GiB),
                          "source": "rocm-smi"})
    store.update_attempt(job_id, n, ended_at=clock.t, max_step=max_step, total_steps=total,
                         checkpoint_step_after=ckpt_after, peak_rss_bytes=peak_rss, steps_per_s=steps_per_s,
                         tokens_per_s=tokens_per_s, interrupted=interrupted,
                         exit=json.dumps({"returncode": 0 if diag and diag["category"] == "success" else 1}),
                         diagnosis=json.dumps(diag) if diag else None, decision=json.dumps(decision))
    if decision["kind"] in ("escalate", "retry"):
        store.transition(job_id, JobState.WAITING_RETRY, f"{decision.get('rung')}: {decision['reason']}")


def build_night(root: Path, *, start: float | None = None) -> tuple[StatePaths, Store]:
    """Job 1: two host OOMs, two micro-batch remedies, succeeded (the demo's shape). Job 2: a GPU
    OOM on ROCm, gradient checkpointing, still running. Job 3: queued."""
    state = StatePaths(root / "state")
    state.ensure()
    clock = Clock(time.time() - 10 * 3600 if start is None else start)  # last night
    store = Store(state.db, clock=clock)
    work = root / "work"
    out1, out2 = work / "out-1", work / "out-2"
    for d in (out1, out2):
        d.mkdir(parents=True)

    def job(name: str, out: Path) -> int:
        job_id = store.add_job(name=name, kind="llamafactory", priority=0, policy="default",
                               workdir=str(work), source=f"{name}.yaml", spool_key=name)
        state.job(job_id).root.mkdir(parents=True)
        state.job(job_id).job_file.write_text(yaml.safe_dump(
            {"model_name_or_path": "tiny", "output_dir": out.name, "supervisor": {"name": name}}))
        return job_id

    host_oom = {"category": "host_oom", "vendor": "cpu", "summary": "host out of memory (CPU allocator)",
                "evidence": [{"line_no": 412, "text": "RuntimeError: DefaultCPUAllocator: can't allocate "
                              "memory: you tried to allocate 1073741824 bytes.", "rule": "cpu_alloc"}]}
    j1 = job("llama-lora-zh", out1)
    lines, tokens = [], 0
    for s in range(1, 9):  # attempt 1: 8 steps, checkpoint-8, then OOM at step 9
        tokens += 4096
        lines.append(_lf_line(s, 9, 2.9 - 0.18 * s, s * 1.4, tokens))
    _attempt(store, clock, j1, 1, minutes=12, max_step=8, total=9, diag=host_oom, ckpt_after=8,
             peak_rss=int(1.9 * GiB), steps_per_s=0.71, tokens_per_s=2900.0, limit=2 * GiB,
             decision={"kind": "escalate", "rung": "micro_batch", "reason": "host OOM: halve the micro-batch",
                       "changes": [{"target": "yaml", "key": "per_device_train_batch_size", "old": 16, "new": 8,
                                    "why": "keep the effective batch"}]})
    store.event(j1, "checkpoint_quarantined", "checkpoint-9 is incomplete; moved aside", attempt=2)
    _attempt(store, clock, j1, 2, minutes=4, max_step=None, total=9, diag=host_oom, resumed_step=8,
             ckpt_after=8, peak_rss=int(1.95 * GiB), limit=2 * GiB, remedy="micro_batch 16->8",
             rungs=["micro_batch"],
             decision={"kind": "escalate", "rung": "micro_batch", "reason": "host OOM again: halve again",
                       "changes": []})
    tokens_at_8 = tokens
    lines.append(_lf_line(9, 9, 1.41, 2.2, tokens_at_8 + 4096))  # attempt 3: timer restarted
    _attempt(store, clock, j1, 3, minutes=3, max_step=9, total=9, resumed_step=8, ckpt_after=9,
             diag={"category": "success", "vendor": "unknown", "summary": "finished"},
             peak_rss=int(1.2 * GiB), steps_per_s=0.45, tokens_per_s=1860.0, limit=2 * GiB,
             remedy="micro_batch 8->4", rungs=["micro_batch", "micro_batch"],
             decision={"kind": "done", "reason": "finished"})
    store.transition(j1, JobState.SUCCEEDED, "finished")
    (out1 / "trainer_log.jsonl").write_text("\n".join(lines) + "\n")

    j2 = job("qwen-7b-sft", out2)
    gpu_oom = {"category": "gpu_oom", "vendor": "hip", "summary": "GPU out of memory on rank 0 [hip]",
               "numbers": {"tried_to_allocate": 2 * GiB, "total_capacity": 64 * GiB}, "evidence": []}
    lines = [_lf_line(s, 100, 3.2 - 0.01 * s, s * 5.0, s * 8192) for s in range(1, 31)]
    _attempt(store, clock, j2, 1, minutes=30, max_step=30, total=100, diag=gpu_oom, ckpt_after=20,
             peak_rss=12 * GiB, steps_per_s=0.2, tokens_per_s=1638.0, gpu_peak={"0": int(63.5 * GiB)},
             decision={"kind": "escalate", "rung": "gradient_checkpointing", "reason": "GPU OOM",
                       "changes": []})
    store.add_attempt(j2, 2, overrides=json.dumps({"rungs": ["gradient_checkpointing"]}),
                      remedy="gradient_checkpointing", resumed_from="/out/checkpoint-20", resumed_from_step=20)
    store.transition(j2, JobState.RUNNING, "attempt 2 started")
    lines += [_lf_line(s, 100, 3.0 - 0.01 * s, (s - 20) * 6.0, s * 8192) for s in range(21, 41)]
    (out2 / "trainer_log.jsonl").write_text("\n".join(lines) + "\n")
    store.update_attempt(j2, 2, max_step=40, total_steps=100, tokens_per_s=1400.0, peak_rss_bytes=11 * GiB)

    job("mistral-dpo", work / "out-3")
    clock.t += 60
    return state, store
