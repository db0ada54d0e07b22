"""Untrusted text through the real CLI: `status`/`show` print it verbatim (never as rich
markup), and `submit` refuses hostile files with exit 2 and a reason, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from supervisor.core.states import JobState
from supervisor.record.store import Store

REPO = Path(__file__).resolve().parents[2]
NASTY = ["[/bold]", "[rank1]", "[red]x", "[cuda, PyTorch caching allocator]", "[link=file:///etc]y[/link]",
         "[rank1]:", "[/x/*.parquet]", "[bold]", "[/]", "[link=http://h/p]"]


def cli(tmp_path: Path, *args: str, columns: int = 80, cwd: Path | None = None, timeout: float = 60):
    conf = tmp_path / "config.yaml"
    if not conf.exists():
        conf.write_text("poll_interval: 1\n")
    cmd = [sys.executable, "-m", "supervisor.cli", args[0], "--state-dir", str(tmp_path / "state"),
           "--spool-dir", str(tmp_path / "spool"), "--config", str(conf), *args[1:]]
    env = {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd or REPO, timeout=timeout, env=env, check=False)


def bare(tmp_path: Path, *args: str, columns: int = 80):
    """A command that takes no state folder (explain, plan)."""
    env = {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60, env=env, check=False)


@pytest.fixture
def nasty_state(tmp_path):
    store = Store(tmp_path / "state" / "state.sqlite3")
    job_id = store.add_job(name="[red]x", kind="command", priority=0, policy=None, workdir="/w[/i]",
                           source="a.yaml", spool_key=None)
    store.transition(job_id, JobState.RUNNING, "started " + " ".join(NASTY))
    store.add_attempt(job_id, 1, remedy="[bold]r", diagnosis=json.dumps({
        "category": "gpu_oom", "summary": "OOM in [cuda, PyTorch caching allocator] [/bold]",
        "evidence": [{"line_no": 7, "text": "[rank1]: torch.OutOfMemoryError: [/red] boom"}],
        "numbers": {}}), decision=json.dumps({
        "kind": "escalate", "rung": "micro_batch", "reason": "because [rank1] said [/]",
        "changes": [{"target": "yaml", "key": "k", "old": 2, "new": 1, "why": "[/why]"}]}))
    store.transition(job_id, JobState.FAILED, "gave up: " + " ".join(NASTY))
    store.event(job_id, "note", "event text " + " ".join(NASTY) + " \x1b]0;pwned\x07\x1b[2J")
    store.close()
    return job_id


@pytest.mark.parametrize("columns", [80, 200])
def test_status_prints_brackets_verbatim(tmp_path, nasty_state, columns):
    res = cli(tmp_path, "status", columns=columns)
    assert res.returncode == 0, res.stderr  # before the fix: rich MarkupError on '[/bold]'
    flat = " ".join(res.stdout.split())
    assert "[red]x" in flat
    for s in NASTY:
        assert s in flat, (s, res.stdout)


def test_show_prints_brackets_verbatim(tmp_path, nasty_state):
    res = cli(tmp_path, "show", str(nasty_state), columns=250)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "\x1b" not in out and "\\x1b]0;pwned" in out  # a log's ESC never reaches the terminal
    for s in [*NASTY, "/w[/i]", "[rank1]: torch.OutOfMemoryError: [/red] boom", "because [rank1] said [/]",
              "[bold]r", "OOM in [cuda, PyTorch caching allocator] [/bold]", "[/why]"]:
        assert s in out, (s, out)


def test_watch_prints_brackets_verbatim(tmp_path, nasty_state):
    """watch draws the job and its log tail with rich's Live: the record's text and the log's
    bracketed lines are shown as written (the job has ended: one frame, then exit 1)."""
    log = tmp_path / "state" / "jobs" / str(nasty_state) / "attempt-1" / "output.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("step 1\n[rank1]: loading [/x/*.parquet] [bold] [/] [link=http://h/p]y\n")
    res = cli(tmp_path, "watch", str(nasty_state), columns=250)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "[red]x" in res.stdout and "gave up: [/bold] [rank1]" in res.stdout, res.stdout
    assert "[rank1]: loading [/x/*.parquet] [bold] [/] [link=http://h/p]y" in res.stdout, res.stdout


def test_explain_prints_brackets_and_long_lines_verbatim(tmp_path):
    text = " ".join(NASTY)
    log = tmp_path / "crash.log"
    log.write_text(f"reading {text}\n[rank1]: Traceback (most recent call last):\n"
                   f'[rank1]:   File "train.py", line 3, in <module>\n'
                   f"[rank1]: ValueError: cannot read [/x/*.parquet] {text} " + "y" * 5000 + "\n")
    res = bare(tmp_path, "explain", str(log))
    assert res.returncode == 0, res.stderr
    assert "[rank1]: ValueError: cannot read [/x/*.parquet] [/bold] [rank1] [red]x" in res.stdout, res.stdout
    assert "[link=file:///etc]y[/link]" in res.stdout


def test_plan_prints_brackets_in_names_and_paths_verbatim(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "supervisor": {"name": "[rank1]: [bold]night[/] [link=http://h/p]y"},
        "model_name_or_path": "/models/[/x/*.parquet]", "stage": "sft", "do_train": True,
        "finetuning_type": "lora", "dataset": "alpaca_en_demo", "template": "llama3",
        "output_dir": str(tmp_path / "out[/]"), "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2}))
    res = bare(tmp_path, "plan", str(job))
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert res.stdout.startswith("[rank1]: [bold]night[/] [link=http://h/p]y: policy"), res.stdout
    assert "/models/[/x/*.parquet] does not exist here" in res.stdout, res.stdout


# --- submit ---------------------------------------------------------------------------------

BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]\n" for i in range(8))


@pytest.mark.parametrize("text,needle", [
    (BOMB, "aliases are expanded"),
    ("x: " + "[" * 3000 + "]" * 3000 + "\n", "nested more than 64"),
    ("supervisor: {command: [echo], priority: 99999999999999999999999}\n", "supervisor.priority"),
    ("supervisor: {command: [echo], policy: /etc/shadow}\n", "not a policy name"),
    ("supervisor: {command: [echo], policy: nosuchpolicy}\n", "no policy 'nosuchpolicy'"),
    ("supervisor: {command: [echo], gpus: []}\n", "supervisor.gpus"),
    ("supervisor: {command: [echo], priority: " + "9" * 5000 + "}\n", "4300 digits"),
])
def test_submit_refuses_hostile_files_with_exit_2(tmp_path, text, needle):
    job = tmp_path / "job.yaml"
    job.write_text(text)
    t0 = time.monotonic()
    res = cli(tmp_path, "submit", str(job), timeout=30)
    assert time.monotonic() - t0 < 20
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert needle in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "spool" / "incoming").exists() or os.listdir(tmp_path / "spool" / "incoming") == []


def test_submit_known_policy_is_accepted(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("supervisor: {command: [echo], policy: conservative}\n")
    res = cli(tmp_path, "submit", str(job))
    assert res.returncode == 0, res.stderr
    assert len(os.listdir(tmp_path / "spool" / "incoming")) == 1


def test_submit_into_an_unwritable_spool_says_which_folder(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("supervisor: {command: [echo]}\n")
    (tmp_path / "spool").mkdir()
    (tmp_path / "spool" / "incoming").write_text("not a folder")  # root ignores modes: break it by type
    res = cli(tmp_path, "submit", str(job))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert str(tmp_path / "spool" / "incoming") in res.stderr and "cannot write" in res.stderr


def test_submit_of_fifo_and_garbage_exit_2(tmp_path):
    os.mkfifo(tmp_path / "pipe.yaml")
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe" + os.urandom(64))
    for name in ("pipe.yaml", "bin.yaml", "missing.yaml"):
        res = cli(tmp_path, "submit", str(tmp_path / name), timeout=30)
        assert res.returncode == 2 and "Traceback" not in res.stderr and res.stderr.strip(), name


def test_submit_with_a_non_utf8_and_long_name(tmp_path):
    raw = os.path.join(os.fsencode(tmp_path), b"j\xff" + b"k" * 240 + b".yaml")
    with open(raw, "wb") as f:
        f.write(b"supervisor: {command: [echo]}\n")
    res = subprocess.run([sys.executable, "-m", "supervisor.cli", "submit", "--state-dir", str(tmp_path / "state"),
                          "--spool-dir", str(tmp_path / "spool"), "--config", "/dev/null", raw],
                         capture_output=True, cwd=REPO, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    (dest,) = os.listdir(tmp_path / "spool" / "incoming")
    assert dest.isascii() and len(dest.encode()) < 120
    assert yaml.safe_load((tmp_path / "spool" / "incoming" / dest).read_text())["supervisor"]["command"] == ["echo"]


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs, filled up (needs root, as CI is)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (mnt / "spool" / "incoming").mkdir(parents=True)
        (mnt / "spool" / "rejected").mkdir()
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def test_submit_onto_a_full_spool_disk_says_so(tmp_path, full_disk):
    job = tmp_path / "job.yaml"
    job.write_text("supervisor: {command: [echo]}\n" + "# padding\n" * 2000)
    conf = tmp_path / "config.yaml"
    conf.write_text("poll_interval: 1\n")
    res = subprocess.run([sys.executable, "-m", "supervisor.cli", "submit", "--state-dir", str(tmp_path / "state"),
                          "--spool-dir", str(full_disk / "spool"), "--config", str(conf), str(job)],
                         capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "the disk is full" in res.stderr and str(full_disk / "spool" / "incoming") in res.stderr
    assert list(os.listdir(full_disk / "spool" / "incoming")) == []  # no temp file left behind


def test_intake_on_a_full_spool_disk_still_moves_bad_files_aside(tmp_path, full_disk):
    from supervisor.core.paths import SpoolPaths, StatePaths
    from supervisor.intake.spool import intake

    spool = SpoolPaths(full_disk / "spool")
    os.rename(full_disk / "filler", full_disk / "spool" / "incoming" / "bad.yaml")  # garbage, fills the disk
    state = StatePaths(tmp_path / "state")
    store = Store(state.db)
    res = intake(spool, state, store, settle_s=0.0, max_bytes=1 << 20)
    store.close()
    assert res.accepted == [] and os.listdir(spool.incoming) == []
    assert (spool.rejected / "bad.yaml").exists()
