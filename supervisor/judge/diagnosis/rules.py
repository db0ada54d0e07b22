"""What a log line means: the rule table and the per-line classifier (pure).

The scanner finds candidate lines with one cheap keyword pass (`KEYWORDS`) and
hands each candidate segment (one `\\r`-delimited piece of a line, ANSI codes
removed) to `classify()`. Rules were written from upstream texts: PyTorch's
CUDACachingAllocator (every era; HIP and `allowed;` variants), c10
DefaultCPUAllocator, ProcessGroupNCCL, DeepSpeed's loss scaler and config
models, vLLM's KV-cache checks, LLaMA-Factory's parser and loaders.

Tiers order root causes (see conclude.py for how they are combined):
  1 ROOT   a failure that explains itself (OOM, device fault, disk, config, numeric)
  2 COMM   collective/rendezvous failures: often a CONSEQUENCE of a root cause elsewhere
  3 CRASH  any other Python exception, segfault, abort
  4 MARKER launcher summaries and kill markers (SIGKILL): what happened, not why
  5 HINT   mentions that only count when nothing else explains a failure
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from supervisor.core.models import Category, Phase
from supervisor.judge.diagnosis.fastre import compile_search
from supervisor.judge.diagnosis.kernel import KERNEL_OOM_RE
from supervisor.judge.diagnosis.prefixes import KNOWN_PREFIX_RE, PrefixModel, undecorate
from supervisor.judge.diagnosis.sizes import SIZE, parse_size

ROOT, COMM, CRASH, MARKER, HINT = 1, 2, 3, 4, 5

# The prefilter: a line is looked at only if it holds one of these (the union of
# the rule triggers, phase/progress markers, vendor names, exception and
# traceback shapes, defined below). They are SPECIFIC on purpose: a broad word
# ("memory", "CUDA", "checkpoint", "fault" as in "default") would make every
# allocator-conf warning or torchrun "[default0]:" line a candidate.
_EXCEPTION_TRIGGERS = ("Error:", "Exception:", "MemoryError", "AssertionError", "KeyboardInterrupt", "Traceback (most", 'File "')
_MARKER_TRIGGERS = (
    # Only BAD logged steps are candidates (healthy ones, one per logging step, stay out of the
    # Python path); the scanner tells "in a row" by looking for a dict between two bad ones.
    "'loss': 0.0,", "'loss': 0,", " example:", "input_ids:",
    "Loading checkpoint shards", "loading weights file", "*****", "Saving model checkpoint", "Loading model from",
    "Continuing training", "Resuming training", "optimization steps", "skipped=", "batch size of", "OVERFLOW",
    "local_rank", "is ready now", "Deleting older checkpoint", "Gradient overflow", "Loading weights",
    "Load checkpoint", "Loading checkpoint from", "loading model tensors", "zero partition checkpoints", "zero checkpoints",
    # chained exceptions; C++ aborts; a program that says it retries after an OOM
    "above exception", "what():", "terminated with exception", "aborting with error", "retrying", "Retrying",
    "falling back",
)
_VENDOR_TRIGGERS = (
    "HIP", "hipError", "AMD_SERIALIZE", "HSA_", "HW Exception", "/rocm", "ROCm", "rocm-", "gfx9", "gfx1", "MI300",
    "MI250", "MI210", "MI325", "MI355", "RCCL", "rocBLAS", "rocblas", "hipBLAS", "MIOpen", "amdgpu", "libamdhip",
    "detected platform", "CUDA out of memory", "CUDA error", "CUDA_LAUNCH_BLOCKING", "CUBLAS", "cuBLAS", "CUDNN",
    "cuDNN", "NVIDIA", "NVRM", "nvidia-smi", "NVML", "cudaError", "sm_",
)

_GLUED_RANK_RE = re.compile(r"\[(?:rank|default)\d+\]:")
_RANK_ANYWHERE_RE = re.compile(r"\[(?:rank|default)(\d+)\]:|\[(?:PG [^\]]*?)?Rank (\d+)\]")
_EXC_RE = re.compile(
    r"^(?P<exc>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)"
    # any CamelCase class with a module path: triton.runtime.errors.OutOfResources
    r"|(?:[a-z_][a-z0-9_]*\.)+[A-Z][a-z0-9]+[A-Z]\w*)"
    # Ray re-raises a task's exception as RayTaskError(<the task's class>)
    r"(?:\((?P<inner>[A-Za-z_]\w*)\))?(?::\s?(?P<msg>.*))?$"
)
FRAME_RE = re.compile(r'File "(?P<path>[^"]*)", line \d+, in (?P<func>[\w<>.]+)')
ANSI_RE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")

HIP_RE = compile_search(
    r"HIP out of memory|HIP error|\bhip[A-Z]\w+|AMD_SERIALIZE_KERNEL|HSA_STATUS|Memory access fault by GPU|HW Exception by GPU"
    r"|\bgfx\d{3,4}\w*|\bMI\d{3}[A-Z]?\b|/rocm|\bROCm\b|\bRCCL\b|rocBLAS|hipBLAS|MIOpen|\bamdgpu\b"
    r"|libamdhip64|HIPBLAS_STATUS|rocblas_status|detected platform rocm|/rccl/|/hipify/"
)
CUDA_RE = compile_search(
    r"CUDA out of memory|CUDA error|CUDA_LAUNCH_BLOCKING|CUBLAS_STATUS|cuBLAS|CUDNN_STATUS|cuDNN"
    r"|\bNVIDIA\b|\bNVRM\b|nvidia-smi|\bNVML\b|\bcudaError\w+|\bsm_\d{2,3}\b|detected platform cuda"
    r"|THCudaCheck|cuda runtime error|for CUDA device|CUDA_ERROR_|\bCUDA\d*\b"
)

# --- phase markers --------------------------------------------------------
# Functions on a traceback that tell where the failure happened. When several
# appear, the first phase in PHASE_PRECEDENCE wins: loading optimizer state is
# "checkpoint_load" even though it runs inside the training loop.
FRAME_PHASES: dict[str, Phase] = {
    "_load_from_checkpoint": Phase.CHECKPOINT_LOAD,
    "_load_optimizer_and_scheduler": Phase.CHECKPOINT_LOAD,
    "_load_rng_state": Phase.CHECKPOINT_LOAD,
    "load_checkpoint": Phase.CHECKPOINT_LOAD,
    "_load_zero_checkpoint": Phase.CHECKPOINT_LOAD,
    "_load_scaler": Phase.CHECKPOINT_LOAD,
    "load_universal_checkpoint": Phase.CHECKPOINT_LOAD,
    "_load_checkpoint": Phase.CHECKPOINT_LOAD,
    "load_module_state_dict": Phase.CHECKPOINT_LOAD,
    "deepspeed_load_checkpoint": Phase.CHECKPOINT_LOAD,
    "_save_checkpoint": Phase.CHECKPOINT_SAVE,
    "save_model": Phase.CHECKPOINT_SAVE,
    "save_pretrained": Phase.CHECKPOINT_SAVE,
    "save_checkpoint": Phase.CHECKPOINT_SAVE,
    "_save_optimizer_and_scheduler": Phase.CHECKPOINT_SAVE,
    "_save": Phase.CHECKPOINT_SAVE,
    "save_16bit_model": Phase.CHECKPOINT_SAVE,
    "save_weights": Phase.CHECKPOINT_SAVE,
    "save_state": Phase.CHECKPOINT_SAVE,
    "evaluate": Phase.EVALUATION,
    "_evaluate": Phase.EVALUATION,
    "evaluation_loop": Phase.EVALUATION,
    "prediction_step": Phase.EVALUATION,
    "prediction_loop": Phase.EVALUATION,
    "predict": Phase.EVALUATION,
    "from_pretrained": Phase.MODEL_LOAD,
    "load_model": Phase.MODEL_LOAD,
    "load_tokenizer": Phase.MODEL_LOAD,
    "_load_pretrained_model": Phase.MODEL_LOAD,
    "load_model_and_tokenizer": Phase.MODEL_LOAD,
    "_load_state_dict_into_meta_model": Phase.MODEL_LOAD,
    "load_state_dict": Phase.MODEL_LOAD,
    "training_step": Phase.TRAIN_STEP,
    "_inner_training_loop": Phase.TRAIN_STEP,
    "compute_loss": Phase.TRAIN_STEP,
    # the backward pass and the usual names of a training step in other frameworks
    "backward": Phase.TRAIN_STEP,
    "_engine_run_backward": Phase.TRAIN_STEP,
    "run_step": Phase.TRAIN_STEP,
    "train_step": Phase.TRAIN_STEP,
    "optimizer_step": Phase.TRAIN_STEP,
    "step": Phase.TRAIN_STEP,  # optimizer.step(), lr_scheduler.step(), engine.step(): training
    "optimize_parameters": Phase.TRAIN_STEP,
    "train_one_epoch": Phase.TRAIN_STEP,
    "train_epoch": Phase.TRAIN_STEP,
    "validation_step": Phase.EVALUATION,
}
PHASE_PRECEDENCE = (
    Phase.CHECKPOINT_LOAD,
    Phase.CHECKPOINT_SAVE,
    Phase.EVALUATION,
    Phase.MODEL_LOAD,
    Phase.TRAIN_STEP,
)

# Log lines that say what the run is doing now (used when a failure has no traceback).
CONTEXT_MARKERS: tuple[tuple[re.Pattern[str], Phase], ...] = (
    (re.compile(r"Loading checkpoint shards|loading weights file|Loading weights:|loading model tensors"),
     Phase.MODEL_LOAD),
    (re.compile(r"\*\*\*\*\* Running training \*\*\*\*\*"), Phase.TRAIN_STEP),
    (re.compile(r"\*\*\*\*\* Running (?:Evaluation|Prediction) \*\*\*\*\*"), Phase.EVALUATION),
    (re.compile(r"Saving model checkpoint to|\[Rank \d+\] Saving model checkpoint"), Phase.CHECKPOINT_SAVE),
    # The save is over (DeepSpeed's commit line; transformers' rotation after a save): training resumes.
    (re.compile(r"Checkpoint \S+ is ready now|Deleting older checkpoint"), Phase.TRAIN_STEP),
    (
        # transformers' _load_from_checkpoint and resume log lines, LLaMA-Factory's parser, DeepSpeed's engine
        re.compile(r"Loading model from \S*checkpoint|\[INFO\|trainer\.py:\d+\][^>]*>> Loading model from"
                   r"|Continuing training from checkpoint|Resuming training from"
                   r"|\[Torch\] (?:Begin )?Load(?:ing)? checkpoint from|loading \d+ zero partition checkpoints"
                   r"|Loading \S+ zero checkpoints|loaded universal zero checkpoints"),
        Phase.CHECKPOINT_LOAD,
    ),
)
TOTAL_STEPS_RE = re.compile(r"Total optimization steps = (\d[\d,]*)")
CHECKPOINT_STEP_RE = re.compile(r"Saving model checkpoint to \S*checkpoint-(\d+)")
DS_STEP_RE = re.compile(r"\bstep=(\d+), skipped=\d+")
RETRY_BATCH_RE = re.compile(r"Currently training with a batch size of: (\d+)")
LOSS_SCALE_RE = re.compile(r"OVERFLOW!.*?Attempted loss scale: (\d+(?:\.\d+)?)(?:, reducing to (\d+(?:\.\d+)?))?")
# Megatron/apex-style: "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 0.5"
GRAD_OVERFLOW_RE = re.compile(r"Gradient overflow\.\s+Skipping step,.*?reducing (?:loss scale )?to (\d+(?:\.\d+)?(?:e[-+]?\d+)?)")
TORCHRUN_RANK_RE = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank")


@dataclass
class Hit:
    """One rule that matched one segment."""

    rule: str
    category: Category
    tier: int
    subkind: str | None = None
    fatal: bool = False  # justifies tearing the attempt down now
    numbers: dict[str, Any] = field(default_factory=dict)
    vendor: str | None = None  # a vendor the line itself proves
    exc: str | None = None  # Python exception class, when the line is an exception line


@dataclass
class Segment:
    """A cleaned piece of a line: prefixes stripped, rank found."""

    text: str  # after prefix stripping
    raw: str  # before
    rank: int | None
    exc: str | None
    exc_msg: str | None


def split_prefix(raw: str, learned: PrefixModel | None = None) -> Segment:
    """A line's text past its prefixes and paste decorations, the rank they name, and its exception."""
    text = undecorate(raw)
    rank = None
    if learned is not None:
        text, rank = learned.strip(text)
    while True:
        m = KNOWN_PREFIX_RE.match(text)
        if not m or m.end() == 0:
            break
        if m.group("rank") is not None and rank is None:
            rank = int(m.group("rank"))
        text = text[m.end():]
        if learned is not None:
            text, lab = learned.strip(text)
            rank = lab if rank is None else rank
    text = text.strip()
    if not _EXC_RE.match(text):
        # A progress bar left without a newline glues the next rank-prefixed
        # line onto its own: "...2.83s/it][rank0]: torch.OutOfMemoryError: ...".
        glued = None
        for glued in _GLUED_RANK_RE.finditer(text):
            pass
        if glued is not None and glued.start() > 0:
            rest = split_prefix(text[glued.start():], learned)
            return Segment(text=rest.text, raw=raw, rank=rest.rank, exc=rest.exc, exc_msg=rest.exc_msg)
    if rank is None:
        m = _RANK_ANYWHERE_RE.search(raw)
        if m:
            rank = int(m.group(1) or m.group(2))
    em = _EXC_RE.match(text)
    exc = None
    if em:
        exc = em.group("exc")
        if em.group("inner"):
            exc = em.group("inner")  # RayTaskError(OutOfMemoryError): the task's own exception
    return Segment(text=text, raw=raw, rank=rank, exc=exc, exc_msg=em.group("msg") if em else None)


def exception_class(text: str) -> str | None:
    """The exception class a cleaned line starts with (`ValueError: ...`), if it is an exception line."""
    em = _EXC_RE.match(text)
    if em is None:
        return None
    return em.group("inner") or em.group("exc")


def _short(exc: str | None) -> str | None:
    return exc.rsplit(".", 1)[-1] if exc else None


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
_BATCH_EXHAUSTED_RE = re.compile(r"No executable batch size found, reached zero")

# Other frameworks' OOM dialects (generic `command:` jobs).
_TF_OOM_RE = re.compile(r"OOM when allocating tensor(?: with shape\s*\[[^\]]*\])?(?P<rest>.*)")
# XLA's status text; older releases spelled it "Resource exhausted:". A terminal may wrap the line after "Out".
_XLA_OOM_RE = re.compile(r"(?:RESOURCE_EXHAUSTED|Resource exhausted): Out(?:$|\s+of memory"
                         r"(?:\s+(?:while trying to allocate|allocating)\s+(\d+)\s+bytes)?)")
_GGML_OOM_RE = re.compile(
    r"(?:cuda|hip)Malloc failed: out of memory|failed to allocate (?P<dev>CUDA|ROCm|HIP|Vulkan|SYCL)\d* buffer(?: of size (?P<size>\d+))?"
    r"|unable to allocate (?:CUDA|ROCm|HIP)\d* buffer|ggml_cuda_host_malloc: failed to allocate"
)
_GGML_ALLOC_MIB_RE = re.compile(r"allocating ([\d.]+) MiB on device")
_BNB_OOM_RE = re.compile(r"\bError out of memory at line \d+ in file \S*(?:bitsandbytes|csrc)\S*")
_TRITON_RES_RE = re.compile(r"out of resources?: (?P<what>shared memory|registers|\w+)(?:, Required: (?P<req>\d+))?"
                            r"(?:, Hardware limit(?:ation)?: (?P<lim>\d+))?")

# --- host OOM -------------------------------------------------------------
_CPU_ALLOC_RE = re.compile(r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)"
                           # PyTorch <= 1.1's CPUAllocator: posix_memalign returned ENOMEM (12)
                           r"|posix_memalign\(.*\)\s*==\s*0\.?\s*12 vs 0")
# /dev/shm exhausted: DataLoader workers pass batches through shared memory.
_SHM_RE = re.compile(r"insufficient shared memory|out of shared memory|killed by signal: Bus error"
                     r"|unable to write to file </torch_\w+>")
_RAY_HOST_OOM_RE = re.compile(r"node running low on memory|Memory on the node .* was \S+ / \S+")
_CPU_TRIED_RE = re.compile(r"you tried to allocate (\d+) bytes")
_BAD_ALLOC_RE = re.compile(r"std::bad_alloc")

# --- device faults --------------------------------------------------------
_DEVICE_RULES: tuple[tuple[str, re.Pattern[str], str | None], ...] = (
    ("illegal_memory_access", re.compile(r"illegal memory access|\b(?:hip|cuda)ErrorIllegalAddress\b"), None),
    ("memory_access_fault", re.compile(r"Memory access fault by GPU node"), "hip"),
    ("gpu_hang", re.compile(r"GPU Hang|reason\s*:\s*GPU Hang|\bhipErrorLaunchTimeOut\b|launch timed out"), None),
    ("hsa_error", re.compile(r"HSA_STATUS_ERROR_(?!OUT_OF_RESOURCES)\w+"), "hip"),
    ("ecc_error", re.compile(r"uncorrectable ECC error|\bECC error\b|ECC errors? (?:detected|encountered)"), None),
    ("xid", re.compile(r"\bNVRM: Xid\b|\bXid \(PCI:"), "cuda"),
    ("fallen_off_bus", re.compile(r"fallen off the bus"), None),
    ("launch_failure", re.compile(r"unspecified launch failure|\bhipErrorLaunchFailure\b"), None),
    ("kernel_fault", re.compile(r"(?:CUDA|HIP) error: (?:misaligned address|an illegal instruction was encountered)"), None),
    # nvidia-smi / NVML can no longer reach the GPU: it fell off the bus or its driver state is lost.
    ("gpu_lost", re.compile(r"Unable to determine the device handle for (?:GPU|gpu)|\bGPU is lost\b"), "cuda"),
)

# --- comm -----------------------------------------------------------------
_WATCHDOG_RE = re.compile(
    r"Watchdog caught collective operation timeout|Some NCCL operations have failed or timed out"
    r"|[Hh]eartbeat monitor timed out|watchdog got stuck|timed out in blocking wait"
)
_RAN_FOR_RE = re.compile(r"ran for (\d+) milliseconds")
# A watchdog timeout that shows up only as its C++ frames, or torch's summary line.
_WATCHDOG_FRAME_RE = re.compile(r"WorkNCCL::checkTimeout|Timeout at NCCL work: \d+")
_WATCHDOG_OTHER_FRAME_RE = re.compile(r"ProcessGroupNCCL::(?:watchdogHandler|ncclCommWatchdog)|ncclCommWatchdog\b")
_IPC_RE = re.compile(
    r"\b(?:hip|cuda)Ipc(?:Open|Get)MemHandle\b.*(?:fail|error|invalid)|(?:fail|error)\w*.*\b(?:hip|cuda)Ipc(?:Open|Get)MemHandle"
    r"|failed to open (?:CUDA|HIP) IPC handle|RCCL.*\bIPC\b.*(?:fail|error)|ncclP2pImportShareableBuffer.*fail"
)
_NCCL_ERR_RE = re.compile(
    r"\bncclUnhandledCudaError\b|\bncclSystemError\b|\bncclInternalError\b|\bncclRemoteError\b"
    r"|NCCL [Ee]rror|DistBackendError|NCCL communicator was aborted|ProcessGroupNCCL is aborted"
    r"|NCCL WARN (?:Cuda|HIP|Hip) failure"
)
_SOCKET_RE = re.compile(
    r"Rendezvous\w*Error|DistNetworkError|DistStoreError|socket has timed out|EADDRINUSE"
    r"|address already in use|TCPStore\w*.*(?:fail|timed out|refused)"
    r"|(?:Connection reset by peer|Connection refused|Broken pipe).*(?:c10d|socket|Gloo|NCCL|store)"
    r"|(?:c10d|socket|Gloo|NCCL|store).*(?:Connection reset by peer|Connection refused)"
)

# --- environment (transient: the network, the hub, DNS) -------------------
_ENV_RE = re.compile(
    r"Temporary failure in name resolution|NameResolutionError|Failed to resolve|Name or service not known"
    r"|ReadTimeoutError|ConnectTimeoutError|MaxRetryError|ConnectionError|ConnectionResetError|Connection aborted"
    r"|We couldn't connect to '?https?://|couldn't connect to|Network is unreachable|HTTP Error 50[234]|50[234] Server Error"
    r"|check your connection|Please check your connection|Internet connection|SSLError|ProxyError"
)
# LocalEntryNotFoundError under HF_HUB_OFFLINE (or local_files_only) means "not cached": a config error.
_OFFLINE_RE = re.compile(r"outgoing traffic has been disabled|HF_HUB_OFFLINE|local_files_only=True|offline mode")

# --- config ---------------------------------------------------------------
_CONFIG_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("unknown_keys", re.compile(r"Some (?:keys|specified arguments) are not used by the HfArgumentParser: (?P<detail>\[.*?\])")),
    (
        "model_not_found",
        re.compile(
            r"is not a local folder and is not a valid model identifier|Can't load (?:tokenizer|config|the configuration|the model)"
            r"|HFValidationError|Repo id must be|does not appear to have a file named|Incorrect path_or_model_id"
            r"|LocalEntryNotFoundError|RepositoryNotFoundError"
        ),
    ),
    (
        "dataset_not_found",
        re.compile(
            r"Undefined dataset (?P<detail>\S+) in|Cannot open \S*dataset_info\.json|File \S+ not found\."
            r"|Cannot find valid samples|DatasetNotFoundError|Please specify dataset for"
        ),
    ),
    ("template_not_found", re.compile(r"Template (?P<detail>\S+) does not exist")),
    (
        "deepspeed_config",
        re.compile(
            r"validation errors? for DeepSpeed\w*|Please correct the following DeepSpeed config values that mismatch"
            r"|DeepSpeedConfigError|Extra inputs are not permitted.*extra_forbidden"
        ),
    ),
    ("allocator_conf", re.compile(r"Unrecognized CachingAllocator option|Unrecognized key '[^']*' in \w+ allocator config")),
    ("checkpoint_incompatible", re.compile(r"Can't find a valid checkpoint at|ZeRORuntimeException")),
    ("incomplete_checkpoint", re.compile(r"checkpoint-\d+/trainer_state\.json")),
    ("output_dir", re.compile(r"Output directory \S+ already exists and is not empty")),
)

# --- disk -----------------------------------------------------------------
_DISK_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("no_space", re.compile(r"No space left on device|\[Errno 28\]|\bENOSPC\b|os error 28|StorageFull")),
    ("quota", re.compile(r"Disk quota exceeded|\[Errno 122\]")),
    (
        "checkpoint_write_failed",
        re.compile(r"PytorchStreamWriter failed writing file|unexpected pos \d+ vs \d+|file write failed"
                   r"|write\(\): fd \d+ failed with"),
    ),
)

# --- numeric --------------------------------------------------------------
_LOSS_SCALE_MIN_RE = re.compile(r"Current loss scale already at minimum")
_NAN_DETECTED_RE = re.compile(
    r"returned nan values in its \d+\w* output|Loss is (?:nan|inf)\b|non-finite loss|[Ll]oss became (?:NaN|nan|inf)"
)
_NAN_LOSS_RE = re.compile(r"""['"]loss['"]:\s*(?:nan|-?inf)\b|loss\w*\s*[=:]\s*(?:nan|-?inf)\b""")

# --- crashes and kills ----------------------------------------------------
# The word the shell prints for a job ended by SIGKILL: glibc's strsignal(SIGKILL) in every locale
# glibc ships (libc.po), so a zh_CN box's "已杀死" reads like "Killed".
KILLED_WORDS = (
    "Killed", "Getötet", "Processus arrêté", "Terminado (killed)", "Ucciso", "Morto", "Matat", "Matado", "Убито",
    "Вбито", "Забіты", "Убијен", "已杀死", "強制結束", "強制終了", "죽었음", "Unicestwiony", "Geëlimineerd", "Dræbt",
    "Drept", "Dödad", "Tapettu", "Zabit (SIGKILL)", "Zabitý", "Pobit", "Ubijen", "Kilőve", "Σκοτώθηκε",
    "Süreç durduruldu", "Terbunuh", "Buĉita", "Bị buộc kết thúc", "Nutraukta (killed)", "Безусловно прекъснат",
)
_KILLED_ALT = "|".join(re.escape(w) for w in KILLED_WORDS)
_SIGKILL_RE = re.compile(
    r"exitcode\s*:?\s*-9\b|Signal 9 \(SIGKILL\)|killed by signal: Killed|received signal SIGKILL"
    # DeepSpeed's launcher; subprocess and torchelastic name the signal
    r"|exits with return code = -9\b|Signals\.SIGKILL\b|got signal: 9\b"
    # the shell's job report: "Killed", "./run.sh: line 5:  1234 Killed   python x.py", or glued to a tqdm bar
    rf"|(?:^|\])(?:{_KILLED_ALT})(?:\s+\(core dumped\))?$|:\s*\d+\s+(?:{_KILLED_ALT})(?:\s|$)"
)
_EXITCODE_RE = re.compile(r"exitcode\s*:?\s*(-?\d+)")
_LOCAL_RANK_RE = re.compile(r"local_rank:\s*(\d+)")
_SEGV_RE = re.compile(r"Segmentation fault|SIGSEGV|exitcode\s*:?\s*-11\b|Signal 11\b")
_ABORT_RE = re.compile(r"Aborted \(core dumped\)|SIGABRT|exitcode\s*:?\s*-6\b|Signal 6\b|Fatal Python error: Aborted|terminate called after throwing")
_BUS_RE = re.compile(r"[Bb]us error|SIGBUS")
_DEVICE_ASSERT_RE = re.compile(r"device-side assert triggered")
_CHILD_FAILED_RE = re.compile(r"ChildFailedError")

# Exceptions that are consequences or launcher noise, not a crash cause of their own.
_NOT_A_CAUSE = {"ChildFailedError", "KeyboardInterrupt", "SystemExit"}


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


# Substrings at least one of which every rule's match contains. Candidate lines
# that merely share a broad prefilter keyword ("memory", "CUDA", "checkpoint")
# are dismissed with this one search instead of ~40 rule regexes.
_RULE_TRIGGERS = (
    "ut of memory", "OutOfMemory", "ALLOC_FAILED", "memory_error", "AllocFailed", "OUT_OF_RESOURCES",
    "allocate buffer", "MIOpen", "rocBLAS", "cache blocks", "KV cache", "on startup is less", "executable batch size",
    "DefaultCPUAllocator", "bad_alloc", "Kill process", "Killed process", "oom-kill", "oom_kill", "illegal",
    "IllegalAddress", "Memory access fault", "GPU Hang", "LaunchTimeOut", "launch timed out", "HSA_STATUS_ERROR",
    "ECC error", "Xid", "fallen off the bus", "launch failure", "LaunchFailure", "misaligned address",
    "Watchdog caught", "NCCL operations have failed", "eartbeat monitor", "watchdog got stuck", "blocking wait",
    "nccl", "NCCL error", "NCCL Error", "DistBackendError", "aborted", "Rendezvous", "DistNetworkError", "DistStoreError",
    "socket has timed out", "EADDRINUSE", "address already in use", "TCPStore", "Connection reset",
    "Connection refused", "Broken pipe", "HfArgumentParser", "validation error", "DeepSpeed config values",
    "DeepSpeedConfigError", "extra_forbidden", "Unrecognized", "not a valid model identifier", "Can't load",
    "HFValidationError", "Repo id must be", "does not appear to have a file", "Undefined dataset", "dataset_info.json",
    "does not exist", "valid samples", "valid checkpoint", "ZeRORuntimeException", "trainer_state.json",
    "Output directory", "No space left", "Errno 28", "ENOSPC", "os error 28", "StorageFull",
    "Disk quota", "Errno 122", "PytorchStreamWriter", "unexpected pos", "file write failed", "loss scale",
    ": nan", ": inf", ": -inf", "=nan", "=inf", "= nan", "= inf", "returned nan",
    "NaN", "non-finite", "Loss is", "exitcode", "SIGKILL", "Signal", "killed by signal", "Killed",
    "SIGSEGV", "Segmentation fault", "Aborted", "SIGABRT", "terminate called", "us error", "SIGBUS",
    "shared memory", "device-side assert", "ChildFailedError", "cannot start",
    "OOM when allocating", "RESOURCE_EXHAUSTED", "Malloc failed", "failed to allocate", "unable to allocate",
    "out of resource", "checkTimeout", "Timeout at NCCL work", "watchdogHandler", "ncclCommWatchdog",
    "IpcOpenMemHandle", "IpcGetMemHandle", "IPC handle", "ImportShareableBuffer",
    "OUT_OF_MEMORY", "hipError_t(1002)", "hipErrorMemoryAllocation", "Resource exhausted", "posix_memalign",
    "unable to write to file", "running low on memory", "Unable to determine the device handle", "GPU is lost",
    "NCCL WARN", "Some specified arguments", "Please specify dataset", "return code = -9", "Signals.SIGKILL",
    "got signal: 9", ":nan", *KILLED_WORDS,
    "name resolution", "NameResolution", "Failed to resolve", "service not known", "TimeoutError", "MaxRetryError",
    "ConnectionError", "Connection aborted", "connect to", "unreachable", "HTTP Error 50", "Server Error",
    "check your connection", "Internet connection", "SSLError", "ProxyError",
)
_RULE_GATE = compile_search("|".join(re.escape(k) for k in _RULE_TRIGGERS))

KEYWORDS: tuple[str, ...] = tuple(
    dict.fromkeys(_RULE_TRIGGERS + _MARKER_TRIGGERS + _VENDOR_TRIGGERS + _EXCEPTION_TRIGGERS)
)


def classify(seg: Segment) -> list[Hit]:
    """All rule hits for one cleaned segment. Pure; the order is irrelevant."""
    t = seg.text
    hits: list[Hit] = []
    exc = _short(seg.exc)
    exc_form = seg.exc is not None
    if not exc_form and not _RULE_GATE.search(t):
        return hits

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
        elif exc == "OutOfMemoryError" and not (seg.exc or "").startswith("ray."):
            # The class says it even where the message was cut (or wrapped by Ray: RayTaskError(OutOfMemoryError)).
            hits.append(Hit("torch_oom", Category.GPU_OOM, ROOT, "allocator", fatal=True,
                            numbers=gpu_oom_numbers(t), exc=seg.exc))
    if exc == "OutOfMemoryError" and (seg.exc or "").startswith("ray.") or (
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

    # Host OOM.
    if "DefaultCPUAllocator" in t and _CPU_ALLOC_RE.search(t):
        nums = {}
        m = _CPU_TRIED_RE.search(t)
        if m:
            nums["tried_to_allocate"] = int(m.group(1))
        hits.append(Hit("cpu_alloc" if exc_form else "cpu_alloc_mention", Category.HOST_OOM,
                        ROOT if exc_form else HINT, "cpu_allocator", fatal=exc_form, numbers=nums,
                        vendor="cpu", exc=seg.exc))
    if ("shared memory" in t or "Bus error" in t or "</torch_" in t) and _SHM_RE.search(t):
        hits.append(Hit("shm_exhausted", Category.HOST_OOM, ROOT, "shared_memory", fatal=exc_form, vendor="cpu",
                        exc=seg.exc))
    if "posix_memalign" in t and _CPU_ALLOC_RE.search(t) and not any(h.rule == "cpu_alloc" for h in hits):
        hits.append(Hit("cpu_alloc" if exc_form else "cpu_alloc_mention", Category.HOST_OOM,
                        ROOT if exc_form else HINT, "cpu_allocator", fatal=exc_form, vendor="cpu", exc=seg.exc))
    if exc == "MemoryError":
        hits.append(Hit("memory_error", Category.HOST_OOM, ROOT, "python_memory_error", fatal=True, vendor="cpu", exc=seg.exc))
    if "bad_alloc" in t and _BAD_ALLOC_RE.search(t):
        hits.append(Hit("bad_alloc", Category.HOST_OOM, ROOT, "bad_alloc", fatal=True, vendor="cpu"))
    if ("emory" in t or "oom" in t) and KERNEL_OOM_RE.search(t):
        hits.append(Hit("kernel_oom_kill", Category.HOST_OOM, ROOT, "oom_killer", fatal=True, vendor="cpu"))

    # Device faults.
    for name, rx, vendor in _DEVICE_RULES:
        if rx.search(t):
            hits.append(Hit(name, Category.DEVICE_FAULT, ROOT, name, fatal=True, vendor=vendor, exc=seg.exc))
            break

    # Communication.
    if _WATCHDOG_FRAME_RE.search(t):
        hits.append(Hit("nccl_timeout", Category.COMM_FAILURE, COMM, "nccl_timeout"))
    elif _WATCHDOG_OTHER_FRAME_RE.search(t):
        hits.append(Hit("nccl_error", Category.COMM_FAILURE, COMM, "nccl_watchdog"))
    elif ("Ipc" in t or "IPC" in t) and _IPC_RE.search(t):
        hits.append(Hit("ipc_handle", Category.COMM_FAILURE, COMM, "ipc_handle", exc=seg.exc))
    elif _WATCHDOG_RE.search(t):
        nums = {}
        m = _RAN_FOR_RE.search(t)
        if m:
            nums["timeout_ms"] = int(m.group(1))
        hits.append(Hit("nccl_timeout", Category.COMM_FAILURE, COMM, "nccl_timeout", numbers=nums))
    elif _NCCL_ERR_RE.search(t):
        sub = "nccl_unhandled_cuda_error" if "ncclUnhandledCudaError" in t else "nccl_error"
        hits.append(Hit("nccl_error", Category.COMM_FAILURE, COMM, sub, exc=seg.exc))
    elif _SOCKET_RE.search(t):
        hits.append(Hit("rendezvous", Category.COMM_FAILURE, COMM, "rendezvous", exc=seg.exc))

    # Transient environment failures, before config: a hub lookup that failed for want of a network.
    # (A connection between ranks - c10d store, rendezvous, NCCL - stays a comm failure.)
    if (_ENV_RE.search(t) and not _OFFLINE_RE.search(t) and (exc_form or "LocalEntryNotFoundError" in t)
            and not any(h.category is Category.COMM_FAILURE for h in hits)):
        hits.append(Hit("environment", Category.ENVIRONMENT, ROOT, "network", exc=seg.exc))
        return hits

    # Configuration.
    for name, rx in _CONFIG_RULES:
        m = rx.search(t)
        if m and (exc_form or name in ("deepspeed_config", "unknown_keys")):
            hits.append(Hit(name, Category.CONFIG_ERROR, ROOT, name, exc=seg.exc))
            break

    # Disk.
    for name, rx in _DISK_RULES:
        if rx.search(t):
            hits.append(Hit(name, Category.DISK_FULL, ROOT, name, exc=seg.exc))
            break

    # Numeric.
    if _LOSS_SCALE_MIN_RE.search(t):
        hits.append(Hit("loss_scale_min", Category.NUMERIC, ROOT, "loss_scale_at_minimum", exc=seg.exc))
    elif _NAN_DETECTED_RE.search(t):
        hits.append(Hit("nan_detected", Category.NUMERIC, ROOT if exc_form else HINT, "nan_detected", exc=seg.exc))
    elif ("nan" in t or "inf" in t) and _NAN_LOSS_RE.search(t):
        hits.append(Hit("nan_loss", Category.NUMERIC, HINT, "nan_loss"))

    # Crashes, kills, launcher summaries.
    if _SIGKILL_RE.search(t):
        hits.append(Hit("sigkill", Category.CRASH_OTHER, MARKER, "sigkill_unexplained"))
    elif _SEGV_RE.search(t):
        hits.append(Hit("segfault", Category.CRASH_OTHER, CRASH, "segfault"))
    elif _ABORT_RE.search(t) and not any(h.rule == "bad_alloc" for h in hits):
        hits.append(Hit("abort", Category.CRASH_OTHER, CRASH, "abort"))
    elif _BUS_RE.search(t):
        hits.append(Hit("bus_error", Category.CRASH_OTHER, CRASH, "bus_error"))
    if _DEVICE_ASSERT_RE.search(t):
        hits.append(Hit("device_assert", Category.CRASH_OTHER, CRASH, "device_assert", exc=seg.exc))
    if _CHILD_FAILED_RE.search(t):
        hits.append(Hit("child_failed", Category.CRASH_OTHER, MARKER, "launcher_summary", exc=seg.exc))

    if "cannot start" in t and t.startswith("oom-supervisor: cannot start"):
        hits.append(Hit("launch_failed", Category.CONFIG_ERROR, MARKER, "launch_failed"))

    if exc_form and not hits:
        if exc == "KeyboardInterrupt":
            hits.append(Hit("interrupted", Category.CRASH_OTHER, CRASH, "interrupted", exc=seg.exc))
        elif exc not in _NOT_A_CAUSE:
            hits.append(Hit("python_exception", Category.CRASH_OTHER, CRASH, "python_exception", exc=seg.exc))
    return hits


def exitcode_of(text: str) -> int | None:
    m = _EXITCODE_RE.search(text)
    return int(m.group(1)) if m else None


def local_rank_of(text: str) -> int | None:
    m = _LOCAL_RANK_RE.search(text)
    return int(m.group(1)) if m else None
