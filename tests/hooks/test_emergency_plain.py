"""The emergency checkpoint in a plain transformers Trainer script, real processes throughout.

The OOMs are PyTorch's own CPU-allocator failure (see plain_trainer.py), raised from the
forward pass, from inside optimizer.step(), or on one rank of a real two-rank torchrun run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from supervisor.core.models import ExitRecord
from supervisor.hooks.markers import parse_emergency
from supervisor.judge.diagnosis import diagnose_file
from supervisor.judge.policy.render import HOOK_DIR
from supervisor.run.checkpoints import scan_output_dir

pytestmark = [pytest.mark.slow, pytest.mark.ml]

SCRIPT = Path(__file__).resolve().parent / "plain_trainer.py"
VENV_BIN = Path(sys.executable).parent
SAVED_RE = re.compile(r"^oom-supervisor: emergency checkpoint at step (\d+): (\S+)", re.MULTILINE)


def run(out: Path, *args: str, hook: str | None = "1", launcher: list[str] | None = None,
        timeout: float = 300, env_extra: dict[str, str] | None = None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOM_SUPERVISOR_") and k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(HOOK_DIR), PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}")
    if hook is not None:
        env["OOM_SUPERVISOR_EMERGENCY_CKPT"] = hook
    env.update(env_extra or {})
    log = out.parent / f"{out.name}.{len(list(out.parent.glob(out.name + '.*.log')))}.log"
    with open(log, "wb") as fh:
        rc = subprocess.run([*(launcher or [sys.executable]), str(SCRIPT), "--out", str(out), *args],
                            stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=out.parent,
                            timeout=timeout, check=False).returncode
    return rc, log.read_text(errors="replace")


@contextlib.contextmanager
def frozen_rank0(out: Path, verdict: str):
    """Rank 0 that plain_trainer.py's --freeze-rank0 stopped (SIGSTOP): killed once the log says
    `verdict`, as torchrun kills it in the end (its SIGTERM cannot reach a stopped process, so it
    waits 30 s before its SIGKILL; the test has what it checks by then), and never left behind."""
    pid_file = Path(f"{out}.rank0.pid")
    done = threading.Event()

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError, ValueError, OSError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)

    def watch() -> None:
        while not done.wait(0.2):
            if any(verdict in p.read_text(errors="replace") for p in out.parent.glob(f"{out.name}.*.log")):
                kill()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        if pid_file.exists():
            kill()


def losses(log: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in re.finditer(r"^LOSS (\d+) (\S+)$", log, re.MULTILINE)}


def markers(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("oom-supervisor:")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref")
    rc, log = run(root / "out", hook=None)
    assert rc == 0, log[-3000:]
    return losses(log)


def test_forward_oom_mid_accumulation_saves_the_last_finished_step_and_resumes_exactly(tmp_path, reference):
    out = tmp_path / "out"
    # accumulation 2: forward call 16 is the second micro-batch of step 8 (steps 6, 7 since checkpoint-5)
    rc, log = run(out, "--oom-forward", "16")
    assert rc == 1, log[-3000:]
    assert log.rstrip().splitlines()[-1].startswith("RuntimeError: [enforce fail"), "the real error ends the log"
    saved = SAVED_RE.search(log)
    assert saved and saved[1] == "7" and saved[2] == str(out / "checkpoint-7"), markers(log)
    em = parse_emergency(log.splitlines())
    assert (em.outcome, em.step, em.path) == ("saved", 7, str(out / "checkpoint-7"))
    scan = scan_output_dir(out)
    assert [c.step for c in scan.complete] == [5, 7] and scan.incomplete == ()
    assert not list(out.glob("tmp-*"))
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"):
        assert (out / "checkpoint-7" / name).is_file(), name
    # The diagnosis still reads the OOM, not our lines.
    diag = diagnose_file(tmp_path / "out.0.log", ExitRecord(returncode=rc))
    assert diag.category.value == "host_oom" and diag.subkind == "cpu_allocator", diag.summary
    assert not any("oom-supervisor" in e.text for e in diag.evidence)

    rc, log2 = run(out, "--resume", str(out / "checkpoint-7"))
    assert rc == 0, log2[-3000:]
    got = {**losses(log), **losses(log2)}
    assert sorted(got) == list(range(1, 13))
    # Attention dropout is on: equal losses after step 7 need the RNG of step 7's end, which the
    # hook restores before saving (measured: without it step 8 gives 4.54536 instead of 4.54698).
    assert got == reference


def test_oom_inside_the_optimizer_step_saves_nothing(tmp_path):
    out = tmp_path / "out"
    rc, log = run(out, "--oom-optimizer", "8")  # parameters of step 8 already updated
    assert rc == 1
    assert any("no emergency checkpoint: the OOM hit the optimizer step of step 8" in m
               and "half-updated" in m for m in markers(log)), markers(log)
    assert parse_emergency(log.splitlines()).outcome == "not_attempted"
    assert [c.step for c in scan_output_dir(out).complete] == [5]
    assert not (out / "checkpoint-7").exists() and not (out / "checkpoint-8").exists()
    assert not list(out.glob("tmp-*"))


def test_oom_right_after_a_regular_save_keeps_that_checkpoint(tmp_path):
    out = tmp_path / "out"
    rc, log = run(out, "--oom-forward", "11")  # first micro-batch of step 6; checkpoint-5 just saved
    assert rc == 1
    assert f"emergency checkpoint at step 5: {out / 'checkpoint-5'} (already saved by the regular schedule)" \
        in log, markers(log)
    assert parse_emergency(log.splitlines()).outcome == "already_saved"
    assert len(markers(log)) == 1  # no "saving" line for a save that does not happen
    assert [c.step for c in scan_output_dir(out).complete] == [5]


def test_oom_before_any_step_finished_saves_nothing(tmp_path):
    out = tmp_path / "out"
    rc, log = run(out, "--oom-forward", "1")
    assert rc == 1
    assert any(m.startswith("oom-supervisor: no emergency checkpoint: a CPU-allocator OOM before any optimizer "
                            "step finished in this process, which started at step 0") for m in markers(log)), markers(log)
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("value,warning", [("0", None), ("yes", "neither 1 (on) nor 0 (off)")])
def test_switched_off_the_run_fails_as_it_would_without_the_hook(tmp_path, value, warning):
    out = tmp_path / "out"
    rc, log = run(out, "--oom-forward", "16", hook=value)
    assert rc == 1 and markers(log) == []
    assert [c.step for c in scan_output_dir(out).complete] == [5]
    if warning:
        assert warning in log


def test_failing_save_on_a_full_disk_leaves_no_checkpoint_that_looks_complete(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # One checkpoint of this model is ~394 KB: room for checkpoint-5, not for a second one.
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(out)],
                      capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        rc, log = run(out, "--oom-forward", "16")
        assert rc == 1
        failed = [m for m in markers(log) if "emergency checkpoint at step 7 failed:" in m]
        assert failed, markers(log)
        em = parse_emergency(log.splitlines())
        assert em.outcome == "failed" and em.step == 7, em
        scan = scan_output_dir(out)
        assert [c.step for c in scan.complete] == [5] and scan.incomplete == ()
        assert sorted(p.name for p in out.iterdir()) == ["checkpoint-5"]  # staging removed
        assert log.rstrip().splitlines()[-1].startswith("RuntimeError: [enforce fail")  # the OOM, not ours
    finally:
        subprocess.run(["umount", str(out)], check=False)


# The multi-rank (DDP replica) cases: test_emergency_ddp.py.


# --- DeepSpeed ZeRO-3 on one CPU rank (torchrun --nproc_per_node 1) ---------------------------

@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"deepspeed not importable: {e}")
    from tests.conftest_ml import DS_ENV, ds_z3

    root = tmp_path_factory.mktemp("z3")
    cfg = root / "z3.json"
    cfg.write_text(json.dumps(ds_z3(offload=False)))
    return root, cfg, dict(DS_ENV)


def torchrun(port: int) -> list[str]:
    return [str(VENV_BIN / "torchrun"), "--nproc_per_node", "1", "--master_port", str(port)]


def test_deepspeed_zero3_one_rank_forward_oom_saves_and_resumes_exactly(zero3):
    root, cfg, env = zero3
    rc, ref = run(root / "ref", "--deepspeed", str(cfg), hook=None, launcher=torchrun(29561), env_extra=env)
    assert rc == 0, ref[-3000:]
    out = root / "out"
    rc, log = run(out, "--deepspeed", str(cfg), "--oom-forward", "16", launcher=torchrun(29562), env_extra=env)
    assert rc != 0
    saved = SAVED_RE.search(log)
    assert saved and saved[1] == "7", markers(log)
    scan = scan_output_dir(out, expected_world_size=1)
    assert [(c.step, c.zero_stage) for c in scan.complete] == [(5, 3), (7, 3)] and scan.incomplete == ()
    assert (out / "checkpoint-7" / "latest").read_text().strip() == "global_step7"
    rc, log2 = run(out, "--deepspeed", str(cfg), "--resume", str(out / "checkpoint-7"), launcher=torchrun(29563),
                   env_extra=env)
    assert rc == 0, log2[-3000:]
    got = {**losses(log), **losses(log2)}
    assert sorted(got) == list(range(1, 13)) and got == losses(ref)  # bit-identical, dropout on


def test_deepspeed_oom_inside_engine_step_saves_nothing(zero3):
    root, cfg, env = zero3
    out = root / "opt"
    # accelerate runs DeepSpeed's optimizer step inside backward; the hook marks engine.step() too.
    rc, log = run(out, "--deepspeed", str(cfg), "--oom-optimizer", "14", launcher=torchrun(29564),
                  env_extra=env)
    assert rc != 0
    said = [m for m in markers(log) if "no emergency checkpoint: the OOM hit the optimizer step of step" in m]
    assert len(said) == 1, markers(log)
    failed_step = int(re.search(r"optimizer step of step (\d+)", said[0])[1])
    assert failed_step > 5 and max(losses(log)) == failed_step - 1
    assert [c.step for c in scan_output_dir(out).complete] == [5]


def test_oom_during_a_regular_save_moves_the_cut_off_checkpoint_aside_and_saves_it_again(tmp_path):
    out = tmp_path / "out"
    rc, log = run(out, "--oom-save", "1")  # checkpoint-5: weights and optimizer written, then the OOM
    assert rc == 1
    moved = [m for m in markers(log) if "moved the incomplete" in m]
    assert len(moved) == 1 and str(out / "checkpoint-5") in moved[0], markers(log)
    em = parse_emergency(log.splitlines())
    assert em.outcome == "saved" and em.moved_aside and ".supervisor-quarantine" in em.moved_aside
    saved = SAVED_RE.search(log)
    assert saved and saved[1] == "5", markers(log)
    scan = scan_output_dir(out)
    assert [c.step for c in scan.complete] == [5] and scan.incomplete == ()
    aside = list((out / ".supervisor-quarantine").iterdir())
    assert len(aside) == 1 and aside[0].name.startswith("checkpoint-5.incomplete-")
    assert not (aside[0] / "trainer_state.json").exists() and (aside[0] / "optimizer.pt").exists()
