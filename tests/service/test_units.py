"""The shipped systemd files, checked by systemd's own tools (PID 1 here is not systemd, so the
unit cannot be started; what systemd-analyze, systemd-sysusers and systemd-tmpfiles accept and
compute is checked for real, in a scratch root laid out as the README installs it)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "systemd"

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None and os.environ.get("CI") != "true",
                                reason="systemd-analyze is not installed")


def _run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False,
                          env={**os.environ, "SYSTEMD_COLORS": "0", **(env or {})})


def _exe(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)


def system_root(tmp_path: Path, *, infiniband: bool = False) -> Path:
    """/etc/systemd/system with the unit and its drop-ins, the distribution's units, the binary."""
    root = tmp_path / "root"
    etc = root / "etc/systemd/system"
    etc.mkdir(parents=True)
    shutil.copy(UNITS / "oom-supervisor.service", etc)
    shutil.copytree(UNITS / "oom-supervisor.service.d", etc / "oom-supervisor.service.d")
    if infiniband:
        shutil.copy(UNITS / "oom-supervisor.service.d/infiniband.conf.example",
                    etc / "oom-supervisor.service.d/infiniband.conf")
    (root / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    _exe(root / "opt/oom-supervisor/.venv/bin/oom-supervisor")
    return root


def exposure(out: str) -> float:
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out)
    assert m, out
    return float(m.group(1))


@pytest.mark.parametrize("infiniband", [False, True], ids=["plain", "infiniband-drop-in"])
def test_system_unit_verifies_without_a_word(tmp_path, infiniband):
    root = system_root(tmp_path, infiniband=infiniband)
    res = _run("systemd-analyze", "verify", f"--root={root}", "oom-supervisor.service")
    # verify exits 0 on unknown keys and only warns: any output at all is a failure.
    assert (res.stdout + res.stderr) == "" and res.returncode == 0, res.stdout + res.stderr


def test_verify_would_catch_a_typo(tmp_path):
    """The check above is not vacuous: a misspelt key in the admin's drop-in is reported."""
    root = system_root(tmp_path)
    with open(root / "etc/systemd/system/oom-supervisor.service.d/paths.conf", "a") as f:
        f.write("ReadWritePath=/srv/x\n")
    res = _run("systemd-analyze", "verify", f"--root={root}", "oom-supervisor.service")
    assert "Unknown key" in res.stderr and "ReadWritePath" in res.stderr


def test_system_unit_exposure_is_ok(tmp_path):
    """Root with five capabilities (each job runs as its submitter): 3.2 measured, 3.5 allowed."""
    root = system_root(tmp_path, infiniband=True)
    for args in (["--offline=true", str(UNITS / "oom-supervisor.service")],
                 ["--offline=true", f"--root={root}", "oom-supervisor.service"]):
        res = _run("systemd-analyze", "security", *args)
        score = exposure(res.stdout)
        assert score <= 3.5, res.stdout
        assert "Service runs as root user" in res.stdout, "the figure is the one of the real, root, unit"


def test_user_unit_exposure_is_the_one_the_readme_gives(tmp_path):
    res = _run("systemd-analyze", "security", "--offline=true", str(UNITS / "user/oom-supervisor.service"))
    score = exposure(res.stdout)
    assert f"**{score}" in (REPO / "README.md").read_text(), f"README must say the user unit's exposure {score}"


def test_system_unit_keeps_what_trainings_and_adoption_need():
    text = (UNITS / "oom-supervisor.service").read_text()
    keys = dict(re.findall(r"^(\w+)=(.*)$", text, re.MULTILINE))
    assert keys["Type"] == "notify" and keys["NotifyAccess"] == "main" and keys["WatchdogSec"]
    assert keys["KillMode"] == "process", "a daemon crash must not kill the trainings"
    assert keys["Delegate"] == "yes" and keys["ProtectControlGroups"] == "no"
    assert int(keys["TimeoutStopSec"]) > 30, "longer than the default stop_grace"
    assert set(keys["RestrictAddressFamilies"].split()) == {"AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK"}
    caps = set(keys["CapabilityBoundingSet"].split())
    assert caps == {"CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_DAC_READ_SEARCH", "CAP_CHOWN"}, caps
    assert all(c in text.split("CapabilityBoundingSet=")[0] for c in caps), "each capability says why"
    assert "User" not in keys and "--mode system" in keys["ExecStart"] and keys["UMask"] == "0077"
    assert keys["NoNewPrivileges"] == "yes" and keys["AmbientCapabilities"] == ""
    assert keys["ProtectProc"] == "default", "hidepid would hide the jobs (other users' processes) from the daemon"
    assert keys["RuntimeDirectory"] == "oom-supervisor" and keys["EnvironmentFile"].startswith("-/etc/oom-supervisor/")
    assert keys["Documentation"] == "file:///usr/share/doc/oom-supervisor/README.md"
    assert "install -D -m 0644 README.md /usr/share/doc/oom-supervisor/README.md" in (REPO / "README.md").read_text()
    assert keys["SystemCallErrorNumber"] == "EPERM", "a filtered call must not SIGSYS a training"
    allowed = re.findall(r"^DeviceAllow=(\S+)", text, re.MULTILINE)
    assert "char-kfd" in allowed and "char-drm" in allowed and "char-nvidia-frontend" in allowed
    assert not re.search(r"^ReadWritePaths=", text, re.MULTILINE), "writable paths live in paths.conf only"
    assert "ReadWritePaths" in (UNITS / "oom-supervisor.service.d/paths.conf").read_text()


def test_user_unit_verifies_without_a_word(tmp_path):
    home = tmp_path / "home"
    _exe(home / ".local/bin/oom-supervisor")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    res = _run("systemd-analyze", "--user", "verify", str(UNITS / "user/oom-supervisor.service"),
               env={"HOME": str(home), "XDG_RUNTIME_DIR": str(run)})
    assert (res.stdout + res.stderr) == "" and res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="systemd-tmpfiles chowns to the new user: needs root")
def test_sysusers_and_tmpfiles_make_the_folders_with_their_modes(tmp_path):
    root = tmp_path / "root"
    (root / "etc/sysusers.d").mkdir(parents=True)
    (root / "etc/tmpfiles.d").mkdir(parents=True)
    shutil.copy(UNITS / "oom-supervisor.sysusers.conf", root / "etc/sysusers.d/oom-supervisor.conf")
    shutil.copy(UNITS / "oom-supervisor.tmpfiles.conf", root / "etc/tmpfiles.d/oom-supervisor.conf")
    res = _run("systemd-sysusers", f"--root={root}")
    assert res.returncode == 0, res.stderr
    passwd = (root / "etc/passwd").read_text() if (root / "etc/passwd").exists() else ""
    groups = {ln.split(":")[0]: ln.split(":") for ln in (root / "etc/group").read_text().splitlines()}
    assert "oom-supervisor" not in passwd, "no service user: the daemon is root, each job its submitter"
    assert {"oom-supervisor-submit", "oom-supervisor-admin"} <= set(groups)
    env = root / "etc/oom-supervisor/supervisor.env"
    env.parent.mkdir(parents=True)
    env.write_text("OOM_SUPERVISOR_WEBHOOK_URL=https://hooks.example/T000/secret\n")
    env.chmod(0o644)  # as an editor or `cp` may leave it
    res = _run("systemd-tmpfiles", f"--root={root}", "--create")
    assert res.returncode == 0, res.stderr
    submit_gid = int(groups["oom-supervisor-submit"][2])

    def mode(rel: str) -> tuple[int, int, int]:
        st = (root / rel).stat()
        return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid

    assert mode("var/lib/oom-supervisor") == (0o700, 0, 0)
    assert mode("var/lib/oom-supervisor-attempts") == (0o711, 0, 0)
    assert mode("var/spool/oom-supervisor/incoming") == (0o1730, 0, submit_gid)
    assert mode("var/spool/oom-supervisor/rejected") == (0o711, 0, 0)
    assert mode("etc/oom-supervisor/supervisor.env") == (0o600, 0, 0), "the daemon's secrets are root's alone"
