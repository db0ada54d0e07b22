"""Collectives and rendezvous: NCCL/RCCL watchdogs and errors, IPC handles, c10d stores and sockets.
Often a consequence of a root cause on another rank (conclude.py weighs that)."""

from __future__ import annotations

import re

from supervisor.core.models import Category
from supervisor.judge.diagnosis.hits import COMM, Hit, Segment

# --- comm -----------------------------------------------------------------
_WATCHDOG_RE = re.compile(
    r"Watchdog caught collective operation timeout|Some NCCL operations have failed or timed out"
    r"|[Hh]eartbeat monitor timed out|watchdog got stuck|timed out in blocking wait"
)
_RAN_FOR_RE = re.compile(r"ran for (\d+) milliseconds")
# A watchdog timeout that shows up only as its C++ frames, or torch's summary line.
_WATCHDOG_FRAME_RE = re.compile(r"WorkNCCL::checkTimeout|Timeout at NCCL work: \d+")
_WATCHDOG_OTHER_FRAME_RE = re.compile(r"ProcessGroupNCCL::(?:watchdogHandler|ncclCommWatchdog)|ncclCommWatchdog\b")
_IPC_RE = re.compile(
    r"\b(?:hip|cuda)Ipc(?:Open|Get)MemHandle\b.*(?:fail|error|invalid)|(?:fail|error)\w*.*\b(?:hip|cuda)Ipc(?:Open|Get)MemHandle"
    r"|failed to open (?:CUDA|HIP) IPC handle|RCCL.*\bIPC\b.*(?:fail|error)|ncclP2pImportShareableBuffer.*fail"
)
_NCCL_ERR_RE = re.compile(
    r"\bncclUnhandledCudaError\b|\bncclSystemError\b|\bncclInternalError\b|\bncclRemoteError\b"
    r"|NCCL [Ee]rror|DistBackendError|NCCL communicator was aborted|ProcessGroupNCCL is aborted"
    r"|NCCL WARN (?:Cuda|HIP|Hip) failure"
)
_SOCKET_RE = re.compile(
    r"Rendezvous\w*Error|DistNetworkError|DistStoreError|socket has timed out|EADDRINUSE"
    r"|address already in use|TCPStore\w*.*(?:fail|timed out|refused)"
    r"|(?:Connection reset by peer|Connection refused|Broken pipe).*(?:c10d|socket|Gloo|NCCL|store)"
    r"|(?:c10d|socket|Gloo|NCCL|store).*(?:Connection reset by peer|Connection refused)"
    # the group never formed: c10d's store barrier, a store read that timed out, its client socket giving up
    r"|Timed out initializing process group in store based barrier|store->\w+\(.*\) got error"
    r"|\[c10d\].*client socket has (?:failed to connect|timed out)"
    # gloo's TCP pair lost its peer (the other rank died or the link dropped)
    r"|gloo\S*.*(?:Connection closed by peer|Connection reset by peer|Connection refused|Timed out waiting \d+ms)"
    r"|\[c10d\].*server socket has failed to (?:listen|bind)"
    # c10d's TCPStore server giving up on the ranks that never joined (N-1/N: one rank never came);
    # ProcessGroupGloo's monitoredBarrier naming the rank that did not arrive
    r"|Timed out after \d+ seconds waiting for clients|failed to pass monitoredBarrier"
    r"|successfully reached monitoredBarrier, but received errors"
    # horovod/common/exceptions.py: a collective (allreduce, ...) failed; Open MPI's runtime lost a peer
    r"|HorovodInternalError|ORTE has lost communication with a remote daemon"
    r"|MPI communication peer process has unexpectedly disconnected"
)
# NCCL/RCCL's own network failures, said by their WARN lines (socket, bootstrap, IB verbs, proxy
# connect) or, when no WARN was printed, by the error codes a failed call returns up the stack
# from its socket/bootstrap/net code ("misc/socket.cc:564 -> 2"). Often the log's last word: the
# launcher kills the ranks, or the log is cut, before any Python traceback.
_NCCL_NET_RE = re.compile(
    r"\b[NR]CCL WARN\b.*(?:Connection closed by (?:remote )?peer|Connection refused|Connection reset by peer"
    r"|Connect to \S+ failed|socket(?:StartConnect|PollConnect|Progress|Accept|Recv|Send)\w*:"
    r"|Network is unreachable|No route to host|Software caused connection abort|Connection timed out"
    r"|\bbootstrap\w*\b.*(?:fail|error|timeout)|\bibv_\w+ failed|Got completion from peer\b.*\bstatus=[1-9]"
    r"|Socket recv failed|Failed to execute operation Connect|no socket interface found"
    r"|NET/IB\s*:.*(?:\berror\b|failed|Got async event))"
    r"|\b[NR]CCL INFO (?:\S*/)?(?:socket|bootstrap|net_socket|net_ib|ibvwrap)\.cc:\d+ -> [1-9]\d*\b"
    # retries to reach a peer used up: socketPollConnect's "retrying (34/34)"
    r"|socketPollConnect: connect returned .*retrying \((\d+)/\1\)"
)


def find(seg: Segment, t: str, exc: str | None, exc_form: bool, hits: list[Hit]) -> None:
    """Append this family's hits for one segment (`t` its text, `exc` its short exception class)."""
    # Communication.
    if _WATCHDOG_FRAME_RE.search(t):
        hits.append(Hit("nccl_timeout", Category.COMM_FAILURE, COMM, "nccl_timeout"))
    elif _WATCHDOG_OTHER_FRAME_RE.search(t):
        hits.append(Hit("nccl_error", Category.COMM_FAILURE, COMM, "nccl_watchdog"))
    elif ("Ipc" in t or "IPC" in t) and _IPC_RE.search(t):
        hits.append(Hit("ipc_handle", Category.COMM_FAILURE, COMM, "ipc_handle", exc=seg.exc))
    elif _WATCHDOG_RE.search(t):
        nums = {}
        m = _RAN_FOR_RE.search(t)
        if m:
            nums["timeout_ms"] = int(m.group(1))
        hits.append(Hit("nccl_timeout", Category.COMM_FAILURE, COMM, "nccl_timeout", numbers=nums))
    elif _NCCL_ERR_RE.search(t):
        sub = "nccl_unhandled_cuda_error" if "ncclUnhandledCudaError" in t else "nccl_error"
        hits.append(Hit("nccl_error", Category.COMM_FAILURE, COMM, sub, exc=seg.exc))
    elif _SOCKET_RE.search(t):
        hits.append(Hit("rendezvous", Category.COMM_FAILURE, COMM, "rendezvous", exc=seg.exc))
    elif "CCL" in t and _NCCL_NET_RE.search(t):
        hits.append(Hit("nccl_network", Category.COMM_FAILURE, COMM, "nccl_network", exc=seg.exc))


# Raised while torch.distributed's c10d store formed or was read (rendezvous.py's TCPStore creation,
# elastic/rendezvous/'s store calls, the store-based barrier): the group not forming, in whatever
# words (TCPStore.cpp's "Stop_waiting response is expected", a bare EOF). The scanner asks this of a
# generic exception's last frame; a ValueError there is the env check's (MASTER_ADDR not set).
_STORE_FUNCS = frozenset({"_create_c10d_store", "_create_tcp_store", "_store_based_barrier", "_call_store"})
_STORE_EXCS = frozenset({"RuntimeError", "TimeoutError", "OSError", "ConnectionError", "ConnectionResetError",
                         "ConnectionRefusedError", "ConnectionAbortedError", "BrokenPipeError", "DistError"})


def store_frame(exc: str | None, func: str, path: str) -> Hit | None:
    """A comm hit for a generic exception raised at the c10d store's frame, else None."""
    if exc is None or exc.rsplit(".", 1)[-1] not in _STORE_EXCS:
        return None
    if func not in _STORE_FUNCS and "/elastic/rendezvous/" not in path.replace("\\", "/"):
        return None
    return Hit("rendezvous", Category.COMM_FAILURE, COMM, "rendezvous", exc=exc)

