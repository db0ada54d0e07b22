"""Communication failures that no rule read (issue 29): a group that never formed (c10d's store
barrier, a store read that timed out, its client socket giving up), gloo losing its peer, and NCCL's
own network failures said only by its WARN lines or the error codes its socket/bootstrap code
returns, with no Python traceback. Each log below is copied from a development-part excerpt of
bench/corpus (thread named per test); before this change they read as unknown or crash_other."""

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import diagnose_bytes
from tests.diagnosis.test_trust import HEALTHY, sample_block

# NVIDIA/nccl-tests#166 (comm_failure_nccltests_socket_connect_abort_proxy): WARN lines only.
NCCLTESTS_166 = (
    b"ubuntu:39964:40075 [0] misc/socket.cc:483 NCCL WARN socketStartConnect: Connect to 10.0.0.2<45763> failed :"
    b" Software caused connection abort\n"
    b"ubuntu:39964:40075 [0] NCCL INFO misc/socket.cc:564 -> 2\n"
    b"ubuntu:39964:40075 [0] NCCL INFO misc/socket.cc:586 -> 2\n"
    b"ubuntu:39964:40075 [0] NCCL INFO transport/net_socket.cc:336 -> 2\n"
    b"ubuntu:39964:40075 [0] NCCL INFO transport/net.cc:592 -> 2\n"
    b"ubuntu:39964:40075 [0] NCCL INFO proxy.cc:1306 -> 2\n"
    b"ubuntu:39964:40075 [0] NCCL INFO proxy.cc:1377 -> 2\n"
    b"\n"
    b"ubuntu:39964:40075 [0] proxy.cc:1519 NCCL WARN [Proxy Service 0] Failed to execute operation Connect from rank 0,"
    b" retcode 2\n"
    b"ubuntu:39964:40049 [5] NCCL INFO Channel 20 : 5[5] -> 4[4] via SHM/direct/direct\n"
    b"ubuntu:39964:40049 [5] NCCL INFO Channel 21 : 5[5] -> 4[4] via SHM/direct/direct\n"
)
# NVIDIA/nccl#1099 (comm_failure_nccl_dgx_socketpollconnect_bootstrap_fail): no WARN line at all,
# only ncclSystemError (2) returned up from misc/socket.cc through bootstrap.cc.
NCCL_1099 = (
    b"nd20-01:191191:219889 [0] NCCL INFO misc/socket.cc:564 -> 2\n"
    b"nd20-01:191191:219889 [0] NCCL INFO misc/socket.cc:615 -> 2\n"
    b"nd20-01:191191:219889 [0] NCCL INFO bootstrap.cc:270 -> 2\n"
    b"nd20-01:191191:219889 [0] NCCL INFO init.cc:1303 -> 2\n"
    b"nd20-01:191191:219889 [0] NCCL INFO group.cc:64 -> 2 [Async thread]\n"
    b"nd20-01:191191:191191 [0] NCCL INFO group.cc:422 -> 2\n"
    b"nd20-01:191191:191191 [0] NCCL INFO group.cc:106 -> 2\n"
)
# hiyouga/LlamaFactory#8045 (comm_failure_llamafactory_multinode_socketpollconnect_no_route).
RETRY = (b"zgiot:1183664:1184669 [0] NCCL INFO socketPollConnect: connect returned No route to host, retrying (%d/34)"
         b" after sleep for %d msec\n")
LLAMAFACTORY_8045 = b"".join(RETRY % (i, i * 100) for i in range(26, 35))
# hpcaitech/Open-Sora#667 (comm_failure_opensora_c10d_client_socket_errno110).
OPENSORA_667 = (
    b"[W socket.cpp:697] [c10d] The client socket has failed to connect to [::ffff:0.104.99.143]:47389"
    b" (errno: 110 - Connection timed out).\n"
    b"[E socket.cpp:753] [c10d] The client socket has failed to connect to any network address of (6841231, 47389).\n"
)
# lllyasviel/ControlNet#380 (comm_failure_controlnet_ddp_store_barrier_timeout).
CONTROLNET_380 = (b"RuntimeError: Timed out initializing process group in store based barrier on rank: 0, for key:"
                  b" store_based_barrier_key:1 (world_size=4, worker_count=2, timeout=0:30:00)\n")
# pytorch/pytorch#78514 (comm_failure_pytorch_gloo_recv_closed_by_peer).
PYTORCH_78514 = (
    b'  File "/NFS/home/haokang/test.py", line 20, in main_worker\n'
    b"    dist.recv(input,0)\n"
    b'  File "/home/haokang/miniconda3/envs/3.8/lib/python3.8/site-packages/torch/distributed/distributed_c10d.py",'
    b" line 1002, in recv\n"
    b"    pg.recv([tensor], src, tag).wait()\n"
    b"RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [18.25.6.30]:30872\n"
)
# pytorch/pytorch#82091 (comm_failure_pytorch_nccl_uniqueid_store_socket_timeout).
PYTORCH_82091 = (
    b"RuntimeError: [2] is setting up NCCL communicator and retreiving ncclUniqueId from [0] via c10d key-value store"
    b" by key '0', but store->get('0') got error: Socket Timeout\n"
    b"Exception raised from recvBytes at ../torch/csrc/distributed/c10d/Utils.hpp:580 (most recent call first):\n"
)


def test_nccl_socket_warn_lines_without_a_traceback_are_a_comm_failure():
    for log in (NCCLTESTS_166, NCCL_1099, LLAMAFACTORY_8045):
        for exit in (None, ExitRecord(returncode=1)):
            d = diagnose_bytes(log, exit)
            assert d.category is Category.COMM_FAILURE, d.summary
            assert d.subkind == "nccl_network"


def test_rendezvous_store_and_gloo_failures_are_comm_failures():
    for log in (OPENSORA_667, CONTROLNET_380, PYTORCH_78514, PYTORCH_82091):
        d = diagnose_bytes(log, None)
        assert d.category is Category.COMM_FAILURE, d.summary
        assert d.subkind == "rendezvous"


def test_the_same_lines_in_a_printed_sample_do_not_act():
    for log in (NCCLTESTS_166, NCCL_1099, OPENSORA_667, CONTROLNET_380):
        d = diagnose_bytes(sample_block(log), ExitRecord(returncode=1))
        assert d.category is Category.UNKNOWN, d.summary


def test_a_retry_that_is_not_the_last_and_a_call_that_returned_success_do_not_act():
    """NCCL retries a connect while the peer starts; "-> 0" is not an error code."""
    log = (RETRY % (3, 300) + b"nd20-01:191191:219889 [0] NCCL INFO misc/socket.cc:564 -> 0\n") * 2 + HEALTHY
    assert diagnose_bytes(log, ExitRecord(returncode=1)).category is Category.UNKNOWN


def test_a_connect_failure_that_training_went_past_does_not_act():
    """Text alone, then logged steps: whatever NCCL said, the run trained on (rule 8)."""
    d = diagnose_bytes(NCCLTESTS_166 + HEALTHY, ExitRecord(returncode=1))
    assert d.category is Category.UNKNOWN, d.summary


def test_the_same_failures_in_their_other_library_words():
    """Beyond the corpus: the libraries' own messages for the same failures (NCCL's bootstrap without
    an interface, gloo's pair reset and recv timeout, c10d's server socket), as they print them."""
    lines = (
        b"node1:123:123 [0] bootstrap.cc:41 NCCL WARN Bootstrap : no socket interface found\n",
        b"RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:575] Connection reset by peer\n",
        (b"RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:84] Timed out waiting 1800000ms"
        b" for recv operation to complete\n"),
        b"[E socket.cpp:462] [c10d] The server socket has failed to listen on any local network address.\n",
    )
    for line in lines:
        d = diagnose_bytes(line, None)
        assert d.category is Category.COMM_FAILURE, (line, d.summary)
