"""An attempt's folder, and whose each file in it is.

Single-user mode: the folder is the daemon's (0700), inside the job's folder in the state, as it
always was. On a shared box it lives in the attempts folder, outside the root-only state, so that
the job's owner can read what is theirs without seeing anyone else's:

    <attempts>/<job>/attempt-<n>/   0711 root   (open by name, no listing; nobody else may write)
        output.log                  0600 owner  the command's output (written through the shim's fd)
        effective.yaml, ds_config.json, environment.json
                                    0600 owner  what the job runs with (the job reads them as itself)
        user/                       0700 owner  the job's own writable folder (the start-up hook's
                                                GPU peak file), read by the daemon without following links
        launch.json, exit.json, procs.json, diagnosis.json
                                    0600 root   the shim's spec and the daemon's evidence: a job cannot
                                                forge its exit status or point the daemon elsewhere

Root-owned folders mean a job cannot swap a file for a link to something it may not read; files
the daemon reads from the job's side (the peak file) are opened with O_NOFOLLOW.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from supervisor.core.paths import AttemptPaths
from supervisor.run.identity import Identity

SHARED_MODE, PRIVATE_MODE = 0o711, 0o700
MAX_JOB_FILE = 4 << 20


def make(paths: AttemptPaths, identity: Identity | None) -> None:
    """Create the attempt folder (after a previous, never-launched one was removed). `identity`:
    a shared box's job owner, who gets the log, the scratch folder and later the rendered files."""
    if identity is None:
        paths.root.mkdir(parents=True, mode=PRIVATE_MODE)
        paths.user_dir.mkdir(mode=PRIVATE_MODE)
        return
    for folder in (paths.root.parent.parent, paths.root.parent):
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, SHARED_MODE)
    paths.root.mkdir(mode=SHARED_MODE)
    os.chmod(paths.root, SHARED_MODE)  # mkdir's mode passes through the umask
    paths.user_dir.mkdir(mode=PRIVATE_MODE)
    os.chown(paths.user_dir, identity.uid, identity.gid)
    # The log is handed to its user by whoever opens it for writing first (proctree.launch, as root:
    # the descriptor stays writable after the chown; without CAP_DAC_OVERRIDE a user's file could
    # not be opened for writing), or before sbatch (the Slurm step opens it as the user).


def give(path: Path, identity: Identity | None) -> None:
    """A file the daemon wrote for the job (rendered config, environment): its owner's, 0600."""
    if identity is None or not os.path.lexists(path):
        return
    os.chmod(path, 0o600)  # first, while it is root's: changing the mode of a user's file takes CAP_FOWNER
    os.chown(path, identity.uid, identity.gid, follow_symlinks=False)


def read_job_json(path: Path) -> Any | None:
    """A JSON file the job itself wrote (its user may have made it anything): a regular file only,
    no link followed, bounded; None when missing or not JSON."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, MAX_JOB_FILE + 1)
        if len(data) > MAX_JOB_FILE:
            return None
        return json.loads(data)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
