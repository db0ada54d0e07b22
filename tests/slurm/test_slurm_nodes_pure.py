"""Multi-node judgement over plain values: the job's environment inside Slurm, every node's exit
record, the node a rank ran on, and the supervisor's own stop never read as someone's scancel."""

from __future__ import annotations

import json

from supervisor.core.models import Category, Diagnosis, Evidence, ExitRecord, HostEvidence
from supervisor.core.paths import AttemptPaths
from supervisor.judge.diagnosis import diagnose_bytes
from supervisor.judge.nodes import combine_exits, expand_nodelist, locate, node_of_rank
from supervisor.run import proctree
from supervisor.run import slurm as sl
from supervisor.run.shim import exit_record_path, job_environment

OOM_ON_RANK1 = b"""step 8
[rank1]: Traceback (most recent call last):
[rank1]:   File "train.py", line 3, in <module>
[rank1]: RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 805306368 bytes. Error code 12 (Cannot allocate memory)
"""


def test_inside_slurm_the_allocation_is_never_dropped_and_the_attempt_wins_elsewhere():
    attempt = {"PATH": "/venv/bin:/usr/bin", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
               "NPROC_PER_NODE": "1", "CUDA_VISIBLE_DEVICES": "7", "PYTHONPATH": "/hooks", "MASTER_PORT": "29511"}
    slurm_env = {"PATH": "/venv/bin:/usr/bin", "SLURM_JOB_ID": "36", "SLURM_NODEID": "1", "SLURM_JOB_GPUS": "0,1",
                 "CUDA_VISIBLE_DEVICES": "0,1", "GPU_DEVICE_ORDINAL": "0,1", "NNODES": "2", "NODE_RANK": "1",
                 "MASTER_ADDR": "node1", "MASTER_PORT": "29511", "FORCE_TORCHRUN": "1",
                 "PYTHONPATH": "/supervisor-package", "NPROC_PER_NODE": "8", "ENVIRONMENT": "BATCH"}
    env = job_environment(attempt, slurm_env)
    for k in ("SLURM_JOB_ID", "SLURM_NODEID", "SLURM_JOB_GPUS", "GPU_DEVICE_ORDINAL", "NNODES", "NODE_RANK",
              "MASTER_ADDR", "MASTER_PORT"):
        assert env[k] == slurm_env[k], k  # Slurm's allocation and the batch script's rendezvous
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"  # the GPUs Slurm gave, not what the job file said
    assert env["FORCE_TORCHRUN"] == "1" and env["ENVIRONMENT"] == "BATCH"  # what Slurm added is kept
    assert env["NPROC_PER_NODE"] == "1" and env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"  # remedies
    assert env["PYTHONPATH"] == "/hooks"  # the job's, never the shim's own
    assert "PYTHONPATH" not in job_environment({}, {"PYTHONPATH": "/supervisor-package"})
    assert job_environment(attempt, None) == attempt  # locally: exactly the attempt's


def test_each_node_writes_its_own_record_and_one_failure_never_hides_behind_a_success(tmp_path):
    spec = {"exit_record": str(tmp_path / "exit.json"), "exit_per_node": True}
    assert exit_record_path(spec, "node2") == tmp_path / "exit-node2.json"
    assert exit_record_path({"exit_record": str(tmp_path / "exit.json")}, "node2") == tmp_path / "exit.json"
    paths = AttemptPaths(tmp_path)
    (tmp_path / "exit-node1.json").write_text(json.dumps({"returncode": 0, "ended_at": 20.0, "node_rank": 0}))
    (tmp_path / "exit-node2.json").write_text(json.dumps({"returncode": 3, "ended_at": 10.0, "node_rank": 1,
                                                          "peak_rss_bytes": 5}))
    raw = proctree.read_exit(paths, ["node1", "node2"])
    assert (raw["returncode"], raw["node"], raw["peak_rss_bytes"]) == (3, "node2", 5)
    assert raw["nodes"]["node1"]["returncode"] == 0 and raw["missing_nodes"] == []


def test_the_node_that_failed_on_its_own_decides_not_the_one_stopped_after_it():
    recs = {"node1": {"returncode": -15, "signal": "SIGTERM", "ended_at": 5.0},
            "node2": {"returncode": 1, "ended_at": 6.0}}
    assert combine_exits(recs, ["node1", "node2"])["node"] == "node2"
    recs = {"node1": {"returncode": 1, "ended_at": 7.0}, "node2": {"returncode": -9, "signal": "SIGKILL", "ended_at": 6.0}}
    assert combine_exits(recs)["node"] == "node2"  # a SIGKILL (the OOM killer) is a failure of its own, earlier


def test_every_node_at_0_is_a_success_that_names_no_node():
    raw = combine_exits({"node1": {"returncode": 0, "ended_at": 3.0, "node": "node1"},
                         "node2": {"returncode": 0, "ended_at": 4.0, "node": "node2"}}, ["node1", "node2"])
    assert raw["returncode"] == 0 and "node" not in raw and set(raw["nodes"]) == {"node1", "node2"}
    ok = locate(Diagnosis(Category.SUCCESS, "Exited with status 0."), exit_node=None, rank_node=None,
                node_ends=raw["nodes"])
    assert ok.node is None and ok.summary == "Exited with status 0. Nodes: node1 exit 0; node2 exit 0."


def test_a_node_without_a_record_is_not_a_success():
    raw = combine_exits({"node1": {"returncode": 0, "ended_at": 3.0}}, ["node1", "node2"])
    assert raw["returncode"] is None and raw["missing_nodes"] == ["node2"] and "node2" in raw["note"]
    assert combine_exits({"": {"returncode": 0}}) == {"returncode": 0}  # exit.json of one shim: as it was
    assert combine_exits({}) is None


def test_slurm_host_lists():
    assert expand_nodelist("node[1-2]") == ["node1", "node2"]
    assert expand_nodelist("gpu[01-03,7]x,login") == ["gpu01x", "gpu02x", "gpu03x", "gpu7x", "login"]
    assert expand_nodelist("vm") == ["vm"] and expand_nodelist(None) == []


def test_a_rank_is_placed_on_its_node_and_a_node_failure_names_the_node_not_the_log_tail():
    assert node_of_rank(1, 1, ["node1", "node2"]) == "node2"
    assert node_of_rank(5, 4, ["a", "b"]) == "b" and node_of_rank(9, 4, ["a", "b"]) is None
    d = diagnose_bytes(OOM_ON_RANK1, ExitRecord(returncode=1, node="node2"), None)
    placed = locate(d, exit_node="node2", rank_node=node_of_rank(d.rank, 1, ["node1", "node2"]),
                    node_ends={"node1": {"returncode": -15, "signal": "SIGTERM"}, "node2": {"returncode": 1}})
    assert placed.node == "node2" and "On node node2 (rank 1)" in placed.summary, placed.summary
    assert "Nodes: node1 killed by SIGTERM; node2 exit 1." in placed.summary
    fail = Diagnosis(Category.ENVIRONMENT, "The scheduler reports NODE_FAIL.", subkind="node_fail",
                     numbers={"scheduler_state": "NODE_FAIL"},
                     evidence=(Evidence(0, "srun: got SIGCONT", "tail"), Evidence(0, "slurmstepd: ...", "tail")))
    placed = locate(fail, exit_node=None, rank_node=None, failed_nodes=["node2"],
                    scheduler_words=["Slurm NODE_FAIL ExitCode=0:0 Reason=NodeDown", "node2: DOWN* Reason=Not responding"])
    assert placed.node == "node2" and "node(s) node2 down" in placed.summary
    assert [e.rule for e in placed.evidence] == ["scheduler", "scheduler"]
    assert placed.evidence[1].text == "node2: DOWN* Reason=Not responding"


def test_the_supervisors_own_stop_is_not_someone_cancelling_the_job():
    """Seen on two nodes: an OOM on node2's rank, the daemon stopped the job (its scancel ended it
    CANCELLED) and the verdict said "someone cancelled the job; not a failure"."""
    host = HostEvidence(scheduler_state="CANCELLED", limit_mechanism="slurm-cgroup")
    d = diagnose_bytes(OOM_ON_RANK1, ExitRecord(returncode=None, stopped_by="fatal_signal"), host)
    assert d.category == Category.HOST_OOM and d.rank == 1, d.summary
    outside = diagnose_bytes(b"step 3\n", ExitRecord(returncode=-15, signal="SIGTERM", stopped_by="cancelled_outside"),
                             host)
    assert outside.subkind == "cancelled"  # someone else's scancel stays what it is


def test_the_supervisors_own_sigkill_is_not_read_as_slurms_job_launch_failure():
    st = sl.SlurmJobState(job_id="7", state="FAILED", reason="JobLaunchFailure", exit_code=0, signal=9)
    v = sl.verdict(st, "", killed_by_supervisor=True)
    assert v["exit"] == {"returncode": -9, "signal": "SIGKILL"} and not v["cancelled"]
    assert "the supervisor SIGKILLed the job's steps itself" in v["evidence"][1]
    done = sl.SlurmJobState(job_id="8", state="COMPLETED", exit_code=0, signal=0, derived_exit_code=0, derived_signal=9)
    assert sl.verdict(done, "", killed_by_supervisor=True)["exit"]["returncode"] == -9
    assert sl.down_nodes({"node1": ("ALLOCATED", None), "node2": ("DOWN*", "Not responding"),
                          "node3": ("IDLE*", None)}) == {"node2": "node2: DOWN* Reason=Not responding",
                                                         "node3": "node3: IDLE*"}
