"""A stand-in for `llamafactory-cli train FILE` in daemon tests (a real process): it reads the
rendered YAML, says which output_dir it trains into (appending to $FAKE_LF_LOG), writes a
file there while it runs, and waits until the file $FAKE_LF_GO exists (the test decides when
the training ends), then exits 0."""

import os
import sys
import time
from pathlib import Path

import yaml

cmd, cfg_path = sys.argv[1], sys.argv[2]
assert cmd == "train", sys.argv
cfg = yaml.safe_load(Path(cfg_path).read_text())
out = Path(cfg["output_dir"])
out.mkdir(parents=True, exist_ok=True)
marker = out / "TRAINING_NOW"
with open(os.environ["FAKE_LF_LOG"], "a") as f:
    f.write(f"start {os.getpid()} {out} {'busy' if marker.exists() else 'free'}\n")
marker.write_text(str(os.getpid()))
go = Path(os.environ["FAKE_LF_GO"])
deadline = time.monotonic() + 120
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
marker.unlink(missing_ok=True)
with open(os.environ["FAKE_LF_LOG"], "a") as f:
    f.write(f"end {os.getpid()} {out}\n")
print("train done", flush=True)
