"""Sizes and durations as people write them in job files and configs ('2GiB', '30m')."""

from __future__ import annotations

import math
import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """'2GiB', '1500M', 2000000000 -> bytes. Binary units; 'G' means GiB. Must be > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"not a size: {value!r} (use e.g. 2GiB, 1500MiB or a byte count)")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE_RE.match(value)
        if not m:
            raise ValueError(f"not a size: {value!r} (use e.g. 2GiB, 1500MiB or a byte count)")
        unit = (m.group(2) or "B").upper().rstrip("B").rstrip("I")
        number = float(m.group(1))
        if not math.isfinite(number):
            raise ValueError(f"not a size: {value[:40]!r}... (too large)")
        size = int(number * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit])
    if size <= 0:
        raise ValueError(f"must be more than 0 bytes, got {value!r}")
    return size


def parse_duration(value: float | str) -> float:
    """'30m', '2h', 90 -> seconds. Never negative."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"not a duration: {value!r} (use e.g. 90, 30m or 2h)")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION_RE.match(value)
        if not m:
            raise ValueError(f"not a duration: {value!r} (use e.g. 90, 30m or 2h)")
        seconds = float(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[(m.group(2) or "s").lower()]
    if not math.isfinite(seconds):
        raise ValueError(f"not a finite duration: {str(value)[:40]!r}")
    if seconds < 0:
        raise ValueError(f"must not be negative, got {value!r}")
    return seconds
