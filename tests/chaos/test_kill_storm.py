"""Kill storm (issue 9): kill -9 the real daemon, shims and trainings at random moments.

Eight jobs of the exclusive workload (it detects a second live instance of itself through
an flock on its output folder). At the end, with the daemon left running until every job
is terminal: every job is terminal with a reason, none lost, none duplicated, none ever
ran twice at once, the SQLite file is intact and no process of any attempt is left.
The long version is bench/bench_chaos.py (200 kills).
"""

import os

from .harness import kill_storm

KILLS = int(os.environ.get("CHAOS_KILLS", "50"))


def test_kill_storm_loses_nothing_and_never_runs_a_job_twice(tmp_path):
    rep = kill_storm(tmp_path, kills=KILLS, jobs=8, max_parallel=4, steps=300, interval=0.1,
                     gap=(0.3, 2.0), drain_s=150)
    print(rep.summary())
    assert rep.total_kills >= KILLS
    problems = rep.problems()
    detail = "\n".join(f"{name}:\n{text}" for name, text in rep.explanations.items())
    assert not problems, ("\n".join(problems) + f"\n{rep.summary()}\n" + detail
                          + "\ndaemon errors: " + "\n".join(rep.daemon_errors[:10]))
