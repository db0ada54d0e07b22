"""Shared loaders for the labeled log fixtures (tests/fixtures/logs/*.log + *.expect.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from supervisor.core.models import ExitRecord, HostEvidence

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "logs"


def fixture_cases() -> list[Path]:
    return sorted(FIXTURES.glob("*.expect.yaml"))


def load_case(sidecar: Path) -> tuple[bytes, dict[str, Any], ExitRecord | None, HostEvidence | None]:
    side = yaml.safe_load(sidecar.read_text())
    log = sidecar.with_name(sidecar.name.replace(".expect.yaml", ".log")).read_bytes()
    exit = ExitRecord(**side["exit"]) if side.get("exit") else None
    host = None
    if side.get("host"):
        h = dict(side["host"])
        if "kernel_oom_lines" in h:
            h["kernel_oom_lines"] = tuple(h["kernel_oom_lines"])
        host = HostEvidence(**h)
    return log, side, exit, host
