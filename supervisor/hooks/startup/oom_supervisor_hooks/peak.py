"""Peak GPU memory seen from inside the process, written at exit (OOM_SUPERVISOR_PEAK_FILE).

Why from inside: only the process's own allocator knows its high-water marks
(`torch.cuda.max_memory_allocated` / `max_memory_reserved`); sampling `nvidia-smi` from outside
misses short peaks. No-op in a process that never initialised CUDA/HIP (launchers, CPU runs):
reading the counters must not create a GPU context.

File format (JSON, one file for every process of the attempt, merged under an flock on
`PATH.lock`, replaced atomically):
  {"version": 1, "processes": {"<pid>": {
      "pid": 123, "rank": 0, "local_rank": 0, "world_size": 1, "when": "exit" | "oom",
      "time": 1764612345.6, "torch": "2.14.1", "backend": "cuda" | "hip",
      "devices": [{"index": 0, "name": "NVIDIA H200", "total_bytes": ...,
                   "max_allocated_bytes": ..., "max_reserved_bytes": ...}]}}}
Only devices this process allocated on are listed. `when` is "oom" if the last write was the
OOM path's (the atexit write that follows replaces it with the same peaks).
"""

import atexit
import fcntl
import json
import os
import sys
import time

from . import PEAK_FILE_ENV, warn

_torch = None


def install(torch):
    global _torch
    if _torch is None:
        _torch = torch
        atexit.register(record, "exit")


def _int_env(name):
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def snapshot(torch, when):
    """This process's peaks, or None when it never used a GPU."""
    cuda = torch.cuda
    if not cuda.is_initialized():
        return None
    devices = []
    for i in range(cuda.device_count()):
        reserved = cuda.max_memory_reserved(i)
        if not reserved:
            continue
        props = cuda.get_device_properties(i)
        devices.append({"index": i, "name": props.name, "total_bytes": int(props.total_memory),
                        "max_allocated_bytes": int(cuda.max_memory_allocated(i)),
                        "max_reserved_bytes": int(reserved)})
    if not devices:
        return None
    return {"pid": os.getpid(), "rank": _int_env("RANK"), "local_rank": _int_env("LOCAL_RANK"),
            "world_size": _int_env("WORLD_SIZE"), "when": when, "time": time.time(),
            "torch": torch.__version__, "backend": "hip" if getattr(torch.version, "hip", None) else "cuda",
            "devices": devices}


def record(when="exit"):
    """Write this process's entry; never raises (it runs at exit and on the OOM path)."""
    path = os.environ.get(PEAK_FILE_ENV)
    torch = _torch or sys.modules.get("torch")
    if not path or torch is None:
        return
    try:
        entry = snapshot(torch, when)
        if entry is not None:
            merge(path, entry)
    except Exception as exc:  # noqa: BLE001 - runs at exit and on the OOM path: never raises
        warn(f"could not record peak GPU memory in {path}: {exc!r}")


def merge(path, entry):
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path) as fh:
                data = json.load(fh)
            if not isinstance(data, dict) or not isinstance(data.get("processes"), dict):
                raise ValueError("not a peak file")
        except (OSError, ValueError):
            data = {"version": 1, "processes": {}}
        data["processes"][str(entry["pid"])] = entry
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
