"""Shared helpers for tests that run REAL trainings (LLaMA-Factory on the CPU, tiny local model).

Not a conftest: import what you need (`from tests.conftest_ml import ...`). Assets and the
DeepSpeed op build are cached under the repo's git-ignored `.cache/` (override with
OOMSUP_TEST_CACHE) so only the first session pays for them; training outputs live in pytest's
temp dirs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
LLAMAFACTORY_CLI = VENV_BIN / "llamafactory-cli"
CACHE = Path(os.environ.get("OOMSUP_TEST_CACHE", REPO / ".cache" / "test-ml"))

# Uninterrupted runs' per-step losses, measured once and kept with the code (README there): keyed by
# what they depend on, the CPU included, so a fresh clone reads them instead of training them again.
REFERENCES = REPO / "tests" / "fixtures" / "references"
# Instruction sets that pick torch's CPU kernels (and so the last bits of a loss)
ISA_FLAGS = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "amx_tile", "amx_bf16", "amx_int8"}


def cpu_kind() -> str:
    """The CPU as far as it decides a loss's bits: vendor, model and the instruction sets torch uses."""
    info: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
        if key.strip() == "flags":
            break
    flags = sorted(ISA_FLAGS & set(info.get("flags", "").split()))
    return " ".join([info.get("vendor_id", "?"), info.get("model name", "?"), *flags])


def stack_key(config_text: str) -> str:
    """What an uninterrupted LLaMA-Factory run's losses depend on: its config (as text, no per-clone
    paths), the libraries that train, the CPU."""
    from importlib.metadata import version

    libs = [f"{m}=={version(m)}" for m in ("torch", "transformers", "llamafactory", "peft", "accelerate")]
    return hashlib.sha256("\n".join([config_text, *libs, cpu_kind()]).encode()).hexdigest()[:16]


# What a DeepSpeed process needs to find the CPU ops scripts/test.sh prebuilt, not rebuild them: the
# same folder and the same ninja. torch.utils.cpp_extension runs `ninja` from PATH; the venv's (pip's
# ninja 1.13) and the system's (1.11) keep incompatible build logs, so a process that finds the other
# one rebuilds the op (~100 s of CPU), and the next process with the first ninja rebuilds it back.
DS_ENV = {
    "TORCH_EXTENSIONS_DIR": str(CACHE / "torch_extensions"),  # DeepSpeed ops compile once
    "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # also torchrun, for FORCE_TORCHRUN
}

# Offline, quiet, fast: nothing may come from a hub.
TRAIN_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "DISABLE_VERSION_CHECK": "1",
    "OMP_WAIT_POLICY": "PASSIVE",  # also through a daemon (tests/conftest.py, QUIET_OMP)
    **DS_ENV,
}

# The DeepSpeed ZeRO-3 config of LLaMA-Factory's examples/deepspeed/ds_z3_config.json.
DS_Z3: dict[str, Any] = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}


def ds_z3(offload: bool) -> dict[str, Any]:
    cfg = json.loads(json.dumps(DS_Z3))
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    return cfg


def needs_llamafactory() -> None:
    if not LLAMAFACTORY_CLI.exists():
        pytest.skip(f"{LLAMAFACTORY_CLI} not installed (the [llamafactory] extra)")


def needs_deepspeed() -> None:
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        pytest.skip(f"deepspeed not importable: {e}")


def tiny_assets():
    """A ~50k-parameter Llama + 64 short samples: a training step takes milliseconds."""
    from supervisor.demo.assets import build_demo_assets

    return build_demo_assets(CACHE / "assets", hidden=64, layers=2, n_short=64, n_long=0,
                             long_tokens=100)


def tiny_job(output_dir: Path, **overrides: Any) -> dict[str, Any]:
    from supervisor.demo.assets import demo_job_config

    cfg = demo_job_config(tiny_assets(), output_dir, micro_batch=4, grad_accum=1, save_steps=3)
    cfg.update(cutoff_len=256, max_steps=12)
    cfg.update(overrides)
    return {k: v for k, v in cfg.items() if v is not None}


def write_job(path: Path, config: Mapping[str, Any], deepspeed: Mapping[str, Any] | None = None) -> Path:
    cfg = dict(config)
    if deepspeed is not None:
        ds_path = path.with_suffix(".ds.json")
        ds_path.write_text(json.dumps(deepspeed, indent=1))
        cfg["deepspeed"] = str(ds_path)
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_train(job_yaml: Path, log: Path, *, deepspeed: bool = False) -> subprocess.Popen:
    env = {**os.environ, **TRAIN_ENV}
    if deepspeed:
        env.update(FORCE_TORCHRUN="1", NPROC_PER_NODE="1")
    with open(log, "wb") as out:
        return subprocess.Popen([str(LLAMAFACTORY_CLI), "train", str(job_yaml)], stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=job_yaml.parent,
                                start_new_session=True)


def train(job_yaml: Path, log: Path, *, deepspeed: bool = False, timeout: float = 600) -> int:
    proc = start_train(job_yaml, log, deepspeed=deepspeed)
    try:
        return proc.wait(timeout=timeout)
    finally:
        kill_tree(proc)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the whole session (torchrun's workers are not in the launcher's group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def kill_when(proc: subprocess.Popen, ready: Callable[[], bool], *, timeout: float = 300,
              poll: float = 0.005) -> bool:
    """SIGKILL the run as soon as `ready()` holds; False if the run ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            kill_tree(proc)
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    kill_tree(proc)
    raise TimeoutError("condition not reached")


def log_records(output_dir: Path) -> list[dict[str, Any]]:
    """trainer_log.jsonl as records (complete lines only)."""
    path = output_dir / "trainer_log.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def aborted_after_training(log_text: str) -> bool:
    """The run trained to its end and saved, then a rank died of SIGABRT on its way out: "terminate
    called without an active exception" after the trainer's "Training completed", with 2 ranks under
    DeepSpeed ZeRO-3 over gloo while rank 0 still wrote the final model (seen in CI on three different
    tests; never before the final save). A teardown crash of the stack, not of what a test checks:
    the daemon takes it for an unknown abort and resumes from the final checkpoint
    (tests/e2e/test_multirank_night.py)."""
    done = log_text.find("Training completed")
    return done >= 0 and "terminate called without an active exception" in log_text[done:]


def steps_logged(output_dir: Path) -> dict[int, dict[str, Any]]:
    """Per-step loss/lr records (the final summary line has no loss)."""
    return {r["current_steps"]: r for r in log_records(output_dir) if "loss" in r}


def kept_steps(name: str, cfg: Mapping[str, Any], make: Callable[[], Path]) -> dict[int, dict[str, Any]]:
    """An uninterrupted LLaMA-Factory run's per-step records (as steps_logged gives them): kept with the
    code (REFERENCES) for this config, stack and kind of CPU, else made here by `make()` (which trains
    and returns the run's output folder) and cached. Only for a reference a test compares with, never
    for a run whose files a test reads."""
    text = yaml.safe_dump({k: v for k, v in cfg.items() if k != "output_dir"}).replace(str(REPO), "<repo>")
    file = f"{name}-reference-{stack_key(text)}.json"
    for path in (REFERENCES / file, CACHE / file):
        if path.exists():
            return {int(k): v for k, v in json.loads(path.read_text()).items()}
    keep = ("current_steps", "total_steps", "loss", "lr", "epoch")  # not the timings: they vary run to run
    steps = {n: {k: r[k] for k in keep if k in r} for n, r in steps_logged(make()).items()}
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = CACHE / f"{file}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(steps))
    os.replace(tmp, CACHE / file)
    return steps


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst
