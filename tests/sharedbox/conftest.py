"""A shared training box with real users: `alice` and `bob` in the submit group, `eve` outside it,
`oscar` in the admin group. Made with useradd/groupadd (root: as CI runs), removed afterwards even
when a test fails; a leftover of a killed run (marked in the GECOS field) is removed first.

Users run the real CLI with runuser. The test interpreter may live where they cannot reach it
(pyenv under /root, mode 0700); then they run the system's python3 of the same version with the
checkout and this venv's site-packages on PYTHONPATH (the same code and libraries)."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from ..service.conftest import http_server, rlog  # noqa: F401  (the real logger captured; a real HTTP server)

REPO = Path(__file__).resolve().parents[2]
MARK = "oom-supervisor test user"
SUBMIT, ADMIN = "oomsv-test-submit", "oomsv-test-admin"
USERS = {"alice": [SUBMIT], "bob": [SUBMIT], "eve": [], "oscar": [SUBMIT, ADMIN]}
# The system unit's CapabilityBoundingSet, read from the unit itself.
UNITS_CAPS = next(line.split("=", 1)[1].split() for line in (REPO / "systemd/oom-supervisor.service").read_text()
                  .splitlines() if line.startswith("CapabilityBoundingSet="))

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs a root daemon: needs root")


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60)


def _remove_users() -> None:
    for name in USERS:
        try:
            if pwd.getpwnam(name).pw_gecos.startswith(MARK):
                subprocess.run(["userdel", "-r", "-f", name], capture_output=True, timeout=60, check=False)
        except KeyError:
            pass
    for g in (SUBMIT, ADMIN):
        try:
            grp.getgrnam(g)
            subprocess.run(["groupdel", g], capture_output=True, timeout=60, check=False)
        except KeyError:
            pass


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    groups: frozenset[int]
    home: Path


@pytest.fixture(scope="session")
def box_users():
    if os.geteuid() != 0:
        pytest.skip("needs root")
    _remove_users()  # a run killed before its clean-up
    for name in USERS:
        try:
            pwd.getpwnam(name)
            pytest.fail(f"user {name} exists on this machine and is not one of ours: not touching it")
        except KeyError:
            pass
    try:
        for g in (SUBMIT, ADMIN):
            _run("groupadd", g)
        for name, groups in USERS.items():
            _run("useradd", "-m", "-s", "/bin/sh", "-c", f"{MARK} {name}", *(["-G", ",".join(groups)] if groups else []),
                 name)
        users = {}
        for name in USERS:
            pw = pwd.getpwnam(name)
            users[name] = User(name, pw.pw_uid, pw.pw_gid, frozenset(os.getgrouplist(name, pw.pw_gid)),
                               Path(pw.pw_dir))
        yield users
    finally:
        _remove_users()


def _user_python() -> tuple[str, dict[str, str]]:
    """An interpreter an unprivileged user can run, with this checkout and its libraries."""
    site = sysconfig.get_paths()["purelib"]
    env = {"PYTHONPATH": f"{REPO}{os.pathsep}{site}"}
    probe = ["runuser", "-u", "nobody", "--"]
    for exe in (sys.executable, shutil.which(f"python{sys.version_info[0]}.{sys.version_info[1]}") or "",
                "/usr/bin/python3"):
        if not exe:
            continue
        res = subprocess.run([*probe, "env", f"PYTHONPATH={env['PYTHONPATH']}", exe, "-c",
                              ("import sys, supervisor.cli.main, psutil, pydantic, yaml\n"
                               f"assert sys.version_info[:2] == {tuple(sys.version_info[:2])}")],
                             capture_output=True, text=True, timeout=60, cwd="/", check=False)
        if res.returncode == 0:
            return exe, env
    pytest.fail("no Python an unprivileged user can run with this checkout (tried the test interpreter, "
                f"python{sys.version_info[0]}.{sys.version_info[1]} and /usr/bin/python3)")


@pytest.fixture(scope="session")
def user_python():
    return _user_python()


@pytest.fixture
def box_dir():
    """A folder every user can traverse (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="oomsv-box-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def unit_privileges(caps: list[str]) -> list[str]:
    """setpriv: root with only `caps` in its bounding set (so in what it may ever have), and
    no_new_privs, like CapabilityBoundingSet= and NoNewPrivileges=yes in the unit."""
    bounding = ",".join(["-all", *(f"+{c.lower().removeprefix('cap_')}" for c in caps)])
    return ["setpriv", "--no-new-privs", f"--bounding-set={bounding}", "--"]


class Box:
    """A real daemon in system mode (root, as the unit runs it) and the real CLI run as each user."""

    def __init__(self, root: Path, users: dict[str, User], user_python, **config) -> None:
        self.root, self.users = root, users
        self.python, self.pyenv = user_python
        self.state, self.spool = root / "state", root / "spool"
        self.socket = root / "ctl.sock"
        self.config = root / "config.yaml"
        cfg = {"poll_interval": 0.1, "settle_time": 0.0, "stop_grace": 3, "fatal_grace": 0.5, "cgroups": "auto",
               "mode": "system", "submit_group": SUBMIT, "admin_group": ADMIN, "control_socket": str(self.socket),
               **config}
        self.config.write_text(yaml.safe_dump(cfg))
        self.config.chmod(0o644)
        self.log_path = root / "daemon.log"
        self.proc: subprocess.Popen | None = None

    def args(self) -> list[str]:
        return ["--state-dir", str(self.state), "--spool-dir", str(self.spool), "--config", str(self.config)]

    def start(self, env: dict[str, str] | None = None, prefix: list[str] | None = None) -> Box:
        """Root with the unit's capabilities only and no_new_privs, as the system unit runs it
        (`prefix`: another setpriv line)."""
        if prefix is None:
            prefix = unit_privileges(UNITS_CAPS)
        self.logf = open(self.log_path, "ab")  # noqa: SIM115 - the daemon's log for as long as it runs; closed when it stops
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "supervisor.cli", "daemon", "--json-logs",
                                      *self.args()],
                                     stdout=self.logf, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, **(env or {})})
        self.wait_for(lambda: self.socket.exists(), 30, "the control socket")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.logf.close()

    def workdir(self, user: str) -> Path:
        w = self.root / f"work-{user}"
        w.mkdir(exist_ok=True)
        u = self.users[user]
        os.chown(w, u.uid, u.gid)
        w.chmod(0o700)
        return w

    def as_user(self, user: str, *argv: str, cwd: Path | None = None, timeout: float = 120,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """`argv` run as `user` (runuser, a login-like environment: nothing of root's)."""
        u = self.users[user]
        base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(u.home), "USER": user, "LOGNAME": user,
                "LANG": "C.UTF-8", **(env or {})}
        return subprocess.run(["runuser", "-u", user, "--", "env", "-i", *(f"{k}={v}" for k, v in base.items()),
                               *argv], capture_output=True, text=True, timeout=timeout, cwd=cwd or self.workdir(user), check=False)

    def cli(self, user: str, *args: str, cwd: Path | None = None, **kw) -> subprocess.CompletedProcess:
        """The real CLI as `user` (root: the test's own interpreter, as root runs it)."""
        argv = [args[0], *self.args(), *args[1:]]
        if user == "root":
            return subprocess.run([sys.executable, "-m", "supervisor.cli", *argv], capture_output=True, text=True,
                                  timeout=120, cwd=cwd or REPO, check=False)
        return self.as_user(user, self.python, "-m", "supervisor.cli", *argv, cwd=cwd,
                            env={**self.pyenv, **kw.pop("env", {})}, **kw)

    def submit(self, user: str, name: str, sup: dict, *, extra: dict | None = None) -> int:
        work = self.workdir(user)
        job = work / f"{name}.yaml"
        text = yaml.safe_dump({**(extra or {}), "supervisor": {"name": name, **sup}})
        job.write_text(text)
        u = self.users[user]
        os.chown(job, u.uid, u.gid)
        job.chmod(0o600)
        res = self.cli(user, "submit", str(job), "--wait", "30", cwd=work)
        assert res.returncode == 0, res.stdout + res.stderr
        return int(res.stdout.strip().splitlines()[-1].split()[-1])

    def status(self, user: str = "root") -> list[dict]:
        res = self.cli(user, "status", "--json")
        assert res.returncode == 0, res.stdout + res.stderr
        return json.loads(res.stdout)

    def wait_for(self, pred, timeout: float = 60, what: str = "condition"):
        deadline = time.monotonic() + timeout
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
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; last={last}\n{self.log_path.read_text()[-3000:]}")

    def wait_state(self, job: int, states, timeout: float = 60) -> str:
        states = {states} if isinstance(states, str) else set(states)
        return self.wait_for(lambda: next((j["state"] for j in self.status() if j["id"] == job and j["state"] in states),
                                          None), timeout, f"job {job} in {states}")


@pytest.fixture
def box(box_dir, box_users, user_python):
    made: list[Box] = []

    def make(**config) -> Box:
        b = Box(box_dir, box_users, user_python, **config)
        made.append(b)
        return b

    yield make
    for b in made:
        b.stop()
