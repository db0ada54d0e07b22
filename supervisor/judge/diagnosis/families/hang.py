"""A run that stopped making progress with no error, read from a log alone (a pasted log, whose exit
status is unknown). The supervisor's own hang stop (`stopped_by == "hang"`) is conclude.py's; this
is the same story told by the log's last line: it stops mid-way through loading, a progress bar or
the distributed start-up, and nothing (no error, no kill, no exit) follows."""

from __future__ import annotations

import re

from supervisor.judge.diagnosis import teardown

# What a run prints on its way to training: a model's shards loading (or just loaded, before the
# next step began), the process group forming. A training bar is not one: a pasted log of a healthy
# run often ends on it (the excerpt stops, not the run).
_STALL_RE = re.compile(
    r"checkpoint shards\b|[Ll]oading (?:weights|model|checkpoint)\b"
    r"|\b[Ii]nitiali[sz]ing (?:ddp|distributed|process group|TorchBackend)|\bMEMBER: \d+/\d+"
    r"|Waiting in store based barrier"
    # torch.utils.cpp_extension's JIT build (it waits on the lock a crashed build left in its root),
    # ColossalAI's runtime kernel build
    r"|as PyTorch extensions root\.\.\.|Emitting ninja build file|Building extension module \w+"
    r"|build and load the \w+ kernel during runtime"
    # mmcv's runner announcing its loop; peft's parameter count, the last set-up step before training
    r"|\bworkflow: \[\(.*\)\], max: \d+ (?:epochs|iters)|^trainable params: [\d,]+ \|\| all params:"
)
# DeepSpeed's records from its init_distributed (the group still forming), told by the logger's
# `[file.py:LINE:function]` prefix, which cleaning strips: read on the raw line.
_STALL_RAW_RE = re.compile(r"\[\w+\.py:\d+:init_distributed\]")
# A logged step dict ends many logs whose run failed numerically: it is a value, not a stall.
_LOGGED_STEP_RE = re.compile(r"^\{['\"]\w+['\"]:")


def stalled_at(tail: list[tuple[int, str]], prefixes: tuple[str, ...]) -> tuple[int, str] | None:
    """(line, text) of the log's last line that says something, when it shows the run still on its way."""
    after_frame = False
    last: tuple[int, str] | None = None
    last_raw = ""
    for n, raw in tail:
        t = teardown.clean(raw, prefixes)
        if not teardown.is_noise(raw, t, after_frame):
            last, last_raw = (n, t), raw
        after_frame = t.startswith('File "')
    if last is None or _LOGGED_STEP_RE.match(last[1]):
        return None
    if not _STALL_RE.search(last[1]) and not _STALL_RAW_RE.search(last_raw):
        return None
    return last
