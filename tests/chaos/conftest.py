"""A chaos environment per test: folders, a daemon factory, the record, and a cleanup that
kills every process the test's jobs started, whatever happened."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import DaemonProc

from .harness import Record, kill_all, shims, trainings, write_chaos_config


@dataclass
class Chaos:
    root: Path
    state: Path
    spool: Path
    work: Path
    rec: Record
    daemon: DaemonProc | None = None

    def start(self, **config) -> DaemonProc:
        """(Re)start the real daemon; config keys given here replace the previous config."""
        if config or self.daemon is None:
            cfg = write_chaos_config(self.root, **config)
        else:
            cfg = self.daemon.config
        self.daemon = DaemonProc(self.state, self.spool, cfg, self.root / "daemon.log").start()
        return self.daemon

    def restart(self) -> DaemonProc:
        self.daemon = DaemonProc(self.state, self.spool, self.daemon.config, self.root / "daemon.log").start()
        return self.daemon

    def out(self, name: str) -> Path:
        return self.work / name


@pytest.fixture
def chaos(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    env = Chaos(tmp_path, tmp_path / "state", tmp_path / "spool", work, Record(tmp_path / "state"))
    yield env
    if env.daemon is not None and env.daemon.proc is not None and env.daemon.proc.poll() is None:
        env.daemon.stop(signal.SIGKILL)
    kill_all(trainings(work) + shims(env.state))
