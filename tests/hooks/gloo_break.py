"""Two gloo ranks, no training: what breaks a collective that one rank will never join (sharded.py).

Rank 0 blocks in an all_reduce on a cloned group (as DeepSpeed's reductions do); rank 1 never
joins it. A thread of rank 0 first tries torch's own ProcessGroup.abort() and .shutdown(), then
sharded.break_groups(); both ranks then put a fresh backend into every existing group
(sharded.regroup) and run collectives on the same group objects. Prints one JSON line per rank.
"""

import datetime
import json
import os
import threading
import time

import torch
import torch.distributed as dist
from oom_supervisor_hooks import sharded
from torch.distributed import distributed_c10d as c10d

dist.init_process_group("gloo")
rank = dist.get_rank()
clone = dist.new_group(ranks=[0, 1])
store = c10d._get_default_store()
ports = sharded.gloo_ports(store)
store.set(f"test/ports/{rank}", json.dumps(ports))
peer = json.loads(store.get(f"test/ports/{1 - rank}"))
result = {"rank": rank, "ports": ports}
if rank == 0:
    def breaker():
        time.sleep(1.0)
        for pg in (clone, c10d._get_default_group()):
            pg.abort()
            pg.shutdown()
        time.sleep(float(os.environ.get("ABORT_WAIT_S", "3")))
        result["pending_after_abort"] = not done.is_set()
        # From here on either rank may break first (rank 1 breaks its side once told): the clock starts
        # before telling it (seen in CI: rank 1's break ended the op before rank 0's own was timed).
        result["broke_at"] = time.monotonic()
        store.set("test/aborted", "1")
        time.sleep(float(os.environ.get("BREAK_LAG_S", "0")))  # rank 1's break may end the op first
        result["broke"] = sharded.break_groups(store, peer, mine=ports)

    done = threading.Event()
    breaking = threading.Thread(target=breaker, daemon=True)
    breaking.start()
    try:
        dist.all_reduce(torch.ones(8), group=clone)
        result["stuck_op"] = "returned"
    except RuntimeError as exc:
        result["stuck_op"] = str(exc).split("]", 1)[-1].strip()[:40]
        raised = time.monotonic()
        result["raised_after_break_s"] = round(raised - result["broke_at"], 3) if "broke_at" in result else None
    done.set()
    # Broken first, then fresh backends (as sharded.Watcher lets the main thread go on): a break still
    # under way would shut the fresh backend's connections (seen in CI: gloo's accept() aborted rank 0).
    breaking.join()
else:
    store.wait(["test/aborted"], datetime.timedelta(seconds=60))  # rank 0 tries torch's own abort first
    result["broke"] = sharded.break_groups(store, peer, mine=ports)  # as the leader tells every rank to
t0 = time.monotonic()
result["groups"] = sharded.regroup(store, "test/fresh", 30)
x = torch.tensor([rank + 1.0])
dist.all_reduce(x)
y = [torch.zeros(1), torch.zeros(1)]
dist.all_gather(y, torch.tensor([float(rank)]), group=clone)
dist.barrier(group=clone)
result.update(default_sum=x.item(), clone_gather=[t.item() for t in y], clone_rank=dist.get_rank(group=clone),
              regroup_s=round(time.monotonic() - t0, 3))
# One write: both ranks share torchrun's stdout, unbuffered, and print() writes the text and its
# newline apart (seen in CI: rank 0's line glued onto rank 1's before its newline).
os.write(1, ("RESULT " + json.dumps(result) + "\n").encode())
dist.barrier()
os._exit(0)
