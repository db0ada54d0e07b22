"""Job kinds: what differs between a LLaMA-Factory training and a plain command, in one place.

The attempt path asks its kind, never `if spec.kind == ...`: where the training writes its
checkpoints (resume applies only where there is an output folder), whether attempts teach the
observations (only a LLaMA-Factory config has a shape to learn from), and what must be checked in
the rendered files before launch. A new kind is one more class here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from supervisor.core.models import Problem
from supervisor.intake.jobspec import JobSpec
from supervisor.judge.policy.render import RenderedAttempt, check_rendered


class JobKind(Protocol):
    name: str
    learns: bool  # its attempts are recorded as observations, and its first attempt may start learned
    resumes: bool  # it writes checkpoints the supervisor resumes from

    def output_dir(self, spec: JobSpec) -> Path | None: ...

    def check(self, rendered: RenderedAttempt, spec: JobSpec, *, world_size: int,
              user_deepspeed: Mapping[str, Any] | None) -> list[Problem]: ...


@dataclass(frozen=True)
class LlamaFactoryKind:
    name: str = "llamafactory"
    learns: bool = True
    resumes: bool = True

    def output_dir(self, spec: JobSpec) -> Path | None:
        out = spec.config.get("output_dir")
        return spec.resolve(str(out)) if out else None

    def check(self, rendered: RenderedAttempt, spec: JobSpec, *, world_size: int,
              user_deepspeed: Mapping[str, Any] | None) -> list[Problem]:
        """The YAML and the DeepSpeed JSON it will load, matched as transformers will."""
        return check_rendered(rendered, user_deepspeed=user_deepspeed, world_size=world_size)


@dataclass(frozen=True)
class CommandKind:
    name: str = "command"
    learns: bool = False
    resumes: bool = False

    def output_dir(self, spec: JobSpec) -> Path | None:
        return None  # a command's own business: the supervisor does not know where it saves

    def check(self, rendered: RenderedAttempt, spec: JobSpec, *, world_size: int,
              user_deepspeed: Mapping[str, Any] | None) -> list[Problem]:
        return []


KINDS: dict[str, JobKind] = {"llamafactory": LlamaFactoryKind(), "command": CommandKind()}


def kind_of(spec: JobSpec) -> JobKind:
    return KINDS[spec.kind]
