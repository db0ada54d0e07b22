"""What the emergency-checkpoint hook said in an attempt's log (pure; the daemon's side).

The hook (startup/oom_supervisor_hooks/emergency.py) prints its lines right before the final
traceback, so the log's tail is enough. `parse_emergency` returns the outcome with the line as
evidence, or None when the hook said nothing (off, not a Trainer job, no catchable OOM).
Outcomes:
  saved          checkpoint-N was written now; `path` is complete (steps lost 0)
  already_saved  the OOM came right after a regular save of step N; `path` is that checkpoint
  failed         the save was tried and failed (`reason`); no checkpoint-N was left behind
  not_attempted  the hook chose not to save (`reason`: sharded state, an OOM inside the
                 optimizer step, no step finished, a rank that did not send its RNG state)
  interrupted    the save started (`path`) but no result line followed: the process was killed
                 during the save; the completeness scan decides what is usable
A save by one rank of a replicated multi-rank run (DDP) also says which rank wrote it and
whose RNG state it holds (`rank`, `world_size`, `rng_ranks`); a second failing rank's "leaves
the save ... to the rank that claimed it first" is no outcome of its own.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_P = r"^(?:\[(?:rank|default)\d+\]:\s*)?oom-supervisor: "
_STARTED = re.compile(_P + r"emergency checkpoint: saving step (?P<step>\d+) to (?P<path>.+?) \((?P<why>.*)\)$")
_ALREADY = re.compile(_P + r"emergency checkpoint at step (?P<step>\d+): (?P<path>.+?) "
                      r"\(already saved by the regular schedule\)$")
_SAVED = re.compile(_P + r"emergency checkpoint at step (?P<step>\d+): (?P<path>.+?) \(saved in (?P<s>[\d.]+) s\)$")
_FAILED = re.compile(_P + r"emergency checkpoint at step (?P<step>\S+) failed: (?P<why>.*)$")
_NOT = re.compile(_P + r"no emergency checkpoint: (?P<why>.*)$")
_REPLICA = re.compile(_P + r"emergency checkpoint: replica of rank (?P<rank>\d+) of (?P<world>\d+): .*; "
                      r"RNG from ranks \[(?P<rng>[\d, ]*)\]$")
_MOVED = re.compile(_P + r"emergency checkpoint: moved the incomplete (?P<path>.+?) \(.*\) to (?P<dest>.+)$")


@dataclass(frozen=True)
class EmergencyCheckpoint:
    outcome: str  # saved | already_saved | failed | not_attempted | interrupted
    step: int | None
    path: str | None
    reason: str | None
    seconds: float | None  # how long the save took (saved only)
    moved_aside: str | None  # where an incomplete regular checkpoint-N was moved first
    line_no: int  # 1-based, in the lines given
    text: str
    rank: int | None = None  # several ranks: the rank that wrote the checkpoint
    world_size: int | None = None
    rng_ranks: tuple[int, ...] = ()  # whose rng_state_<r>.pth it holds

    @property
    def steps_saved(self) -> bool:
        return self.outcome in ("saved", "already_saved")


def _int(s: str) -> int | None:
    return int(s) if s.isdigit() else None


def parse_emergency(lines: Iterable[str], *, first_line_no: int = 1) -> EmergencyCheckpoint | None:
    """The hook's last word in `lines` (str lines, newline or not), or None."""
    found: EmergencyCheckpoint | None = None
    moved = None
    replica: dict = {}
    for n, raw in enumerate(lines, start=first_line_no):
        line = raw.rstrip("\r\n").rsplit("\r", 1)[-1]
        if "oom-supervisor: " not in line:
            continue
        if m := _MOVED.match(line):
            moved = m["dest"]
        elif m := _REPLICA.match(line):
            replica = {"rank": int(m["rank"]), "world_size": int(m["world"]),
                       "rng_ranks": tuple(int(r) for r in m["rng"].replace(" ", "").split(",") if r)}
        elif m := _STARTED.match(line):
            found = EmergencyCheckpoint("interrupted", int(m["step"]), m["path"], None, None, moved, n, line)
        elif m := _SAVED.match(line):
            found = EmergencyCheckpoint("saved", int(m["step"]), m["path"], None, float(m["s"]), moved, n, line,
                                        **replica)
        elif m := _ALREADY.match(line):
            found = EmergencyCheckpoint("already_saved", int(m["step"]), m["path"], None, None, moved, n, line)
        elif m := _FAILED.match(line):
            found = EmergencyCheckpoint("failed", _int(m["step"]), None, m["why"], None, moved, n, line)
        elif m := _NOT.match(line):
            found = EmergencyCheckpoint("not_attempted", None, None, m["why"], None, moved, n, line)
    return found
