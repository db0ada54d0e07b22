"""The exception that ends a traceback, whatever its class is called. A class without an Error or
Exception suffix (psutil.NoSuchProcess, psutil.AccessDenied) holds none of the scanner's keywords,
so the line was never read: a rank's crash went unseen and the peer rank's "Connection closed by
peer" was blamed (seen on a 2-rank LLaMA-Factory night: DeepSpeed's CPU accelerator died with
psutil.NoSuchProcess on rank 0, and the night was judged comm_failure three times)."""

from __future__ import annotations

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import diagnose_bytes

_FRAMES = b"""Traceback (most recent call last):
  File "/x/train.py", line 10, in <module>
    main()
  File "/x/site-packages/psutil/__init__.py", line 355, in _init
    raise NoSuchProcess(pid, msg=msg)
"""


def _ranked(rank: int, text: bytes) -> bytes:
    return b"".join(b"[rank%d]: " % rank + line + b"\n" for line in text.splitlines())


def test_a_class_without_the_usual_suffix_ends_its_traceback() -> None:
    d = diagnose_bytes(_FRAMES + b"psutil.NoSuchProcess: process PID not found (pid=2)\n", exit=ExitRecord(returncode=1))
    assert d.category == Category.CRASH_OTHER, d.summary
    assert "psutil.NoSuchProcess" in d.summary and "line 6" in d.summary


def test_the_crashed_rank_is_blamed_not_the_peer_that_lost_it() -> None:
    log = (_ranked(0, _FRAMES + b"psutil.NoSuchProcess: process PID not found (pid=2)")
           + _ranked(1, b"""Traceback (most recent call last):
  File "/x/train.py", line 10, in <module>
    main()
  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 2806, in all_reduce
    work.wait()
RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29400"""))
    d = diagnose_bytes(log, exit=ExitRecord(returncode=1))
    assert d.category == Category.CRASH_OTHER, d.summary
    assert "rank 0" in d.summary and "NoSuchProcess" in d.summary


def test_an_indented_code_line_that_looks_like_a_class_is_not_the_exception() -> None:
    log = _FRAMES.replace(b"    raise NoSuchProcess(pid, msg=msg)", b"    psutil.NoSuchProcess(pid)") + b"\n"
    d = diagnose_bytes(log, exit=ExitRecord(returncode=1))
    assert d.category == Category.UNKNOWN, d.summary


def test_the_same_words_printed_outside_a_traceback_do_not_act() -> None:
    # A failed run, so that the line would be named the crash if it were read as one.
    log = b"step 3 done\npsutil.NoSuchProcess: process PID not found (pid=2)\nstep 4 done\n"
    d = diagnose_bytes(log, exit=ExitRecord(returncode=1))
    assert d.category == Category.UNKNOWN, d.summary
