"""The demo: a real overnight run in a minute.

Starts the daemon on embedded defaults (a local state folder and spool under
`.demo/`), submits a real LLaMA-Factory full fine-tune of a tiny local Llama
whose long samples come after the first checkpoint, under a host-memory limit
(RLIMIT_DATA: no root needed). The first attempt runs out of memory mid-run;
the supervisor diagnoses it from the real log, lowers the micro-batch while
keeping the effective batch, resumes from the checkpoint the first attempt
saved, and the run finishes. Ends with the job's timeline, then stops the
daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from supervisor.demo.assets import DEMO_ENV, build_demo_assets, demo_job_config

# Fits the short steps, not the first long batch (measured: see facts.md, end).
DEMO_RLIMIT = "2000000KiB"
DEMO_CGROUP_LIMIT = "1200MiB"


# Checkpoints every 5 steps put the demo's OOM (step 9) four steps after the last one: the start-up
# hook's emergency checkpoint of step 8 is what makes that cost 0 steps (with a cgroup the kernel
# kills the job outright, nothing can be saved, and checkpoints every 4 steps keep the loss small).
DEMO_SAVE_STEPS = 5


def demo_job(root: Path, *, memory_limit: str, launcher: list[str], micro_batch: int = 16,
             save_steps: int = 4) -> dict:
    assets = build_demo_assets(root / "cache")
    job = demo_job_config(assets, root / "work" / "output", micro_batch=micro_batch, save_steps=save_steps)
    job["supervisor"] = {
        "name": "demo-tiny-llama",
        "workdir": str(root / "work"),
        "host_memory_limit": memory_limit,
        "env": dict(DEMO_ENV),
        "launcher": launcher,
        "max_attempts": 4,
        "hang_timeout": "10m",
    }
    return job


def default_launcher() -> list[str]:
    cand = Path(sys.executable).parent / "llamafactory-cli"
    return [str(cand)] if cand.exists() else ["llamafactory-cli"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m supervisor.demo.run", description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(".demo"), help="where state, spool and outputs go")
    ap.add_argument("--keep", action="store_true", help="keep the previous run's state (default: start fresh)")
    ap.add_argument("--cgroup", action="store_true",
                    help="limit memory with a cgroup (needs root) instead of RLIMIT_DATA")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    if not args.keep:
        for sub in ("state", "spool", "work"):
            shutil.rmtree(root / sub, ignore_errors=True)
    (root / "work").mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    print("demo: building the tiny local model, tokenizer and dataset (cached after the first run)...",
          flush=True)
    job = demo_job(root, memory_limit=DEMO_CGROUP_LIMIT if args.cgroup else DEMO_RLIMIT,
                   launcher=default_launcher(), save_steps=4 if args.cgroup else DEMO_SAVE_STEPS)
    job_file = root / "demo-job.yaml"
    job_file.write_text(yaml.safe_dump(job, sort_keys=False))
    config = root / "daemon.yaml"
    config.write_text(yaml.safe_dump({"poll_interval": 0.5, "settle_time": 0, "stop_grace": 20,
                                      "cgroups": "auto" if args.cgroup else "off"}))
    common = ["--state-dir", str(root / "state"), "--spool-dir", str(root / "spool"), "--config", str(config)]
    cli = [sys.executable, "-m", "supervisor.cli"]
    daemon_log = open(root / "daemon.log", "ab")  # noqa: SIM115 - the daemon's log for as long as it runs; closed when it stops
    daemon = subprocess.Popen([*cli, "daemon", "--json-logs", *common], stdout=daemon_log,
                              stderr=subprocess.STDOUT)
    print(f"demo: daemon started (pid {daemon.pid}); its JSON log is {root / 'daemon.log'}", flush=True)
    code = 1
    try:
        res = subprocess.run([*cli, "submit", *common, str(job_file), "--wait", "60"], capture_output=True,
                             text=True, check=False)
        print(res.stdout.strip(), res.stderr.strip(), flush=True)
        if res.returncode != 0:
            return res.returncode
        job_id = res.stdout.strip().split()[-1]
        print(f"demo: following job {job_id} live (Ctrl-C stops only the view)\n", flush=True)
        try:
            subprocess.run([*cli, "watch", *common, job_id, "--interval", "1"], check=False)
        except KeyboardInterrupt:
            pass
        subprocess.run([*cli, "show", *common, job_id], check=False)
        status = json.loads(subprocess.run([*cli, "status", *common, "--json"], capture_output=True,
                                           text=True, check=False).stdout)
        state = next(j["state"] for j in status if str(j["id"]) == job_id)
        code = 0 if state == "succeeded" else 1
        print(f"\ndemo: job {job_id} {state} in {time.monotonic() - t0:.0f}s "
              f"(state: {root / 'state'}; try `oom-supervisor show {job_id} --state-dir {root / 'state'}`)")
        state_dir, spool_dir = (root / "state").resolve(), (root / "spool").resolve()
        print(f"demo: to point every command at the demo's state:\n"
              f"  export OOM_SUPERVISOR_STATE_DIR={state_dir} OOM_SUPERVISOR_SPOOL_DIR={spool_dir}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
        daemon_log.close()
        print(f"demo: daemon stopped (exit {daemon.returncode})")
    return code


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
