"""LogScanner: reads one attempt's log incrementally, in bounded memory.

Design, so that a 1 GB log costs about a third of `grep -E` on it:
  - Bytes, never decoded wholesale. Each chunk is cut at its last newline; the
    rest waits for the next chunk (a line longer than LONG_LINE is scanned in
    fixed blocks counted from the line start, so results do not depend on how
    the stream was chunked).
  - One prefilter pass over the complete lines: a literal alternation of the
    rule keywords (`rules.KEYWORDS`), run by RE2 when `google-re2` is
    installed (a DFA, ~0.5 GB/s) and by `re` otherwise (same answers, slower).
    Only lines it hits are decoded (errors="replace"), stripped of ANSI codes,
    split on `\\r`, and classified.
  - Line numbers count `\\n` only (so they match `grep -n` and editors).
  - Training progress from tqdm bars is read by `rfind` of the bar's
    `/<total> [` text, once per chunk, not per line.
  - Kept state is capped: `max_evidence_per_rule` findings per rule (the
    earliest, plus the latest), `tail_lines` tail lines of at most
    TAIL_LINE_CHARS each, 64 traceback frames per rank.
"""

from __future__ import annotations

import re
from collections import deque

from supervisor.core.models import Category, Diagnosis, Evidence, ExitRecord, HostEvidence, Phase
from supervisor.judge.diagnosis import kernel, rules, scan_rich
from supervisor.judge.diagnosis.conclude import conclude
from supervisor.judge.diagnosis.families import checks, numeric
from supervisor.judge.diagnosis.families.comm import store_frame
from supervisor.judge.diagnosis.families.environment import network_frame
from supervisor.judge.diagnosis.families.gpu_memory import _PINNED_RE
from supervisor.judge.diagnosis.findings import Finding, ScanState
from supervisor.judge.diagnosis.prefixes import MAX_PREFIX, PrefixModel
from supervisor.judge.diagnosis.rules import (
    CONTEXT_MARKERS,
    FRAME_PHASES,
    FRAME_RE,
    HINT,
    PHASE_PRECEDENCE,
    Hit,
    Segment,
    classify,
    split_prefix,
)
from supervisor.judge.diagnosis.scan_patterns import (
    _BAR_PREFIX_RE,
    _CONFIG_FRAME_RE,
    _MARKER_GATE,
    _RETRY_RE,
    _RUNTIME_ABORT_RE,
    _TRAILING_EXC_RE,
    _WATCHDOG_EXC_RE,
    CALIBRATION_STEPS,
    CHAIN_GAP,
    EVIDENCE_CHARS,
    EXC_MESSAGE_LINES,
    LONG_LINE,
    MAX_FRAMES,
    MAX_WATCH,
    NUMERIC_RUN,
    OVERFLOW_STORM,
    OVERLAP,
    RETRY_WINDOW,
    TB_GAP,
)
from supervisor.judge.diagnosis.scan_progress import ProgressReading
from supervisor.judge.diagnosis.scan_stream import StreamReading


class LogScanner(StreamReading, ProgressReading):
    """Incremental, bounded-memory reader of one attempt's combined stdout/stderr log."""

    def __init__(self, *, max_evidence_per_rule: int = 5, tail_lines: int = 200,
                 initial_step: int | None = None):
        """`initial_step`: the step a resumed attempt starts from (its bar first shows 0)."""
        self.max_evidence_per_rule = max(1, max_evidence_per_rule)
        self.tail_lines = max(1, tail_lines)
        self._lines = 0
        self._partial = b""
        self._line_key: tuple[int, set[str]] = (0, set())  # dedupe rules on the current line
        self._kept: dict[str, list[Finding]] = {}
        self._latest: dict[str, Finding] = {}
        self._seq = 0
        self._frames: dict[int | None, deque[tuple[str, str]]] = {}
        self._context: tuple[Phase, int] | None = None
        self._total: int | None = None
        self._needle: bytes | None = None
        self._last_step: int | None = initial_step
        self._last_bar_line = 0
        self._watch: list[Finding] = []
        self._hip = False
        self._cuda = False
        self._tail: deque[tuple[int, str]] = deque(maxlen=self.tail_lines)
        self._tail_pending: list[tuple[bytes, int, int, int, int]] = []
        self._rs = 0  # start of the buffer region being read (bounds backward searches)
        self._torchrun_rank: int | None = None
        self._nan_assert: tuple[int | None, int] | None = None  # (rank, line) of `assert not isnan(...)` code
        self._check_code: tuple[int | None, int, str] | None = None  # (rank, line, kind) of `assert args.x ...`
        self._min_scale_overflows = 0
        self._flushed = False
        self._tb_phases: dict[int | None, set[Phase]] = {}  # phases named by ANY frame of the open traceback
        self._context_step: int | None = None  # the step a checkpoint-save marker named
        self._tb_at: dict[int | None, int] = {}  # rank -> line of its open traceback's last frame
        self._exc_at: dict[int | None, int] = {}  # rank -> line of the exception that closed its traceback
        self._exc_form: dict[int | None, str] = {}  # rank -> "traceback" or "cut" for that exception
        self._sample_bytes: int | None = None  # bytes read of the open printed-sample block, if any
        self._sample_final = False  # the open block's last section (labels) has begun
        self.samples_skipped = 0  # printed sample blocks ignored
        self.internal_errors = 0  # lines the scanner failed on (skipped; never raised to the caller)
        self._numeric_run: list[tuple[int, str, str]] = []  # (line, text, what) of consecutive bad logged steps
        self._numeric_fired = False
        self._overflow_steps: deque[int] = deque(maxlen=OVERFLOW_STORM[0])  # steps of recent late overflows
        self._overflow_storm = False
        self._progress_from: tuple[int, int] | None = None  # (region, offset) where the total became known
        self._region = 0  # count of regions read, to place the last bad logged step
        self._last_bad: tuple[int, int] | None = None  # (region, offset) of the last bad logged step
        # Shapes (digits removed) of candidate lines that matched only rules whose evidence is
        # already full, outside any traceback: the same shape again is skipped without decoding,
        # so a keyword flood ("[rank0]: Error: sample 123 skipped" x 10^6) costs a dict lookup a line.
        self._shapes: set[bytes] = set()
        self._cacheable = False
        self._exc_until = 0  # last line that may still belong to a closing exception's message
        self._skipped: dict[bytes, tuple[int, bytes]] = {}  # shape -> its latest skipped line, read at state()
        self._replaying = False
        self._prefixes = PrefixModel()  # line prefixes learned from traceback headers
        self._cut: set[int | None] = set()  # ranks whose open traceback began without its header
        self._chain: dict[int | None, int] = {}  # rank -> chain id of its open/last traceback
        self._chain_mark: dict[int | None, int] = {}  # rank -> line of "During handling of the above exception"
        self._chains = 0
        self._loose: tuple[int | None, int, Segment] | None = None  # last exception line read as text
        self._cxx_at: dict[int | None, int] = {}  # rank -> line of "terminate called after throwing"
        self._last_tb_phase: dict[int | None, tuple[int, Phase]] = {}  # rank -> (line, phase) of its last exception
        self._prev_tail = b""  # the end of the last line read (a split "ValueError" / ": message" pair)
        self._hold: list[bytes] | None = None  # lines held after a traceback ended a sample block
        self._hold_lines = 0
        self._hold_bytes = 0
        self._last_advance_line = 0
        self._sample_lines: deque[tuple[int, int]] = deque(maxlen=32)  # line ranges of printed samples
        self._scale_run: tuple[int, float, int, int] | None = None
        self._rich: dict[int | None, tuple[int, int]] = {}  # rank -> (region, offset) of its open rich box
        self._rich_body: dict[int | None, bytearray | None] = {}  # rank -> that box's bytes from earlier reads

    # ------------------------------------------------------------------ API
    @property
    def last_step(self) -> int | None:
        """Highest training step seen (tqdm `N/M` bars, DeepSpeed `step=N`, `checkpoint-N` saves)."""
        return self._last_step

    @property
    def total_steps(self) -> int | None:
        """The `M` of the progress bar's `N/M`, once seen."""
        return self._total

    @property
    def lines_seen(self) -> int:
        return self._lines

    def feed(self, chunk: bytes) -> list[Evidence]:
        """Feed bytes as appended to the log; returns NEW fatal evidence (structural only).

        Never raises on any log content: a line the scanner fails on is skipped and counted in
        `internal_errors` (the daemon must keep control of the training whatever it prints).
        """
        if self._flushed:
            raise RuntimeError("LogScanner.feed() after finish()")
        if not chunk:
            return []
        fatal: list[Evidence] = []
        try:
            self._feed(bytes(chunk), fatal)
        except Exception:  # noqa: BLE001 - a scanner bug must not cost the daemon its training
            self.internal_errors += 1
            self._partial = b""
        return fatal

    def _feed(self, chunk: bytes, fatal: list[Evidence]) -> list[Evidence]:
        start = 0
        if self._partial:
            # Complete the pending line first; the rest of the chunk is then read in place (no copy).
            i = chunk.find(b"\n")
            if i < 0:
                data = self._partial + chunk
                self._partial = data[self._consume_long_line(data, 0, fatal) :]
                return fatal
            head = self._partial + chunk[: i + 1]
            self._partial = b""
            hs = self._consume_long_line(head, 0, fatal)
            self._scan_region(head, hs, len(head), fatal)
            start = i + 1
        start = self._consume_long_line(chunk, start, fatal)
        nl = chunk.rfind(b"\n", start)
        if nl < 0:
            self._partial = chunk[start:]
            return fatal
        self._scan_region(chunk, start, nl + 1, fatal)
        self._partial = chunk[nl + 1 :]
        if len(self._partial) >= LONG_LINE + OVERLAP:
            self._partial = self._partial[self._consume_long_line(self._partial, 0, fatal) :]
        return fatal

    def finish(self, exit: ExitRecord | None = None, host: HostEvidence | None = None) -> Diagnosis:
        """Flush the partial line and conclude (see conclude.py). Callable on a bare excerpt, and repeatedly."""
        if not self._flushed:
            if self._hold is not None:  # the log ended: what followed the sample is the program's
                try:
                    self._release_hold()
                except Exception:  # noqa: BLE001 - see feed()
                    self.internal_errors += 1
            if self._partial:
                data, self._partial = self._partial + b"\n", b""
                try:
                    self._scan_region(data, 0, len(data), [])
                except Exception:  # noqa: BLE001 - see feed()
                    self.internal_errors += 1
            self._flushed = True
        return conclude(self.state(), exit, host)

    def _replay_skipped(self) -> None:
        """Read the latest line of each skipped shape, so every rule's latest finding is exact."""
        pending, self._skipped = self._skipped, {}
        self._replaying = True
        try:
            for line_no, window in sorted(pending.values(), key=lambda p: p[0]):
                self._line_key = (line_no, set())
                self._window_inner(window, window, 0, line_no, [])
        except Exception:  # noqa: BLE001 - see feed()
            self.internal_errors += 1
        finally:
            self._replaying = False

    def state(self) -> ScanState:
        self._replay_skipped()
        self._materialize_tail()
        findings: dict[int, Finding] = {}
        for kept in self._kept.values():
            for f in kept:
                findings[f.seq] = f
        for f in self._latest.values():
            findings[f.seq] = f
        ordered = sorted(findings.values(), key=lambda f: (f.line_no, f.seq))
        return ScanState(
            findings=ordered,
            lines_seen=self._lines,
            last_step=self._last_step,
            total_steps=self._total,
            hip=self._hip,
            cuda=self._cuda,
            tail=list(self._tail),
            context_phase=self._context_phase_now(),
            min_loss_scale_overflows=self._min_scale_overflows,
            internal_errors=self.internal_errors,
            samples_skipped=self.samples_skipped,
            prefixes=self._prefixes.patterns,
            sample_lines=tuple(self._sample_lines),
            last_advance_line=self._last_advance_line,
            scale_run=self._scale_run,
        )

    # ------------------------------------------------------------ bytes level

    # ------------------------------------------------------------- line level
    def _handle_segment(self, raw: str, line_no: int, buf: bytes, ls: int, fatal: list[Evidence]) -> None:
        seg = split_prefix(raw, self._prefixes)
        t = seg.text
        if self._replaying:  # a skipped line of a known shape: only its findings (as the latest), no state
            for hit in classify(seg):
                self._record(hit, seg, line_no, buf, ls, [], "")
            return
        if ('File "' in t or "Traceback" in t or (t.startswith("{") and "loss" in t) or _MARKER_GATE.search(t)
                or t.startswith(scan_rich.RICH_BOTTOM)):
            self._cacheable = False
        if 'File "' in t and t.find('File "') <= MAX_PREFIX:
            fm = FRAME_RE.search(t)
            if fm:
                self._note_frame(seg.rank, fm.group("func"), fm.group("path"), line_no)
                return
        # A header or frame far into a line (a paste whose newlines were lost) is text: the line is read on.
        if "Traceback (most recent call last)" in t and t.find("Traceback (most recent call last)") <= MAX_PREFIX:
            i = t.find("Traceback (most recent call last)")
            rich = scan_rich.is_rich_header(t, i)
            if i > 0 and "%|" not in t[:i] and not rich:
                self._prefixes.learn(t[:i])  # this stream's prefix: read its next lines past it
                seg = split_prefix(raw, self._prefixes)
            self._open_traceback(seg.rank, line_no, cut=False)
            if rich:
                self._rich[seg.rank] = (self._region, ls)
                self._rich_body[seg.rank] = bytearray()
            return
        if t.startswith(scan_rich.RICH_BOTTOM) and self._rich and scan_rich.is_box_bottom(t):
            self._close_rich(seg.rank, line_no, buf, ls)
            return
        if "above exception" in t and t.find("above exception") <= MAX_PREFIX + 20 and (
                "During handling of the above exception" in t or "The above exception was the direct cause" in t):
            self._chain_mark[seg.rank] = line_no
            self._confirm_loose(seg.rank, line_no, buf, ls)
            return
        if "terminate called after throwing" in t:
            self._cxx_at[seg.rank] = line_no
        if seg.exc is None and t.startswith(": ") and not self._replaying:
            # Two processes writing one stream split "ValueError" and ": message" onto two lines.
            m = _TRAILING_EXC_RE.search(self._prev_line_end(buf, ls).decode("utf-8", "replace"))
            if m:
                seg = Segment(text=m.group(1) + t, raw=raw, rank=seg.rank, exc=m.group(1), exc_msg=t[2:])
                t = seg.text
        if not self._hip and rules.HIP_RE.search(raw):
            self._hip = True
        if not self._cuda and rules.CUDA_RE.search(raw):
            self._cuda = True
        self._track_markers(t, line_no, buf, ls)
        if t.startswith("{") and "loss" in t:
            self._track_logged_step(t, seg, line_no, buf, ls, fatal)
        if self._overflow_storm and not self._numeric_fired:
            self._numeric_fired = True
            self._record(Hit("numeric_run", Category.NUMERIC, rules.ROOT, "repeated_overflow", fatal=True),
                         seg, line_no, buf, ls, fatal, "traceback")
            first, last = self._overflow_steps[0], self._overflow_steps[-1]
            self._latest["numeric_run"].notes.append(
                f"{len(self._overflow_steps)} gradient overflows (skipped steps) between steps {first} and {last},"
                f" after the first {CALIBRATION_STEPS} steps of loss-scale calibration")
        if self._min_scale_overflows == NUMERIC_RUN and not self._numeric_fired:
            # fp16 loss scale at its minimum and still overflowing: every step is skipped from now on.
            # (Early calibration halves it from 65536 by a few steps; it does not reach 1.)
            self._numeric_fired = True
            self._record(Hit("numeric_run", Category.NUMERIC, rules.ROOT, "loss_scale_at_minimum", fatal=True),
                         seg, line_no, buf, ls, fatal, "traceback")
            self._latest["numeric_run"].notes.append(f"{NUMERIC_RUN} gradient overflows at the minimum loss scale")
        form = self._structural(seg, line_no)
        for hit in classify(seg):
            self._record(hit, seg, line_no, buf, ls, fatal, form)
        if seg.exc is not None:
            self._close_exception(seg, line_no, form)

    def _close_exception(self, seg: Segment, line_no: int, form: str) -> None:
        """An exception line closes that rank's traceback (or the unprefixed one it used). One read as
        text is kept: a chain marker right after it shows it ended a traceback whose frames were cut."""
        if self._frames.pop(seg.rank, None) is None and seg.rank is not None:
            self._frames.pop(None, None)
        if self._tb_phases.pop(seg.rank, None) is None and seg.rank is not None:
            self._tb_phases.pop(None, None)
        if not form:
            self._loose = (seg.rank, line_no, seg)

    def _confirm_loose(self, rank: int | None, line_no: int, buf: bytes, ls: int) -> None:
        """CPython prints "During handling of the above exception" / "The above exception was the direct
        cause" only after a whole traceback: the exception line just above it (its blank line and at most
        one message line between) ended one, even when the paste kept none of its frames. Its findings
        are read again as a cut traceback's, the first link of the chain that follows."""
        loose, self._loose = self._loose, None
        if loose is None or loose[0] != rank or not 0 < line_no - loose[1] <= CHAIN_GAP:
            return
        self._chains += 1
        self._chain[rank] = self._chains
        for hit in classify(loose[2]):
            self._record(hit, loose[2], loose[1], buf, ls, [], "cut")

    def _note_frame(self, rank: int | None, func: str, path: str, line_no: int) -> None:
        """A traceback's `File "...", line N, in func` line: kept for the exception that will close it."""
        if rank not in self._tb_at and not (rank is not None and None in self._tb_at):
            # A frame with no traceback open: its header was cut (a pasted or rotated log).
            self._open_traceback(rank, line_no, cut=True)
        frames = self._frames.setdefault(rank, deque(maxlen=MAX_FRAMES))
        frames.append((func, path))
        if func in FRAME_PHASES:  # kept beyond MAX_FRAMES: outer frames say the phase
            self._tb_phases.setdefault(rank, set()).add(FRAME_PHASES[func])
        if rank in self._tb_at:
            self._tb_at[rank] = line_no
        elif None in self._tb_at:
            self._tb_at[None] = line_no
        if "/rocm" in path or "hip" in path.rsplit("/", 1)[-1]:
            self._hip = True

    def _close_rich(self, rank: int | None, line_no: int, buf: bytes, ls: int) -> None:
        """A rich traceback's box ends: its frames are that traceback's, and the exception line after
        the edge closes it (scan_rich.py). The box's bytes from earlier reads were carried along."""
        key = rank if rank in self._rich else (None if None in self._rich else rank)
        opened = self._rich.pop(key, None)
        carried = self._rich_body.pop(key, None)
        if opened is None or key not in self._tb_at:
            return
        begin = opened[1] if opened[0] == self._region else self._rs
        if carried is not None and len(carried) + ls - begin <= scan_rich.MAX_BOX_BYTES:
            frames = self._frames.setdefault(key, deque(maxlen=MAX_FRAMES))
            for func, path in scan_rich.frames((bytes(carried) + buf[begin:ls]).decode("utf-8", "replace")):
                frames.append((func, path))
                if func in FRAME_PHASES:
                    self._tb_phases.setdefault(key, set()).add(FRAME_PHASES[func])
        self._tb_at[key] = line_no

    def _carry_rich(self, buf: bytes, start: int, end: int) -> None:
        """Keep the bytes of an open rich box past the end of this read (bounded): chunking must not
        change which frames its traceback has."""
        for key, (region, off) in self._rich.items():
            body = self._rich_body.get(key)
            if body is None:
                continue
            body += buf[off if region == self._region else start:end]
            if len(body) > scan_rich.MAX_BOX_BYTES:
                self._rich_body[key] = None  # too long for a box: its frames are not read

    def _open_traceback(self, rank: int | None, line_no: int, *, cut: bool) -> None:
        """A traceback begins (its header, or a frame whose header is not in the log)."""
        self._frames.pop(rank, None)
        self._tb_phases.pop(rank, None)
        self._tb_at[rank] = line_no
        self._exc_at.pop(rank, None)
        if cut:
            self._cut.add(rank)
        else:
            self._cut.discard(rank)
        mark = self._chain_mark.pop(rank, None)
        if mark is None or line_no - mark > 3 or rank not in self._chain:
            self._chains += 1
            self._chain[rank] = self._chains


    def _structural(self, seg: Segment, line_no: int) -> str:
        """How this line stands: "traceback" / "cut" (an exception ending a traceback block, or a line of
        that exception's message), "cxx" (a C++ exception's what() after `terminate called`, a watchdog
        thread ending with an exception), "runtime" (a runtime announcing its own abort), "" (text).

        The traceback is the same rank's (a rank-prefixed exception may close an unprefixed one); its
        last frame must be at most TB_GAP lines before (the frame's code and caret lines come between).
        Lines printed like an exception anywhere else are text.
        """
        if seg.exc is not None:
            key = seg.rank if seg.rank in self._tb_at else (None if None in self._tb_at else seg.rank)
            at = self._tb_at.pop(key, None)
            if at is not None and 0 <= line_no - at <= TB_GAP:
                form = "cut" if key in self._cut else "traceback"
                self._cut.discard(key)
                self._exc_at[seg.rank] = line_no
                self._exc_form[seg.rank] = form
                if key != seg.rank and key in self._chain:
                    self._chain[seg.rank] = self._chain[key]
                self._exc_until = max(self._exc_until, line_no + EXC_MESSAGE_LINES)
                self._cacheable = False
                return form
        at = self._exc_at.get(seg.rank)
        rank = seg.rank
        if at is None and seg.rank is not None:
            at, rank = self._exc_at.get(None), None
        if at is not None and 0 < line_no - at <= EXC_MESSAGE_LINES:
            return self._exc_form.get(rank, "traceback")
        t = seg.text
        if t.startswith("what():"):
            at = self._cxx_at.get(seg.rank, self._cxx_at.get(None))
            if at is not None and 0 < line_no - at <= 3:
                return "cxx"
        if "terminated with exception" in t and _WATCHDOG_EXC_RE.search(t):
            return "cxx"
        if ("aborting with error" in t or "Memory access fault by GPU" in t) and _RUNTIME_ABORT_RE.search(t):
            return "runtime"
        if kernel.log_fault(t) is not None:  # the kernel's own device-fault line, pasted from dmesg
            return "runtime"
        if t.startswith("THCudaCheck FAIL "):  # the THC runtime's own check, printed as it raises
            return "runtime"
        return ""

    def _track_markers(self, t: str, line_no: int, buf: bytes, ls: int) -> None:
        if not _MARKER_GATE.search(t):
            return
        for rx, phase in CONTEXT_MARKERS:
            if rx.search(t):
                if not (phase is Phase.TRAIN_STEP and self._context and self._context[0] is Phase.CHECKPOINT_LOAD
                        and self._context[1] > self._bar_line_before(buf, ls, line_no)):
                    self._context = (phase, line_no)
                    m = rules.CHECKPOINT_STEP_RE.search(t) if phase is Phase.CHECKPOINT_SAVE else None
                    self._context_step = int(m.group(1)) if m else None
                break
        if "optimization steps" in t:
            m = rules.TOTAL_STEPS_RE.search(t)
            if m:
                known = self._needle is not None
                self._set_total(int(m.group(1).replace(",", "")))
                if not known:
                    # Bars earlier in this region were drawn before the total was known: had the
                    # log been cut here they would not count, so they do not count now either.
                    self._progress_from = (self._region, ls)
        if "checkpoint-" in t:
            m = rules.CHECKPOINT_STEP_RE.search(t)
            if m:
                self._bump_step(int(m.group(1)))
        if "skipped=" in t:
            m = rules.DS_STEP_RE.search(t)
            if m:
                self._bump_step(int(m.group(1)))
        if "batch size of" in t and rules.RETRY_BATCH_RE.search(t):
            # transformers' auto_find_batch_size restarted the loop: earlier OOMs were handled.
            for w in self._watch:
                if w.line_no < line_no and w.category in (Category.GPU_OOM, Category.HOST_OOM):
                    w.recovered = True
                    w.notes.append(f"the program restarted with a smaller batch at line {line_no}")
        if ("etrying" in t or "falling back" in t) and _RETRY_RE.search(t):
            # The program says it handles the OOM just printed (llama.cpp, vLLM, batch-size finders).
            for w in self._watch:
                if (w.category in (Category.GPU_OOM, Category.HOST_OOM) and not w.recovered
                        and 0 <= line_no - w.line_no <= RETRY_WINDOW):
                    w.recovered = True
                    w.notes.append(f"the program said it retries at line {line_no}")
        if ("OVERFLOW" in t or "verflow detected" in t or "Gradient overflow" in t or "scale overflow!" in t
                or "Reducing dynamic loss scale" in t):
            m = rules.LOSS_SCALE_RE.search(t) or rules.SCALE_REDUCED_RE.search(t) or rules.GRAD_OVERFLOW_RE.search(t)
            if m and float(m.group(1)) <= 1:
                self._min_scale_overflows += 1
            if m:
                self._track_scale_run(m, line_no)
            step = self._step_before(buf, ls)
            if m and step is not None and step > CALIBRATION_STEPS:
                self._overflow_steps.append(step)
                n, within = OVERFLOW_STORM
                if len(self._overflow_steps) == n and self._overflow_steps[-1] - self._overflow_steps[0] <= within:
                    self._overflow_storm = True
        if "local_rank" in t:
            m = rules.TORCHRUN_RANK_RE.search(t)
            if m:
                self._torchrun_rank = int(m.group(1))

    def _track_scale_run(self, m: re.Match[str], line_no: int) -> None:
        """A run of overflows, each lowering the fp16 loss scale from where the previous left it."""
        if m.re is rules.LOSS_SCALE_RE or m.re is rules.SCALE_REDUCED_RE:
            attempted, new = float(m.group(1)), float(m.group(2)) if m.group(2) else float(m.group(1))
        else:
            attempted, new = None, float(m.group(1))
        run = self._scale_run
        if run is not None and ((attempted is not None and attempted == run[1])
                                or (attempted is None and new < run[1])):
            self._scale_run = (run[0] + 1, new, run[2], line_no)
        else:
            self._scale_run = (1, new, line_no, line_no)

    def _reread_by_frames(self, hit: Hit, seg: Segment, line_no: int, structural: bool,
                          frames: list | None) -> tuple[Hit, list[str]]:
        """What the frames above an exception say it is (an argument check, a config check, the
        network, the c10d store, pinned host memory) and where in DeepSpeed it was raised."""
        notes: list[str] = []
        if frames:
            paths = " ".join(p for _, p in frames)
            funcs = " ".join(f for f, _ in frames)
            if hit.rule == "driver_oom" and _PINNED_RE.search(funcs + " " + paths):
                hit = Hit("pinned_host_oom", Category.HOST_OOM, hit.tier, "pinned", fatal=True, vendor="cpu", exc=hit.exc)
            if hit.rule == "python_exception" and structural and (
                    _CONFIG_FRAME_RE.search(frames[-1][1]) or checks.raised_at_config_frame(hit.exc, *frames[-1])):
                # Raised while the arguments were parsed or validated (LLaMA-Factory's parser, HfArgumentParser).
                hit = Hit("invalid_arguments", Category.CONFIG_ERROR, rules.ROOT, "invalid_arguments", exc=hit.exc)
            elif hit.rule == "python_exception" and structural and self._check_code is not None and (
                    checks.raised_by_check_code(hit.exc, self._check_code, seg.rank, line_no, frames[-1][1])):
                hit = Hit("config_check", Category.CONFIG_ERROR, rules.ROOT, "invalid_config", exc=hit.exc)
            elif hit.rule == "python_exception" and structural:
                hit = network_frame(hit.exc, frames[-1][1]) or store_frame(hit.exc, *frames[-1]) or hit
            if "deepspeed/runtime/zero" in paths or "deepspeed/runtime/swap_tensor" in paths:
                if "partition_parameters" in paths or "all_gather" in funcs or "fetch_sub_module" in funcs:
                    notes.append("inside DeepSpeed ZeRO-3 parameter gather")
                elif "swap_tensor" in paths or "offload" in funcs or "pin_memory" in funcs or hit.subkind == "pinned":
                    notes.append("inside DeepSpeed ZeRO offload")
                else:
                    notes.append("inside DeepSpeed ZeRO")
        return hit, notes

    def _phase_of(self, seg: Segment, frames: list | None, form: str, line_no: int, buf: bytes,
                  ls: int) -> Phase | None:
        """The run's phase at a finding: its traceback's frames, else the traceback just before
        (a C++ abort right after it), else the log's context around the line."""
        phase = None
        if seg.exc is not None:
            tb_phases = self._tb_phases.get(seg.rank) or (self._tb_phases.get(None) if seg.rank is not None else None)
            phase = next((p for p in PHASE_PRECEDENCE if tb_phases and p in tb_phases), None)
            if phase is None and frames:
                phase = self._phase_from_frames(frames)
        if seg.exc is not None and phase is not None:
            self._last_tb_phase[seg.rank] = (line_no, phase)
        if phase is None and form:
            # A C++ abort right after a Python traceback of the same process happened where that one did.
            prev = self._last_tb_phase.get(seg.rank) or self._last_tb_phase.get(None)
            if prev is not None and 0 <= line_no - prev[0] <= 10:
                phase = prev[1]
        if phase is None:
            phase = self._context_phase(buf, ls, line_no)
        return phase

    def _record(self, hit: Hit, seg: Segment, line_no: int, buf: bytes, ls: int, fatal: list[Evidence],
                form: str = "") -> None:
        """Keep a hit as a finding. `form` says how the line stands (see _structural): any form is
        decisive for the verdict; only an exception ending a traceback with its header is fatal live."""
        structural = bool(form)
        if hit.rule == "nan_assert_code":  # a traceback's code line: read with the exception under it
            self._nan_assert = (seg.rank, line_no)
            return
        if hit.rule == "config_check_code":
            self._check_code = (seg.rank, line_no, hit.subkind)
            return
        if (hit.rule == "python_exception" and structural and self._nan_assert is not None
                and numeric.raised_by_finite_assert(hit.exc, self._nan_assert, seg.rank, line_no)):
            hit = Hit("nan_detected", Category.NUMERIC, rules.ROOT, "nan_detected", exc=hit.exc)
        seen = self._line_key[1]
        if hit.rule in seen:
            return
        seen.add(hit.rule)
        rank = seg.rank
        if rank is None and hit.rule in ("sigkill", "segfault", "abort", "child_failed"):
            rank = rules.local_rank_of(seg.text)
            if rank is None and "exitcode" in seg.text:
                rank = self._torchrun_rank
        frames = self._frames.get(seg.rank) or (self._frames.get(None) if seg.rank is not None else None)
        hit, notes = self._reread_by_frames(hit, seg, line_no, structural, frames)
        phase = self._phase_of(seg, frames, form, line_no, buf, ls)
        text = _BAR_PREFIX_RE.sub("", seg.raw).strip() or seg.raw.strip()
        if len(text) > EVIDENCE_CHARS:
            text = text[:EVIDENCE_CHARS] + "..."
        self._seq += 1
        chain = None
        if form in ("traceback", "cut") and hit.exc is not None:
            chain = self._chain.get(seg.rank, self._chain.get(None))
        f = Finding(hit=hit, line_no=line_no, text=text, rank=rank, phase=phase, seq=self._seq, notes=notes,
                    structural=structural, chain=chain, form=form)
        if hit.category in (Category.GPU_OOM, Category.HOST_OOM) or form in ("cut", "cxx", "runtime"):
            # Watched: training that advances afterwards shows it was handled (or only printed).
            f.step_before = self._step_before(buf, ls)
            if len(self._watch) >= MAX_WATCH:
                self._watch.pop(0)
            self._watch.append(f)
        kept = self._kept.setdefault(hit.rule, [])
        if len(kept) < self.max_evidence_per_rule:
            kept.append(f)
            self._cacheable = False
        if structural:
            self._cacheable = False
        prev = self._latest.get(hit.rule)
        if prev is None or prev.line_no <= line_no:  # a replayed skipped line is older than a newer finding
            self._latest[hit.rule] = f
        if hit.fatal and hit.tier != HINT and form == "traceback" and not self._replaying:
            fatal.append(f.evidence())

    # ------------------------------------------------------------ progress
