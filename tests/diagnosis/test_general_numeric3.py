"""Training "advanced" after an error only when a step is seen to grow (issue 29, r9a dev miss): a tqdm bar
that a dying process reprints once (tqdm's close at exit, another rank's last refresh) shows the step it
stopped at, not a run that went on. A bar first seen after the error counts as progress only when it moves."""

import pytest

from supervisor.core.models import Category
from supervisor.judge.diagnosis import diagnose_bytes

# DeepSpeed's fp16 loss scaler (runtime/fp16/loss_scaler.py): `raise Exception("Current loss scale already at
# minimum - cannot decrease scale anymore. Exiting run.")`, the traceback's header cut off by the paste.
_CUT = (b'  File "/usr/local/lib/python3.8/dist-packages/deepspeed/runtime/fp16/loss_scaler.py", line 175,'
        b" in update_scale\n    raise Exception(\n"
        b"Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.\n")
_KILLS = (b"[2023-07-26 15:19:24,960] [INFO] [launch.py:315:sigkill_handler] Killing subprocess 45098\n"
          b"[2023-07-26 15:19:27,802] [INFO] [launch.py:315:sigkill_handler] Killing subprocess 45099\n")


def _bar(step: int) -> bytes:
    return f"  4%|\u258d         | {step}/387 [05:25<1:57:56, 19.13s/it]\n".encode()


@pytest.mark.parametrize("before", [b"", _bar(16) + _bar(17)])
def test_a_bar_reprinted_once_after_the_error_is_not_progress(before: bytes) -> None:
    d = diagnose_bytes(before + _CUT + _bar(17) + _KILLS)
    assert d.category is Category.NUMERIC, d.summary


def test_a_bar_that_moves_after_the_error_is_progress() -> None:
    d = diagnose_bytes(_CUT + _bar(17) + _bar(18) + _bar(19))
    assert d.category is not Category.NUMERIC, d.summary


def test_a_bar_that_moves_within_one_line_after_the_error_is_progress() -> None:
    line = b"".join(_bar(s).rstrip(b"\n") + b"\r" for s in (17, 18, 19)) + b"\n"
    d = diagnose_bytes(_CUT + line)
    assert d.category is not Category.NUMERIC, d.summary


# Python's base class raised directly (`raise Exception("...")`) ends a traceback like any other class.
def test_a_bare_exception_ending_a_traceback_is_structural() -> None:
    d = diagnose_bytes(b"Traceback (most recent call last):\n" + _CUT)
    assert d.category is Category.NUMERIC and d.strength != "hint", d.summary


_SPAWN = (b'  File "/usr/lib/python3.6/site-packages/torch/multiprocessing/spawn.py", line 107, in join\n'
          b"    (error_index, name)\n")


@pytest.mark.parametrize("exc", [
    b"Exception: process 3 terminated with signal SIGKILL",  # torch < 1.6 spawn.py
    b"torch.multiprocessing.spawn.ProcessExitedException: process 0 terminated with exit code 1",
])
def test_spawns_report_of_a_childs_exit_is_a_relay(exc: bytes) -> None:
    # join() saw a child end without a Python error of its own: how it ended, not why.
    d = diagnose_bytes(b"Traceback (most recent call last):\n" + _SPAWN + exc + b"\n")
    assert d.category is Category.UNKNOWN, d.summary


def test_a_bare_exception_word_alone_is_not_an_exception_line() -> None:
    d = diagnose_bytes(b"step 1 loss 2.0\nException\nstep 2 loss 1.9\n")
    assert d.category is Category.UNKNOWN, d.summary
