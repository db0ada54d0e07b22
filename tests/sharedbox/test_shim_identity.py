"""The launch shim stays root and runs only the command as the job's user: uid, primary gid and
supplementary groups from the user database, checked after the drop; without an identity where
one is required it runs nothing. Real processes, a real user."""

from __future__ import annotations

import os
import stat
import time

from supervisor.core.paths import AttemptPaths
from supervisor.run import attemptdir, proctree
from supervisor.run.identity import lookup


def _run(paths: AttemptPaths, argv, **kw) -> dict:
    h = proctree.launch(paths, argv=argv, cwd=kw.pop("cwd", paths.root), env={"PATH": "/usr/bin:/bin"}, **kw)
    deadline = time.monotonic() + 30
    while not h.over() and time.monotonic() < deadline:
        time.sleep(0.05)
    return proctree.read_exit(paths)


def test_the_command_runs_as_its_submitter_and_cannot_become_root_again(box_dir, box_users, user_python):
    alice = lookup(box_users["alice"].uid)
    paths = AttemptPaths(box_dir / "attempts/1/attempt-1")
    attemptdir.make(paths, alice)
    probe = ("import os, sys\nprint('ids', os.getresuid(), os.getresgid(), sorted(os.getgroups()), os.getcwd())\n"
             "try:\n    os.setuid(0)\n    print('ROOT AGAIN')\nexcept PermissionError:\n    print('no way back')\n")
    rec = _run(paths, [user_python[0], "-c", probe], cwd=alice.home, identity=alice, require_identity=True)
    assert rec["returncode"] == 0, paths.log.read_text()
    out = paths.log.read_text()
    u, g = alice.uid, alice.gid
    assert f"ids ({u}, {u}, {u}) ({g}, {g}, {g}) {sorted(alice.groups)} {alice.home}" in out
    assert "no way back" in out and "ROOT AGAIN" not in out
    st = paths.log.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, alice.uid), "the log is its owner's"
    ex = paths.exit_record.stat()
    assert (stat.S_IMODE(ex.st_mode), ex.st_uid) == (0o600, 0), "the exit record is root's: not forgeable"
    assert (stat.S_IMODE(paths.root.stat().st_mode), paths.root.stat().st_uid) == (0o711, 0)
    assert paths.user_dir.stat().st_uid == alice.uid
    assert alice.groups and box_users["alice"].gid in alice.groups


def test_a_workdir_the_user_cannot_enter_is_not_entered_as_root(box_dir, box_users):
    alice = lookup(box_users["alice"].uid)
    paths = AttemptPaths(box_dir / "attempts/2/attempt-1")
    attemptdir.make(paths, alice)
    secret = box_dir / "roots"
    secret.mkdir(mode=0o700)
    rec = _run(paths, ["true"], cwd=secret, identity=alice)
    assert rec["returncode"] == 127 and "Permission denied" in rec["launch_error"]


def test_no_identity_where_one_is_required_runs_nothing(box_dir):
    paths = AttemptPaths(box_dir / "attempts/3/attempt-1")
    paths.root.mkdir(parents=True)
    marker = box_dir / "ran"
    rec = _run(paths, ["touch", str(marker)], require_identity=True)
    assert rec["returncode"] == 126 and "names nobody" in rec["launch_error"]
    assert not marker.exists() and os.geteuid() == 0
