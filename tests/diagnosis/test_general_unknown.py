"""A signal with nothing in the log to say why (issue 29, generalising): torchrun's summary with
`error_file: <N/A>` and `traceback : Signal 11 (SIGSEGV) received by PID N` is how the launcher passed the
death on, not a cause. The verdict is unknown (the signal kept as its subkind), not a guessed crash;
the policy treats the two alike (decide.TRANSIENT, the same-twice stop). Text from bench r7
unknown_megatron_elastic_exitcode_minus11_sigsegv (NVIDIA/Megatron-LM#1880)."""

import pytest

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import diagnose_bytes

SUMMARY = (
    b"======================================================\n"
    b"pretrain_gpt.py FAILED\n"
    b"------------------------------------------------------\n"
    b"Failures:\n"
    b"  <NO_OTHER_FAILURES>\n"
    b"------------------------------------------------------\n"
    b"Root Cause (first observed failure):\n"
    b"[0]:\n"
    b"  time      : 2025-06-01_10:00:00\n"
    b"  host      : node1\n"
    b"  rank      : 0 (local_rank: 0)\n"
    b"  exitcode  : -%d (pid: 6421)\n"
    b"  error_file: <N/A>\n"
    b"  traceback : Signal %d (%s) received by PID 6421\n"
    b"======================================================\n"
)


@pytest.mark.parametrize(("sig", "name", "sub"), [(11, b"SIGSEGV", "segfault"), (6, b"SIGABRT", "abort")])
def test_a_signal_with_no_error_in_the_log_is_unknown(sig, name, sub):
    d = diagnose_bytes(SUMMARY % (sig, sig, name), ExitRecord(returncode=-sig))
    assert d.category is Category.UNKNOWN, d.summary
    assert d.subkind == sub
    d = diagnose_bytes(b"step 10 loss 1.2\n", ExitRecord(returncode=-sig))
    assert d.category is Category.UNKNOWN, d.summary


def test_a_segfault_the_log_reports_stays_a_crash():
    assert diagnose_bytes(b"step 1\nSegmentation fault (core dumped)\n", ExitRecord(returncode=139)).category \
        is Category.CRASH_OTHER


# fudan-generative-vision/hallo2#56 shape (bench r7 unknown_hallo2_*): the launcher's line is the log's last error
ELASTIC = (
    b"[2024-11-26 02:04:28,495] torch.distributed.elastic.multiprocessing.api: [WARNING] Sending process 750664"
    b" closing signal SIGTERM\n"
    b"[2024-11-26 02:04:31,514] torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: -11)"
    b" local_rank: 1 (pid: 750662) of binary: /env/bin/python\n"
    b"Traceback (most recent call last):\n"
    b'  File "/env/bin/torchrun", line 8, in <module>\n'
    b"    sys.exit(main())\n"
    b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
)


def test_a_pasted_launcher_report_alone_is_unknown():
    for exit in (None, ExitRecord(returncode=1)):
        d = diagnose_bytes(ELASTIC + SUMMARY % (11, 11, b"SIGSEGV"), exit)
        assert d.category is Category.UNKNOWN, d.summary
        assert d.subkind == "segfault"


def test_the_childs_own_error_still_decides():
    child = (b"[rank1]: Traceback (most recent call last):\n[rank1]:   File \"train.py\", line 3, in <module>\n"
             b"[rank1]: ValueError: bad shape\n")
    assert diagnose_bytes(child + ELASTIC, None).category is Category.CRASH_OTHER
    assert diagnose_bytes(b"Fatal Python error: Segmentation fault\n" + ELASTIC, None).category \
        is Category.CRASH_OTHER


# accelerate/commands/launch.py simple_launcher: `raise subprocess.CalledProcessError(returncode=process.returncode,
# cmd=cmd)` (the shape of bench r7 unknown_sd_scripts_flux_db_save_died_sigkill, kohya-ss/sd-scripts): the parent's
# report that the interpreter it ran exited non-zero, not the child's error.
ACCELERATE = (
    b"Traceback (most recent call last):\n"
    b'  File "/env/bin/accelerate", line 8, in <module>\n'
    b"    sys.exit(main())\n"
    b'  File "/env/lib/python3.10/site-packages/accelerate/commands/launch.py", line 703, in simple_launcher\n'
    b"    raise subprocess.CalledProcessError(returncode=process.returncode, cmd=cmd)\n"
    b"subprocess.CalledProcessError: Command '['/env/bin/python', 'train.py', '--config_file', 'c.toml']' returned"
    b" non-zero exit status 1.\n"
)
# ray/exceptions.py: RayActorError / WorkerCrashedError: a worker process died; the why is elsewhere (or nowhere).
RAY = b"step 5\nray.exceptions.RayActorError: The actor died unexpectedly before finishing this task.\n"


def test_a_launchers_report_of_a_nonzero_exit_is_unknown():
    for log in (ACCELERATE, RAY, (b"step 5\nray.exceptions.WorkerCrashedError: The worker died unexpectedly while"
                                  b" executing this task.\n")):
        for exit in (None, ExitRecord(returncode=1)):
            d = diagnose_bytes(log, exit)
            assert d.category is Category.UNKNOWN, d.summary


def test_the_childs_own_error_before_the_launchers_report_still_decides():
    child = (b'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n'
             b"ValueError: bad shape\n")
    assert diagnose_bytes(child + ACCELERATE, ExitRecord(returncode=1)).category is Category.CRASH_OTHER


def test_a_build_tools_failure_stays_a_crash():
    # torch/utils/cpp_extension.py _run_ninja_build: the tool's own output says what failed
    log = (b'Traceback (most recent call last):\n  File "/env/lib/python3.10/site-packages/torch/utils/cpp_extension.py",'
           b" line 2100, in _run_ninja_build\n    subprocess.run(\n"
           b"subprocess.CalledProcessError: Command '['ninja', '-v']' returned non-zero exit status 1.\n")
    assert diagnose_bytes(log, None).category is Category.CRASH_OTHER


def _bar(n: int) -> bytes:
    return b"%3d%%|#         | %d/100 [00:01<00:19,  5.00it/s]\n" % (n, n)


def test_an_exception_line_the_program_went_on_from_is_not_what_ended_it():
    """Printed outside a traceback and followed by training that advanced: the program logged it and went on
    (like a hub retry). With nothing else, the end is unknown, not a guessed crash."""
    log = _bar(1) + _bar(2) + b"ValueError: could not parse header, skipping\n" + _bar(3) + _bar(4)
    d = diagnose_bytes(log, None)
    assert d.category is Category.UNKNOWN, d.summary
    # the same line as the log's last words is still read
    assert diagnose_bytes(_bar(1) + _bar(2) + b"ValueError: could not parse header\n", None).category \
        is Category.CRASH_OTHER
