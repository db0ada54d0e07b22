"""A chaos night through the real daemon: a training killed with SIGKILL, an OOM, a hang, jobs
queued behind each other. Where the night went (goodput buckets) adds up to its wall time within
1%, per job and for the night, in `status --json`, `show` and the Prometheus metrics alike.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import sys

import psutil
import yaml

from supervisor.judge.goodput import BUCKETS

from ..conftest import DaemonProc, drop, fakejob, write_config
from .harness import FAST_POLICY

OOM_TEXT = ("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
            "of 79.15 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.10 GiB "
            "memory in use. Of the allocated memory 75.10 GiB is allocated by PyTorch, and 1.50 GiB is reserved "
            "by PyTorch but unallocated.")
HANG_ONCE = """
import os, sys, time
state = sys.argv[1]
n = int(open(state).read()) + 1 if os.path.exists(state) else 1
open(state, "w").write(str(n))
for step in range(1, 6):
    time.sleep(0.1)
    print(f"{20 * step:3d}%|#| {step}/5 [00:01<00:01,  1.00it/s]", flush=True)
    if n == 1 and step == 3:
        time.sleep(60)  # silent: the hang timeout stops it
"""


def test_a_chaos_nights_goodput_buckets_add_up_to_its_wall_time(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    pol = tmp_path / "policies"
    pol.mkdir()
    (pol / "chaos.yaml").write_text(yaml.safe_dump({**FAST_POLICY, "name": "chaos", "backoff": {
        "initial_s": 1.0, "max_s": 2.0, "exp_base": 1, "jitter_s": 0}}))
    d = DaemonProc(tmp_path / "state", tmp_path / "spool",
                   write_config(tmp_path / "config.yaml", policy_dirs=[str(pol)], default_policy="chaos",
                                vram_release_timeout=0), tmp_path / "daemon.log")
    progress = tmp_path / "progress.txt"

    def job(name: str, argv: list[str], **sup) -> str:
        return yaml.safe_dump({"supervisor": {"name": name, "command": argv, "workdir": str(work), **sup}})

    d.start()
    try:
        # Held at step 20 until it is killed (the gate never opens): a loaded box's slow polling must not
        # find it finished (seen in CI: the 2 s run ended before the test saw it running).
        drop(d.spool, "1-killed.yaml", job("killed", fakejob("--steps", "40", "--sleep", "0.05",
                                                             f"--progress={progress}", "--gate",
                                                             str(tmp_path / "never"), "--gate-step", "20")))
        d.wait_state(1, "running", timeout=60)
        drop(d.spool, "2-oom.yaml", job("oom", fakejob("--steps", "5", "--sleep", "0.05", "--exit", "1",
                                                       "--fail-first", "1", f"--state={tmp_path / 'oom.n'}",
                                                       "--print", OOM_TEXT)))
        drop(d.spool, "3-hang.yaml", job("hang", [sys.executable, "-c", HANG_ONCE, str(tmp_path / "hang.n")],
                                         hang_timeout="2s"))
        # kill -9 the training itself (not the shim) at its gate: attempt 2 resumes after it
        d.wait_for(lambda: progress.exists() and len(progress.read_text().split()) >= 20, what="progress")
        victim = next(p for p in psutil.process_iter(["cmdline"])
                      if f"--progress={progress}" in (p.info["cmdline"] or []) and "supervisor.run.shim"
                      not in " ".join(p.info["cmdline"] or []))
        os.kill(victim.pid, signal.SIGKILL)
        for j in (1, 2, 3):
            d.wait_state(j, {"succeeded", "failed"}, timeout=180)
        status = d.status()
        shown = {j: d.show(j) for j in (1, 2, 3)}
        text = d.cli("show", "1").stdout
    finally:
        d.stop(signal.SIGTERM)

    night = dict.fromkeys(BUCKETS, 0.0)
    night_wall = 0.0
    for row in status:
        g = row["goodput"]
        total = sum(g["buckets"].values())
        assert abs(total - g["wall_s"]) <= 0.01 * g["wall_s"], (row["name"], total, g)
        attempts = shown[row["id"]]["attempt_list"]
        assert sum(a["time"]["wall_s"] for a in attempts) <= g["wall_s"] + 1e-6
        for a in attempts:
            assert abs(sum(a["time"]["buckets"].values()) - a["time"]["wall_s"]) <= 0.01 * a["time"]["wall_s"]
        night_wall += g["wall_s"]
        for b, v in g["buckets"].items():
            night[b] += v
        print(f"{row['name']}: {row['state']}, {row['attempts']} attempts, wall {g['wall_s']:.1f}s, "
              f"goodput {g['goodput']:.1%}: " + ", ".join(f"{b} {v:.1f}s" for b, v in g["buckets"].items() if v))
    print(f"night: wall {night_wall:.1f}s (job-seconds), goodput {night['productive'] / night_wall:.1%}: "
          + ", ".join(f"{b} {v:.1f}s" for b, v in night.items() if v))
    assert abs(sum(night.values()) - night_wall) <= 0.01 * night_wall
    by_name = {row["name"]: row for row in status}
    assert all(row["state"] == "succeeded" for row in status), status
    killed, oom, hang = (by_name[n]["goodput"]["buckets"] for n in ("killed", "oom", "hang"))
    assert killed["productive"] > 0 and killed["redone"] + killed["failed"] > 0 and killed["backoff"] >= 0.9
    assert oom["failed"] + oom["redone"] > 0, "an escalation starts at once: no backoff there"
    assert shown[2]["attempt_list"][1]["remedy"].startswith("allocator")
    assert hang["hang"] >= 1.5, "the 2 s of silence before the hang stop"
    assert night["queued"] > 1.0, "jobs without GPUs run one at a time: the others queue"
    assert "goodput" in text and "productive training" in text

    # The Prometheus metrics say the same, from the same computation.
    from supervisor.record.store import Store
    from supervisor.service.metrics import goodput_families

    store = Store(tmp_path / "state" / "state.sqlite3")
    seconds, ratio, _ = goodput_families(store)
    metric = {s.labels["bucket"]: s.value for s in seconds.samples}
    assert abs(sum(metric.values()) - night_wall) <= 0.01 * night_wall + 1.0  # `now` moved on by a second or so
    assert 0 < ratio.samples[0].value < 1
    store.close()
    sqlite3.connect(tmp_path / "state" / "state.sqlite3").execute("PRAGMA integrity_check").fetchone()
