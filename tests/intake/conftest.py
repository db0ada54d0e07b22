"""A LLaMA-Factory checkout as a user has one: v0.9.5's examples, its data/dataset_info.json and
DeepSpeed presets (tests/fixtures/llamafactory-v0.9.5), copied to a temporary folder with the data
files the registry names written there (the fixture holds only the registry), and an empty
Hugging Face cache; `submit`/`plan` run through the real CLI entry point from that folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "llamafactory-v0.9.5"


def make_checkout(root: Path) -> Path:
    shutil.copytree(FIXTURE, root)
    info = json.loads((root / "data" / "dataset_info.json").read_text())
    for entry in info.values():
        name = entry.get("file_name")
        if name and not any(k in entry for k in ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url")):
            path = root / "data" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("" if name.endswith((".jsonl", ".txt", ".csv")) else "[]\n")
    return root


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    root = make_checkout(tmp_path / "LLaMA-Factory")
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
                "ALLOW_EXTRA_ARGS", "USE_MCA", "USE_MODELSCOPE_HUB", "USE_OPENMIND_HUB",
                "OOM_SUPERVISOR_STATE_DIR", "OOM_SUPERVISOR_SPOOL_DIR", "OOM_SUPERVISOR_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty cache
    monkeypatch.chdir(root)
    return root


class Cli:
    """`oom-supervisor ...` in this process (main() as the console script calls it)."""

    def __init__(self, tmp: Path, capsys) -> None:
        self.tmp, self.capsys = tmp, capsys

    def __call__(self, *args: str) -> tuple[int, str, str]:
        from supervisor.cli.main import main

        cmd, *rest = args
        common = ["--state-dir", str(self.tmp / "state"), "--spool-dir", str(self.tmp / "spool"),
                  "--config", "/dev/null"]
        self.capsys.readouterr()
        try:
            rc = main([cmd, *common, *rest])
        except SystemExit as exc:
            rc = exc.code
        out = self.capsys.readouterr()
        return rc, out.out, out.err


@pytest.fixture
def cli(tmp_path, capsys):
    return Cli(tmp_path, capsys)
