"""Where attempts run: one small protocol, two implementations (this box, a Slurm cluster).

The runner never asks which backend it has: it reserves what the attempt needs (owner, memory
limit), launches the plan's argv with its environment, follows the handle it gets back, asks the
backend for its own evidence at the verdict, and adopts a handle after a restart. A handle
answers `alive` / `over` / `processes` / `signal_all` / `force_stop` / `waiting` the same way for
a local process tree and for a Slurm job (`supervisor.run.proctree.Handle`,
`supervisor.run.slurm_handle.SlurmHandle`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from supervisor.core.paths import AttemptPaths
from supervisor.intake.jobspec import JobSpec


@dataclass
class Reservation:
    """What an attempt holds before it launches: its owner, its memory limit (and how it is kept)."""

    tag: str
    owner: Any = None
    cgroup: Any = None
    rlimits: dict[str, int] | None = None
    mechanism: str | None = None


@dataclass
class Launched:
    handle: Any
    record: dict[str, Any]  # fields of the attempt row that find it again (pid + start time, job id)
    events: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)  # (kind, message, data)


class Backend(Protocol):
    name: str
    allocates_gpus: bool  # the backend hands out GPUs itself (the daemon assigns none)
    keeps_verdicts: bool  # it knows how an attempt ended without the shim's exit record
    gpu_vendor: str

    def describe(self) -> str: ...

    def attempt_tag(self, job_id: int, number: int) -> str: ...

    def gpu_capacities(self) -> dict[int, int]: ...

    def world_size(self, spec: JobSpec) -> int: ...

    def launch_fields(self, spec: JobSpec, gpus: list[int] | None, env: dict[str, str]) -> dict[str, Any]: ...

    def reserve(self, tag: str, paths: AttemptPaths, memory_limit: int | None) -> Reservation: ...

    def release(self, res: Reservation) -> None: ...

    def launch(self, res: Reservation, paths: AttemptPaths, *, argv: list[str], cwd: Path,
               env: dict[str, str], spec: JobSpec, identity: Any = None) -> Launched: ...

    def unlaunched(self, res: Reservation) -> Any: ...

    def adopt(self, row: Any, paths: AttemptPaths, tag: str) -> Any: ...

    def verdict(self, handle: Any, paths: AttemptPaths, memory_limit: int | None) -> dict[str, Any] | None: ...

    def telemetry(self, handle: Any, gpus: list[int] | None) -> Any: ...

    def cleanup(self, handle: Any) -> None: ...
