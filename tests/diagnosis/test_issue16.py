"""Issue 16's cases (and the diagnosis items of issues 19 and 20), each reproduced as a log.

Every structural form the diagnosis now reads comes with its twin: the same text printed as data
(inside a printed sample, or followed by training that goes on) does not act.
"""

from __future__ import annotations

import pytest

from supervisor.core.models import (
    Category,
    DecisionKind,
    ExitRecord,
    HostEvidence,
    Overrides,
    Phase,
)
from supervisor.judge.diagnosis import LogScanner, diagnose_bytes
from supervisor.judge.policy import decide
from supervisor.judge.policy.schema import BUILTIN_POLICY_DIR, load_policy
from tests.diagnosis.test_trust import HEALTHY, sample_block
from tests.policy.builders import attempt, job

GIB = 2**30
# Training that goes on after a line: the bar advances past where HEALTHY left it.
GOES_ON = b"".join(b"\r %d%%|#   | %d/100 [00:10<00:10,  5.00it/s]" % (i, i) for i in range(40, 45)) + b"\n"


@pytest.fixture(scope="module")
def default_policy():
    return load_policy("default", search_dirs=[BUILTIN_POLICY_DIR])
TB_HEAD = b"Traceback (most recent call last):\n"
FRAME = b'  File "/opt/venv/lib/python3.11/site-packages/transformers/trainer.py", line 3745, in training_step\n'
CODE = b"    self.accelerator.backward(loss, **kwargs)\n"
CUDA_OOM = (b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            b"79.14 GiB of which 1.00 GiB is free. Including non-PyTorch memory, this process has 78.13 GiB memory in "
            b"use. Of the allocated memory 75.00 GiB is allocated by PyTorch, and 1.50 GiB is reserved by PyTorch but "
            b"unallocated.")
TEARDOWN = (b"[2026-11-28 23:41:07,000] [INFO] [launch.py:315:sigkill_handler] Killing subprocess 4242\n"
            b"[2026-11-28 23:41:07,100] [ERROR] [launch.py:321:sigkill_handler] ['python', '-u', 'train.py'] exits with "
            b"return code = 1\n")


def prefixed(prefix: bytes, body: bytes) -> bytes:
    return b"".join(prefix + line + b"\n" for line in body.rstrip(b"\n").split(b"\n"))


PY_TB = TB_HEAD + FRAME + CODE + CUDA_OOM + b"\n"

# --- case 1: each structural form, what it decides, and its twin printed as data --------------------------
FORMS = {
    # prefixes on every line of a traceback
    "ray_actor": (prefixed(b"(RayTrainWorker pid=48213, ip=10.0.0.7) ", PY_TB), Category.GPU_OOM),
    "srun_label": (prefixed(b"3: ", PY_TB), Category.GPU_OOM),
    "orchestrator_timestamp_tag": (prefixed(b"2026-11-28T23:41:07.123456789Z stderr F ", PY_TB), Category.GPU_OOM),
    "compose_service": (prefixed(b"trainer-1  | ", PY_TB), Category.GPU_OOM),
    "logging_format": (prefixed(b"2026-11-28 23:41:07,123 - worker - ERROR - ", PY_TB), Category.GPU_OOM),
    # chained: the disk filled while a checkpoint was written; the handler failed afterwards
    "chained_disk_full": (
        TB_HEAD + b'  File "/opt/venv/lib/python3.11/site-packages/torch/serialization.py", line 652, in save\n'
        + b"    _save(obj, opened_zipfile, pickle_module, pickle_protocol)\n"
        + b"OSError: [Errno 28] No space left on device\n\nDuring handling of the above exception, another exception "
        + b"occurred:\n\n" + TB_HEAD
        + b'  File "/opt/venv/lib/python3.11/site-packages/transformers/trainer.py", line 3172, in _save_checkpoint\n'
        + b"    self.save_model(output_dir, _internal_call=True)\n"
        + b"RuntimeError: [enforce fail at inline_container.cc:603] . unexpected pos 4325376 vs 4325270\n",
        Category.DISK_FULL),
    # a traceback whose header was cut by whoever pasted it
    "cut_header": (FRAME + CODE + b"ValueError: Undefined dataset alpaca_zh in dataset_info.json.\n",
                   Category.CONFIG_ERROR),
    # the last error of the log, no traceback at all, then only teardown
    "final_error_line": (b"ValueError: Some keys are not used by the HfArgumentParser: ['compute_type']\n" + TEARDOWN,
                         Category.CONFIG_ERROR),
    "loss_scaler_exception": (b"Exception: Current loss scale already at minimum - cannot decrease scale anymore. "
                              b"Exiting run.\n" + TEARDOWN, Category.NUMERIC),
    # C++ blocks and runtime aborts
    "cxx_terminate_what": ((b"terminate called after throwing an instance of 'c10::Error'\n"
                           b"  what():  CUDA error: an illegal memory access was encountered\n"
                           b"Exception raised from c10_cuda_check_implementation at ../c10/cuda/CUDAException.cpp:44 "
                           b"(most recent call first):\nframe #0: c10::Error::Error(c10::SourceLocation, std::string) "
                           b"+ 0x57 (0x7f1b1fd134d7 in /opt/venv/lib/python3.11/site-packages/torch/lib/libc10.so)\n"),
                           Category.DEVICE_FAULT),
    "nccl_watchdog_terminated": (
        (b"[rank1]:[E1128 02:07:08.408000000 ProcessGroupNCCL.cpp:1595] [PG 0 (default_pg) Rank 1] Process group "
        b"watchdog thread terminated with exception: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO "
        b"for details), NCCL version 2.21.5\nException raised from checkForNCCLErrorsInternal at "
        b"../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2027 (most recent call first):\n"),
        Category.COMM_FAILURE),
    "rocm_memory_access_fault": ((b"Memory access fault by GPU node-2 (Agent handle: 0x55d1c2a1e2b0) on address "
                                 b"0x7f1c00000000. Reason: Page not present or supervisor privilege.\n"),
                                 Category.DEVICE_FAULT),
    "hsa_queue_abort": ((b":0:rocdevice.cpp            :3586: 93411680345 us:  Callback: Queue 0x77ef1a200000 aborting "
                        b"with error : HSA_STATUS_ERROR_EXCEPTION: An HSAIL operation resulted in a hardware "
                        b"exception. code: 0x1016\n"), Category.DEVICE_FAULT),
    # launchers and shells: the kill (no host evidence gathered: unknown, host_oom the likeliest; test_bare_kill.py)
    "deepspeed_launcher_minus9": ((b"[2023-11-13 16:59:55,650] [ERROR] [launch.py:320:sigkill_handler] ['/opt/conda/"
                                  b"bin/python', '-u', 'train.py', '--local_rank=1'] exits with return code = -9\n"),
                                  Category.UNKNOWN),
    "shell_killed_zh_cn": (b"x_test shape = (461851, 5, 5, 244), type = float64\n\xe5\xb7\xb2\xe6\x9d\x80\xe6\xad\xbb\n",
                           Category.UNKNOWN),
    "dataloader_shm_bus_error": ((b"ERROR: Unexpected bus error encountered in worker. This might be caused by "
                                 b"insufficient shared memory (shm).\n"), Category.HOST_OOM),
    # fp16 loss-scale collapse as overflow lines only
    "loss_scale_collapse": (b"".join(b"[2023-06-07 22:16:00,018] [INFO] [loss_scaler.py:181:update_scale] [deepspeed] "
                                     b"OVERFLOW! Rank 0 Skipping step. Attempted loss scale: %d, reducing to %d\n"
                                     % (2**k, 2**(k - 1)) for k in range(6, 1, -1)), Category.NUMERIC),
    # allocators outside PyTorch
    "tensorflow_oom": ((b"tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor "
                       b"with shape[32,1024,1024] and type float on /job:localhost/replica:0/task:0/device:GPU:0 by "
                       b"allocator GPU_0_bfc\n"), Category.GPU_OOM),
    "xla_oom": ((b"jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                b"17179869184 bytes.\n"), Category.GPU_OOM),
    "ggml_oom": ((b"ggml_backend_cuda_buffer_type_alloc_buffer: allocating 144817.04 MiB on device 0: cudaMalloc "
                 b"failed: out of memory\nllama_model_load: error loading model: unable to allocate CUDA0 buffer\n"),
                 Category.GPU_OOM),
}
TRACEBACK_FORMS = {"ray_actor", "srun_label", "orchestrator_timestamp_tag", "compose_service", "logging_format",
                   "chained_disk_full"}


@pytest.mark.parametrize("name", sorted(FORMS))
def test_each_structural_form_decides(name):
    log, want = FORMS[name]
    d = diagnose_bytes(HEALTHY + log, ExitRecord(returncode=1))
    assert d.category is want, d.summary
    if want is Category.UNKNOWN:  # a kill alone is not proof: where to look, not a verdict
        assert d.candidates[0].category is Category.HOST_OOM and "SIGKILL" in d.summary, (d.summary, d.candidates)
    else:
        assert d.strength == "structural", d.summary


@pytest.mark.parametrize("name", sorted(FORMS))
def test_each_structural_form_printed_in_a_sample_does_not_act(name):
    log, want = FORMS[name]
    s = LogScanner()
    assert s.feed(sample_block(log) + HEALTHY) == []
    d = s.finish(ExitRecord(returncode=1))
    if want is Category.UNKNOWN:  # a kill form: printed, it is no kill (nothing says SIGKILL)
        assert "SIGKILL" not in d.summary, d.summary
    else:
        assert d.category is not want or d.strength == "hint", d.summary
    assert s.samples_skipped == 1


@pytest.mark.parametrize("name", sorted(set(FORMS) - TRACEBACK_FORMS))
def test_each_form_without_a_traceback_does_not_act_when_training_goes_on(name):
    log, want = FORMS[name]
    s = LogScanner()
    assert s.feed(HEALTHY + log + GOES_ON) == []  # never a live teardown
    d = s.finish(ExitRecord(returncode=1))
    assert d.strength == "hint" or d.category in (Category.UNKNOWN, Category.CRASH_OTHER), d.summary
    assert not (d.category is want and d.strength == "structural"), d.summary


@pytest.mark.parametrize("name", sorted(TRACEBACK_FORMS - {"chained_disk_full"}))
def test_a_prefixed_traceback_is_torn_down_live_and_names_its_rank(name):
    s = LogScanner()
    assert [e.rule for e in s.feed(HEALTHY + FORMS[name][0])] == ["torch_oom"]
    if name == "srun_label":
        assert s.finish(ExitRecord(1)).rank == 3


def test_chained_exceptions_the_first_is_the_cause():
    d = diagnose_bytes(FORMS["chained_disk_full"][0], ExitRecord(1))
    assert (d.category, d.subkind, d.evidence[0].line_no) == (Category.DISK_FULL, "no_space", 4), d.summary
    assert d.phase is Phase.CHECKPOINT_SAVE


# --- case 2: a pt-stage sample (no labels:) never ended and swallowed a real OOM ------------------------
PT_SAMPLE = (b"training example:\ninput_ids:\n[791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679, 13, 128001]\n"
             b"inputs:\nThe quick brown fox jumps over the lazy dog.<|end_of_text|>\n")


def test_case2_a_pt_sample_block_ends_at_the_progress_bar_and_the_oom_after_it_decides():
    bar = b"".join(b"\r  %d%%|#         | %d/100 [00:%02d<01:40,  1.01s/it]" % (s, s, s) for s in range(4)) + b"\n"
    log = PT_SAMPLE + bar + PY_TB
    s = LogScanner()
    assert [e.rule for e in s.feed(log)] == ["torch_oom"]  # torn down live, as any real OOM
    d = s.finish(ExitRecord(returncode=1))
    assert (d.category, d.strength, d.phase) == (Category.GPU_OOM, "structural", Phase.TRAIN_STEP), d.summary
    assert s.samples_skipped == 1


def test_case2_a_pt_sample_whose_text_holds_a_traceback_is_still_not_evidence():
    doc = (b"inputs:\nA log from our cluster:\nTraceback (most recent call last):\n" + FRAME + CODE
           + b"RuntimeError: CUDA error: an illegal memory access was encountered\nwhich we fixed.<|end_of_text|>\n")
    log = b"training example:\ninput_ids:\n[1, 2, 3]\n" + doc + HEALTHY
    s = LogScanner()
    assert s.feed(log) == []
    d = s.finish(ExitRecord(returncode=1))
    assert d.category is not Category.DEVICE_FAULT, d.summary
    # and a real crash right after such a sample, no logger line between: read (late), decided
    crash = b"training example:\ninput_ids:\n[1, 2, 3]\n" + doc + PY_TB
    assert diagnose_bytes(crash, ExitRecord(1)).category is Category.GPU_OOM


# --- case 3: memory held by others, seen from a container (and on ROCm) ---------------------------------
CONTAINER_OOM = (b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                 b"capacity of 79.14 GiB of which 1.00 GiB is free. Process 999 has 70.00 GiB memory in use. Process "
                 b"4242 has 8.10 GiB memory in use. Of the allocated memory 7.10 GiB is allocated by PyTorch, and "
                 b"512.00 MiB is reserved by PyTorch but unallocated.")


def test_case3_container_oom_counts_the_other_process_and_the_policy_waits(default_policy):
    d = diagnose_bytes(TB_HEAD + FRAME + CODE + CONTAINER_OOM + b"\n", ExitRecord(1))
    assert d.category is Category.GPU_OOM
    n = d.numbers
    assert n["process_in_use"] == round(8.10 * GIB)  # the one whose use covers PyTorch's 7.6 GiB
    assert abs(n["held_by_others"] - (79.14 - 1.00 - 8.10) * GIB) < 2**20
    assert "held by other processes" in d.summary
    j = job({"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2})
    decision = decide(j, [attempt(1, Overrides(), d)], d, default_policy)
    assert decision.kind == DecisionKind.RETRY, decision.reason  # wait: the job unchanged, not halved for good
    assert "other processes hold" in decision.reason


def test_case3_rocm_lists_no_process_and_says_what_cannot_be_told_apart(default_policy):
    rocm = (b"torch.OutOfMemoryError: HIP out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            b"191.98 GiB of which 1.00 GiB is free. Of the allocated memory 100.00 GiB is allocated by PyTorch, and "
            b"2.00 GiB is reserved by PyTorch but unallocated.")
    d = diagnose_bytes(TB_HEAD + FRAME + CODE + rocm + b"\n", ExitRecord(1))
    assert d.numbers["not_held_by_pytorch"] == round((191.98 - 1.00 - 102.00) * GIB)
    assert 80 * GIB < d.numbers["held_by_others"] < d.numbers["not_held_by_pytorch"]
    assert "cannot tell other processes from this process's non-PyTorch memory" in d.summary
    assert decide(job(), [attempt(1, Overrides(), d)], d, default_policy).kind == DecisionKind.RETRY
    # the job's own context and buffers alone (a few GiB) are not someone else's
    own = rocm.replace(b"100.00 GiB is allocated", b"186.00 GiB is allocated")
    assert "held_by_others" not in diagnose_bytes(TB_HEAD + FRAME + CODE + own + b"\n", ExitRecord(1)).numbers


# --- case 4: a hang after an OOM ------------------------------------------------------------------------
def test_case4_a_hang_after_an_oom_remedies_the_oom(default_policy):
    log = (HEALTHY + b"[rank3]: " + CUDA_OOM + b"\n"
           + b"[rank0]:[W1128 02:07:08.408 ProcessGroupNCCL.cpp:1234] Warning: waiting for rank 3 in allreduce\n")
    s = LogScanner()
    assert s.feed(log) == []  # free text never tears anything down by itself
    d = s.finish(ExitRecord(returncode=-9, signal="SIGKILL", stopped_by="hang"))
    assert d.category is Category.GPU_OOM, d.summary
    assert "a hang after an OOM on rank 3 at line 5" in d.summary
    j = job({"per_device_train_batch_size": 8})
    decision = decide(j, [attempt(1, Overrides(), d)], d, default_policy)
    assert decision.kind == DecisionKind.ESCALATE, decision.reason  # not the same configuration again
    # no OOM in the attempt: still a hang
    assert diagnose_bytes(HEALTHY, ExitRecord(-9, "SIGKILL", stopped_by="hang")).category is Category.HANG
    # an OOM that training went on after is not the cause
    handled = HEALTHY + b"[rank3]: " + CUDA_OOM + b"\n" + GOES_ON
    assert diagnose_bytes(handled, ExitRecord(-9, "SIGKILL", stopped_by="hang")).category is Category.HANG


# --- issue 19: a failure while a checkpoint is loaded ---------------------------------------------------
RESUME = (b"[INFO|trainer.py:3343] 2026-12-02 03:41:21,934 >> Loading model from /data/out/checkpoint-6.\n"
          b"[INFO|trainer.py:1469] 2026-12-02 03:41:23,683 >> ***** Running training *****\n"
          b"[INFO|trainer.py:1478] 2026-12-02 03:41:23,683 >>   Total optimization steps = 9\n"
          b"[INFO|trainer.py:1482] 2026-12-02 03:41:23,683 >>   Resuming training from checkpoint with epoch 0 and "
          b"global step 6\n")  # transformers' own lines, from a real resume of the tiny model


def test_checkpoint_load_phase_for_gpu_and_host_ooms():
    cpu = (b"RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
           b"tried to allocate 36028797018963968 bytes. Error code 12 (Cannot allocate memory)\n")
    d = diagnose_bytes(RESUME + cpu, ExitRecord(1))
    assert (d.category, d.phase) == (Category.HOST_OOM, Phase.CHECKPOINT_LOAD), d.summary
    killed = diagnose_bytes(RESUME, ExitRecord(-9, "SIGKILL"), HostEvidence(cgroup_oom_kills=1))
    assert (killed.category, killed.phase) == (Category.HOST_OOM, Phase.CHECKPOINT_LOAD), killed.summary
    ds = (b"[2026-12-02 03:41:22,001] [INFO] [torch_checkpoint_engine.py:36:load] [Torch] Begin Load checkpoint from "
          b"/data/out/checkpoint-6/global_step6/zero_pp_rank_0_mp_rank_00_optim_states.pt...\n")
    g = diagnose_bytes(ds + b"[rank0]: " + CUDA_OOM + b"\n", ExitRecord(1))
    assert (g.category, g.phase) == (Category.GPU_OOM, Phase.CHECKPOINT_LOAD), g.summary
    frames = (TB_HEAD + b'  File "/opt/venv/lib/python3.11/site-packages/transformers/trainer.py", line 3566, in '
              b"_load_optimizer_and_scheduler\n    x\n" + CUDA_OOM + b"\n")
    assert diagnose_bytes(frames, ExitRecord(1)).phase is Phase.CHECKPOINT_LOAD
    # once a training step ran, it is a training OOM again
    bar = b"\r 78%|#######   | 7/9 [00:02<00:00,  3.28it/s]\n"
    assert diagnose_bytes(RESUME + bar + cpu, ExitRecord(1)).phase is Phase.TRAIN_STEP
    assert Phase("resume") is Phase.CHECKPOINT_LOAD  # records written before keep reading


# --- issue 20: what only launch can tell about a config is a config error, never a retry ----------------
@pytest.mark.parametrize("fixture", ["config_llamafactory_offline_model_not_cached", "config_llamafactory_no_dataset_key"])
def test_launch_time_config_errors_are_not_retried(fixture, default_policy):
    from tests.diagnosis.cases import FIXTURES

    log = (FIXTURES / f"{fixture}.log").read_bytes()
    d = diagnose_bytes(log, ExitRecord(1))
    assert (d.category, d.strength) == (Category.CONFIG_ERROR, "structural"), d.summary
    decision = decide(job(), [attempt(1, Overrides(), d)], d, default_policy)
    assert decision.kind == DecisionKind.FAIL, decision.reason
