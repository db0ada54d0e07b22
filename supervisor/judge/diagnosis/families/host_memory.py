"""Host memory ran out: PyTorch's CPU allocator, /dev/shm for DataLoader workers, std::bad_alloc,
MemoryError, the kernel's OOM killer as the log quotes it."""

from __future__ import annotations

import re

from supervisor.core.models import Category
from supervisor.judge.diagnosis.hits import HINT, ROOT, Hit, Segment
from supervisor.judge.diagnosis.kernel import KERNEL_OOM_RE

# --- host OOM -------------------------------------------------------------
_CPU_ALLOC_RE = re.compile(r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)"
                           # PyTorch <= 1.1's CPUAllocator: posix_memalign returned ENOMEM (12)
                           r"|posix_memalign\(.*\)\s*==\s*0\.?\s*12 vs 0")
# /dev/shm exhausted: DataLoader workers pass batches through shared memory.
_SHM_RE = re.compile(r"insufficient shared memory|out of shared memory|killed by signal: Bus error"
                     r"|unable to write to file </torch_\w+>")
_CPU_TRIED_RE = re.compile(r"you tried to allocate (\d+) bytes")
# ...and Rust's default alloc error handler (tokenizers, safetensors), which then aborts the process
_BAD_ALLOC_RE = re.compile(r"std::bad_alloc|^memory allocation of \d+ bytes failed")
# The OS refused memory (ENOMEM: a fork of a large process, an mmap), Arrow's allocator failed.
# Windows spells ENOMEM "Not enough space"; its commit limit (WinError 1455, the paging file) is the same
# exhaustion of host memory; torch's shared-memory mmap reports ENOMEM as "Cannot allocate memory (12)".
_ENOMEM_RE = re.compile(r"\[Errno 12\]\s*(?:Cannot allocate memory|Not enough space)|\[WinError 1455\]"
                        r"|The paging file is too small for this operation to complete|Cannot allocate memory \(12\)")
# A scheduler, orchestrator or runtime saying in its own words that the job ran out of host memory:
# slurmstepd's cgroup count ("Detected 1 oom-kill event(s) in StepId=..."), srun's step state ("task 0: Out Of
# Memory"), Kubernetes' container status ("Reason: OOMKilled"), YARN's container monitor ("running beyond
# physical memory limits"), the Go runtime's throw, a shell's fork that got ENOMEM.
_HOST_OOM_SAID_RE = re.compile(r"Detected \d+ oom[-_]kill events?|srun: error: .*: tasks? [\d,-]+: Out Of Memory"
                               r"|Reason:\s+OOMKilled\b|\bOOMKilled\b|running beyond physical memory limits"
                               r"|fatal error: runtime: out of memory|\bfork: Cannot allocate memory")
# numpy's _ArrayMemoryError ("Unable to allocate 7.45 GiB for an array with shape"), the JVM's heap.
_HOST_ALLOC_EXCS = frozenset({"MemoryError", "ArrowMemoryError", "_ArrayMemoryError"})


def find(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> None:
    """Append this family's hits for one segment (`t` its text, `exc` its short exception class)."""
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
    if exc_form and ("Errno 12" in t or "1455" in t or "paging file" in t or "(12)" in t) and _ENOMEM_RE.search(t):
        hits.append(Hit("enomem", Category.HOST_OOM, ROOT, "enomem", fatal=True, vendor="cpu", exc=seg.exc))
    gpu = any(h.category is Category.GPU_OOM for h in hits)  # Paddle raises its GPU OOM as MemoryError
    if (exc in _HOST_ALLOC_EXCS and not gpu) or (exc == "OutOfMemoryError" and (seg.exc or "").startswith("java.")):
        hits.append(Hit("memory_error", Category.HOST_OOM, ROOT, "python_memory_error", fatal=True, vendor="cpu", exc=seg.exc))
    if ("bad_alloc" in t or "memory allocation of" in t) and _BAD_ALLOC_RE.search(t) and not gpu:  # RAPIDS: std::bad_alloc: out_of_memory: CUDA
        hits.append(Hit("bad_alloc", Category.HOST_OOM, ROOT, "bad_alloc", fatal=True, vendor="cpu"))
    if ("emory" in t or "oom" in t or "OOM" in t) and _HOST_OOM_SAID_RE.search(t) and not KERNEL_OOM_RE.search(t):
        hits.append(Hit("oom_reported", Category.HOST_OOM, ROOT, "oom_killer", fatal=True, vendor="cpu"))
    if ("emory" in t or "oom" in t) and KERNEL_OOM_RE.search(t):
        hits.append(Hit("kernel_oom_kill", Category.HOST_OOM, ROOT, "oom_killer", fatal=True, vendor="cpu"))
