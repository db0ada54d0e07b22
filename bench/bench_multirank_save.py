"""One rank of an N-rank DDP run OOMs: how long the coordinated emergency save takes, what it keeps.

Real torchrun, gloo on CPU, the plain Trainer job of the hook's tests (tests/hooks/plain_trainer.py:
a tiny Llama, AdamW, `save_steps` 5, accumulation 2). Rank 1 alone hits PyTorch's real CPU-allocator
OOM in its 16th forward, the second micro-batch of step 8, so steps 6 and 7 are newer than the last
regular checkpoint-5. The trainer stamps the wall time right before it raises; the bench polls the
output folder every 5 ms for checkpoint folders appearing (the hook renames a finished save into
place, so appearing = complete) and notes when torchrun exits (every rank gone). For each world
size, the run with the start-up hook (OOM_SUPERVISOR_EMERGENCY_CKPT=1) and without it (=0) print:

  OOM->saved    the OOM's raise to checkpoint-N renamed into place (hook on only)
  save_s        the hook's own figure from oom-supervisor-emergency.json (RNG answers included)
  OOM->stop     the OOM's raise to torchrun's agent stopping the other ranks (its "closing signal"
                line: the failing rank has exited, its save done)
  OOM->gone     the OOM's raise to torchrun's exit
  finished      the last step every rank finished (rank 0's last LOSS line)
  resume        the newest complete checkpoint left (supervisor.run.checkpoints' scan)
  lost          finished - resume: the steps the night trains again after this OOM

    PYTHONPATH=$PWD .venv/bin/python bench/bench_multirank_save.py [--ranks 2 4] [--trials 1]

Times are the median of --trials (min-max beside it); the box's load moves them (printed before
and after), the steps lost do not.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.judge.policy.render import HOOK_DIR  # noqa: E402
from supervisor.run.checkpoints import scan_output_dir  # noqa: E402

TRAINER = REPO / "tests" / "hooks" / "plain_trainer.py"
NOTE = "oom-supervisor-emergency.json"
OOM_FORWARD, OOM_RANK, SAVE_STEPS, MAX_STEPS = 16, 1, 5, 12
_LOSS = re.compile(r"^LOSS (\d+) ", re.MULTILINE)
_CKPT = re.compile(r"^checkpoint-(\d+)$")
# torchrun's agent (glog format, local time): "W1207 05:52:16.198000 32680 .../api.py:1028] Sending process
# 300 closing signal SIGTERM" once a worker failed
_STOP = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(\.\d+) +\d+ .*closing signal", re.MULTILINE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def watch(out: Path, seen: dict[int, float], stop: threading.Event) -> None:
    """When each checkpoint-N first appears in `out` (wall time, 5 ms polls)."""
    while not stop.is_set():
        try:
            names = os.listdir(out)
        except FileNotFoundError:
            names = []
        now = time.time()
        for name in names:
            if (m := _CKPT.match(name)) and int(m[1]) not in seen:
                seen[int(m[1])] = now
        stop.wait(0.005)


def agent_stop(log: str, near: float) -> float | None:
    """When torchrun's agent began stopping the other workers (wall time), or None."""
    m = _STOP.search(log)
    if m is None:
        return None
    year = time.localtime(near).tm_year
    mon, day, hh, mm, ss = (int(x) for x in m.groups()[:5])
    return time.mktime((year, mon, day, hh, mm, ss, 0, 0, -1)) + float(m[6])


def trial(root: Path, world: int, hook: bool) -> dict:
    out, stamp = root / "out", root / "oom-stamp"
    launcher = Path(sys.executable).parent / "torchrun"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOM_SUPERVISOR_") and k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(HOOK_DIR), OOM_SUPERVISOR_EMERGENCY_CKPT="1" if hook else "0",
               PATH=f"{launcher.parent}{os.pathsep}{env.get('PATH', '')}")
    cmd = [str(launcher), "--nproc_per_node", str(world), "--master_port", str(free_port()), str(TRAINER),
           "--out", str(out), "--max-steps", str(MAX_STEPS), "--save-steps", str(SAVE_STEPS),
           "--oom-forward", str(OOM_FORWARD), "--oom-rank", str(OOM_RANK), "--stamp-oom", str(stamp)]
    seen: dict[int, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(out, seen, stop), daemon=True)
    watcher.start()
    log_path = root / "run.log"
    with open(log_path, "wb") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=root, timeout=900,
                            check=False).returncode
    gone = time.time()
    stop.set()
    watcher.join()
    log = log_path.read_text(errors="replace")
    if not stamp.exists():
        raise SystemExit(f"no OOM was raised (rc {rc}); see {log_path}")
    rank, oom_at = stamp.read_text().split()[:2]
    oom_at = float(oom_at)
    steps = [int(m) for m in _LOSS.findall(log)]
    complete = [c.step for c in scan_output_dir(out, expected_world_size=world).complete]
    newer = [s for s, t in seen.items() if t >= oom_at]
    saved = max(newer) if newer and max(newer) in complete else None
    note = json.loads((out / f"checkpoint-{saved}" / NOTE).read_text()) if saved is not None else {}
    finished, resume = max(steps, default=0), max(complete, default=0)
    return {"world": world, "hook": hook, "rc": rc, "oom_rank": int(rank), "saved_step": saved,
            "oom_to_saved_s": seen[saved] - oom_at if saved is not None else None,
            "save_s": note.get("save_s"), "oom_to_gone_s": gone - oom_at,
            "oom_to_stop_s": None if (stop_at := agent_stop(log, oom_at)) is None else stop_at - oom_at,
            "finished": finished, "resume": resume, "lost": finished - resume, "log": str(log_path)}


def sec(rows: list[dict], key: str) -> str:
    """'1.51 s' for one trial, '1.51 s (1.16-1.57)' for several, '-' when none has the figure."""
    vals = [r[key] for r in rows if r[key] is not None]
    if not vals:
        return "-"
    mid = f"{statistics.median(vals):.2f} s"
    return mid if len(vals) == 1 else f"{mid} ({min(vals):.2f}-{max(vals):.2f})"


def table(results: list[list[dict]]) -> str:
    head = ("ranks", "emergency save", "OOM->saved", "save_s", "OOM->stop", "OOM->gone", "finished", "resume",
            "lost")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for rows in results:
        r = rows[0]
        lines.append(" | ".join((
            str(r["world"]), "on" if r["hook"] else "off (hook disabled)", sec(rows, "oom_to_saved_s"),
            sec(rows, "save_s"), sec(rows, "oom_to_stop_s"), sec(rows, "oom_to_gone_s"), str(r["finished"]),
            f"checkpoint-{r['resume']}" if r["resume"] else "none", str(max(x["lost"] for x in rows)))))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="world sizes (each >= 2)")
    ap.add_argument("--trials", type=int, default=1, help="runs per world size and hook setting")
    ap.add_argument("--keep", action="store_true", help="keep the runs' folders (logs, checkpoints)")
    args = ap.parse_args(argv)
    if any(w < 2 for w in args.ranks) or args.trials < 1:
        ap.error("--ranks take world sizes of 2 or more (rank 1 OOMs); --trials at least 1")
    print(f"code: {REPO}")
    print(f"rank {OOM_RANK} OOMs in forward {OOM_FORWARD} (step 8); save_steps {SAVE_STEPS}; gloo on CPU, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    base = Path(tempfile.mkdtemp(prefix="oomsup-multirank-"))
    results = []
    for world in args.ranks:
        for hook in (True, False):
            rows = []
            for i in range(args.trials):
                root = base / f"w{world}-{'on' if hook else 'off'}-{i}"
                root.mkdir()
                r = trial(root, world, hook)
                rows.append(r)
                print(f"  {world} ranks, hook {'on ' if hook else 'off'} #{i + 1}: rc {r['rc']}, "
                      f"saved {r['saved_step']}, lost {r['lost']}, OOM->gone {r['oom_to_gone_s']:.2f} s",
                      flush=True)
            results.append(rows)
    print(f"\nload average now {os.getloadavg()[0]:.1f}")
    print(table(results))
    if args.keep:
        print(f"\nruns kept in {base}")
    else:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
