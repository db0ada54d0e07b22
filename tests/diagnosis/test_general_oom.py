"""Device and host memory running out in every runtime's own words (issue 29, generalising): the
spellings come from the libraries' raise/log statements, not from log excerpts. Each is a GPU (or host)
OOM as the exception that ends a traceback; the same words printed by a running program do not act."""

import pytest

from supervisor.core.models import Category
from supervisor.judge.diagnosis import diagnose_bytes


def _tb(exc: str) -> bytes:
    return ('Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n    loss.backward()\n'
            + exc + "\n").encode()


GPU = [
    # pytorch aten/src/ATen/mps/MPSAllocator.mm: TORCH_CHECK(false, "MPS backend out of memory (MPS allocated: ...
    ("RuntimeError: MPS backend out of memory (MPS allocated: 17.36 GB, other allocations: 613.56 MB, max allowed:"
     " 18.13 GB). Tried to allocate 192.00 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable"
     " upper limit for memory allocations (may cause system failure)."),
    # pytorch c10/cuda/CUDAMallocAsyncAllocator.cpp: TORCH_CHECK_WITH(OutOfMemoryError, ... "would exceed allowed memory"
    "RuntimeError: Allocation on device 0 would exceed allowed memory. (out of memory)",
    # pytorch c10/cuda/driver_api.h C10_CUDA_DRIVER_CHECK: "CUDA driver error: " + cuGetErrorString
    "RuntimeError: CUDA driver error: out of memory",
    # pytorch aten/src/ATen/native/cuda/CuFFTUtils.h: "cuFFT error: " + _cudaGetErrorEnum (CUFFT_ALLOC_FAILED)
    "RuntimeError: cuFFT error: CUFFT_ALLOC_FAILED",
    # pytorch ATen/cuda/CUDAGeneratorImpl / curand status name
    "RuntimeError: CURAND_STATUS_ALLOCATION_FAILED",
    # tensorflow core/common_runtime/gpu/gpu_util.cc: errors::Internal("Dst tensor is not initialized.")
    # (the destination tensor's GPU allocation failed)
    "tensorflow.python.framework.errors_impl.InternalError: Dst tensor is not initialized.",
    # xla stream_executor_memory_allocator.cc: ResourceExhaustedError("Failed to allocate request for %s (%uB) on ...
    ("jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Failed to allocate request for 1.00GiB (1073741824B)"
     " on device ordinal 0"),
    # deepspeed csrc/transformer/inference/includes/inference_context.h: std::runtime_error("Workspace can't be ...
    "RuntimeError: Workspace can't be allocated, no enough memory.",
    # vllm worker/gpu_model_runner.py _dummy_sampler_run: RuntimeError("CUDA out of memory occurred when warming up ...
    ("RuntimeError: CUDA out of memory occurred when warming up sampler with 256 dummy requests. Please try lowering"
     " `max_num_seqs` or `gpu_memory_utilization` when initializing the engine."),
    # RAPIDS rmm cuda_memory_resource.hpp: RMM_CUDA_TRY_ALLOC -> rmm::out_of_memory (a std::bad_alloc)
    ("MemoryError: std::bad_alloc: out_of_memory: CUDA error at: /rmm/mr/device/cuda_memory_resource.hpp:70:"
     " cudaErrorMemoryAllocation out of memory"),
    # a vendor-named allocator error cut before "Tried to allocate" (torch_npu, XPU)
    "torch.OutOfMemoryError: NPU out of memory",
]


@pytest.mark.parametrize("exc", GPU)
def test_a_runtime_oom_ending_a_traceback_is_gpu_oom(exc):
    d = diagnose_bytes(_tb(exc), None)
    assert d.category is Category.GPU_OOM, (exc, d.summary)
    assert d.strength != "hint", d.summary


def test_paddle_raises_its_gpu_oom_as_memory_error():
    """paddle/fluid/memory/allocation/cuda_allocator.cc: PADDLE_THROW_BAD_ALLOC(ResourceExhausted("\\n\\nOut of
    memory error on GPU %d. Cannot allocate ...")); BadAlloc is a std::bad_alloc, which pybind11 raises as
    MemoryError: the host class, the GPU's words in its message."""
    exc = ("MemoryError: \n\n--------------------------------------\nC++ Traceback (most recent call last):\n"
           "--------------------------------------\n0   paddle::memory::allocation::Allocator::Allocate(unsigned long)\n\n"
           "----------------------\nError Message Summary:\n----------------------\nResourceExhaustedError: \n\n"
           "Out of memory error on GPU 0. Cannot allocate 1.000244GB memory on GPU 0, 14.5GB memory has been"
           " allocated and available memory is only 100.000000MB.")
    d = diagnose_bytes(_tb(exc), None)
    assert d.category is Category.GPU_OOM, d.summary


def test_nccl_cuda_failure_with_its_code_is_gpu_oom():
    """nccl src/include/checks.h CUCHECK: WARN("Cuda failure %d '%s'", err, errStr) under the NCCL error torch
    raises; alloc.h: WARN("Failed to CUDA calloc %ld bytes")."""
    for last in ("Cuda failure 2 'out of memory'", "node1:123:456 [0] NCCL WARN Failed to CUDA calloc 6291456 bytes"):
        exc = ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:121,"
               " unhandled cuda error, NCCL version 2.18.1\nncclUnhandledCudaError: Call to CUDA function failed.\n"
               "Last error:\n" + last)
        d = diagnose_bytes(_tb(exc), None)
        assert d.category is Category.GPU_OOM, (last, d.summary)


HOST = [
    # numpy core/src/multiarray/alloc.c raise_memory_error: _ArrayMemoryError "Unable to allocate %s for an array"
    ("numpy.core._exceptions._ArrayMemoryError: Unable to allocate 7.45 GiB for an array with shape (1000000000,)"
     " and data type float64"),
    # Windows: ERROR_COMMITMENT_LIMIT / paging file (WinError 1455), ENOMEM's "Not enough space"
    "OSError: [WinError 1455] The paging file is too small for this operation to complete.",
    "OSError: [Errno 12] Not enough space",
    # torch/csrc (libshm / MapAllocator.cpp): "unable to mmap %d bytes from file <%s>: %s (%d)" with ENOMEM
    "RuntimeError: unable to mmap 1024 bytes from file </torch_1234_56>: Cannot allocate memory (12)",
    "java.lang.OutOfMemoryError: Java heap space",
]


@pytest.mark.parametrize("exc", HOST)
def test_host_memory_in_other_words_is_host_oom(exc):
    d = diagnose_bytes(_tb(exc), None)
    assert d.category is Category.HOST_OOM, (exc, d.summary)



def test_not_memory_capacity_stays_a_crash():
    # glibc's dlopen: static TLS, not memory; cuDNN: the workspace the caller passed is too small (an API
    # contract, cudnn's CUDNN_STATUS_NOT_ENOUGH_WORKSPACE); Triton: a kernel's launch configuration
    for exc in ("ImportError: /lib/aarch64-linux-gnu/libgomp.so.1: cannot allocate memory in static TLS block",
                "RuntimeError: cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
                ("triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 98304,"
                 " Hardware limit: 65536.")):
        assert diagnose_bytes(_tb(exc), None).category is Category.CRASH_OTHER, exc


def test_tensorflows_retry_warning_is_not_a_failure():
    # tensorflow bfc_allocator.cc: "... The caller indicates that this is not a failure, but ..."
    log = (b"W tensorflow/core/common_runtime/bfc_allocator.cc:275] Allocator (GPU_0_bfc) ran out of memory trying to"
           b" allocate 2.00GiB with freed_by_count=0. The caller indicates that this is not a failure, but may mean"
           b" that there could be performance gains if more memory were available.\nEpoch 1/10\n")
    assert diagnose_bytes(log, None).category is not Category.GPU_OOM


def test_the_same_words_printed_by_a_running_program_do_not_act():
    """Echoed text is no structural evidence: a program that prints a caught OOM and goes on, or a hint."""
    for line in (b"warning: MPS backend out of memory, retrying with a smaller batch\n",
                 b"NCCL WARN Cuda failure 2 'out of memory'\n"):
        log = line + b"{'loss': 1.0, 'epoch': 1.0}\n" * 3
        d = diagnose_bytes(log, None)
        assert d.category is not Category.GPU_OOM or d.strength == "hint", d.summary
    d = diagnose_bytes(b"print('if you see CUDA out of memory, lower the batch')\n", None)
    assert d.category is Category.UNKNOWN, d.summary


@pytest.mark.parametrize("warn", [
    "node1:123:456 [0] include/alloc.h:48 NCCL WARN Cuda failure 'out of memory'",
    "node1:123:456 [0] NCCL WARN Cuda failure 2 'out of memory'",
    "node1:123:456 [0] NCCL WARN Failed to CUDA calloc 6291456 bytes",
])
def test_an_nccl_error_after_nccls_own_oom_warning_is_that_oom(warn):
    """NCCL prints its WARN when the CUDA call fails; torch raises the vague "unhandled cuda error" later:
    the exception is the structural fact, the WARN line (same rank, just above) the cause."""
    log = (warn + "\nnode1:123:456 [0] NCCL INFO init.cc:1090 -> 1\n"
           + _tb("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:121,"
                 " unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.18.1\n"
                 "ncclUnhandledCudaError: Call to CUDA function failed.").decode())
    assert diagnose_bytes(log.encode(), None).category is Category.GPU_OOM


def test_an_nccl_error_alone_stays_a_comm_failure():
    log = _tb("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:121,"
              " unhandled system error, NCCL version 2.18.1")
    assert diagnose_bytes(log, None).category is Category.COMM_FAILURE


def test_a_collective_failing_after_another_ranks_oom_line_is_that_oom():
    """The ranks that wait in a collective for the one that ran out fail with the comm error; the OOM,
    printed without its traceback on its own rank just above, is the cause (OOM kinds only)."""
    log = (b"[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total"
           b" capacity of 79.15 GiB of which 1.00 GiB is free.\n"
           b"[rank0]:[E ProcessGroupNCCL.cpp:1316] [PG 0 Rank 0] Watchdog caught collective operation timeout:"
           b" WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.\n"
           b'[rank0]: Traceback (most recent call last):\n[rank0]:   File "train.py", line 9, in <module>\n'
           b"[rank0]:     dist.all_reduce(t)\n"
           b"[rank0]: torch.distributed.DistBackendError: NCCL communicator was aborted on rank 0.\n")
    assert diagnose_bytes(log, None).category is Category.GPU_OOM


def test_tensorflows_cpu_oom_stays_host():
    # tensorflow: "OOM when allocating tensor with shape[...] ... by allocator cpu" raised as ResourceExhaustedError
    exc = ("tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor with"
           " shape[1024,1024,1024] and type float on /job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu")
    assert diagnose_bytes(_tb(exc), None).category is Category.HOST_OOM


@pytest.mark.parametrize("line", [
    # slurm src/slurmd/slurmstepd (task/cgroup): "Detected %u oom-kill event(s) in %ps. Some of your processes may
    # have been killed by the cgroup out-of-memory handler."
    ("slurmstepd: error: Detected 1 oom-kill event(s) in StepId=1234.batch. Some of your processes may have been"
     " killed by the cgroup out-of-memory handler."),
    # srun's report of the step's state (JOB_OOM: "Out Of Memory")
    "srun: error: node12: task 0: Out Of Memory",
    # Kubernetes' container status; YARN's ContainersMonitorImpl; the Go runtime's throw; bash's fork with ENOMEM
    "      Reason:       OOMKilled",
    ("Container [pid=1234,containerID=container_1] is running beyond physical memory limits. Current usage: 8.1 GB"
     " of 8 GB physical memory used; Killing container."),
    "fatal error: runtime: out of memory",
    "bash: fork: Cannot allocate memory",
])
def test_a_scheduler_or_runtime_saying_host_memory_ran_out_is_host_oom(line):
    d = diagnose_bytes(b"step 1\n" + line.encode() + b"\n", None)
    assert d.category is Category.HOST_OOM, (line, d.summary)
