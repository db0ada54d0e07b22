"""Text that lists possible causes without choosing one: no family may read a fact from it.

Ray ends a dead worker's report with "There are some potential root causes. (1) The process is
killed by SIGKILL by OOM killer ... (2) ray stop --force is called. (3) The worker is crashed
unexpectedly due to SIGSEGV ...": every cause named there is a guess, and the same line stands for
all of them. Asked first, it stops the walk, so neither the segfault nor the kill rules speak."""

from __future__ import annotations

import re

from supervisor.judge.diagnosis.hits import Hit, Segment

_HEDGE_RE = re.compile(r"potential root causes\.?\s*\(1\)")


def find(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> bool:
    """True (stop the walk, no hit) for a line that only lists possible causes."""
    return "root causes" in t and _HEDGE_RE.search(t) is not None
