"""Memory sizes as logs print them, to and from bytes.

PyTorch's `format_size` prints `N bytes`, `X.XX KiB/MiB/GiB`; vLLM and
DeepSpeed print `GiB`/`GB`. Everything downstream compares bytes, so parsing
happens once, here.
"""

from __future__ import annotations

import re

_UNITS = {
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}

# A number followed by a unit, as one regex fragment other patterns embed.
SIZE = r"(?:\d+(?:\.\d+)?)\s*(?:bytes|byte|[KMGTP]iB|[KMGT]B|B)"
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(bytes|byte|[KMGTP]iB|[KMGT]B|B)\b")


def parse_size(text: str) -> int | None:
    """`'546.00 MiB'` -> 572522496; None when `text` holds no size."""
    m = _SIZE_RE.search(text)
    if not m:
        return None
    return round(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human(n: float | None) -> str:
    """Bytes in binary units, the way PyTorch prints them (for reports)."""
    if n is None:
        return "?"
    n = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} bytes" if unit == "bytes" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
