"""Collective/rendezvous failures in the words of the libraries that raise them (issue 29), each line
from its source: c10d's TCPStore (store/TCPStore.cpp), ProcessGroupGloo's monitoredBarrier,
horovod/common/exceptions.py, Open MPI's runtime help texts."""

import pytest

from supervisor.core.models import Category
from supervisor.judge.diagnosis import diagnose_bytes


def _tb(exc_line: str) -> bytes:
    return ('Traceback (most recent call last):\n  File "/home/u/train.py", line 3, in <module>\n    main()\n'
            '  File "/x/torch/distributed/distributed_c10d.py", line 40, in init_process_group\n    raise X\n'
            f"{exc_line}\n").encode()


COMM = {
    "tcpstore_clients": _tb("torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. "
                            "1/2 clients joined."),
    "tcpstore_clients_old": _tb("RuntimeError: Timed out after 1801 seconds waiting for clients. 3/4 clients joined."),
    "monitored_barrier": _tb("RuntimeError: [Rank 0]: Rank 1 failed to pass monitoredBarrier in 2000 ms"),
    "monitored_barrier_peer": _tb("RuntimeError: Rank 2 successfully reached monitoredBarrier, but received errors while"
                                  " waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank."),
    "horovod": _tb("horovod.common.exceptions.HorovodInternalError: ncclAllReduce failed: unhandled system error"),
    "orte": b"step 120 loss 2.31\nORTE has lost communication with a remote daemon.\n",
}


@pytest.mark.parametrize("name", sorted(COMM))
def test_library_comm_failures(name: str) -> None:
    d = diagnose_bytes(COMM[name])
    assert d.category is Category.COMM_FAILURE, (name, d.summary)
