"""Issue 29, through the real daemon: a job whose log ends in a real Hub DNS failure is not failed
once its retries are spent; it waits for the network and `status` says why and until when."""

import re
import sys

import yaml

from supervisor.judge.policy import BUILTIN_POLICY_DIR

from ..conftest import DaemonProc, command_job, drop, write_config
from ..diagnosis.cases import FIXTURES

HUB_LOG = FIXTURES / "environment_hub_connection_error.log"


def test_a_job_that_cannot_reach_the_hub_waits_for_the_network_and_status_says_why(dirs, tmp_path):
    state, spool, work = dirs
    pol = tmp_path / "policies"
    pol.mkdir()
    cfg = yaml.safe_load((BUILTIN_POLICY_DIR / "default.yaml").read_text())
    cfg["name"] = "net"
    cfg["backoff"] = {"initial_s": 0.05, "max_s": 0.1, "exp_base": 2, "jitter_s": 0}
    cfg["budgets"].update(environment_retries=1, environment_wait_s=600, environment_wait_max_s=3600)
    (pol / "net.yaml").write_text(yaml.safe_dump(cfg))
    config = write_config(tmp_path / "c.yaml", policy_dirs=[str(pol)], default_policy="net")
    d = DaemonProc(state, spool, config, tmp_path / "d.log")
    d.start()
    try:
        # The job prints the real log of a Hub lookup that failed for want of DNS, and exits 1.
        argv = [sys.executable, "-c", f"import sys; sys.stdout.write(open({str(HUB_LOG)!r}).read()); sys.exit(1)"]
        drop(spool, "hub.yaml", command_job(work, argv, name="hub"))
        # One CLI call a poll (`show` carries status's row): each costs ~0.3 s of CPU.
        d.wait_for(lambda: (s := d.show(1))["attempts"] == 2 and s["state"] == "waiting_retry"
                   and s["reason"].startswith("waiting"), timeout=60, what="the wait for the network")
        row = d.status()[0]
        assert re.match(r"waiting for the network: huggingface\.co unreachable \(NameResolutionError\) in 2 "
                        r"attempts; next try at \d\d:\d\d \(in 10m00s\)", row["reason"]), row["reason"]
        assert row["not_before"] is not None
        plain = d.cli("status", check=True).stdout
        assert "waiting for the network" in plain and "huggingface.co unreachable" in plain
        first, second = d.show(1)["attempt_list"]
        assert first["decision"]["kind"] == "retry" and second["decision"]["kind"] == "wait"
        shown = d.cli("show", "1", check=True).stdout
        assert "decision: retry" in shown and "decision: wait" in shown
    finally:
        d.stop()
