"""What a log line means: the rule table and the per-line classifier (pure).

The scanner finds candidate lines with one cheap keyword pass (`KEYWORDS`) and
hands each candidate segment (one `\\r`-delimited piece of a line, ANSI codes
removed) to `classify()`. Rules were written from upstream texts: PyTorch's
CUDACachingAllocator (every era; HIP and `allowed;` variants), c10
DefaultCPUAllocator, ProcessGroupNCCL, DeepSpeed's loss scaler and config
models, vLLM's KV-cache checks, LLaMA-Factory's parser and loaders.

What each family's lines mean lives in `families/` (one module per family); the order they are
asked in is `FAMILIES` below. Tiers (hits.py) order root causes; conclude.py combines them.
"""

from __future__ import annotations

import re

from supervisor.core.models import Phase
from supervisor.judge.diagnosis.families import (
    comm,
    config,
    crash,
    device,
    disk,
    environment,
    gpu_memory,
    hedge,
    host_memory,
    numeric,
)
from supervisor.judge.diagnosis.families.crash import (
    _EXITCODE_RE,
    _LOCAL_RANK_RE,
    KILLED_WORDS,
)
from supervisor.judge.diagnosis.fastre import compile_search
from supervisor.judge.diagnosis.hits import HINT, ROOT, Hit, Segment
from supervisor.judge.diagnosis.prefixes import KNOWN_PREFIX_RE, PrefixModel, undecorate

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
    "Continuing training", "Resuming training", "optimization steps", "skipped=", "batch size of", "OVERFLOW", "overflow detected", "scale overflow!",
    "local_rank", "is ready now", "Deleting older checkpoint", "Gradient overflow", "Loading weights",
    "Load checkpoint", "Loading checkpoint from", "loading model tensors", "zero partition checkpoints", "zero checkpoints",
    # chained exceptions; C++ aborts; a program that says it retries after an OOM
    "above exception", "what():", "terminated with exception", "aborting with error", "retrying", "Retrying",
    "falling back",
    # the bottom edge of a rich-style traceback's box (scan_rich.py)
    "╰─",
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
    # a leading "." : the class of a dotted path whose module part another process's write split off
    # ("pydantic.error_wrappers  File ..." / ".ValidationError: 3 validation errors for ...")
    # Python's base class itself (`raise Exception("...")`: DeepSpeed's loss scaler, many scripts)
    r"^\.?(?P<exc>(?:[A-Za-z_]\w*\.)*(?:[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)|Exception(?=:))"
    # any CamelCase class with a module path: triton.runtime.errors.OutOfResources
    r"|(?:[a-z_][a-z0-9_]*\.)+[A-Z][a-z0-9]+[A-Z]\w*"
    # the stdlib's lowercase socket errors (socket.gaierror: a failed name lookup)
    r"|socket\.(?:gaierror|herror|timeout))"
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
# DeepSpeed's fused ("OVERFLOW! Rank 0 Skipping step") and unfused ("fp16 dynamic loss scale overflow! Skipping
# step") optimizers
LOSS_SCALE_RE = re.compile(r"(?:OVERFLOW!|scale overflow! Skipping step\.|Overflow detected\. Skipping step\.)"
                           r".*?Attempted loss scale: (\d+(?:\.\d+)?)(?:, reducing to (\d+(?:\.\d+)?))?")
# DeepSpeed's fp16 fused_optimizer._update_scale, on each overflow: "Reducing dynamic loss scale from 2 to 1"
SCALE_REDUCED_RE = re.compile(r"Reducing dynamic loss scale from (\d+(?:\.\d+)?) to (\d+(?:\.\d+)?)")
# Megatron/apex-style: "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 0.5"
# fairseq/trainer.py: "NOTE: gradient overflow detected, ignoring gradient, setting loss scale to: 64.0"
GRAD_OVERFLOW_RE = re.compile(r"(?:Gradient overflow\.\s+Skipping step,.*?reducing (?:loss scale )?to"
                              r"|overflow detected, ignoring gradient, setting loss scale to:)\s*(\d+(?:\.\d+)?(?:e[-+]?\d+)?)")
TORCHRUN_RANK_RE = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank")


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
        glued = next(reversed(list(_GLUED_RANK_RE.finditer(text))), None)  # the last one
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


# Substrings at least one of which every rule's match contains. Candidate lines
# that merely share a broad prefilter keyword ("memory", "CUDA", "checkpoint")
# are dismissed with this one search instead of ~40 rule regexes.
_RULE_TRIGGERS = (
    "ut of memory", "OutOfMemory", "ALLOC_FAILED", "memory_error", "AllocFailed", "OUT_OF_RESOURCES",
    "allocate buffer", "MIOpen", "rocBLAS", "cache blocks", "KV cache", "on startup is less", "executable batch size",
    "DefaultCPUAllocator", "bad_alloc", "memory allocation of", "Kill process", "Killed process", "oom-kill", "oom_kill", "oom_reaper", "illegal",
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
    "Disk quota", "Errno 122", "PytorchStreamWriter", "unexpected pos", "file write failed", "cannot be opened.",
    "requested and", "loss scale",
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
    "check your connection", "Internet connection", "SSLError", "ProxyError", "CommError", "ServiceUnavailable",
    "Service Unavailable", "Service Temporarily Unavailable", "Bad Gateway", "Gateway Time",
    # config checks said outside an exception line (families/config.py)
    "size mismatch for", "Please verify arguments", "is not in struct", "Could not override", "only the following",
    ": error: ", "error: Parser key", "error: Validation failed", "is not registered", "is already registered",
    "Correct your", "path to an existing", "call to target", "locating target", "Missing mandatory value", "model is torch.Size",
    "TypeError(", "No such option", "Invalid value for", "Missing option", "Missing argument", "Missing parameter",
    "unexpected extra argument",
    # numeric blow-ups in other frameworks' words (families/numeric.py)
    "oss is nan", "oss is NaN", "oss is inf", "Invalid loss", "Tensor had", "found NaN",
    "found Inf", "found nan", "found inf", "loss scale reached", "cannot be clipped", "probability tensor",
    "found invalid values", "is not finite", "NaN loss", "nan loss", "Inf loss", "inf loss", "non-finite",
    "oss was", "oss has become", "oss went", "oss turned", "gradients detected", "gradient detected",
    "contains NaN", "contains infinity", "Inf found in input", "float NaN", "float infinity",
    "isnan(", "isinf(", "isfinite(", "isneginf(", "isposinf(",
    # a script's check of its own settings, on a traceback's code line (families/checks.py)
    "args.", "cfg.", "config.", "conf.", "opt.", "opts.", "hparams.", "hp.", "params.", "flags.", "FLAGS.", "options.",
    "args[", "cfg[", "config[", "conf[", "opt[", "hparams[",
    "] Assertion `", ": Assertion `", ": Assertion '", "n't exist", "not exists",  # CUDA's device-side and glibc's assert(); a path check's words
    # comm: rendezvous, stores, gloo and NCCL's network code (families/comm.py)
    "store based barrier", "got error", "client socket", "closed by peer", "socket.cc:", "bootstrap.cc:",
    "net_ib.cc:", "ibvwrap.cc:", "socketPollConnect", "waiting for clients", "monitoredBarrier", "HorovodInternalError",
    "lost communication with a remote", "peer process has unexpectedly",
    "Max retries exceeded", "Failed to establish a new connection",  # families/environment.py
    "page fault", "PAGE_FAULT", "job_timedout", "GPU reset", "GPU fault detected", "AER:",  # kernel lines (kernel.py)
    "server socket", "resolve host", "ReadTimeout", "ConnectTimeout", "Read timed out",
    "getaddrinfo failed", "specific connection error", "connect timeout=", "socket.timeout", "gaierror", "herror:",
    "no space left", "Not enough disk space", "WinError 112", "enough space on the disk",
    ".tempstate", "write error: wrote", "EDQUOT", "os error 122", "errno = 28", "disk is full",  # families/disk.py
    "ChunkedEncoding", "Connection broken", "RemoteDisconnected", "Remote end closed", "ClientConnectorError",
    "Cannot connect to host", "ServerDisconnected", "ClientPayloadError", "CERTIFICATE_VERIFY_FAILED",
    "ILLEGAL_ADDRESS", "LAUNCH_FAILED", "ECC_UNCORRECTABLE", "ECCUncorrectable", "NVLink error", "NVLINK_UNCORRECTABLE",
    "MISALIGNED_ADDRESS", "ILLEGAL_INSTRUCTION", "HARDWARE_STACK_ERROR", "INVALID_PC", "hardware stack error",
    "invalid program counter",
    # device memory in other runtimes' words (families/gpu_memory.py _MORE_GPU_OOM_RE)
    "ALLOCATION_FAILED", "CUDA calloc", "Dst tensor is not initialized", "no enough memory",
    "Not enough memory", "Requested amount of GPU memory", "retval=2", "MEMORY_ALLOCATION", "EL0004",
    "metal::malloc", "OUT_OF_DEVICE_MEMORY", "OutOfDeviceMemory", "Device memory allocation", "out_of_memory",
    "requested buffer", "ran out of memory", "Ran out of memory", "paging file", "Not enough space",
    "Out Of Memory", "OOMKilled", "beyond physical memory", "Cannot allocate memory",
)
_RULE_GATE = compile_search("|".join(re.escape(k) for k in _RULE_TRIGGERS))

KEYWORDS: tuple[str, ...] = tuple(
    dict.fromkeys(_RULE_TRIGGERS + _MARKER_TRIGGERS + _VENDOR_TRIGGERS + _EXCEPTION_TRIGGERS)
)


# The precedence table: families asked in this order for every candidate segment. A family sees
# the hits of those before it: the launcher's rendezvous comm hit keeps a connection refused out of
# `environment`; `environment` stops the walk (a failed hub lookup is not a missing model); `config`
# and `disk` follow the memory, device and comm families; `crash` (kills, segfaults, any other
# exception) is the fallback and speaks for an exception only when nothing else did.
FAMILIES = (
    hedge.find,  # a list of possible causes (Ray's dead-worker report) is no family's evidence
    gpu_memory.find,
    host_memory.find,
    device.find,
    comm.find,
    environment.find,
    config.find,
    disk.find,
    numeric.find,
    crash.find,
)
# What the scanner and the tests read from here besides classify (defined in hits.py and families/).
__all__ = ["HINT", "ROOT", "Hit", "Segment", "classify", "split_prefix"]


def classify(seg: Segment) -> list[Hit]:
    """All rule hits for one cleaned segment. Pure; the order of the hits is irrelevant, the order of
    FAMILIES is not: environment stops the walk (a failed hub lookup is not a missing model), config
    and the generic crash fallback look at what the families before them found."""
    t = seg.text
    hits: list[Hit] = []
    exc = _short(seg.exc)
    exc_form = seg.exc is not None
    if not exc_form and not _RULE_GATE.search(t):
        return hits
    for family in FAMILIES:
        if family(seg, t, exc, exc_form, hits):
            break
    return hits


def exitcode_of(text: str) -> int | None:
    m = _EXITCODE_RE.search(text)
    return int(m.group(1)) if m else None


def local_rank_of(text: str) -> int | None:
    m = _LOCAL_RANK_RE.search(text)
    return int(m.group(1)) if m else None
