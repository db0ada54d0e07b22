"""Evidence you can trust: structural findings decide, printed text only hints (issue 10)."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.core.models import Category, ExitRecord, HostEvidence
from supervisor.judge.diagnosis import LogScanner, diagnose_bytes
from tests.diagnosis.cases import fixture_cases, load_case

GIB = 2**30


def tb(line: bytes, rank: int | None = None) -> bytes:
    p = b"[rank%d]: " % rank if rank is not None else b""
    return (p + b"Traceback (most recent call last):\n"
            + p + b'  File "/x/transformers/trainer.py", line 3745, in training_step\n'
            + p + b"    self.accelerator.backward(loss, **kwargs)\n" + line + b"\n")


def sample_block(text: bytes) -> bytes:
    """What LLaMA-Factory 0.9.5's SupervisedDatasetProcessor.print_data_example prints, then its next log line."""
    return (b"training example:\ninput_ids:\n[151644, 8948, 198, 2610, 525]\ninputs:\n<|im_start|>user\n" + text
            + b"<|im_end|>\nlabel_ids:\n[-100, -100, 2610, 525]\nlabels:\n" + text + b"<|im_end|>\n"
            + b"[INFO|2026-11-28 23:10:05] llamafactory.model.model_utils.kv_cache:143 >> KV cache is disabled during training.\n")


ILLEGAL = tb(b"RuntimeError: CUDA error: an illegal memory access was encountered")
HEALTHY = (b"[INFO|trainer.py:2519] 2026-11-28 23:12:10,512 >> ***** Running training *****\n"
           b"  Total optimization steps = 100\n"
           + b"".join(b"\r %d%%|#   | %d/100 [00:10<00:10,  5.00it/s]" % (i, i) for i in range(1, 40)) + b"\n"
           b"{'loss': 1.2, 'grad_norm': 0.3, 'learning_rate': 1e-05, 'epoch': 0.1}\n")
# Training that goes on after a line: the bar advances past where it was.
GOES_ON = b"".join(b"\r %d%%|#   | %d/100 [00:10<00:10,  5.00it/s]" % (i, i) for i in range(40, 45)) + b"\n"
OOM = (b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
       b"79.14 GiB of which 1.00 GiB is free. Including non-PyTorch memory, this process has 8.00 GiB memory in use. "
       b"Of the allocated memory 6.50 GiB is allocated by PyTorch, and 512.00 MiB is reserved by PyTorch but unallocated.")


def test_a_printed_sample_with_a_device_fault_traceback_never_tears_down_a_healthy_job():
    s = LogScanner()
    assert s.feed(sample_block(ILLEGAL)) == []
    assert s.feed(HEALTHY) == []
    d = s.finish(ExitRecord(returncode=1))
    assert d.category is not Category.DEVICE_FAULT, d.summary
    assert not any(e.rule == "illegal_memory_access" for e in d.evidence)
    assert s.finish(ExitRecord(returncode=0)).category is Category.SUCCESS


def test_a_sample_saying_disk_full_then_a_real_oom_traceback_is_a_gpu_oom():
    log = sample_block(b"OSError: [Errno 28] No space left on device\n") + HEALTHY + tb(OOM)
    s = LogScanner()
    assert [e.rule for e in s.feed(log)] == ["torch_oom"]
    d = s.finish(ExitRecord(returncode=1))
    assert (d.category, d.strength) == (Category.GPU_OOM, "structural")
    assert not any(e.rule == "no_space" for e in d.evidence)


def test_an_exception_line_outside_a_traceback_is_a_hint_that_never_ends_or_pauses_a_job():
    # A dataset line printed by the job (no traceback above it), training going on after it:
    # disk_full would pause the queue.
    log = HEALTHY + b"OSError: [Errno 28] No space left on device\n" + GOES_ON
    s = LogScanner()
    assert s.feed(log) == []
    d = s.finish(ExitRecord(returncode=1))
    assert d.strength == "hint"
    assert d.category is Category.CRASH_OTHER and d.subkind == "no_space", d


def test_the_last_error_of_the_log_decides_the_verdict_but_never_tears_down():
    """Issue 16: the last exception line before a non-zero exit, nothing but teardown after it, is
    structural even without a traceback header (a pasted or rotated log); statvfs still guards disk."""
    teardown = (b"[2026-11-28 23:41:07,000] [INFO] [launch.py:315:sigkill_handler] Killing subprocess 4242\n"
                b"[2026-11-28 23:41:07,100] [ERROR] [launch.py:321:sigkill_handler] ['python', 'train.py'] exits with"
                b" return code = 1\n\n")
    log = HEALTHY + b"OSError: [Errno 28] No space left on device\n" + teardown
    s = LogScanner()
    assert s.feed(log) == []  # free text never tears anything down by itself
    d = s.finish(ExitRecord(returncode=1))
    assert (d.category, d.strength) == (Category.DISK_FULL, "structural"), d.summary
    assert "the last error in the log" in d.summary
    roomy = diagnose_bytes(log, ExitRecord(1), HostEvidence(free_bytes={"/out": 500 * GIB}))
    assert (roomy.category, roomy.strength) == (Category.CRASH_OTHER, "hint"), roomy.summary
    # The same line printed as data, then training went on, or in a printed sample: a hint / nothing.
    assert diagnose_bytes(HEALTHY + b"OSError: [Errno 28] No space left on device\n" + GOES_ON + teardown,
                          ExitRecord(1)).strength == "hint"
    assert diagnose_bytes(sample_block(b"OSError: [Errno 28] No space left on device\n") + teardown,
                          ExitRecord(1)).category is Category.UNKNOWN


def test_the_exception_that_ends_the_last_traceback_wins_over_an_earlier_line():
    log = (HEALTHY + b"[WARNING|x] sample 3: OSError: [Errno 28] No space left on device\n" + tb(OOM))
    d = diagnose_bytes(log, ExitRecord(1))
    assert (d.category, d.strength) == (Category.GPU_OOM, "structural")


def test_disk_full_needs_statvfs_to_agree_when_it_was_measured():
    log = tb(b"OSError: [Errno 28] No space left on device")
    roomy = diagnose_bytes(log, ExitRecord(1), HostEvidence(free_bytes={"/out": 500 * GIB}))
    assert (roomy.category, roomy.strength) == (Category.CRASH_OTHER, "hint"), roomy
    assert "statvfs disagrees" in roomy.summary
    full = diagnose_bytes(log, ExitRecord(1), HostEvidence(free_bytes={"/out": 10 * 2**20, "/state": 500 * GIB}))
    assert (full.category, full.strength) == (Category.DISK_FULL, "structural")
    assert "/out has 10.00 MiB free" in full.summary
    assert diagnose_bytes(log, ExitRecord(1)).category is Category.DISK_FULL  # not measured: the exception decides


def test_a_log_line_the_scanner_used_to_choke_on_never_raises():
    s = LogScanner()
    s.feed(b"[INFO|trainer.py:2527] >>   Total optimization steps = ,\n  Total optimization steps = ,,\n")
    assert s.total_steps is None
    d = s.finish(ExitRecord(1))
    assert d.category is Category.UNKNOWN


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([
    b"  Total optimization steps = ", b",", b"1", b"\n", b"Saving model checkpoint to x/checkpoint-", b"step=",
    b", skipped=", b"OVERFLOW! Attempted loss scale: ", b"{'loss': ", b"nan", b"'grad_norm': ", b"}",
    b"Currently training with a batch size of: ", b"rank: ", b" (local_rank", b"training example:\n",
    b"[INFO|", b"input_ids:\n", b"Traceback (most recent call last):\n", b'  File "a", line 1, in f\n',
    b"RuntimeError: x", b"99999999999999999999999999", b"\xff", b"\r",
]), max_size=80).map(b"".join))
def test_marker_shaped_garbage_never_raises(data):
    s = LogScanner()
    for i in range(0, len(data), 7):
        s.feed(data[i:i + 7])
    s.finish(ExitRecord(1))
    assert s.internal_errors == 0  # no line had to be skipped by the safety net either


def _comparable(d):
    x = d.to_dict()
    x.pop("summary")
    x["evidence"] = [(e["rule"], e["text"]) for e in x["evidence"] if e["rule"] != "tail"]
    # an unknown's candidates point at the same lines, numbered after the prepended sample
    x["candidates"] = [(c["category"], [ln["text"] for ln in c["lines"]]) for c in x.get("candidates", ())]
    return x


SAMPLE_TEXT = st.lists(st.sampled_from([
    ILLEGAL, tb(OOM, 3), b"OSError: [Errno 28] No space left on device\n", b"Memory access fault by GPU node-2\n",
    b"{'loss': nan, 'grad_norm': nan}\n" * 3, b"HIP out of memory\n", b"Killed\n", b"exitcode  : -9 (pid: 1)\n",
    b"ValueError: Some keys are not used by the HfArgumentParser: ['a']\n", b"  Total optimization steps = 5\n",
    b" 50%|#  | 5/10 [00:01<00:01, 5.00it/s]\n", b"NCCL error\n", b"ROCm gfx942 MI300X\n", b"plain words\n",
]), min_size=1, max_size=6).map(b"".join)
CASES = fixture_cases()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CASES), text=SAMPLE_TEXT)
def test_text_in_a_printed_sample_never_changes_the_verdict(case, text):
    log, _side, exit, host = load_case(case)
    plain = diagnose_bytes(log, exit, host)
    with_sample = diagnose_bytes(sample_block(text) + log, exit, host)
    assert _comparable(with_sample) == _comparable(plain)


def test_launch_failure_is_could_not_start():
    d = diagnose_bytes(b"", ExitRecord(returncode=127, launch_error="cannot start 'llamafactory-cli' in '/nope': "
                                                                   "[Errno 2] No such file or directory"))
    assert d.category is Category.CONFIG_ERROR and d.subkind == "launch_failed"
    assert d.summary.startswith("could not start: cannot start 'llamafactory-cli'")
    log = b"oom-supervisor: cannot start 'python' in '/tmp/x': embedded null byte\n"
    d2 = diagnose_bytes(log, ExitRecord(returncode=127))
    assert d2.category is Category.CONFIG_ERROR and "could not start" in d2.summary
    assert d2.evidence[0].line_no == 1


def test_memory_held_by_others_and_reserved_unallocated_are_numbers():
    d = diagnose_bytes(tb(OOM), ExitRecord(1))
    n = d.numbers
    assert n["held_by_others"] == int((79.14 - 1.00 - 8.00) * GIB)
    assert n["reserved_unallocated"] == 512 * 2**20


def test_fingerprint_is_stable_across_attempts_and_tells_failures_apart():
    a = diagnose_bytes(HEALTHY + tb(b"[rank3]: " + OOM, 3), ExitRecord(1))
    other = OOM.replace(b"2.00 GiB", b"1.00 GiB").replace(b"79.14", b"191.98")
    b = diagnose_bytes(HEALTHY * 2 + tb(b"[rank1]: " + other, 1), ExitRecord(1))
    assert a.fingerprint and a.fingerprint == b.fingerprint
    c = diagnose_bytes(tb(b"KeyError: 'labels'"), ExitRecord(1))
    d = diagnose_bytes(tb(b"KeyError: 'input_ids'"), ExitRecord(1))
    assert c.fingerprint != a.fingerprint and c.fingerprint != d.fingerprint
    e = diagnose_bytes(tb(b'FileNotFoundError: [Errno 2] No such file: "/data/run7/x_0x7f3a.json"'), ExitRecord(1))
    f = diagnose_bytes(tb(b'FileNotFoundError: [Errno 2] No such file: "/data/run8/x_0x1b2c.json"'), ExitRecord(1))
    assert e.fingerprint == f.fingerprint


def _logged(loss, grad="0.5"):
    return b"{'loss': %s, 'grad_norm': %s, 'learning_rate': 1e-05, 'epoch': 0.1}\n" % (loss, grad.encode())


def test_numeric_failure_is_watched_live_after_three_logged_steps():
    s = LogScanner()
    assert s.feed(HEALTHY + _logged(b"nan") + _logged(b"nan")) == []
    fatal = s.feed(_logged(b"nan"))
    assert [e.rule for e in fatal] == ["numeric_run"]
    assert s.feed(_logged(b"nan")) == []  # once
    d = s.finish(ExitRecord(returncode=-15, stopped_by="fatal_signal"))
    assert (d.category, d.subkind, d.strength) == (Category.NUMERIC, "nan_loss", "structural")
    assert "3 logged steps in a row" in d.summary


def test_grad_norm_inf_and_zero_loss_runs():
    s = LogScanner()
    fatal = s.feed(b"".join(_logged(b"1.5", "inf") for _ in range(3)))
    assert [e.rule for e in fatal] == ["numeric_run"]
    assert s.finish(ExitRecord(1)).subkind == "nonfinite_grad_norm"
    z = LogScanner()
    assert [e.rule for e in z.feed(_logged(b"0.0") * 3)] == ["numeric_run"]
    assert z.finish(ExitRecord(1)).subkind == "zero_loss"


def test_an_interrupted_run_of_bad_steps_and_early_loss_scale_calibration_do_not_trigger():
    s = LogScanner()
    calib = b"".join(b"[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: %d, reducing to %d\n"
                     % (2**k, 2**(k - 1)) for k in range(16, 8, -1))
    log = calib + _logged(b"nan") + _logged(b"nan") + _logged(b"1.2") + _logged(b"nan") + _logged(b"inf")
    assert s.feed(log) == []
    assert s.finish(ExitRecord(0)).category is Category.SUCCESS


def test_hints_never_decide_a_terminal_category():
    for line in (b"RuntimeError: CUDA error: an illegal memory access was encountered",
                 b"ValueError: Some keys are not used by the HfArgumentParser: ['x']",
                 b"RuntimeError: Function 'LogSoftmaxBackward0' returned nan values in its 0th output."):
        d = diagnose_bytes(HEALTHY + line + b"\n" + GOES_ON, ExitRecord(1))  # printed, then training went on
        assert d.strength == "hint" and d.category not in (
            Category.DEVICE_FAULT, Category.DISK_FULL, Category.NUMERIC), (line, d)
        s = diagnose_bytes(tb(line), ExitRecord(1))
        assert s.strength == "structural" and s.category is not Category.CRASH_OTHER, (line, s)


def test_diagnosis_round_trips_with_the_new_fields():
    d = diagnose_bytes(tb(OOM), ExitRecord(1))
    assert dataclasses.replace(d) == type(d).from_dict(d.to_dict())


# --- phase attribution (issue 10) ------------------------------------------------------------
BAR2000 = b"\r 25%%|##5       | %d/2000 [10:00<30:00,  1.11it/s]"
SAVE500 = b"[INFO|trainer.py:3815] 2026-11-29 01:10:20,001 >> Saving model checkpoint to out/checkpoint-500\n"
HIP_OOM = (b"torch.OutOfMemoryError: HIP out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of "
           b"191.98 GiB of which 512.00 MiB is free.")


def _run_to_500():
    return (b"  Total optimization steps = 2000\n" + b"".join(BAR2000 % s for s in range(480, 501)) + b"\n" + SAVE500)


def test_an_oom_in_the_step_after_a_checkpoint_save_is_a_train_step_oom_deep_traceback():
    """The save line is the last marker and the bar still shows 500 (tqdm redraws when step 501
    ends), but the traceback (deeper than the frames kept) starts in training_step."""
    frames = b'  File "/x/transformers/trainer.py", line 2555, in _inner_training_loop\n    x\n'
    frames += b'  File "/x/transformers/trainer.py", line 3745, in training_step\n    x\n'
    frames += b"".join(b'  File "/x/torch/nn/modules/module.py", line 1775, in _call_impl\n    x\n' for _ in range(100))
    log = _run_to_500() + b"Traceback (most recent call last):\n" + frames + HIP_OOM + b"\n"
    d = diagnose_bytes(log, ExitRecord(1))
    assert (d.category, d.phase.value) == (Category.GPU_OOM, "train_step"), d.summary


def test_an_oom_after_the_bar_advanced_past_the_saved_step_is_a_train_step_oom_without_frames():
    log = _run_to_500() + BAR2000 % 501 + b"\n" + tb(HIP_OOM).replace(b"training_step", b"forward")
    d = diagnose_bytes(log, ExitRecord(1))
    assert (d.category, d.phase.value) == (Category.GPU_OOM, "train_step"), d.summary
    glued = _run_to_500() + BAR2000 % 501 + b"[rank0]: " + HIP_OOM + b"\n"  # the bar and the line on one line
    assert diagnose_bytes(glued, ExitRecord(1)).phase.value == "train_step"


def test_an_oom_while_saving_is_still_a_checkpoint_save_oom():
    save_tb = (b"Traceback (most recent call last):\n"
               b'  File "/x/transformers/trainer.py", line 3172, in _save_checkpoint\n    x\n' + HIP_OOM + b"\n")
    d = diagnose_bytes(_run_to_500() + save_tb, ExitRecord(1))
    assert d.phase.value == "checkpoint_save"
    bare = _run_to_500() + HIP_OOM + b"\n"  # no step advanced since the save line
    assert diagnose_bytes(bare, ExitRecord(1)).phase.value == "checkpoint_save"


def test_a_completed_save_marker_ends_the_checkpoint_phase():
    done = b"[2026-11-29 01:10:40,000] [INFO] [engine.py:3600:_save_zero_checkpoint] zero checkpoint saved out/checkpoint-500/global_step500\n"
    done += b"[2026-11-29 01:10:41,000] [INFO] [torch_checkpoint_engine.py:33:commit] [Torch] Checkpoint global_step500 is ready now!\n"
    d = diagnose_bytes(_run_to_500() + done + b"[rank0]: " + HIP_OOM + b"\n", ExitRecord(1))
    assert d.phase.value == "train_step", d.summary


def test_loss_scale_stuck_at_its_minimum_stops_live_but_calibration_does_not():
    calib = b"".join(b"[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: %d, reducing to %d\n"
                     % (2**k, 2**(k - 1)) for k in range(16, 10, -1))
    s = LogScanner()
    assert s.feed(calib) == []
    stuck = b"[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 1, reducing to 1\n"
    assert s.feed(stuck * 2) == []
    assert [e.rule for e in s.feed(stuck)] == ["numeric_run"]
    d = s.finish(ExitRecord(returncode=-15, stopped_by="fatal_signal"))
    assert (d.category, d.subkind) == (Category.NUMERIC, "loss_scale_at_minimum")
    apex = LogScanner()
    line = b"Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 1.0\n"
    assert [e.rule for e in apex.feed(line * 3)] == ["numeric_run"]


def test_the_supervisors_memory_limit_enforcement_is_host_oom_evidence():
    host = HostEvidence(limit_enforced_kill=True, memory_limit_bytes=300 << 20, peak_rss_bytes=857 << 20)
    d = diagnose_bytes(b"working\n", ExitRecord(returncode=-9, signal="SIGKILL", stopped_by="memory_limit"), host)
    assert (d.category, d.strength) == (Category.HOST_OOM, "structural"), d.summary
    assert "over the job's limit" in d.summary
    bare = diagnose_bytes(b"working\n", ExitRecord(returncode=-9, signal="SIGKILL"), HostEvidence())
    assert bare.category is Category.CRASH_OTHER


def test_an_oom_before_the_bar_total_is_known_is_judged_the_same_however_the_log_is_chunked():
    """Found by hypothesis: cut after the first byte, the bar's total was learnt only after the OOM line,
    so 'training continued afterwards' was not seen and the verdict differed from the whole log's."""
    data = (b"[rank3]: torch.OutOfMemoryError: HIP out of memory. Tried to allocate 124.00 MiB. GPU 0 has a total "
            b"capacity of 19.94 GiB of which 554.47 MiB is free.\n  3%|\xe2\x96\x88    | 30/1000 [00:10<05:00,  3.21it/s]\n")
    whole = diagnose_bytes(data)
    s = LogScanner()
    s.feed(data[:1])
    s.feed(data[1:])
    assert s.finish().to_dict() == whole.to_dict()


def test_an_unclosed_traceback_does_not_disable_the_flood_fast_path():
    import time

    flood = b"".join(b"[rank0]: Error: sample %d skipped (CUDA out of memory. Tried to allocate 2.00 GiB)\n" % i
                     for i in range(40000))
    s = LogScanner()
    s.feed(b"Traceback (most recent call last):\n")  # never closed
    t0 = time.perf_counter()
    s.feed(flood)
    fast = time.perf_counter() - t0
    s2 = LogScanner(max_evidence_per_rule=10**9)  # nothing is ever "full": every line is read
    t0 = time.perf_counter()
    s2.feed(flood[: len(flood) // 8])
    slow_per_line = (time.perf_counter() - t0) / 5000
    assert fast / 40000 < slow_per_line / 3, (fast, slow_per_line)
    s.feed(b"epoch 2 begins\n")  # not the log's last word: the flood stays text
    assert s.finish(ExitRecord(1)).evidence[0].line_no == 2  # the earliest hint is still the evidence


def test_a_healthy_logged_step_between_bad_ones_resets_the_run_across_chunks():
    s = LogScanner()
    assert s.feed(_logged(b"nan") * 2) == []
    assert s.feed(_logged(b"1.25")) == []  # healthy: not even a candidate line
    assert s.feed(_logged(b"nan") * 2) == []
    assert [e.rule for e in s.feed(_logged(b"nan"))] == ["numeric_run"]
    t = LogScanner()
    assert t.feed(_logged(b"nan")) == [] and t.feed(_logged(b"inf")) == []
    assert [e.rule for e in t.feed(_logged(b"nan"))] == ["numeric_run"]


def test_a_real_traceback_after_a_keyword_flood_in_one_buffer_is_the_verdict():
    """Found by bench --flood: the flood's skipped lines, read back at the end, replaced the
    newer structural OOM as the rule's latest finding."""
    flood = b"".join(b"[rank1]: ValueError: sample %d: CUDA out of memory. Tried to allocate 2.00 GiB (dataset)\n" % i
                     for i in range(200))
    d = diagnose_bytes(flood + tb(b"[rank3]: " + OOM, 3), ExitRecord(1))
    assert (d.category, d.strength, d.rank) == (Category.GPU_OOM, "structural", 3), d.summary


def _bar1000(step):
    return b"\r  %d%%|#   | %d/1000 [01:00<09:00,  1.66it/s]" % (step // 10, step)


def _overflow(scale):
    return b"\n[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: %d, reducing to %d\n" % (scale, scale // 2)


def test_repeated_overflows_after_calibration_stop_the_attempt_live():
    head = b"  Total optimization steps = 1000\n"
    calib = b"".join(_bar1000(s) + _overflow(2 ** (17 - s)) for s in range(1, 15))  # steps 1-14: normal
    healthy = b"".join(_bar1000(s) + b"\n" for s in range(15, 200)) + _bar1000(200) + _overflow(2048)  # one late overflow
    s = LogScanner()
    assert s.feed(head + calib + healthy) == []
    storm = b"".join(_bar1000(st) + _overflow(1024) for st in range(201, 212))
    fatal = s.feed(storm)
    assert [e.rule for e in fatal] == ["numeric_run"]
    d = s.finish(ExitRecord(returncode=-15, stopped_by="fatal_signal"))
    assert (d.category, d.subkind) == (Category.NUMERIC, "repeated_overflow"), d.summary


def test_a_bar_drawn_before_the_total_is_known_counts_the_same_however_the_log_is_chunked():
    """Found by hypothesis: whole, the bar before 'Total optimization steps' was counted (same chunk);
    cut between the two lines, it was not."""
    data = b"\x1b[31m  3%|\xe2\x96\x88    | 30/1000 [00:10<05:00,  3.21it/s]\nTotal optimization steps = 1,000\n"
    whole = diagnose_bytes(data)
    s = LogScanner()
    cut = data.index(b"Total")
    s.feed(data[:cut])
    s.feed(data[cut:])
    assert s.finish().to_dict() == whole.to_dict()
    oom_glued = (b"\x1b[31m  3%|\xe2\x96\x88    | 30/1000 [00:10<05:00,  3.21it/s]\n[rank3]: torch.OutOfMemoryError: HIP "
                 b"out of memory. Tried to allocate 124.00 MiB.Total optimization steps = 1,000\n")
    s2 = LogScanner()
    s2.feed(oom_glued[:1])
    s2.feed(oom_glued[1:])
    assert s2.finish().to_dict() == diagnose_bytes(oom_glued).to_dict()


def test_a_connection_failure_between_ranks_stays_a_comm_failure():
    d = diagnose_bytes(tb(b"torch.distributed.DistStoreError: ConnectionResetError: [Errno 104] Connection reset by "
                          b"peer (c10d store at 10.0.0.1:29500)"), ExitRecord(1))
    assert d.category is Category.COMM_FAILURE, d.summary
    h = diagnose_bytes(tb(b"requests.exceptions.ConnectionError: HTTPSConnectionPool(host='huggingface.co', port=443): "
                          b"Max retries exceeded (Caused by NameResolutionError)"), ExitRecord(1))
    assert h.category is Category.ENVIRONMENT, h.summary


def test_held_by_others_needs_this_processes_own_figure():
    listed_only = (b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                   b"of 79.14 GiB of which 1.00 GiB is free. Process 4242 has 70.00 GiB memory in use.")
    assert "held_by_others" not in diagnose_bytes(tb(listed_only), ExitRecord(1)).numbers
    both = listed_only + b" Including non-PyTorch memory, this process has 8.00 GiB memory in use."
    assert diagnose_bytes(tb(both), ExitRecord(1)).numbers["held_by_others"] == int((79.14 - 1.00 - 8.00) * GIB)


def test_a_sample_block_ends_with_its_labels_when_no_logger_line_follows():
    """LLAMAFACTORY_VERBOSITY=WARN: no "[INFO|" line after the sample; a real crash right after it counts."""
    quiet = (b"training example:\ninput_ids:\n[1, 2, 3]\ninputs:\n<|im_start|>user\nRuntimeError: CUDA error: an illegal "
             b"memory access was encountered\n<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\nlabel_ids:\n[-100, 3]\n"
             b"labels:\nok, see:\nOSError: [Errno 28] No space left on device\nbye<|im_end|>\n")
    s = LogScanner()
    fatal = s.feed(quiet + tb(OOM))
    assert [e.rule for e in fatal] == ["torch_oom"]
    d = s.finish(ExitRecord(1))
    assert (d.category, d.strength) == (Category.GPU_OOM, "structural")
    assert not any(e.rule in ("no_space", "illegal_memory_access") for e in d.evidence)
    pairwise = (b"chosen_input_ids:\n[1]\nchosen_inputs:\nx</s>\nchosen_label_ids:\n[1]\nchosen_labels:\nx</s>\n"
                b"rejected_input_ids:\n[2]\nrejected_inputs:\nRuntimeError: CUDA error: an illegal memory access "
                b"was encountered</s>\nrejected_label_ids:\n[2]\nrejected_labels:\ny</s>\n")
    p = LogScanner()
    assert [e.rule for e in p.feed(pairwise + tb(OOM))] == ["torch_oom"]
