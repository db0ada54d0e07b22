"""Where attempts run: this box (`local`) or a Slurm cluster (`slurm`), behind one protocol (`base`)."""

from __future__ import annotations

from supervisor.run.backends.base import Backend


def make_backend(cfg) -> Backend:
    if cfg.backend == "slurm":
        from supervisor.run.backends.slurm import SlurmBackend

        return SlurmBackend(cfg)
    from supervisor.run.backends.local import LocalBackend

    return LocalBackend(cfg)
