"""Shared fixtures: isolated state/spool folders and a real daemon process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
FAKEJOB = REPO / "tests" / "jobs" / "fakejob.py"

# Two trainings run at once (two workers on two cores), and PyTorch's OpenMP threads spin while
# they wait (libgomp's default), burning the cores the other training needs. Passive waiting
# changes no result, memory figure or thread count; measured here, two test_demo_assets trainings
# side by side: 132 s -> 77 s each (user CPU 123 s -> 72 s). Trainings the tests start directly
# inherit it; jobs run by a daemon get their own environment (its allowlist), as in production.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The same for trainings a test's daemon runs (their environment is the job's, not ours): a job
# file's `env:` carries it, as a user would put a box-wide setting there.
QUIET_OMP = {"OMP_WAIT_POLICY": "PASSIVE"}


# --- two workers (scripts/test.sh runs pytest-xdist) -------------------------------------------
# Tests that share something of the machine run on one worker, one after another: the users
# alice/bob/eve/oscar that tests/sharedbox creates in /etc/passwd, the Slurm test clusters, and
# the user tests/slurm makes too (useradd fails, not waits, while another holds /etc/passwd's lock).
# (Not xdist's `xdist_group` marks: pytest 9.2 no longer lets xdist 3.8 put the group into the
# node ids, and loadgroup then silently spreads a group over both workers.)
SHARED_BY_FOLDER = {"sharedbox": "the-box", "slurm": "the-box"}


def _shared(nodeid: str) -> str | None:
    parts = nodeid.split("/")
    return SHARED_BY_FOLDER.get(parts[1]) if len(parts) > 2 and parts[0] == "tests" else None


_MODULE_FIXTURES: dict[str, bool] = {}


def _module_with_fixture(nodeid: str) -> str | None:
    """The test's module when it defines a module-scoped fixture (a training run once and copied by
    its tests): a worker builds such a fixture for itself, so a module spread over both workers
    trained it twice (seen in CI: test_real_resume's `runs` set up twice, 33 s and 26 s)."""
    path = nodeid.split("::")[0]
    if path not in _MODULE_FIXTURES:
        try:
            _MODULE_FIXTURES[path] = 'scope="module"' in (REPO / path).read_text()
        except OSError:
            _MODULE_FIXTURES[path] = False
    return path if _MODULE_FIXTURES[path] else None


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling, where a scope is a shared folder, a module with a module-scoped
    fixture, or else one test."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFolders(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _shared(nodeid) or _module_with_fixture(nodeid) or nodeid

    return SharedFolders(config, log)


SLOW_LIST = Path(__file__).resolve().parent / "slow_tests.txt"


def _measured_slow() -> set[str]:
    """tests/slow_tests.txt: tests measured at 0.8 s or more (the fast tier leaves them out)."""
    lines = SLOW_LIST.read_text().splitlines() if SLOW_LIST.exists() else []
    return {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}


def pytest_collection_modifyitems(config, items):
    """Longest first, so no long test is left for one worker to run alone at the end: the Slurm
    and shared-box tests (one unit of ~9 minutes on one worker), then the real trainings
    (`slow`), then the rest; the collection order is kept within each (a stable sort)."""
    slow = _measured_slow()
    for item in items:
        # A test on a Slurm test cluster is slow whatever it measured: its fixture starts the cluster
        # when none runs, and test_slurm_real's module fixtures wait out a time limit and KillWait.
        on_cluster = {"slurm", "slurm2"} & set(getattr(item, "fixturenames", ()))
        if (item.nodeid.split("[")[0] in slow or on_cluster) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)

    def rank(item) -> int:
        if _shared(item.nodeid):
            return 0
        return 1 if item.get_closest_marker("slow") else 2

    items.sort(key=rank)


TIMELINE = os.environ.get("OOM_SUPERVISOR_TEST_TIMELINE")


def _cpu_s() -> float:
    """CPU seconds of this process and of every child it has reaped (with what they reaped): a test's
    daemons, trainings and CLI calls. A process a fixture keeps across tests counts where it is reaped."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With a timeline, each phase's report carries the CPU it used (the worker measures, the
    controller writes): on a box whose cores are all busy, CPU, not wall time, is what a test costs."""
    outcome = yield
    if TIMELINE:
        now = _cpu_s()
        outcome.get_result().user_properties.append(("cpu_s", round(now - item._cpu_mark, 3)))
        item._cpu_mark = now  # the next phase counts from here


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if TIMELINE:
        item._cpu_mark = _cpu_s()
    yield


def pytest_runtest_logreport(report):
    """OOM_SUPERVISOR_TEST_TIMELINE=FILE: one JSON line per test phase (worker, start, stop, CPU), so a
    run can say where its time went (bench/suite_timeline.py), not only its 20 slowest tests.
    Written by the process that sees every report: xdist's controller, or the only one."""
    if not TIMELINE or "PYTEST_XDIST_WORKER" in os.environ:
        return
    node = getattr(report, "node", None)  # the worker a report came from (xdist)
    worker = getattr(getattr(node, "gateway", None), "id", "main")
    cpu = dict(report.user_properties).get("cpu_s")
    with open(TIMELINE, "a") as fh:
        fh.write(json.dumps({"worker": f"{worker} py{sys.version_info[0]}.{sys.version_info[1]}", "id": report.nodeid, "when": report.when, "start": report.start,
                             "stop": report.stop, "outcome": report.outcome, "cpu_s": cpu}) + "\n")


@pytest.fixture
def dirs(tmp_path):
    state, spool, work = tmp_path / "state", tmp_path / "spool", tmp_path / "work"
    work.mkdir()
    return state, spool, work


def write_config(path: Path, **overrides) -> Path:
    cfg = {"poll_interval": 0.1, "settle_time": 0.0, "stop_grace": 3, "fatal_grace": 0.5,
           "cgroups": "off", **overrides}
    path.write_text(yaml.safe_dump(cfg))
    return path


def command_job(work: Path, argv: list[str], **sup) -> str:
    return yaml.safe_dump({"supervisor": {"command": argv, "workdir": str(work), **sup}})


def fakejob(*args: str) -> list[str]:
    return [sys.executable, str(FAKEJOB), *args]


class DaemonProc:
    """The real `oom-supervisor daemon`, as systemd would run it."""

    def __init__(self, state: Path, spool: Path, config: Path, log: Path) -> None:
        self.state, self.spool, self.config, self.log_path = state, spool, config, log
        self.proc: subprocess.Popen | None = None

    def cli_args(self) -> list[str]:
        return ["--state-dir", str(self.state), "--spool-dir", str(self.spool), "--config", str(self.config)]

    def start(self) -> DaemonProc:
        self.logf = open(self.log_path, "ab")  # noqa: SIM115 - the daemon's log for as long as it runs; closed when it stops
        self.proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "daemon", "--json-logs",
                                      *self.cli_args()], stdout=self.logf, stderr=subprocess.STDOUT,
                                     cwd=REPO)
        return self

    def cli(self, *args: str, check: bool = False) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "supervisor.cli", args[0], *self.cli_args(), *args[1:]]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
        if check and res.returncode != 0:
            raise AssertionError(f"{cmd} -> {res.returncode}\n{res.stdout}\n{res.stderr}")
        return res

    def status(self) -> list[dict]:
        return json.loads(self.cli("status", "--json", check=True).stdout)

    def show(self, job: int) -> dict:
        return json.loads(self.cli("show", str(job), "--json", check=True).stdout)

    def wait_for(self, pred, timeout: float = 60, what: str = "condition"):
        """Poll `pred` until it holds. The pause grows with the wait (0.1 s, then a twentieth of the
        time waited, at most 1 s): a predicate is a CLI call (~0.3 s of CPU), and polling a
        minutes-long training every 0.1 s took most of a core from it and from the other worker;
        a condition is still seen within 5% of the time it took."""
        start = time.monotonic()
        deadline = start + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                last = pred()
                if last:
                    return last
            except (FileNotFoundError, json.JSONDecodeError, AssertionError):
                pass
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log_path.read_text()[-4000:]}")
            time.sleep(min(1.0, 0.1 + (time.monotonic() - start) / 20))
        raise AssertionError(f"timed out waiting for {what}; last={last}\n{self.log_path.read_text()[-3000:]}")

    def job_state(self, job: int) -> str | None:
        for j in self.status():
            if j["id"] == job:
                return j["state"]
        return None

    def wait_state(self, job: int, states, timeout: float = 60) -> str:
        states = {states} if isinstance(states, str) else set(states)
        return self.wait_for(lambda: (s := self.job_state(job)) in states and s, timeout, f"job {job} in {states}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        self.logf.close()
        return rc

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.logf.close()


@pytest.fixture
def daemon(dirs, tmp_path):
    state, spool, _ = dirs
    d = DaemonProc(state, spool, write_config(tmp_path / "config.yaml"), tmp_path / "daemon.log")
    yield d
    d.stop(signal.SIGKILL) if d.proc and d.proc.poll() is None else None


def drop(spool: Path, name: str, text: str) -> Path:
    """A raw drop, as `cp` would do it (through a temp name so it is never half-read)."""
    inc = spool / "incoming"
    inc.mkdir(parents=True, exist_ok=True)
    tmp = inc / f".{name}.tmp"
    tmp.write_text(text)
    os.rename(tmp, inc / name)
    return inc / name


def pids_with_marker(marker: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if any(marker in c for c in (p.info["cmdline"] or [])):
                out.append(p.pid)
        except psutil.Error:
            pass
    return out
