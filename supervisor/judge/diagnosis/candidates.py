"""The "why not" of an `unknown` verdict (pure): the two categories the log points to most, with
the lines that point there, so a person knows where to look. Never a verdict: nothing acts on it.

The pointers are the scanner's own findings, whatever kept them from deciding (a hint, a marker,
an error training went on after), weighted by tier, then the program's last lines, each read for
the words that usually go with a category (weight 1, the first category that matches)."""

from __future__ import annotations

import re
from collections import defaultdict

from supervisor.core.models import Candidate, Category
from supervisor.judge.diagnosis.findings import ScanState
from supervisor.judge.diagnosis.hits import COMM, CRASH, HINT, MARKER, ROOT

_TIER_WEIGHT = {ROOT: 5, COMM: 4, CRASH: 3, MARKER: 2, HINT: 1}
LINES_PER_CANDIDATE = 3
MAX_TEXT = 300

# Words that go with a category, most specific first; a line counts for the first that matches.
_POINTERS = (
    (Category.DISK_FULL, re.compile(r"No space left on device|Disk quota exceeded")),
    (Category.DEVICE_FAULT, re.compile(r"\bXid\b|\bECC\b|illegal memory access|HSA_STATUS_ERROR|GPU Hang")),
    (Category.ENVIRONMENT, re.compile(r"ConnectionError|name resolution|HTTPSConnectionPool|ReadTimeout|ProxyError"
                                      r"|SSLError"
                                      # the Hub named in a failure, never in a farewell ("share your model on
                                      # huggingface.co/models")
                                      r"|(?:[Ee]rror|[Ff]ail|[Tt]imed? ?out|refused|couldn't connect).*huggingface\.co"
                                      r"|huggingface\.co.*(?:[Ee]rror|[Ff]ail|[Tt]imed? ?out|refused)")),
    (Category.GPU_OOM, re.compile(r"out of memory|OutOfMemory|\bMax_MA\b|ALLOC_FAILED|hipErrorOutOfMemory")),
    (Category.HOST_OOM, re.compile(r"\bKill(?:ed|ing)\b|SIGKILL|[Ss]ignal 9\b|EXIT CODE: 9\b|exitcode\s*:\s*-9\b"
                                   r"|CPU Virtual Memory|MemoryError|oom[-_ ]kill|Cannot allocate memory")),
    (Category.COMM_FAILURE, re.compile(r"\bNCCL\b|\bRCCL\b|\bc10d\b|[Rr]endezvous|ProcessGroup|[Ww]atchdog")),
    (Category.NUMERIC, re.compile(r"\bnan\b|\bNaN\b|loss scale|[Oo]verflow")),
    (Category.HANG, re.compile(r"\bhangs?\b|\bhanging\b|\bstuck\b|[Tt]imed out")),
    (Category.CONFIG_ERROR, re.compile(r"No such file|not found|unrecognized arguments|KeyError")),
    (Category.CRASH_OTHER, re.compile(r"Traceback|\b\w+(?:Error|Exception)\b|Segmentation fault|core dumped"
                                      r"|Aborted|BAD TERMINATION|exitcode\s*:\s*[1-9]")),
)


def likely_categories(state: ScanState, n: int = 2) -> tuple[Candidate, ...]:
    """The `n` categories with the most weight, each with its latest pointing lines in log order."""
    score: dict[Category, float] = defaultdict(float)
    lines: dict[Category, dict[int, str]] = defaultdict(dict)
    for f in state.findings:
        # A kill marker is filed as a crash (what happened); where to look is memory, its likeliest sender.
        cat = Category.HOST_OOM if f.rule == "sigkill" else f.category
        if cat in (Category.UNKNOWN, Category.SUCCESS):
            continue
        score[cat] += _TIER_WEIGHT.get(f.tier, 1)
        lines[cat][f.line_no] = f.text
    seen = {f.line_no for f in state.findings}
    for no, text in state.program_tail():
        if no in seen or not text.strip():
            continue
        cat = next((c for c, rx in _POINTERS if rx.search(text)), None)
        if cat is not None:
            score[cat] += 1
            lines[cat][no] = text
    best = sorted(score, key=lambda c: (-score[c], -max(lines[c])))[:n]
    return tuple(Candidate(c, tuple((no, lines[c][no].strip()[:MAX_TEXT])
                                    for no in sorted(lines[c])[-LINES_PER_CANDIDATE:])) for c in best)


def candidates_line(candidates: list[dict]) -> str:
    """'most likely: comm_failure (line 120: ...), crash_other (line 98: ...)' from a diagnosis's
    JSON: the latest line of each (for `show`)."""
    parts = []
    for c in candidates:
        last = (c.get("lines") or [None])[-1]
        parts.append(str(c["category"]) + (f" (line {last['line']}: {last['text'][:120]})" if last else ""))
    return "most likely: " + ", ".join(parts) if parts else "no line points to any cause"
