"""The daemon (root) touches a job's output folder as the job's user, on its own thread only: a
path or a link the user chose reaches nothing they could not reach themselves."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from supervisor.run.identity import acting_as, as_user_kwargs, lookup


def test_reads_and_writes_with_the_users_rights_on_this_thread_only(box_dir, box_users):
    alice = lookup(box_users["alice"].uid)
    secret = box_dir / "roots-only"
    secret.write_text("root's")
    secret.chmod(0o600)
    bobs = box_dir / "bobs"
    bobs.mkdir(mode=0o700)
    os.chown(bobs, box_users["bob"].uid, box_users["bob"].gid)
    out = box_users["alice"].home / "out"
    out.mkdir()
    os.chown(out, alice.uid, alice.gid)
    out.chmod(0o700)
    (out / "trainer_log.jsonl").symlink_to(secret)  # alice's own link to a file she may not read
    other_thread: list[str] = []
    go = threading.Event()

    def read_later():
        go.wait(10)
        other_thread.append(secret.read_text())

    t = threading.Thread(target=read_later)  # started before: a thread started inside would inherit it
    t.start()
    with acting_as(alice):
        with pytest.raises(PermissionError):
            (out / "trainer_log.jsonl").read_text()
        with pytest.raises(PermissionError):
            (bobs / "x").write_text("x")
        (out / "checkpoint-1").mkdir()  # what quarantine and fixups do: allowed, as her
        (out / "checkpoint-1").rename(out / ".aside-1")
        go.set()
        t.join()
    assert other_thread == ["root's"], "the other threads stay root"
    assert (out / ".aside-1").stat().st_uid == alice.uid
    assert secret.read_text() == "root's", "back to root afterwards"


def test_a_program_for_the_user_runs_as_the_user(box_users, user_python):
    alice = lookup(box_users["alice"].uid)
    res = subprocess.run([user_python[0], "-c", "import os; print(os.getuid(), sorted(os.getgroups()))"],
                         capture_output=True, text=True, timeout=60, cwd="/", **as_user_kwargs(alice), check=False)
    assert res.stdout.split(None, 1) == [str(alice.uid), f"{sorted(alice.groups)}\n"]
