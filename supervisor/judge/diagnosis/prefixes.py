"""What stands before the text of a log line, and how to see past it (pure).

Logs reach us wrapped: launchers tag each line with a rank (`[rank3]:`, `[default0]:`, srun
`--label`'s `3: `), orchestrators add a timestamp and a stream tag (`2024-05-01T12:00:00Z stderr F`,
`trainer-1  | `), Ray prefixes an actor (`(RayTrainWorker pid=123, ip=10.0.0.2)`), logging
formats add time, level and logger; people paste logs into issues with markdown (`**`, backticks,
`> `), from tmux panes (a border character at the end of every line) or as JSON events. An expert
reads past all of it; so must the scanner, or an exception line is not seen as one.

Two kinds of prefix:
  - KNOWN shapes (this module's regex), stripped wherever they appear at a line start;
  - LEARNED ones: the text before a `Traceback (most recent call last):` is, by construction,
    this stream's prefix; its shape (digits, levels and spacing generalised) is remembered, so
    the frames and the exception line that follow, carrying the same prefix, read as they should.
"""

from __future__ import annotations

import json
import re
from collections import deque

# Prefixes that launchers and loggers put before the real text. Stripped repeatedly from the
# start of a segment; `[rankN]:` / `[defaultN]:` give the rank.
KNOWN_PREFIX_RE = re.compile(
    r"""^\s*(?:
        \[(?:rank|default)(?P<rank>\d+)\]:\s?
      | \((?:[\w.:-]+\s+)?pid=\d+(?:,\s*ip=[\w.:-]+)?\)\s*
      | (?:INFO|WARNING|ERROR|DEBUG|CRITICAL)\s+\d\d-\d\d\s+\d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s*
      | \[?[EWIF]\d{4}\s+[\d:.]+\s+(?:\d+\s+)?[\w./-]+:\d+\]\s*
      | \[\d{4}-\d\d-\d\d[ T][\d:.,]+\]\s*(?:\[\w+\]\s*(?:\[[^\]]*\]\s*)?)?
      | \d{4}-\d\d-\d\d[ T][\d:.,]+Z?:?\s*(?:\|\s*\w+\s*\|\s*\w+\s*\|\s*)?
        (?:(?:stdout|stderr)\s+[FP]\s+|\[(?:stdout|stderr)\s*\]\s*)?
        (?:[EWIF]\s+[\w./-]+:\d+\]\s*)?
        (?:-\s*[\w.]+\s*-\s*(?:INFO|WARNING|ERROR|DEBUG|CRITICAL)\s*-\s*)?
      | (?:INFO|WARNING|ERROR|DEBUG|CRITICAL):[\w.]+:\s?
    )""",
    re.VERBOSE,
)
# srun --label / pdsh: a bare task number; a rank only when learned from a traceback header.
_TASK_LABEL_RE = re.compile(r"^\s*(\d{1,5}):\s*$")
_LEVELS = r"(?:INFO|WARNING|WARN|ERROR|DEBUG|CRITICAL|FATAL|TRACE)"
_LEVEL_WORD_RE = re.compile(_LEVELS + r"\b")
# IPython/Jupyter's traceback header names the exception before it: "ImportError     Traceback (most
# recent call last)". That name is no stream prefix (learned, it would eat the exception line).
_IPYTHON_HEADER_RE = re.compile(r"^\s*(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit|Warning)\s+$")
MAX_LEARNED = 8
MAX_PREFIX = 160

# Paste decorations: markdown emphasis and code, quote marks, a tmux pane's border.
_MD_LEAD_RE = re.compile(r"^(?:\s*>)+\s?|^\s*`+|^\s*[│┃]\s")
_MD_TRAIL_RE = re.compile(r"`+\s*$|\s{2,}[x│┃|]\s*$")
_JSON_KEYS = ("log", "message", "msg", "data", "text", "line")


def undecorate(text: str) -> str:
    """The line as the program wrote it: markdown, quote marks, pane borders and JSON wrapping removed."""
    if text.startswith("{") and text.rstrip().endswith("}") and '"' in text:
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            for k in _JSON_KEYS:
                v = obj.get(k)
                if isinstance(v, str):
                    text = v.rstrip("\r\n")
                    break
    if "**" in text:
        text = text.replace("**", "")
    if text[:1] in ">`│┃ \t\"" and text.lstrip()[:1] in (">", "`", "│", "┃", '"'):
        text = _MD_LEAD_RE.sub("", text, count=1)
        if text.startswith('"') and text.count('"') % 2 == 1:
            text = text[1:]  # a quoted paste: "OSError: ... (the closing quote lines later)
    if text.endswith(("`", "x", "│", "┃", "|")) or text.rstrip() != text:
        text = _MD_TRAIL_RE.sub("", text)
    return text


def shape_pattern(prefix: str) -> str:
    """A regex for prefixes of the same shape: digits, levels and runs of spaces generalised."""
    out = []
    i = 0
    n = len(prefix)
    while i < n:
        c = prefix[i]
        if c.isdigit():
            while i < n and prefix[i].isdigit():
                i += 1
            out.append(r"\d+")
            continue
        if c.isspace():
            while i < n and prefix[i].isspace():
                i += 1
            out.append(r"\s*")
            continue
        m = _LEVEL_WORD_RE.match(prefix, i)
        if m and (i == 0 or not prefix[i - 1].isalnum()):
            out.append(_LEVELS)
            i = m.end()
            continue
        out.append(re.escape(c))
        i += 1
    return "^" + "".join(out)


class PrefixModel:
    """Learned per-stream line prefixes (bounded); pure state, no I/O."""

    def __init__(self) -> None:
        self._learned: deque[tuple[str, re.Pattern[str]]] = deque(maxlen=MAX_LEARNED)

    @property
    def patterns(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self._learned)

    def learn(self, prefix: str) -> None:
        """Remember `prefix` (the text before a traceback header) as a stream's prefix."""
        if not prefix.strip() or len(prefix) > MAX_PREFIX or _IPYTHON_HEADER_RE.match(prefix):
            return
        pattern = shape_pattern(prefix)
        if any(p == pattern for p, _ in self._learned):
            return
        self._learned.append((pattern, re.compile(pattern)))

    def strip(self, text: str) -> tuple[str, int | None]:
        """`text` without a learned prefix at its start, and the task number such a prefix names."""
        for _, rx in reversed(self._learned):
            m = rx.match(text)
            if m and m.end() > 0:
                lab = _TASK_LABEL_RE.match(text[: m.end()])
                return text[m.end():], int(lab.group(1)) if lab else None
        return text, None


def strip_learned(text: str, patterns: tuple[str, ...]) -> str:
    """`PrefixModel.strip` for a conclusion that only has the patterns (conclude is stateless)."""
    for p in reversed(patterns):
        m = re.match(p, text)
        if m and m.end() > 0:
            return text[m.end():]
    return text
