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
