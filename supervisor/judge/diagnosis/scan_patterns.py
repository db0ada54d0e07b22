"""What the scanner looks for at the byte level: its limits, the prefilter over every rule's
keywords, the sample-block and progress-bar shapes, and small helpers on raw bytes."""


from __future__ import annotations

import re

from supervisor.judge.diagnosis import rules
from supervisor.judge.diagnosis.fastre import LiteralScanner, compile_search
from supervisor.judge.diagnosis.rules import (
    ANSI_RE,
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
CHAIN_GAP = 3  # lines from an exception to the chain marker CPython prints after it (blank, a message line)
SAMPLE_MAX_BYTES = 4 << 20  # a printed sample block longer than this is ended by force
SHAPES = 4096  # remembered shapes of lines that can no longer change the verdict
SHAPE_LINE = 1024  # longer candidate lines are always read
_DIGITS = b"0123456789"
_LOGGED = b"{'loss': "
_LOGGED_JSON = b'{"loss": '
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
    r"|is ready now|Deleting older checkpoint|Gradient overflow|verflow detected|scale overflow!|Loading weights|Load checkpoint|Loading checkpoint from"
    r"|Reducing dynamic loss scale"
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
_CONFIG_FRAME_RE = re.compile(r"llamafactory/hparams/|transformers/hf_argparser\.py|transformers/training_args\.py"
                              # a config-driven framework building an object from the user's config dict
                              r"|mmcv/utils/registry\.py|mmengine/registry/build_functions\.py"
                              r"|hydra/_internal/instantiate/"
                              # the frameworks' own checks of their configuration and arguments
                              r"|deepspeed/runtime/config\.py|accelerate/utils/dataclasses\.py"
                              r"|lightning/\S*connectors/accelerator_connector\.py")

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


def healthy_logged_step(buf: bytes, start: int, end: int) -> bool:
    """A logged step dict in buf[start:end] with a finite, non-zero loss and no non-finite grad_norm.
    A bad one that is no candidate (a logger's prefixed copy, `{'loss': 0.0000, ...}`) does not
    end a run of bad steps: only a healthy step does."""
    # a Python dict, or a JSON metrics line
    return any(_healthy_from(buf, start, end, needle) for needle in (_LOGGED, _LOGGED_JSON))


def _healthy_from(buf: bytes, start: int, end: int, needle: bytes) -> bool:
    p = buf.find(needle, start, end)
    while p >= 0:
        nl = buf.find(b"\n", p, min(end, p + 600))
        line = buf[p: nl if nl >= 0 else min(end, p + 600)].decode("utf-8", "replace")
        m = _LOGGED_LOSS_RE.match(line)
        g = _LOGGED_GRAD_RE.search(line)
        if (m is None or _bad_value(m.group(1).rstrip(",}"), zero_is_bad=True) is None) and (
                g is None or _bad_value(g.group(1).rstrip(",}"), zero_is_bad=False) is None):
            return True
        p = buf.find(needle, p + 1, end)
    return False


def _last_segment(line: bytes) -> str:
    """The text a terminal would show for a line: what follows its last `\\r`."""
    if b"\r" in line:
        parts = [p for p in line.split(b"\r") if p.strip()]
        line = parts[-1] if parts else b""
    text = line[-TAIL_LINE_CHARS * 2 :].decode("utf-8", "replace")
    if "\x1b" in text:
        text = ANSI_RE.sub("", text)
    return text[-TAIL_LINE_CHARS:]
