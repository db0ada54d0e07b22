"""A plain transformers Trainer job (no LLaMA-Factory) for the start-up hook's tests.

A tiny random Llama with attention dropout (so the RNG state matters for exact resume) on
fixed random token ids. The OOMs are PyTorch's real CPU-allocator failure: an allocation of
1 PiB that `DefaultCPUAllocator` refuses, raised from the chosen place:
  --oom-forward C        in the C-th training forward call (1-based; micro-batches count)
  --oom-optimizer K      inside the K-th optimizer.step(), AFTER the parameters were updated
  --oom-save K           in the K-th checkpoint save, after weights and optimizer were written
`--oom-type cuda` raises torch.OutOfMemoryError with a CUDA allocator's text instead (what a GPU
rank raises; the hook's handling is the same).
Run under torchrun for the multi-rank case (`--oom-rank R` limits the OOM to rank R) and for
`--deepspeed CONFIG` (the Trainer then builds torch's AdamW, which DeepSpeed steps inside
`engine.step()`: --oom-optimizer then fails in the K-th `torch.optim.AdamW.step`, after it).
`--freeze-rank0` stops rank 0 (SIGSTOP) right before the OOM; `--slow-save S` makes every save after
the OOM S seconds slower. `--stamp-oom FILE` appends
`<rank> <time.time()>` to FILE right before the OOM is raised (bench/bench_multirank_save.py).
Prints `LOSS <step> <loss>` per logged step and exits 0 when training ends.
"""

import argparse
import os
import signal
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--max-steps", type=int, default=12)
p.add_argument("--save-steps", type=int, default=5)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--accum", type=int, default=2)
p.add_argument("--oom-forward", type=int, default=0)
p.add_argument("--oom-optimizer", type=int, default=0)
p.add_argument("--oom-rank", type=int, default=-1)
p.add_argument("--oom-type", choices=("cpu", "cuda"), default="cpu", help="cuda: raise torch.OutOfMemoryError "
               "with the text a CUDA allocator failure has (torch >= 2.2) instead of the CPU allocator's real one")
p.add_argument("--oom-save", type=int, default=0, help="OOM in the K-th RNG save (the last file before "
               "trainer_state.json): a regular checkpoint cut off mid-save")
p.add_argument("--freeze-rank0", action="store_true", help="under torchrun: the OOMing rank first stops "
               "rank 0 (SIGSTOP; its pid in <out>.rank0.pid): a rank that can never answer")
p.add_argument("--rank-seed", action="store_true", help="each rank reseeds torch at train begin (1000 + rank): "
               "the ranks' dropout draws differ, so every rank's own RNG file matters for an exact resume")
p.add_argument("--slow-save", type=float, default=0, help="once the OOM was raised, every RNG save first sleeps "
               "this many seconds: an emergency save slower than its budget")
p.add_argument("--stamp-oom", default=None, help="append '<rank> <wall time>' to this file right before the OOM")
p.add_argument("--resume", default=None)
p.add_argument("--deepspeed", default=None, help="a DeepSpeed JSON (run under torchrun)")
a = p.parse_args()

RANK = int(os.environ.get("RANK", "0"))
ARMED = a.oom_rank < 0 or a.oom_rank == RANK


if a.freeze_rank0 and RANK == 0:
    with open(f"{a.out}.rank0.pid", "w") as fh:
        fh.write(str(os.getpid()))


OOMED = []


def oom():
    OOMED.append(True)
    if a.freeze_rank0:
        with open(f"{a.out}.rank0.pid") as fh:
            os.kill(int(fh.read()), signal.SIGSTOP)
    if a.stamp_oom:
        with open(a.stamp_oom, "a") as fh:
            fh.write(f"{RANK} {time.time():.6f}\n")
    if a.oom_type == "cuda":
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 546.00 MiB. GPU 0 has a total capacity of 15.77 GiB of which "
            "514.19 MiB is free. Of the allocated memory 13.73 GiB is allocated by PyTorch, and 736.86 MiB is "
            "reserved by PyTorch but unallocated.")
    torch.empty(1 << 50, dtype=torch.uint8)  # RuntimeError: DefaultCPUAllocator: can't allocate memory


class Model(LlamaForCausalLM):
    calls = 0

    def forward(self, *args, **kwargs):
        if self.training:
            Model.calls += 1
            if ARMED and Model.calls == a.oom_forward:
                oom()
        return super().forward(*args, **kwargs)


class AdamW(torch.optim.AdamW):
    steps = 0

    def step(self, closure=None):
        out = super().step(closure)
        AdamW.steps += 1
        if ARMED and AdamW.steps == a.oom_optimizer:
            oom()
        return out


class Data(torch.utils.data.Dataset):
    def __init__(self, n=256, length=16):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(4, 128, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


_save_rng = Trainer._save_rng_state
saves = 0


def save_rng(self, output_dir):
    global saves
    saves += 1
    if saves == a.oom_save:
        oom()
    if OOMED and a.slow_save:
        time.sleep(a.slow_save)
    return _save_rng(self, output_dir)


Trainer._save_rng_state = save_rng

# transformers 5.6 loads optimizer.pt of a multi-rank run with map_location=args.device, which is
# `cpu:0` for CPU ranks, and torch 2.14 cannot restore that tag: resuming ANY 2-rank CPU run (a
# regular checkpoint too; measured on checkpoint-5) fails with "don't know how to restore data
# location ... (tagged with cpu:0)". GPU ranks (cuda:N) are unaffected. The harness maps it to cpu.
_load = torch.load


def load(*args, map_location=None, **kwargs):
    if isinstance(map_location, torch.device) and map_location.type == "cpu":
        map_location = "cpu"
    return _load(*args, map_location=map_location, **kwargs)


torch.load = load


class PrintLoss(TrainerCallback):
    def on_train_begin(self, args, state, control, **kw):
        if a.rank_seed:  # a resume loads the checkpoint's RNG later, in the first epoch
            torch.manual_seed(1000 + RANK)

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs and RANK == 0:
            sys.stdout.flush()  # one write for the line: other ranks share the (unbuffered) stream
            os.write(1, f"LOSS {state.global_step} {logs['loss']!r}\n".encode())


torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                  attention_dropout=0.1)
model = Model(cfg)
args = TrainingArguments(output_dir=a.out, max_steps=a.max_steps, save_steps=a.save_steps,
                         per_device_train_batch_size=a.batch, gradient_accumulation_steps=a.accum,
                         learning_rate=1e-3, logging_steps=1, report_to=[], seed=42, use_cpu=True,
                         dataloader_num_workers=0, disable_tqdm=True,
                         remove_unused_columns=False, deepspeed=a.deepspeed)
opt = None if a.deepspeed else AdamW(model.parameters(), lr=1e-3)
if a.deepspeed and a.oom_optimizer:
    _step = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        out = _step(self, *args, **kwargs)
        AdamW.steps += 1
        if ARMED and AdamW.steps == a.oom_optimizer:
            oom()
        return out

    torch.optim.AdamW.step = step
trainer = Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None),
                  callbacks=[PrintLoss()])
trainer.train(resume_from_checkpoint=a.resume)
print("TRAINING DONE", flush=True)
if torch.distributed.is_initialized():
    # torch 2.14's gloo teardown sometimes aborts a rank after training finished ("terminate called
    # without an active exception", rank 0 SIGABRT: 2 of ~8 two-rank runs, with and without the hook
    # and with destroy_process_group): this exit status must say whether training finished.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
