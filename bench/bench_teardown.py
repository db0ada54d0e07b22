"""OOM line written -> every process of the attempt gone, through the real daemon.

Each trial is a job shaped like a torchrun launch (4 ranks in their own sessions, all ignoring
SIGTERM); rank 3 writes a CUDA OOM line at a random moment and records when. The bench polls
the process table every 5 ms and prints p50/p95/max of (all gone - line written). The daemon
runs with its default poll interval (1 s): what makes it fast is that it wakes on log growth.

    .venv/bin/python bench/bench_teardown.py [--trials 20]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "bench" / "jobs" / "multirank_oom.py"


def job_pids(marker: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in c for c in p.info["cmdline"] or []):
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=20)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="oomsup-bench-"))
    state, spool = tmp / "state", tmp / "spool"
    (spool / "incoming").mkdir(parents=True)
    config = tmp / "daemon.yaml"
    config.write_text(yaml.safe_dump({"settle_time": 0, "cgroups": "off", "fatal_grace": 0.5}))
    common = ["--state-dir", str(state), "--spool-dir", str(spool), "--config", str(config)]
    log = open(tmp / "daemon.log", "wb")  # noqa: SIM115 - the daemon's log for as long as it runs; closed when it stops
    daemon = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "daemon", "--json-logs", *common],
                              stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    latencies = []
    try:
        for i in range(args.trials):
            stamp = tmp / f"stamp-{i}"
            marker = str(stamp)
            job = {"supervisor": {"command": [sys.executable, str(JOB), marker], "workdir": str(tmp),
                                  "max_attempts": 1, "name": f"trial-{i}"}}
            path = spool / "incoming" / f"trial-{i}.yaml"
            path.with_name(f".{path.name}").write_text(yaml.safe_dump(job))
            path.with_name(f".{path.name}").rename(path)
            deadline = time.monotonic() + 60
            while not stamp.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
            while stamp.exists() and not stamp.read_text() and time.monotonic() < deadline:
                time.sleep(0.002)
            written = float(stamp.read_text())
            while job_pids(marker) and time.monotonic() < deadline:
                time.sleep(0.005)
            gone = time.time()
            latencies.append(gone - written)
            print(f"trial {i:2d}: {latencies[-1] * 1000:7.1f} ms", flush=True)
        out = subprocess.run([sys.executable, "-m", "supervisor.cli", "status", "--json", *common],
                             capture_output=True, text=True, cwd=REPO, check=False)
        shown = json.loads(out.stdout)
        diagnosed = sum(1 for j in shown if j["last_diagnosis"] == "gpu_oom")
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
    lat = sorted(latencies)
    p95 = lat[min(len(lat) - 1, round(0.95 * (len(lat) - 1)))]
    print(f"\nOOM line written -> attempt's processes all gone, {len(lat)} trials "
          f"(4 ranks, SIGTERM ignored, fatal_grace 0.5 s):")
    print(f"  p50 {statistics.median(lat) * 1000:.0f} ms   p95 {p95 * 1000:.0f} ms   max {lat[-1] * 1000:.0f} ms"
          f"   (target p95 <= 1000 ms)")
    print(f"  diagnosed gpu_oom: {diagnosed}/{len(shown)}")
    return 0 if p95 <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
