"""Shared loaders for the labeled log fixtures (tests/fixtures/logs/*.log + *.expect.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from supervisor.core.models import ExitRecord, HostEvidence

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "logs"


def fixture_cases() -> list[Path]:
    """Every labeled log: ours (tests/fixtures/logs) and the real ones copied from public issues (real/)."""
    return sorted(FIXTURES.glob("*.expect.yaml")) + sorted((FIXTURES / "real").glob("*.expect.yaml"))


def load_case(sidecar: Path) -> tuple[bytes, dict[str, Any], ExitRecord | None, HostEvidence | None]:
    side = yaml.safe_load(sidecar.read_text())
    log = sidecar.with_name(sidecar.name.replace(".expect.yaml", ".log")).read_bytes()
    exit = ExitRecord(**side["exit"]) if side.get("exit") else None
    host = None
    if side.get("host"):
        h = dict(side["host"])
        for key in ("kernel_lines", "kernel_oom_lines"):  # the old name of the field
            if key in h:
                h["kernel_lines"] = tuple(h.pop(key))
        host = HostEvidence(**h)
    if side.get("kernel_log"):  # a kernel log excerpt beside the log, as `explain --kernel-log` reads it
        text = (sidecar.parent / side["kernel_log"]).read_text(errors="replace")
        host = HostEvidence(**{**(host.to_dict() if host else {}),
                               "kernel_lines": tuple(host.kernel_lines if host else ()) + tuple(text.splitlines()),
                               "kernel_log_read": True})
    return log, side, exit, host
