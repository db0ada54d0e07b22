"""The byte stream: lines longer than LONG_LINE scanned in blocks, a printed sample block held
back or skipped, candidate windows around prefilter hits. A LogScanner part (it shares its state)."""


from __future__ import annotations

from supervisor.core.models import Evidence
from supervisor.judge.diagnosis.rules import (
    ANSI_RE,
    exception_class,
    split_prefix,
)
from supervisor.judge.diagnosis.scan_patterns import (
    _DIGITS,
    _PIECE_FILTER,
    _PREFILTER,
    _SAMPLE_END_RE,
    _SAMPLE_EOS_RE,
    _SAMPLE_FINAL_RE,
    _SAMPLE_HEADER_RE,
    _SAMPLE_RESUME_RE,
    _SAMPLE_SOFT_END_RE,
    HOLD_MAX_BYTES,
    HOLD_MAX_LINES,
    LONG_LINE,
    OVERLAP,
    SAMPLE_MAX_BYTES,
    SHAPE_LINE,
    SHAPES,
    TB_GAP,
    WINDOW,
    healthy_logged_step,
)


class StreamReading:
    def _consume_long_line(self, data: bytes, start: int, fatal: list[Evidence]) -> int:
        """Scan a newline-less line head longer than LONG_LINE in fixed blocks; return where to go on.

        Blocks are counted from the line's start, whatever the chunking, so the
        answer does not depend on how the stream was cut.
        """
        block = LONG_LINE + OVERLAP
        while len(data) - start >= block and data.find(b"\n", start, start + block) < 0:
            if self._hold is not None:
                self._release_hold()
            self._rs = start
            if self._sample_bytes is not None:  # a token-id list of a printed sample: not evidence
                self._sample_bytes += LONG_LINE
                start += LONG_LINE
                continue
            if self._needle is None:
                self._discover_total(data, start, start + block)
            self._scan_matches(data, start, start + block, self._lines + 1, fatal, count_lines=False)
            self._scan_progress(data, start, start + block, self._lines, 0)
            start += LONG_LINE
        return start

    def _scan_region(self, buf: bytes, start: int, end: int, fatal: list[Evidence]) -> None:
        """Process the complete lines buf[start:end] (end is just after a newline), skipping printed samples."""
        pos = start
        while pos < end:
            if self._sample_bytes is not None:
                stop = self._sample_stop(buf, pos, end)
                self._skip_lines(buf, pos, stop)
                pos = stop
                continue
            if self._hold is not None:
                pos = self._hold_region(buf, pos, end)
                continue
            h = self._sample_header(buf, pos, end)
            stop = end if h < 0 else h
            if stop > pos:
                self._scan_plain(buf, pos, stop, fatal)
            if h < 0:
                return
            self._sample_bytes = 0
            self._sample_final = False
            self.samples_skipped += 1
            he = buf.index(b"\n", h) + 1  # the header line belongs to the block
            self._skip_lines(buf, h, he)
            pos = he

    @staticmethod
    def _sample_header(buf: bytes, start: int, end: int) -> int:
        """Start of the first printed-sample header line in buf[start:end], or -1."""
        best = -1
        for needle in (b" example:", b"input_ids:"):
            p = buf.find(needle, start, end)
            while p >= 0 and (best < 0 or p < best):
                ls = buf.rfind(b"\n", start, p) + 1 or start
                if _SAMPLE_HEADER_RE.match(buf, ls, end):
                    best = ls
                    break
                p = buf.find(needle, p + 1, end)
        return best

    def _hold_region(self, buf: bytes, pos: int, end: int) -> int:
        """Lines after a provisional sample end: hold them until it is known whose they are."""
        assert self._hold is not None
        if self._hold_lines == 0:  # the line that ended the block provisionally is held, not re-matched
            nl = buf.index(b"\n", pos, end) + 1
            self._hold.append(buf[pos:nl])
            self._hold_lines, self._hold_bytes = 1, nl - pos
            pos = nl
            if pos >= end:
                return pos
        # Only the program's unmistakable output confirms the end (a sample may hold several soft ends).
        d = _SAMPLE_END_RE.search(buf, pos, end)
        r = _SAMPLE_RESUME_RE.search(buf, pos, d.start() if d else end)
        if r is not None:  # the sample went on: the held lines were its text
            held = b"".join(self._hold)
            self._hold = None
            self._skip_lines(held, 0, len(held))
            self._skip_lines(buf, pos, r.start())
            self._sample_bytes = self._hold_bytes + (r.start() - pos)
            self._sample_final = False
            return r.start()
        stop = d.start() if d else end
        # the budget, counted in whole lines, so chunking cannot change where it runs out
        p = pos
        while p < stop:
            nl = buf.find(b"\n", p, stop)
            nl = stop - 1 if nl < 0 else nl
            self._hold_lines += 1
            self._hold_bytes += nl + 1 - p
            if self._hold_lines > HOLD_MAX_LINES or self._hold_bytes > HOLD_MAX_BYTES:
                self._hold.append(buf[pos:nl + 1])
                self._release_hold()
                return nl + 1
            p = nl + 1
        self._hold.append(buf[pos:stop])
        if d is not None:
            self._release_hold()
        return stop

    def _release_hold(self) -> None:
        """The held lines are the program's output after all: read them."""
        held = b"".join(self._hold or ())
        self._hold = None
        if held:
            self._scan_plain(held, 0, len(held), [])  # read late: never a live teardown

    def _sample_stop(self, buf: bytes, pos: int, end: int) -> int:
        """Where the open sample block ends in buf[pos:end] (a line start), closing it if it does."""
        assert self._sample_bytes is not None
        m = _SAMPLE_END_RE.search(buf, pos, end)
        t = _SAMPLE_SOFT_END_RE.search(buf, pos, m.start() if m else end)
        if t is not None:
            m = None
        stop = t.start() if t is not None else (m.start() if m else end)
        closed = m is not None or t is not None
        soft = t is not None  # closed provisionally: hold what follows
        final_from = pos
        if not self._sample_final:
            f = _SAMPLE_FINAL_RE.search(buf, pos, stop)
            if f is not None:
                self._sample_final, final_from = True, f.end()
        if self._sample_final:
            e = _SAMPLE_EOS_RE.search(buf, final_from, stop)
            if e is not None:
                nl = buf.find(b"\n", e.end(), end)
                stop, closed, soft = (end if nl < 0 else nl + 1), True, False
        budget = SAMPLE_MAX_BYTES - self._sample_bytes
        if stop - pos > budget:  # too long for a sample: end it at the next line start past the budget
            nl = buf.find(b"\n", pos + max(0, budget), end)
            stop = end if nl < 0 else nl + 1
            closed, soft = True, False
        self._sample_bytes += stop - pos
        if closed:
            self._sample_bytes = None
            if soft:
                self._hold, self._hold_lines, self._hold_bytes = [], 0, 0
        return stop

    def _skip_lines(self, buf: bytes, start: int, end: int) -> None:
        """Count lines that are not evidence (a printed sample) and keep them for the tail only."""
        if end <= start:
            return
        base = self._lines
        nlines = buf.count(b"\n", start, end)
        self._lines = base + nlines
        self._remember_tail(buf, start, end, base, nlines)
        self._prev_tail = self._last_line_end(buf, start, end)
        if nlines:
            r = self._sample_lines[-1] if self._sample_lines else None
            if r is not None and r[1] == base:
                self._sample_lines[-1] = (r[0], base + nlines)
            else:
                self._sample_lines.append((base + 1, base + nlines))

    def _scan_plain(self, buf: bytes, start: int, end: int, fatal: list[Evidence]) -> None:
        self._region += 1
        self._scan_lines(buf, start, end, fatal)
        if self._rich:  # a rich traceback's box still open: carry its bytes into the next read
            self._carry_rich(buf, start, end)
        if self._numeric_run:  # a logged step after the last bad one (healthy: not a candidate) ends the run
            last = self._last_bad
            after = last[1] + 1 if last is not None and last[0] == self._region else start
            if healthy_logged_step(buf, after, end):
                self._numeric_run.clear()

    def _scan_lines(self, buf: bytes, start: int, end: int, fatal: list[Evidence]) -> None:
        base = self._lines
        self._rs = start
        if self._needle is None:
            # Before the candidates: their phase and "progress after an OOM" need the bar's total.
            self._discover_total(buf, start, end)
        nlines = self._scan_matches(buf, start, end, base + 1, fatal, count_lines=True)
        self._scan_progress(buf, start, end, base, nlines)
        self._lines = base + nlines
        self._remember_tail(buf, start, end, base, nlines)
        self._prev_tail = self._last_line_end(buf, start, end)

    @staticmethod
    def _last_line_end(buf: bytes, start: int, end: int) -> bytes:
        stop = end - 1 if end > start and buf[end - 1:end] == b"\n" else end
        ls = buf.rfind(b"\n", start, stop) + 1 or start
        return buf[max(ls, stop - 80):stop]

    def _prev_line_end(self, buf: bytes, ls: int) -> bytes:
        """The last bytes of the line before the one starting at `ls` (possibly from an earlier region)."""
        if ls <= self._rs:
            return self._prev_tail
        stop = ls - 1
        p = buf.rfind(b"\n", self._rs, stop) + 1 or self._rs
        return buf[max(p, stop - 80):stop]

    def _scan_matches(self, buf: bytes, start: int, end: int, first_line: int, fatal: list[Evidence], *,
                      count_lines: bool) -> int:
        line_no = first_line
        counted = start
        skip_until = -1
        for mend in _PREFILTER.ends(buf, start, end):
            s = mend - 1  # a byte of the match: keywords hold no newline, so its line is the match's line
            if s < skip_until:
                continue
            if count_lines:
                line_no += buf.count(b"\n", counted, s)
                counted = s
            ls = buf.rfind(b"\n", start, s) + 1 or start
            le = buf.find(b"\n", s, end)
            if le < 0:
                le = end
            if le - ls > WINDOW:
                ws = max(ls, s - 2048)
                we = min(le, s + 16 * 1024)
            else:
                ws, we = ls, le
            self._handle_window(buf, ws, we, ls, line_no, fatal)
            skip_until = we
            if count_lines and line_no in self._tb_at.values():  # a traceback frame: its exception may follow
                skip_until = max(skip_until, self._exception_after_frame(buf, le, end, line_no, fatal))
        if not count_lines:
            return 0
        return (line_no - first_line) + buf.count(b"\n", counted, end)

    def _exception_after_frame(self, buf: bytes, le: int, end: int, line_no: int, fatal: list[Evidence]) -> int:
        """Read the exception line that ends a traceback although it holds no keyword: a class without an
        Error or Exception suffix (psutil.NoSuchProcess). It is the first unindented line within TB_GAP
        lines of the last frame (the frame's code and caret lines come between, indented); a line with
        a keyword stops the look (the main loop reads it, in order). Returns where the line read ends."""
        ls = le + 1
        for k in range(1, TB_GAP + 1):
            if ls >= end:
                break
            e = buf.find(b"\n", ls, end)
            e = end if e < 0 else e
            line = buf[ls:e]
            if e - ls > SHAPE_LINE or _PIECE_FILTER.search(line) or b"\r" in line:
                break
            text = line.decode("utf-8", "replace")
            if "\x1b" in text:
                text = ANSI_RE.sub("", text)
            seg = split_prefix(text, self._prefixes)
            at = text.find(seg.text) if seg.text else -1
            indented = at > 0 and (text[:at].endswith("  ") or text[:at].endswith("\t"))
            if at >= 0 and not indented and exception_class(seg.text) is not None:
                self._handle_window(buf, ls, e, ls, line_no + k, fatal)
                return e
            ls = e + 1
        return -1

    def _handle_window(self, buf: bytes, ws: int, we: int, ls: int, line_no: int, fatal: list[Evidence]) -> None:
        if self._line_key[0] != line_no:
            self._line_key = (line_no, set())
        window = buf[ws:we]
        shape = None
        if we - ws <= SHAPE_LINE and ws == ls:
            shape = window.translate(None, _DIGITS)
            if shape in self._shapes and line_no > self._exc_until and not any(
                    line_no - at <= TB_GAP for at in self._tb_at.values()):
                self._skipped[shape] = (line_no, window)  # its "latest" finding is read if asked for
                return
        self._cacheable = shape is not None
        self._window_inner(window, buf, ls, line_no, fatal)
        if self._cacheable and shape is not None:
            if len(self._shapes) >= SHAPES:
                self._shapes.clear()
                self._replay_skipped()
            self._shapes.add(shape)

    def _window_inner(self, window: bytes, buf: bytes, ls: int, line_no: int, fatal: list[Evidence]) -> None:
        pieces = window.split(b"\r") if b"\r" in window else (window,)
        for piece in pieces:
            # Only the \r-pieces that hold a keyword are decoded (tqdm redraws are not).
            if len(pieces) > 1 and not _PIECE_FILTER.search(piece):
                continue
            text = piece.decode("utf-8", "replace")
            if "\x1b" in text:
                text = ANSI_RE.sub("", text)
                if len(pieces) > 1 and not _PIECE_FILTER.search(text.encode()):
                    continue
            if text:
                try:
                    self._handle_segment(text, line_no, buf, ls, fatal)
                except Exception:  # noqa: BLE001 - one odd line must not stop the scan
                    self.internal_errors += 1
