"""Text that lists possible causes without choosing one: no family may read a fact from it.

Ray ends a dead worker's report with "There are some potential root causes. (1) The process is
killed by SIGKILL by OOM killer ... (2) ray stop --force is called. (3) The worker is crashed
unexpectedly due to SIGSEGV ..." (newer releases: "Some common causes include: (1) ..., (2) ...,
or (3) ..."): every cause named there is a guess, and the same line stands for all of them. Any
numbered list of two or more possible causes reads the same. Asked first, it stops the walk, so
neither the segfault nor the kill rules speak."""

from __future__ import annotations

import re

from supervisor.judge.diagnosis.hits import Hit, Segment

_HEDGE_RE = re.compile(
    r"\b(?:potential|possible|common|likely|probable)\s+(?:root\s+)?causes?\b[^()]{0,24}\(1\).*\(2\)",
    re.IGNORECASE)


def find(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> bool:
    """True (stop the walk, no hit) for a line that only lists possible causes."""
    return "auses" in t and _HEDGE_RE.search(t) is not None
