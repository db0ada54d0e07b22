"""A user's own `resume_from_checkpoint`: honoured, or replaced with a note that says why. Pure.

LLaMA-Factory 0.9.5 hands the key to transformers' `Trainer.train(resume_from_checkpoint=...)`;
the supervisor always renders an explicit path instead (auto-resume takes the highest
`checkpoint-N` with no completeness check), so what the user wrote is read here first:

* absent / null: the newest COMPLETE checkpoint of output_dir (what LLaMA-Factory's auto-resume
  means, minus the half-written folders).
* `true`: transformers' `get_last_checkpoint(output_dir)`, again without a completeness check:
  the newest complete one. With none at all, transformers stops ("No valid checkpoint found in
  output directory"): the first attempt is refused, with what was found.
* `auto`: the word of LLaMA-Factory's newer trainer (v1: the newest valid checkpoint, else from
  scratch); 0.9.5's trainer would look for a folder named `auto` and stop with "Can't find a
  valid checkpoint at auto". Read as the newer trainer reads it, and said.
* `false`: no resume at the start. Checkpoints already in output_dir belong to an earlier run:
  they are set aside (never deleted), so no later attempt of this job resumes into that run.
* a path: that checkpoint when it is complete (newer ones in output_dir are set aside, so no
  later attempt jumps past the user's choice); when it is incomplete, the newest complete one
  next to it, said; a path that does not exist refuses the first attempt (transformers would
  stop with "Can't find a valid checkpoint").

All of this is about where the JOB starts. From its second attempt on, it continues from its own
newest complete checkpoint (or the user's chosen one, when nothing newer was written since).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.judge.resume import Checkpoint, Incomplete, Scan

KEY = "resume_from_checkpoint"


@dataclass(frozen=True)
class UserCheckpoint:
    """What is at the path the user named, read at the edge."""

    path: Path  # resolved against the job's working directory
    found: Checkpoint | Incomplete | None  # None: nothing there
    siblings: Scan | None = None  # the folder holding it, when that is not output_dir


@dataclass(frozen=True)
class Choice:
    """Where the attempt starts from, and what to say about it."""

    checkpoint: Checkpoint | None
    note: str | None = None  # said to the user when the value was read, replaced or refused
    # Set aside output_dir's checkpoint-N folders newer than this step before launch (-1: every one,
    # final weights included): they belong to a run the user chose not to continue.
    archive_above: int | None = None
    refuse: str | None = None


def user_value(config: dict[str, Any] | Any) -> str | None:
    """The user's value as one of None, 'true', 'false', 'auto' or a path string."""
    raw = config.get(KEY) if hasattr(config, "get") else None
    if raw is None:
        return None
    if isinstance(raw, bool):
        return "true" if raw else "false"
    text = str(raw).strip()
    if text.lower() in ("true", "false", "auto"):
        return text.lower()
    return text or None


def choose_checkpoint(value: str | None, *, scan: Scan, user: UserCheckpoint | None,
                      first_attempt: bool, output_dir: Path | None = None) -> Choice:
    """Which checkpoint the attempt resumes from, given the user's `value` (see `user_value`)."""
    latest = scan.latest
    if value is None:
        return Choice(latest)
    said = f"{KEY}: {value}"
    if value == "true":
        if latest is not None:
            return Choice(latest, f"{said}: the newest complete checkpoint, {latest.path.name}"
                          + _skipped_newer(scan, latest))
        if first_attempt:
            return Choice(None, refuse=f"{said} but output_dir has no complete checkpoint"
                          + _incomplete_words(scan) + " (transformers would stop: 'No valid checkpoint found "
                          "in output directory'); remove the key to start from step 0")
        return Choice(None, f"{said}: still no complete checkpoint; starting from step 0")
    if value == "auto":
        why = ("the newer LLaMA-Factory trainer's word for the newest complete checkpoint; 0.9.5 would "
               "look for a folder named 'auto'")
        if latest is None:
            return Choice(None, f"{said} ({why}): no complete checkpoint" + _incomplete_words(scan)
                          + ", so from step 0 as `auto` does")
        return Choice(latest, f"{said} ({why}): {latest.path.name}" + _skipped_newer(scan, latest))
    if value == "false":
        if not first_attempt:
            if latest is None:
                return Choice(None)
            return Choice(latest, f"{said} held for the first attempt; this one continues from "
                          f"{latest.path.name}, which this job wrote")
        earlier = [c.path.name for c in scan.complete] + [i.path.name for i in scan.incomplete]
        if not earlier:
            return Choice(None, f"{said}: starting from step 0")
        return Choice(None, f"{said}: starting from step 0; the checkpoints already in output_dir "
                      f"({', '.join(earlier)}: an earlier run's) are set aside, not deleted, so that no "
                      "later attempt resumes into that run", archive_above=-1)
    return _path_choice(value, scan=scan, user=user, first_attempt=first_attempt, output_dir=output_dir)


def _path_choice(value: str, *, scan: Scan, user: UserCheckpoint | None, first_attempt: bool,
                 output_dir: Path | None) -> Choice:
    said = f"{KEY}: {value}"
    latest = scan.latest
    found = user.found if user is not None else None
    inside = user is not None and output_dir is not None and user.path.parent == output_dir
    if isinstance(found, Checkpoint):
        chosen, why = found, f"{said}: {found.path.name}, as asked"
    elif isinstance(found, Incomplete):
        near = latest if inside or user is None or user.siblings is None else user.siblings.latest
        if near is None:
            if first_attempt:
                return Choice(None, refuse=f"{said} is incomplete ({found.reason}) and no complete checkpoint "
                              "is next to it: nothing to resume from; point it at a complete one or remove it")
            return Choice(latest, f"{said} is incomplete ({found.reason})"
                          + (f"; continuing from {latest.path.name}, which this job wrote" if latest else ""))
        chosen, why = near, (f"{said} is incomplete ({found.reason}); the newest complete one there is "
                             f"{near.path.name}: resuming from it")
    else:
        if first_attempt:
            have = ", ".join(c.path.name for c in scan.complete) or "none"
            return Choice(None, refuse=f"{said} does not exist (transformers would stop: 'Can't find a valid "
                          f"checkpoint'); complete checkpoints in output_dir: {have}")
        return Choice(latest, f"{said} does not exist" + (
            f"; continuing from {latest.path.name}, which this job wrote" if latest else "; starting from step 0"))
    if not first_attempt:
        if latest is not None and latest.step > chosen.step:
            return Choice(latest, f"{why}; this attempt continues from {latest.path.name}, which this job "
                          "wrote since")
        return Choice(chosen, why)
    newer = [c.path.name for c in scan.complete if c.step > chosen.step]
    newer += [i.path.name for i in scan.incomplete if (i.step or -1) > chosen.step]
    if newer:
        return Choice(chosen, f"{why}; the newer {', '.join(newer)} in output_dir are set aside (not deleted) "
                      "so that no later attempt resumes past the checkpoint you chose",
                      archive_above=chosen.step)
    return Choice(chosen, why)


def _skipped_newer(scan: Scan, chosen: Checkpoint) -> str:
    newer = [i for i in scan.incomplete if (i.step or -1) > chosen.step]
    if not newer:
        return ""
    first = max(newer, key=lambda i: i.step or -1)
    return (f" (transformers alone would take {first.path.name}, which is incomplete: {first.reason}; it is "
            "moved aside)")


def _incomplete_words(scan: Scan) -> str:
    if not scan.incomplete:
        return ""
    return " (" + "; ".join(f"{i.path.name} is incomplete: {i.reason}" for i in scan.incomplete[-3:]) + ")"
