"""Before a resume, the checkpoint's optimizer state against the host's memory and the GPUs':
refused with the numbers only when it cannot load at all, said when it may not.

The checkpoint folders are real (sparse files of the real size: nothing is written), scanned by
the real scanner; the refusal goes through the real daemon's start step (no attempt launched).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from supervisor.core.states import JobState
from supervisor.intake.jobspec import parse_job_text
from supervisor.intake.spool import accept
from supervisor.judge.load_check import check_load
from supervisor.judge.resume import Checkpoint
from supervisor.run.checkpoints import scan_output_dir
from tests.checkpoints.test_scan import PLAIN, make, zero3
from tests.core.test_control import daemon_factory, run_until  # noqa: F401  (fixture)

GiB = 1 << 30


def sparse(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


def ck(total: int, largest: int | None = None, *, deepspeed: bool = False, world: int = 1) -> Checkpoint:
    return Checkpoint(path=Path("/o/checkpoint-8"), step=8, deepspeed=deepspeed, zero_stage=3 if deepspeed else None,
                      world_size=world, train_batch_size=4, has_weights=True, adapter=False, has_optimizer=True,
                      optimizer_bytes=total, largest_optimizer_file=largest or total)


def test_sizes_come_from_the_files_of_the_checkpoint(tmp_path):
    d = make(tmp_path, 4, PLAIN)
    sparse(d / "optimizer.pt", 3 * GiB)
    ds = make(tmp_path, 8, ["config.json", "model.safetensors", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"],
              tag_files=zero3(range(2)), latest="global_step8")
    for r, size in ((0, GiB), (1, 2 * GiB)):
        sparse(ds / "global_step8" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", size)
    plain, zero = scan_output_dir(tmp_path).complete
    assert (plain.optimizer_bytes, plain.largest_optimizer_file) == (3 * GiB, 3 * GiB)
    assert (zero.optimizer_bytes, zero.largest_optimizer_file) == (3 * GiB, 2 * GiB)


def test_one_rank_loads_the_whole_optimizer_file_into_host_memory():
    no = check_load(ck(3 * GiB), mode="exact", world=1, offload_optimizer=False, host_limit=2 * GiB,
                    host_ram=64 * GiB, host_budget=2 * GiB, gpu_capacity=80 * GiB)
    assert no.refuse and "3.00 GiB on disk" in no.refuse and "host_memory_limit of 2.00 GiB" in no.refuse
    assert no.numbers["host_need_bytes"] == 3 * GiB - (1 << 20)
    fits = check_load(ck(3 * GiB), mode="exact", world=1, offload_optimizer=False, host_limit=None,
                      host_ram=64 * GiB, host_budget=50 * GiB, gpu_capacity=80 * GiB)
    assert fits.refuse is None and fits.note is None


def test_memory_others_hold_is_said_never_refused():
    busy = check_load(ck(3 * GiB), mode="exact", world=1, offload_optimizer=False, host_limit=None,
                      host_ram=8 * GiB, host_budget=1 * GiB, gpu_capacity=None)
    assert busy.refuse is None and "may run out of host memory" in busy.note


def test_ranks_on_gpus_load_onto_their_gpus_and_zero_offload_adds_the_shard_to_what_it_holds():
    ddp = check_load(ck(30 * GiB), mode="exact", world=4, offload_optimizer=False, host_limit=8 * GiB,
                     host_ram=512 * GiB, host_budget=8 * GiB, gpu_capacity=24 * GiB)
    assert ddp.refuse is None and "each GPU must hold 30.00 GiB" in ddp.note and "ZeRO offload" in ddp.note
    off = check_load(ck(40 * GiB, 10 * GiB, deepspeed=True, world=4), mode="exact", world=4, offload_optimizer=True,
                     host_limit=45 * GiB, host_ram=512 * GiB, host_budget=45 * GiB, gpu_capacity=80 * GiB)
    assert off.refuse and "on top of the optimizer state that offload already holds" in off.refuse
    lean = check_load(ck(40 * GiB, 10 * GiB, deepspeed=True), mode="universal", world=2, lean=True,
                      offload_optimizer=True, host_limit=1, host_ram=1, host_budget=1, gpu_capacity=None)
    assert lean.refuse is None and lean.note is None, "a lean universal load reads per parameter"


def test_a_universal_load_holds_the_old_rank_0_file_on_every_rank():
    """The reproduced load-time OOM (test_real_load_oom): said before launch, with the numbers."""
    u = check_load(ck(155 << 20, 155 << 20, deepspeed=True), mode="universal", world=2, offload_optimizer=False,
                   host_limit=None, host_ram=8 * GiB, host_budget=200 << 20, gpu_capacity=None)
    assert u.refuse is None and "each of the 2 ranks hold the old rank 0's whole optimizer file" in u.note
    assert "universal_load" in u.note


def test_an_impossible_resume_is_refused_before_launch_with_the_numbers(daemon_factory, tmp_path):  # noqa: F811 - the imported fixture, taken as pytest does
    """The real daemon: a job whose checkpoint holds a 3 GiB optimizer state, limited to 2 GiB of
    host memory, fails before anything is launched, and says why with both numbers."""
    d = daemon_factory()
    work = tmp_path / "work"
    out = work / "out"
    ckpt = make(out, 8, PLAIN)
    sparse(ckpt / "optimizer.pt", 3 * GiB)
    cfg = {"model_name_or_path": "/models/tiny", "stage": "sft", "do_train": True, "finetuning_type": "full",
           "dataset": "alpaca", "template": "default", "output_dir": str(out), "per_device_train_batch_size": 4,
           "supervisor": {"workdir": str(work), "host_memory_limit": "2GiB",
                          "launcher": [sys.executable, "-c", "raise SystemExit('must not run')"]}}
    text = yaml.safe_dump(cfg)
    job_id = accept(d.state, d.store, parse_job_text(text, source="j.yaml", submit_dir=work, check_lf=False),
                    text=text, source="j.yaml", key=None)
    run_until(d, lambda: d.store.job(job_id).state.terminal, what="the refusal")
    job = d.store.job(job_id)
    assert job.state == JobState.FAILED and d.store.attempts(job_id) == []
    assert "cannot resume: checkpoint-8's optimizer state is 3.00 GiB on disk" in job.reason
    assert "more than the job's host_memory_limit of 2.00 GiB" in job.reason
    assert os.path.getsize(ckpt / "optimizer.pt") == 3 * GiB, "nothing was touched"
