"""The layout is the architecture: pure packages import nothing that acts, and nothing is circular."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.architecture import importgraph as ig

PURE_PACKAGES = ("supervisor.core", "supervisor.judge")
PURE_MODULES = ("supervisor", "supervisor.intake", "supervisor.intake.jobspec", "supervisor.intake.slurm_request",
                "supervisor.intake.preflight",
                "supervisor.intake.deepspeed_config", "supervisor.intake.llamafactory")
# Modules that act (processes, databases, sockets, the file system beyond reading a config).
ACTING = ("sqlite3", "subprocess", "psutil", "socket", "multiprocessing", "shutil", "torch", "signal")
LOWER = ("supervisor.core", "supervisor.intake", "supervisor.judge", "supervisor.run", "supervisor.record")


def is_pure(m: str) -> bool:
    return m in PURE_MODULES or m.startswith(PURE_PACKAGES) or m.startswith("supervisor.intake.llamafactory.")


GRAPH = ig.graph()


def test_the_graph_sees_the_package():
    assert "supervisor.judge.diagnosis.scanner" in GRAPH and "supervisor.daemon.loop" in GRAPH
    assert "supervisor.judge.diagnosis.findings" in GRAPH["supervisor.judge.diagnosis.scanner"]


def test_no_import_cycles():
    assert ig.cycles(GRAPH) == []


def test_cycle_finder_finds_a_cycle():
    assert ig.cycles({"supervisor.a": {"supervisor.b"}, "supervisor.b": {"supervisor.a"}}) == [
        ["supervisor.a", "supervisor.b"]]


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if is_pure(m)))
def test_pure_modules_import_only_pure_ones(module):
    bad = sorted(x for x in GRAPH[module]
                 if (x.startswith("supervisor") and not is_pure(x)) or x in ACTING)
    assert bad == [], f"{module} is pure but imports {bad}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith(LOWER)))
def test_lower_layers_never_import_the_daemon_or_the_cli(module):
    bad = sorted(x for x in GRAPH[module] if x.startswith(("supervisor.daemon", "supervisor.cli")))
    assert bad == [], f"{module} imports {bad}"


def test_importing_the_pure_core_loads_no_acting_module():
    pure = sorted(m for m in GRAPH if is_pure(m) and not m.endswith(("generate_keys", "introspect")))
    code = ("import importlib, json, sys\n"
            f"for m in {pure!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                       text=True).stdout)
    acting = [m for m in loaded if m.split(".")[0] in ("sqlite3", "psutil", "torch")
              or m.startswith(("supervisor.run", "supervisor.daemon", "supervisor.service", "supervisor.cli"))]
    assert acting == []
