"""A real single-node Slurm, started once per session by scripts/slurm.sh (see ../shared/docs/slurm.md).

`slurm` skips with the script's own reason where Slurm cannot start here; with CI=true it
fails instead, so CI never silently loses these tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supervisor.run import slurm as sl

REPO = Path(__file__).resolve().parents[2]
# A Python process that allocates 16 MiB at a time until something stops it.
ALLOC = ("import time\nb=[]\nfor i in range(400):\n    b.append(bytearray(16 << 20))\n"
         "    print('allocated', (i + 1) * 16, 'MiB', flush=True)\n    time.sleep(0.01)\n")


@pytest.fixture(scope="session")
def slurm() -> str:
    """SLURM_CONF of the running test cluster (also exported to this process for the clients)."""
    try:
        res = subprocess.run(["bash", str(REPO / "scripts" / "slurm.sh"), "up"], check=False, capture_output=True,
                             text=True, timeout=300)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("SLURM_CONF=")]
        why = None if res.returncode == 0 and lines else \
            f"scripts/slurm.sh up exited {res.returncode}: {(res.stderr or res.stdout).strip()[-1500:]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        why, lines = f"scripts/slurm.sh up could not run: {e}", []
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the Slurm tests: {why}")
        pytest.skip(f"no local Slurm: {why}")
    conf = lines[-1].split("=", 1)[1]
    os.environ["SLURM_CONF"] = conf
    return conf


def wait_state(job_id: str, pred, timeout: float = 60, what: str = "state") -> sl.SlurmJobState:
    """Poll `query` (at a test's pace: 0.3 s) until pred(state) holds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = sl.query(job_id)
        if last is not None and pred(last):
            return last
        time.sleep(0.3)
    raise AssertionError(f"job {job_id}: no {what} within {timeout} s; last {last}")


def wait_terminal(job_id: str, timeout: float = 60) -> sl.SlurmJobState:
    return wait_state(job_id, lambda s: s.terminal, timeout, "terminal state")


def wait_file(path: Path, pred=lambda text: bool(text), timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if pred(text):
            return text
        time.sleep(0.2)
    raise AssertionError(f"{path}: condition not met within {timeout} s; content {text[-2000:]!r}")


def go(tmp_path: Path, argv: list[str], name: str = "t", *, request=None, settings=None, env=None):
    att = tmp_path / name
    att.mkdir(parents=True, exist_ok=True)
    log = att / "train.log"
    sub = sl.submit(att, log, argv, tmp_path, {**os.environ, **(env or {})},
                    settings=settings or sl.SlurmSettings(), request=request or sl.SlurmJobRequest(mem="300M"),
                    job_name=f"oomsup-test-{name}")
    return sub, log


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def cluster_up(script: str) -> tuple[str | None, str]:
    """Run `scripts/<script> up`; (its last line, why it failed or "")."""
    try:
        res = subprocess.run(["bash", str(REPO / "scripts" / script), "up"], check=False, capture_output=True,
                             text=True, timeout=300)
        lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
        if res.returncode == 0 and lines:
            return lines[-1], ""
        return None, f"scripts/{script} up exited {res.returncode}: {(res.stderr or res.stdout).strip()[-1500:]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"scripts/{script} up could not run: {e}"


@pytest.fixture(scope="module")
def slurm2():
    """The two-node cluster of scripts/slurm2.sh (node1, node2, each in its own network namespace)
    for one test module: SLURM_CONF and its client wrappers first on PATH while the module runs,
    then the single-node cluster's settings again. Skips where it cannot start; fails on CI."""
    line, why = cluster_up("slurm2.sh")
    m = re.match(r"^export SLURM_CONF=(\S+) PATH=(\S+):\$PATH$", line or "")
    if m is None:
        why = why or f"scripts/slurm2.sh up printed no export line: {line!r}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the multi-node Slurm tests (two slurmd in network namespaces, root "
                        f"needed): {why}")
        pytest.skip(f"no two-node Slurm: {why}")
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "PATH")}
    os.environ["SLURM_CONF"] = m.group(1)
    os.environ["PATH"] = f"{m.group(2)}{os.pathsep}{saved['PATH']}"
    try:
        yield m.group(1)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
