"""VRAM telemetry with fake vendor tools on PATH: real subprocesses printing recorded output."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import pytest

from supervisor.run.gpus import VramSampler, compute_apps_vram, read_vram, wait_vram_released

MiB, GiB = 1 << 20, 1 << 30

# nvidia-smi 550: used MiB per GPU comes from a file the test rewrites; one line per call is
# appended to calls.log so a test can make memory go away after N memory readings.
NVIDIA_SMI = r"""#!/bin/sh
d="$(dirname "$0")"
echo "$*" >> "$d/calls.log"
case "$*" in
  *--query-gpu=index,memory.used,memory.total*)
    n=$(grep -c "memory.used" "$d/calls.log")  # memory readings only: other queries may be cached
    if [ -f "$d/release_after" ] && [ "$n" -gt "$(cat "$d/release_after")" ]; then
      echo "0, 3, 81559"; echo "1, 1, 81559"
    else
      cat "$d/used.csv"
    fi ;;
  *--query-gpu=index,pci.bus_id*) echo "0, 00000000:18:00.0"; echo "1, 00000000:3B:00.0" ;;
  *--query-compute-apps*) cat "$d/apps.csv" ;;
  *) exit 9 ;;
esac
"""

# rocm-smi 6.2 `--showmeminfo vram --json`, as printed on an MI250X node (two GCDs shown).
ROCM_SMI_JSON = {"card0": {"VRAM Total Memory (B)": "68702699520", "VRAM Total Used Memory (B)": "56908177408"},
                 "card1": {"VRAM Total Memory (B)": "68702699520", "VRAM Total Used Memory (B)": "11071488"}}

# amd-smi 24.x `metric --mem-usage --json` on an MI300X.
AMD_SMI_JSON = [{"gpu": 0, "mem_usage": {"total_vram": {"value": 196592, "unit": "MB"},
                                         "used_vram": {"value": 181200, "unit": "MB"},
                                         "free_vram": {"value": 15392, "unit": "MB"}}}]


def tool(bin_dir: Path, name: str, body: str) -> None:
    p = bin_dir / name
    p.write_text(body)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_bin(tmp_path, monkeypatch):
    d = tmp_path / "bin"
    d.mkdir()
    monkeypatch.setenv("PATH", f"{d}:/usr/bin:/bin")
    return d


NODRM = Path("/nonexistent-drm")


def test_nvidia_peak_per_attempt_counts_only_its_processes(fake_bin):
    tool(fake_bin, "nvidia-smi", NVIDIA_SMI)
    (fake_bin / "used.csv").write_text("0, 30512, 81559\n1, 51000, 81559\n")
    (fake_bin / "apps.csv").write_text("4242, 00000000:18:00.0, 30000\n4243, 00000000:18:00.0, 500\n"
                                       "9999, 00000000:3B:00.0, 51000\n")  # another user's job on GPU 1
    s = VramSampler([0, 1], interval=0.05, timeout=5, drm_root=NODRM, pids=lambda: [4242, 4243])
    s.sample_once()
    (fake_bin / "apps.csv").write_text("4242, 00000000:18:00.0, 12000\n")
    s.sample_once()
    rec = s.stop()
    assert rec["source"] == "nvidia-smi" and rec["samples"] == 2
    assert rec["peak_bytes"] == {"0": 30500 * MiB, "1": 0}
    assert rec["capacity_bytes"] == {"0": 81559 * MiB, "1": 81559 * MiB}


def test_compute_apps_unknown_without_the_tool(fake_bin):
    assert compute_apps_vram([1]) is None


def test_rocm_smi_json_and_device_filter(fake_bin):
    tool(fake_bin, "rocm-smi", f"#!/bin/sh\ncat <<'EOF'\n{json.dumps(ROCM_SMI_JSON)}\nEOF\n")
    r = read_vram(drm_root=NODRM)
    assert r.source == "rocm-smi" and r.used == {0: 56908177408, 1: 11071488}
    s = VramSampler([0], drm_root=NODRM)
    s.sample_once()
    assert s.stop()["peak_bytes"] == {"0": 56908177408}


def test_amd_smi_json(fake_bin):
    tool(fake_bin, "amd-smi", f"#!/bin/sh\ncat <<'EOF'\n{json.dumps(AMD_SMI_JSON)}\nEOF\n")
    r = read_vram(drm_root=NODRM)
    assert r.source == "amd-smi" and r.used == {0: 181200 * MiB} and r.total == {0: 196592 * MiB}


def test_amd_sysfs_needs_no_tool(tmp_path, fake_bin):
    d = tmp_path / "drm" / "card0" / "device"
    d.mkdir(parents=True)
    (d / "mem_info_vram_used").write_text(f"{5 * GiB}\n")
    (d / "mem_info_vram_total").write_text(f"{192 * GiB}\n")
    r = read_vram(drm_root=tmp_path / "drm")
    assert (r.source, r.used, r.total) == ("sysfs", {0: 5 * GiB}, {0: 192 * GiB})


def test_a_hung_tool_never_holds_up_the_caller(fake_bin):
    tool(fake_bin, "nvidia-smi", "#!/bin/sh\nsleep 30\n")
    s = VramSampler([0], interval=10, timeout=0.5, drm_root=NODRM)
    t0 = time.monotonic()
    s.start()
    assert time.monotonic() - t0 < 0.05, "sampling runs in its own thread"
    rec = s.stop()
    assert time.monotonic() - t0 < 5 and rec["source"] is None and rec["peak_bytes"] == {}


def test_wait_until_released(fake_bin):
    tool(fake_bin, "nvidia-smi", NVIDIA_SMI)
    (fake_bin / "used.csv").write_text("0, 40000, 81559\n1, 1, 81559\n")
    (fake_bin / "release_after").write_text("2\n")  # the driver lets go on the third look
    r = wait_vram_released([0], timeout=10, poll=0.1, drm_root=NODRM)
    # It looked until the driver let go, and slept between looks (at least once: the first look is before
    # any sleep). Not two sleeps' worth of time: under load one look may read twice (seen in CI: 0.12 s).
    readings = (fake_bin / "calls.log").read_text().count("memory.used")
    assert r.released is True and readings >= 3 and 0.1 <= r.waited_s < 5 and r.used == {0: 3 * MiB}, (r, readings)
    assert "released on GPU(s) [0]" in r.message


def test_wait_is_bounded_and_says_so(fake_bin):
    tool(fake_bin, "nvidia-smi", NVIDIA_SMI)
    (fake_bin / "used.csv").write_text("0, 1, 81559\n1, 40960, 81559\n")
    t0 = time.monotonic()
    r = wait_vram_released([0, 1], timeout=0.6, poll=0.1, drm_root=NODRM)
    assert r.released is False and time.monotonic() - t0 < 3
    assert "still in use" in r.message and "GPU 1: 40.0 GiB" in r.message and "GPU 0" not in r.message
    assert wait_vram_released([0], timeout=0.6, poll=0.1, drm_root=NODRM).released is True, \
        "GPU 1's user does not hold up a job on GPU 0"


def test_no_tool_is_unknown_not_a_wait(fake_bin, monkeypatch):
    monkeypatch.setenv("PATH", str(fake_bin))
    r = wait_vram_released([0], timeout=30, drm_root=NODRM)
    assert r.released is None and r.waited_s < 2 and "unknown" in r.message
