"""The `slurm` fixture skips with the script's reason where Slurm cannot start, and fails on CI.

Run in a child pytest with SLURM_DIR under /proc (nothing can be created there), so the real
test cluster is not touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("ci", ["true", None])
def test_no_slurm_skips_locally_and_fails_on_ci(ci):
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "SLURM_CONF")}
    env["SLURM_DIR"] = "/proc/oom-supervisor-no-slurm"
    if ci:
        env["CI"] = ci
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "tests/slurm/test_slurm_real.py::test_up_is_idempotent"],
                         check=False, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    out = res.stdout + res.stderr
    if ci:
        assert res.returncode != 0 and "CI must run the Slurm tests" in out, out[-3000:]
    else:
        assert res.returncode == 0 and "no local Slurm: scripts/slurm.sh up exited" in out, out[-3000:]
    assert "/proc/oom-supervisor-no-slurm" in out  # the reason names what failed


@pytest.mark.parametrize("ci", ["true", None])
def test_no_two_node_slurm_skips_locally_and_fails_on_ci(ci):
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "SLURM_CONF")}
    env["SLURM2_DIR"] = "/proc/oom-supervisor-no-slurm2"
    if ci:
        env["CI"] = ci
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "tests/slurm/test_slurm_multinode.py::test_each_node_sees_its_rank_and_one_nodes_failure_never_hides_behind_anothers_success"],
                         check=False, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    out = res.stdout + res.stderr
    if ci:
        assert res.returncode != 0 and "CI must run the multi-node Slurm tests" in out, out[-3000:]
    else:
        assert res.returncode == 0 and "no two-node Slurm: scripts/slurm2.sh up exited" in out, out[-3000:]
    assert "/proc/oom-supervisor-no-slurm2" in out  # the reason names what failed
