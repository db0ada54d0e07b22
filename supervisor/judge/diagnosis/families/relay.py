"""A launcher passing a child's death on: torchrun's `exitcode : -11` / `Signal 11 (SIGSEGV) received by
PID N` (with `error_file: <N/A>`, the child wrote no error), DeepSpeed's `exits with return code = -6`.
How the process ended, never why: where nothing else in the log speaks, the cause is unknown."""

from __future__ import annotations

import re
from collections.abc import Iterable

_RELAY_RE = re.compile(
    r"exitcode\s*:?\s*-?\d+|\bSignal \d+ \(SIG\w+\) received by PID|return code\s*=\s*-?\d+"
)


def only_relayed(texts: Iterable[str]) -> bool:
    """True when every line found says only that a launcher saw a child end (or there is none)."""
    return all(_RELAY_RE.search(t) for t in texts)
