"""The Slurm module's pure parts: parsing Slurm's words, the config schema, same_run, verdict.

The scontrol lines are verbatim from the real Slurm 22.05 of scripts/slurm.sh."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from supervisor.run import slurm as sl

OOM_LINE = ("JobId=1 JobName=oom.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 "
            "Account=(null) QOS=(null) JobState=OUT_OF_MEMORY Reason=OutOfMemory Dependency=(null) Requeue=1 "
            "Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:125 DerivedExitCode=0:0 RunTime=00:00:01 "
            "TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-12-01T18:30:48 EligibleTime=2026-12-01T18:30:48 "
            "AccrueTime=2026-12-01T18:30:48 StartTime=2026-12-01T18:30:51 EndTime=2026-12-01T18:30:52 "
            "Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-12-01T18:30:51 Scheduler=Main "
            "Partition=debug AllocNode:Sid=localhost:20105 ReqNodeList=(null) ExcNodeList=(null) NodeList=vm "
            "BatchHost=vm NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* "
            "TRES=cpu=1,mem=200M,node=1,billing=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* "
            "JOB_GRES=(null)   Nodes=vm CPU_IDs=0 Mem=200 GRES= MinCPUsNode=1 MinMemoryNode=200M "
            "MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 "
            "Licenses=(null) Network=(null) Command=/tmp/my jobs/oom.sh WorkDir=/tmp/my jobs "
            "StdErr=/tmp/sx/oom.log StdIn=/dev/null StdOut=/tmp/sx/oom.log Power= ")


def test_scontrol_oneliner_parsed():
    st = sl.state_from_scontrol(OOM_LINE)
    assert (st.job_id, st.state, st.reason, st.exit_code, st.signal) == ("1", "OUT_OF_MEMORY", "OutOfMemory", 0, 125)
    assert (st.derived_exit_code, st.derived_signal, st.restarts) == (0, 0, 0)
    assert st.memory_limit_bytes == 200 << 20 and st.node_list == "vm" and st.batch_host == "vm"
    assert st.end_time - st.start_time == 1 and st.start_time - st.submit_time == 3
    assert st.terminal and not st.running
    kv = sl.parse_keyvalues(OOM_LINE)
    assert kv["Command"] == "/tmp/my jobs/oom.sh" and kv["WorkDir"] == "/tmp/my jobs"  # spaces kept
    assert kv["TRES"] == "cpu=1,mem=200M,node=1,billing=1" and kv["AllocNode:Sid"] == "localhost:20105"
    assert kv["Power"] == "" and kv["GRES"] == ""


def test_pending_start_time_is_an_estimate_not_a_start():
    st = sl.state_from_scontrol(OOM_LINE.replace("JobState=OUT_OF_MEMORY", "JobState=PENDING"))
    assert st.running and not st.terminal and st.start_time is None and st.end_time is None


def test_garbage_from_scontrol_is_a_clear_error():
    with pytest.raises(sl.SlurmError, match="JobId/JobState"):
        sl.state_from_scontrol("slurm_load_jobs error: Socket timed out")


def test_settings_schema():
    s = sl.SlurmSettings(partition="gpu", time_limit="12h", mem="64G", extra_args=["--qos=high"],
                         launcher_prefix=["srun", "--cpu-bind=none"], gpus_per_node=8)
    assert s.time_limit == "0-12:00:00" and s.mem == 64 << 30
    assert sl.SlurmSettings(time_limit="1:30:00").time_limit == "1:30:00"    # Slurm's own format
    assert sl.SlurmSettings(time_limit=90).time_limit == "0-00:01:30"        # seconds, like every duration
    for bad, word in [({"time_limit": "1:xx"}, "Slurm time"), ({"mem": "12K"}, "1 MiB"),
                      ({"extra_args": ["--output=/x"]}, "sets --output itself"), ({"nodes": 0}, "greater"),
                      ({"partiton": "gpu"}, "Extra inputs")]:
        with pytest.raises(ValidationError, match=word):
            sl.SlurmSettings(**bad)
    with pytest.raises(ValidationError, match="Extra inputs"):
        sl.SlurmJobRequest(gpus=2)


def test_sbatch_args_request_overrides_site():
    s = sl.SlurmSettings(partition="gpu", account="lab", nodes=1, gpus_per_node=8, mem="64G",
                         time_limit="12h", extra_args=["--qos=high"])
    r = sl.SlurmJobRequest(gpus_per_node=2, mem=1000 * 1000 * 1000 + 1, time="30m")
    args = sl.sbatch_args(Path("/s/log"), Path("/w"), settings=s, request=r, job_name="j1")
    assert {"--parsable", "--open-mode=append", "--output=/s/log", "--error=/s/log", "--export=ALL",
            "--gres=gpu:2", "--mem=954M", "--time=0-00:30:00", "--partition=gpu", "--account=lab",
            "--nodes=1", "--chdir=/w", "--job-name=j1", "--no-requeue"} <= set(args)
    assert args[-1] == "--qos=high"  # the site's extra arguments come last: they win
    args0 = sl.sbatch_args(Path("/l"), Path("/w"), settings=sl.SlurmSettings(), request=None, job_name="j")
    assert not any(a.startswith(("--gres", "--mem", "--time", "--partition")) for a in args0)
    assert r.world_size(s) == 2 and sl.SlurmJobRequest(nodes=4).world_size(s) == 32


def test_sbatch_args_submit_as_the_jobs_user_on_a_shared_box():
    s = sl.SlurmSettings(extra_args=["--qos=high"])
    args = sl.sbatch_args(Path("/l"), Path("/w"), settings=s, request=None, job_name="j", run_as=(1001, 1002))
    assert args[-3:] == ["--uid=1001", "--gid=1002", "--qos=high"]
    plain = sl.sbatch_args(Path("/l"), Path("/w"), settings=s, request=None, job_name="j")
    assert not any(a.startswith(("--uid", "--gid")) for a in plain)


def test_batch_script_execs_and_multinode_uses_llamafactory_names():
    one = sl.batch_script(["llamafactory-cli", "train", "a b.yaml"], launcher_prefix=[], nodes=1)
    assert one.splitlines()[-1] == "exec llamafactory-cli train 'a b.yaml'"
    multi = sl.batch_script(["llamafactory-cli", "train", "x.yaml"], launcher_prefix=[], nodes=2)
    for word in ("NNODES=", "MASTER_ADDR=", "scontrol show hostnames", "MASTER_PORT=", "FORCE_TORCHRUN=1",
                 "NODE_RANK=", "exec srun --ntasks-per-node=1"):
        assert word in multi


def _state(**kw) -> sl.SlurmJobState:
    base = {"job_id": "7", "state": "RUNNING", "submit_time": 1000.0, "start_time": 1003.0,
            "job_name": "oomsup-1-2"}
    return sl.SlurmJobState(**{**base, **kw})


def test_same_run_rules():
    sub = sl.SlurmSubmission(job_id="7", submitted_at=999.6, script=Path("/a/s.sh"), job_name="oomsup-1-2")
    rec = sl.observed(sub, _state())
    assert rec["start_time"] == 1003.0 and rec["restarts"] == 0
    assert sl.same_run(rec, _state()) and sl.same_run(rec, _state(state="COMPLETED"))
    assert not sl.same_run(rec, _state(start_time=1040.0))           # relaunched, Restarts still 0
    assert not sl.same_run(rec, _state(state="PENDING", start_time=None))
    assert not sl.same_run(rec, _state(restarts=1))                  # requeued
    assert not sl.same_run(rec, _state(job_id="8"))
    assert not sl.same_run(rec, _state(job_name="someone-else"))     # ids reused after a state wipe
    assert not sl.same_run(rec, _state(submit_time=500.0))
    never_started = sl.observed(sub, _state(state="PENDING", start_time=None))
    assert "start_time" not in never_started and sl.same_run(never_started, _state())


@pytest.mark.parametrize("state,flag", [("NODE_FAIL", "interrupted"), ("PREEMPTED", "interrupted"),
                                        ("TIMEOUT", "timeout"), ("CANCELLED", "cancelled")])
def test_verdict_flags(state, flag):
    v = sl.verdict(_state(state=state, exit_code=0, signal=0), "")
    assert v[flag] and v["scheduler_state"] == state and v["host"]["scheduler_state"] == state
    assert v["exit"]["returncode"] is None  # 0:0 from Slurm's kill is no success of the training
    assert v["host"]["cgroup_oom_kills"] == 0


def test_verdict_oom_from_derived_code_and_line_when_batch_exits_0():
    tail = ("step done\nslurmstepd-vm: error: Detected 2 oom-kill event(s) in StepId=7.0. Some of your "
            "processes may have been killed by the cgroup out-of-memory handler.\n")
    v = sl.verdict(_state(state="COMPLETED", exit_code=0, signal=0, derived_signal=125,
                          memory_limit_bytes=200 << 20), tail)
    assert v["exit"] == {"returncode": -9, "signal": "SIGKILL"}
    assert v["host"]["cgroup_oom_kills"] == 2 and v["host"]["memory_limit_bytes"] == 200 << 20
    assert any("StepId=7.0" in e for e in v["evidence"])
    # Slurm's DerivedExitCode alone is enough.
    assert sl.verdict(_state(state="COMPLETED", exit_code=0, signal=0, derived_signal=125), "")["host"][
        "cgroup_oom_kills"] == 1
    # A plain signal is the signal.
    assert sl.verdict(_state(state="FAILED", exit_code=0, signal=9), "")["exit"] == {"returncode": -9,
                                                                                    "signal": "SIGKILL"}


def test_jobcomp_state_takes_the_requested_memory_and_gives_classifier_records():
    st = _state(state="OUT_OF_MEMORY", exit_code=0, signal=125, source="sacct-jobcomp")
    v = sl.verdict(st, "", requested_mem_bytes=200 << 20)
    exit_rec, host = sl.records(v)
    assert host.memory_limit_bytes == 200 << 20 and host.cgroup_oom_kills == 1
    assert host.scheduler_state == "OUT_OF_MEMORY" and exit_rec.signal == "SIGKILL"


def test_verdict_sigkill_without_memory_evidence_is_not_oom():
    """slurm.md: a SIGKILLed batch shell reads FAILED JobLaunchFailure 0:9 (misleading reason)."""
    v = sl.verdict(_state(state="FAILED", reason="JobLaunchFailure", exit_code=0, signal=9), "Killed\n")
    assert v["exit"] == {"returncode": -9, "signal": "SIGKILL"} and v["host"]["cgroup_oom_kills"] == 0
    assert not (v["interrupted"] or v["timeout"] or v["cancelled"])
    assert "Reason=JobLaunchFailure" in v["evidence"][0]
    assert sl.verdict(_state(state="BOOT_FAIL"), "")["interrupted"]
    assert sl.verdict(_state(state="DEADLINE"), "")["timeout"]
