"""Rich-style tracebacks (`rich.traceback`): a box whose top edge is the `Traceback (most recent call
last)` header, frames as `path.py:LINE in func` (wrapped when long), the exception line after the
bottom edge. The scanner read none of it: the exception counted only as the log's last error (never
when more followed), its frames were lost, and the box's top edge was learned as a line prefix.

The lines are copied from config_error_hfblog_starchat_rich_ds_batch_assertion (huggingface/blog#1270,
development part of bench/corpus); the header is that log's own, from the next rank's copy of the
same traceback, put in front of the frames it draws."""

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import scan_rich
from supervisor.judge.diagnosis.scanner import LogScanner

HEADER = "╭───────────────── Traceback (most recent call last) ─────────────────╮\n"
BOX = (
    "│    944 │   def _do_sanity_check(self):                              │\n"
    "│    945 │   │   self._do_error_check()                               │\n"
    "│                                                                     │\n"
    "│ /opt/conda/lib/python3.7/site-packages/deepspeed/runtime/config.py: │\n"
    "│ 891 in _batch_assertion                                             │\n"
    "│                                                                     │\n"
    "│    888 │   │   assert (grad_acc > 0), f\"Gradient accumulation steps │\n"
    "│    889 │   │                                                        │\n"
    "│    890 │   │   assert train_batch == micro_batch * grad_acc * self. │\n"
    "│ ❱  891 │   │   │   f\"Check batch related parameters. train_batch_si │\n"
    "│    892 │   │   │   \"to micro_batch_per_gpu * gradient_acc_step * wo │\n"
    "│    893 │   │   │   f\"{train_batch} != {micro_batch} * {grad_acc} *  │\n"
    "│    894                                                              │\n"
    "╰─────────────────────────────────────────────────────────────────────╯\n"
)
EXC = (
    "AssertionError: Check batch related parameters. train_batch_size is not\n"
    "equal to micro_batch_per_gpu * gradient_acc_step * world_size 64 != 4 *\n"
    "8 * 1\n"
)
GOING_ON = "{'loss': 1.2031, 'learning_rate': 1e-05, 'epoch': 0.04}\n"


def _findings(text: str) -> list:
    s = LogScanner()
    s.feed(text.encode())
    return [f for f in s.state().findings if f.hit.exc]


def test_frames_are_read_across_the_wrapped_line():
    assert scan_rich.frames(BOX) == [("_batch_assertion", "/opt/conda/lib/python3.7/site-packages/deepspeed/runtime/config.py")]


def test_the_exception_after_the_box_ends_a_traceback_with_its_header():
    [f] = _findings(HEADER + BOX + EXC + GOING_ON)
    assert (f.form, f.hit.category) == ("traceback", Category.CONFIG_ERROR)
    s = LogScanner()
    s.feed((HEADER + BOX + EXC).encode())
    assert s._prefixes.patterns == ()  # the box's top edge is no stream prefix


def test_a_box_without_its_header_or_a_panel_is_no_traceback():
    # the same box and words, no header above (a panel, or a cut paste), then training goes on: text
    [f] = _findings(BOX + EXC + GOING_ON)
    assert f.form == ""
    s = LogScanner()
    s.feed((BOX + EXC + GOING_ON).encode())
    assert s.finish(ExitRecord(returncode=1)).strength == "hint"


def test_any_chunking_reads_the_same_frames():
    # the same box with its frame renamed to a training step (the only edit of the copied text), so the
    # phase tells whether the frames were read
    box = BOX.replace("│ 891 in _batch_assertion          ", "│ 891 in training_step             ")
    data = (HEADER + box + EXC).encode()
    answers = set()
    for cut in range(1, len(data), 97):
        s = LogScanner()
        s.feed(data[:cut])
        s.feed(data[cut:])
        d = s.finish(ExitRecord(returncode=1))
        answers.add((d.category, d.phase))
    assert answers == {(Category.CONFIG_ERROR, "train_step")}, answers
