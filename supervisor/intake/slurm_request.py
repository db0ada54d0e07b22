"""What a job and the site may ask of Slurm: the daemon's `slurm:` section and a job's `slurm:` block.

Pure schema (pydantic); the sbatch call itself is `supervisor.run.slurm`.
"""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from supervisor.core.units import parse_duration, parse_size

_SLURM_TIME_RE = re.compile(r"^(?:\d+-\d{1,2}(?::\d{1,2}){0,2}|\d+(?::\d{1,2}){0,2}|UNLIMITED|INFINITE)$",
                            re.IGNORECASE)


def _slurm_time(v: Any) -> str | None:
    """Slurm's own time format ('90' minutes, '1:30:00', '2-00') or our durations ('2h', 5400 s)."""
    if v is None:
        return None
    if isinstance(v, str) and (":" in v or "-" in v or v.upper() in ("UNLIMITED", "INFINITE")):
        if not _SLURM_TIME_RE.match(v):
            raise ValueError(f"{v!r} is not a Slurm time (e.g. 90, 1:30:00, 2-00:00:00) nor a duration (2h)")
        return v
    seconds = parse_duration(v)
    if seconds < 1:
        raise ValueError(f"time limit must be at least 1 second, got {v!r}")
    return format_time(seconds)


def format_time(seconds: float) -> str:
    """Seconds -> 'D-HH:MM:SS' (rounded up: a limit is never shortened)."""
    s = math.ceil(seconds)
    return f"{s // 86400}-{s % 86400 // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _mem(v: Any) -> int | None:
    if v is None:
        return None
    n = parse_size(v)
    if n < 1 << 20:
        raise ValueError(f"memory must be at least 1 MiB (Slurm counts MiB), got {v!r}")
    return n


class SlurmSettings(BaseModel):
    """The daemon's `slurm:` section: site-wide defaults for every attempt's sbatch."""

    model_config = ConfigDict(extra="forbid")
    partition: str | None = None
    account: str | None = None
    extra_args: list[str] = Field(default_factory=list)     # appended last: they win
    time_limit: str | None = None                            # Slurm time or duration ('12h')
    launcher_prefix: list[str] = Field(default_factory=list)  # argv before the command
    nodes: int = Field(default=1, ge=1)
    gpus_per_node: int = Field(default=0, ge=0)
    mem: int | None = None                                   # bytes per node ('64G' accepted)

    @field_validator("time_limit", mode="before")
    @classmethod
    def _time(cls, v: Any) -> str | None:
        return _slurm_time(v)

    @field_validator("mem", mode="before")
    @classmethod
    def _m(cls, v: Any) -> int | None:
        return _mem(v)

    @field_validator("extra_args")
    @classmethod
    def _extra(cls, v: list[str]) -> list[str]:
        owned = ("--output", "--error", "--open-mode", "--parsable", "--export", "--chdir", "-o", "-e", "-D")
        for a in v:
            if a.split("=", 1)[0] in owned:
                raise ValueError(f"{a!r}: the supervisor sets {a.split('=', 1)[0]} itself (the log and "
                                 "the environment must be the ones it follows)")
        return v


class SlurmJobRequest(BaseModel):
    """What one job may ask for in its `supervisor:` block (`slurm:`); overrides SlurmSettings."""

    model_config = ConfigDict(extra="forbid")
    nodes: int | None = Field(default=None, ge=1)
    gpus_per_node: int | None = Field(default=None, ge=0)
    mem: int | None = None     # bytes per node
    time: str | None = None    # Slurm time or duration

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, v: Any) -> str | None:
        return _slurm_time(v)

    @field_validator("mem", mode="before")
    @classmethod
    def _m(cls, v: Any) -> int | None:
        return _mem(v)

    def world_size(self, settings: SlurmSettings) -> int:
        """nodes x GPUs per node, what the policy must take as the data-parallel world."""
        nodes = self.nodes or settings.nodes
        gpus = self.gpus_per_node if self.gpus_per_node is not None else settings.gpus_per_node
        return nodes * max(gpus, 1)
