"""What the scanner hands to `conclude`: rule hits placed in the log, and the scan's summary."""

from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.core.models import Category, Evidence, Phase
from supervisor.judge.diagnosis.rules import Hit


@dataclass
class Finding:
    """A rule hit placed in the log: where, which rank, which phase."""

    hit: Hit
    line_no: int
    text: str
    rank: int | None
    phase: Phase
    seq: int
    step_before: int | None = None
    recovered: bool = False
    # True when the line is an exception that ends a traceback block (or a line of that
    # exception's message right after it): decisive. Any other match is a hint.
    structural: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def rule(self) -> str:
        return self.hit.rule

    @property
    def category(self) -> Category:
        return self.hit.category

    @property
    def tier(self) -> int:
        return self.hit.tier

    def evidence(self) -> Evidence:
        return Evidence(line_no=self.line_no, text=self.text, rule=self.hit.rule)


@dataclass
class ScanState:
    """What the scanner concluded from the log alone (input to `conclude`)."""

    findings: list[Finding]
    lines_seen: int
    last_step: int | None
    total_steps: int | None
    hip: bool
    cuda: bool
    tail: list[tuple[int, str]]
    context_phase: Phase
    min_loss_scale_overflows: int
    internal_errors: int = 0
    samples_skipped: int = 0
