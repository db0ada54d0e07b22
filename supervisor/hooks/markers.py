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
the save ... to the rank that claimed it first" is no outcome of its own. `oom_rank` is the rank
that ran out of memory where a line says it ("on rank R of W"). `parse_note` reads the
`oom-supervisor-emergency.json` such a save leaves in the checkpoint (who wrote what, how long).
"""

from __future__ import annotations

import json
import math
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
_ON_RANK = re.compile(r" on rank (?P<rank>\d+) of (?P<world>\d+)\b")
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
    oom_rank: int | None = None  # several ranks: the rank that ran out of memory, where a line says it

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
    oom: dict = {}
    for n, raw in enumerate(lines, start=first_line_no):
        line = raw.rstrip("\r\n").rsplit("\r", 1)[-1]
        if "oom-supervisor: " not in line:
            continue
        if (_STARTED.match(line) or _NOT.match(line)) and (r := _ON_RANK.search(line)):
            oom = {"oom_rank": int(r["rank"]), "world_size": int(r["world"])}
        if m := _MOVED.match(line):
            moved = m["dest"]
        elif m := _REPLICA.match(line):
            replica = {"rank": int(m["rank"]), "world_size": int(m["world"]),
                       "rng_ranks": tuple(int(r) for r in m["rng"].replace(" ", "").split(",") if r)}
        elif m := _STARTED.match(line):
            found = EmergencyCheckpoint("interrupted", int(m["step"]), m["path"], None, None, moved, n, line, **oom)
        elif m := _SAVED.match(line):
            found = EmergencyCheckpoint("saved", int(m["step"]), m["path"], None, float(m["s"]), moved, n, line,
                                        **{**oom, **replica})
        elif m := _ALREADY.match(line):
            found = EmergencyCheckpoint("already_saved", int(m["step"]), m["path"], None, None, moved, n, line)
        elif m := _FAILED.match(line):
            found = EmergencyCheckpoint("failed", _int(m["step"]), None, m["why"], None, moved, n, line)
        elif m := _NOT.match(line):
            found = EmergencyCheckpoint("not_attempted", None, None, m["why"], None, moved, n, line, **oom)
    return found


NOTE_FILE = "oom-supervisor-emergency.json"  # written by emergency.py into a multi-rank emergency checkpoint
NOTE_MAX_BYTES = 64 << 10


@dataclass(frozen=True)
class EmergencyNote:
    """What a multi-rank emergency checkpoint says of itself. Untrusted (the job wrote it): only
    plain numbers and short names are kept."""

    step: int | None
    failing_rank: int | None
    writer_rank: int | None
    world_size: int | None
    save_s: float | None  # the writer's whole save, the other ranks' RNG answers included
    rng_wait_s: float | None  # until every other rank had sent its RNG state
    rng_ranks: tuple[int, ...] = ()
    node: str | None = None  # the failing rank's host, where the note says it
    per_rank: tuple[tuple[int, float | None, str | None], ...] = ()  # (rank, seconds, node) where each rank saved

    def to_dict(self) -> dict:
        return {"step": self.step, "failing_rank": self.failing_rank, "writer_rank": self.writer_rank,
                "world_size": self.world_size, "save_s": self.save_s, "rng_wait_s": self.rng_wait_s,
                "rng_ranks": list(self.rng_ranks), "node": self.node,
                "per_rank": [{"rank": r, "save_s": t, "node": h} for r, t, h in self.per_rank]}


def _nat(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31 else None


def _secs(v) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 else None


def _name(v) -> str | None:
    return v[:128] if isinstance(v, str) and v and v.isprintable() else None


def parse_note(data: bytes | dict | None) -> EmergencyNote | None:
    """The note's facts (its bytes, or its JSON as read), or None when it is not a JSON object (or
    too big). Per-rank entries come from `ranks` ({"<rank>": {"save_s": s, "node": host}}), where a
    save of every rank writes them."""
    if isinstance(data, bytes | bytearray):
        if len(data) > NOTE_MAX_BYTES:
            return None
        try:
            data = json.loads(data)
        except ValueError:
            return None
    d = data
    if not isinstance(d, dict):
        return None
    rng = d.get("rng_from_ranks")
    per = []
    ranks = d.get("ranks")
    for k, v in (ranks.items() if isinstance(ranks, dict) else ()):
        if isinstance(k, str) and k.isdigit() and isinstance(v, dict) and len(per) < 4096:
            per.append((int(k), _secs(v.get("save_s")), _name(v.get("node"))))
    return EmergencyNote(
        step=_nat(d.get("step")), failing_rank=_nat(d.get("failing_rank")), writer_rank=_nat(d.get("writer_rank")),
        world_size=_nat(d.get("world_size")), save_s=_secs(d.get("save_s")), rng_wait_s=_secs(d.get("rng_wait_s")),
        rng_ranks=tuple(r for r in rng if _nat(r) is not None)[:4096] if isinstance(rng, list) else (),
        node=_name(d.get("node") or d.get("failing_node")), per_rank=tuple(sorted(per)))


def _ranks(world: int | None) -> str:
    return f" of {world}" if world else ""


def describe(em: EmergencyCheckpoint, note: EmergencyNote | None = None, node: str | None = None) -> tuple[str, dict]:
    """The attempt's emergency-checkpoint event: its words (what `show` prints) and its data (the
    report and the metrics read): the save's time, which rank ran out of memory (and where), which
    rank wrote, whose RNG state came how fast, and each rank's own save where the note lists it."""
    note = note if note is not None and note.step in (None, em.step) else None
    world = (note and note.world_size) or em.world_size
    oom_rank = note.failing_rank if note and note.failing_rank is not None else em.oom_rank
    writer = note.writer_rank if note and note.writer_rank is not None else em.rank
    seconds = em.seconds if em.seconds is not None else (note.save_s if note else None)  # the marker's: to the rename
    node = (note and note.node) or node
    data = {"outcome": em.outcome, "step": em.step, "path": em.path, "seconds": seconds, "oom_rank": oom_rank,
            "writer_rank": writer, "world_size": world, "node": node,
            "rng_ranks": list(note.rng_ranks if note and note.rng_ranks else em.rng_ranks),
            "rng_wait_s": note.rng_wait_s if note else None,
            "per_rank": note.to_dict()["per_rank"] if note else []}
    where = "" if oom_rank is None else f"OOM on rank {oom_rank}{_ranks(world)}"
    where += f" ({node})" if node and where else (f"OOM on {node}" if node else "")
    if em.outcome == "saved":
        words = f"emergency checkpoint at step {em.step}: {em.path}"
        said = [f"saved in {seconds:g} s" if seconds is not None else None,
                f"written by rank {writer}{_ranks(world)}" if writer is not None else None, where or None]
        if data["rng_ranks"] and len(data["rng_ranks"]) > 1:
            said.append(f"RNG of ranks {data['rng_ranks']}"
                        + (f" in {note.rng_wait_s:g} s" if note and note.rng_wait_s is not None else ""))
        if data["per_rank"]:
            said.append("per rank " + ", ".join(
                f"{p['rank']}: {'?' if p['save_s'] is None else format(p['save_s'], 'g')} s"
                + (f" ({p['node']})" if p["node"] else "") for p in data["per_rank"]))
        words += " (" + "; ".join(s for s in said if s) + ")"
    elif em.outcome == "already_saved":
        words = f"emergency checkpoint at step {em.step}: already saved by the regular schedule" + (
            f" ({where})" if where else "")
    else:
        words = f"no emergency checkpoint ({em.outcome}): {em.reason or em.text}"
        if node and node not in words:
            words += f" [{where}]"
    return words, data
