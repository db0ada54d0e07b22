"""Helpers for hostile-input tests: a real spool, state folder and SQLite store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from supervisor.core.paths import SpoolPaths, StatePaths
from supervisor.record.store import Store


@pytest.fixture
def env(tmp_path):
    spool, state = SpoolPaths(tmp_path / "spool"), StatePaths(tmp_path / "state")
    spool.ensure()
    state.ensure()
    store = Store(state.db)
    yield spool, state, store
    store.close()


def put(spool: SpoolPaths, name: str | bytes, data: str | bytes) -> Path:
    """Drop a file with any name (bytes for names that are not UTF-8) into incoming/."""
    raw = name if isinstance(name, bytes) else name.encode()
    path = os.path.join(os.fsencode(spool.incoming), raw)
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return Path(os.fsdecode(path))


def reasons(spool: SpoolPaths) -> dict[str, str]:
    """rejected/ as {file name: its .error.txt text}."""
    out = {}
    for p in spool.rejected.iterdir():
        if p.name.endswith(".error.txt"):
            out[p.name.removesuffix(".error.txt")] = p.read_text()
    return out
