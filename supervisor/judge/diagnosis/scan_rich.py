"""Rich-style tracebacks (pure): `rich.traceback` draws a box, its frames as `path.py:LINE in func`
(wrapped onto a second line when the path is long), the code and locals in panels inside it, and
prints the exception line after the box's bottom edge:

    ╭───────────────── Traceback (most recent call last) ─────────────────╮
    │ /opt/conda/lib/python3.7/site-packages/deepspeed/runtime/config.py: │
    │ 891 in _batch_assertion                                             │
    │ ❱  891 │   │   │   f"Check batch related parameters. train_batch_si │
    ╰─────────────────────────────────────────────────────────────────────╯
    AssertionError: Check batch related parameters. ...

The scanner opens a traceback at the header and closes its frame block at the bottom edge, so the
exception line right after it ends a traceback with its header, like Python's own form."""

from __future__ import annotations

import re

from supervisor.judge.diagnosis.prefixes import KNOWN_PREFIX_RE

RICH_TOP = "╭"
RICH_BOTTOM = "╰"
MAX_BOX_BYTES = 512 << 10  # frames are read from the box's bytes when it lies in one buffer region
_FRAME_RE = re.compile(r"^(?P<path>\S+\.py):(?:(?P<line>\d+) in(?: (?P<func>[\w<>.]+))?)?$")
# The rest of a frame wrapped onto the next line: "891 in _batch_assertion" after "path.py:", or
# "main" after "path.py:353 in".
_REST_RE = {False: re.compile(r"^\d+ in (?P<func>[\w<>.]+)$"), True: re.compile(r"^(?P<func>[\w<>.]+)$")}
_BORDER = " \t│┃"


def is_rich_header(text: str, at: int) -> bool:
    """The `Traceback (most recent call last)` at `at` is drawn in a rich box's top edge."""
    return RICH_TOP in text[:at]


def is_box_bottom(text: str) -> bool:
    """The outer box's bottom edge (an inner panel's edge still has the outer border after it)."""
    t = text.strip()
    return t.startswith(RICH_BOTTOM) and t.endswith("╯")


def frames(body: str) -> list[tuple[str, str]]:
    """(func, path) of each frame in the box's text, outermost first."""
    out: list[tuple[str, str]] = []
    pending: tuple[str, bool] | None = None  # (path, its line number already read)
    for line in body.splitlines():
        m = KNOWN_PREFIX_RE.match(line)  # [rankN]:, a timestamp
        t = (line[m.end():] if m else line).strip(_BORDER)
        if pending is not None:
            r = _REST_RE[pending[1]].match(t)
            if r:
                out.append((r.group("func"), pending[0]))
            pending = None
            continue
        f = _FRAME_RE.match(t)
        if f is None:
            continue
        if f.group("func"):
            out.append((f.group("func"), f.group("path")))
        else:
            pending = (f.group("path"), f.group("line") is not None)
    return out
