"""FSDP checkpoints as accelerate's save_fsdp_model / save_fsdp_optimizer write them into
checkpoint-N: real torch.distributed.checkpoint folders (2 gloo ranks on the CPU) and real
torch.save files, then the completeness rules and the resume plan on them."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.judge.resume import Incomplete, plan_resume, run_shape
from supervisor.run.checkpoints import scan_output_dir

pytest.importorskip("torch", reason="torch not installed")

# What Trainer._save_checkpoint leaves for FSDP, per rank r of W: rng_state_<r>.pth; rank 0:
# scheduler.pt, trainer_state.json (last); and the FSDP state by state-dict type.
WRITER = r"""
import os, sys, json, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
rank, world, ckpt, kind, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
os.makedirs(ckpt, exist_ok=True)
if kind == "sharded":
    # each rank owns its shard (distinct keys), as FSDP's sharded state dict does
    model = {f"layer.{rank}.weight": torch.randn(8, 8)}
    optim = {f"state.{rank}.exp_avg": torch.zeros(8, 8)}
    dcp.save(model, storage_writer=dcp.FileSystemWriter(os.path.join(ckpt, "pytorch_model_fsdp_0")))
    dcp.save(optim, storage_writer=dcp.FileSystemWriter(os.path.join(ckpt, "optimizer_0")))
elif rank == 0:
    torch.save({"w": torch.randn(8, 8)}, os.path.join(ckpt, "pytorch_model_fsdp.bin"))
    torch.save({"state": {}, "param_groups": []}, os.path.join(ckpt, "optimizer.bin"))
torch.save({"python": 1}, os.path.join(ckpt, f"rng_state_{rank}.pth" if world > 1 else "rng_state.pth"))
dist.barrier()
if rank == 0:
    torch.save({"last_epoch": 3}, os.path.join(ckpt, "scheduler.pt"))
    step = int(os.path.basename(ckpt).split("-")[1])
    json.dump({"global_step": step, "train_batch_size": 4}, open(os.path.join(ckpt, "trainer_state.json"), "w"))
dist.destroy_process_group()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write(out: Path, step: int, kind: str, world: int) -> Path:
    ckpt = out / f"checkpoint-{step}"
    port = str(_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(r), str(world), str(ckpt), kind, port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
    return ckpt


@pytest.fixture(scope="module")
def sharded2(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("fsdp"), 20, "sharded", 2)


def test_sharded_fsdp_checkpoint_is_complete(sharded2, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(sharded2, out / sharded2.name)
    names = sorted(os.listdir(out / sharded2.name / "pytorch_model_fsdp_0"))
    assert ".metadata" in names and "__0_0.distcp" in names and "__1_0.distcp" in names  # the real layout
    scan = scan_output_dir(out, expected_world_size=2)
    assert scan.incomplete == ()
    c = scan.latest
    assert (c.step, c.fsdp, c.world_size, c.has_optimizer, c.deepspeed) == (20, "sharded", 2, True, False)
    nxt = run_shape({"per_device_train_batch_size": 4, "finetuning_type": "full"}, world_size=2, deepspeed_cfg=None)
    plan = plan_resume(c, prev=nxt, nxt=nxt, transformers_version="5.6.0")
    assert plan.mode == "exact" and plan.yaml["resume_from_checkpoint"] == str(c.path)


@pytest.mark.parametrize("damage,reason", [
    ("pytorch_model_fsdp_0/.metadata", "no .metadata"),
    ("optimizer_0/.metadata", "no .metadata"),
    ("pytorch_model_fsdp_0/__1_0.distcp", "disagree"),
    ("rng_state_1.pth", "RNG state missing for ranks [1]"),
])
def test_an_unfinished_sharded_save_is_incomplete(sharded2, tmp_path, damage, reason):
    out = tmp_path / "out"
    shutil.copytree(sharded2, out / sharded2.name)
    (out / sharded2.name / damage).unlink()
    scan = scan_output_dir(out, expected_world_size=2)
    assert scan.latest is None
    (inc,) = scan.incomplete
    assert isinstance(inc, Incomplete) and reason in inc.reason, inc.reason


def test_full_state_dict_fsdp_checkpoint_is_complete(tmp_path):
    write(tmp_path, 8, "full", 2)
    scan = scan_output_dir(tmp_path)
    assert scan.incomplete == ()
    assert (scan.latest.fsdp, scan.latest.world_size, scan.latest.has_optimizer) == ("full", 2, True)


def test_the_same_checkpoint_without_fsdp_state_is_still_incomplete(sharded2, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(sharded2, out / sharded2.name)
    shutil.rmtree(out / sharded2.name / "pytorch_model_fsdp_0")
    shutil.rmtree(out / sharded2.name / "optimizer_0")
    assert scan_output_dir(out).latest is None
    json.loads((out / sharded2.name / "trainer_state.json").read_text())
