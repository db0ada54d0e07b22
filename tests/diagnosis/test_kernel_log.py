"""Kernel evidence: the daemon's read of the kernel log for an attempt's window, and what it means.

The read is real (this box's /dev/kmsg or dmesg); a record is injected through /dev/kmsg where the
test may write there (root). The injected line is an OOM kill naming a cgroup and pid of nobody's, so
no other reader that filters by its own job (as the daemon does) can take it for theirs.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import pytest

from supervisor.core.models import Category, ExitRecord, HostEvidence
from supervisor.judge.diagnosis import diagnose_bytes
from supervisor.judge.diagnosis.kernel import device_faults
from supervisor.run import kernel_log

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "logs" / "real"


def _kmsg_writable() -> bool:
    return os.access("/dev/kmsg", os.W_OK) and os.access("/dev/kmsg", os.R_OK)


@pytest.mark.skipif(not _kmsg_writable(), reason="needs a readable and writable /dev/kmsg (root)")
def test_a_kernel_oom_kill_in_the_window_is_read_for_its_cgroup_only():
    tag = f"oom-supervisor/test-kernel-log-{uuid.uuid4().hex[:12]}"
    since = time.time()
    line = (f"oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/{tag},"
            f"task_memcg=/{tag},task=python,pid=4194301,uid=0")
    with open("/dev/kmsg", "w") as fh:
        fh.write(line + "\n")
    got = kernel_log.read_window(since - 1, time.time() + 1, cgroup=tag)
    assert got.read and got.source
    assert any(tag in x for x in got.lines), got
    other = kernel_log.read_window(since - 1, time.time() + 1, cgroup="oom-supervisor/another-job", pids=[1])
    assert not any(tag in x for x in other.lines)  # another job's kill is not this one's
    before = kernel_log.read_window(since - 3600, since - 60, cgroup=tag)
    assert not any(tag in x for x in before.lines)  # outside the window
    d = diagnose_bytes(b"step 3\n", ExitRecord(returncode=-9, signal="SIGKILL"),
                       HostEvidence(kernel_lines=got.lines, kernel_log_read=got.read))
    assert (d.category, d.subkind) == (Category.HOST_OOM, "oom_killer"), d.summary


def test_reading_is_bounded_and_says_when_it_could_not_read():
    got = kernel_log.read_window(time.time() - 60)
    assert len(got.lines) <= kernel_log.MAX_LINES
    assert got.read == bool(got.source)
    if not got.read:
        assert got.lines == ()


@pytest.mark.skipif(shutil.which("dmesg") is None, reason="no dmesg")
def test_dmesg_iso_output_is_parsed_into_the_window():
    text = ("2024-04-05T21:29:39,123456+00:00 NVRM: Xid (PCI:0000:a1:00): 79, pid='<unknown>', name=<unknown>, GPU "
            "has fallen off the bus.\n2024-04-05T23:00:00,000000+00:00 usb 1-1: new device\n")
    t0 = 1712352579.0
    assert kernel_log._iso_window(text, t0 - 5, t0 + 5) == [
        "NVRM: Xid (PCI:0000:a1:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."]
    assert kernel_log._iso_window(text, t0 + 10, t0 + 20) == []


def test_what_the_kernel_says_about_a_device():
    lines = [
        "NVRM: Xid (PCI:0000:3b:00): 13, pid=123, name=python, Graphics Exception: ESR 0x5",  # an app's own bug
        "NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001 caused by previous Xid 149",
        "pcieport 0000:00:03.0: AER: Corrected error received: 0000:00:03.0",  # corrected: not a fault
        "pcieport 0000:00:01.0: AER: Uncorrected (Fatal) error received: 0000:01:00.0",
        "amdgpu 0000:c1:00.0: amdgpu: GPU reset begin!",
    ]
    got = [(f.subkind, f.code) for f in device_faults(lines)]
    assert got == [("xid", 149), ("pcie_aer", None), ("gpu_hang", None)]
    assert device_faults(["NVRM: Xid (PCI:0000:3b:00): 31, pid=1, name=python, Ch 00000008, MMU Fault"]) == []


def test_a_kernel_device_fault_explains_a_crash_the_log_calls_generic():
    log = b"Traceback (most recent call last):\n  File \"t.py\", line 1, in training_step\nRuntimeError: CUDA error: unknown error\n"
    host = HostEvidence(kernel_lines=("NVRM: Xid (PCI:0000:a1:00): 79, pid=7, name=python, GPU has fallen off the bus.",),
                        kernel_log_read=True)
    d = diagnose_bytes(log, ExitRecord(1), host)
    assert (d.category, d.subkind, d.vendor) == (Category.DEVICE_FAULT, "fallen_off_bus", "cuda"), d.summary
    assert any(e.rule == "host:kernel_fallen_off_bus" for e in d.evidence)
    assert "Xid 79" in d.summary
    # an application-class Xid alone is no device fault: the crash stays a crash
    app = HostEvidence(kernel_lines=("NVRM: Xid (PCI:0000:a1:00): 13, pid=7, name=python, Graphics Exception",),
                       kernel_log_read=True)
    assert diagnose_bytes(log, ExitRecord(1), app).category is Category.CRASH_OTHER
    # a structural OOM in the log is the cause even when the kernel reported a fault in the window
    oom = log.replace(b"RuntimeError: CUDA error: unknown error",
                      b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.")
    assert diagnose_bytes(oom, ExitRecord(1), host).category is Category.GPU_OOM


def test_explain_takes_a_kernel_log(tmp_path):
    from tests.diagnosis.test_explain import _run

    case = REAL / "device_fault_nvsentinel_fallen_off_bus_no_xid"
    rc, out, err = _run([str(case.with_suffix(".log")), "--kernel-log", str(case.with_suffix(".kernel.log")),
                         "--exit-code", "1", "--json"])
    import json

    d = json.loads(out)
    assert rc == 0 and err == ""
    assert (d["category"], d["subkind"], d["vendor"]) == ("device_fault", "fallen_off_bus", "cuda"), d["summary"]
    rc, out, _ = _run([str(case.with_suffix(".log")), "--exit-code", "1", "--json"])
    assert json.loads(out)["category"] != "device_fault"  # without the kernel's word the empty log says nothing


@pytest.mark.skipif(not _kmsg_writable(), reason="needs a readable and writable /dev/kmsg (root)")
def test_an_attempt_that_names_no_process_claims_no_oom_kill():
    """Nothing to match a kill against (no pid, no cgroup): another job's kill is not this one's."""
    since = time.time()
    with open("/dev/kmsg", "w") as fh:
        fh.write("Out of memory: Killed process 4194297 (python) total-vm:1kB, anon-rss:1kB\n")
    got = kernel_log.read_window(since - 1, time.time() + 1)
    assert got.read
    assert not any("4194297" in x for x in got.lines), got.lines


@pytest.mark.skipif(not _kmsg_writable(), reason="needs a readable and writable /dev/kmsg (root)")
def test_a_rank_killed_without_a_cgroup_is_this_attempts_kill():
    """Without a cgroup the kernel names the rank it killed, not the attempt's main process: every
    process the daemon saw in the attempt's tree is the attempt's (the torchrun agent lives on)."""
    from supervisor.daemon.verdict import attempt_pids
    from supervisor.run.ownership import Owner
    from supervisor.run.proctree import Handle

    since = time.time()
    with open("/dev/kmsg", "w") as fh:
        fh.write("Out of memory: Killed process 4194293 (python) total-vm:1kB, anon-rss:1kB\n")
    handle = Handle(pid=1, create_time=0.0, owner=Owner(tag="t", known={4194291: 1.0, 4194293: 2.0}))
    pids = attempt_pids({"pid": 4194291}, handle)
    assert pids == {4194291, 4194293}
    got = kernel_log.read_window(since - 1, time.time() + 1, pids=pids)
    assert any("4194293" in x for x in got.lines), got.lines
