"""GPU faults said only by the kernel (issue 29): amdgpu VM page faults, the IOMMU refusing the
GPU's access, a ring timeout and the reset after it, pasted from dmesg or the journal into the log.
In the kernel's own line shape they weigh as a runtime's own report (structural, voided when
training advances after them); the same words in any other shape, or in a printed sample, are
text. Logs copied from development-part excerpts of bench/corpus (thread per constant); before
this change each read as 'no failure evidence'."""

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import diagnose_bytes
from tests.diagnosis.test_trust import HEALTHY, sample_block

# ROCm/legacy-rocm-build#5225 (device_fault_rocm_comfyui_gfxhub_page_fault_journal): journalctl.
JOURNAL_PAGE_FAULT = (
    b"Aug 23 23:38:11 jo-A6 kernel: amdgpu 0000:74:00.0: amdgpu: [gfxhub] page fault (src_id:0 ring:40 vmid:8"
    b" pasid:32771)\n"
    b"Aug 23 23:38:11 jo-A6 kernel: amdgpu 0000:74:00.0: amdgpu:  in process python3 pid 3416 thread python3 pid 3416\n"
    b"Aug 23 23:38:11 jo-A6 kernel: amdgpu 0000:74:00.0: amdgpu:   in page starting at address 0x00007bf2f3408000"
    b" from client 0x1b (UTCL2)\n"
    b"Aug 23 23:38:11 jo-A6 kernel: amdgpu 0000:74:00.0: amdgpu: GCVM_L2_PROTECTION_FAULT_STATUS:0x00841051\n"
)
# ollama/ollama#4820 (device_fault_ollama_multi_amd_gpu_iommu_io_page_fault): journal with dmesg times.
IOMMU = (
    b"Jun 23 00:26:28 TH-AI2 kernel: [349399.669937] amd_iommu_report_page_fault: 798 callbacks suppressed\n"
    b"Jun 23 00:26:28 TH-AI2 kernel: [349399.669941] amdgpu 0000:03:00.0: AMD-Vi: Event logged [IO_PAGE_FAULT"
    b" domain=0x000f address=0xe0c0000100 flags=0x0020]\n"
    b"Jun 23 00:26:28 TH-AI2 kernel: [349399.669953] amdgpu 0000:03:00.0: AMD-Vi: Event logged [IO_PAGE_FAULT"
    b" domain=0x000f address=0xe0c0001000 flags=0x0020]\n"
)
# freebsd/drm-kmod#387 (device_fault_freebsd_llamacpp_vulkan_ring_timeout_mes).
RING_TIMEOUT = (
    b"[drm ERROR :amdgpu_job_timedout] ring gfx_0.0.0 timeout, signaled seq=12174921, emitted seq=12174923\n"
    b"[drm ERROR :amdgpu_job_timedout] Process information: process  pid 540118 thread  pid 540118\n"
    b"drmn0: GPU reset begin!\n"
)


def test_kernel_fault_lines_pasted_into_the_log_are_a_device_fault():
    for log, subkinds in ((JOURNAL_PAGE_FAULT, {"gpu_page_fault"}), (IOMMU, {"iommu_page_fault"}),
                          (RING_TIMEOUT, {"gpu_hang"})):
        for exit in (None, ExitRecord(returncode=1)):
            d = diagnose_bytes(log, exit)
            assert d.category is Category.DEVICE_FAULT, d.summary
            assert d.subkind in subkinds and d.vendor == "hip"


def test_the_same_lines_in_a_printed_sample_do_not_act():
    for log in (JOURNAL_PAGE_FAULT, IOMMU, RING_TIMEOUT):
        assert diagnose_bytes(sample_block(log), ExitRecord(returncode=1)).category is Category.UNKNOWN


def test_the_same_words_outside_the_kernels_shape_are_text():
    """A program quoting the fault is not the kernel reporting it (never a device_fault from text)."""
    quoted = (b"INFO: if you see 'amdgpu 0000:74:00.0: amdgpu: [gfxhub] page fault' in dmesg, lower the clocks\n"
              b"note: ring gfx_0.0.0 timeout and GPU reset begin are printed by the driver\n")
    d = diagnose_bytes(quoted, ExitRecord(returncode=1))
    assert d.category is not Category.DEVICE_FAULT, d.summary


def test_a_fault_that_training_went_past_does_not_decide():
    d = diagnose_bytes(JOURNAL_PAGE_FAULT + HEALTHY, ExitRecord(returncode=1))
    assert d.category is not Category.DEVICE_FAULT, d.summary


def test_other_kernel_device_reports_in_the_same_shape():
    """Beyond the corpus: Linux's own ring-timeout line and an uncorrected PCIe error, as dmesg prints them."""
    for line, sub in (((b"[ 5123.123456] [drm:amdgpu_job_timedout [amdgpu]] *ERROR* ring gfx timeout, signaled seq=1,"
                       b" emitted seq=3\n"), "gpu_hang"),
                      ((b"[ 1234.567890] pcieport 0000:00:01.1: AER: Uncorrected (Fatal) error received:"
                       b" 0000:01:00.0\n"), "pcie_aer")):
        d = diagnose_bytes(line, None)
        assert (d.category, d.subkind) == (Category.DEVICE_FAULT, sub), d.summary


# NVIDIA/apex#124 (device_fault_apex_fp16_thcudacheck_misaligned_address): THC's own check line, then
# the traceback it raised, cut by the paste before its exception line.
APEX_124 = (
    b"THCudaCheck FAIL file=/pytorch/aten/src/THC/THCTensorCopy.cu line=84 error=74 : misaligned address\n"
    b"Traceback (most recent call last):\n"
    b'  File "full_main.py", line 394, in <module>\n'
    b"    full_main()\n"
    b'  File "full_main.py", line 184, in full_main\n'
    b"    loss = train(train_loader, model, criterion, optimizer, epoch, log_training,args.fp16)\n"
)


def test_the_thc_runtime_check_line_is_the_runtimes_own_report():
    for exit in (None, ExitRecord(returncode=1)):
        d = diagnose_bytes(APEX_124, exit)
        assert d.category is Category.DEVICE_FAULT, d.summary
    check = APEX_124.split(b"\n", 1)[0] + b"\n"
    assert diagnose_bytes(sample_block(check), ExitRecord(returncode=1)).category is Category.UNKNOWN
    assert diagnose_bytes(check + HEALTHY, ExitRecord(returncode=1)).category is not Category.DEVICE_FAULT


def test_a_pasted_xid_counts_but_not_the_cleanup_after_a_process_ended():
    """noonghunna/club-3090 (device_fault_club3090_fp8_xid13_skedcheck): Xid 13, the kernel's view of a
    faulting kernel, decides alone; Xid 43/45 (channel cleanup, after any process that ended) do not."""
    xid13 = (b"[Tue Jul 21 23:13:57 2026] NVRM: Xid (PCI:0000:07:00): 13, Graphics Exception:"
             b" SKEDCHECK02_LOCAL_MEMORY_LOW_SIZE failed\n")
    assert diagnose_bytes(xid13, None).category is Category.DEVICE_FAULT
    for code in (b"43", b"45"):
        cleanup = b"[Tue Jul 21 23:13:57 2026] NVRM: Xid (PCI:0000:07:00): " + code + b", pid=1234, Ch 00000008\n"
        assert diagnose_bytes(cleanup, None).category is not Category.DEVICE_FAULT
