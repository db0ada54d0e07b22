"""Where a test run's wall time went, from its timeline (tests/conftest.py writes one when
OOM_SUPERVISOR_TEST_TIMELINE=FILE is set): each worker's busy time, what each ran last, the
longest tests and the modules they cost in all.

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
    per_test: dict[tuple[str, str], float] = defaultdict(float)
    per_module: dict[str, float] = defaultdict(float)
    workers: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        took = r["stop"] - r["start"]
        per_test[(r["worker"], r["id"])] += took
        per_module[r["id"].split("::")[0]] += took
        workers[r["worker"]].append(r)
    out = [f"wall {end - t0:7.0f} s from the first test's start to the last one's end"]
    for w, rs in sorted(workers.items()):
        busy = sum(r["stop"] - r["start"] for r in rs)
        last = max(rs, key=lambda r: r["stop"])
        out.append(f"  {w}: busy {busy:6.0f} s, done at {last['stop'] - t0:6.0f} s "
                   f"(idle {end - last['stop']:4.0f} s at the end); last: {last['id']}")
    out.append(f"longest {top} tests (setup + call + teardown):")
    for (w, test), took in sorted(per_test.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"  {took:6.1f} s  {w}  {test}")
    out.append(f"costliest {top} modules:")
    for module, took in sorted(per_module.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"  {took:6.1f} s  {module}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("timeline", type=Path)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    print(summarize(load(args.timeline), args.top))


if __name__ == "__main__":
    main()
