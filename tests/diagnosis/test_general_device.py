"""Device faults in the kernel's words as a paste keeps them (issue 29, generalising): journalctl's
`-o cat`/short forms leave `kernel: NVRM: Xid ...`; an Xid 45 'caused by previous Xid N' takes N's
meaning (N = 145..150: NVLink errors in NVIDIA's Xid catalogue: hardware)."""

from supervisor.core.models import Category
from supervisor.judge.diagnosis import diagnose_bytes


def test_kernel_prefixed_xid45_after_an_nvlink_xid_is_a_device_fault():
    # bench r6 device_fault_nvopen_xid45_after_xid149_python3 (NVIDIA/open-gpu-kernel-modules)
    log = (b"kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149\n"
           b"kernel: NVRM: Xid (PCI:0000:ed:00): 45, pid=1818992, name=python3, Ch 0000000c caused by previous Xid 145\n")
    d = diagnose_bytes(log, None)
    assert d.category is Category.DEVICE_FAULT, d.summary


def test_kernel_prefixed_xid45_alone_is_not():
    log = b"kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001\n"
    assert diagnose_bytes(log, None).category is not Category.DEVICE_FAULT


def _tb(exc: bytes) -> bytes:
    return b'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n    loss.backward()\n' + exc


def test_cuda_driver_api_names_and_runtime_strings_of_hardware_faults():
    """cuda.h's CUresult names (JAX/XLA, CuPy, numba print them) and cudaGetErrorString's texts for
    the faults the runtime documents as leaving the context unusable: ECC, NVLink, hardware stack,
    illegal instruction, misaligned address, invalid program counter, launch failure."""
    for exc in (b"jaxlib.xla_extension.XlaRuntimeError: INTERNAL: CUDA_ERROR_ILLEGAL_ADDRESS: operation failed\n",
                b"cupy_backends.cuda.api.driver.CUDADriverError: CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure\n",
                b"RuntimeError: CUDA error: uncorrectable NVLink error detected during the execution\n",
                b"RuntimeError: CUDA error: hardware stack error\n",
                b"RuntimeError: CUDA error: invalid program counter\n",
                (b"numba.cuda.cudadrv.driver.CudaAPIError: [214] Call to cuCtxSynchronize results in"
                b" CUDA_ERROR_ECC_UNCORRECTABLE\n")):
        d = diagnose_bytes(_tb(exc), None)
        assert d.category is Category.DEVICE_FAULT, (exc, d.summary)


def test_the_same_words_printed_by_a_running_program_do_not_act():
    log = b"note: CUDA_ERROR_ILLEGAL_ADDRESS is retried by our wrapper\n{'loss': 1.0, 'epoch': 1.0}\n"
    assert diagnose_bytes(log, None).category is not Category.DEVICE_FAULT
