"""The GPU or its driver failed: illegal accesses, HSA errors, ECC, Xid, a GPU fallen off the bus."""

from __future__ import annotations

import re

from supervisor.core.models import Category
from supervisor.judge.diagnosis.hits import ROOT, Hit, Segment
from supervisor.judge.diagnosis.kernel import log_fault

# --- device faults --------------------------------------------------------
_DEVICE_RULES: tuple[tuple[str, re.Pattern[str], str | None], ...] = (
    ("illegal_memory_access", re.compile(r"illegal memory access|\b(?:hip|cuda)ErrorIllegalAddress\b"
                                         r"|\bCUDA_ERROR_ILLEGAL_ADDRESS\b"), None),
    ("memory_access_fault", re.compile(r"Memory access fault by GPU node"), "hip"),
    ("gpu_hang", re.compile(r"GPU Hang|reason\s*:\s*GPU Hang|\bhipErrorLaunchTimeOut\b|launch timed out"), None),
    ("hsa_error", re.compile(r"HSA_STATUS_ERROR_(?!OUT_OF_RESOURCES)\w+"), "hip"),
    ("ecc_error", re.compile(r"uncorrectable ECC error|\bECC error\b|ECC errors? (?:detected|encountered)"
                             r"|\bCUDA_ERROR_ECC_UNCORRECTABLE\b|\bcudaErrorECCUncorrectable\b"), None),
    # cudaErrorNvlinkUncorrectable's text, cuda.h's name
    ("nvlink_error", re.compile(r"uncorrectable NVLink error|\bCUDA_ERROR_NVLINK_UNCORRECTABLE\b"), "cuda"),
    # not Xid 43/45 (a channel cleaned up after any process that ended): aftermath, not a fault
    ("xid", re.compile(r"\bXid \((?:PCI:)?[0-9a-fA-F:.]+\):\s*(?!4[35]\b)\d+|\bNVRM: Xid\b(?!\s*\()"), "cuda"),
    ("fallen_off_bus", re.compile(r"fallen off the bus"), None),
    ("launch_failure", re.compile(r"unspecified launch failure|\bhipErrorLaunchFailure\b|\bCUDA_ERROR_LAUNCH_FAILED\b"),
     None),
    # also the THC era's "THCudaCheck FAIL ... error=74 : misaligned address" / "cuda runtime error (74) : ..."
    ("kernel_fault", re.compile(r"(?:(?:CUDA|HIP) error:|\berror=\d+ :|runtime error \(\d+\) :)"
                                r" (?:misaligned address|an illegal instruction was encountered|hardware stack error"
                                r"|invalid program counter)"
                                # cuda.h's names for the same (JAX/XLA, CuPy, numba print these)
                                r"|\bCUDA_ERROR_(?:MISALIGNED_ADDRESS|ILLEGAL_INSTRUCTION|HARDWARE_STACK_ERROR|INVALID_PC)\b"),
     None),
    # nvidia-smi / NVML can no longer reach the GPU: it fell off the bus or its driver state is lost.
    ("gpu_lost", re.compile(r"Unable to determine the device handle for (?:GPU|gpu)|\bGPU is lost\b"), "cuda"),
)


def find(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> None:
    """Append this family's hits for one segment (`t` its text, `exc` its short exception class)."""
    # Device faults. A kernel line pasted into the log (dmesg, the journal) in the kernel's own shape
    # first: the scanner weighs it as a runtime's own report (kernel.log_fault decides the shape).
    k = log_fault(t)
    if k is not None:
        hits.append(Hit(f"kernel_{k.subkind}", Category.DEVICE_FAULT, ROOT, k.subkind, fatal=True, vendor=k.vendor,
                        numbers={"xid": k.code} if k.code is not None else {}))
        return
    for name, rx, vendor in _DEVICE_RULES:
        if rx.search(t):
            hits.append(Hit(name, Category.DEVICE_FAULT, ROOT, name, fatal=True, vendor=vendor, exc=seg.exc))
            break
