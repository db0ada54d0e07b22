"""Spool fuzzing: hypothesis-made hostile files through the real `intake()` and the real
`submit` command. Nothing may escape as an exception; every bad file is rejected with
an .error.txt that names a problem; every good one is accepted exactly once."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor import cli
from supervisor.core.paths import SpoolPaths, StatePaths
from supervisor.intake.spool import intake
from supervisor.record.store import Store

REPO = Path(__file__).resolve().parents[2]
BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]\n" for i in range(8))

# Contents that must be refused, each for a reason the .error.txt has to name.
bad_contents = st.one_of(
    st.binary(min_size=0, max_size=300).map(lambda b: b + b"\xff\x00"),  # garbage, never UTF-8
    st.integers(65, 3000).map(lambda n: ("x: " + "[" * n + "]" * n + "\n").encode()),
    st.integers(65, 1000).map(lambda n: ("x: " + "{a: " * n + "1" + "}" * n + "\n").encode()),
    st.just(BOMB.encode()),
    st.integers(9, 12).map(lambda n: ("a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
        f"l{i}: &l{i} [" + ",".join([f"*{'a' if i == 0 else f'l{i - 1}'}"] * n) + "]\n"
        for i in range(6))).encode()),
    st.sampled_from(["priority", "max_attempts", "nproc_per_node", "hang_timeout", "host_memory_limit"]).flatmap(
        lambda k: st.one_of(st.integers(10 ** 19, 10 ** 40), st.integers(-(10 ** 40), -(10 ** 19))).map(
            lambda v: f"supervisor:\n  command: [echo]\n  {k}: {v}\n".encode())),
    st.integers(4301, 6000).map(lambda n: f"supervisor:\n  command: [echo]\n  priority: {'9' * n}\n".encode()),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=3, max_size=20).filter(
        lambda k: k not in ("name", "policy", "workdir", "gpus", "priority", "env", "notify", "command",
                            "launcher")).map(lambda k: f"supervisor:\n  command: [echo]\n  {k}: 1\n".encode()),
    st.sampled_from([
        "supervisor: {command: [echo], gpus: []}\n", "supervisor: {command: [echo], gpus: [0, 0]}\n",
        "supervisor: {command: [echo], gpus: [-1]}\n", "supervisor: {command: [echo], policy: /etc/shadow}\n",
        "supervisor: {command: [echo], policy: ../x}\n", "supervisor: {command: [echo], priority: high}\n",
        "supervisor: {command: echo}\n", "supervisor: {command: [1, 2]}\n", "supervisor: [a]\n",
        "supervisor: {command: [echo], env: [A]}\n", "supervisor: {command: [echo], hang_timeout: .nan}\n",
        "- a\n- b\n", "", "'just a string'\n", "a: &a {b: *a}\n", "supervisor: {command: [echo]}\nlr: 1\n",
        "? [a, b]\n: c\n", "1: 2\n", "supervisor: {command: [echo], name: ''}\n",
        "supervisor: {command: [echo], max_attempts: 0}\n", "when: 2024-13-45\n",
    ]).map(str.encode),
)

safe_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=30).map(
    lambda s: (s + ".yaml").encode())
odd_names = st.one_of(
    st.binary(min_size=1, max_size=40).map(lambda b: b.replace(b"/", b"_").replace(b"\x00", b"_").lstrip(b".")
                                            or b"x").map(lambda b: b + b"\xff.yaml"),
    st.integers(200, 250).map(lambda n: b"L" * n + b".yaml"),
    st.sampled_from([b"a\nb.yaml", b"[red]x.yaml", b"a[rank1]b.yaml", b"sp ace.yaml", b"\xe2\x80\xae.yaml", b"-rf.yaml"]),
)
kinds = st.sampled_from(["file", "file", "file", "symlink", "fifo", "dir"])


@st.composite
def hostile_spool(draw):
    files = {}
    for i in range(draw(st.integers(1, 6))):
        name = draw(st.one_of(safe_names, odd_names))
        name = b"%d-" % i + name  # distinct names
        files[name[:255]] = (draw(kinds), draw(bad_contents), draw(st.booleans()))
    good = draw(st.integers(0, 3))
    return files, good


def _put(incoming: bytes, name: bytes, kind: str, data: bytes, future: bool, target: bytes) -> None:
    path = os.path.join(incoming, name)
    if kind == "symlink":
        os.symlink(target, path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        os.mkdir(path)
    else:
        with open(path, "wb") as f:
            f.write(data)
    if future and kind in ("file", "dir"):
        t = time.time() + 3600
        os.utime(path, (t, t))


def good_job(workdir: Path, n: int) -> bytes:
    return yaml.safe_dump({"supervisor": {"command": ["echo", str(n)], "name": f"good-{n}",
                                          "workdir": str(workdir)}}).encode()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(hostile_spool())
def test_intake_survives_hostile_spools(case):
    files, good = case
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        spool, state = SpoolPaths(tmp_path / "spool"), StatePaths(tmp_path / "state")
        spool.ensure()
        state.ensure()
        inc = os.fsencode(spool.incoming)
        secret = tmp_path / "secret.yaml"
        secret.write_bytes(good_job(tmp_path, 99))
        for name, (kind, data, future) in files.items():
            _put(inc, name, kind, data, future, os.fsencode(secret))
        for n in range(good):
            _put(inc, b"good-%d.yaml" % n, "file", good_job(tmp_path, n), n == 1, b"")
        store = Store(state.db)
        try:
            for _ in range(4):  # future mtimes need two passes
                intake(spool, state, store, settle_s=0.0, max_bytes=64 * 1024, max_files=5)
            names = sorted(j.name for j in store.jobs())
        finally:
            store.close()
        assert names == sorted(f"good-{n}" for n in range(good))  # good ones once, bad ones never
        assert os.listdir(spool.incoming) == []
        assert os.listdir(spool.claimed(state.tag)) == []
        errors = [p for p in spool.rejected.iterdir() if p.name.endswith(".error.txt")]
        assert len(errors) == len(files)
        for p in errors:
            text = p.read_text()
            assert "was refused" in text and "  - " in text  # at least one problem, named
            assert len(p.name.encode()) <= 200 and p.name.isascii()
        assert secret.read_bytes() == good_job(tmp_path, 99)  # a link's target is never touched


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(bad_contents, st.one_of(safe_names, odd_names))
def test_submit_refuses_hostile_files(data, name):
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        path = os.path.join(os.fsencode(tmp_path), name[:250])
        with open(path, "wb") as f:
            f.write(data)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(["submit", "--state-dir", str(tmp_path / "state"), "--spool-dir",
                               str(tmp_path / "spool"), "--config", "/dev/null", os.fsdecode(path)])
            except SystemExit as exc:  # argparse and _config exit this way
                rc = exc.code
        assert rc == 2, (rc, err.getvalue())
        assert err.getvalue().strip() and "Traceback" not in err.getvalue()
        incoming = tmp_path / "spool" / "incoming"
        assert not incoming.exists() or os.listdir(incoming) == []
