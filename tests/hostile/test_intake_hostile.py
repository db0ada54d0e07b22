"""One test per defect a hostile tester found in spool intake (issue 9). Real files,
real SQLite, real processes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from supervisor.core.paths import SpoolPaths
from supervisor.intake import spool as spool_mod
from supervisor.intake.jobspec import JobFileError, parse_job_text
from supervisor.intake.spool import intake
from supervisor.record.store import Store

from .conftest import put, reasons

REPO = Path(__file__).resolve().parents[2]
POLICIES = [REPO / "policies"]


def job(tmp_path: Path, **sup) -> str:
    return yaml.safe_dump({"supervisor": {"command": ["true"], "workdir": str(tmp_path), **sup}})


def run(env, **kw):
    spool, state, store = env
    kw.setdefault("settle_s", 0.0)
    kw.setdefault("max_bytes", 1 << 20)
    return intake(spool, state, store, **kw)


def only_reason(spool: SpoolPaths) -> str:
    got = reasons(spool)
    assert len(got) == 1, got
    return next(iter(got.values()))


# --- 1. numbers -------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value,needle", [
    ("priority", 99999999999999999999999, "less than or equal to 1000"),
    ("priority", -5000, "greater than or equal to -1000"),
    ("nproc_per_node", 10 ** 12, "less than or equal to 1024"),
    ("max_attempts", 10 ** 30, "less than or equal to 100"),
    ("host_memory_limit", "99999999999999999T", "less than or equal to"),
    ("host_memory_limit", "9" * 400 + "G", "too large"),
    ("hang_timeout", 10 ** 30, "less than or equal to"),
    ("hang_timeout", float("inf"), "not a finite duration"),
    ("hang_timeout", float("nan"), "not a finite duration"),
])
def test_out_of_range_numbers_are_rejected_not_crashing_every_tick(env, tmp_path, key, value, needle):
    spool, _, store = env
    put(spool, "n.yaml", job(tmp_path, **{key: value}))
    res = run(env)  # before the fix: OverflowError from SQLite here, on every tick
    assert res.accepted == [] and store.jobs() == []
    text = only_reason(spool)
    assert f"supervisor.{key}" in text and needle in text


def test_integer_beyond_python_digit_limit_is_rejected(env, tmp_path):
    spool, _, _ = env
    put(spool, "d.yaml", f"supervisor:\n  command: [true]\n  priority: {'9' * 5000}\n")
    assert run(env).accepted == []
    assert "4300 digits" in only_reason(spool)


# --- 2. parse limits --------------------------------------------------------------------------

BILLION_LAUGHS = "a: &a [lol,lol,lol,lol,lol,lol,lol,lol,lol]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]\n" for i in range(8))


@pytest.mark.parametrize("text,needle", [
    (BILLION_LAUGHS, "aliases are expanded"),
    ("supervisor: {command: [true]}\nx: " + "[" * 3000 + "]" * 3000 + "\n", "nested more than 64"),
    ("supervisor: {command: [true]}\nx: " + "{a: " * 1000 + "1" + "}" * 1000 + "\n", "nested more than 64"),
    ("supervisor: {command: [true]}\n" + "".join(f"k{i}: &k{i} v\n" for i in range(101))
     + "refs: [" + ",".join(f"*k{i}" for i in range(101)) + "]\n", "more than 100 YAML aliases"),
    ("a: &a {b: *a}\n", "recursive"),
])
def test_parse_limits_reject_bombs_quickly(env, text, needle):
    spool, _, _ = env
    assert len(text) < 7000
    put(spool, "bomb.yaml", text)
    t0 = time.monotonic()
    res = run(env)
    assert time.monotonic() - t0 < 5.0  # before: RecursionError, or 75 s and 6 GB for a bomb
    assert res.accepted == [] and needle in only_reason(spool)


def test_billion_laughs_through_submit_function_is_refused_fast(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(JobFileError) as err:
        parse_job_text(BILLION_LAUGHS, submit_dir=tmp_path)
    assert time.monotonic() - t0 < 5.0 and "aliases are expanded" in err.value.report()


def test_a_few_aliases_are_still_fine(tmp_path):
    spec = parse_job_text(f"supervisor:\n  command: &c [echo, hi]\n  workdir: {tmp_path}\n  notify:\n"
                          "    - {command: *c}\n", submit_dir=tmp_path)
    assert spec.sup.notify[0].command == ["echo", "hi"]


# --- 3. names ---------------------------------------------------------------------------------

def test_non_utf8_name_is_handled(env, tmp_path):
    spool, _, store = env
    put(spool, b"bad-\xff\xfe.yaml", "supervisor: {comand: [true]}\n")
    put(spool, b"good-\xff.yaml", job(tmp_path))
    res = run(env)  # before the fix: sqlite refuses the surrogate name, or rejected/ cannot be named
    assert len(res.accepted) == 1 and store.job(res.accepted[0]).source == "good-\\xff.yaml"
    (name, text), = reasons(spool).items()
    assert name.isascii() and "bad-\\xff\\xfe.yaml" in text and "unknown key" in text
    assert os.listdir(spool.incoming) == []


@pytest.mark.parametrize("length", [232, 250, 255])
def test_long_invalid_name_gets_a_bounded_rejected_name(env, length):
    spool, _, _ = env
    name = "j" * (length - 5) + ".yaml"
    put(spool, name, "supervisor: {comand: [true]}\n")
    res = run(env)
    assert res.rejected and os.listdir(spool.incoming) == []
    (short, text), = reasons(spool).items()
    assert len((short + ".error.txt").encode()) <= 200
    assert name in text and "unknown key" in text
    assert (spool.rejected / short).exists()


def test_names_with_newlines_and_markup_are_escaped(env):
    spool, _, _ = env
    put(spool, "a\nb [red]x.yaml", "supervisor: {comand: [true]}\n")
    run(env)
    (short, text), = reasons(spool).items()
    assert "\n" not in short and "a\\x0ab [red]x.yaml" in text


# --- 4. future mtime ----------------------------------------------------------------------------

def test_future_mtime_is_taken_after_two_unchanged_passes(env, tmp_path):
    spool, _, store = env
    p = put(spool, "future.yaml", job(tmp_path))
    ahead = time.time() + 86400
    os.utime(p, (ahead, ahead))
    assert run(env, settle_s=2.0).waiting == ["future.yaml"]  # first pass: noted
    res = run(env, settle_s=2.0)  # before the fix: waiting forever, silently
    assert len(res.accepted) == 1 and store.job(res.accepted[0]).source == "future.yaml"


def test_future_mtime_file_still_being_written_waits(env, tmp_path):
    spool, _, _ = env
    p = put(spool, "growing.yaml", job(tmp_path))
    ahead = time.time() + 86400
    os.utime(p, (ahead, ahead))
    assert run(env, settle_s=2.0).waiting == ["growing.yaml"]
    with open(p, "a") as f:
        f.write("# more\n")
    os.utime(p, (ahead + 5, ahead + 5))
    assert run(env, settle_s=2.0).waiting == ["growing.yaml"]  # it changed: not settled yet
    assert len(run(env, settle_s=2.0).accepted) == 1


# --- 5. two daemons sharing one spool --------------------------------------------------------

RACER = r"""
import sys, time
from pathlib import Path
from supervisor.core.paths import SpoolPaths, StatePaths
from supervisor.intake.spool import intake
from supervisor.record.store import Store
spool, state = SpoolPaths(Path(sys.argv[1])), StatePaths(Path(sys.argv[2]))
state.ensure()
store = Store(state.db)
go = Path(sys.argv[3])
while not go.exists():
    time.sleep(0.001)
idle = 0
while idle < 20:
    res = intake(spool, state, store, settle_s=0.0, max_bytes=1 << 20, max_files=7)
    idle = 0 if (res.accepted or res.rejected) else idle + 1
"""


def test_two_daemons_sharing_a_spool_take_each_file_once(tmp_path):
    spool = SpoolPaths(tmp_path / "spool")
    spool.ensure()
    for i in range(200):
        put(spool, f"j{i:03}.yaml", job(tmp_path, name=f"j{i:03}"))
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(spool.root), str(tmp_path / f"state{n}"),
                               str(go)], cwd=REPO) for n in (1, 2)]
    time.sleep(1.0)
    go.touch()
    for p in procs:
        assert p.wait(timeout=120) == 0
    names = []
    for n in (1, 2):
        store = Store(tmp_path / f"state{n}" / "state.sqlite3")
        names += [j.name for j in store.jobs()]
        store.close()
    assert sorted(names) == [f"j{i:03}" for i in range(200)]  # before the fix: some twice
    assert os.listdir(spool.incoming) == []


def test_claimed_files_of_a_crashed_daemon_are_finished_on_restart(env, tmp_path):
    spool, state, store = env
    claimed = spool.claimed(state.tag)
    claimed.mkdir(parents=True)
    (claimed / "123.left.yaml").write_text(job(tmp_path, name="left"))
    res = run(env)
    assert [store.job(i).name for i in res.accepted] == ["left"] and list(claimed.iterdir()) == []


# --- 6. policy ----------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["/etc/shadow", "../../etc/shadow", "a/b", "..", "x" * 100, ""])
def test_policy_is_a_name_never_a_path(tmp_path, policy):
    with pytest.raises(JobFileError) as err:
        parse_job_text(job(tmp_path, policy=policy), submit_dir=tmp_path)
    assert "supervisor.policy" in err.value.report() and "not a policy name" in err.value.report()


def test_unknown_policy_refused_at_intake(env, tmp_path):
    spool, _, store = env
    put(spool, "p.yaml", job(tmp_path, policy="conservativ"))
    put(spool, "ok.yaml", job(tmp_path, policy="conservative"))
    res = run(env, policy_dirs=POLICIES)
    assert [store.job(i).source for i in res.accepted] == ["ok.yaml"]
    text = reasons(spool)["p.yaml"]
    assert "no policy 'conservativ'" in text and "did you mean 'conservative'" in text


def test_a_policy_parse_error_never_quotes_the_file(tmp_path):
    from supervisor.judge.policy.schema import PolicyError, load_policy_by_name

    (tmp_path / "leaky.yaml").write_text("name: x\nsecret: [TOKEN-abc123\n")
    with pytest.raises(PolicyError) as err:
        load_policy_by_name("leaky", search_dirs=[tmp_path])
    assert "TOKEN" not in str(err.value) and "does not parse" in str(err.value)
    with pytest.raises(PolicyError):
        load_policy_by_name("/etc/passwd", search_dirs=[tmp_path])


# --- 7. gpus ------------------------------------------------------------------------------------

@pytest.mark.parametrize("gpus,needle", [
    ([], "empty list, which is not 'no GPUs'"),
    ([0, 0], "more than once"),
    ([1, -1], "greater than or equal to 0"),
    ([5000], "less than 1024"),
])
def test_bad_gpu_lists_are_refused(env, tmp_path, gpus, needle):
    spool, _, store = env
    put(spool, "g.yaml", job(tmp_path, gpus=gpus))
    assert run(env).accepted == [] and store.jobs() == []
    text = only_reason(spool)
    assert "supervisor.gpus" in text and needle in text


# --- 8. modes -----------------------------------------------------------------------------------

def test_job_file_with_tokens_is_private(env, tmp_path):
    spool, state, _ = env
    put(spool, "s.yaml", job(tmp_path, env={"HF_TOKEN": "hf_secret"}))
    (job_id,) = run(env).accepted
    assert stat.S_IMODE(state.job(job_id).job_file.stat().st_mode) == 0o600


def test_submit_writes_the_file_private_to_its_submitter(env, tmp_path):
    """The owner is the submitter; nobody else (a member of the same submit group included) reads it:
    the daemon runs as root on a shared box (issue 17 case 3)."""
    from supervisor.intake.spool import submit

    spool, _, _ = env
    dest = submit(spool, job(tmp_path, env={"HF_TOKEN": "x"}), name="s.yaml", cwd=tmp_path)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o600 and dest.stat().st_uid == os.geteuid()


def test_atomic_writes_are_private_by_default(tmp_path):
    from supervisor.run.fsutil import atomic_write_json

    atomic_write_json(tmp_path / "x.json", {"token": "t"})
    assert stat.S_IMODE((tmp_path / "x.json").stat().st_mode) == 0o600


# --- 10. rejected/ is pruned ----------------------------------------------------------------------

def test_rejected_keeps_the_newest_n_and_drops_old_ones(env):
    spool, _, _ = env
    now = time.time()
    for i in range(12):
        (spool.rejected / f"r{i:02}.yaml").write_text("x")
        err = spool.rejected / f"r{i:02}.yaml.error.txt"
        err.write_text("why")
        os.utime(err, (now - 1000 + i, now - 1000 + i))
    old = spool.rejected / "ancient.yaml.error.txt"
    old.write_text("why")
    os.utime(old, (now - 40 * 86400, now - 40 * 86400))
    assert spool_mod.prune_rejected(spool, keep=10, max_age_s=30 * 86400, now=now) == 3
    left = sorted(p.name for p in spool.rejected.iterdir())
    assert left == sorted([f"r{i:02}.yaml" for i in range(2, 12)] + [f"r{i:02}.yaml.error.txt" for i in range(2, 12)])


def test_intake_prunes_rejected(env):
    spool, _, _ = env
    for i in range(8):
        put(spool, f"bad{i}.yaml", "- a list\n")
    res = run(env, keep_rejected=3)
    assert len(res.rejected) == 8 and res.pruned == 5 and len(reasons(spool)) == 3


# --- 11. bounded work per call --------------------------------------------------------------------

def test_intake_works_within_a_budget_and_goes_on_next_call(env, tmp_path):
    spool, _, store = env
    for i in range(25):
        put(spool, f"j{i:02}.yaml", job(tmp_path))
    res = run(env, max_files=10)
    assert len(res.accepted) == 10 and res.deferred == 15
    run(env, max_files=10)
    run(env, max_files=10)
    assert len(store.jobs()) == 25 and os.listdir(spool.incoming) == []


# --- other odd things in incoming/ ----------------------------------------------------------------

def test_fifo_socket_and_folder_are_rejected_without_blocking(env, tmp_path):
    spool, _, _ = env
    os.mkfifo(spool.incoming / "pipe.yaml")
    (spool.incoming / "folder.yaml").mkdir()
    os.symlink("/etc/shadow", spool.incoming / "shadow.yaml")
    res = run(env)
    assert res.accepted == [] and len(res.rejected) == 3
    got = reasons(spool)
    assert "a FIFO" in got["pipe.yaml"] and "a folder" in got["folder.yaml"]
    assert "symbolic link" in got["shadow.yaml"] and "root:" not in json.dumps(got)


def test_nul_bytes_and_garbage_are_rejected(env):
    spool, _, _ = env
    put(spool, "nul.yaml", b"supervisor: {command: [true]}\n\x00\n")
    put(spool, "bin.yaml", os.urandom(300) + b"\xff")
    res = run(env)
    assert res.accepted == [] and len(res.rejected) == 2


def test_huge_integer_in_training_keys_is_rejected(env):
    """Found by bench_spool_fuzz: a 40-digit batch size passed as a LLaMA-Factory job."""
    spool, _, store = env
    put(spool, "lf.yaml", "model_name_or_path: m\nstage: sft\nper_device_train_batch_size: " + "9" * 40 + "\n")
    assert run(env).accepted == [] and store.jobs() == []
    text = only_reason(spool)
    assert "line 3: per_device_train_batch_size" in text and "64 bits" in text


@pytest.mark.parametrize("text,needle", [
    ("model_name_or_path: m\n" + "".join(f"kq{i}zz: {i}\n" for i in range(5000)), "top-level keys"),
    ("model_name_or_path: m\ndeepspeed:\n  zero_optimization:\n" + "".join(f"    kq{i}zz: {i}\n" for i in range(5000)),
     "more than 1000 mapping keys"),
])
def test_thousands_of_unknown_keys_are_refused_quickly(env, text, needle):
    """Found while fuzzing: every unknown key costs a nearest-key search; 45,000 of them
    (a 740 KB file) held intake for 170 s, 5,000 for 13 s."""
    spool, _, _ = env
    put(spool, "keys.yaml", text)
    t0 = time.monotonic()
    assert run(env).accepted == []
    assert time.monotonic() - t0 < 5.0 and needle in only_reason(spool)


def test_atomic_write_of_a_250_byte_name(tmp_path):
    """Its temp name (dot + name + random + .tmp) used to exceed the 255-byte limit."""
    from supervisor.run.fsutil import atomic_write_text

    atomic_write_text(tmp_path / ("n" * 250), "x")
    assert (tmp_path / ("n" * 250)).read_text() == "x" and len(os.listdir(tmp_path)) == 1
