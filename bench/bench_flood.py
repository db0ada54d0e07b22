"""Cancel latency while a job floods its log at full speed (issue 9 item 4).

A job prints `[rank0]: Error: sample N skipped` lines as fast as it can; after a few seconds
`oom-supervisor cancel` (the real CLI) is run and the time until the job is `cancelled` with
its processes gone is measured. Also: the attempt log's peak size against `max_log_bytes`,
and `status` latency during the flood. Target: cancel <= 2 s, log under the cap.

    .venv/bin/python bench/bench_flood.py [--trials 5] [--flood 5] [--cap 64MiB]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.intake.jobspec import parse_size  # noqa: E402 - after sys.path names the checkout
from tests.chaos.harness import config_knows, flood_cancel  # noqa: E402 - after sys.path names the checkout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--flood", type=float, default=5.0, help="seconds of flood before the cancel")
    ap.add_argument("--cap", default="64MiB", help="max_log_bytes for the daemon")
    a = ap.parse_args()
    cap = parse_size(a.cap)
    if not config_knows("max_log_bytes"):
        print("note: the daemon config has no max_log_bytes key: running without a log cap")
    lat, cli, peaks, totals, status = [], [], [], [], []
    failures = 0
    for i in range(a.trials):
        root = Path(tempfile.mkdtemp(prefix="bench-flood-"))
        try:
            r = flood_cancel(root, flood_s=a.flood, max_log_bytes=cap)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        took = r["cancel_s"]
        print(f"trial {i + 1}: cancel {'never' if took is None else f'{took:.2f} s'} (CLI returned after "
              f"{r['cancel_cli_s']:.2f} s), output.log peak {r['peak_log'] / 2**20:.1f} MiB, with kept parts "
              f"{r['total_log'] / 2**20:.1f} MiB, status worst {max(r['status_s'] or [0]):.2f} s"
              + (f", {r['daemon_stop']}" if r.get("daemon_stop") else ""), flush=True)
        if took is None:
            failures += 1
        else:
            lat.append(took)
        cli.append(r["cancel_cli_s"])
        peaks.append(r["peak_log"])
        totals.append(r["total_log"])
        status += r["status_s"]
    print()
    if lat:
        print(f"cancel latency      median {statistics.median(lat):.2f} s, max {max(lat):.2f} s "
              f"({len(lat)} of {a.trials} took effect; target <= 2 s)")
    print(f"cancel never took effect: {failures}")
    print(f"CLI cancel itself   median {statistics.median(cli):.2f} s")
    print(f"output.log peak     {max(peaks) / 2**20:.1f} MiB (cap {cap / 2**20:.0f} MiB"
          f"{'' if config_knows('max_log_bytes') else ', not supported: no cap'})")
    print(f"log + kept parts    {max(totals) / 2**20:.1f} MiB")
    if status:
        print(f"status latency      median {statistics.median(status):.2f} s, worst {max(status):.2f} s")
    ok = failures == 0 and max(lat, default=99) <= 2.0 and max(peaks) <= cap + (4 << 20)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
