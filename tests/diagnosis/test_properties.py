"""Property tests: no input crashes the scanner, and chunking never changes the answer."""

from __future__ import annotations

import resource

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import LogScanner, diagnose_bytes
from supervisor.judge.diagnosis.scan_patterns import LONG_LINE

OOM = (b"[rank3]: torch.OutOfMemoryError: HIP out of memory. Tried to allocate 124.00 MiB. GPU 0 has a total "
       b"capacity of 19.94 GiB of which 554.47 MiB is free.")
PIECES = [
    b"\n", b"\r", b"\r\n", b"\x1b[31m", b"\x1b[0m", b"\xff\xfe", b"\xe2\x96\x88", b"[rank1]: ", b"[default2]:",
    b"Traceback (most recent call last):\n", b'  File "/x/transformers/trainer.py", line 3745, in training_step\n',
    OOM, b"RuntimeError: CUDA error: an illegal memory access was encountered", b"KeyError: 'x'",
    b"  3%|\xe2\x96\x88    | 30/1000 [00:10<05:00,  3.21it/s]", b"Total optimization steps = 1,000\n",
    b"{'loss': nan, 'grad_norm': nan}", b"Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1)",
    b"exitcode  : -9 (pid: 1)", b"Signal 9 (SIGKILL) received by PID 1", b"OSError: [Errno 28] No space left on device",
    b"Saving model checkpoint to out/checkpoint-20\n", b"[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1",
    b"ValueError: Some keys are not used by the HfArgumentParser: ['a']", b"Memory access fault by GPU node-2",
    b"Currently training with a batch size of: 4\n",
]
logs = st.lists(st.one_of(st.sampled_from(PIECES), st.binary(max_size=40)), max_size=60).map(b"".join)
exits = st.one_of(
    st.none(),
    st.builds(ExitRecord, returncode=st.sampled_from([0, 1, 134, 137, 139, -9, -11, None]),
              stopped_by=st.sampled_from([None, None, "hang", "fatal_signal", "cancel"])),
)


def _feed_in(data: bytes, cuts: list[int]) -> tuple[LogScanner, list[str]]:
    scanner = LogScanner(max_evidence_per_rule=3, tail_lines=7)
    rules = []
    prev = 0
    for c in sorted({c for c in cuts if 0 < c < len(data)}) + [len(data)]:
        rules += [e.rule for e in scanner.feed(data[prev:c])]
        prev = c
    return scanner, rules


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=logs, cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=30), exit=exits)
def test_random_chunking_gives_the_same_diagnosis(data, cuts, exit):
    whole = LogScanner(max_evidence_per_rule=3, tail_lines=7)
    whole_rules = [e.rule for e in whole.feed(data)]
    expected = whole.finish(exit)
    chunked, rules = _feed_in(data, cuts)
    assert chunked.finish(exit).to_dict() == expected.to_dict()
    assert sorted(rules) == sorted(whole_rules)
    assert chunked.last_step == whole.last_step
    assert chunked.lines_seen == whole.lines_seen == data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=5000), exit=exits)
def test_arbitrary_bytes_never_crash(data, exit):
    d = diagnose_bytes(data, exit)
    assert d.category in set(Category)
    assert all(e.line_no >= 0 for e in d.evidence)
    d.to_dict()


@settings(max_examples=100, deadline=None)
@given(data=logs, cut=st.integers(min_value=0, max_value=5000))
def test_truncated_input_never_crashes(data, cut):
    d = diagnose_bytes(data[:cut])
    assert isinstance(d.summary, str) and d.summary


def test_huge_line_without_newline_is_scanned_in_bounded_memory():
    """12 MB on one line with an OOM near its end, fed in 64 KiB chunks; the newline comes last."""
    filler = (b"\r 50%|\xe2\x96\x88\xe2\x96\x88    | 50/100 [00:10<00:10,  5.00it/s]" * 200_000)[: 12 * 1024 * 1024]
    head = b'Traceback (most recent call last):\n  File "/x/trainer.py", line 1, in training_step\n'
    data = head + filler + b" " + OOM + b" trailing text" * 1000 + b"\n"
    scanner = LogScanner()
    fatal = []
    for i in range(0, len(data), 65536):
        fatal += scanner.feed(data[i : i + 65536])
        assert len(scanner._partial) <= LONG_LINE + 4096 + 65536  # never the whole line
    assert [e.rule for e in fatal] == ["torch_oom"]
    d = scanner.finish(ExitRecord(returncode=1))
    assert d.category is Category.GPU_OOM and d.vendor == "hip" and d.rank == 3
    assert d.evidence[0].line_no == 3
    assert len(d.evidence[0].text) <= 2003
    assert scanner.last_step == 50
    assert scanner.lines_seen == 3


def test_huge_line_same_answer_whatever_the_chunk_size():
    data = b"x" * (3 * LONG_LINE + 123) + OOM + b"\nnext line\n"
    answers = set()
    for size in (1000, 65536, LONG_LINE - 1, 10 * LONG_LINE):
        s = LogScanner()
        for i in range(0, len(data), size):
            s.feed(data[i : i + size])
        answers.add(repr(s.finish().to_dict()))
    assert len(answers) == 1


def test_memory_stays_bounded_on_a_long_log():
    """80 MB of training output does not grow the scanner's state."""
    block = (b"\r 10%|\xe2\x96\x88         | 100/1000 [01:00<09:00,  1.66it/s]" * 30 + b"\n"
             b"{'loss': 1.2, 'grad_norm': 0.3, 'learning_rate': 1e-05, 'epoch': 0.1}\n"
             b"[rank0]:[W1128 ProcessGroupNCCL.cpp:1] Warning: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n"
             b"KeyError: 'not fatal but recorded'\n") * 200
    scanner = LogScanner()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(150):
        scanner.feed(block)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 * 1024
    st_ = scanner.state()
    assert len(st_.findings) <= 6  # 5 earliest + the latest of the one rule that fired
    assert len(st_.tail) == 200
