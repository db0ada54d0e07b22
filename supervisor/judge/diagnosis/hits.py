"""What one rule says about one piece of a line: the vocabulary rules.py and families/ share.

Tiers order root causes (see conclude.py for how they are combined):
  1 ROOT   a failure that explains itself (OOM, device fault, disk, config, numeric)
  2 COMM   collective/rendezvous failures: often a CONSEQUENCE of a root cause elsewhere
  3 CRASH  any other Python exception, segfault, abort
  4 MARKER launcher summaries and kill markers (SIGKILL): what happened, not why
  5 HINT   mentions that only count when nothing else explains a failure
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from supervisor.core.models import Category

ROOT, COMM, CRASH, MARKER, HINT = 1, 2, 3, 4, 5


@dataclass
class Hit:
    """One rule that matched one segment."""

    rule: str
    category: Category
    tier: int
    subkind: str | None = None
    fatal: bool = False  # justifies tearing the attempt down now
    numbers: dict[str, Any] = field(default_factory=dict)
    vendor: str | None = None  # a vendor the line itself proves
    exc: str | None = None  # Python exception class, when the line is an exception line


@dataclass
class Segment:
    """A cleaned piece of a line: prefixes stripped, rank found."""

    text: str  # after prefix stripping
    raw: str  # before
    rank: int | None
    exc: str | None
    exc_msg: str | None
