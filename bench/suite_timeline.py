"""Where a test run's time went, from its timeline (tests/conftest.py writes one when
OOM_SUPERVISOR_TEST_TIMELINE=FILE is set): each worker's busy time and CPU, what each ran last, the
longest tests, the modules they cost in all, and the tests that used the most CPU.

    OOM_SUPERVISOR_TEST_TIMELINE=/tmp/tl.jsonl bash scripts/test.sh
    .venv/bin/python bench/suite_timeline.py /tmp/tl.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(rows: list[dict], top: int) -> str:
    t0 = min(r["start"] for r in rows)
    end = max(r["stop"] for r in rows)
    per_test: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])  # wall, CPU
    per_module: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    workers: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        took, cpu = r["stop"] - r["start"], r.get("cpu_s") or 0.0
        for acc in (per_test[(r["worker"], r["id"])], per_module[r["id"].split("::")[0]]):
            acc[0] += took
            acc[1] += cpu
        workers[r["worker"]].append(r)
    has_cpu = any("cpu_s" in r and r["cpu_s"] is not None for r in rows)
    out = [f"wall {end - t0:7.0f} s from the first test's start to the last one's end"]
    for w, rs in sorted(workers.items()):
        busy = sum(r["stop"] - r["start"] for r in rs)
        last = max(rs, key=lambda r: r["stop"])
        cpu = f", CPU {sum(r.get('cpu_s') or 0 for r in rs):6.0f} s" if has_cpu else ""
        out.append(f"  {w}: busy {busy:6.0f} s{cpu}, done at {last['stop'] - t0:6.0f} s "
                   f"(idle {end - last['stop']:4.0f} s at the end); last: {last['id']}")
    col = "  wall s   CPU s" if has_cpu else "  wall s"

    def line(v: list[float]) -> str:
        return f"  {v[0]:6.1f}  {v[1]:6.1f}" if has_cpu else f"  {v[0]:6.1f}"

    out.append(f"longest {top} tests (setup + call + teardown):\n{col}")
    for (w, test), v in sorted(per_test.items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"{line(v)}  {w}  {test}")
    out.append(f"costliest {top} modules:\n{col}")
    for module, v in sorted(per_module.items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"{line(v)}  {module}")
    if has_cpu:  # on a box with every core busy, what a test costs the others
        out.append(f"most CPU, {top} tests (this process and the children it reaped):\n{col}")
        for (w, test), v in sorted(per_test.items(), key=lambda kv: -kv[1][1])[:top]:
            out.append(f"{line(v)}  {w}  {test}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("timeline", type=Path)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    print(summarize(load(args.timeline), args.top))


if __name__ == "__main__":
    main()
