"""Fast pattern engines for the scanner, each optional, each with a stdlib fallback.

Two jobs, two tools:
  - `LiteralScanner`: find every keyword occurrence in megabytes of log. Hyperscan
    (`hyperscan` package, SIMD literal matching, ~1.5 GB/s here) when installed,
    else RE2 (`google-re2`, a DFA, ~0.4 GB/s), else `re` (~0.1 GB/s).
  - `compile_search`: one pattern against one short line. RE2 (~1.5 us) when
    installed, else `re` (up to ~40 us for a long literal alternation, which
    backtracks position by position).
Only patterns whose meaning is identical in every engine go through here
(literals, classes, `\\b`, alternation), and callers only use match positions or
truthiness, so every fallback gives the same answers, slower. Set
OOM_SUPERVISOR_NO_FAST_RE=1 to force the stdlib (tests compare the two).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from typing import Any

_hs: Any = None
_re2: Any = None
if not os.environ.get("OOM_SUPERVISOR_NO_FAST_RE"):
    try:
        import hyperscan as _hs  # type: ignore[import-not-found,no-redef]
    except ImportError:  # pragma: no cover - depends on the environment
        _hs = None
    try:
        import re2 as _re2  # type: ignore[import-not-found,no-redef]
    except ImportError:  # pragma: no cover - depends on the environment
        _re2 = None


def compile_search(pattern: str | bytes) -> Any:
    """A compiled pattern offering `.search()` / `.finditer()`; RE2 when available."""
    if _re2 is not None:
        try:
            return _re2.compile(pattern)
        except _re2.error:  # pragma: no cover - a pattern RE2 refuses: the stdlib reads it the same way
            return re.compile(pattern)
    return re.compile(pattern)


class LiteralScanner:
    """End offsets of every occurrence of any of `words` in a buffer."""

    def __init__(self, words: Sequence[bytes]):
        self.words = tuple(dict.fromkeys(words))
        self._local = threading.local()  # a Hyperscan database's scratch is per thread
        self._regex = None
        self.engine = "hyperscan" if _hs is not None else ("re2" if _re2 is not None else "re")
        if _hs is None:
            if _re2 is not None:
                self._regex = compile_search(b"|".join(re.escape(w) for w in self.words))
            else:  # sre backtracks per alternative; a trie of the words is ~4x faster
                self._regex = re.compile(trie_pattern(self.words))

    def _db(self) -> Any:
        db = getattr(self._local, "db", None)
        if db is None:
            db = _hs.Database(mode=_hs.HS_MODE_BLOCK)
            db.compile(expressions=[re.escape(w) for w in self.words], ids=list(range(len(self.words))),
                       elements=len(self.words))
            self._local.db = db
        return db

    def ends(self, buf: bytes, start: int = 0, end: int | None = None) -> list[int]:
        """Sorted end offsets (exclusive) of matches lying wholly in buf[start:end]."""
        end = len(buf) if end is None else end
        if self._regex is not None:
            return [m.end() for m in self._regex.finditer(buf, start, end)]
        if end <= start:
            return []
        out: list[int] = []
        add = out.append
        # Scanning the whole buffer and filtering beats copying the slice; a match
        # ending in range but starting before `start` cannot happen at a line start.
        data = buf if (start == 0 and end == len(buf)) or (end - start) * 4 > len(buf) else buf[start:end]
        offset = 0 if data is buf else start
        lo, hi = start - offset, end - offset
        self._db().scan(data, match_event_handler=lambda _id, _from, to, _flags, _ctx: add(to))
        out.sort()
        return [e + offset for e in out if lo < e <= hi]


def trie_pattern(words: Sequence[bytes]) -> bytes:
    """A regex matching exactly `words`, factored by common prefixes (a(?:bc|de) for abc|ade)."""
    trie: dict[Any, Any] = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[None] = True

    def build(node: dict[Any, Any]) -> bytes:
        branches = [re.escape(bytes([ch])) + build(sub) for ch, sub in sorted(
            (k, v) for k, v in node.items() if k is not None)]
        if not branches:
            return b""
        body = branches[0] if len(branches) == 1 else b"(?:" + b"|".join(branches) + b")"
        return b"(?:" + body + b")?" if None in node else body

    return build(trie)
