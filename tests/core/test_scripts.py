"""The README's commands: scripts/test.sh is what CI runs and stops what it starts; setup.sh
says what to install when `python3 -m venv` cannot work (Debian/Ubuntu without python3-venv)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readmes_test_command():
    lines = [ln for ln in (REPO / ".ci/run").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[-1] == "exec bash scripts/test.sh", lines


def test_test_sh_stops_the_clusters_it_started_even_when_tests_fail(tmp_path):
    """A cluster script here starts a real background process on `up` and stops it on `down`."""
    pidfile = tmp_path / "cluster.pid"
    cluster = tmp_path / "cluster.sh"
    cluster.write_text(f"""#!/usr/bin/env bash
case "$1" in
  up) setsid sleep 300 </dev/null >/dev/null 2>&1 & echo $! > {pidfile} ;;
  down) [ -f {pidfile} ] && kill "$(cat {pidfile})" ;;
esac
""")
    failing = tmp_path / "test_fails.py"
    failing.write_text("def test_fails():\n    assert False\n")
    env = {**os.environ, "OOM_SUPERVISOR_TEST_INSTALL": "0", "OOM_SUPERVISOR_TEST_CLUSTERS": str(cluster)}
    res = subprocess.run(["bash", "scripts/test.sh", "-p", "no:cacheprovider", str(failing)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]  # pytest's verdict comes through
    assert "1 failed" in res.stdout
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the cluster test.sh started is still running"
        time.sleep(0.1)


def test_setup_says_to_install_python3_venv_when_venv_cannot_work(tmp_path):
    """Debian's and Ubuntu's python3 without python3-venv: `python3 -m venv` prints Debian's own
    text (its patched venv module, reproduced here by a `venv` found first on PYTHONPATH) and fails."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts/setup.sh", tmp_path / "scripts/setup.sh")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    debian = tmp_path / "debian-python"
    (debian / "venv").mkdir(parents=True)
    (debian / "venv" / "__init__.py").write_text("")
    (debian / "venv" / "__main__.py").write_text(
        "import sys\nprint('The virtual environment was not created successfully because ensurepip is not\\n'\n"
        "      'available.  On Debian/Ubuntu systems, you need to install the python3-venv\\n'\n"
        "      'package using the following command.\\n\\n    apt install python3.11-venv\\n')\nsys.exit(1)\n")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(debian)}
    res = subprocess.run(["bash", "scripts/setup.sh"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 1, res.stderr
    assert "this Python has no venv module. On Debian/Ubuntu:" in res.stderr
    assert "sudo apt-get install python3-venv" in res.stderr
    assert not (tmp_path / ".venv").exists(), "a half-made venv would be taken as made next time"
