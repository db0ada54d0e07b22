"""Chaos harness: the real daemon, real shims, the exclusive workload, and the checks.

Shared by tests/chaos/* and bench/bench_chaos.py, bench/bench_flood.py. It only reads
the daemon's record (SQLite, read-only) and /proc; it never calls into the daemon's
internals, so whatever it measures is what a user of the real service would see.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml

from tests.conftest import REPO, DaemonProc, drop

EXCLUSIVE = REPO / "tests" / "jobs" / "exclusive_job.py"
TERMINAL = {"succeeded", "failed", "cancelled"}

# Retries at once and budgets a storm cannot spend: the chaos tests judge control, not the policy.
FAST_POLICY = {
    "name": "chaos-fast",
    "description": "immediate retries, budgets a kill storm cannot spend",
    "ladder": ["allocator", "micro_batch"],
    "budgets": {"max_attempts": 100, "oom_escalations": 7, "transient_retries": 100,
                "no_progress_attempts": 100, "device_fault_retries": 1},
    "backoff": {"initial_s": 0, "max_s": 0.5, "exp_base": 1, "jitter_s": 0},
}


def write_chaos_config(root: Path, **overrides) -> Path:
    """Daemon config + a fast-retry policy next to it."""
    pol = root / "policies"
    pol.mkdir(parents=True, exist_ok=True)
    (pol / "chaos-fast.yaml").write_text(yaml.safe_dump(FAST_POLICY))
    cfg = {"poll_interval": 0.1, "settle_time": 0.0, "stop_grace": 3, "fatal_grace": 0.5,
           "cgroups": "off", "policy_dirs": [str(pol)], "default_policy": "chaos-fast", **overrides}
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def exclusive(outdir: Path, *args: str) -> list[str]:
    return [sys.executable, str(EXCLUSIVE), f"--outdir={outdir}", *args]


def exclusive_job(work: Path, outdir: Path, *args: str, **sup) -> str:
    return yaml.safe_dump({"supervisor": {"command": exclusive(outdir, *args), "workdir": str(work), **sup}})


def live_pids(marker: str, *, exclude: set[int] | None = None) -> list[int]:
    """Live (non-zombie) processes whose argv mentions `marker`."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or (exclude and p.pid in exclude):
                continue
            if any(marker in c for c in (p.info["cmdline"] or [])):
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def trainings(work: Path) -> list[int]:
    """The workload's processes (main and grandchildren) under `work`, shims excluded."""
    return [p for p in live_pids(str(work)) if _is_workload(p)]


def grandchild_of(work: Path, outdir: Path) -> int | None:
    """The host's pid of the job's escaped grandchild. Not what the job wrote: an attempt in a PID
    namespace of its own sees that namespace's /proc, so its own idea of its pid is not the host's."""
    found = [p for p in trainings(work) if _argv_has(p, "--grandchild") and _argv_has(p, str(outdir))]
    return found[0] if len(found) == 1 else None


def shims(state: Path) -> list[int]:
    return [p for p in live_pids(str(state)) if _argv_has(p, "supervisor.run.shim")]


def _is_workload(pid: int) -> bool:
    return _argv_has(pid, str(EXCLUSIVE)) and not _argv_has(pid, "supervisor.run.shim")


def _argv_has(pid: int, token: str) -> bool:
    try:
        return any(token in c for c in psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class Record:
    """Read-only view of the daemon's SQLite record (what `status`/`show` read)."""

    def __init__(self, state: Path) -> None:
        self.db = state / "state.sqlite3"

    def _q(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=10)
        con.row_factory = sqlite3.Row
        try:
            return con.execute(sql, args).fetchall()
        finally:
            con.close()

    def jobs(self) -> list[dict]:
        try:
            return [dict(r) for r in self._q("SELECT * FROM jobs ORDER BY id")]
        except sqlite3.OperationalError:
            return []

    def state(self, job: int) -> str | None:
        rows = self._q("SELECT state FROM jobs WHERE id=?", (job,))
        return rows[0]["state"] if rows else None

    def attempts(self, job: int) -> list[dict]:
        return [dict(r) for r in self._q("SELECT * FROM attempts WHERE job_id=? ORDER BY number", (job,))]

    def events(self, job: int | None = None, like: str = "%") -> list[dict]:
        if job is None:
            rows = self._q("SELECT * FROM events WHERE kind LIKE ? ORDER BY id", (like,))
        else:
            rows = self._q("SELECT * FROM events WHERE job_id=? AND kind LIKE ? ORDER BY id", (job, like))
        return [dict(r) for r in rows]

    def writable_now(self) -> bool:
        """False while another connection (a frozen daemon mid-transaction) holds the write lock."""
        con = sqlite3.connect(self.db, timeout=0, isolation_level=None)
        try:
            con.execute("BEGIN IMMEDIATE")
            con.execute("ROLLBACK")
            return True
        except sqlite3.OperationalError:
            return False
        finally:
            con.close()

    def integrity(self) -> str:
        con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=30)
        try:
            return ";".join(r[0] for r in con.execute("PRAGMA integrity_check").fetchall())
        finally:
            con.close()

    def wait(self, pred, timeout: float, what: str, daemon: DaemonProc | None = None, step: float = 0.05):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                last = pred()
            except (sqlite3.OperationalError, FileNotFoundError):
                last = None
            if last:
                return last
            if daemon is not None and daemon.proc is not None and daemon.proc.poll() is not None:
                raise AssertionError(f"daemon exited {daemon.proc.returncode} while waiting for {what}:\n"
                                     + daemon.log_path.read_text(errors="replace")[-3000:])
            time.sleep(step)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last!r}"
                             + (f"\n{daemon.log_path.read_text(errors='replace')[-3000:]}" if daemon else ""))

    def wait_state(self, job: int, states, timeout: float = 60, daemon: DaemonProc | None = None) -> str:
        states = {states} if isinstance(states, str) else set(states)
        return self.wait(lambda: (s := self.state(job)) in states and s, timeout, f"job {job} in {states}",
                         daemon)


def explain(rec: Record, job: int) -> str:
    """A job's attempt_* / state / daemon events, to read a failure without rerunning it."""
    lines = []
    for e in rec.events(job):
        if e["kind"].startswith(("attempt_", "orphans", "internal", "cancel", "hang", "fatal")) or e["kind"] == "state":
            lines.append(f"  [{e['ts']:.2f}] {e['kind']} a{e['attempt']}: {e['message'][:200]}")
    return "\n".join(lines[-40:])


@dataclass
class StormReport:
    kills: dict[str, int] = field(default_factory=lambda: {"daemon": 0, "shim": 0, "training": 0})
    files_dropped: int = 0
    jobs_recorded: int = 0
    jobs_lost: list[str] = field(default_factory=list)
    jobs_duplicated: list[str] = field(default_factory=list)
    twice: dict[str, str] = field(default_factory=dict)
    integrity: str = ""
    leftover: list[int] = field(default_factory=list)
    not_terminal: dict[str, str] = field(default_factory=dict)
    failed_without_reason: list[str] = field(default_factory=list)
    succeeded_without_done: list[str] = field(default_factory=list)
    states: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    explanations: dict[str, str] = field(default_factory=dict)
    daemon_errors: list[str] = field(default_factory=list)

    @property
    def total_kills(self) -> int:
        return sum(self.kills.values())

    def problems(self) -> list[str]:
        out = []
        if self.jobs_lost:
            out.append(f"jobs lost (spool file never became a job): {self.jobs_lost}")
        if self.jobs_duplicated:
            out.append(f"jobs duplicated: {self.jobs_duplicated}")
        if self.twice:
            out.append(f"two live instances at once: {self.twice}")
        if self.integrity != "ok":
            out.append(f"PRAGMA integrity_check: {self.integrity}")
        if self.leftover:
            out.append(f"processes of attempts left alive: {self.leftover}")
        if self.not_terminal:
            out.append(f"jobs not terminal at the end: {self.not_terminal}")
        if self.failed_without_reason:
            out.append(f"failed without a reason: {self.failed_without_reason}")
        if self.succeeded_without_done:
            out.append(f"succeeded but the training never finished: {self.succeeded_without_done}")
        return out

    def summary(self) -> str:
        return (f"kills {self.total_kills} {self.kills}; files {self.files_dropped}, jobs {self.jobs_recorded}; "
                f"lost {len(self.jobs_lost)}; duplicated {len(self.jobs_duplicated)}; run twice at once "
                f"{len(self.twice)}; DB integrity {self.integrity}; leftover processes {len(self.leftover)}; "
                f"not terminal {len(self.not_terminal)}; states {self.states}; wall {self.wall_s:.1f}s")


def kill_storm(root: Path, *, kills: int = 60, jobs: int = 8, max_parallel: int = 4, steps: int = 80,
               interval: float = 0.1, gap: tuple[float, float] = (0.3, 2.0), drain_s: float = 180,
               seed: int | None = None, config: dict | None = None, log=print) -> StormReport:
    """kill -9 the daemon, shims and trainings at random moments over `jobs` exclusive jobs.

    Files are dropped during the storm too (intake must not lose or duplicate them across
    kills). At the end the daemon runs until every job is terminal (bounded by drain_s).
    """
    rng = random.Random(seed)
    t0 = time.monotonic()
    state, spool, work = root / "state", root / "spool", root / "work"
    work.mkdir(parents=True, exist_ok=True)
    cfg = write_chaos_config(root, max_parallel=max_parallel, **(config or {}))
    d = DaemonProc(state, spool, cfg, root / "daemon.log")
    rep = StormReport()
    names = [f"storm-{i}" for i in range(jobs)]

    def drop_job(i: int) -> None:
        drop(spool, f"{names[i]}.yaml", exclusive_job(work, work / names[i], f"--steps={steps}",
                                                     f"--interval={interval}", "--checkpoint-every=5",
                                                     name=names[i], gpus=[i], max_attempts=100))
        rep.files_dropped += 1

    next_file = 0
    d.start()
    try:
        for _ in range(min(max_parallel, jobs)):
            drop_job(next_file)
            next_file += 1
        down_since: float | None = None
        while rep.total_kills < kills:
            time.sleep(rng.uniform(*gap))
            if next_file < jobs and rng.random() < 0.35:
                drop_job(next_file)
                next_file += 1
            if down_since is not None and (rng.random() < 0.6 or time.monotonic() - down_since > 3):
                d.start()
                down_since = None
                continue
            what = rng.choices(["daemon", "shim", "training"], weights=[4, 3, 3])[0]
            if what == "daemon" and down_since is None:
                d.kill9()
                down_since = time.monotonic()
                rep.kills["daemon"] += 1
                if rep.total_kills % 10 == 0:
                    log(f"  ... {rep.total_kills} kills, {time.monotonic() - t0:.0f}s")
                continue
            victims = shims(state) if what == "shim" else list(trainings(work))
            if victims:
                kill_all([rng.choice(victims)])
                rep.kills[what] += 1
            if victims and rep.total_kills % 10 == 0:
                log(f"  ... {rep.total_kills} kills, {time.monotonic() - t0:.0f}s")
        while next_file < jobs:
            drop_job(next_file)
            next_file += 1
        if d.proc is None or d.proc.poll() is not None:
            d.start()
        rec = Record(state)

        def settled():
            rows = rec.jobs()
            return (len(rows) >= jobs and all(r["state"] in TERMINAL for r in rows) and not trainings(work)
                and not shims(state))

        try:
            rec.wait(settled, drain_s, "every job terminal and no training left", d, step=0.2)
        except AssertionError as exc:
            log(f"  drain: {str(exc).splitlines()[0]}")
        rep.wall_s = time.monotonic() - t0
        _judge(rep, rec, names, work, state)
        d.stop(signal.SIGTERM, timeout=60)
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.kill9()
        kill_all(trainings(work) + shims(state))
    return rep


def _judge(rep: StormReport, rec: Record, names: list[str], work: Path, state: Path) -> None:
    rows = rec.jobs()
    rep.jobs_recorded = len(rows)
    by_name: dict[str, list[dict]] = {}
    for r in rows:
        by_name.setdefault(r["name"], []).append(r)
    rep.jobs_lost = [n for n in names if n not in by_name]
    rep.jobs_duplicated = [n for n, rs in by_name.items() if len(rs) > 1]
    for n in names:
        twice = work / n / "TWICE"
        if twice.exists():
            rep.twice[n] = twice.read_text().strip().splitlines()[0]
    rep.integrity = rec.integrity()
    rep.leftover = trainings(work) + shims(state)
    for r in rows:
        rep.states[r["state"]] = rep.states.get(r["state"], 0) + 1
        if r["state"] not in TERMINAL:
            rep.not_terminal[r["name"]] = r["state"]
        if r["state"] == "failed" and not (r.get("reason") or "").strip():
            rep.failed_without_reason.append(r["name"])
        if r["state"] == "succeeded" and not (work / r["name"] / "DONE").exists():
            rep.succeeded_without_done.append(r["name"])
        if r["state"] != "succeeded" or r["name"] in rep.twice:
            rep.explanations[r["name"]] = f"job {r['id']} {r['state']}: {r.get('reason')}\n" + explain(rec, r["id"])
    rep.daemon_errors = [e["message"][:300] for e in rec.events(like="daemon_error")]


def cancel_now(d: DaemonProc, job: int) -> subprocess.CompletedProcess:
    return d.cli("cancel", str(job))


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def log_sizes(attempt_dir: Path) -> tuple[int, int]:
    """(size of output.log, size of output.log and every part kept beside it)."""
    main = total = 0
    for p in attempt_dir.glob("output.log*"):
        try:
            size = p.stat().st_size
        except OSError:
            continue
        total += size
        if p.name == "output.log":
            main = size
    return main, total


def config_knows(key: str) -> bool:
    from supervisor.daemon.config import DaemonConfig

    return key in DaemonConfig.model_fields


def flood_cancel(root: Path, *, flood_s: float = 2.0, max_log_bytes: int | None = 8 << 20,
                 timeout_s: float = 30.0) -> dict:
    """A job floods its log with keyword lines; after `flood_s`, `oom-supervisor cancel` it.

    Returns the cancel latency (CLI start -> job `cancelled` with no process left), the
    log sizes seen (peak of output.log, total with kept parts) and `status` latencies.
    """
    state, spool, work = root / "state", root / "spool", root / "work"
    work.mkdir(parents=True, exist_ok=True)
    cap_known = config_knows("max_log_bytes")
    extra = {"max_log_bytes": max_log_bytes} if (max_log_bytes and cap_known) else {}
    d = DaemonProc(state, spool, write_chaos_config(root, **extra), root / "daemon.log").start()
    rec = Record(state)
    attempt = state / "jobs" / "1" / "attempt-1"
    out: dict = {"cap_known": cap_known, "max_log_bytes": extra.get("max_log_bytes"), "peak_log": 0,
                 "total_log": 0, "status_s": []}
    try:
        drop(spool, "flood.yaml", exclusive_job(work, work / "flood", "--flood", name="flood", max_attempts=1))
        rec.wait(lambda: rec.state(1) == "running" and log_sizes(attempt)[0] > 0, 30, "flooding", d)
        t_flood = time.monotonic()
        while time.monotonic() - t_flood < flood_s:
            main, total = log_sizes(attempt)
            out["peak_log"], out["total_log"] = max(out["peak_log"], main), max(out["total_log"], total)
            if out["peak_log"] > 64 * (max_log_bytes or 8 << 20):
                break  # no cap at all: do not fill the disk to prove it
            t = time.monotonic()
            d.cli("status", "--json")
            out["status_s"].append(time.monotonic() - t)
        t0 = time.monotonic()
        res = d.cli("cancel", "1")
        out["cancel_rc"], out["cancel_cli_s"] = res.returncode, time.monotonic() - t0
        try:
            rec.wait(lambda: rec.state(1) == "cancelled" and not trainings(work), timeout_s, "cancelled", d,
                     step=0.01)
            out["cancel_s"] = time.monotonic() - t0
            # The daemon's part: from the cancel being recorded to the job cancelled with its processes
            # gone (cancel_s adds the CLI's own start-up, which a loaded box stretches).
            asked = [e["ts"] for e in rec.events(1) if e["kind"] == "cancel_requested"]
            out["cancel_effect_s"] = time.time() - asked[0] if asked else None
        except AssertionError:
            out["cancel_s"] = out["cancel_effect_s"] = None
        main, total = log_sizes(attempt)
        out["peak_log"], out["total_log"] = max(out["peak_log"], main), max(out["total_log"], total)
        out["state"] = rec.state(1)
        try:
            d.stop(signal.SIGTERM, timeout=20)
        except subprocess.TimeoutExpired:
            out["daemon_stop"] = "did not exit within 20 s of SIGTERM"
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.kill9()
        kill_all(trainings(work) + shims(state))
    return out
