"""Emergency checkpoint of a sharded multi-rank run: DeepSpeed ZeRO (issue 26).

No rank holds the whole optimizer state (ZeRO-1/2) or the parameters (ZeRO-3), so every rank
must write its own shard of the last finished step N through DeepSpeed's own `save_checkpoint`,
which needs collectives. But when one rank hits a catchable OOM, its peers are inside, or about
to enter, a collective that it will never join (ZeRO-2: the gradient reduction in backward).
The coordinated save:

  1. Tell them out of band. The failing rank (the leader: the first to add 1 to `claim/<N>`)
     posts `sharded` = {step, rank, nonce} in the job's rendezvous store (the TCPStore that
     torchrun runs; replica.Channel). Every rank runs a watcher thread (its main thread may be
     blocked in gloo, which releases the GIL) that answers `<nonce>/phase/<r>` with its last
     finished step, whether it is inside an optimizer step, and its gloo listening ports. The
     leader decides (`<nonce>/decision`): save only if every rank answered within half the
     budget, every rank finished step N, and none is inside an optimizer step (then parameters
     or optimizer state may be half-updated: nothing is saved, the marker names the rank).
  2. Break the stuck collective. gloo (torch 2.14.1) has no abort that reaches a pending
     operation: `ProcessGroup.abort()`, `.shutdown()` and `destroy_process_group()` all return
     while a peer's `all_reduce` stays blocked until the group's timeout (measured: 25+ s, the
     default 30 min; torchft runs gloo in a subprocess for this reason). What gloo does handle
     is a connection that goes away: every pending and later operation on it fails at once with
     "Connection closed by peer" (the error a crashed peer causes). So each rank shuts down
     (`shutdown(2)`) its own gloo pair sockets: the TCP connections of this process to or from a
     gloo listening port (its own, or one a peer reported), never the store's. The blocked main
     thread gets that RuntimeError; the start-up hook's Trainer.train wrapper sees the watcher's
     flag and runs the save instead of re-raising. NCCL/RCCL: `ProcessGroup.abort()` (which
     calls ncclCommAbort, the documented way; `_abort_process_group`'s note: NCCL only) instead;
     that path is written to the API and not run here.
  3. A fresh group among the same ranks without new group objects: DeepSpeed, accelerate and
     the Trainer hold references to the existing ProcessGroup objects (DeepSpeed clones the
     world group; each ZeRO-3 parameter keeps its own), so each existing group gets a fresh
     backend of its kind, connected over a fresh store prefix (`<nonce>/pg/<group name>`),
     registered as its backend for every device type. (`ProcessGroup` keeps the first backend
     registered for a backend type, so the fresh one is registered under type CUSTOM and made
     the default: measured to carry all_reduce, all_gather and barrier on both the default and
     a cloned group after the break.)
  4. ZeRO-3 only: the broken step's parameter gathers stay in flight forever; their handles are
     forgotten unwaited (`settle_zero3`), or DeepSpeed's save, which first releases every
     gathered parameter, would wait on them and fail (measured).
  5. DeepSpeed's and the Trainer's own save, on every rank, staged: into
     `tmp-checkpoint-N/checkpoint-N`, checked by rank 0 (trainer_state.json, `latest`, one
     optimizer shard and one RNG file per rank), then renamed to `checkpoint-N`; a watchdog
     ends every rank once the budget (OOM_SUPERVISOR_EMERGENCY_BUDGET_S) is spent, leaving no
     `checkpoint-N`.

Afterwards the leader re-raises its OOM (the job's real error); a rank that was only pulled out
of its collective says so and waits for torchrun to end it (exiting itself would print a
connection error that reads like the job's cause; it ends itself only once the budget is over).
"""

import datetime
import json
import os
import shutil
import socket
import sys
import time
import traceback
import uuid

from . import emergency, replica, warn

_LISTEN, _NOT_PORTS = 0x0A, (0,)


STAGES = (1, 2, 3)  # stage 0 keeps the optimizer state in rank 0's model file: replica-like (not built)


def supported(trainer):
    return bool(getattr(trainer, "is_deepspeed_enabled", False)) and replica._zero_stage(trainer) in STAGES


def describe(trainer):
    stage = replica._zero_stage(trainer)
    return f"DeepSpeed ZeRO-{stage}"


# --- finding and breaking this process's gloo connections ----------------------------------

def _socket_fds():
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(link[8:-1])] = int(fd)
    return out


def _tcp_sockets():
    """(fd, state, local port, remote port) of this process's TCP sockets (IPv4 and IPv6)."""
    fds = _socket_fds()
    rows = []
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{name}") as fh:
                next(fh)
                for line in fh:
                    f = line.split()
                    inode = int(f[9])
                    if inode in fds:
                        rows.append((fds[inode], int(f[3], 16), int(f[1].rsplit(":", 1)[1], 16),
                                     int(f[2].rsplit(":", 1)[1], 16)))
        except OSError:
            continue
    return rows


def store_port(store):
    while store is not None and not hasattr(store, "port"):
        store = getattr(store, "underlying_store", None)
    return getattr(store, "port", None)


def gloo_ports(store):
    """This process's listening ports other than the store's: gloo's devices (one per group)."""
    skip = {store_port(store), *_NOT_PORTS}
    return sorted({lp for _fd, st, lp, _rp in _tcp_sockets() if st == _LISTEN and lp not in skip})


def break_gloo(store, peer_ports, mine=None):
    """Shut down this process's gloo pair sockets: a pending gloo operation fails at once.

    `mine`: this process's gloo listening ports as reported before any fresh backend existed."""
    mine = set(gloo_ports(store) if mine is None else mine)
    theirs = set(peer_ports) - {store_port(store), 0}
    shut = 0
    for fd, st, lp, rp in _tcp_sockets():
        if st == _LISTEN or not (lp in mine or rp in theirs):
            continue
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            shut += 1
        except OSError:
            pass
        finally:
            s.close()
    return shut


def break_groups(store, peer_ports, mine=None):
    """Make every pending collective of this process fail; returns what was done, in words."""
    from torch.distributed import distributed_c10d as c10d

    nccl = [pg for pg in list(c10d._world.pg_map) if _backend_name(pg) == "nccl"]
    for pg in nccl:  # ncclCommAbort: the documented way out of a stuck NCCL/RCCL collective
        pg.abort()
    shut = break_gloo(store, peer_ports, mine)
    parts = [f"{shut} gloo connection(s) shut down"]
    if nccl:
        parts.append(f"{len(nccl)} NCCL communicator(s) aborted")
    return ", ".join(parts)


def _backend_name(pg):
    from torch.distributed import distributed_c10d as c10d

    try:
        return str(c10d._world.pg_map[pg][0]).lower()
    except Exception:  # noqa: BLE001 - a group torch no longer lists: treated as gloo
        return "gloo"


def regroup(store, prefix, timeout_s):
    """A fresh backend in each existing process group, connected over `prefix` of the store."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=max(timeout_s, 1.0))
    groups = sorted(c10d._world.pg_names.items(), key=lambda kv: kv[1])
    for pg, name in groups:
        pstore = dist.PrefixStore(f"{prefix}/pg/{name}", store)
        if _backend_name(pg) == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            backend = dist.ProcessGroupNCCL(pstore, pg.rank(), pg.size(), opts)
        else:
            backend = dist.ProcessGroupGloo(pstore, pg.rank(), pg.size(), timeout)
        for device in pg._device_types:
            pg._register_backend(device, dist.ProcessGroup.BackendType.CUSTOM, backend)
        pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    return len(groups)


# --- the watcher: answers the leader, breaks this rank's collective -------------------------

class Watcher(replica.Watcher):
    """Every rank's: reports its phase to the leader and, on "go", breaks its own groups."""

    def __init__(self, channel, tracker):
        super().__init__(channel)
        self.tracker = tracker

    def poll(self):
        ch = self.channel
        if not ch.has(ch.key("sharded")):
            return
        req = json.loads(ch.get(ch.key("sharded")))
        if req["nonce"] in self.seen or req["rank"] == ch.rank:
            return
        self.seen.add(req["nonce"])
        report = self.report(int(req["step"]), float(req["wait_s"]))
        self.tracker.emergency = {"request": req}  # before anything breaks: the main thread checks it
        ch.store.set(ch.key(req["nonce"], "phase", ch.rank), json.dumps(report))
        decision = wait_json(ch, ch.key(req["nonce"], "decision"), time.monotonic() + float(req["budget_s"]))
        if decision is None or not decision.get("go"):
            return
        # Broken first, then the main thread may go on: a fresh backend it builds must not be broken too.
        broke = break_groups(ch.store, decision["ports"], mine=report["ports"])
        self.tracker.emergency.update(decision=decision, broke=broke)

    def report(self, step, wait_s):
        """This rank's phase for the leader: its last finished step, inside an optimizer step or not."""
        until = time.monotonic() + wait_s
        while True:  # this rank may still be finishing step `step` (its last collective is behind it)
            with self.lock:
                steps = sorted(self.history)
            unsafe = self.tracker.unsafe
            if (steps and steps[-1] >= step and unsafe is None) or time.monotonic() >= until:
                break
            time.sleep(0.05)
        return {"rank": self.channel.rank, "step": steps[-1] if steps else None, "unsafe": unsafe,
                "ports": gloo_ports(self.channel.store)}


def start(world, tracker):
    try:
        watcher = Watcher(replica.Channel.open(world), tracker)
        watcher.start()
        return watcher
    except Exception as exc:  # noqa: BLE001 - inside the user's training: no watcher means no sharded save
        warn(f"emergency checkpoint of a sharded run off: no store to reach the other ranks: {exc!r}")
        return None


def wait_json(channel, key, deadline):
    while not channel.has(key):
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
    return json.loads(channel.get(key))


# --- the leader (the rank whose OOM it is) --------------------------------------------------

def lead(channel, step, budget):
    """Ask every rank for its phase; publish and return the decision ({"go", "why", ...})."""
    nonce = uuid.uuid4().hex
    wait_s = budget / 2
    ports = gloo_ports(channel.store)
    channel.store.set(channel.key("sharded"), json.dumps(
        {"step": step, "rank": channel.rank, "nonce": nonce, "wait_s": wait_s / 2, "budget_s": budget}))
    until = time.monotonic() + wait_s
    reports, pending = {}, [r for r in range(channel.world) if r != channel.rank]
    while pending and time.monotonic() < until:
        for r in list(pending):
            if channel.has(channel.key(nonce, "phase", r)):
                reports[r] = json.loads(channel.get(channel.key(nonce, "phase", r)))
                pending.remove(r)
        time.sleep(0.05)
    why = _refusal(step, reports, pending, wait_s)
    decision = {"go": why is None, "why": why, "nonce": nonce, "step": step, "leader": channel.rank,
                "leader_node": socket.gethostname(),
                "ports": sorted({*ports, *(p for rep in reports.values() for p in rep["ports"])}),
                "phases": {str(r): reports[r] for r in sorted(reports)}}
    channel.store.set(channel.key(nonce, "decision"), json.dumps(decision))
    return decision


def _refusal(step, reports, pending, wait_s):
    if pending:
        return (f"rank(s) {sorted(pending)} did not report their phase within {wait_s:.1f} s: their shards "
                f"of step {step} cannot be written")
    for r in sorted(reports):
        rep = reports[r]
        if rep["unsafe"] is not None:
            return (f"rank {r} is inside its optimizer step ({rep['unsafe']}): its parameters and optimizer "
                    f"state may be half-updated, so saving them as step {step} would be wrong")
        if rep["step"] != step:
            return f"rank {r} last finished step {rep['step']}, not step {step}: the shards would not match"
    return None


# --- the save, on every rank ----------------------------------------------------------------

def save(trainer, tracker, decision, deadline):
    """Every rank: fresh backends, then DeepSpeed's and the Trainer's own save, staged; rank 0 renames.

    Returns (path, regroup seconds); raises on failure (rank 0 then removes the staging)."""
    import torch.distributed as dist

    channel = tracker.watcher.channel
    t0 = time.monotonic()
    prefix = channel.key(decision["nonce"])
    groups = regroup(channel.store, prefix, deadline - time.monotonic())
    dist.barrier()
    regroup_s = time.monotonic() - t0
    rank, world = dist.get_rank(), dist.get_world_size()
    step = decision["step"]
    run_dir = emergency._run_dir(trainer)
    final = os.path.join(run_dir, f"checkpoint-{step}")
    staging = os.path.join(run_dir, f"tmp-checkpoint-{step}")
    produced = os.path.join(staging, f"checkpoint-{step}")
    if rank == 0:
        if os.path.isdir(final) and not os.path.isfile(os.path.join(final, emergency.STATE_FILE)):
            emergency._quarantine(final)  # a regular save the OOM cut off: never mistaken for complete
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    if tracker.snap is not None:
        emergency._restore(trainer, tracker.snap)
    settle_zero3(trainer)
    trainer._get_output_dir = lambda trial=None: staging  # the save (and its rotation) stays inside
    try:
        trainer._save_checkpoint(trainer.model_wrapped, trial=None)
    finally:
        del trainer._get_output_dir
    # Each rank's own part, for the note: how long its save took and on which node it wrote its shard
    channel.store.set(channel.key(decision["nonce"], "saved", rank),
                      json.dumps({"save_s": round(time.monotonic() - t0, 3), "node": socket.gethostname()}))
    dist.barrier()
    ok_key = channel.key(decision["nonce"], "renamed")
    if rank == 0:
        try:
            _check(produced, step, world)
            note = {**_note(trainer, decision, world), "regroup_s": round(regroup_s, 3), "groups": groups,
                    "save_s": round(time.monotonic() - t0, 3), "ranks": _per_rank(channel, decision["nonce"], world)}
            with open(os.path.join(produced, emergency.NOTE_FILE), "w") as fh:
                json.dump(note, fh, indent=1)
            emergency._fsync_tree(produced)
            os.rename(produced, final)
            emergency._fsync_dir(run_dir)
            shutil.rmtree(staging, ignore_errors=True)
            channel.store.set(ok_key, "ok")
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            channel.store.set(ok_key, f"{type(exc).__name__}: {exc}")
            raise
    result = wait_json_raw(channel, ok_key, deadline)
    if result != "ok":
        raise RuntimeError(f"rank 0 did not complete {final}: {result or 'no answer before the budget ran out'}")
    try:  # what a regular save does next (e.g. LLaMA-Factory saves the tokenizer/processor)
        trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
    except Exception as exc:  # noqa: BLE001 - the checkpoint is written; a user callback's failure must not undo it
        warn(f"on_save callbacks after the emergency checkpoint failed: {exc!r}")
    return final, regroup_s


def wait_json_raw(channel, key, deadline):
    while not channel.has(key):
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
    return channel.get(key).decode(errors="replace")


def settle_zero3(trainer):
    """ZeRO-3: the broken step's parameter gathers never finish; forget their handles unwaited.

    DeepSpeed's save first releases every gathered parameter (`release_and_reset_all`), which
    waits on each in-flight gather: on a broken connection that raises. The gathered data is not
    saved (the fp32 partitions in the optimizer are), so an in-flight parameter is taken as
    gathered and released like any other."""
    offload = getattr(getattr(getattr(trainer, "model_wrapped", None), "optimizer", None), "parameter_offload", None)
    if offload is None:
        return 0
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    coordinator = offload.get_param_coordinator()
    registry = getattr(coordinator, "_PartitionedParameterCoordinator__inflight_param_registry", None)
    if registry is not None:
        registry.clear()
    n = 0
    for param in trainer.model_wrapped.module.parameters():
        if getattr(param, "ds_status", None) == ZeroParamStatus.INFLIGHT:
            param.ds_status = ZeroParamStatus.AVAILABLE
            n += 1
    return n


def _check(produced, step, world):
    """What makes a DeepSpeed checkpoint complete: the Trainer's state, `latest`, every rank's files."""
    missing = [n for n in (emergency.STATE_FILE, "latest") if not os.path.isfile(os.path.join(produced, n))]
    missing += [f"rng_state_{r}.pth" for r in range(world)
                if not os.path.isfile(os.path.join(produced, f"rng_state_{r}.pth"))]
    tag_dir = os.path.join(produced, f"global_step{step}")
    shards = [n for n in (os.listdir(tag_dir) if os.path.isdir(tag_dir) else ()) if n.endswith("_optim_states.pt")]
    if len(shards) != world:
        missing.append(f"{world} optimizer shards in global_step{step} (found {len(shards)})")
    if missing:
        raise RuntimeError(f"the save left {produced} without {', '.join(missing)}")


def _per_rank(channel, nonce, world):
    """Every rank's {"save_s", "node"} (each set its own before the barrier rank 0 has passed)."""
    per = {}
    for r in range(world):
        key = channel.key(nonce, "saved", r)
        if channel.has(key):
            per[str(r)] = json.loads(channel.get(key))
    return per


def _note(trainer, decision, world):
    return {"step": decision["step"], "failing_rank": decision["leader"], "failing_node": decision.get("leader_node"),
            "world_size": world,
            "sharded": describe(trainer), "shards_from_ranks": list(range(world)),
            "phases": decision["phases"], "budget_s": replica.budget_s()}


# --- entry points from emergency.py ---------------------------------------------------------

def on_oom(trainer, tracker, exc, step, who):
    """The failing rank: coordinate, save its own shard, return (the OOM is re-raised after)."""
    rank, world, what, freed = who
    say, last = emergency.say, "the last regular checkpoint is the resume point"
    if tracker.watcher is None:
        say(f"no emergency checkpoint: {what} on rank {rank} of {world}: no store to reach the other ranks "
            f"(see the hook's warning at start); {last}")
        return
    budget = replica.budget_s()
    deadline = time.monotonic() + budget
    channel = tracker.watcher.channel
    if channel.store.add(channel.key("claim", step), 1) > 1:  # another rank's OOM leads: save with it
        _follow(trainer, tracker, exc, rank, world, deadline)
        return
    t0 = time.monotonic()
    decision = lead(channel, step, budget)
    if not decision["go"]:
        say(f"no emergency checkpoint: {what} on rank {rank} of {world} ({describe(trainer)}): "
            f"{decision['why']}; {last}")
        return
    final = os.path.join(emergency._run_dir(trainer), f"checkpoint-{step}")
    say(f"emergency checkpoint: saving step {step} to {final} (after {what} on rank {rank} of {world}; "
        f"every rank writes its {describe(trainer)} shard; {freed})")
    broke = break_groups(channel.store, decision["ports"])
    with replica.Watchdog(deadline - time.monotonic(), lambda: _expired(step, final, budget, exc, True)):
        try:
            path, regroup_s = save(trainer, tracker, decision, deadline)
        except Exception as err:  # noqa: BLE001 - the save failed: say so and let the OOM end the run as it would have
            say(f"emergency checkpoint at step {step} failed: {type(err).__name__}: {err}")
            return
    say(f"emergency checkpoint: shards of step {step} from ranks {list(range(world))} of {world} "
        f"({describe(trainer)}); collectives broken ({broke}), a fresh backend in each process group "
        f"after {regroup_s:.1f} s")
    say(f"emergency checkpoint at step {step}: {path} (saved in {time.monotonic() - t0:.1f} s)")


def _follow(trainer, tracker, exc, rank, world, deadline):
    """A second failing rank: its watcher reports its phase; it saves its shard with the leader."""
    while time.monotonic() < deadline and "decision" not in (tracker.emergency or {}):
        if (tracker.emergency or {}).get("request") and _decided_no(tracker):
            return
        time.sleep(0.05)
    if "decision" in (tracker.emergency or {}):
        join(trainer, tracker, exc, park=False)


def _decided_no(tracker):
    req = tracker.emergency["request"]
    ch = tracker.watcher.channel
    decision = ch.has(ch.key(req["nonce"], "decision")) and json.loads(ch.get(ch.key(req["nonce"], "decision")))
    return bool(decision) and not decision.get("go")


def join(trainer, tracker, exc, park=True):
    """A rank pulled out of its collective (or a second failing one): write its shard, then wait."""
    decision = tracker.emergency["decision"]
    rank, world, step = replica._rank(), int(os.environ.get("WORLD_SIZE", "1")), decision["step"]
    budget = replica.budget_s()
    deadline = time.monotonic() + budget
    emergency.release_memory(trainer, exc)
    final = os.path.join(emergency._run_dir(trainer), f"checkpoint-{step}")
    # The error's own text is left out: it reads like a crashed peer, and the log's reader must not take it
    # for the job's cause.
    emergency.say(f"emergency checkpoint: rank {rank} of {world} left its collective (broken on purpose: "
                  f"{type(exc).__name__}) to write its shard of step {step} for rank {decision['leader']}'s OOM")
    with replica.Watchdog(deadline - time.monotonic(), lambda: _expired(step, final, budget, exc, False)):
        try:
            save(trainer, tracker, decision, deadline)
            emergency.say(f"emergency checkpoint: rank {rank} of {world} wrote its shard of step {step} to {final}")
        except Exception as err:  # noqa: BLE001 - the leader says the outcome; this rank only says why it stopped
            emergency.say(f"emergency checkpoint: rank {rank} of {world} could not write its shard of step "
                          f"{step}: {type(err).__name__}: {err}")
    if park:  # torchrun ends this rank once the leader exits with its OOM; never print a cause of our own
        time.sleep(max(deadline - time.monotonic(), 0.0) + 30.0)
        os._exit(1)


def _expired(step, final, budget, exc, leader):
    emergency.discard(os.path.join(os.path.dirname(final), f"tmp-checkpoint-{step}"))  # whichever rank is first
    if leader:
        emergency.say(f"emergency checkpoint at step {step} failed: not done within the budget of {budget:.0f} s "
                      f"({replica.BUDGET_ENV}); no {final} was left, and its unfinished staging was removed")
        traceback.print_exception(exc)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def on_broken(trainer, tracker, exc):
    """The main thread's exception on a rank the leader asked in: join the save (True), else False."""
    if tracker.emergency is None or tracker.watcher is None:
        return False
    req = tracker.emergency["request"]
    deadline = time.monotonic() + float(req["budget_s"]) / 2
    while "decision" not in tracker.emergency:  # the leader's own break may reach us before our watcher reads "go"
        if time.monotonic() >= deadline or _decided_no(tracker):
            return False
        time.sleep(0.05)
    join(trainer, tracker, exc)
    return True
