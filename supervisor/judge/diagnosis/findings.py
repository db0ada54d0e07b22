"""What the scanner hands to `conclude`: rule hits placed in the log, and the scan's summary."""

from __future__ import annotations

from dataclasses import dataclass, field

from supervisor.core.models import Category, Evidence, Phase
from supervisor.judge.diagnosis.hits import Hit


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
    # Tracebacks joined by "During handling of the above exception" / "The above exception was the
    # direct cause" share a chain id: within a chain the FIRST exception is the cause.
    chain: int | None = None
    # How the finding was placed: "traceback" (an exception ending a traceback block), "cut" (a
    # traceback whose header is not in the log), "cxx" (a C++ terminate/what() or watchdog block),
    # "runtime" (a runtime's own abort line), "" (free text: a hint).
    form: str = ""

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
    # Learned line prefixes (regexes, see prefixes.py): the tail is read past them too.
    prefixes: tuple[str, ...] = ()
    # Line ranges (first, last) of printed samples: their text is in the tail for display, never read.
    sample_lines: tuple[tuple[int, int], ...] = ()
    # The last line where the training step advanced (a tqdm bar): nothing before it ended the run.
    last_advance_line: int = 0
    # The latest run of fp16 overflow lines, each lowering the loss scale from where the previous
    # one left it: (overflows in the run, the scale it ended at, its first line, its last line).
    scale_run: tuple[int, float, int, int] | None = None

    def program_tail(self) -> list[tuple[int, str]]:
        """The tail without printed-sample lines: what the program itself wrote last."""
        if not self.sample_lines:
            return self.tail
        return [(n, t) for n, t in self.tail if not any(a <= n <= b for a, b in self.sample_lines)]
