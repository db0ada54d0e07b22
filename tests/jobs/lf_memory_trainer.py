"""A stand-in for `llamafactory-cli train FILE` whose host memory is real and grows with its
micro-batch, for daemon tests of learned starts that cost seconds instead of a LLaMA-Factory run.

It reads the rendered YAML the daemon wrote and trains `STANDIN_STEPS` optimizer steps of
`per_device_train_batch_size` x `gradient_accumulation_steps` samples. It holds `STANDIN_BASE_MIB`
(the model and optimizer) for the whole run, and each micro-step fills (touches) its activations:
`STANDIN_MIB_PER_SAMPLE` x micro-batch x min(cutoff_len, STANDIN_SEQ) / 1024 MiB, a quarter of that
for the short samples of the first `STANDIN_SHORT_STEPS` steps (the demo's shape: the long batch
comes after a checkpoint). Under the daemon's RLIMIT_DATA an activation that does not fit raises a
real Python MemoryError. As LLaMA-Factory does, it appends one line per step to
`output_dir/trainer_log.jsonl`, saves `checkpoint-N` (trainer_state.json written last) every
`save_steps`, resumes from `resume_from_checkpoint`, and saves the final model.
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import yaml

cmd, cfg_path = sys.argv[1], sys.argv[2]
assert cmd == "train", sys.argv
cfg = yaml.safe_load(Path(cfg_path).read_text())
env = os.environ
steps = int(env.get("STANDIN_STEPS", "8"))
short_steps = int(env.get("STANDIN_SHORT_STEPS", "4"))
base_mib, per_sample = float(env.get("STANDIN_BASE_MIB", "40")), float(env.get("STANDIN_MIB_PER_SAMPLE", "10"))
seq = min(int(cfg.get("cutoff_len", 1024)), int(env.get("STANDIN_SEQ", "1024")))
hold_s = float(env.get("STANDIN_HOLD_S", "0.15"))
micro, accum = int(cfg["per_device_train_batch_size"]), int(cfg.get("gradient_accumulation_steps", 1))
save_steps = int(cfg.get("save_steps", 4))
out = Path(cfg["output_dir"])
out.mkdir(parents=True, exist_ok=True)

start = 0
if cfg.get("resume_from_checkpoint"):
    start = json.loads((Path(cfg["resume_from_checkpoint"]) / "trainer_state.json").read_text())["global_step"]
    print(f"[INFO|trainer.py] Loading model from {cfg['resume_from_checkpoint']}.", flush=True)
print(f"***** Running training ***** micro-batch {micro} x accumulation {accum}, "
      f"steps {steps}, from step {start}", flush=True)


def fill(mib: float) -> bytes:
    return b"\x01" * int(mib * (1 << 20))  # touched: resident, as activations are


def save(step: int) -> None:
    ck = out / f"checkpoint-{step}"
    ck.mkdir(exist_ok=True)
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (ck / name).write_bytes(b"\0" * 64)
    state = {"global_step": step, "max_steps": steps, "train_batch_size": micro, "save_steps": save_steps}
    (ck / "trainer_state.json").write_text(json.dumps(state))  # last: the save is complete
    print(f"[INFO|trainer.py] Saving model checkpoint to {ck}", flush=True)


def training_step(weight: float) -> None:
    """One micro-step (named as transformers' Trainer names it: a traceback says where it failed)."""
    activations = fill(per_sample * micro * weight * seq / 1024)
    time.sleep(hold_s)
    del activations


def _inner_training_loop() -> None:
    t0 = time.monotonic()
    for step in range(start + 1, steps + 1):
        for _ in range(accum):
            training_step(0.25 if step <= short_steps else 1.0)
        elapsed = time.monotonic() - t0
        line = {"current_steps": step, "total_steps": steps, "loss": round(2.0 / step, 4), "lr": 1e-4,
                "epoch": round(step / steps, 2), "percentage": round(100 * step / steps, 2),
                "elapsed_time": str(timedelta(seconds=int(elapsed))), "remaining_time": "0:00:01"}
        with open(out / "trainer_log.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        print(f"{{'loss': {line['loss']}, 'epoch': {line['epoch']}}}  step {step}/{steps}", flush=True)
        if step % save_steps == 0 and step < steps:
            save(step)


model = fill(base_mib)
_inner_training_loop()
(out / "model.safetensors").write_bytes(b"\0" * 64)
print("***** train metrics *****", flush=True)
