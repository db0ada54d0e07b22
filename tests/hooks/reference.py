"""One uninterrupted 2-rank run of the plain Trainer, shared by the DDP and the ZeRO emergency tests.

Measured here (torch 2.14.1, DeepSpeed 0.19.8, fp32 on CPU, `--rank-seed`): the per-step losses of
the uninterrupted DDP, ZeRO-2 and ZeRO-3 runs agree within 4.2e-7 relative, 24 times inside the
1e-5 the resume tests allow, so one run is the reference for all three: a resume that lost or
half-restored any state (optimizer moments, a shard, a rank's RNG) is off by far more. The run is
kept with the code (tests/fixtures/references) or made once per box (a file lock: the other xdist
worker waits for it) and cached, keyed by the trainer's source, the library versions and the CPU's
kind, so no product code can change it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from importlib.metadata import version

from filelock import FileLock

from tests.conftest_ml import CACHE, REFERENCES, cpu_kind
from tests.hooks.test_emergency_plain import SCRIPT, losses, run


def _key() -> str:
    parts = [SCRIPT.read_bytes()] + [version(p).encode() for p in ("torch", "transformers")] + [cpu_kind().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def ddp_losses(launcher: list[str]) -> dict[int, float]:
    """The uninterrupted 2-rank run's loss per step: kept with the code for this trainer, these
    libraries and this kind of CPU (REFERENCES), or made once here with `launcher` (a 2-rank torchrun)."""
    kept = REFERENCES / f"plain-2-ranks-reference-{_key()}.json"
    if kept.exists():
        return {int(k): v for k, v in json.loads(kept.read_text()).items()}
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / kept.name
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            root = CACHE / f"plain-2-ranks-reference-{_key()}"
            shutil.rmtree(root, ignore_errors=True)  # an interrupted run's checkpoints: start afresh
            root.mkdir()
            rc, log = run(root / "out", "--rank-seed", hook=None, launcher=launcher, timeout=400)
            assert rc == 0, log[-3000:]
            path.write_text(json.dumps(losses(log)))
    return {int(k): v for k, v in json.loads(path.read_text()).items()}
