"""Emergency checkpoint of a replicated multi-rank run: DDP, LoRA under DDP (issue 26).

Under DDP every rank holds the whole model, optimizer and scheduler state of the last finished
step N, so the rank that hit the OOM (its main thread is free, the others are blocked in a
collective it will never join) can write checkpoint-N alone, as if it were process 0, without
any collective. Only the RNG state is per rank (`rng_state_{r}.pth`): rank r's is known to rank
r only. So every rank runs a small daemon thread (`Watcher`) that polls the job's own
rendezvous store (the default process group's TCPStore, reachable across nodes; its main thread
may be blocked in gloo/NCCL, a thread still runs) for a request "emergency save of step N" and
answers with its step-N snapshot (RNG, FLOs; taken by the tracker at each step's end, the
last KEEP_STEPS kept: under NCCL a rank's CPU can run ahead of the stuck all-reduce),
`torch.save`d to bytes. The store carries, under `oom-supervisor/emergency/<restart>/`:
  claim/<N>          an atomic counter: the first failing rank to add 1 writes, others wait
  request            {"step", "rank", "nonce"} (JSON) from the writer
  <nonce>/rng/<r>    rank r's answer: b"S" + torch.save bytes, or b"R" + why it refuses
  <nonce>/done       the writer finished (saved or not): a second failing rank may exit now
The writer waits for the answers at most half of the budget (OOM_SUPERVISOR_EMERGENCY_BUDGET_S,
default 300 s: below NCCL's default 10 min collective timeout, after which the blocked ranks
abort and torchrun tears the writer down; room for a multi-GB replica's save). A rank that does
not answer in time means NO save: without its RNG file resume is not bit-exact for that rank,
and the supervisor's completeness scan (run/checkpoints.py) calls a checkpoint missing a rank's
RNG file incomplete (a regular save cut off looks the same), so it would never be resumed from.
The whole save is bounded by the budget: a watchdog prints the failure and the original
traceback, removes the unfinished tmp-checkpoint-N (a large model's half-written files would hold
the disk all night) and ends the process (`os._exit(1)`) if it is over.

During the save the writer is made the writer, temporarily (`writer_scope`, restored after):
`args.should_save` is True (a class-level property patch: `torch.save(args)` must still pickle),
`store_flos` sums the FLOs the ranks reported instead of all-gathering them, `dist.barrier`
(only there to wait for process 0's weights) is a no-op, every other collective raises, and
`_save_rng_state` writes each rank's file from its answer. The result has exactly the files of
a regular N-rank save, plus `oom-supervisor-emergency.json` saying what came from which rank.

Sharded state: DeepSpeed ZeRO-1/2/3 is sharded.py's (every rank writes its own shard); FSDP is
not built.
DeepSpeed at stage 0 is refused too: its `save_checkpoint` synchronises ranks through its own
communication layer, which the writer cannot bypass safely.
"""

import atexit
import contextlib
import io
import json
import os
import threading
import time
import uuid

from . import warn

BUDGET_ENV = "OOM_SUPERVISOR_EMERGENCY_BUDGET_S"
DEFAULT_BUDGET_S = 300.0
POLL_S = 0.5
KEEP_STEPS = 8  # a few KB each (Python, NumPy, CPU and per-GPU RNG states)
_ROOT = "oom-supervisor/emergency"
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
                "broadcast_object_list", "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
                "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "monitored_barrier")


def budget_s():
    raw = os.environ.get(BUDGET_ENV, "").strip()
    if not raw:
        return DEFAULT_BUDGET_S
    try:
        value = float(raw)
        if value <= 0:
            raise ValueError
        return value
    except ValueError:
        warn(f"{BUDGET_ENV}={raw!r} is not a positive number of seconds; using {DEFAULT_BUDGET_S:.0f}")
        return DEFAULT_BUDGET_S


def sharded(trainer):
    """Why this run's state is not replicated on every rank (no replica save), or None."""
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP shards parameters and optimizer state: every rank must write its own shard; not built yet"
    if getattr(trainer, "is_deepspeed_enabled", False):
        stage = _zero_stage(trainer)
        if stage:
            return (f"DeepSpeed ZeRO-{stage} shards the optimizer state{' and parameters' if stage == 3 else ''}: "
                    f"every rank must write its own shard; not built yet")
        return ("DeepSpeed's save_checkpoint synchronises the ranks through its own communication layer "
                "even at ZeRO stage 0; a one-rank save is not built yet")
    return None


def _zero_stage(trainer):
    try:
        return int(trainer.accelerator.state.deepspeed_plugin.zero_stage)
    except Exception:  # noqa: BLE001 - an unknown stage is reported as sharded: never a wrong one-rank save
        return "?"


def _rank():
    return int(os.environ.get("RANK", "0"))


class Channel:
    """Our keys in the job's rendezvous store (the default process group's, else MASTER_ADDR:PORT)."""

    def __init__(self, store, rank, world):
        self.store, self.rank, self.world = store, rank, world
        self.prefix = f"{_ROOT}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    @classmethod
    def open(cls, world):
        import torch.distributed as dist

        store = None
        if dist.is_available() and dist.is_initialized():
            from torch.distributed import distributed_c10d

            store = distributed_c10d._get_default_store()
        if store is None:
            import datetime

            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
        return cls(store, _rank(), world)

    def key(self, *parts):
        return "/".join((self.prefix, *map(str, parts)))

    def has(self, key):
        return self.store.check([key])

    def get(self, key):
        return bytes(self.store.get(key))


class Watcher(threading.Thread):
    """Answers the writer's request with this rank's step-N snapshot, from a daemon thread."""

    def __init__(self, channel):
        super().__init__(name="oom-supervisor-emergency-watcher", daemon=True)
        self.channel = channel
        self.stop = threading.Event()
        self.seen = set()
        self.lock = threading.Lock()
        self.history = {}  # step -> snapshot of that step's end, the last KEEP_STEPS steps

    def start(self):
        super().start()
        atexit.register(self.close)

    def close(self, timeout=2.0):
        """Stopped and joined before the interpreter finalizes: a daemon thread left inside a store
        call while the store's C++ client is torn down ends the process with std::terminate (seen:
        'terminate called without an active exception', SIGABRT, on a rank whose training had
        finished, after its checkpoints were complete), and the supervisor took a finished run for a crash."""
        self.stop.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout)

    def run(self):
        while not self.stop.wait(POLL_S):
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - a lost watcher only means no replica save; never the user's run
                warn(f"emergency checkpoint watcher on rank {self.channel.rank} stopped: {exc!r}")
                return

    def poll(self):
        ch = self.channel
        if not ch.has(ch.key("request")):
            return
        req = json.loads(ch.get(ch.key("request")))
        if req["nonce"] in self.seen or req["rank"] == ch.rank:
            return
        self.seen.add(req["nonce"])
        ch.store.set(ch.key(req["nonce"], "rng", ch.rank), self.answer(int(req["step"]), float(req["wait_s"])))

    def keep(self, snap):
        """Called at each step's end: under NCCL a rank's CPU may run a few steps ahead of the
        all-reduce that will never finish, so the step the writer asks for may not be the last."""
        with self.lock:
            self.history[snap["step"]] = snap
            while len(self.history) > KEEP_STEPS:
                del self.history[min(self.history)]

    def answer(self, step, wait_s):
        """The snapshot of `step`'s end; this rank may still be finishing that step: wait for it."""
        import torch

        until = time.monotonic() + wait_s
        while True:
            with self.lock:
                snap, steps = self.history.get(step), sorted(self.history)
            if snap is not None or (steps and steps[-1] > step) or time.monotonic() >= until:
                break
            time.sleep(0.05)
        if snap is None:
            have = f"steps {steps[0]}-{steps[-1]}" if steps else "none"
            return f"R rank {self.channel.rank} has no snapshot of step {step} (it has {have})".encode()
        buf = io.BytesIO()
        torch.save(snap, buf)
        return b"S" + buf.getvalue()


def start(world):
    """Open the channel and start this rank's watcher; None (said) when the store is out of reach."""
    try:
        channel = Channel.open(world)
        watcher = Watcher(channel)
        watcher.start()
        return watcher
    except Exception as exc:  # noqa: BLE001 - inside the user's training: no watcher means no replica save
        warn(f"emergency checkpoint of a replica off for this run: no store to reach the other ranks: {exc!r}")
        return None


def collect(channel, step, wait_s):
    """Ask every other rank for its step-`step` snapshot; ({rank: snap}, {rank: why missing})."""
    import torch
    from transformers.trainer_pt_utils import safe_globals

    nonce = uuid.uuid4().hex
    channel.store.set(channel.key("request"), json.dumps(
        {"step": step, "rank": channel.rank, "nonce": nonce, "wait_s": wait_s}))
    until = time.monotonic() + wait_s
    got, why = {}, {}
    pending = [r for r in range(channel.world) if r != channel.rank]
    while pending and time.monotonic() < until:
        for r in list(pending):
            key = channel.key(nonce, "rng", r)
            if not channel.has(key):
                continue
            raw = channel.get(key)
            pending.remove(r)
            if raw[:1] == b"S":
                with safe_globals():  # what transformers allows when it loads an rng_state file
                    got[r] = torch.load(io.BytesIO(raw[1:]), map_location="cpu", weights_only=True)
            else:
                why[r] = raw[1:].decode(errors="replace")
        time.sleep(0.05)
    for r in pending:
        why[r] = f"rank {r} did not answer within {wait_s:.1f} s"
    return got, why


@contextlib.contextmanager
def writer_scope(trainer, own_snap, answers):
    """Make this rank the only writer of a regular N-rank save, for the save's duration only."""
    import torch
    import torch.distributed as dist

    args_cls = type(trainer.args)
    saved_prop = args_cls.__dict__.get("should_save", _MISSING)
    saved_dist = {name: getattr(dist, name) for name in ("barrier", *_COLLECTIVES) if hasattr(dist, name)}
    original_rng = trainer._save_rng_state

    def store_flos():  # what distributed_broadcast_scalars(...).sum() gives, from the ranks' reports
        flos = [s.get("flos") or 0 for s in (own_snap, *answers.values())]
        trainer.state.total_flos += sum(flos)
        trainer.current_flos = 0

    def save_rng_state(output_dir):
        original_rng(output_dir)  # this rank's file, from its restored step-N state
        for r, snap in answers.items():
            rng = {k: snap[k] for k in ("python", "numpy", "cpu", "cuda") if k in snap}
            torch.save(rng, os.path.join(output_dir, f"rng_state_{r}.pth"))

    def refuse(name):
        def collective(*a, **kw):
            raise RuntimeError(f"torch.distributed.{name} during a one-rank emergency save: the other ranks "
                               f"cannot join it")
        return collective

    args_cls.should_save = property(lambda self: True)
    for name in saved_dist:
        setattr(dist, name, (lambda *a, **kw: None) if name == "barrier" else refuse(name))
    trainer.store_flos, trainer._save_rng_state = store_flos, save_rng_state
    try:
        yield
    finally:
        del trainer.store_flos, trainer._save_rng_state
        for name, fn in saved_dist.items():
            setattr(dist, name, fn)
        if saved_prop is _MISSING:
            del args_cls.should_save
        else:
            args_cls.should_save = saved_prop


_MISSING = object()


class Watchdog:
    """Ends the process if the save is not done by the deadline: a hung save must not hold the night."""

    def __init__(self, seconds, on_expiry):
        self.timer = threading.Timer(max(seconds, 0.0), on_expiry)
        self.timer.daemon = True

    def __enter__(self):
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()
        return False
