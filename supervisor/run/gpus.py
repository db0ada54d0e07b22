"""GPU memory: capacity for the policy's fit predictions, and VRAM telemetry per attempt (peak
use; whether the previous attempt's memory is released). Never trusted to answer.

Monitoring tools can hang on a stuck driver (nvidia-smi, amd-smi): every probe
runs with a timeout, and no answer means "unknown" (the policy then uses the
capacity printed in the OOM message itself). AMD's sysfs files need no tool.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

PROBE_TIMEOUT_S = 10.0


def _nvidia(timeout: float) -> dict[int, int]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=timeout, check=True).stdout
    caps = {}
    for line in out.splitlines():
        idx, mib = (x.strip() for x in line.split(","))
        caps[int(idx)] = int(float(mib)) * (1 << 20)
    return caps


def _amd_sysfs(root: Path) -> dict[int, int]:
    caps, idx = {}, 0
    for card in sorted(root.glob("card[0-9]*"), key=lambda p: int(p.name[4:]) if p.name[4:].isdigit() else 1 << 30):
        f = card / "device" / "mem_info_vram_total"
        if f.exists():
            caps[idx] = int(f.read_text().strip())
            idx += 1
    return caps


def _rocm_smi(timeout: float) -> dict[int, int]:
    out = subprocess.run(["rocm-smi", "--showmeminfo", "vram", "--json"], capture_output=True, text=True,
                         timeout=timeout, check=True).stdout
    caps = {}
    for key, val in json.loads(out).items():
        if key.startswith("card") and isinstance(val, dict):
            total = next((v for k, v in val.items() if "Total Memory" in k), None)
            if total is not None:
                caps[int(key[4:])] = int(total)
    return caps


def probe_capacities(*, timeout: float = PROBE_TIMEOUT_S, drm_root: Path = Path("/sys/class/drm")) -> dict[int, int]:
    """{device index: bytes} from the first source that answers; {} when none does."""
    try:
        caps = _amd_sysfs(drm_root)
        if caps:
            return caps
    except (OSError, ValueError):
        pass
    for probe in (_nvidia, _rocm_smi):
        try:
            caps = probe(timeout)
            if caps:
                return caps
        except (OSError, subprocess.SubprocessError, ValueError, KeyError):
            continue
    return {}


def capacity_for(caps: dict[int, int], gpus: list[int] | None) -> int | None:
    """The smallest capacity among the job's GPUs (all of them when unspecified)."""
    chosen = [caps[g] for g in (gpus if gpus is not None else caps) if g in caps]
    return min(chosen) if chosen else None


# --- VRAM telemetry: what an attempt used, and whether the previous one has let go ----------------
#
# Device-level "used" on the attempt's GPUs is the attempt's use: the scheduler gives concurrent
# attempts disjoint GPU sets. NVIDIA's per-process view (--query-compute-apps) narrows it to the
# attempt's own processes when their pids are known. Sources are tried in order and the first
# that answers is kept; in-process libraries (amdsmi, pynvml: only if installed) run in a worker
# thread with the same timeout as the tools, since a stuck driver hangs them too.

SAMPLE_INTERVAL_S = 10.0
RELEASED_BYTES = 1 << 30  # "released": at most this much still used on the device


@dataclass(frozen=True)
class VramReading:
    source: str
    used: dict[int, int]                      # device index -> bytes in use
    total: dict[int, int] = field(default_factory=dict)


def _sysfs_used(drm_root: Path, _timeout: float) -> VramReading | None:
    used, total, idx = {}, {}, 0
    for card in sorted(drm_root.glob("card[0-9]*"), key=lambda p: int(p.name[4:]) if p.name[4:].isdigit() else 1 << 30):
        u, t = card / "device" / "mem_info_vram_used", card / "device" / "mem_info_vram_total"
        if u.exists():
            used[idx] = int(u.read_text().strip())
            if t.exists():
                total[idx] = int(t.read_text().strip())
            idx += 1
    return VramReading("sysfs", used, total) if used else None


def _in_thread(fn: Callable[[], VramReading | None], timeout: float) -> VramReading | None:
    box: list = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True, name="vram-probe")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"{getattr(fn, '__name__', 'probe')} did not answer in {timeout:.0f}s")
    return box[0] if box else None


def _amdsmi(_root: Path, timeout: float) -> VramReading | None:
    import amdsmi  # optional, ROCm's own Python bindings

    def read() -> VramReading:
        amdsmi.amdsmi_init()
        try:
            used, total = {}, {}
            for i, h in enumerate(amdsmi.amdsmi_get_processor_handles()):
                v = amdsmi.amdsmi_get_gpu_vram_usage(h)  # MB
                used[i], total[i] = int(v["vram_used"]) << 20, int(v["vram_total"]) << 20
            return VramReading("amdsmi", used, total)
        finally:
            amdsmi.amdsmi_shut_down()
    return _in_thread(read, timeout)


def _pynvml(_root: Path, timeout: float) -> VramReading | None:
    import pynvml  # optional: only when installed; oom-supervisor does not depend on it

    def read() -> VramReading:
        pynvml.nvmlInit()
        try:
            used, total = {}, {}
            for i in range(pynvml.nvmlDeviceGetCount()):
                m = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i))
                used[i], total[i] = int(m.used), int(m.total)
            return VramReading("nvml", used, total)
        finally:
            pynvml.nvmlShutdown()
    return _in_thread(read, timeout)


def _run(argv: list[str], timeout: float) -> str:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True).stdout


def _amd_smi_tool(_root: Path, timeout: float) -> VramReading | None:
    data = json.loads(_run(["amd-smi", "metric", "--mem-usage", "--json"], timeout))
    if isinstance(data, dict):  # some releases wrap the list
        data = data.get("gpu_data") or list(data.values())
    used, total = {}, {}
    unit = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
    for entry in data:
        mem = entry.get("mem_usage") or {}
        u, t = mem.get("used_vram"), mem.get("total_vram")
        if isinstance(u, dict):
            i = int(entry["gpu"])
            used[i] = int(float(u["value"]) * unit.get(str(u.get("unit", "MB")).upper(), 1 << 20))
            if isinstance(t, dict):
                total[i] = int(float(t["value"]) * unit.get(str(t.get("unit", "MB")).upper(), 1 << 20))
    return VramReading("amd-smi", used, total) if used else None


def _rocm_smi_used(_root: Path, timeout: float) -> VramReading | None:
    used, total = {}, {}
    for key, val in json.loads(_run(["rocm-smi", "--showmeminfo", "vram", "--json"], timeout)).items():
        if key.startswith("card") and isinstance(val, dict):
            u = next((v for k, v in val.items() if "Used Memory" in k), None)
            t = next((v for k, v in val.items() if "Total Memory" in k), None)
            if u is not None:
                used[int(key[4:])] = int(u)
                if t is not None:
                    total[int(key[4:])] = int(t)
    return VramReading("rocm-smi", used, total) if used else None


def _nvidia_smi_used(_root: Path, timeout: float) -> VramReading | None:
    used, total = {}, {}
    out = _run(["nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"],
               timeout)
    for line in out.splitlines():
        if line.strip():
            idx, u, t = (x.strip() for x in line.split(","))
            used[int(idx)], total[int(idx)] = int(float(u)) << 20, int(float(t)) << 20
    return VramReading("nvidia-smi", used, total) if used else None


VRAM_SOURCES: dict[str, Callable[[Path, float], VramReading | None]] = {
    "sysfs": _sysfs_used, "amdsmi": _amdsmi, "pynvml": _pynvml, "amd-smi": _amd_smi_tool,
    "rocm-smi": _rocm_smi_used, "nvidia-smi": _nvidia_smi_used}


def read_vram(*, timeout: float = PROBE_TIMEOUT_S, drm_root: Path = Path("/sys/class/drm"),
              sources: Iterable[str] | None = None) -> VramReading | None:
    """The first source that answers, or None (no GPU, no tool, or every tool failed or hung)."""
    for name in sources or VRAM_SOURCES:
        try:
            reading = VRAM_SOURCES[name](drm_root, timeout)
        except Exception:  # noqa: BLE001, S112 - vendor bindings raise their own types; any failure = no answer
            continue
        if reading is not None:
            return reading
    return None


def compute_apps_vram(pids: Iterable[int], *, timeout: float = PROBE_TIMEOUT_S) -> dict[int, int] | None:
    """NVIDIA only: {device index: bytes} held by these processes (`--query-compute-apps`)."""
    wanted = set(pids)
    try:
        buses = {}
        for line in _run(["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                         timeout).splitlines():
            if line.strip():
                idx, bus = (x.strip() for x in line.split(","))
                buses[bus.lower()] = int(idx)
        out = _run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id,used_memory",
                    "--format=csv,noheader,nounits"], timeout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    held: dict[int, int] = {}
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit() or int(parts[0]) not in wanted:
            continue
        dev = buses.get(parts[1].lower())
        if dev is not None and parts[2].replace(".", "", 1).isdigit():
            held[dev] = held.get(dev, 0) + (int(float(parts[2])) << 20)
    return held


class VramSampler:
    """Peak VRAM of one attempt, sampled in a background thread at a low rate, so a stuck driver
    (tools can hang for minutes) never holds up the loop. `stop()` returns what to record."""

    def __init__(self, devices: list[int] | None, *, interval: float = SAMPLE_INTERVAL_S,
                 timeout: float = PROBE_TIMEOUT_S, drm_root: Path = Path("/sys/class/drm"),
                 pids: Callable[[], Iterable[int]] | None = None) -> None:
        self.devices, self.interval, self.timeout, self.drm_root = devices, interval, timeout, drm_root
        self.pids = pids  # the attempt's live pids, for NVIDIA's per-process view
        self.peak: dict[int, int] = {}
        self.total: dict[int, int] = {}
        self.source: str | None = None
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample_once(self) -> None:
        reading = read_vram(timeout=self.timeout, drm_root=self.drm_root,
                            sources=[self.source] if self.source else None)
        if reading is None:
            return
        self.source = reading.source
        self.total.update(reading.total)
        used = reading.used
        if self.pids is not None and reading.source in ("nvidia-smi", "nvml"):
            own = compute_apps_vram(self.pids(), timeout=self.timeout)
            if own is not None:
                used = {d: own.get(d, 0) for d in used}
        for dev, b in used.items():
            if self.devices is None or dev in self.devices:
                self.peak[dev] = max(self.peak.get(dev, 0), b)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval)

    def start(self) -> VramSampler:
        self._thread = threading.Thread(target=self._run, daemon=True, name="vram-sampler")
        self._thread.start()
        return self

    def stop(self) -> dict:
        """The `gpu_telemetry` event data: peak and capacity per device, the source."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(0.2)  # a sample stuck in a hung tool is not waited for: the loop goes on
        devs = sorted(self.peak)
        return {"peak_bytes": {str(d): self.peak[d] for d in devs},
                "capacity_bytes": {str(d): self.total[d] for d in devs if d in self.total},
                "source": self.source, "samples": self.samples, "interval_s": self.interval}


@dataclass(frozen=True)
class Release:
    released: bool | None     # None: could not be read (no tool answered)
    waited_s: float
    used: dict[int, int]
    message: str


def wait_vram_released(devices: list[int] | None, timeout: float, *, threshold: int = RELEASED_BYTES,
                       poll: float = 1.0, probe_timeout: float = 5.0,
                       drm_root: Path = Path("/sys/class/drm")) -> Release:
    """Wait (at most `timeout`) until the previous attempt's VRAM is given back on `devices`:
    drivers free a dead process's memory late, and a new attempt started too early OOMs at once.
    Never waits past the deadline: a device still in use is said, and the caller goes on."""
    start = time.monotonic()
    while True:
        reading = read_vram(timeout=probe_timeout, drm_root=drm_root)
        waited = time.monotonic() - start
        if reading is None:
            return Release(None, waited, {}, "VRAM use unknown (no GPU tool answered); not waiting")
        used = {d: b for d, b in reading.used.items() if devices is None or d in devices}
        busy = {d: b for d, b in used.items() if b > threshold}
        if not busy:
            return Release(True, waited, used, f"VRAM released on GPU(s) {sorted(used)} after {waited:.1f}s "
                                               f"({reading.source})")
        if waited >= timeout:
            what = ", ".join(f"GPU {d}: {b / (1 << 30):.1f} GiB" for d, b in sorted(busy.items()))
            return Release(False, waited, used, f"VRAM still in use after {waited:.0f}s ({what}; {reading.source}); "
                                                "starting anyway")
        time.sleep(min(poll, max(0.0, timeout - waited)))


# --- which devices an attempt sees -----------------------------------------------------------------



def detect_vendor(dev: Path = Path("/dev")) -> str:
    """"amd" (ROCm's /dev/kfd), "nvidia" (/dev/nvidiactl), else "unknown"."""
    if (dev / "kfd").exists():
        return "amd"
    if (dev / "nvidiactl").exists():
        return "nvidia"
    return "unknown"
