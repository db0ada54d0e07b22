"""Who submitted a job, on a shared box: the owner of the spool file `submit` created, read from
the opened file; only the submit group's members may submit; nobody reads another's job file,
waiting in incoming/ or refused in rejected/ (issue 17 case 3)."""

from __future__ import annotations

import os
import stat

import yaml

from supervisor.core.paths import SpoolPaths, StatePaths
from supervisor.intake.spool import intake
from supervisor.record.store import Store
from supervisor.run.identity import SubmitGate

from .conftest import SUBMIT, Box


def _job(work, name="j", **sup) -> str:
    return yaml.safe_dump({"supervisor": {"name": name, "command": ["true"], "workdir": str(work), **sup}})


def _intake(b: Box, gate: SubmitGate):
    """One intake pass as the daemon does it (root), with the shared box's gate."""
    state = StatePaths(b.state)
    state.ensure()
    store = Store(state.db)
    return intake(SpoolPaths(b.spool), state, store, settle_s=0, max_bytes=1 << 20, gate=gate), store


def _mode(p) -> tuple[int, int, int]:
    st = os.lstat(p)
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


def test_case3_incoming_is_private_and_submit_makes_the_file_its_submitters(box, box_users):
    b = box()
    gate = SubmitGate(SUBMIT)
    _intake(b, gate)  # lays the spool out: 1730 root:<submit group>
    assert _mode(b.spool / "incoming") == (0o1730, 0, gate.gid)
    alice, bob = box_users["alice"], box_users["bob"]
    work = b.workdir("alice")
    (work / "secret.yaml").write_text(_job(work, env={"HF_TOKEN": "hf_alices_secret"}))
    os.chown(work / "secret.yaml", alice.uid, alice.gid)
    res = b.cli("alice", "submit", str(work / "secret.yaml"), cwd=work)
    assert res.returncode == 0, res.stderr
    (dropped,) = list((b.spool / "incoming").iterdir())
    assert _mode(dropped)[:2] == (0o600, alice.uid), "the submitter's alone"
    # bob is in the same group: he can submit, but neither list nor read nor remove alice's file.
    ls = b.as_user("bob", "ls", str(b.spool / "incoming"))
    assert ls.returncode != 0 and "Permission denied" in ls.stderr
    cat = b.as_user("bob", "cat", str(dropped))
    assert cat.returncode != 0 and "hf_alices_secret" not in cat.stdout
    rm = b.as_user("bob", "rm", "-f", str(dropped))
    assert rm.returncode != 0 and dropped.exists()
    # eve is not in the group: she cannot even create a file there.
    eve = b.as_user("eve", "sh", "-c", f"echo x > {b.spool}/incoming/eve.yaml")
    assert eve.returncode != 0 and not (b.spool / "incoming/eve.yaml").exists()
    res, store = _intake(b, gate)
    assert res.accepted == [1]
    job = store.job(1)
    assert (job.owner_uid, job.owner) == (alice.uid, "alice")
    assert _mode(StatePaths(b.state).job(1).job_file)[:2] == (0o600, 0), "the record's copy is root's"
    assert bob.uid != alice.uid


def test_case3_a_refusal_is_readable_by_its_submitter_only(box, box_users):
    b = box()
    gate = SubmitGate(SUBMIT)
    _intake(b, gate)
    alice = box_users["alice"]
    work = b.workdir("alice")
    bad = work / "bad.yaml"
    bad.write_text("supervisor:\n  command: [true]\n  max_attempt: 3\n  env: {HF_TOKEN: hf_alices_secret}\n")
    os.chown(bad, alice.uid, alice.gid)
    # a raw drop (cp keeps the mode it is given: 0600 by alice's umask here)
    cp = b.as_user("alice", "sh", "-c", f"umask 077 && cp {bad} {b.spool}/incoming/bad.yaml")
    assert cp.returncode == 0, cp.stderr
    res, _ = _intake(b, gate)
    assert res.rejected and not res.accepted
    rejected, reason = b.spool / "rejected/bad.yaml", b.spool / "rejected/bad.yaml.error.txt"
    assert _mode(b.spool / "rejected")[:2] == (0o711, 0), "nobody lists the refusals"
    assert _mode(rejected)[:2] == (0o600, alice.uid) and _mode(reason)[:2] == (0o600, alice.uid)
    mine = b.as_user("alice", "cat", str(reason))
    assert mine.returncode == 0 and "max_attempt" in mine.stdout
    for path in (rejected, reason):
        theirs = b.as_user("bob", "cat", str(path))
        assert theirs.returncode != 0 and "hf_alices_secret" not in theirs.stdout
    assert b.as_user("bob", "ls", str(b.spool / "rejected")).returncode != 0


def test_only_members_files_are_jobs_and_roots_drop_is_roots(box, box_users):
    b = box()
    gate = SubmitGate(SUBMIT)
    _intake(b, gate)
    eve = box_users["eve"]
    work = b.workdir("eve")
    # eve was removed from the group after dropping a file (or root copied one of hers in).
    f = b.spool / "incoming/eve.yaml"
    f.write_text(_job(work))
    os.chown(f, eve.uid, eve.gid)
    f.chmod(0o600)
    (b.spool / "incoming/root.yaml").write_text(_job(work, name="roots"))
    res, store = _intake(b, gate)
    assert res.accepted == [1] and (store.job(1).name, store.job(1).owner_uid, store.job(1).owner) == ("roots", 0, "root")
    (reason,) = [r for n, r in res.rejected if n == "eve.yaml"]
    assert "eve" in reason and f"not a member of {SUBMIT!r}" in reason
    assert _mode(b.spool / "rejected/eve.yaml.error.txt")[1] == eve.uid


def test_a_hard_link_is_refused(box, box_users):
    """A link would make whoever owns the linked file its submitter."""
    b = box()
    gate = SubmitGate(SUBMIT)
    _intake(b, gate)
    work = b.workdir("alice")
    res = b.as_user("alice", "sh", "-c", f"printf '%s' '{_job(work)}' > j.yaml && ln j.yaml {b.spool}/incoming/j.yaml",
                    cwd=work)
    assert res.returncode == 0, res.stderr
    res, _ = _intake(b, gate)
    assert not res.accepted and "hard links" in res.rejected[0][1]


def test_a_single_user_daemon_takes_its_own_users_files_only(box, box_users):
    """Run by hand as root without system mode, it would run alice's file as root: refused."""
    b = box()
    _intake(b, SubmitGate(SUBMIT))  # the spool exists and members may write to it
    work = b.workdir("alice")
    (work / "j.yaml").write_text(_job(work))
    os.chown(work / "j.yaml", box_users["alice"].uid, box_users["alice"].gid)
    assert b.cli("alice", "submit", str(work / "j.yaml"), cwd=work).returncode == 0
    res, _ = _intake(b, SubmitGate(None, daemon_uid=0))
    assert not res.accepted and "not this daemon's user" in res.rejected[0][1]
