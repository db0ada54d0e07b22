"""Benchmark: N hostile files through a REAL daemon process (issue 9, spool fuzzing).

    python bench/bench_spool_fuzz.py                  # 10,000 files
    python bench/bench_spool_fuzz.py --n 2000 --keep  # smaller, keep the folders

Starts `python -m supervisor.cli daemon` on a fresh state and spool (config: short
poll, no settle time, no cgroups), drops files in batches while it runs - garbage
bytes, alias bombs, 3000-deep nesting, huge numbers, unknown keys, wrong types,
non-UTF-8 and 250-byte names, symlinks, FIFOs, folders, future mtimes, plus one good
command job (`true`) in every `--good-every` - and polls `oom-supervisor status --json`
in a loop meanwhile. Prints: files dropped (neither accepted nor rejected), bad files
rejected with a reason, bad files wrongly accepted, good files accepted (once), daemon
crashes and failed intake steps, peak daemon RSS (psutil, sampled every 20 ms) and the
worst `status` latency (a whole CLI process, interpreter start included).
Targets: 0 crashes, every bad one rejected with a reason, peak RSS <= 150 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]\n" for i in range(8))
INDEX = re.compile(r"^f(\d{5})-")


def bad_content(rng: random.Random) -> bytes:
    pick = rng.randrange(12)
    if pick == 0:
        return os.urandom(rng.randrange(1, 2000)) + b"\xff"
    if pick == 1:
        return BOMB.encode()
    if pick == 2:
        n = rng.randrange(65, 3000)
        return ("x: " + "[" * n + "]" * n + "\n").encode()
    if pick == 3:
        n = rng.randrange(65, 1500)
        return ("x: " + "{a: " * n + "1" + "}" * n + "\n").encode()
    if pick == 4:
        key = rng.choice(["priority", "max_attempts", "nproc_per_node", "hang_timeout", "host_memory_limit"])
        return f"supervisor:\n  command: [echo]\n  {key}: {rng.choice(['9' * 23, '-' + '9' * 30, '9' * 5000])}\n".encode()
    if pick == 5:
        return f"supervisor:\n  command: [echo]\n  prioritty_{rng.randrange(1000)}: 1\n".encode()
    if pick == 6:
        return rng.choice(["supervisor: {command: echo}\n", "supervisor: {command: [1, 2]}\n", "supervisor: [a]\n",
                           "supervisor: {command: [echo], gpus: []}\n", "supervisor: {command: [echo], gpus: [0, 0]}\n",
                           "supervisor: {command: [echo], policy: /etc/shadow}\n", "- a\n- b\n", "",
                           "supervisor: {command: [echo], env: {A: [1]}}\n", "a: &a {b: *a}\n"]).encode()
    if pick == 7:  # many aliases below the node budget but over the alias limit
        return ("supervisor: {command: [echo]}\n" + "".join(f"k{i}: &k{i} v\n" for i in range(120))
                + "r: [" + ",".join(f"*k{i}" for i in range(120)) + "]\n").encode()
    if pick == 8:
        return b"supervisor: {command: [echo]}\n\x00\n"
    if pick == 9:  # a wide flat file near the size limit
        return ("supervisor: {command: [echo]}\n" + "".join(f"k{i}: {i}\n" for i in range(6000))).encode()
    if pick == 10:
        return ("model_name_or_path: m\nstage: sft\nper_device_train_batch_size: " + "9" * 40 + "\n").encode()
    return b"\xef\xbb\xbf" + os.urandom(64)


def odd_name(rng: random.Random, i: int) -> bytes:
    head = b"f%05d-" % i
    pick = rng.randrange(6)
    if pick == 0:
        return head + b"bad\xff\xfe.yaml"
    if pick == 1:
        return head + b"L" * (250 - len(head) - 5) + b".yaml"
    if pick == 2:
        return head + b"[red]x[rank1].yaml"
    if pick == 3:
        return head + b"new\nline.yaml"
    return head + b"job.yaml"


def good_job(work: Path, i: int) -> bytes:
    return yaml.safe_dump({"supervisor": {"command": ["true"], "name": f"good-{i:05d}",
                                          "workdir": str(work)}}).encode()


def drop(incoming: bytes, name: bytes, kind: str, data: bytes, future: bool, target: bytes) -> None:
    path = os.path.join(incoming, name)
    if kind == "symlink":
        os.symlink(target, path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        os.mkdir(path)
    else:
        tmp = os.path.join(incoming, b"." + name[:200] + b".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        if future:
            t = time.time() + 86400
            os.utime(tmp, (t, t))
        os.rename(tmp, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--good-every", type=int, default=50)
    ap.add_argument("--batch", type=int, default=250, help="files dropped at once")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--seed", type=int, default=9)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="bench-spool-"))
    state, spool, work = root / "state", root / "spool", root / "work"
    work.mkdir()
    (spool / "incoming").mkdir(parents=True)
    conf = root / "config.yaml"
    conf.write_text(yaml.safe_dump({"poll_interval": 0.05, "settle_time": 0, "cgroups": "off", "stop_grace": 3,
                                    "max_parallel": 4, "max_job_file_bytes": 64 * 1024}))
    secret = root / "secret.yaml"
    secret.write_bytes(good_job(work, 99999))
    cli = [sys.executable, "-m", "supervisor.cli"]
    dirs = ["--state-dir", str(state), "--spool-dir", str(spool), "--config", str(conf)]
    logf = open(root / "daemon.log", "wb")  # noqa: SIM115 - the daemon's log for as long as it runs; closed when it stops
    daemon = subprocess.Popen([*cli, "daemon", "--json-logs", *dirs], stdout=logf, stderr=subprocess.STDOUT, cwd=REPO)
    proc = psutil.Process(daemon.pid)
    peak_rss, crashes = 0, 0
    latencies: list[float] = []
    status_errors = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak_rss
        while not done.is_set():
            try:
                peak_rss = max(peak_rss, proc.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.02)

    def poll_status() -> None:
        nonlocal status_errors
        while not done.is_set():
            t0 = time.monotonic()
            res = subprocess.run([*cli, "status", "--json", *dirs], capture_output=True, cwd=REPO, timeout=120, check=False)
            latencies.append(time.monotonic() - t0)
            if res.returncode != 0:
                status_errors += 1
            time.sleep(0.2)

    threads = [threading.Thread(target=sample, daemon=True), threading.Thread(target=poll_status, daemon=True)]
    for t in threads:
        t.start()
    incoming = os.fsencode(spool / "incoming")
    good, bad = set(), set()
    t_start = time.monotonic()
    for i in range(args.n):
        if i % args.good_every == 0:
            drop(incoming, b"f%05d-good.yaml" % i, "file", good_job(work, i), rng.random() < 0.1, b"")
            good.add(i)
        else:
            kind = rng.choices(["file", "symlink", "fifo", "dir"], [90, 4, 3, 3])[0]
            drop(incoming, odd_name(rng, i), kind, bad_content(rng), rng.random() < 0.05, os.fsencode(secret))
            bad.add(i)
        if i % args.batch == args.batch - 1:
            time.sleep(0.05)
            if daemon.poll() is not None:
                break
    t_dropped = time.monotonic()
    deadline = t_start + args.timeout
    while time.monotonic() < deadline and daemon.poll() is None:
        left = len(os.listdir(spool / "incoming")) + sum(len(os.listdir(d)) for d in (spool / "claimed").glob("*"))
        if left == 0:
            break
        time.sleep(0.2)
    t_drained = time.monotonic()
    if daemon.poll() is not None:
        crashes += 1
    done.set()
    for t in threads:
        t.join(timeout=130)
    rc = None
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
        rc = daemon.wait(timeout=60)
    logf.close()

    accepted: dict[int, int] = {}
    res = subprocess.run([*cli, "status", "--json", *dirs], capture_output=True, text=True, cwd=REPO, check=False)
    for j in json.loads(res.stdout or "[]"):
        m = re.match(r"good-(\d{5})$", j["name"])
        idx = int(m.group(1)) if m else None
        if idx is None:
            src = subprocess.run([*cli, "show", str(j["id"]), "--json", *dirs], capture_output=True, text=True,
                                 cwd=REPO, check=False)
            m2 = INDEX.match(json.loads(src.stdout).get("source") or "")
            idx = int(m2.group(1)) if m2 else -1
        accepted[idx] = accepted.get(idx, 0) + 1
    # rejected/ keeps the newest 1000, so the daemon's log (one job_rejected line per file, with
    # its problems) is the record of all; the files still in rejected/ are checked on disk too.
    with_reason, without_reason, pruned = set(), set(), 0
    log_text = (root / "daemon.log").read_text(errors="replace")
    for line in log_text.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "job_rejected":
            m = INDEX.match(ev.get("file") or "")
            (with_reason if ev.get("problems") else without_reason).add(int(m.group(1)) if m else -1)
        elif ev.get("event") == "spool_rejected_pruned":
            pruned += ev.get("removed", 0)
    on_disk = on_disk_ok = 0
    for p in (spool / "rejected").iterdir():
        if p.name.endswith(".error.txt"):
            continue
        on_disk += 1
        err = p.with_name(p.name + ".error.txt")
        text = err.read_text(errors="replace") if err.exists() else ""
        if "was refused" in text and "  - " in text:
            on_disk_ok += 1
        else:
            m = INDEX.match(p.name)
            without_reason.add(int(m.group(1)) if m else -1)
    step_failures = log_text.count("step_failed")
    placed = good | bad
    dropped = placed - set(accepted) - with_reason - without_reason
    print(f"files placed: {len(placed)} ({len(bad)} hostile, {len(good)} good), drop phase "
          f"{t_dropped - t_start:.1f} s, drained after {t_drained - t_start:.1f} s")
    print(f"files dropped (neither accepted nor rejected): {len(dropped)}")
    print(f"hostile files rejected with a reason: {len(with_reason & bad)} / {len(bad)}"
          f" (rejected without a reason: {len(without_reason)})")
    print(f"rejected/ now: {on_disk} files, {on_disk_ok} with a reason beside them; pruned by the daemon: {pruned}")
    print(f"hostile files wrongly accepted: {len(set(accepted) & bad)}")
    print(f"good files accepted: {len(set(accepted) & good)} / {len(good)}, accepted twice: "
          f"{sum(1 for v in accepted.values() if v > 1)}, good wrongly rejected: {len((with_reason | without_reason) & good)}")
    print(f"daemon crashes: {crashes}; failed intake steps in its log: {step_failures}; exit on SIGTERM: {rc}")
    print(f"peak daemon RSS: {peak_rss / 2**20:.1f} MiB (sampled every 20 ms)")
    lat = sorted(latencies)
    if lat:
        print(f"status latency over {len(lat)} calls: median {lat[len(lat) // 2]:.2f} s, worst {lat[-1]:.2f} s "
              f"(a whole CLI process), errors {status_errors}")
    print(f"link target untouched: {secret.read_bytes() == good_job(work, 99999)}")
    if args.keep:
        print(f"kept {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
