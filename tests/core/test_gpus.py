"""GPU capacity probes: real subprocesses standing in for the vendor tools, a hung tool, sysfs."""

import os
import stat
import time

from supervisor.run.gpus import capacity_for, probe_capacities


def tool(bin_dir, name, body):
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_nvidia_smi_csv_is_parsed(tmp_path, monkeypatch):
    tool(tmp_path, "nvidia-smi", "echo '0, 81559'\necho '1, 40960'\n")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    caps = probe_capacities(drm_root=tmp_path / "nodrm")
    assert caps == {0: 81559 << 20, 1: 40960 << 20}
    assert capacity_for(caps, [0]) == 81559 << 20 and capacity_for(caps, None) == 40960 << 20


def test_a_hung_tool_means_unknown_not_a_hung_daemon(tmp_path, monkeypatch):
    tool(tmp_path, "nvidia-smi", "sleep 30\n")
    tool(tmp_path, "rocm-smi", "exit 1\n")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    t = time.monotonic()
    assert probe_capacities(timeout=0.5, drm_root=tmp_path / "nodrm") == {}
    assert time.monotonic() - t < 5


def test_amd_sysfs_needs_no_tool(tmp_path):
    for i, total in ((0, 192 << 30), (1, 192 << 30)):
        d = tmp_path / f"card{i}" / "device"
        d.mkdir(parents=True)
        (d / "mem_info_vram_total").write_text(f"{total}\n")
    (tmp_path / "card0-DP-1").mkdir()  # connectors are not cards
    assert probe_capacities(drm_root=tmp_path) == {0: 192 << 30, 1: 192 << 30}
