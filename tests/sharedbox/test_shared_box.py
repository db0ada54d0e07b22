"""Issue 17 end to end: a real daemon as root in system mode, alice and bob submitting through the
real CLI as themselves. Each job runs as its submitter; alice's job, however it tries, cannot read
bob's job file, environment, log or outputs, cannot write the state folder, cannot signal bob's
processes; the daemon's secrets (a webhook URL in its environment) never reach a job; no path of
the state folder is handed to one (case 1, case 2)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import psutil

from supervisor.run.identity import lookup

PROBE = r'''
probe() { what="$1"; shift; if "$@" >/dev/null 2>&1; then echo "ALLOWED $what"; else echo "DENIED $what"; fi; }
echo "ids uid=$(id -u) gid=$(id -g) groups=$(id -G) home=$HOME user=$USER logname=$LOGNAME"
probe bobs-job-file cat "$STATE/jobs/$BOB_JOB/job.yaml"
probe bobs-environment cat "$ATTEMPTS/$BOB_JOB/attempt-1/environment.json"
probe bobs-launch-spec cat "$ATTEMPTS/$BOB_JOB/attempt-1/launch.json"
probe bobs-log cat "$ATTEMPTS/$BOB_JOB/attempt-1/output.log"
probe bobs-output cat "$BOB_WORK/out.txt"
probe bobs-process-environ cat "/proc/$BOB_PID/environ"
probe list-attempts ls "$ATTEMPTS/$BOB_JOB"
probe state-list ls "$STATE"
probe state-write touch "$STATE/alice-was-here"
probe state-db-write sh -c "echo x >> '$STATE/state.sqlite3'"
probe signal-bob kill -TERM "$BOB_PID"
probe own-peak-folder touch "$(dirname "$OOM_SUPERVISOR_PEAK_FILE")/mine"
echo "peak-file=$OOM_SUPERVISOR_PEAK_FILE"
echo "--- env"
env | sort
'''


def _ids(log: str) -> tuple[int, int, list[int], str]:
    m = re.search(r"ids uid=(\d+) gid=(\d+) groups=([\d ]+) home=(\S+) user=(\S+) logname=(\S+)", log)
    assert m, log
    assert m.group(5) == m.group(6)
    return int(m.group(1)), int(m.group(2)), sorted(int(g) for g in m.group(3).split()), m.group(4)


def test_alice_and_bob_on_one_box(box, box_users, http_server):
    hook = http_server()
    secret_url = f"{hook.url}/services/T0BOX/B0BOX/boxsecretwebhooktoken"
    b = box(max_parallel=2, webhooks=[{"url_env": "SLACK_WEBHOOK_URL", "on": ["succeeded"]}]).start(
        env={"SLACK_WEBHOOK_URL": secret_url, "HF_TOKEN": "hf_the_daemons_own"})
    pids = b.root / "pids"
    pids.mkdir()
    pids.chmod(0o1777)
    bob_work = b.workdir("bob")
    bob_job = b.submit("bob", "bobs-secret-run", {
        "command": ["sh", "-c", (f"id; echo secret-output > out.txt; echo $$ > {pids}/bob; "
                                 f"chmod 644 {pids}/bob; exec sleep 300")],
        "env": {"HF_TOKEN": "hf_bobs_secret_token"}, "gpus": [0]})
    b.wait_for(lambda: (pids / "bob").exists() and (pids / "bob").read_text().strip(), 60, "bob's job")
    bob_pid = int((pids / "bob").read_text())
    bob = lookup(box_users["bob"].uid)
    proc = psutil.Process(bob_pid)
    assert proc.uids().real == bob.uid and proc.uids().effective == bob.uid and proc.gids().real == bob.gid
    status = Path(f"/proc/{bob_pid}/status").read_text()
    assert sorted(int(g) for g in status.split("Groups:")[1].split("\n")[0].split()) \
        == sorted(bob.groups), "bob's job has exactly bob's groups"

    alice_job = b.submit("alice", "alices-probe", {
        "command": ["sh", "-c", PROBE],
        "env": {"STATE": str(b.state), "ATTEMPTS": str(b.root / "state-attempts"), "BOB_JOB": str(bob_job),
                "BOB_WORK": str(bob_work), "BOB_PID": str(bob_pid)}, "gpus": [1]})
    b.wait_state(alice_job, ("succeeded", "failed"), 90)
    res = b.cli("alice", "logs", str(alice_job))
    assert res.returncode == 0, res.stderr
    log = res.stdout

    # each job runs as its submitter: uid, primary gid, supplementary groups, HOME/USER/LOGNAME
    alice = lookup(box_users["alice"].uid)
    assert _ids(log) == (alice.uid, alice.gid, sorted(alice.groups), alice.home)
    assert "user=alice" in log
    # alice's job cannot reach anything of bob's, nor write the daemon's state
    for what in ("bobs-job-file", "bobs-environment", "bobs-launch-spec", "bobs-log", "bobs-output",
                 "bobs-process-environ", "list-attempts", "state-list", "state-write", "state-db-write", "signal-bob"):
        assert f"DENIED {what}" in log, f"{what}:\n{log}"
    assert "ALLOWED own-peak-folder" in log, "the hook's folder is the job's own"
    assert psutil.pid_exists(bob_pid) and not (b.state / "alice-was-here").exists()
    assert "hf_bobs_secret_token" not in log
    # case 1: no path of the state folder is handed to a job
    peak = re.search(r"peak-file=(\S+)", log).group(1)
    assert not peak.startswith(str(b.state) + "/") and str(b.state) + "/" not in log.split("--- env")[1].replace(
        f"STATE={b.state}", "")
    # case 2: the daemon's environment (a webhook URL, its own token) reaches no job, nor its files
    env_part = log.split("--- env")[1]
    assert "boxsecretwebhooktoken" not in env_part and "SLACK_WEBHOOK_URL" not in env_part
    assert "hf_the_daemons_own" not in env_part
    for f in ("environment.json", "launch.json"):
        text = (b.root / "state-attempts" / str(alice_job) / "attempt-1" / f).read_text()
        assert "boxsecretwebhooktoken" not in text and "hf_the_daemons_own" not in text, f
    b.wait_for(lambda: hook.bodies, 30, "the webhook for alice's success")
    assert "alices-probe" in json.loads(hook.bodies[0])["text"], "the daemon itself still has its URL"

    # bob sees alice's job in status, but cannot show, read or cancel it; he cancels his own
    rows = {r["id"]: r for r in b.status("bob")}
    assert rows[alice_job]["owner"] == "alice" and rows[alice_job]["state"] == "succeeded"
    for cmd in ("show", "logs", "cancel"):
        assert b.cli("bob", cmd, str(alice_job)).returncode == 2
    assert b.cli("bob", "cancel", str(bob_job)).returncode == 0
    b.wait_state(bob_job, "cancelled", 60)
    assert not psutil.pid_exists(bob_pid), "the daemon (root) stops bob's processes"
    # files of the attempts: their owner's, in root's folders
    st = os.stat(b.root / "state-attempts" / str(bob_job) / "attempt-1" / "output.log")
    assert (st.st_uid, st.st_mode & 0o777) == (bob.uid, 0o600)
    assert os.stat(b.root / "state-attempts" / str(bob_job) / "attempt-1" / "launch.json").st_uid == 0
