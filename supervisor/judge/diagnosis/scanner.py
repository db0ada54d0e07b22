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
from supervisor.judge.diagnosis import rules
from supervisor.judge.diagnosis.conclude import conclude
from supervisor.judge.diagnosis.families.gpu_memory import _PINNED_RE
from supervisor.judge.diagnosis.fastre import LiteralScanner, compile_search
from supervisor.judge.diagnosis.findings import Finding, ScanState
from supervisor.judge.diagnosis.prefixes import PrefixModel
from supervisor.judge.diagnosis.rules import (
    ANSI_RE,
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

LONG_LINE = 1 << 20  # bytes of one line held before it is scanned in blocks
OVERLAP = 4096  # bytes re-scanned between blocks of a long line
WINDOW = 64 * 1024  # a candidate line longer than this is read around the hit only
TAIL_LINE_CHARS = 2000
EVIDENCE_CHARS = 2000
MAX_FRAMES = 64
MAX_WATCH = 32
TAIL_PENDING_BYTES = 8 << 20  # bytes of recent chunks kept by reference for the lazy tail
TB_GAP = 6  # lines from a traceback's last frame to the exception line ending it (code, carets)
EXC_MESSAGE_LINES = 8  # lines after a closing exception that still belong to its message
SAMPLE_MAX_BYTES = 4 << 20  # a printed sample block longer than this is ended by force
SHAPES = 4096  # remembered shapes of lines that can no longer change the verdict
SHAPE_LINE = 1024  # longer candidate lines are always read
_DIGITS = b"0123456789"
_LOGGED = b"{'loss': "
NUMERIC_RUN = 3  # consecutive logged steps with a non-finite or exactly-zero loss that stop the attempt
CALIBRATION_STEPS = 20  # fp16 loss-scale calibration overflows at the start of a run are normal
OVERFLOW_STORM = (10, 12)  # 10 overflows within 12 steps after calibration: nearly every step skipped
# The trainer's logged dicts: {'loss': nan, 'grad_norm': inf, 'learning_rate': 1e-05, 'epoch': 0.1}
_LOGGED_LOSS_RE = re.compile(r"""^\{['"]loss['"]:\s*(?:np\.float\d+\()?([-+\w.]+)""")
_LOGGED_GRAD_RE = re.compile(r"""['"]grad_norm['"]:\s*(?:np\.float\d+\()?(?:tensor\()?([-+\w.]+)""")

# LLaMA-Factory prints a tokenised training example at start-up (print_data_example):
#   "training example:" / "eval example:", then "input_ids:\n[...]", "inputs:\n<decoded text>",
#   "label_ids:\n[...]", "labels:\n<decoded text>" (chosen_/rejected_ for pairwise data).
# The decoded text is the user's data: never evidence. The block ends at the next line that
# LLaMA-Factory's or transformers' logger writes ("[INFO|...", "[WARNING|...").
_SAMPLE_HEADER_RE = re.compile(
    rb"(?:\[(?:rank|default)\d+\]: ?)?(?:(?:training|eval) example:|(?:chosen_|rejected_)?input_ids:)[ \t]*\r?\n")
# It also ends at a tqdm bar at a line start (tqdm writes every refresh as "\r" + bar; printed
# text does not start a line with "\r"): the program went on to run.
_LEVELS = rb"(?:INFO|WARNING|ERROR|DEBUG|CRITICAL)"
_SAMPLE_END_RE = re.compile(
    rb"(?m)^(?:\[(?:rank|default)\d+\]: ?)?(?:\[" + _LEVELS + rb"\||\r[^\n]{0,100}?\d{1,3}%\|)")
# Other logger formats and a traceback at a line start end a block PROVISIONALLY: the block's decoded
# text may itself hold them (a dataset of logs). The lines from there on are held back, unread, until
# the program's own output confirms the end (a definite end line, the end of the log, HOLD_MAX_*) or the
# sample shows it went on (a section header, an end-of-sequence token): held lines are then read
# (late: never a live teardown), or skipped as sample text.
_SAMPLE_SOFT_END_RE = re.compile(
    rb"(?m)^(?:\[(?:rank|default)\d+\]: ?)?(?:Traceback \(most recent call last\):"
    rb"|\[\d{4}-\d\d-\d\d[ T][\d:.,]+\]\s*\[" + _LEVELS + rb"\]"
    rb"|" + _LEVELS + rb"\s+\d\d-\d\d\s+\d\d:\d\d:\d\d"
    rb"|\d{4}-\d\d-\d\d[ T][\d:.,]+\s*[-|]?\s*" + _LEVELS + rb"\b"
    rb"|" + _LEVELS + rb":[\w.]+:"
    rb"|[^\n]{0,100}?\d{1,3}%\|)")
_SAMPLE_RESUME_RE = re.compile(
    rb"(?m)^(?:(?:chosen_|rejected_)?(?:inputs|label_ids|labels|input_ids):[ \t]*\r?$"
    rb"|(?:training|eval) example:"
    rb"|.*(?:<\|[A-Za-z0-9_]+\|>|</s>|<eos>|<end_of_turn>)[ \t]*\r?$)")
HOLD_MAX_LINES = 400
HOLD_MAX_BYTES = 1 << 20
# With a quieter logger (LLAMAFACTORY_VERBOSITY=WARN) no such line may follow: the block then also
# ends after its last section ("labels:", pairwise "rejected_labels:"), whose decoded text is the
# training target and ends with the tokenizer's end-of-sequence token.
_SAMPLE_FINAL_RE = re.compile(rb"(?m)^(?:rejected_)?labels:[ \t]*\r?$")
_SAMPLE_EOS_RE = re.compile(rb"(?m)(?:<\|[A-Za-z0-9_]+\|>|</s>|<eos>|<end_of_turn>)[ \t]*\r?$")

_KEYWORDS = list(dict.fromkeys(rules.KEYWORDS))
# A keyword that contains another one adds nothing to the alternation.
_PREFILTER_PATTERN = b"|".join(
    re.escape(k.encode()) for k in _KEYWORDS if not any(o != k and o in k for o in _KEYWORDS)
)
_BAR_RE = re.compile(rb"%\|[^|\r\n]{0,200}\|\s*(\d+)/(\d+) \[")
_MARKER_GATE = compile_search(
    r"Loading checkpoint shards|loading weights file|\*\*\*\*\*|Saving model checkpoint|Loading model from"
    r"|Continuing training|Resuming training|optimization steps|checkpoint-|skipped=|batch size of|OVERFLOW|local_rank"
    r"|is ready now|Deleting older checkpoint|Gradient overflow|Loading weights|Load checkpoint|Loading checkpoint from"
    r"|zero partition checkpoints|zero checkpoints|loading model tensors|etrying|falling back"
)
# A tqdm bar left without a newline, glued in front of the text that followed it.
_BAR_PREFIX_RE = re.compile(r"^[^|\n]{0,120}\d+%\|[^|]{0,200}\|[^\]]{0,200}\]")


# The end of a line that a second process split from its ": message" line.
_TRAILING_EXC_RE = re.compile(r"((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception))\s*$")
# PyTorch's NCCL watchdog thread ending with an exception (C++; no Python traceback).
_WATCHDOG_EXC_RE = re.compile(r"[Ww]atchdog thread terminated with exception:")
# A runtime that says it aborts the process: ROCr's queue callback, HSA's memory access fault.
_RUNTIME_ABORT_RE = re.compile(r"Queue 0x[0-9a-f]+ aborting with error|Memory access fault by GPU node-?\d+")
# An exception raised while the arguments were parsed or validated is a configuration error.
_RETRY_RE = re.compile(r"\b[Rr]etrying (?:with|without)\b|\bfalling back (?:to|on)\b")
RETRY_WINDOW = 8
_CONFIG_FRAME_RE = re.compile(r"llamafactory/hparams/|transformers/hf_argparser\.py|transformers/training_args\.py")

_PREFILTER = LiteralScanner([k.encode() for k in _KEYWORDS if not any(o != k and o in k for o in _KEYWORDS)])
_PIECE_FILTER = compile_search(_PREFILTER_PATTERN)  # one short \r-piece at a time
PREFILTER_ENGINE = _PREFILTER.engine


def _digits_before(buf: bytes, end: int, floor: int = 0) -> int | None:
    i = end
    while i > floor and end - i < 12 and 48 <= buf[i - 1] <= 57:
        i -= 1
    return int(buf[i:end]) if i < end else None


def _bad_value(v: str, *, zero_is_bad: bool) -> str | None:
    """"nan"/"inf" for a non-finite logged number, "0.0" for an exact zero loss; None when fine."""
    v = v.strip().lower().rstrip(")")
    if v in ("nan", "-nan") or v.endswith("nan"):
        return "nan"
    if v.lstrip("+-") in ("inf", "infinity"):
        return "inf"
    if zero_is_bad:
        try:
            if float(v) == 0.0:
                return "0.0"
        except ValueError:
            return None
    return None


def _last_segment(line: bytes) -> str:
    """The text a terminal would show for a line: what follows its last `\\r`."""
    if b"\r" in line:
        parts = [p for p in line.split(b"\r") if p.strip()]
        line = parts[-1] if parts else b""
    text = line[-TAIL_LINE_CHARS * 2 :].decode("utf-8", "replace")
    if "\x1b" in text:
        text = ANSI_RE.sub("", text)
    return text[-TAIL_LINE_CHARS:]


class LogScanner:
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
        self._cxx_at: dict[int | None, int] = {}  # rank -> line of "terminate called after throwing"
        self._last_tb_phase: dict[int | None, tuple[int, Phase]] = {}  # rank -> (line, phase) of its last exception
        self._prev_tail = b""  # the end of the last line read (a split "ValueError" / ": message" pair)
        self._hold: list[bytes] | None = None  # lines held after a traceback ended a sample block
        self._hold_lines = 0
        self._hold_bytes = 0
        self._last_advance_line = 0
        self._sample_lines: deque[tuple[int, int]] = deque(maxlen=32)  # line ranges of printed samples
        self._scale_run: tuple[int, float, int, int] | None = None

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
        if self._numeric_run:  # a logged step after the last bad one (healthy: not a candidate) ends the run
            last = self._last_bad
            after = last[1] + 1 if last is not None and last[0] == self._region else start
            if buf.find(_LOGGED, after, end) >= 0:
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
        if not count_lines:
            return 0
        return (line_no - first_line) + buf.count(b"\n", counted, end)

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

    # ------------------------------------------------------------- line level
    def _handle_segment(self, raw: str, line_no: int, buf: bytes, ls: int, fatal: list[Evidence]) -> None:
        seg = split_prefix(raw, self._prefixes)
        t = seg.text
        if self._replaying:  # a skipped line of a known shape: only its findings (as the latest), no state
            for hit in classify(seg):
                self._record(hit, seg, line_no, buf, ls, [], "")
            return
        if 'File "' in t or "Traceback" in t or (t.startswith("{") and "loss" in t) or _MARKER_GATE.search(t):
            self._cacheable = False
        if 'File "' in t:
            fm = FRAME_RE.search(t)
            if fm:
                if seg.rank not in self._tb_at and not (seg.rank is not None and None in self._tb_at):
                    # A frame with no traceback open: its header was cut (a pasted or rotated log).
                    self._open_traceback(seg.rank, line_no, cut=True)
                frames = self._frames.setdefault(seg.rank, deque(maxlen=MAX_FRAMES))
                frames.append((fm.group("func"), fm.group("path")))
                if fm.group("func") in FRAME_PHASES:  # kept beyond MAX_FRAMES: outer frames say the phase
                    self._tb_phases.setdefault(seg.rank, set()).add(FRAME_PHASES[fm.group("func")])
                if seg.rank in self._tb_at:
                    self._tb_at[seg.rank] = line_no
                elif None in self._tb_at:
                    self._tb_at[None] = line_no
                if "/rocm" in fm.group("path") or "hip" in fm.group("path").rsplit("/", 1)[-1]:
                    self._hip = True
                return
        if "Traceback (most recent call last)" in t:
            i = t.find("Traceback (most recent call last)")
            if i > 0 and "%|" not in t[:i]:
                self._prefixes.learn(t[:i])  # this stream's prefix: read its next lines past it
                seg = split_prefix(raw, self._prefixes)
            self._open_traceback(seg.rank, line_no, cut=False)
            return
        if "above exception" in t and ("During handling of the above exception" in t
                                       or "The above exception was the direct cause" in t):
            self._chain_mark[seg.rank] = line_no
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
        # An exception line closes that rank's traceback (or the unprefixed one it used).
        if seg.exc is not None and self._frames.pop(seg.rank, None) is None and seg.rank is not None:
            self._frames.pop(None, None)
        if seg.exc is not None and self._tb_phases.pop(seg.rank, None) is None and seg.rank is not None:
            self._tb_phases.pop(None, None)

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
            if buf.find(_LOGGED, after, ls) >= 0:
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
        if "OVERFLOW" in t or "Gradient overflow" in t:
            m = rules.LOSS_SCALE_RE.search(t) or rules.GRAD_OVERFLOW_RE.search(t)
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
        if m.re is rules.LOSS_SCALE_RE:
            attempted, new = float(m.group(1)), float(m.group(2)) if m.group(2) else float(m.group(1))
        else:
            attempted, new = None, float(m.group(1))
        run = self._scale_run
        if run is not None and ((attempted is not None and attempted == run[1])
                                or (attempted is None and new < run[1])):
            self._scale_run = (run[0] + 1, new, run[2], line_no)
        else:
            self._scale_run = (1, new, line_no, line_no)

    def _record(self, hit: Hit, seg: Segment, line_no: int, buf: bytes, ls: int, fatal: list[Evidence],
                form: str = "") -> None:
        """Keep a hit as a finding. `form` says how the line stands (see _structural): any form is
        decisive for the verdict; only an exception ending a traceback with its header is fatal live."""
        structural = bool(form)
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
        notes: list[str] = []
        if frames:
            paths = " ".join(p for _, p in frames)
            funcs = " ".join(f for f, _ in frames)
            if hit.rule == "driver_oom" and _PINNED_RE.search(funcs + " " + paths):
                hit = Hit("pinned_host_oom", Category.HOST_OOM, hit.tier, "pinned", fatal=True, vendor="cpu", exc=hit.exc)
            if hit.rule == "python_exception" and structural and _CONFIG_FRAME_RE.search(frames[-1][1]):
                # Raised while the arguments were parsed or validated (LLaMA-Factory's parser, HfArgumentParser).
                hit = Hit("invalid_arguments", Category.CONFIG_ERROR, rules.ROOT, "invalid_arguments", exc=hit.exc)
            if "deepspeed/runtime/zero" in paths or "deepspeed/runtime/swap_tensor" in paths:
                if "partition_parameters" in paths or "all_gather" in funcs or "fetch_sub_module" in funcs:
                    notes.append("inside DeepSpeed ZeRO-3 parameter gather")
                elif "swap_tensor" in paths or "offload" in funcs or "pin_memory" in funcs or hit.subkind == "pinned":
                    notes.append("inside DeepSpeed ZeRO offload")
                else:
                    notes.append("inside DeepSpeed ZeRO")
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
        if self._last_step is None or step > self._last_step:
            self._last_advance_line = max(self._last_advance_line, line)
        self._bump_step(step)
        self._last_bar_line = max(self._last_bar_line, line)
        for w in self._watch:
            # No step known at the OOM (the bar's total not seen yet) counts as "before step 0":
            # whether the total was learnt from this chunk or a later one must not change the answer.
            if not w.recovered and line > w.line_no and (w.step_before is None or step > w.step_before):
                w.recovered = True
                w.notes.append(f"training continued to step {step} afterwards")

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
