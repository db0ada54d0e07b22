"""Emergency checkpoint: lose no finished optimizer step to a catchable OOM (issue 13).

Installed after `import transformers.trainer` when OOM_SUPERVISOR_EMERGENCY_CKPT=1. It wraps
`Trainer.train` (subclasses such as LLaMA-Factory's inherit it) and adds a callback that knows
where in the step the run is. When train() raises a catchable OOM (torch.OutOfMemoryError on
CUDA/HIP, or PyTorch's CPU allocator failure) in a run with ONE process (several: see below):

  1. memory is released: the traceback's frames (activations, the batch, the graph) are
     cleared, gradients dropped (`zero_grad(set_to_none=True)` on model and optimizer),
     `gc.collect()`, `torch.cuda.empty_cache()`;
  2. the Trainer's own `_save_checkpoint` writes checkpoint-N of the LAST FINISHED step N
     (weights, optimizer, scheduler, trainer state, RNG) into `<output_dir>/tmp-checkpoint-N/`,
     and only a finished save (trainer_state.json present, files fsynced) is renamed to
     `<output_dir>/checkpoint-N`. A failed save is removed and leaves no `checkpoint-N`;
  3. the original exception is re-raised: the process still exits non-zero with the real
     traceback (what the supervisor's diagnosis reads), after the marker lines below.

The optimizer state is step N's only if the OOM came before the optimizer step of N+1
(forward/backward, including a partial gradient accumulation, which is discarded: exactly
what resuming at N means). From `on_pre_optimizer_step` (and, under DeepSpeed, from the entry
of `engine.step()`, which accelerate calls inside backward) until `on_step_end`, parameters and
optimizer state may be half-updated: then nothing is saved, and the marker says why. State the
trainer accumulates per micro-batch (tokens seen, FLOs, RNG) is restored to its value at the end
of step N first, so the checkpoint equals the one a regular save at step N would have written.

Multi-rank (WORLD_SIZE > 1), replicated state (DDP, LoRA under DDP; replica.py): the failing
rank writes checkpoint-N alone, with no collective (the others wait in one it will not join),
made the writer for the save's duration; the other ranks' RNG state of step N comes from a
watcher thread of each rank through torchrun's store. The same rules hold (step N's state only,
staging and rename); in addition a rank that does not answer within the budget
(OOM_SUPERVISOR_EMERGENCY_BUDGET_S) means no save, the whole save is bounded by that budget, and
the rank exits (so torchrun tears the others down) only once the save is done. Two ranks that
fail at once: the first to claim the step writes, the other waits for it. Sharded state,
DeepSpeed ZeRO-1/2/3 (sharded.py): every rank writes its own shard through DeepSpeed's own save,
after the failing rank has told the others through the store and their stuck collective was
broken on purpose. FSDP, DeepSpeed stage 0: nothing is saved, and the marker says why.

Marker lines (stdout, each starting a line of its own; `supervisor.hooks.markers` reads them):
  oom-supervisor: emergency checkpoint: saving step N to <output_dir>/checkpoint-N (after <what>; <freed>)
  oom-supervisor: emergency checkpoint: moved the incomplete <path> (a regular save ...) to <dest>
  oom-supervisor: emergency checkpoint: replica of rank R of W: ...; RNG from ranks [0, 1, ...]
  oom-supervisor: emergency checkpoint at step N: <path> (saved in <s> s)
  oom-supervisor: emergency checkpoint: rank R of W leaves the save of step N to the rank that claimed it first
  oom-supervisor: emergency checkpoint at step N: <path> (already saved by the regular schedule)
  oom-supervisor: emergency checkpoint: shards of step N from ranks [0, 1, ...] of W (DeepSpeed ZeRO-S); ...
  oom-supervisor: emergency checkpoint: rank R of W left its collective (broken on purpose: ...) to write ...
  oom-supervisor: emergency checkpoint at step N failed: <ExceptionType>: <message>
  oom-supervisor: no emergency checkpoint: <why>
Nothing else is changed: no training setting, no regular save, no rotation of older checkpoints
(the save's rotation runs inside the staging folder).
"""

import contextlib
import gc
import json
import os
import random
import shutil
import sys
import time
import traceback

from . import warn

PREFIX = "oom-supervisor:"
STATE_FILE = "trainer_state.json"
NOTE_FILE = "oom-supervisor-emergency.json"  # inside a checkpoint written by a replica (several ranks)
QUARANTINE_DIR = ".supervisor-quarantine"  # the supervisor's own (checkpoints.py); not `checkpoint-*`
_CPU_OOM = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")
_GPU_OOM = ("CUDA out of memory.", "HIP out of memory.")  # old torch raised a plain RuntimeError


def say(msg):
    """One marker line, always at the start of a line (a progress bar may have left the cursor
    mid-line, e.g. tqdm's `44%|...| 8/18 [...]` on stderr): hence the leading newline."""
    sys.stderr.flush()
    sys.stdout.write(f"\n{PREFIX} {msg}\n")
    sys.stdout.flush()


def install(trainer_module):
    trainer_cls = trainer_module.Trainer
    if getattr(trainer_cls.train, "_oom_supervisor", False):
        return
    original = trainer_cls.train

    def train(self, *args, **kwargs):
        try:
            tracker = _tracker(self)
        except Exception as exc:  # noqa: BLE001 - inside the user's training: no tracker means no emergency save, never a failed run
            warn(f"emergency checkpoint off for this run: {exc!r}")
            return original(self, *args, **kwargs)
        try:
            return original(self, *args, **kwargs)
        except BaseException as exc:
            kind = oom_kind(exc)
            if kind is None and not tracker.handled and tracker.emergency is not None:
                tracker.handled = True  # another rank's OOM broke this rank's collective on purpose
                from . import sharded

                sharded.on_broken(self, tracker, exc)  # writes this rank's shard, then waits to be ended
            if kind is None or tracker.handled:
                raise
            tracker.handled = True  # one emergency save per process, even if the caller retries
            try:
                on_oom(self, tracker, exc, kind)
            except BaseException as inner:  # noqa: BLE001 - never hide the OOM behind our own failure: it is re-raised next
                say(f"emergency checkpoint at step {_step(self)} failed: {type(inner).__name__}: {inner}")
            raise

    train.__wrapped__ = original
    train.__doc__ = original.__doc__
    train.__name__ = original.__name__
    train.__qualname__ = original.__qualname__
    train._oom_supervisor = True
    trainer_cls.train = train


def oom_kind(exc):
    """'gpu' / 'cpu' for a catchable OOM (the exception or one it was raised from), else None."""
    torch = sys.modules.get("torch")
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None))
                      if isinstance(t, type))
    seen = 0
    while exc is not None and seen < 8:
        if oom_types and isinstance(exc, oom_types):
            return "gpu"
        if isinstance(exc, RuntimeError):
            text = str(exc)
            if any(s in text for s in _CPU_OOM):
                return "cpu"
            if any(s in text for s in _GPU_OOM):
                return "gpu"
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def _step(trainer):
    return getattr(getattr(trainer, "state", None), "global_step", "?")


def _world_size(trainer):
    try:
        return int(trainer.args.world_size)
    except Exception:  # noqa: BLE001 - a trainer without args.world_size: fall back to the launcher's WORLD_SIZE
        try:
            return int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            return 1


# --- where in the step are we ---------------------------------------------------------------

def _tracker(trainer):
    tracker = getattr(trainer, "_oom_supervisor_tracker", None)
    if tracker is None:
        tracker = _make_tracker(trainer)
        trainer._oom_supervisor_tracker = tracker
        trainer.add_callback(tracker)
    return tracker


def _make_tracker(trainer):
    from transformers import TrainerCallback

    class EmergencyTracker(TrainerCallback):
        """Snapshots what a save at the end of each step would write; marks unsafe windows."""

        def __init__(self):
            self.handled = False
            self.started_at = None  # global_step when train() began (the resumed step, or 0)
            self.finished = 0  # optimizer steps finished in this process
            self.unsafe = None  # why the optimizer/parameter state may be half-updated, or None
            self.snap = None
            self.watcher = None  # answers a replica's (replica.py) or a sharded (sharded.py) emergency save
            self.emergency = None  # set by a sharded run's watcher: another rank's OOM asked this rank in

        def on_train_begin(self, args, state, control, **kw):
            self.started_at, self.finished, self.unsafe = state.global_step, 0, None
            world = _world_size(trainer)
            if world > 1 and self.watcher is None:
                from . import replica, sharded

                if replica.sharded(trainer) is None:
                    self.watcher = replica.start(world)
                elif sharded.supported(trainer):
                    self.watcher = sharded.start(world, self)
            if getattr(trainer, "is_deepspeed_enabled", False):
                # accelerate runs DeepSpeed's optimizer step inside backward (engine.step())
                _watch_step(getattr(trainer, "model_wrapped", None), trainer, self)
            if not hasattr(TrainerCallback, "on_pre_optimizer_step"):  # older transformers
                _watch_step(getattr(trainer, "optimizer", None), trainer, self)
            self.snap = None

        def on_pre_optimizer_step(self, args, state, control, **kw):
            self.mark_unsafe(state)

        def mark_unsafe(self, state):
            if self.unsafe is None:
                self.unsafe = f"the OOM hit the optimizer step of step {state.global_step + 1}"

        def on_step_end(self, args, state, control, **kw):
            self.unsafe = None
            self.finished += 1
            self.snap = _snapshot(trainer)
            if self.watcher is not None:
                self.watcher.keep(self.snap)

        def on_train_end(self, args, state, control, **kw):
            if self.watcher is not None:  # joined: no store call of ours may be running at exit
                self.watcher.stop.set()
                self.watcher.join(timeout=5)
                if self.watcher.is_alive():  # then a crash at exit may be ours: say so in the log
                    warn(f"emergency checkpoint watcher on rank {self.watcher.channel.rank} still in a store "
                         "call 5 s after the training ended")
                self.watcher = None

    return EmergencyTracker()


def _watch_step(obj, trainer, tracker):
    """Mark the state unsafe from the moment `obj.step()` starts (until the step's end)."""
    step = getattr(obj, "step", None)
    if step is None or getattr(step, "_oom_supervisor", False):
        return

    def watched(*args, **kwargs):
        tracker.mark_unsafe(trainer.state)
        return step(*args, **kwargs)

    watched._oom_supervisor = True
    obj.step = watched


def _snapshot(trainer):
    import numpy as np
    import torch

    snap = {"python": random.getstate(), "numpy": np.random.get_state(),
            "cpu": torch.random.get_rng_state(),
            "tokens": getattr(trainer.state, "num_input_tokens_seen", None),
            "flos": getattr(trainer, "current_flos", None), "step": trainer.state.global_step}
    if torch.cuda.is_initialized():
        snap["cuda"] = torch.cuda.random.get_rng_state_all()
    return snap


def _restore(trainer, snap):
    import numpy as np
    import torch

    random.setstate(snap["python"])
    np.random.set_state(snap["numpy"])
    torch.random.set_rng_state(snap["cpu"])
    if "cuda" in snap:
        torch.cuda.random.set_rng_state_all(snap["cuda"])
    if snap["tokens"] is not None:
        trainer.state.num_input_tokens_seen = snap["tokens"]
    if snap["flos"] is not None:
        trainer.current_flos = snap["flos"]


# --- the OOM path ---------------------------------------------------------------------------

def on_oom(trainer, tracker, exc, kind):
    from . import peak

    peak.record("oom")
    step = _step(trainer)
    world = _world_size(trainer)
    what = "a GPU OOM" if kind == "gpu" else "a CPU-allocator OOM"
    if world > 1:
        _on_oom_replica(trainer, tracker, exc, step, world, what)
        return
    freed = release_memory(trainer, exc)
    if tracker.unsafe is not None:
        say(f"no emergency checkpoint: {tracker.unsafe}: parameters and optimizer state may be "
            f"half-updated, so saving them as step {step} would be wrong; the last regular "
            f"checkpoint is the resume point")
        return
    if tracker.started_at is None or tracker.finished == 0:
        start = "" if tracker.started_at is None else f", which started at step {tracker.started_at}"
        say(f"no emergency checkpoint: {what} before any optimizer step finished in this process{start}; "
            f"nothing newer than the checkpoint it started from (if any) to save")
        return
    final = _final_dir(trainer, step)
    if os.path.isfile(os.path.join(final, STATE_FILE)):
        say(f"emergency checkpoint at step {step}: {final} (already saved by the regular schedule)")
        return
    say(f"emergency checkpoint: saving step {step} to {final} (after {what}; {freed})")
    t0 = time.monotonic()
    try:
        path, already = save(trainer, step, tracker.snap)
    except Exception as err:  # noqa: BLE001 - the save failed: say so and let the OOM end the run as it would have
        say(f"emergency checkpoint at step {step} failed: {type(err).__name__}: {err}")
        return
    if already:
        say(f"emergency checkpoint at step {step}: {path} (already saved by the regular schedule)")
    else:
        say(f"emergency checkpoint at step {step}: {path} (saved in {time.monotonic() - t0:.1f} s)")


def _on_oom_replica(trainer, tracker, exc, step, world, what):
    """Several ranks: this rank writes checkpoint-N alone when the state is a replica (replica.py)."""
    from . import replica, sharded

    rank = replica._rank()
    who = f"rank {rank} of {world}"
    last = "the last regular checkpoint is the resume point"
    why = replica.sharded(trainer)
    shards = why is not None and sharded.supported(trainer)  # every rank writes its own shard (sharded.py)
    if shards:
        why = None
    elif why is None and tracker.watcher is None:
        why = "no store to reach the other ranks' RNG state (see the hook's warning at start)"
    if why is not None:
        say(f"no emergency checkpoint: {what} on {who}: {why}; {last}")
        return
    freed = release_memory(trainer, exc)
    if tracker.unsafe is not None:
        say(f"no emergency checkpoint: {tracker.unsafe} on {who}: parameters and optimizer state may be "
            f"half-updated, so saving them as step {step} would be wrong; {last}")
        return
    if tracker.started_at is None or tracker.finished == 0:
        say(f"no emergency checkpoint: {what} on {who} before any optimizer step finished in this process; "
            f"nothing newer than the checkpoint it started from (if any) to save")
        return
    budget = replica.budget_s()
    deadline = time.monotonic() + budget
    final = _final_dir(trainer, step)
    if _regular_save_done(final, budget / 4):
        say(f"emergency checkpoint at step {step}: {final} (already saved by the regular schedule)")
        return
    if shards:
        sharded.on_oom(trainer, tracker, exc, step, (rank, world, what, freed))
        return
    channel = tracker.watcher.channel
    if channel.store.add(channel.key("claim", step), 1) > 1:  # another failing rank writes it: wait, then exit
        say(f"emergency checkpoint: {who} leaves the save of step {step} to the rank that claimed it first")
        _wait_for(lambda: channel.has(channel.key("claim", step, "done")), deadline)
        return
    try:
        _replica_save(trainer, tracker, exc, step, (rank, world, what, freed), budget, deadline)
    finally:
        channel.store.set(channel.key("claim", step, "done"), "1")


def _replica_save(trainer, tracker, exc, step, who, budget, deadline):
    from . import replica

    rank, world, what, freed = who
    t0 = time.monotonic()
    answers, missing = replica.collect(tracker.watcher.channel, step, budget / 2)
    if missing:
        why = "; ".join(missing[r] for r in sorted(missing))
        say(f"no emergency checkpoint: {what} on rank {rank} of {world}: the RNG state of step {step} of "
            f"rank(s) {sorted(missing)} is missing ({why}; budget {budget:.0f} s, {replica.BUDGET_ENV}): "
            f"without it resume is not bit-exact for that rank and a checkpoint without its rng_state file "
            f"reads as incomplete; the last regular checkpoint is the resume point")
        return
    final = _final_dir(trainer, step)
    say(f"emergency checkpoint: saving step {step} to {final} (after {what} on rank {rank} of {world}; {freed})")
    rng_ranks = sorted([rank, *answers])
    note = {"step": step, "failing_rank": rank, "world_size": world, "writer_rank": rank,
            "from_writer": ["model", "optimizer", "scheduler", "trainer_state", f"rng_state_{rank}"],
            "rng_from_ranks": rng_ranks, "rng_wait_s": round(time.monotonic() - t0, 3),
            "budget_s": budget, "cause": what}
    staging = os.path.join(_run_dir(trainer), f"tmp-checkpoint-{step}")

    def expired():
        discard(staging)
        say(f"emergency checkpoint at step {step} failed: not done within the budget of {budget:.0f} s "
            f"({replica.BUDGET_ENV}); its unfinished {staging} was removed")
        traceback.print_exception(exc)
        sys.stderr.flush()
        os._exit(1)

    try:
        with replica.Watchdog(deadline - time.monotonic(), expired):
            path, already = save(trainer, step, tracker.snap,
                                 scope=lambda: replica.writer_scope(trainer, tracker.snap, answers),
                                 note=lambda: {**note, "save_s": round(time.monotonic() - t0, 3)})
    except Exception as err:  # noqa: BLE001 - the save failed: say so and let the OOM end the run as it would have
        say(f"emergency checkpoint at step {step} failed: {type(err).__name__}: {err}")
        return
    if already:
        say(f"emergency checkpoint at step {step}: {path} (already saved by the regular schedule)")
        return
    say(f"emergency checkpoint: replica of rank {rank} of {world}: model, optimizer, scheduler and trainer "
        f"state from rank {rank}; RNG from ranks {rng_ranks}")
    say(f"emergency checkpoint at step {step}: {path} (saved in {time.monotonic() - t0:.1f} s)")


def _regular_save_done(final, wait_s):
    """Process 0 may still be writing a regular checkpoint-N that this rank finished its part of."""
    if not os.path.isdir(final):
        return False
    return _wait_for(lambda: os.path.isfile(os.path.join(final, STATE_FILE)), time.monotonic() + wait_s)


def _wait_for(cond, deadline):
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def release_memory(trainer, exc):
    """Drop what the failed step holds; return what was released, in words."""
    import torch

    before = _used(torch)
    e, n = exc, 0
    while e is not None and n < 8:  # the frames hold the batch, activations and autograd graph
        traceback.clear_frames(e.__traceback__)
        e, n = e.__cause__ or e.__context__, n + 1
    for obj in (getattr(trainer, "model", None), getattr(trainer, "model_wrapped", None)):
        _call(obj, "zero_grad", set_to_none=True)
    opt = getattr(trainer, "optimizer", None)
    _call(opt, "zero_grad", set_to_none=True)
    _call(getattr(opt, "optimizer", None), "zero_grad", set_to_none=True)  # behind accelerate's wrapper
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    after = _used(torch)
    if before is None or after is None:
        return "gradients dropped, caches emptied"
    where = "GPU memory reserved by PyTorch" if torch.cuda.is_initialized() else "resident memory"
    return f"gradients dropped, caches emptied: {where} {_mib(before)} -> {_mib(after)}"


def _used(torch):
    """Bytes this process holds: GPU reserved memory when CUDA is in use, else resident memory."""
    try:
        if torch.cuda.is_initialized():
            return sum(torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count()))
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except Exception:  # noqa: BLE001 - a figure for the message only; any failure means no figure
        return None


def _mib(n):
    return f"{max(n, 0) / 2**20:.0f} MiB"


def _call(obj, name, **kwargs):
    fn = getattr(obj, name, None)
    if fn is None:
        return
    try:
        fn(**kwargs)
    except TypeError:
        try:
            fn()
        except Exception:  # noqa: BLE001, S110 - freeing gradients is best effort on the OOM path
            pass
    except Exception:  # noqa: BLE001, S110 - freeing gradients is best effort on the OOM path
        pass


def _run_dir(trainer):
    return os.path.abspath(trainer._get_output_dir(trial=None))


def _final_dir(trainer, step):
    return os.path.join(_run_dir(trainer), f"checkpoint-{step}")


def save(trainer, step, snap, scope=None, note=None):
    """Write checkpoint-`step` through the Trainer's own save, staged; return (path, already).

    `scope` (a context manager factory) is entered around the save and its on_save callbacks;
    `note()` is a dict written into the checkpoint as NOTE_FILE before it is renamed."""
    run_dir = _run_dir(trainer)
    final = os.path.join(run_dir, f"checkpoint-{step}")
    if os.path.isdir(final):
        if os.path.isfile(os.path.join(final, STATE_FILE)):
            return final, True
        _quarantine(final)  # a regular save that the OOM interrupted: never mistaken for complete
    staging = os.path.join(run_dir, f"tmp-checkpoint-{step}")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    if snap is not None:
        _restore(trainer, snap)
    trainer._get_output_dir = lambda trial=None: staging  # the save (and its rotation) stays inside
    scope = scope or contextlib.nullcontext
    try:
        with scope():
            trainer._save_checkpoint(trainer.model_wrapped, trial=None)
        produced = os.path.join(staging, f"checkpoint-{step}")
        if not os.path.isfile(os.path.join(produced, STATE_FILE)):
            raise RuntimeError(f"the Trainer's save left no {STATE_FILE} in {produced}")
        if note is not None:
            with open(os.path.join(produced, NOTE_FILE), "w") as fh:
                json.dump(note(), fh, indent=1)
        _fsync_tree(produced)
        os.rename(produced, final)
        _fsync_dir(run_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        del trainer._get_output_dir
    shutil.rmtree(staging, ignore_errors=True)
    try:  # what a regular save does next (e.g. LLaMA-Factory saves the tokenizer/processor)
        with scope():
            trainer.control = trainer.callback_handler.on_save(trainer.args, trainer.state, trainer.control)
    except Exception as exc:  # noqa: BLE001 - the checkpoint is written; a user callback's failure must not undo it
        warn(f"on_save callbacks after the emergency checkpoint failed: {exc!r}")
    return final, False


def discard(staging):
    """An unfinished save's staging folder, removed as the process gives up on it: left behind it is
    never mistaken for a checkpoint, but a large model's half-written shards would hold the disk all
    night. Renamed first (atomic), so a writer still running writes no new file under the old name."""
    gone = f"{staging}.discarded-{os.getpid()}"
    try:
        os.rename(staging, gone)
    except OSError:
        return  # not there (nothing written yet, or another rank's watchdog took it first)
    shutil.rmtree(gone, ignore_errors=True)


def _quarantine(path):
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest_dir = os.path.join(os.path.dirname(path), QUARANTINE_DIR)
    os.makedirs(dest_dir, exist_ok=True)
    dest = os.path.join(dest_dir, f"{os.path.basename(path)}.incomplete-{stamp}")
    n = 1
    while os.path.exists(dest):
        n += 1
        dest = os.path.join(dest_dir, f"{os.path.basename(path)}.incomplete-{stamp}.{n}")
    os.rename(path, dest)
    say(f"emergency checkpoint: moved the incomplete {path} (a regular save the OOM interrupted) to {dest}")


def _fsync_tree(root):
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
