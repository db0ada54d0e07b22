"""Where the night went: a job's wall time split into named buckets that add up to it. Pure.

Goodput = productive / wall, as Google's ML goodput, Meta's Llama 3 report and ByteRobust's ETTR
count it: the share of wall time that produced progress the run kept. The buckets:

  queued           submitted (or runnable again) and waiting for a slot
  waiting_gpus     waiting for the GPUs it asked for, or for their memory to be given back
  startup          process start to the first step (model load included) and the exit after the last
  checkpoint_load  loading the checkpoint it resumes from (and converting it, before launch)
  productive       training steps whose progress was kept (each global step's kept execution)
  checkpoint_save  saving checkpoints and the final model
  emergency_save   the start-up hook's emergency checkpoint after a catchable OOM: from its start
                   (several ranks: the other ranks' RNG answers included) to checkpoint-N in place
  redone           training steps a failure threw away (the progress trained again afterwards)
  failed           the rest of an attempt that failed or was interrupted: from its last step to its
                   end (the failure, the teardown), or all of it when it never reached a step
  hang             an attempt that printed nothing until the hang timeout stopped it
  backoff          waiting out the policy's delay before the next attempt
  held             failed, cancelled or interrupted, until someone (or a restarted daemon) resumed it

The computation paints labelled intervals over the job's lifetime, the higher priority winning
where they overlap, and cuts the result into elementary segments; every second of
[submitted, end] lands in exactly one bucket, so the buckets add up to the wall time by
construction (tests check it on real nights anyway). Inputs are plain records: the job's state
changes, its attempts, the timing marks the daemon saw while following each attempt (step
advances, checkpoint loads and saves, recorded once per attempt), waits and fixups.

`TimingMarks` is the accumulator the daemon feeds while it reads an attempt's log; it is pure
too (text and times in, marks out).
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

BUCKETS: tuple[str, ...] = ("queued", "waiting_gpus", "startup", "checkpoint_load", "productive",
                            "checkpoint_save", "emergency_save", "redone", "failed", "hang", "backoff", "held")
LABELS = {
    "queued": "queued", "waiting_gpus": "waiting for GPUs/VRAM", "startup": "start-up",
    "checkpoint_load": "checkpoint loads", "productive": "productive training", "checkpoint_save": "checkpoint saves",
    "emergency_save": "emergency saves",
    "redone": "progress redone", "failed": "failed attempts", "hang": "hang timeout", "backoff": "backoff",
    "held": "held (failed/interrupted)",
}
# Where labels overlap, the higher one wins (a save inside a step interval is a save).
_PRIORITY = {"hang": 10, "emergency_save": 9, "checkpoint_save": 8, "checkpoint_load": 7, "productive": 6, "redone": 6,
             "startup": 5, "failed": 5, "waiting_gpus": 4, "held": 3, "backoff": 2, "queued": 1}
MAX_STEP_POINTS = 512
PARTIAL_KEEP = 4096  # of a line still being written: enough for any marker line
TERMINAL = ("succeeded", "failed", "cancelled")
RUNNABLE_STATES = ("queued", "waiting_retry")

# --------------------------------------------------------------------------- marks (live)

# transformers' Trainer (5.x) logs these through LLaMA-Factory's INFO handler on rank 0 (measured
# with LLaMA-Factory 0.9.5, transformers 5.6, DeepSpeed 0.19.8): "Loading model from <ckpt>." when a non-DeepSpeed resume
# loads the weights (the optimizer follows silently), "Attempting to resume from <ckpt>"
# (integrations/deepspeed.py) when DeepSpeed loads weights and optimizer; "***** Running training
# *****" once _prepare_for_training has loaded them all; "Saving model checkpoint to <dir>" at the
# start of every save (checkpoints and the final model). LLaMA-Factory's own "Resuming training
# from ..." comes at argument parsing: start-up, not loading.
_LOAD_BEGIN_RE = re.compile(r"Loading model from \S*checkpoint-\d+|Attempting to resume from \S+")
_LOAD_END_RE = re.compile(r"\*\*\*\*\* Running training \*\*\*\*\*")
_SAVE_RE = re.compile(r"Saving model checkpoint to (\S+)")
# The start-up hook's markers (hooks/startup/oom_supervisor_hooks/emergency.py; read in full by
# supervisor.hooks.markers): "saving step N" starts the write, "(saved in S s)" ends it, S counting
# from before a multi-rank save asked the other ranks for their RNG state; "failed" ends it too.
_EM = r"^(?:\[(?:rank|default)\d+\]:\s*)?oom-supervisor: emergency checkpoint"
_EM_BEGIN_RE = re.compile(_EM + r": saving step \d+ to ", re.MULTILINE)
_EM_END_RE = re.compile(_EM + r" at step \S+(?:: .* \(saved in (?P<s>[\d.]+) s\)| failed: .*)\r?$", re.MULTILINE)
_NEEDLES = (b"Loading model from", b"Attempting to resume from", b"Running training", b"Saving model checkpoint",
            b"oom-supervisor: emergency checkpoint")


@dataclass
class TimingMarks:
    """What the daemon saw, and when, while an attempt ran: step advances (at most
    MAX_STEP_POINTS, thinned evenly, first and last kept), checkpoint loads and saves.

    Times are the daemon's wall clock when it read the line (it wakes within ~20 ms of new
    output). A save's end is set by the caller (`close_save`) from the checkpoint's files, else
    it is the next step advance."""

    steps: list[tuple[int, float]] = field(default_factory=list)
    loads: list[list[float | None]] = field(default_factory=list)  # [begin, end]
    saves: list[list[Any]] = field(default_factory=list)  # [begin, end, path]
    emergency: list[list[float | None]] = field(default_factory=list)  # [begin, end] of emergency saves
    _partial: bytes = b""

    def on_text(self, now: float, chunk: bytes) -> None:
        """New log bytes, read at `now`; complete lines only (a marker may straddle two reads)."""
        data = self._partial + chunk
        cut = data.rfind(b"\n") + 1
        self._partial = data[cut:][-PARTIAL_KEEP:]
        data = data[:cut]
        if not any(n in data for n in _NEEDLES):
            return
        text = data.decode("utf-8", "replace")
        if _LOAD_BEGIN_RE.search(text) and not (self.loads and self.loads[-1][1] is None):
            self.loads.append([now, None])
        for m in _SAVE_RE.finditer(text):
            if self.saves and self.saves[-1][1] is None:
                self.saves[-1][1] = now  # a second save began: the first one is over
            self.saves.append([now, None, m.group(1).rstrip(".")])
        if _LOAD_END_RE.search(text) and self.loads and self.loads[-1][1] is None:
            self.loads[-1][1] = now
        self._emergency(now, text)

    def _emergency(self, now: float, text: str) -> None:
        if _EM_BEGIN_RE.search(text) and not (self.emergency and self.emergency[-1][1] is None):
            self.emergency.append([now, None])
        for m in _EM_END_RE.finditer(text):
            took = float(m["s"]) if m["s"] else 0.0
            if self.emergency and self.emergency[-1][1] is None:
                self.emergency[-1] = [min(self.emergency[-1][0] or now, now - took), now]
            elif took:
                self.emergency.append([now - took, now])
            if self.saves and self.saves[-1][1] is None:
                self.saves[-1][1] = now  # the Trainer's save inside the emergency one is over too

    def on_step(self, now: float, step: int) -> None:
        if self.loads and self.loads[-1][1] is None:
            self.loads[-1][1] = now  # no end line seen: the first step ends the load at the latest
        if self.saves and self.saves[-1][1] is None:
            self.saves[-1][1] = now
        if self.steps and step <= self.steps[-1][0]:
            return
        self.steps.append((step, now))
        if len(self.steps) > MAX_STEP_POINTS:  # thin the older points, keep the newest
            self.steps = [*self.steps[:-1:2], self.steps[-1]]

    def pending_save(self) -> tuple[float, str] | None:
        """(begin, path) of the newest save whose end is not known yet."""
        if self.saves and self.saves[-1][1] is None:
            return self.saves[-1][0], self.saves[-1][2]
        return None

    def close_save(self, end: float) -> None:
        if self.saves and self.saves[-1][1] is None and end >= self.saves[-1][0]:
            self.saves[-1][1] = end

    def to_dict(self) -> dict[str, Any]:
        return {"steps": [list(s) for s in self.steps], "loads": [list(x) for x in self.loads],
                "saves": [list(x) for x in self.saves], "emergency": [list(x) for x in self.emergency]}


@dataclass(frozen=True)
class Marks:
    steps: tuple[tuple[int, float], ...] = ()
    loads: tuple[tuple[float, float | None], ...] = ()
    saves: tuple[tuple[float, float | None], ...] = ()
    emergency: tuple[tuple[float, float | None], ...] = ()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Marks | None:
        if not d:
            return None
        try:
            return cls(steps=tuple((int(s), float(t)) for s, t in d.get("steps") or ()),
                       loads=tuple((float(b), None if e is None else float(e)) for b, e in d.get("loads") or ()),
                       saves=tuple((float(x[0]), None if x[1] is None else float(x[1])) for x in d.get("saves") or ()),
                       emergency=tuple((float(b), None if e is None else float(e))
                                       for b, e in d.get("emergency") or ()))
        except (TypeError, ValueError, IndexError):
            return None


# --------------------------------------------------------------------------- records (input)


@dataclass(frozen=True)
class AttemptSpan:
    """One attempt as the record has it."""

    number: int
    started_at: float
    ended_at: float | None  # None: still running
    outcome: str  # "success", "running", "interrupted", or the diagnosis category of a failure
    resumed_from_step: int | None = None
    max_step: int | None = None
    checkpoint_step_after: int | None = None  # the newest complete checkpoint when it ended
    steps_per_s: float | None = None
    marks: Marks | None = None
    hang_at: float | None = None  # when the daemon stopped it for a hang
    hang_timeout: float | None = None

    @property
    def kept_step(self) -> int:
        """The step up to which this attempt's training was kept."""
        start = self.resumed_from_step or 0
        if self.outcome in ("success", "running"):
            return max(start, self.max_step or start)
        return max(start, min(self.checkpoint_step_after or start, self.max_step or start))


@dataclass(frozen=True)
class Interval:
    begin: float
    end: float
    bucket: str


@dataclass(frozen=True)
class JobRecord:
    job_id: int
    name: str
    submitted_at: float
    states: tuple[tuple[float, str], ...]  # (ts, state entered), oldest first
    attempts: tuple[AttemptSpan, ...]
    backoffs: tuple[tuple[float, float], ...] = ()  # (ts, delay_s) of retry/escalate decisions
    waits: tuple[Interval, ...] = ()  # waiting for GPUs/VRAM, checkpoint conversions before launch


# --------------------------------------------------------------------------- result


@dataclass(frozen=True)
class Breakdown:
    wall_s: float
    buckets: Mapping[str, float]

    @property
    def goodput(self) -> float | None:
        return self.buckets.get("productive", 0.0) / self.wall_s if self.wall_s > 0 else None

    @property
    def total_s(self) -> float:
        return sum(self.buckets.values())

    def to_dict(self) -> dict[str, Any]:
        return {"wall_s": round(self.wall_s, 3), "goodput": None if self.goodput is None else round(self.goodput, 4),
                "buckets": {b: round(self.buckets.get(b, 0.0), 3) for b in BUCKETS}}


@dataclass(frozen=True)
class JobGoodput:
    job_id: int
    name: str
    begin: float
    end: float
    total: Breakdown
    attempts: Mapping[int, Breakdown]  # each attempt with the wait before it
    segments: tuple[tuple[float, float, str, int | None], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {**self.total.to_dict(), "begin": self.begin, "end": self.end,
                "attempts": {str(n): b.to_dict() for n, b in self.attempts.items()}}


def breakdown(parts: Iterable[Breakdown]) -> Breakdown:
    """The sum of several breakdowns (a night: job-hours, not clock hours, when jobs overlap)."""
    total: dict[str, float] = dict.fromkeys(BUCKETS, 0.0)
    wall = 0.0
    for p in parts:
        wall += p.wall_s
        for b, v in p.buckets.items():
            total[b] = total.get(b, 0.0) + v
    return Breakdown(wall, total)


# --------------------------------------------------------------------------- the computation


def job_goodput(job: JobRecord, *, now: float) -> JobGoodput:
    begin = job.submitted_at
    end = _job_end(job, now)
    paint: list[tuple[float, float, str, int | None]] = []
    paint += _state_paint(job, end)
    for b in job.waits:
        paint.append((b.begin, b.end, b.bucket, None))
    for ts, delay in job.backoffs:
        paint.append((ts, ts + max(0.0, delay), "backoff", None))
    for a in job.attempts:
        paint += _attempt_paint(a, job.attempts, end)
    segments = _flatten(paint, begin, end)
    # Each attempt owns its own time and the wait just before it; what follows the last one is the job's.
    starts = [a.started_at for a in job.attempts]
    per: dict[int, dict[str, float]] = {a.number: {} for a in job.attempts}
    total: dict[str, float] = dict.fromkeys(BUCKETS, 0.0)
    out_segments = []
    for b, e, bucket, n in segments:
        total[bucket] += e - b
        owner = n
        if owner is None:
            later = [a.number for a, s in zip(job.attempts, starts) if s >= e]
            owner = later[0] if later else None
        if owner is not None:
            per[owner][bucket] = per[owner].get(bucket, 0.0) + (e - b)
        out_segments.append((b, e, bucket, owner))
    attempts = {n: Breakdown(sum(v.values()), {k: v.get(k, 0.0) for k in BUCKETS}) for n, v in per.items()}
    return JobGoodput(job.job_id, job.name, begin, end, Breakdown(max(0.0, end - begin), total), attempts,
                      tuple(out_segments))


def _job_end(job: JobRecord, now: float) -> float:
    last_attempt_end = max((a.ended_at or now for a in job.attempts), default=job.submitted_at)
    if job.states and job.states[-1][1] in TERMINAL:
        return max(job.states[-1][0], last_attempt_end if all(a.ended_at for a in job.attempts) else now)
    return max(now, last_attempt_end)


def _state_paint(job: JobRecord, end: float) -> list[tuple[float, float, str, int | None]]:
    """The job-level base: queued where it was runnable, held where it waited on a person or a
    restart; running time outside attempts (preparing one) counts as queued."""
    out = []
    states = [(job.submitted_at, "queued"), *job.states]
    for (t, s), (t2, _s2) in zip(states, [*states[1:], (end, "")]):
        bucket = "held" if s in ("failed", "cancelled", "interrupted") else "queued"
        if s == "succeeded":
            continue
        out.append((t, min(t2, end), bucket, None))
    return out


def _attempt_paint(a: AttemptSpan, attempts: Sequence[AttemptSpan], end: float):
    s, e = a.started_at, a.ended_at if a.ended_at is not None else end
    n = a.number
    failed = a.outcome not in ("success", "running")
    out: list[tuple[float, float, str, int | None]] = []
    m = a.marks
    start_step = a.resumed_from_step or 0
    kept = a.kept_step
    steps = [(st, t) for st, t in (m.steps if m else ()) if s <= t <= e and st > start_step]
    if not steps and a.max_step is not None and a.max_step > start_step and a.steps_per_s:
        # No marks (an attempt taken back after a restart, or an older record): the steps it
        # reached at its measured rate, placed at its end.
        train = min(e - s, (a.max_step - start_step) / a.steps_per_s)
        steps = [(start_step, e - train), (a.max_step, e)]
    base_after = "failed" if failed else ("productive" if a.outcome == "running" else "startup")
    if steps:
        first_t = steps[0][1]
        out.append((s, first_t, "startup", n))
        out.append((steps[-1][1], e, base_after, n))
        rate = None
        if len(steps) >= 2 and steps[-1][0] > steps[0][0]:
            rate = (steps[-1][1] - steps[0][1]) / (steps[-1][0] - steps[0][0])
        elif a.steps_per_s:  # one step seen (the last one after a resume): its duration from the trainer log
            rate = 1.0 / a.steps_per_s
        if steps[0][0] > start_step and rate is not None:
            # The first mark is the END of the first steps: their compute came before it.
            steps.insert(0, (start_step, max(s, first_t - rate * (steps[0][0] - start_step))))
        for (s0, t0), (s1, t1) in pairwise(steps):
            out += _train_paint(s0, t0, s1, t1, kept, n)
    else:
        out.append((s, e, "failed" if failed else "startup", n))
    if m is not None:
        for b, le in m.loads:
            le = le if le is not None else (steps[0][1] if steps else e)
            out.append((max(s, b), min(e, le), "checkpoint_load", n))
        for b, se in m.saves:
            nxt = next((t for _st, t in steps if t > b), e)
            out.append((max(s, b), min(e, se if se is not None else nxt), "checkpoint_save", n))
        for b, ee in m.emergency:  # no end seen: the process died during it (the attempt's end)
            out.append((max(s, b), min(e, ee if ee is not None else e), "emergency_save", n))
    if a.hang_at is not None and a.hang_timeout:
        quiet = max(s, a.hang_at - a.hang_timeout, steps[-1][1] if steps else s)
        out.append((quiet, e, "hang", n))
    return out


def _train_paint(s0: int, t0: float, s1: int, t1: float, kept: int, n: int):
    """Steps s0+1..s1 took [t0, t1]: the part up to `kept` was kept, the rest thrown away."""
    if t1 <= t0 or s1 <= s0:
        return []
    if s1 <= kept:
        return [(t0, t1, "productive", n)]
    if s0 >= kept:
        return [(t0, t1, "redone", n)]
    cut = t0 + (t1 - t0) * (kept - s0) / (s1 - s0)
    return [(t0, cut, "productive", n), (cut, t1, "redone", n)]


def _flatten(paint: Sequence[tuple[float, float, str, int | None]], begin: float, end: float):
    """Cut [begin, end] at every boundary; each piece takes the highest-priority label over it
    (ties: the attempt's own label, then the later one). Unlabelled time is queued."""
    cuts = {begin, end}
    items = []
    for b, e, bucket, n in paint:
        b, e = max(begin, b), min(end, e)
        if e > b:
            items.append((b, e, bucket, n))
            cuts.update((b, e))
    points = sorted(cuts)
    out: list[tuple[float, float, str, int | None]] = []
    items.sort(key=lambda x: x[0])
    heap: list[tuple[int, int, float, str, int | None]] = []
    k = 0
    for p0, p1 in pairwise(points):
        while k < len(items) and items[k][0] <= p0:
            b, e, bucket, n = items[k]
            heapq.heappush(heap, (-_PRIORITY[bucket], -(n is not None), -k, e, bucket, n))  # type: ignore[arg-type]
            k += 1
        while heap and heap[0][3] <= p0:
            heapq.heappop(heap)
        if heap:  # (entries that ended earlier but sit below a live one never reach the top)
            _p, _a, _k, _e, bucket, n = heap[0]
        else:
            bucket, n = "queued", None
        if out and out[-1][2] == bucket and out[-1][3] == n and out[-1][1] == p0:
            out[-1] = (out[-1][0], p1, bucket, n)
        else:
            out.append((p0, p1, bucket, n))
    return out
