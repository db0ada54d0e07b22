"""Where the run got to: total and current steps from the trainer's and tqdm's lines, the phase
from frames and context lines, logged losses, and the lazily built tail. A LogScanner part."""


from __future__ import annotations

from collections import deque

from supervisor.core.models import Category, Evidence, Phase
from supervisor.judge.diagnosis import rules
from supervisor.judge.diagnosis.rules import (
    FRAME_PHASES,
    PHASE_PRECEDENCE,
    Hit,
    Segment,
)
from supervisor.judge.diagnosis.scan_patterns import (
    _BAR_RE,
    _LOGGED_GRAD_RE,
    _LOGGED_LOSS_RE,
    EVIDENCE_CHARS,
    NUMERIC_RUN,
    TAIL_PENDING_BYTES,
    _bad_value,
    _digits_before,
    _last_segment,
    healthy_logged_step,
)


class ProgressReading:
    def _track_logged_step(self, t: str, seg: Segment, line_no: int, buf: bytes, ls: int,
                           fatal: list[Evidence]) -> None:
        """NUMERIC_RUN logged steps in a row with loss nan/inf/exactly 0.0 or grad_norm nan/inf:
        the run is training garbage; say so live (once) instead of at the end of the night."""
        m = _LOGGED_LOSS_RE.match(t)
        if not m:
            return
        if self._numeric_run:  # healthy logged steps are not candidates: look for one since the last bad
            last = self._last_bad
            after = last[1] + 1 if last is not None and last[0] == self._region else self._rs
            if healthy_logged_step(buf, after, ls):
                self._numeric_run.clear()
        what = _bad_value(m.group(1), zero_is_bad=True)
        if what is None:
            g = _LOGGED_GRAD_RE.search(t)
            gw = _bad_value(g.group(1), zero_is_bad=False) if g else None
            what = f"grad_norm {gw}" if gw else None
        else:
            what = f"loss {what}"
        if what is None:
            self._numeric_run.clear()
            return
        self._numeric_run.append((line_no, t[:EVIDENCE_CHARS], what))
        self._last_bad = (self._region, ls)
        if len(self._numeric_run) < NUMERIC_RUN or self._numeric_fired:
            return
        self._numeric_fired = True
        run = self._numeric_run[-NUMERIC_RUN:]
        sub = "zero_loss" if all(w == "loss 0.0" for _, _, w in run) else (
            "nan_loss" if all(w.startswith("loss") for _, _, w in run) else "nonfinite_grad_norm")
        hit = Hit("numeric_run", Category.NUMERIC, rules.ROOT, sub, fatal=True)
        self._record(hit, seg, line_no, buf, ls, fatal, "traceback")
        self._latest["numeric_run"].notes.append(
            f"{NUMERIC_RUN} logged steps in a row with {', '.join(w for _, _, w in run)} (lines "
            + ", ".join(str(n) for n, _, _ in run) + ")")

    def _set_total(self, total: int) -> None:
        if total > 0:
            self._total = total
            self._needle = b"/%d [" % total

    def _bump_step(self, step: int) -> None:
        if self._last_step is None or step > self._last_step:
            self._last_step = step

    def _discover_total(self, buf: bytes, start: int, end: int) -> None:
        """Learn the training bar's total from the first description-less tqdm bar."""
        p = buf.find(b"%|", start, end)
        tries = 0
        while p >= 0 and tries < 10_000:
            tries += 1
            seg = max(buf.rfind(b"\r", start, p), buf.rfind(b"\n", start, p)) + 1 or start
            if buf[max(seg, start):p].strip().isdigit():
                m = _BAR_RE.match(buf, p, end)
                if m:
                    self._set_total(int(m.group(2)))
                    return
            p = buf.find(b"%|", p + 2, end)

    def _scan_progress(self, buf: bytes, start: int, end: int, base: int, nlines: int) -> None:
        if self._needle is None:
            return
        if self._progress_from is not None and self._progress_from[0] == self._region:
            start = max(start, self._progress_from[1])
        p = buf.rfind(self._needle, start, end)
        if p < 0:
            return
        step = _digits_before(buf, p, start)
        if step is None:
            return
        line = base + nlines - buf.count(b"\n", p, end) + 1
        reached = self._step_reached_at(buf, start, p, step)
        if reached is None:
            self._bump_step(step)
            self._last_bar_line = max(self._last_bar_line, line)
            return
        reached_line = base + nlines - buf.count(b"\n", reached, end) + 1
        self._last_advance_line = max(self._last_advance_line, reached_line)
        self._bump_step(step)
        self._last_bar_line = max(self._last_bar_line, line)
        for w in self._watch:
            # No step known at the OOM (the bar's total not seen yet) counts as "before step 0":
            # whether the total was learnt from this chunk or a later one must not change the answer.
            # The step must have grown after it: a bar reprinted at the step it had is not progress.
            if not w.recovered and reached_line > w.line_no and (w.step_before is None or step > w.step_before):
                w.recovered = True
                w.notes.append(f"training continued to step {step} afterwards")

    def _step_reached_at(self, buf: bytes, start: int, p: int, step: int) -> int | None:
        """Where the bar first showed `step` (the last bar of this read, at `p`), when the step grew to it:
        past the step known before, or past an earlier bar of this read. A bar a dying process reprints
        (tqdm's close, another rank's refresh) shows where the run stopped, not that it went on."""
        at = p
        for _ in range(64):  # the same step reprinted: walk back to where it was reached
            q = buf.rfind(self._needle, start, at)
            prev = _digits_before(buf, q, start) if q >= 0 else None
            if prev != step:
                grew = prev is not None and prev < step
                break
            at = q
        else:
            return None
        if self._last_step is not None:
            return at if step > self._last_step else None
        return at if grew else None

    def _floor(self) -> int:
        """Where backward searches for the bar may start: not before the total became known."""
        pf = self._progress_from
        return max(self._rs, pf[1]) if pf is not None and pf[0] == self._region else self._rs

    def _step_before(self, buf: bytes, ls: int) -> int | None:
        if self._needle is not None:
            p = buf.rfind(self._needle, self._floor(), ls)
            if p >= 0:
                step = _digits_before(buf, p, self._floor())
                if step is not None:
                    return max(step, self._last_step or 0)
        return self._last_step if self._last_step is not None else (0 if self._needle else None)

    def _bar_line_before(self, buf: bytes, ls: int, line_no: int) -> int:
        if self._needle is not None:
            p = buf.rfind(self._needle, self._floor(), ls)
            if p >= 0:
                return line_no - buf.count(b"\n", p, ls)
        return self._last_bar_line

    # --------------------------------------------------------------- phase
    @staticmethod
    def _phase_from_frames(frames: deque[tuple[str, str]] | None) -> Phase | None:
        if not frames:
            return None
        found = {FRAME_PHASES[f] for f, _ in frames if f in FRAME_PHASES}
        for phase in PHASE_PRECEDENCE:
            if phase in found:
                return phase
        return None

    def _context_phase(self, buf: bytes, ls: int, line_no: int) -> Phase:
        bar_line = self._bar_line_before(buf, ls, line_no)
        if self._context is None:
            return Phase.TRAIN_STEP if bar_line else Phase.UNKNOWN
        phase, marker_line = self._context
        if bar_line > marker_line:
            return Phase.TRAIN_STEP
        if phase is Phase.CHECKPOINT_SAVE and self._context_step is not None:
            # "Saving checkpoint-N" was the last marker, but a bar drawn since (or glued in front of
            # this line) shows step N+1: the save is over and this is the next training step.
            step = self._bar_step_on_line(buf, ls)
            if step is not None and step > self._context_step:
                return Phase.TRAIN_STEP
        return phase

    def _bar_step_on_line(self, buf: bytes, ls: int) -> int | None:
        if self._needle is None:
            return None
        le = buf.find(b"\n", ls)
        p = buf.rfind(self._needle, ls, le if le >= 0 else len(buf))
        return _digits_before(buf, p, ls) if p >= 0 else None

    def _context_phase_now(self) -> Phase:
        if self._context is None:
            return Phase.TRAIN_STEP if self._last_bar_line else Phase.UNKNOWN
        phase, marker_line = self._context
        return Phase.TRAIN_STEP if self._last_bar_line > marker_line else phase

    # ---------------------------------------------------------------- tail
    def _remember_tail(self, buf: bytes, start: int, end: int, base: int, nlines: int) -> None:
        """Remember where the tail lines are; they are decoded only when asked for (state())."""
        if nlines >= self.tail_lines:
            self._tail.clear()
            self._tail_pending = [(buf, start, end, base, nlines)]
            return
        pending = self._tail_pending
        pending.append((buf, start, end, base, nlines))
        while len(pending) > 1 and sum(p[4] for p in pending[1:]) >= self.tail_lines:
            pending.pop(0)  # superseded by newer lines
        while len(pending) > 1 and sum(p[2] - p[1] for p in pending) > TAIL_PENDING_BYTES:
            self._push_tail(*pending.pop(0))

    def _materialize_tail(self) -> None:
        pending, self._tail_pending = self._tail_pending, []
        for p in pending:
            self._push_tail(*p)

    def _push_tail(self, buf: bytes, start: int, end: int, base: int, nlines: int) -> None:
        want = min(nlines, self.tail_lines)
        stop = end - 1  # the final newline
        first_nl = stop
        for _ in range(want):
            j = buf.rfind(b"\n", start, first_nl)
            first_nl = j
            if j < 0:
                break
        lines = buf[(first_nl + 1 if first_nl >= 0 else start) : stop].split(b"\n")
        first = base + nlines - len(lines) + 1
        for i, line in enumerate(lines):
            self._tail.append((first + i, _last_segment(line)))
