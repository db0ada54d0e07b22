"""System mode (a shared box): the folders' owners and modes, set by the daemon itself at start.

The daemon runs as root and each job as its submitter. What that needs on disk, whatever made the
folders (systemd-tmpfiles, an older release, a hand-made spool):

- the state folder (SQLite record, job files with their tokens, launch specs): 0700 root, the
  daemon's alone;
- the attempts folder (`attempts_dir`): 0711 root, so a job's owner can open their attempt's log
  and rendered config by name (the files are theirs, 0600) but nobody can list the jobs there;
- the spool: see `intake.spool.prepare_spool`.
"""

from __future__ import annotations

import os
from pathlib import Path

from supervisor.daemon.config import DaemonConfig
from supervisor.intake.spool import prepare_spool
from supervisor.run.identity import SubmitGate

ATTEMPTS_MODE = 0o711


class NotRoot(RuntimeError):
    pass


def prepare(cfg: DaemonConfig, *, log=None) -> SubmitGate:
    """Set the folders up for the configured mode; whose files are jobs."""
    cfg.state.ensure()
    _private(cfg.state.root, 0o700)
    if not cfg.system_mode:
        return SubmitGate(None, daemon_uid=os.geteuid())
    if os.geteuid() != 0:
        raise NotRoot("mode: system runs each job as its submitter and needs the daemon to run as root "
                      "(the system unit); use mode: single-user to run jobs as this user")
    attempts = cfg.attempts_root
    assert attempts is not None
    attempts.mkdir(parents=True, exist_ok=True)
    os.chown(attempts, 0, 0)
    os.chmod(attempts, ATTEMPTS_MODE)
    gate = SubmitGate(cfg.submit_group)
    cfg.spool.ensure()
    prepare_spool(cfg.spool, gate, log=log)
    if log is not None:
        log.info("system_mode", submit_group=cfg.submit_group, submit_gid=gate.gid, admin_group=cfg.admin_group,
                 attempts_dir=str(attempts), control_socket=str(cfg.control_socket) if cfg.control_socket else None)
    return gate


def _private(path: Path, mode: int) -> None:
    st = path.stat()
    if st.st_mode & 0o7777 != mode and st.st_uid == os.geteuid():
        os.chmod(path, mode)
