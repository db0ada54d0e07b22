import os
import time
from pathlib import Path

import pytest
import yaml

from supervisor.core.paths import SpoolPaths, StatePaths
from supervisor.intake.jobspec import JobFileError, parse_job_text
from supervisor.intake.spool import intake, submit, with_workdir
from supervisor.record.store import Store

from ..conftest import command_job, drop


@pytest.fixture
def env(tmp_path):
    spool, state = SpoolPaths(tmp_path / "spool"), StatePaths(tmp_path / "state")
    spool.ensure()
    state.ensure()
    return spool, state, Store(state.db)


def run(env, **kw):
    spool, state, store = env
    return intake(spool, state, store, settle_s=kw.pop("settle_s", 0.0), max_bytes=kw.pop("max_bytes", 4096), **kw)


def error_of(spool, name):
    return (spool.rejected / f"{name}.error.txt").read_text()


def test_accepts_command_job_into_state_folder(env, tmp_path):
    spool, state, store = env
    text = command_job(tmp_path, ["echo", "hi"], name="hello")
    drop(spool.root, "a.yaml", text)
    res = run(env)
    assert res.accepted == [1]
    assert not (spool.incoming / "a.yaml").exists()
    assert state.job(1).job_file.read_text() == text
    job = store.job(1)
    assert (job.name, job.kind, job.state) == ("hello", "command", "queued")


def test_unknown_key_rejected_with_line_and_suggestion(env, tmp_path):
    spool, _, store = env
    drop(spool.root, "b.yaml", f"supervisor:\n  command: [echo]\n  workdir: {tmp_path}\n  max_attempt: 3\n")
    res = run(env)
    assert res.accepted == [] and res.rejected
    err = error_of(spool, "b.yaml")
    assert "line 4" in err and "supervisor.max_attempt: unknown key" in err and "'max_attempts'" in err
    assert (spool.rejected / "b.yaml").exists() and store.jobs() == []


@pytest.mark.parametrize("text,needle", [
    ("supervisor: [unclosed\n", "YAML does not parse"),
    ("- just\n- a list\n", "must be a YAML mapping, this one is list"),
    ("", "this one is empty"),
    ("supervisor:\n  command: []\n", "non-empty list"),
    ("supervisor:\n  command: [x]\n  priority: high\n", "supervisor.priority"),
    ("supervisor:\n  command: [x]\n  hang_timeout: soon\n", "not a duration"),
    ("supervisor:\n  command: [x]\n  env: {'1BAD': x}\n", "not a valid environment variable name"),
    ("supervisor:\n  command: [x]\nlearning_rate: 1.0e-4\n", "LLaMA-Factory keys beside it would be ignored"),
])
def test_bad_files_are_rejected_with_reason(env, text, needle):
    spool, _, _ = env
    drop(spool.root, "bad.yaml", text)
    res = run(env)
    assert res.accepted == []
    assert needle in error_of(spool, "bad.yaml")


def test_symlink_directory_and_size_refused(env, tmp_path):
    spool, _, _ = env
    target = tmp_path / "real.yaml"
    target.write_text(command_job(tmp_path, ["true"]))
    os.symlink(target, spool.incoming / "link.yaml")
    (spool.incoming / "adir").mkdir()
    drop(spool.root, "big.yaml", "# " + "x" * 5000 + "\n" + command_job(tmp_path, ["true"]))
    res = run(env)
    assert res.accepted == []
    assert "symbolic link" in error_of(spool, "link.yaml")
    assert "not a regular file" in error_of(spool, "adir")
    assert "limited to 4096 bytes" in error_of(spool, "big.yaml")
    assert target.exists()  # the link target is never touched


def test_young_and_temp_files_are_not_read(env, tmp_path):
    spool, _, store = env
    (spool.incoming / ".half-written.yaml").write_text("supervisor: {comm")
    (spool.incoming / "upload.yaml.part").write_text("supervisor: {comm")
    drop(spool.root, "fresh.yaml", command_job(tmp_path, ["true"]))
    res = run(env, settle_s=60)
    assert res.accepted == [] and res.rejected == [] and res.waiting == ["fresh.yaml"]
    res = run(env, settle_s=60, now=time.time() + 120)
    assert res.accepted == [1] and store.job(1).source == "fresh.yaml"
    assert (spool.incoming / ".half-written.yaml").exists()


def test_crash_between_commit_and_unlink_does_not_duplicate(env, tmp_path, monkeypatch):
    spool, state, store = env
    drop(spool.root, "c.yaml", command_job(tmp_path, ["true"]))
    # The daemon dies right after the commit: the unlink never happens.
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: None)
    assert run(env).accepted == [1]
    claimed = spool.claimed(state.tag)
    assert [p.name.partition(".")[2] for p in claimed.iterdir()] == ["c.yaml"]  # the leftover
    monkeypatch.undo()
    res = run(env)  # the restarted daemon
    assert res.accepted == [] and len(store.jobs()) == 1
    assert list(claimed.iterdir()) == [] and not (spool.incoming / "c.yaml").exists()


def test_same_content_dropped_again_is_a_new_job(env, tmp_path):
    spool, _, store = env
    text = command_job(tmp_path, ["true"])
    drop(spool.root, "d.yaml", text)
    run(env)
    time.sleep(0.01)
    drop(spool.root, "d.yaml", text)
    run(env)
    assert [j.id for j in store.jobs()] == [1, 2]


def test_submit_validates_and_records_workdir(env, tmp_path):
    spool, _state, _store = env
    with pytest.raises(JobFileError) as exc:
        submit(spool, "supervisor:\n  comand: [true]\n", name="x.yaml", cwd=tmp_path)
    assert "did you mean 'command'" in exc.value.report()
    assert list(spool.incoming.iterdir()) == []
    text = "# my job\nsupervisor:\n  command: [python, train.py]  # relative to where I ran submit\n"
    dest = submit(spool, text, name="x.yaml", cwd=tmp_path / "proj")
    written = dest.read_text()
    assert written.startswith("# my job\n") and "# relative to where I ran submit" in written
    assert parse_job_text(written).workdir == tmp_path / "proj"
    assert dest.parent == spool.incoming and not dest.name.startswith(".")


def test_with_workdir_keeps_explicit_workdir_and_handles_flow_style(tmp_path):
    text = "supervisor: {command: [a], workdir: /x}\n"
    assert with_workdir(text, tmp_path) == text
    out = with_workdir("supervisor: {command: [a]}\n", tmp_path)
    assert yaml.safe_load(out)["supervisor"] == {"command": ["a"], "workdir": str(tmp_path)}
    out = with_workdir("model_name_or_path: m\n", tmp_path)
    assert yaml.safe_load(out)["supervisor"]["workdir"] == str(tmp_path)


@pytest.mark.parametrize("key,value,needle", [
    ("hang_timeout", -5, "must not be negative"),
    ("hang_timeout", 0, "greater than 0"),
    ("host_memory_limit", 0, "more than 0 bytes"),
    ("host_memory_limit", True, "not a size"),
    ("host_memory_limit", -1, "more than 0 bytes"),
    ("host_memory_limit", "lots", "not a size"),
])
def test_nonsense_limits_are_refused(tmp_path, key, value, needle):
    text = yaml.safe_dump({"supervisor": {"command": ["true"], key: value}})
    with pytest.raises(JobFileError) as exc:
        parse_job_text(text, submit_dir=tmp_path)
    assert needle in exc.value.report() and f"supervisor.{key}" in exc.value.report()
