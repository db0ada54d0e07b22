"""What a new user reads (issue 20): `show` says each decision once and fits 80 columns without
cutting a path; `status` and `show` say the same when there is no state, and where the demo's is."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEMO_NIGHT = REPO / "tests" / "service" / "fixtures" / "demo-night"


def cli(cwd: Path, *args: str, columns: int = 80) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOM_SUPERVISOR_")}
    env.update(COLUMNS=str(columns), PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args, "--config", "/dev/null"], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120, check=False)


def demo_state(root: Path) -> Path:
    state = root / ".demo" / "state"
    (state / "jobs/1").mkdir(parents=True)
    con = sqlite3.connect(state / "state.sqlite3")
    con.executescript((DEMO_NIGHT / "state.sql").read_text())
    con.close()
    (state / "jobs/1/job.yaml").write_text((DEMO_NIGHT / "job.yaml").read_text())
    return state


def test_show_says_each_decision_once_within_80_columns(tmp_path):
    state = demo_state(tmp_path)
    res = cli(tmp_path, "show", "1", "--state-dir", str(state))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert max(len(line) for line in out.splitlines()) <= 80
    flat = " ".join(out.replace("│", " ").split())
    assert flat.count("effective batch 8x2x1 = 4x4x1 unchanged") == 1, out  # attempt 3's decision
    assert flat.count("escalate -> micro_batch") == 3
    assert "workdir: /tmp/d_demo/work\n" in out, "a path is never cut in the middle"


def test_status_fits_80_columns_without_cutting_names(tmp_path):
    state = demo_state(tmp_path)
    res = cli(tmp_path, "status", "--state-dir", str(state))
    assert res.returncode == 0, res.stderr
    assert max(len(line) for line in res.stdout.splitlines()) <= 80
    assert "demo-tiny-llama" in res.stdout and "succeeded" in res.stdout and "…" not in res.stdout


def test_status_and_show_agree_without_state_and_point_at_the_demos(tmp_path):
    demo = demo_state(tmp_path).resolve()
    empty = tmp_path / "nothing-here"
    status = cli(tmp_path, "status", "--state-dir", str(empty))
    show = cli(tmp_path, "show", "1", "--state-dir", str(empty))
    said = f"no state at {empty} (has the daemon run with this --state-dir?)"
    assert status.returncode == 0 and said in status.stdout, status.stdout
    assert show.returncode == 2 and said in show.stderr, show.stderr
    hint = f"the demo's state is {demo}: add `--state-dir {demo}`"
    assert hint in status.stdout and hint in show.stderr
    assert cli(tmp_path, "show", "1", "--state-dir", str(demo)).returncode == 0


def test_status_last_column_says_cancelled_and_by_whom(daemon, dirs):
    """A cancelled job's LAST said `unknown` (the stopped attempt's diagnosis); it says
    `cancelled by <who>`, as the job's reason and `show` do."""
    import pwd

    from tests.conftest import command_job, drop, fakejob

    _, spool, work = dirs
    daemon.start()
    drop(spool, "long.yaml", command_job(work, fakejob("--steps", "600", "--sleep", "0.1")))
    daemon.wait_state(1, "running")
    time.sleep(0.5)
    res = daemon.cli("cancel", "1", check=True)
    assert "cancel requested" in res.stdout
    daemon.wait_state(1, "cancelled", timeout=60)
    me = pwd.getpwuid(os.getuid()).pw_name
    row = daemon.status()[0]
    assert row["last"] == f"cancelled by {me}", row
    assert row["reason"] == f"cancelled by {me}", row
    table = daemon.cli("status", check=True).stdout
    assert f"cancelled by {me}" in " ".join(table.split()) and "unknown" not in table, table
