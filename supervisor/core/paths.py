"""Every file name the supervisor uses, derived in one place."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SpoolPaths:
    root: Path

    @property
    def incoming(self) -> Path:
        return self.root / "incoming"

    @property
    def rejected(self) -> Path:
        return self.root / "rejected"

    def claimed(self, tag: str) -> Path:
        """Where one daemon moves a file before reading it: a rename is atomic, so of two
        daemons sharing the spool exactly one gets each file."""
        return self.root / "claimed" / tag

    def ensure(self) -> None:
        for d in (self.incoming, self.rejected):
            d.mkdir(parents=True, exist_ok=True)


@dataclass(frozen=True)
class StatePaths:
    root: Path
    # Attempt folders outside the state folder (a shared box: their owner reads the log and the
    # rendered config there, while the state stays the daemon's alone); None: inside each job's.
    attempts: Path | None = None

    @property
    def db(self) -> Path:
        return self.root / "state.sqlite3"

    @property
    def lock(self) -> Path:
        return self.root / "daemon.lock"

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"

    @property
    def tag(self) -> str:
        """A short stable name for this state folder (its spool claims live under it)."""
        return hashlib.sha256(os.path.abspath(self.root).encode(errors="surrogateescape")).hexdigest()[:12]

    def job(self, job_id: int) -> JobPaths:
        return JobPaths(self.jobs / str(job_id), self.attempts / str(job_id) if self.attempts else None)

    def ensure(self) -> None:
        self.jobs.mkdir(parents=True, exist_ok=True)


@dataclass(frozen=True)
class JobPaths:
    root: Path
    attempts: Path | None = None  # the job's attempt folders, when not inside `root`

    @property
    def job_file(self) -> Path:
        return self.root / "job.yaml"

    def attempt(self, n: int) -> AttemptPaths:
        return AttemptPaths((self.attempts or self.root) / f"attempt-{n}")


@dataclass(frozen=True)
class AttemptPaths:
    root: Path

    @property
    def log(self) -> Path:
        return self.root / "output.log"

    @property
    def exit_record(self) -> Path:
        return self.root / "exit.json"

    @property
    def launch(self) -> Path:
        """argv, cwd, env and limits the shim runs with (written before launch)."""
        return self.root / "launch.json"

    @property
    def environment(self) -> Path:
        return self.root / "environment.json"

    @property
    def diagnosis(self) -> Path:
        return self.root / "diagnosis.json"

    @property
    def user_dir(self) -> Path:
        """The job's own folder in the attempt (its user may write it): the start-up hook's peak file."""
        return self.root / "user"

    @property
    def peak_file(self) -> Path:
        return self.user_dir / "gpu_peak.json"
