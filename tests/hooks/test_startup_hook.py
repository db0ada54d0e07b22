"""The start-up hook folder itself: lazy patching, both features at once, self-contained, the
peak-memory file's merge across processes. Real subprocesses with the hook on PYTHONPATH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from supervisor.judge.policy.render import HOOK_DIR


def hook_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOM_SUPERVISOR_")}
    env.update({"PYTHONPATH": str(HOOK_DIR), **extra})
    return env


def test_memory_cap_survives_a_find_spec_probe_before_the_import():
    """Regression: the old hook unhooked itself at the first `find_spec('torch')` (transformers'
    "is torch installed?" check), so `import transformers` before `import torch` lost the cap."""
    pytest.importorskip("torch")
    code = ("import importlib.util; importlib.util.find_spec('torch'); import torch;"
            "print(getattr(torch, '_oom_supervisor_memory_fraction', None))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=hook_env(OOM_SUPERVISOR_MEMORY_FRACTION="0.5"), check=False)
    assert res.stdout.strip() == "0.5", res.stderr[-2000:]


def test_hook_patches_the_trainer_only_when_it_is_imported_and_works_with_the_memory_cap(tmp_path):
    code = ("import sys, transformers; lazy = 'transformers.trainer' not in sys.modules;"
            "from transformers import Trainer; import torch;"
            "print(lazy, getattr(Trainer.train, '_oom_supervisor', False), Trainer.train.__name__,"
            " torch._oom_supervisor_memory_fraction)")
    pytest.importorskip("transformers")
    env = hook_env(OOM_SUPERVISOR_EMERGENCY_CKPT="1", OOM_SUPERVISOR_MEMORY_FRACTION="0.5")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert res.stdout.split() == ["True", "True", "train", "0.5"], res.stderr[-2000:]
    env.pop("OOM_SUPERVISOR_EMERGENCY_CKPT")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert res.stdout.split() == ["True", "False", "train", "0.5"], res.stderr[-2000:]


def test_copy_of_the_hook_folder_is_self_contained(tmp_path):
    """The hook runs in the JOB's Python, where `supervisor` need not be importable."""
    copy = tmp_path / "hook"
    shutil.copytree(HOOK_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    pytest.importorskip("transformers")
    env = hook_env(PYTHONPATH=str(copy), OOM_SUPERVISOR_EMERGENCY_CKPT="1")
    code = ("import sys; from transformers import Trainer;"
            "print(Trainer.train._oom_supervisor, any(m == 'supervisor' or m.startswith('supervisor.')"
            " for m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, cwd=tmp_path, check=False)
    assert res.stdout.split() == ["True", "False"], res.stderr[-2000:]


def test_peak_file_merges_every_process_of_the_attempt(tmp_path):
    """Ranks write one file at the same moment (exit): flock + atomic replace keep every entry."""
    path = tmp_path / "gpu_peak.json"
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from oom_supervisor_hooks import peak;"
            "[peak.merge(sys.argv[2], {'pid': os.getpid() * 100 + i, 'devices': []}) for i in range(20)]")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(HOOK_DIR), str(path)]) for _ in range(6)]
    assert [p.wait(timeout=60) for p in procs] == [0] * 6
    data = json.loads(path.read_text())
    assert data["version"] == 1 and len(data["processes"]) == 6 * 20
    assert not list(tmp_path.glob("*.tmp"))


def test_peak_file_is_not_written_by_a_process_that_never_used_a_gpu(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "gpu_peak.json"
    code = "import torch; x = torch.ones(1000, 1000) @ torch.ones(1000, 1000); print(torch.cuda.is_initialized())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=hook_env(OOM_SUPERVISOR_PEAK_FILE=str(path)), check=False)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr[-2000:]
    assert not path.exists() and "peak" not in res.stderr
