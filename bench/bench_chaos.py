"""Kill storm, long version (issue 9): kill -9 the real daemon, shims and trainings at random.

The same harness as tests/chaos/test_kill_storm.py (the exclusive workload detects a second
live instance of a job through an flock), with 200 kills by default. Prints kills, jobs lost,
duplicated, run twice at once, DB integrity, leftover processes, wall time; exit 1 on any
problem.

    .venv/bin/python bench/bench_chaos.py [--kills 200] [--jobs 24] [--parallel 4] [--seed N]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.chaos.harness import kill_storm  # noqa: E402 - after sys.path names the checkout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--jobs", type=int, default=24)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--steps", type=int, default=600,
                    help="steps per job (0.1 s each): enough work that trainings live through the storm")
    ap.add_argument("--gap", type=float, nargs=2, default=(0.3, 2.0), metavar=("MIN", "MAX"),
                    help="seconds between two kills, drawn uniformly")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--cgroups", choices=("auto", "off"), default="off")
    ap.add_argument("--keep", action="store_true", help="keep the state/spool/work folders")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    t0 = time.monotonic()
    print(f"kill storm: {a.kills} kills over {a.jobs} jobs ({a.parallel} at once) in {root}", flush=True)
    rep = kill_storm(root, kills=a.kills, jobs=a.jobs, max_parallel=a.parallel, steps=a.steps,
                     gap=tuple(a.gap), drain_s=300, seed=a.seed, config={"cgroups": a.cgroups},
                     log=lambda msg: print(msg, flush=True))
    print()
    print(f"kills               {rep.total_kills}  (daemon {rep.kills['daemon']}, shim {rep.kills['shim']}, "
          f"training {rep.kills['training']})")
    print(f"files dropped       {rep.files_dropped}")
    print(f"jobs recorded       {rep.jobs_recorded}")
    print(f"jobs lost           {len(rep.jobs_lost)}")
    print(f"jobs duplicated     {len(rep.jobs_duplicated)}")
    print(f"run twice at once   {len(rep.twice)}")
    print(f"DB integrity        {rep.integrity}")
    print(f"leftover processes  {len(rep.leftover)}")
    print(f"not terminal        {len(rep.not_terminal)}")
    print(f"final states        {rep.states}")
    print(f"daemon errors       {len(rep.daemon_errors)}")
    print(f"wall time           {time.monotonic() - t0:.0f} s")
    problems = rep.problems()
    for p in problems:
        print(f"PROBLEM: {p}")
    for name, text in rep.explanations.items():
        if name in rep.twice or name in rep.not_terminal or problems:
            print(f"\n{name}:\n{text}")
        else:  # failed with a reason: say which
            print(f"{name}: {text.splitlines()[0][:300]}")
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
