"""Targeted behaviours of the scanner and the conclusion rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.core.models import Category, ExitRecord, HostEvidence, Phase
from supervisor.judge.diagnosis import LogScanner, diagnose_bytes, diagnose_file
from supervisor.judge.diagnosis.rules import KEYWORDS
from supervisor.judge.diagnosis.sizes import human, parse_size
from supervisor.judge.diagnosis.wording import oom_numbers
from tests.diagnosis.cases import fixture_cases, load_case

REPO = Path(__file__).resolve().parents[2]
GIB, MIB = 2**30, 2**20
OOM = b"[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of 79.14 GiB of which 1.00 GiB is free."
BAR = b"\r  %d%%|#         | %d/100 [00:10<00:10,  5.00it/s]"


def bars(a, b):
    return b"".join(BAR % (s, s) for s in range(a, b + 1)) + b"\n"


def tb(line: bytes, rank: int | None = None) -> bytes:
    """`line` as the exception that ends a Python traceback (what a real crash prints)."""
    p = b"[rank%d]: " % rank if rank is not None else b""
    return (p + b"Traceback (most recent call last):\n"
            + p + b'  File "/x/transformers/trainer.py", line 3745, in training_step\n'
            + p + b"    self.accelerator.backward(loss, **kwargs)\n" + line + b"\n")


def test_feed_reports_fatal_evidence_once_when_the_line_completes():
    s = LogScanner()
    assert s.feed(bars(1, 5)) == []
    assert s.feed(tb(b"")[:-1]) == []
    assert s.feed(OOM[:40]) == []  # partial line: buffered
    fatal = s.feed(OOM[40:] + b"\n")
    assert [(e.rule, e.line_no) for e in fatal] == [("torch_oom", 5)]
    assert "OutOfMemoryError" in fatal[0].text
    assert s.feed(b"more output\n") == []
    assert s.finish(ExitRecord(1)).rank == 3


@pytest.mark.parametrize("line", [
    b"[rank0]:[E1128 02:07:08.408 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1) ran for 600027 milliseconds before timing out.",
    b"ValueError: Some keys are not used by the HfArgumentParser: ['compute_type']",
    b"OSError: [Errno 28] No space left on device",
    b"WARNING: caught CUDA out of memory. Tried to allocate 2.00 GiB. retrying with batch size 4",
    b"[W CUDAAllocatorConfig.h:28] Warning: expandable_segments not supported on this platform (function operator())",
])
def test_non_fatal_lines_do_not_ask_for_teardown(line):
    assert LogScanner().feed(line + b"\n") == []


@pytest.mark.parametrize("line, rule", [
    (b"RuntimeError: HIP error: out of memory", "driver_oom"),
    (b"RuntimeError: HIP error: an illegal memory access was encountered", "illegal_memory_access"),
    (b"RuntimeError: [enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes.", "cpu_alloc"),
    (b"[rank1]: RuntimeError: CUDA error: an illegal memory access was encountered", "illegal_memory_access"),
])
def test_fatal_lines(line, rule):
    """Fatal only as the exception that ends a traceback; the same text on its own line is a hint."""
    rank = 1 if line.startswith(b"[rank1]") else None
    assert [e.rule for e in LogScanner().feed(tb(line, rank))] == [rule]
    assert LogScanner().feed(line + b"\n") == []
    d = diagnose_bytes(line + b"\n" + bars(20, 22), ExitRecord(1))  # printed, then training went on
    assert d.category in (Category.GPU_OOM, Category.HOST_OOM, Category.CRASH_OTHER, Category.UNKNOWN), d
    assert d.strength == "hint" or d.category is Category.UNKNOWN, d  # an OOM followed by progress was handled
    last = diagnose_bytes(line + b"\n", ExitRecord(1))  # the log's last word: the verdict, never a live stop
    assert last.strength == "structural" and [e.rule for e in LogScanner().feed(line + b"\n")] == []


def test_earliest_root_cause_wins_over_an_earlier_consequence_and_a_later_root():
    log = (b"[rank0]:[E1 ProcessGroupNCCL.cpp:1] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1)\n"
           + tb(b"[rank2]: RuntimeError: CUDA error: an illegal memory access was encountered", 2) + tb(OOM, 3))
    d = diagnose_bytes(log, ExitRecord(1))
    assert (d.category, d.rank, d.evidence[0].line_no) == (Category.DEVICE_FAULT, 2, 5)
    assert d.strength == "structural"
    assert {e.rule for e in d.evidence} >= {"nccl_timeout", "torch_oom"}


def test_a_crash_before_the_watchdog_is_the_cause_without_a_root_finding():
    log = (b"[rank1]: KeyError: 'labels'\n"
           b"[rank0]:[E1 ProcessGroupNCCL.cpp:1] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1)\n")
    d = diagnose_bytes(log, ExitRecord(1))
    assert (d.category, d.subkind, d.rank) == (Category.CRASH_OTHER, "python_exception", 1)


@pytest.mark.parametrize("available, limit, want", [
    (10 * MIB, None, Category.HOST_OOM),
    (100 * MIB, 64 * GIB, Category.HOST_OOM),  # <= 2% of the limit
    (2 * GIB, 64 * GIB, Category.CRASH_OTHER),
    (100 * MIB, None, Category.CRASH_OTHER),  # > the 64 MiB floor, no limit known
])
def test_sigkill_needs_memory_evidence(available, limit, want):
    host = HostEvidence(min_available_bytes=available, memory_limit_bytes=limit)
    assert diagnose_bytes(b"step 1\n", ExitRecord(-9), host).category is want


def test_our_own_sigkill_is_never_read_as_the_oom_killer():
    host = HostEvidence(cgroup_oom_kills=0, min_available_bytes=1)
    d = diagnose_bytes(b"training...\n", ExitRecord(-9, "SIGKILL", stopped_by="hang"), host)
    assert d.category is Category.HANG


def test_kernel_oom_lines_that_are_not_oom_do_not_corroborate():
    host = HostEvidence(kernel_lines=("usb 1-1: new high-speed USB device",))
    assert diagnose_bytes(b"x\n", ExitRecord(137), host).subkind == "sigkill_unexplained"


def test_success_mentions_a_retried_oom_and_ignores_nan_for_category():
    log = bars(1, 10) + b"WARNING caught: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 8.00 GiB of which 0 bytes is free.\n" + bars(11, 30)
    d = diagnose_bytes(log, ExitRecord(0))
    assert d.category is Category.SUCCESS


def test_oom_followed_by_progress_is_not_the_cause():
    tb = b"Traceback (most recent call last):\n  File \"t.py\", line 1, in training_step\n" + OOM + b"\n"
    assert diagnose_bytes(bars(1, 10) + tb + bars(11, 12), ExitRecord(1)).category is Category.UNKNOWN
    # no progress after it: it is the cause
    assert diagnose_bytes(bars(1, 10) + tb + bars(10, 10), ExitRecord(1)).category is Category.GPU_OOM


def test_phase_from_context_when_there_is_no_traceback():
    save = b"[INFO|trainer.py:3815] >> Saving model checkpoint to out/checkpoint-10\n"
    d = diagnose_bytes(bars(1, 10) + save + OOM + b"\n", ExitRecord(1))
    assert d.phase is Phase.CHECKPOINT_SAVE
    d = diagnose_bytes(bars(1, 10) + save + bars(11, 12) + OOM + b"\n", ExitRecord(1))
    assert d.phase is Phase.TRAIN_STEP


def test_resume_frames_beat_the_training_loop_frames():
    tb = (b"Traceback (most recent call last):\n"
          b'  File "trainer.py", line 2555, in _inner_training_loop\n'
          b'  File "trainer.py", line 3463, in _load_optimizer_and_scheduler\n' + OOM + b"\n")
    assert diagnose_bytes(tb).phase is Phase.RESUME


def test_progress_sources():
    s = LogScanner()
    s.feed(b"  Total optimization steps = 1,200\n")
    s.feed(b"\r  1%|  | 7/1200 [00:01<00:10,  5.00it/s]\r  1%|  | 8/1200 [00:01<00:10,  5.00it/s]")
    assert s.last_step is None  # the bar line is not complete yet
    s.feed(b"\n\r 50%|#####     | 3/6 [00:01<00:01, 3.1it/s]\n")  # an eval bar: other total
    assert s.last_step == 8
    s.feed(b"[2026] [INFO] [logging.py:128:log_dist] [Rank 0] step=20, skipped=0, lr=[1e-05]\n")
    assert s.last_step == 20
    s.feed(b"Saving model checkpoint to out/checkpoint-25\n")
    assert s.last_step == 25


def test_tail_keeps_the_last_lines_with_their_numbers():
    s = LogScanner(tail_lines=3)
    for i in range(1, 1001):
        s.feed(b"line %d\r\x1b[1mshown %d\x1b[0m\n" % (i, i))
    s.feed(b"partial")
    s.finish()
    assert s.state().tail == [(999, "shown 999"), (1000, "shown 1000"), (1001, "partial")]


def test_evidence_is_capped_per_rule():
    s = LogScanner(max_evidence_per_rule=2)
    for i in range(50):
        s.feed(b"KeyError: 'x%d'\n" % i)
    f = s.state().findings
    assert [x.line_no for x in f] == [1, 2, 50]


@pytest.mark.parametrize("text, n", [
    ("546.00 MiB", 546 * MIB), ("0 bytes", 0), ("15.77 GiB", round(15.77 * GIB)), ("1.5 GB", 1_500_000_000),
    ("12 KiB", 12 * 1024), ("no size", None),
])
def test_parse_size(text, n):
    assert parse_size(text) == n


def test_human():
    assert human(546 * MIB) == "546.00 MiB" and human(12) == "12 bytes"


def test_fragmentation_rule():
    base = {"tried_to_allocate": 2 * GIB, "free": 1 * GIB, "total_capacity": 24 * GIB}
    assert oom_numbers({**base, "reserved_unallocated": int(2.5 * GIB)})[1] is True
    assert oom_numbers({**base, "reserved_unallocated": 1 * GIB})[1] is False  # less than the request
    small = {"tried_to_allocate": 2 * MIB, "free": 0, "total_capacity": 80 * GIB, "reserved_unallocated": 300 * MIB}
    assert oom_numbers(small)[1] is False  # >= request but < 5% of capacity
    nums, _ = oom_numbers(base)
    assert nums["shortfall"] == 1 * GIB


def test_shortfall_under_a_memory_fraction_cap():
    nums, _ = oom_numbers({"tried_to_allocate": 512 * MIB, "free": 20 * GIB, "allowed": 10 * GIB,
                            "allocated_by_pytorch": 9 * GIB + 800 * MIB, "reserved_unallocated": 100 * MIB})
    assert nums["shortfall"] == 512 * MIB - 124 * MIB


def test_diagnose_file_streams(tmp_path):
    p = tmp_path / "a.log"
    p.write_bytes(bars(1, 50) * 100 + OOM + b"\n")
    d = diagnose_file(p, ExitRecord(1), chunk_bytes=4096)
    assert d.category is Category.GPU_OOM and d.evidence[0].line_no == 101


def test_feed_after_finish_is_an_error():
    s = LogScanner()
    s.finish()
    with pytest.raises(RuntimeError):
        s.feed(b"x")


def test_without_fast_engines_every_fixture_reads_the_same():
    """hyperscan and google-re2 are only accelerators: with the stdlib `re` engine the answers are identical."""
    here = {str(c): diagnose_bytes(*_args(c)).to_dict() for c in fixture_cases()}
    code = (
        "import json, sys\n"
        "from supervisor.judge.diagnosis import diagnose_bytes, PREFILTER_ENGINE\n"
        "from tests.diagnosis.cases import fixture_cases, load_case\n"
        "assert PREFILTER_ENGINE == 're', PREFILTER_ENGINE\n"
        "out = {}\n"
        "for c in fixture_cases():\n"
        "    log, _, exit, host = load_case(c)\n"
        "    out[str(c)] = diagnose_bytes(log, exit, host).to_dict()\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "OOM_SUPERVISOR_NO_FAST_RE": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == json.loads(json.dumps(here))


def _args(case):
    log, _, exit, host = load_case(case)
    return log, exit, host


def test_every_evidence_line_of_every_fixture_holds_a_prefilter_keyword():
    for case in fixture_cases():
        log, _, exit, host = load_case(case)
        lines = log.split(b"\n")
        for e in diagnose_bytes(log, exit, host).evidence:
            if e.line_no and e.rule != "tail":
                assert any(k.encode() in lines[e.line_no - 1] for k in KEYWORDS), (case.name, e)


def test_trie_pattern_matches_exactly_the_words():
    import re as _re

    from supervisor.judge.diagnosis.fastre import trie_pattern

    words = [b"Error:", b"Errno 28", b"HIP", b"hipError", b"*****", b"a", b"ab"]
    rx = _re.compile(trie_pattern(words))
    for w in words:
        assert rx.fullmatch(w), w
    for w in (b"Err", b"HI", b"****", b"b", b"abc"):
        assert not rx.fullmatch(w), w
    text = b"x HIP y hipError: z Errno 28 *****"
    assert sorted(m.end() for m in rx.finditer(text)) == sorted(
        m.end() for m in _re.finditer(b"|".join(_re.escape(w) for w in sorted(words, key=len, reverse=True)), text))


def test_resumed_attempt_reports_the_resume_step_not_its_bar_starting_at_zero():
    from supervisor.judge.diagnosis import LogScanner

    s = LogScanner(initial_step=8)
    s.feed(b"  0%|          | 0/9 [00:00<?, ?it/s]\n"
           b"RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
           b"allocate memory: you tried to allocate 22192128 bytes. Error code 12 (Cannot allocate memory)\n")
    assert s.last_step == 8
    assert "last step seen 8" in s.finish().summary


def test_host_oom_says_the_limit_and_the_peak():
    from supervisor.core.models import ExitRecord, HostEvidence
    from supervisor.judge.diagnosis import diagnose_bytes

    d = diagnose_bytes(b"RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                       b"allocate memory: you tried to allocate 65028096 bytes. Error code 12\n",
                       ExitRecord(returncode=1),
                       HostEvidence(memory_limit_bytes=2_048_000_000, peak_rss_bytes=1_500_000_000,
                                    limit_mechanism="rlimit-data"))
    assert d.category == "host_oom"
    assert d.numbers["memory_limit"] == 2_048_000_000 and d.numbers["peak_host_memory"] == 1_500_000_000
    assert "limit is 1.91 GiB (rlimit-data)" in d.summary and "peak seen 1.40 GiB" in d.summary
