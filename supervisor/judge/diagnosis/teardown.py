"""The end of a log: which of its last lines say why it ended, and which are teardown noise (pure).

A process that dies prints its error and then, often, a launcher's summary, other ranks' echoes,
warnings from interpreter shutdown, a shell prompt. An expert reads the log backwards past that
noise to the last line that says something: when that line (or the exception whose message it
continues) is an error, it is "the final error of the log", decisive even without a traceback
header above it (a pasted excerpt, a rotated log, a framework that logs `ExcType: message` and
exits). A line that shows the program going on (a progress bar, a logged step, an ordinary log
line) is not noise: an error printed before it did not end the run.
"""

from __future__ import annotations

import re

from supervisor.judge.diagnosis.prefixes import KNOWN_PREFIX_RE, strip_learned, undecorate
from supervisor.judge.diagnosis.rules import exception_class

MESSAGE_LINES = 8  # lines after an exception line that may still be its message

_NOISE_RE = re.compile(
    r"""^(?:
        [\s=\-_*~#.^]*$                                             # blank, separators, carets
      | Traceback\ \(most\ recent\ call\ last\):                    # traceback structure
      | File\ "[^"]*",\ line\ \d+                                   # frames (Python, faulthandler)
      | During\ handling\ of\ the\ above\ exception | The\ above\ exception\ was\ the\ direct\ cause
      | terminate\ called\ (?:after\ throwing|without\ an\ active)  # C++ block structure
      | Exception\ raised\ from\ | frame\ \#\d+: | \#\d+\s+0x[0-9a-f]+
      | (?:Aborted|Segmentation\ fault|Bus\ error|Floating\ point\ exception)(?:\ \(core\ dumped\))?$
      | Fatal\ Python\ error: | (?:Current\ )?[Tt]hread\ 0x[0-9a-f]+ | Extension\ modules:
      | Exception\ ignored\ in
      | stack\ traceback:$ | \[C\]:\ (?:in|at)\  | \S+\.lua:\d+:\ in\ (?:function|main\ chunk)\b  # Lua's traceback
      | CUDA\ kernel\ errors\ might\ be | HIP\ kernel\ errors\ might\ be | For\ debugging\ consider\ passing
      | Compile\ with\ `TORCH_USE_\w+_DSA`
      # launchers: torchrun / torchelastic summary, DeepSpeed, accelerate, mpirun, srun
      | (?:\S+\ )?FAILED$ | Failures: | <NO_OTHER_FAILURES> | Root\ Cause\ \(first\ observed\ failure\):
      | \[\d+\]:$ | (?:time|host|rank|exitcode|error_file|traceback)\s*:
      | To\ enable\ traceback\ see: | ERROR:torch\.distributed | WARNING:torch\.distributed
      | .*(?:api\.py:\d+\]\ failed\ \(exitcode|multiprocessing\.api:\ \[ERROR\]\ failed\ \(exitcode|Sending\ process\ \d+\ closing\ signal|\[launch\.py:\d+:sigkill_handler\]
          |Killing\ subprocess\ \d+|exits\ with\ return\ code\ =|Main\ process\ received\ SIG
          |Primary\ job\ terminated\ normally|mpirun\ (?:detected|noticed)|srun:\ (?:error|Job\ step\ aborted)
          |process\ group\ has\ NOT\ been\ destroyed|destroy_process_group\(\)\ was\ not\ called)
      # interpreter shutdown, wandb, warnings, shells, markdown fences
      | wandb: | \S+\.py:\d+:\ \w*Warning: | warnings\.warn\( | \w*Warning:
      | Error\ executing\ job\ with\ overrides | Set\ the\ environment\ variable\ HYDRA_FULL_ERROR
      | \#\ (?:Accounting:\ time=|Ended\ \(code\ \d+\)\ at\ )              # Kaldi/ESPnet run.pl's footer
      | full_key:\ | reference_type= | object_type=                # omegaconf's detail under its error
      | Caused\ by\ op\ '[^']*',\ defined\ at: | \[\[\{*node\               # TensorFlow's op location
      | .*Skipping\ cancelled\ (?:en|de)queue\ attempt                 # TF's input queues closing at shutdown
      | \(?[\w.-]*\)?\s*[\w.-]+@[\w.-]+[:\s].*[$#%]\s | [$#%>]\s*$ | ```
    )""",
    re.VERBOSE,
)
# Launcher and wrapper exceptions: how a failure was passed on, never why.
WRAPPER_EXCEPTIONS = frozenset({"ChildFailedError", "CalledProcessError", "SystemExit", "SignalException"})
_CODE_LINE_RE = re.compile(r"^\s{2,}\S")  # a traceback's source line (indented)
# The program going on: a progress bar, a logged step. Never noise, never an error's message.
_PROGRESS_RE = re.compile(r"\d%\||\d+/\d+ \[[\d:]+<|^\{['\"]\w+['\"]:\s*[-\d.]|^\{['\"](?:loss|eval_\w+|train_\w+)['\"]:")
_SHELL_KILLED_RE = re.compile(r"(?:^|\])\s*\S+$")
# rich's logging handler: "[time] LEVEL    message    file.py:LINE", a long message wrapped onto lines
# indented to its column. Such a record is one line of the log: its head says what it is.
_RICH_LOG_HEAD_RE = re.compile(r"^\s*(?:\[?\d[\d/:.\- ]*\]?\s+)?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s{2,}\S")
_RICH_LOG_CONT_RE = re.compile(r"^\s{20,}\S")
# An argument parser's error (argparse's "prog: error: ...", jsonargparse's "error: Parser key ..."):
# like an exception line, the head of a block whose indented lines below are its message.
_ERROR_HEAD_RE = re.compile(r"^(?:\S+: )?error: \S")


def clean(text: str, prefixes: tuple[str, ...]) -> str:
    """A tail line as the program wrote it: decorations, known and learned prefixes removed."""
    t = undecorate(text)
    for _ in range(4):
        t2 = strip_learned(t, prefixes)
        m = KNOWN_PREFIX_RE.match(t2)
        if m and m.end() > 0:
            t2 = t2[m.end():]
        if t2 == t:
            break
        t = t2
    return t.strip()


def is_noise(raw: str, text: str, after_frame: bool) -> bool:
    """Teardown noise: says nothing about why the run ended (see the module docstring)."""
    if after_frame and _CODE_LINE_RE.match(raw):
        return True
    if _NOISE_RE.match(text):
        return True
    exc = exception_class(text)
    return exc is not None and exc.rsplit(".", 1)[-1] in WRAPPER_EXCEPTIONS


def final_block(tail: list[tuple[int, str]], prefixes: tuple[str, ...],
                is_kill_report: object = None) -> tuple[int, int] | None:
    """(first, last) line numbers of the final error block: the last line that is not noise, back to
    the exception line whose message it continues (at most MESSAGE_LINES above). None when the tail
    holds nothing but noise. The caller decides whether that block holds an error."""
    kinds: list[tuple[int, str, bool]] = []  # (line, cleaned text, noise)
    raws = [raw for _, raw in tail]
    after_frame = False
    for n, raw in tail:
        t = clean(raw, prefixes)
        noise = is_noise(raw, t, after_frame)
        if callable(is_kill_report) and not noise and is_kill_report(t):
            noise = True  # the shell's or a launcher's report of the kill itself: an exit status, read apart
        after_frame = t.startswith('File "') or (after_frame and bool(_CODE_LINE_RE.match(raw)))
        kinds.append((n, t, noise))
    last = next((i for i in range(len(kinds) - 1, -1, -1) if not kinds[i][2]), None)
    if last is None:
        return None
    end_line = kinds[last][0]
    first = last
    if _PROGRESS_RE.search(kinds[last][1]):
        return end_line, end_line  # the log ends with the program going on: no error ended it
    for i in range(last, max(-1, last - MESSAGE_LINES - 1), -1):
        if kinds[i][2] or _PROGRESS_RE.search(kinds[i][1]):
            break  # the block is contiguous: noise or progress before it belongs to something else
        if exception_class(kinds[i][1]) is not None or _ERROR_HEAD_RE.match(kinds[i][1]):
            first = i  # the earliest exception line: later ones are its message (NCCL, chained texts)
    if first == last and _RICH_LOG_CONT_RE.match(raws[last]):
        first = _rich_record_head(raws, last)
    return kinds[first][0], end_line


def _rich_record_head(raws: list[str], last: int) -> int:
    """The head line of the rich log record whose wrapped continuation `raws[last]` is, else `last`."""
    for i in range(last - 1, max(-1, last - MESSAGE_LINES - 1), -1):
        if _RICH_LOG_HEAD_RE.match(raws[i]):
            return i
        if not _RICH_LOG_CONT_RE.match(raws[i]):
            break
    return last
