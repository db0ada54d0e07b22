"""Training progress from LLaMA-Factory's `output_dir/trainer_log.jsonl`.

One JSON object per log event: current_steps, total_steps, loss, lr, epoch, elapsed_time
("H:MM:SS", a `str(timedelta)`), and with `include_num_input_tokens_seen: true` total_tokens.
Two traps shape this reader:

* after a resume LLaMA-Factory appends to the same file and its timer restarts at 0, while
  total_tokens continues from the checkpoint: `throughput` is then wrong and mixing lines of two
  attempts gives nonsense rates. So rates come from DELTAS between lines of THIS attempt only,
  selected by a byte offset (the file size when the attempt started) and/or a resume step.
* the file is read while it is being written: a partial last line, or garbage, is skipped and
  counted, never fatal.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRAINER_LOG = "trainer_log.jsonl"
_ELAPSED_RE = re.compile(r"^(?:(\d+) days?, )?(\d+):(\d{2}):(\d{2}(?:\.\d+)?)$")


@dataclass(frozen=True)
class Progress:
    """What this attempt's log lines say. Absent facts are None, never 0.

    `end_offset` is where reading stopped (after the last complete line): pass it back as
    `since_offset` to read incrementally; `bad_lines` counts lines that were not JSON objects.
    """

    max_step: int | None
    total_steps: int | None
    steps_per_s: float | None
    tokens_per_s: float | None
    last_loss: float | None
    last_lr: float | None = None
    epoch: float | None = None
    first_step: int | None = None
    lines: int = 0
    bad_lines: int = 0
    end_offset: int = 0


def read_progress(
    output_dir: Path, *, since_step: int | None = None, since_offset: int | None = None
) -> Progress:
    """Read `trainer_log.jsonl` lines written by the current attempt.

    since_offset: the log's size in bytes when this attempt was launched (lines before it belong
    to earlier attempts): exact, prefer it. since_step: the step this attempt resumed from; the
    lines after the last restart seen in the file (`last_attempt`) above that step are used.
    With neither, the whole file counts as one attempt.
    A missing file gives an empty Progress (the attempt has not logged yet).
    """
    path = Path(output_dir) / TRAINER_LOG
    try:
        with open(path, "rb") as f:
            if since_offset:
                f.seek(since_offset)
            data = f.read()
    except FileNotFoundError:
        return Progress(None, None, None, None, None, end_offset=since_offset or 0)
    start = since_offset or 0
    complete, sep, _partial = data.rpartition(b"\n")  # a partial last line waits for next time
    end_offset = start + len(complete) + len(sep)
    records, bad = _parse_lines(complete.split(b"\n") if complete else [])
    if since_step is not None:
        records = [r for r in last_attempt(records) if (_int(r.get("current_steps")) or 0) > since_step]
    return summarize(records, bad_lines=bad, end_offset=end_offset, resumed_from=since_step)


def last_attempt(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records after the last restart seen in the log: where the step goes down, or stays
    and the timer goes back (a resumed attempt re-logs steps the failed one had reached).

    A fallback for callers without a byte offset: before the new attempt logs its first line,
    the last run of lines is still the previous attempt's.
    """
    start = 0
    prev_step = prev_t = None
    for i, r in enumerate(records):
        step, t = _int(r.get("current_steps")), parse_elapsed(r.get("elapsed_time"))
        if step is None:
            continue
        if prev_step is not None and (
            step < prev_step or (step == prev_step and t is not None and prev_t is not None and t < prev_t)
        ):
            start = i
        prev_step, prev_t = step, t
    return records[start:]


def summarize(records: list[dict[str, Any]], *, bad_lines: int = 0, end_offset: int = 0,
              resumed_from: int | None = None) -> Progress:
    """Pure: a Progress from parsed log records of one attempt, oldest first."""
    steps = [(s, r) for r in records if (s := _int(r.get("current_steps"))) is not None]
    if not steps:
        return Progress(None, None, None, None, None, lines=len(records), bad_lines=bad_lines,
                        end_offset=end_offset)
    max_step = max(s for s, _ in steps)
    total = next((t for _, r in reversed(steps) if (t := _int(r.get("total_steps"))) is not None), None)
    losses = [(r.get("loss"), r.get("lr")) for _, r in steps if _num(r.get("loss")) is not None]
    last_loss = _num(losses[-1][0]) if losses else None
    last_lr = _num(losses[-1][1]) if losses else None
    epoch = next((e for _, r in reversed(steps) if (e := _num(r.get("epoch"))) is not None), None)

    timed, seen = [], set()
    for s, r in steps:  # one record per step: the end-of-training summary repeats the last step
        if s not in seen and (t := parse_elapsed(r.get("elapsed_time"))) is not None:
            seen.add(s)
            timed.append((s, t, r))
    steps_per_s = tokens_per_s = None
    if len(timed) >= 2:
        (s0, t0, r0), (s1, t1, r1) = timed[0], timed[-1]
        dt = t1 - t0
        if dt > 0:
            if s1 > s0:
                steps_per_s = (s1 - s0) / dt
            k0, k1 = _int(r0.get("total_tokens")), _int(r1.get("total_tokens"))
            if k0 is not None and k1 is not None and k1 >= k0:
                tokens_per_s = (k1 - k0) / dt
    elif len(timed) == 1 and resumed_from is not None and timed[0][0] > resumed_from and timed[0][1]:
        # One line since a resume: LLaMA-Factory's timer restarted with this attempt's training,
        # so the steps done since the resume point over its elapsed time is this attempt's rate.
        steps_per_s = (timed[0][0] - resumed_from) / timed[0][1]
    return Progress(
        max_step=max_step,
        total_steps=total,
        steps_per_s=steps_per_s,
        tokens_per_s=tokens_per_s,
        last_loss=last_loss,
        last_lr=last_lr,
        epoch=epoch,
        first_step=steps[0][0],
        lines=len(records),
        bad_lines=bad_lines,
        end_offset=end_offset,
    )


def steps_lost(max_step_reached: int | None, resumed_from: int | None) -> int | None:
    """Steps of work a failure threw away: how far the attempt got minus where it started.

    None when the attempt logged no step (then nothing is known, which is not 0).
    """
    if max_step_reached is None:
        return None
    return max(0, max_step_reached - (resumed_from or 0))


def parse_elapsed(value: Any) -> float | None:
    """Seconds from LLaMA-Factory's `str(timedelta)` ('0:01:02', '1 day, 2:03:04'), or None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, str):
        return None
    m = _ELAPSED_RE.match(value.strip())
    if not m:
        return None
    days, h, mnt, sec = m.groups()
    return int(days or 0) * 86400 + int(h) * 3600 + int(mnt) * 60 + float(sec)


def _parse_lines(lines: list[bytes]) -> tuple[list[dict[str, Any]], int]:
    records: list[dict[str, Any]] = []
    bad = 0
    for raw in lines:
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            bad += 1
            continue
        if isinstance(obj, dict):
            records.append(obj)
        else:
            bad += 1
    return records, bad


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)
