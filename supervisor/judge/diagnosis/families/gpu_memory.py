"""GPU memory ran out: PyTorch's caching allocator (every era), the driver and vendor libraries, vLLM,
TensorFlow, XLA, ggml, bitsandbytes; with every quantity the message states."""

from __future__ import annotations

import re

from supervisor.core.models import Category
from supervisor.judge.diagnosis.hits import CRASH, HINT, ROOT, Hit, Segment
from supervisor.judge.diagnosis.sizes import SIZE, parse_size

# --- GPU OOM --------------------------------------------------------------
_ALLOC_OOM_RE = re.compile(
    rf"\b(?P<vendor>CUDA|HIP|XPU|MPS)?\s?[Oo]ut of memory\.\s+(?:Tried to allocate (?P<tried>{SIZE})"
    rf"|Allocation was preemptively rejected[^.]*\.\s*Requested size: (?P<req>{SIZE}))"
)
_OOM_FIELDS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("total_capacity", re.compile(rf"has a total capac(?:i)?ty of ({SIZE})")),
    ("free", re.compile(rf"of which ({SIZE}) is free")),
    ("allowed", re.compile(rf"({SIZE}) allowed;")),
    ("allocated_by_pytorch", re.compile(rf"Of the allocated memory ({SIZE}) is allocated by PyTorch")),
    ("private_pools", re.compile(rf"with ({SIZE}) allocated in private pools")),
    ("reserved_unallocated", re.compile(rf"({SIZE}) is reserved by PyTorch but unallocated")),
    ("process_in_use", re.compile(rf"this process has ({SIZE}) memory in use")),
    # <= 2.0 ("GPU 0; 6.00 GiB total capacity; ...")
    ("total_capacity", re.compile(rf"({SIZE}) total capacity;")),
    ("allocated_by_pytorch", re.compile(rf"({SIZE}) already allocated;")),
    ("free", re.compile(rf"({SIZE}) free;")),
    ("reserved_total", re.compile(rf"({SIZE}) reserved in total by PyTorch")),
)
_OOM_DEVICE_RE = re.compile(r"(?:\(GPU|\. GPU|\bGPU) (\d+)(?:;| has)")
_PROCESS_RE = re.compile(rf"Process \d+ has ({SIZE}) memory in use")

_DRIVER_OOM_RE = re.compile(
    r"(?P<vendor>CUDA|HIP) error: out of memory|\bhipErrorOutOfMemory\b|\bcudaErrorMemoryAllocation\b"
    r"|cuda runtime error \(2\) : out of memory|(?P<lib>CUBLAS|HIPBLAS|CUDNN|CUSOLVER|CUSPARSE|CUFFT)_STATUS_ALLOC_FAILED"
    r"|rocblas_status_memory_error|miopenStatusAllocFailed|MIOpen(?: Error)?:.*(?:[Mm]emory allocation failed|alloc)"
    r"|HSA_STATUS_ERROR_OUT_OF_RESOURCES|(?P<nccl>Cuda|HIP|Hip) failure '?out of memory'?"
    r"|rocBLAS.*(?:memory allocation|alloc).*fail|Memory not available to allocate buffer|HIP_ERROR_OutOfMemory"
    # TensorFlow's stream executor and the driver APIs: hipErrorMemoryAllocation is HIP's old 1002
    r"|\bCUDA_ERROR_OUT_OF_MEMORY\b|\bhipErrorMemoryAllocation\b|hipError_t\(1002\)"
    r"|failed to allocate \S+ \(\d+ bytes\) from device"
)
_BUFFER_BYTES_RE = re.compile(r"allocate buffer: (\d+)|failed to allocate [\d.]+\w? \((\d+) bytes\)")
_PINNED_RE = re.compile(r"HostAllocator|cudaHostAlloc|hipHostMalloc|hipHostAlloc|pin_memory|pinned memory")

_VLLM_KV_RE = re.compile(
    rf"No available memory for the cache blocks"
    rf"|\((?P<need>{SIZE}) KV cache is needed, which is larger than the available KV cache memory \((?P<avail>-?{SIZE})\)"
    rf"|max seq len \(\d+\) is larger than the maximum number of tokens that can be stored in KV cache"
)
_VLLM_START_RE = re.compile(
    r"Free memory on device(?: \S+)? \((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\) on startup is less than desired"
    r" GPU memory utilization \((?P<util>[\d.]+), (?P<want>[\d.]+) GiB\)"
)
# Ray's memory monitor: the node's host memory (said here, beside the OOMs Ray wraps).
_RAY_HOST_OOM_RE = re.compile(r"node running low on memory|Memory on the node .* was \S+ / \S+")
_BATCH_EXHAUSTED_RE = re.compile(r"No executable batch size found, reached zero")

# Other frameworks' OOM dialects (generic `command:` jobs).
_TF_OOM_RE = re.compile(r"OOM when allocating tensor(?: with shape\s*\[[^\]]*\])?(?P<rest>.*)")
# XLA's status text; older releases spelled it "Resource exhausted:". A terminal may wrap the line after "Out".
_XLA_OOM_RE = re.compile(r"(?:RESOURCE_EXHAUSTED|Resource exhausted): (?:Out(?:$|\s+of memory"
                         r"(?:\s+(?:while trying to allocate|allocating)\s+(\d+)\s+bytes)?)"
                         # a TPU's runtime: "Attempting to reserve 6.48G at the bottom of memory. That was not possible."
                         r"|Attempting to reserve \S+ at the (?:bottom|top) of memory\. That was not possible)")
_GGML_OOM_RE = re.compile(
    r"(?:cuda|hip)Malloc failed: out of memory|failed to allocate (?P<dev>CUDA|ROCm|HIP|Vulkan|SYCL)\d* buffer(?: of size (?P<size>\d+))?"
    r"|unable to allocate (?:CUDA|ROCm|HIP)\d* buffer|ggml_cuda_host_malloc: failed to allocate"
)
_GGML_ALLOC_MIB_RE = re.compile(r"allocating ([\d.]+) MiB on device")
_BNB_OOM_RE = re.compile(r"\bError out of memory at line \d+ in file \S*(?:bitsandbytes|csrc)\S*")
_TRITON_RES_RE = re.compile(r"out of resources?: (?P<what>shared memory|registers|\w+)(?:, Required: (?P<req>\d+))?"
                            r"(?:, Hardware limit(?:ation)?: (?P<lim>\d+))?")

# Every other runtime's own words for device memory running out (from their raise/log statements):
# Apple MPS (MPSAllocator.mm), PyTorch's cudaMallocAsync backend (CUDAMallocAsyncAllocator.cpp) and its
# driver-API check (C10_CUDA_DRIVER_CHECK), Paddle's allocators (PADDLE_THROW_BAD_ALLOC ResourceExhausted,
# raised in Python as MemoryError), NCCL's CUCHECK ("Cuda failure %d '%s'") and alloc.h, cuFFT/cuRAND
# status names, XLA's stream-executor allocator and TPU compiler, TensorFlow's GPU copy into an
# unallocated tensor, DeepSpeed's inference workspace, vLLM's sampler warm-up, SGLang's and TGI's
# start-up checks, ONNX Runtime's CUDA_CALL, TensorRT's error codes, Caffe/MXNet glog checks, darknet,
# OpenCV's CUDA module, Ascend CANN, Metal, Vulkan, SYCL/Level Zero, RAPIDS rmm.
_MORE_GPU_OOM_RE = re.compile(
    r"(?P<mps>MPS) backend out of memory"
    r"|Allocation on device \d+ would exceed allowed memory\. \(out of memory\)"
    r"|Out of memory error on (?P<paddle>GPU|XPU|NPU|MLU|IPU|custom device)"
    r"|(?P<drv>CUDA|HIP) driver error: out of memory"
    r"|\bCUFFT_ALLOC_FAILED\b|\bHIPFFT_ALLOC_FAILED\b|\bCURAND_STATUS_ALLOCATION_FAILED\b"
    r"|\b(?:Cuda|HIP|Hip) failure \d+ '?out of memory|Failed to CUDA calloc(?: async)? \d+ bytes"
    r"|RESOURCE_EXHAUSTED: Failed to allocate request for|Ran out of memory in memory space (?:hbm|vmem)"
    r"|Dst tensor is not initialized"
    r"|Workspace can't be allocated, no enough memory"
    r"|out of memory occurred when warming up sampler"
    r"|Not enough memory\. Please try to increase --mem-fraction-static|Not enough memory to handle \d+ (?:prefill )?tokens"
    r"|\bCUDA failure \d+: out of memory|Error Code \d+: Cuda Runtime \(out of memory\)|Error Code 2: OutOfMemory"
    r"|Requested amount of GPU memory \(\d+ bytes\) could not be allocated"
    r"|\(2 vs\. 0\)\s+out of memory|cudaMalloc retval=2\b|\bCUDA (?:Error|ERROR)\s?: out of memory"
    r"|Gpu API call\) out of memory"
    r"|\bACL_ERROR_RT_MEMORY_ALLOCATION\b|EL0004:.*[Ff]ailed to allocate memory|driver error:\s?out of memory"
    r"|kIOGPUCommandBufferCallbackErrorOutOfMemory|\[metal::malloc\] Resource limit"
    r"|\bErrorOutOfDeviceMemory\b|\bVK_ERROR_OUT_OF_DEVICE_MEMORY\b|Device memory allocation of size \d+ failed"
    r"|\bUR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY\b|\bZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY\b|\bPI_ERROR_OUT_OF_DEVICE_MEMORY\b"
    r"|\brmm::out_of_memory\b|out_of_memory: (?:CUDA error|RMM failure)"
)
# An exception line that names device memory running out with a vendor (the message cut before
# "Tried to allocate", or a library's rewording of the allocator's error): only as an exception line.
_EXC_VENDOR_OOM_RE = re.compile(r"\b(?P<vendor>CUDA|HIP|XPU|NPU|MUSA|GPU) out of memory\b")
# TensorFlow's BFC allocator before it fails (without "The caller indicates that this is not a failure").
_TF_BFC_RE = re.compile(r"Allocator \((?P<name>\w+)\) ran out of memory trying to allocate")
# ONNX Runtime's arena: the same words for the CPU arena, so only where the line names the GPU.
_ORT_ARENA_RE = re.compile(r"Failed to allocate memory for requested buffer of size \d+")
_ORT_GPU_RE = re.compile(r"CUDA|Cuda|cuda|GPU|ROCM|Rocm")


def _numbers_from(fields: tuple[tuple[str, re.Pattern[str]], ...], text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, rx in fields:
        if name in out:
            continue
        m = rx.search(text)
        if m:
            v = parse_size(m.group(1))
            if v is not None:
                out[name] = v
    return out


def gpu_oom_numbers(text: str) -> dict[str, int]:
    """Every quantity an allocator OOM message states, in bytes."""
    m = _ALLOC_OOM_RE.search(text)
    nums: dict[str, int] = {}
    if m:
        tried = parse_size(m.group("tried") or m.group("req") or "")
        if tried is not None:
            nums["tried_to_allocate"] = tried
    nums.update(_numbers_from(_OOM_FIELDS, text))
    if "reserved_total" in nums and "reserved_unallocated" not in nums and "allocated_by_pytorch" in nums:
        nums["reserved_unallocated"] = max(0, nums["reserved_total"] - nums["allocated_by_pytorch"])
    d = _OOM_DEVICE_RE.search(text)
    if d:
        nums["device_index"] = int(d.group(1))
    this_process = "process_in_use" in nums  # "this process has X memory in use"
    procs = [parse_size(p) or 0 for p in _PROCESS_RE.findall(text)]
    if this_process and {"total_capacity", "free"} <= nums.keys():
        # What neither this process nor the free pool holds: other processes (or the driver).
        nums["held_by_others"] = max(0, nums["total_capacity"] - nums["free"] - nums["process_in_use"])
    elif {"total_capacity", "free"} <= nums.keys():
        _infer_foreign(nums, procs)
    return nums


# Memory a process holds outside its PyTorch allocator: the CUDA/HIP context, cuBLAS/MIOpen
# workspaces, NCCL/RCCL buffers. Beyond this much, memory the allocator does not hold is taken for
# someone else's (the message cannot tell another process from our own non-PyTorch memory).
NON_PYTORCH_ALLOWANCE_MIN = 2 * 1024**3
NON_PYTORCH_ALLOWANCE_FRACTION = 0.03


def _infer_foreign(nums: dict[str, int], procs: list[int]) -> None:
    """Memory held by others when the message has no "this process" figure.

    Inside a container NVML's pids are not the container's, so PyTorch lists every process as
    "Process N has X memory in use" and none as "this process"; on ROCm no process is listed at all.
    What the message still proves: total - free - reserved by PyTorch is memory this allocator does
    not hold. A listed process whose use covers PyTorch's reservation (the smallest such) is ours;
    the rest of the GPU's used memory is others'. With no list, only what exceeds a context's
    overhead (NON_PYTORCH_ALLOWANCE) is counted as others'.
    """
    reserved = None
    if "allocated_by_pytorch" in nums:
        reserved = nums["allocated_by_pytorch"] + nums.get("reserved_unallocated", 0)
    elif "reserved_total" in nums:
        reserved = nums["reserved_total"]
    if reserved is None:
        return
    used = nums["total_capacity"] - nums["free"]
    nums["not_held_by_pytorch"] = max(0, used - reserved)
    ours = min((p for p in procs if p >= reserved), default=None)
    if ours is not None:
        nums["process_in_use"] = ours
        others = used - ours
    else:
        allowance = max(NON_PYTORCH_ALLOWANCE_MIN, int(NON_PYTORCH_ALLOWANCE_FRACTION * nums["total_capacity"]))
        others = used - reserved - allowance
    if others > 0:
        nums["held_by_others"] = others
        nums["held_by_others_inferred"] = 1


def find(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> None:
    """Append this family's hits for one segment (`t` its text, `exc` its short exception class)."""
    _torch_and_drivers(seg, t, exc, exc_form, hits)
    _vllm(seg, t, exc, exc_form, hits)
    _other_frameworks(seg, t, exc, exc_form, hits)
    _more_dialects(seg, t, exc, exc_form, hits)


def _torch_and_drivers(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> None:
    """PyTorch's caching allocator, Ray's wrapper of it, the drivers and vendor libraries."""
    # GPU OOM, allocator level. Decisive only as an exception line: a program
    # that catches an OOM and prints it (then retries) must not look failed.
    if "emory" in t or "OutOfMemory" in t:
        m = _ALLOC_OOM_RE.search(t)
        if m:
            v = m.group("vendor")
            vendor = {"CUDA": "cuda", "HIP": "hip"}.get(v or "")
            hits.append(
                Hit("torch_oom" if exc_form else "torch_oom_mention", Category.GPU_OOM,
                    ROOT if exc_form else HINT, "allocator", fatal=exc_form,
                    numbers=gpu_oom_numbers(t), vendor=vendor, exc=seg.exc)
            )
        elif exc == "OutOfMemoryError" and not (seg.exc or "").startswith(("ray.", "java.")):
            # The class says it even where the message was cut (or wrapped by Ray: RayTaskError(OutOfMemoryError)).
            hits.append(Hit("torch_oom", Category.GPU_OOM, ROOT, "allocator", fatal=True,
                            numbers=gpu_oom_numbers(t), exc=seg.exc))
    if (exc == "OutOfMemoryError" and (seg.exc or "").startswith("ray.")) or (
            "low on memory" in t and _RAY_HOST_OOM_RE.search(t)):
        # Ray's memory monitor killed a worker: the node's host memory, not a GPU.
        hits.append(Hit("ray_host_oom", Category.HOST_OOM, ROOT, "ray_memory_monitor", fatal=exc_form,
                        vendor="cpu", exc=seg.exc))
    if "emory" in t or "lloc" in t or "ALLOC" in t or "RESOURCES" in t or "MEMORY" in t:
        m = _DRIVER_OOM_RE.search(t)
        if m and not (hits and hits[0].rule.startswith("torch_oom")):
            vendor = {"CUDA": "cuda", "HIP": "hip", "Cuda": "cuda", "Hip": "hip"}.get(m.group("vendor") or m.group("nccl") or "")
            if "hip" in m.group(0).lower() or "rocblas" in m.group(0).lower() or "MIOpen" in m.group(0):
                vendor = "hip"
            if _PINNED_RE.search(t):
                hits.append(Hit("pinned_host_oom", Category.HOST_OOM, ROOT, "pinned", fatal=True, vendor="cpu", exc=seg.exc))
            else:
                nums = {}
                b = _BUFFER_BYTES_RE.search(t)
                if b:
                    nums["tried_to_allocate"] = int(b.group(1) or b.group(2))
                hits.append(Hit("driver_oom", Category.GPU_OOM, ROOT, "driver", fatal=True, numbers=nums,
                                vendor=vendor, exc=seg.exc))


def _vllm(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> None:
    """vLLM's KV-cache and start-up memory checks."""
    if "memory" in t or "KV cache" in t:
        m = _VLLM_KV_RE.search(t)
        if m:
            nums: dict[str, int] = {}
            if m.group("need"):
                nums["tried_to_allocate"] = parse_size(m.group("need")) or 0
                avail = parse_size(m.group("avail").lstrip("-")) or 0
                nums["free"] = -avail if m.group("avail").startswith("-") else avail
            hits.append(Hit("vllm_kv_cache", Category.GPU_OOM, ROOT if exc_form else HINT, "vllm_kv_cache",
                            fatal=False, numbers=nums, exc=seg.exc))
        m = _VLLM_START_RE.search(t)
        if m:
            gib = 1024**3
            nums = {
                "free": int(float(m.group("free")) * gib),
                "total_capacity": int(float(m.group("total")) * gib),
                "tried_to_allocate": int(float(m.group("want")) * gib),
                "gpu_memory_utilization": float(m.group("util")),
            }
            hits.append(Hit("vllm_startup", Category.GPU_OOM, ROOT if exc_form else HINT, "vllm_startup",
                            numbers=nums, exc=seg.exc))


def _other_frameworks(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> None:
    """TensorFlow, XLA, ggml, bitsandbytes, Triton's resources, the automatic batch-size search."""
    if "OOM when" in t:
        m = _TF_OOM_RE.search(t)
        if m:
            host = re.search(r"by allocator (?:cpu|mklcpu)|device:CPU", t)
            hits.append(Hit("tf_oom", Category.HOST_OOM if host else Category.GPU_OOM, ROOT, "tensorflow",
                            fatal=exc_form, vendor="cpu" if host else None, exc=seg.exc))
    if "RESOURCE_EXHAUSTED" in t or "Resource exhausted" in t:
        m = _XLA_OOM_RE.search(t)
        if m and not any(h.category is Category.GPU_OOM for h in hits):
            hits.append(Hit("xla_oom", Category.GPU_OOM, ROOT, "xla", fatal=exc_form,
                            numbers={"tried_to_allocate": int(m.group(1))} if m.group(1) else {}, exc=seg.exc))
    if "alloc" in t or "Malloc" in t:
        m = _GGML_OOM_RE.search(t)
        if m and not any(h.category is Category.GPU_OOM for h in hits):
            nums = {}
            if m.group("size"):
                nums["tried_to_allocate"] = int(m.group("size"))
            else:
                mib = _GGML_ALLOC_MIB_RE.search(t)
                if mib:
                    nums["tried_to_allocate"] = int(float(mib.group(1)) * 1024 * 1024)
            host = "host_malloc" in t
            vendor = "cpu" if host else ("hip" if re.search(r"ROCm|HIP|hipMalloc", t) else
                                          ("cuda" if re.search(r"CUDA|cudaMalloc", t) else None))
            hits.append(Hit("ggml_oom", Category.HOST_OOM if host else Category.GPU_OOM, ROOT,
                            "pinned" if host else "ggml", numbers=nums, vendor=vendor, exc=seg.exc))
    if "Error out of memory" in t and _BNB_OOM_RE.search(t):
        hits.append(Hit("bnb_oom", Category.GPU_OOM, ROOT, "bitsandbytes", exc=seg.exc))
    if "out of resource" in t:
        m = _TRITON_RES_RE.search(t)
        if m:
            nums = {k: int(m.group(g)) for k, g in (("required", "req"), ("hardware_limit", "lim")) if m.group(g)}
            # A kernel's launch configuration, not device memory: no memory remedy helps.
            hits.append(Hit("triton_out_of_resources", Category.CRASH_OTHER, CRASH, "triton_out_of_resources",
                            numbers=nums, exc=seg.exc))
    if "batch size" in t and _BATCH_EXHAUSTED_RE.search(t):
        hits.append(Hit("batch_size_exhausted", Category.GPU_OOM, ROOT, "batch_size_search_exhausted", exc=seg.exc))


def _more_dialects(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> None:
    """The runtimes' own words beyond PyTorch's allocator (see _MORE_GPU_OOM_RE): a root cause where
    they are said, structural where the log's structure makes them so (an exception line, its message,
    the last error); a vendor-named "X out of memory" only as an exception line."""
    if any(h.category in (Category.GPU_OOM, Category.HOST_OOM) for h in hits):
        return
    m = _MORE_GPU_OOM_RE.search(t)
    if m:
        vendor = "hip" if (m.group("drv") == "HIP" or "HIP" in m.group(0) or "Hip" in m.group(0)) else None
        if m.group("mps"):
            vendor = None
        hits.append(Hit("runtime_oom", Category.GPU_OOM, ROOT, "runtime", fatal=exc_form,
                        numbers=gpu_oom_numbers(t), vendor=vendor, exc=seg.exc))
        return
    if exc_form and (seg.exc or "").split(".")[0] not in ("java", "scala"):
        v = _EXC_VENDOR_OOM_RE.search(t)
        if v or (exc == "ResourceExhaustedError" and re.search(r"alloc|memory", t)):
            hits.append(Hit("runtime_oom", Category.GPU_OOM, ROOT, "runtime", fatal=True,
                            vendor={"CUDA": "cuda", "HIP": "hip"}.get(v.group("vendor") if v else ""), exc=seg.exc))
            return
    if "ran out of memory" in t and "not a failure" not in t:
        b = _TF_BFC_RE.search(t)
        if b:
            host = "cpu" in b.group("name").lower()
            hits.append(Hit("tf_bfc_mention", Category.HOST_OOM if host else Category.GPU_OOM, HINT, "tensorflow",
                            vendor="cpu" if host else None, exc=seg.exc))
    if "requested buffer" in t and _ORT_ARENA_RE.search(t) and _ORT_GPU_RE.search(t):
        hits.append(Hit("runtime_oom", Category.GPU_OOM, ROOT, "runtime", fatal=exc_form, exc=seg.exc))
