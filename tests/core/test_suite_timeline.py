"""bench/suite_timeline.py: where a suite's time and CPU went, read from the conftest's timeline."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("suite_timeline", REPO / "bench" / "suite_timeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def row(worker, test, when, start, stop, cpu=None):
    r = {"worker": worker, "id": test, "when": when, "start": start, "stop": stop, "outcome": "passed"}
    if cpu is not None:
        r["cpu_s"] = cpu
    return r


def test_wall_and_cpu_per_test_module_and_worker():
    rows = [row("gw0 py3.11", "tests/a.py::t1", "setup", 0, 1, 0.5), row("gw0 py3.11", "tests/a.py::t1", "call", 1, 11, 19.0),
            row("gw1 py3.11", "tests/b.py::t2", "call", 0, 30, 3.0)]
    text = _tool().summarize(rows, 5)
    assert "wall      30 s" in text
    assert "gw0 py3.11: busy     11 s, CPU     20 s" in text and "gw1 py3.11: busy     30 s, CPU      3 s" in text
    most_cpu = text.split("most CPU")[1].splitlines()
    assert "tests/a.py::t1" in most_cpu[2] and "19.5" in most_cpu[2], text  # 11 s of wall, 19.5 s of CPU: first
    longest = text.split("longest")[1].splitlines()
    assert "tests/b.py::t2" in longest[2], text


def test_an_old_timeline_without_cpu_still_reads(tmp_path):
    tl = tmp_path / "tl.jsonl"
    tl.write_text("".join(json.dumps(row("main py3.11", "tests/a.py::t", "call", 0, 2)) + "\n" for _ in range(2)))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "suite_timeline.py"), str(tl)], capture_output=True,
                         text=True, check=True).stdout
    assert "CPU" not in out and "4.0  main py3.11  tests/a.py::t" in out, out
