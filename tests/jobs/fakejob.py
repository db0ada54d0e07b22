"""A stand-in training process for daemon tests: real process, real signals, real exit codes.

Options (argv): --steps N --sleep S --exit CODE --ignore-term --children K
--detached-child (a child in its own session, like a torchrun worker) --lock FILE
(fail with 99 if another instance holds it: proves one attempt at a time)
--progress FILE (append each step, so a test can see where it got)
--print TEXT (print a line before exiting) --fail-first-attempts N --state FILE
(exit with --exit only on the first N runs, counted in FILE). --gate FILE --gate-step K
(after step K, wait until FILE exists: the test decides when the job goes on).
"""

import argparse
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=3)
p.add_argument("--sleep", type=float, default=0.1)
p.add_argument("--exit", type=int, default=0)
p.add_argument("--ignore-term", action="store_true")
p.add_argument("--children", type=int, default=0)
p.add_argument("--detached-child", action="store_true")
p.add_argument("--lock")
p.add_argument("--progress")
p.add_argument("--print", dest="text")
p.add_argument("--fail-first", type=int, default=0)
p.add_argument("--state")
p.add_argument("--gate")
p.add_argument("--gate-step", type=int, default=0)
p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
a = p.parse_args()

if a.child:  # a worker: just live until killed (ignoring SIGTERM if asked)
    if a.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1)

if a.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if a.lock:
    fd = os.open(a.lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("TWO ATTEMPTS AT ONCE", flush=True)
        sys.exit(99)

kids = []
for _ in range(a.children):
    args = [sys.executable, __file__, "--child"] + (["--ignore-term"] if a.ignore_term else [])
    kids.append(subprocess.Popen(args, start_new_session=a.detached_child))
    print(f"child pid {kids[-1].pid}", flush=True)

start = 0
if a.progress and os.path.exists(a.progress):
    with open(a.progress) as f:
        done = [int(x) for x in f.read().split()]
        start = max(done) if done else 0
for step in range(start + 1, a.steps + 1):
    time.sleep(a.sleep)
    print(f"step {step}/{a.steps} loss {1.0 / step:.4f}", flush=True)
    print(f"{100 * step // a.steps:3d}%|#| {step}/{a.steps} [00:01<00:01,  1.00it/s]", flush=True)
    if a.progress:
        with open(a.progress, "a") as f:
            f.write(f"{step}\n")
    if a.gate and step == a.gate_step:
        deadline = time.monotonic() + 300
        while not os.path.exists(a.gate) and time.monotonic() < deadline:
            time.sleep(0.05)

code = a.exit
if a.fail_first and a.state:
    n = int(Path(a.state).read_text()) if os.path.exists(a.state) else 0
    with open(a.state, "w") as f:
        f.write(str(n + 1))
    if n >= a.fail_first:
        code = 0
if a.text and code != 0:
    print(a.text, flush=True)
sys.exit(code)
