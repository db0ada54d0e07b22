"""A resume-time host OOM on the CPU, for real: diagnosed `checkpoint_load` from the real log and
exit status, answered with a load-time remedy that leaves the batch alone, and the resumed run
passes under the same limit.

A 38.9M-parameter Llama (12 layers of 512) under ZeRO-3 saves checkpoint-2 on ONE rank; the job
then gets its 2 ranks. The plan converts the checkpoint to DeepSpeed's universal format, and
DeepSpeed's ZeRO-3 universal loader makes EVERY rank hold the old rank 0's whole optimizer file
(zero/optimizer_state.pt, 444 MiB) while it loads. Under RLIMIT_DATA 3,060 MiB per process (the
supervisor's limit without a cgroup), the load fails in the CPU allocator; the 2-rank steady state
fits. The policy answers `universal_load`: the same universal load with that file slimmed to what
the loader reads (a few KiB): it passes, with the losses of an uninterrupted run.

Where the limit sits (VmData peaks per rank, sampled every 20 ms, no limit): the unslimmed load
3,176 and 3,233 MiB, the slimmed attempt 2,945 and 2,948 MiB; the limit is in the middle, ~115 MiB
from each. With 4 layers (13.5M parameters, a 155 MiB file) the two were 64 MiB apart (2,528 vs
2,592): a limit between them was a coin toss on a loaded box (seen in CI: the unslimmed load fitted).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from supervisor.core.models import (
    AttemptRecord,
    Category,
    ExitRecord,
    HostEvidence,
    JobContext,
    Overrides,
    Phase,
)
from supervisor.intake.jobspec import parse_job_text
from supervisor.judge.diagnosis import LogScanner
from supervisor.judge.plan import AttemptPlan, JobFacts, ResumeFacts, plan_attempt
from supervisor.judge.policy import BUILTIN_POLICY_DIR, decide, load_policy
from supervisor.run.checkpoints import apply_fixups, scan_output_dir
from supervisor.run.limits import rlimits_for
from tests.conftest_ml import (
    CACHE,
    DS_Z3,
    LLAMAFACTORY_CLI,
    TRAIN_ENV,
    aborted_after_training,
    kill_tree,
    needs_deepspeed,
    needs_llamafactory,
    steps_logged,
)

pytestmark = [pytest.mark.slow, pytest.mark.ml]

POLICY = load_policy("default", search_dirs=[BUILTIN_POLICY_DIR])
LIMIT = 3_060 << 20  # RLIMIT_DATA per process: the steady state fits, the unslimmed load does not


def config(out: Path) -> dict:
    from supervisor.demo.assets import build_demo_assets, demo_job_config

    assets = build_demo_assets(CACHE / "assets", hidden=512, layers=12, heads=8, max_positions=512, n_short=64,
                               n_long=0, long_tokens=100)
    cfg = demo_job_config(assets, out, micro_batch=2, grad_accum=1, save_steps=2)
    cfg.update(cutoff_len=256, max_steps=4, learning_rate=1.0e-4, report_to="none", seed=42)
    return cfg


def spec_for(work: Path, out: Path, *, ranks: int):
    (work / "ds_z3.json").write_text(json.dumps(DS_Z3))
    cfg = {**config(out), "deepspeed": str(work / "ds_z3.json"),
           "gradient_accumulation_steps": 2 // ranks,  # 2 x 1 x 2 = 2 x 2 x 1
           "supervisor": {"workdir": str(work), "launcher": [str(LLAMAFACTORY_CLI)], "host_memory_limit": LIMIT,
                          "env": {**TRAIN_ENV, "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": str(ranks)}}}
    return parse_job_text(yaml.safe_dump(cfg), source="oom.yaml", submit_dir=work, check_lf=False)


def plan(work: Path, out: Path, number: int, escalation: Overrides | None = None) -> AttemptPlan:
    spec = spec_for(work, out, ranks=2)
    p = plan_attempt(JobFacts(
        job_id=1, number=number, spec=spec, policy=POLICY, escalation=escalation, world_size=2, asked_world_size=2,
        launcher=(str(LLAMAFACTORY_CLI),), attempt_dir=work / f"attempt-{number}", job_deepspeed=DS_Z3,
        base_env={k: v for k, v in os.environ.items() if not k.startswith("OOM_SUPERVISOR_")},
        resume=ResumeFacts(scan=scan_output_dir(out), prev_overrides=Overrides(), transformers_version="5.6.0")))
    assert isinstance(p, AttemptPlan), p
    return p


def run(argv: list[str], env: dict, cwd: Path, log: Path, *, limit: int | None, timeout: float = 900) -> int:
    def rlimits():
        for name, value in (rlimits_for(limit) if limit else {}).items():  # what the shim does
            resource.setrlimit(getattr(resource, name), (value, value))

    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=rlimits)  # noqa: PLW1509 - setrlimit in the child only, as the shim does; this test starts no threads that it could deadlock
    try:
        return proc.wait(timeout=timeout)
    finally:
        kill_tree(proc)


def launch(p: AttemptPlan, work: Path) -> tuple[int, Path, list[str]]:
    done = apply_fixups(p.resume)
    folder = work / f"attempt-{p.number}"
    folder.mkdir(exist_ok=True)
    for name, content in p.rendered.files.items():
        (folder / name).write_text(content)
    log = folder / "log.txt"
    return run(p.rendered.argv, dict(p.env), p.spec.workdir, log, limit=LIMIT), log, done


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory):
    """The run on one rank: its checkpoint-2 is what the job resumes from; its steps 3-4 the reference."""
    needs_llamafactory()
    needs_deepspeed()
    work = tmp_path_factory.mktemp("oom-src")
    out = work / "out"
    spec = spec_for(work, out, ranks=1)
    cfg = {**spec.config, "deepspeed": str(work / "ds_z3.json")}
    (work / "src.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, **TRAIN_ENV, "FORCE_TORCHRUN": "1", "NPROC_PER_NODE": "1"}
    rc = run([str(LLAMAFACTORY_CLI), "train", str(work / "src.yaml")], env, work, work / "src.log", limit=None)
    assert rc == 0 and max(steps_logged(out), default=0) == 4, (work / "src.log").read_text()[-3000:]
    return out


def test_a_resume_time_host_oom_is_diagnosed_checkpoint_load_and_remedied_without_touching_the_batch(
        one_rank_run, tmp_path):
    work, out = tmp_path, tmp_path / "out"
    out.mkdir()
    shutil.copytree(one_rank_run / "checkpoint-2", out / "checkpoint-2")
    (out / "trainer_log.jsonl").write_text("".join(
        line + "\n" for line in (one_rank_run / "trainer_log.jsonl").read_text().splitlines()
        if json.loads(line).get("current_steps", 0) <= 2))

    # Attempt 1: the job's 2 ranks, from a checkpoint of 1: universal, as DeepSpeed ships it.
    p1 = plan(work, out, 1)
    assert p1.resume.mode == "universal" and [f.kind for f in p1.resume.fixups] == ["ds_to_universal"]
    began = time.monotonic()
    rc, log, _ = launch(p1, work)
    text = log.read_text(errors="replace")
    assert rc != 0, "the unslimmed universal load must fail under the limit: " + text[-2000:]
    scanner = LogScanner(initial_step=2)
    scanner.feed(log.read_bytes())
    diag = scanner.finish(ExitRecord(returncode=rc, duration_s=time.monotonic() - began),
                          HostEvidence(memory_limit_bytes=LIMIT, limit_mechanism="rlimit-data+sampled-sum"))
    assert diag.category == Category.HOST_OOM and diag.phase == Phase.CHECKPOINT_LOAD, diag
    assert any("can't allocate memory" in e.text for e in diag.evidence), diag.evidence

    # The policy: a load-time remedy, the batch untouched.
    job = JobContext(id=1, name="oom", kind="llamafactory", config=dict(p1.spec.config), world_size=2,
                     nproc_per_node=2, deepspeed_config=DS_Z3, host_memory_limit_bytes=LIMIT)
    decision = decide(job, [AttemptRecord(1, Overrides(), diag, ExitRecord(rc), resumed_from_step=2,
                                          checkpoint_step_after=2)], diag, POLICY)
    assert decision.kind == "escalate" and decision.rung == "universal_load", decision.reason
    assert decision.overrides.yaml == {} and [c.target for c in decision.changes] == ["deepspeed"]

    # Attempt 2: the same ranks, batch and limit; the universal checkpoint loaded lean.
    p2 = plan(work, out, 2, escalation=decision.overrides)
    eff1, eff2 = (yaml.safe_load(p.rendered.files["effective.yaml"]) for p in (p1, p2))
    assert [(e["per_device_train_batch_size"], e["gradient_accumulation_steps"]) for e in (eff1, eff2)] == [(2, 1)] * 2
    assert [f.kind for f in p2.resume.fixups] == ["ds_to_universal", "slim_universal_optimizer_state"]
    rc2, log2, done = launch(p2, work)
    text2 = log2.read_text(errors="replace")
    # (a rank's SIGABRT at exit after training completed and saved is the stack's teardown, not the load)
    assert rc2 == 0 or aborted_after_training(text2), text2[-3000:]
    assert [c.step for c in scan_output_dir(out).complete][-1] == 4, text2[-3000:]
    slimmed = next(d for d in done if d.startswith("slim"))
    state = out / "checkpoint-2" / "global_step2_universal" / "zero"
    assert (state / "optimizer_state.pt").stat().st_size < 64 << 10 < 100 << 20 < \
        (state / "optimizer_state.pt.supervisor-orig").stat().st_size, slimmed
    ref, got = steps_logged(one_rank_run), steps_logged(out)
    for s in (3, 4):
        assert got[s]["lr"] == pytest.approx(ref[s]["lr"], rel=1e-9)
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], abs=1e-4), (s, got[s]["loss"], ref[s]["loss"])
