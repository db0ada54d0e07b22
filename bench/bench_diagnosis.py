"""Benchmark: diagnose_file vs `grep -E` on the same realistic training log.

    python bench/bench_diagnosis.py                 # 1 GB log in the temp dir
    python bench/bench_diagnosis.py --size-mb 200 --dir /scratch --keep
    python bench/bench_diagnosis.py --flood --size-mb 200     # keyword-dense flood (issue 9 item 4)

`--flood` writes a log whose every line matches prefilter keywords (a job printing
`[rank0]: Error: sample N skipped ...` and dataset text with OOM words for minutes), then
one real OOM traceback: the scanner must stay linear and cheap there, in bounded memory.

The log looks like a long LLaMA-Factory run under torchrun: tqdm bars redrawn
with `\\r`, loss dicts, INFO lines, periodic warnings (some recommending
PYTORCH_CUDA_ALLOC_CONF), benign DeepSpeed overflow messages, checkpoint saves
and evaluations, and one HIP OOM traceback on rank 3 near the end. grep is given
the scanner's own keyword prefilter as its pattern (same candidate lines, C
locale), which is the comparable work: finding the lines worth reading.

Both run in child processes. The diagnosis child reports its own peak RSS
(VmHWM: getrusage would also count the forked parent's pages from before
exec), next to a child that only imports the package (the interpreter's own
floor). Diagnosis time is measured inside its child (interpreter start-up
excluded); grep's is its process wall time. Target: diagnosis >= 1/3 of grep's MB/s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

WARNINGS = (
    (b"/opt/venv/lib/python3.11/site-packages/torch/utils/checkpoint.py:86: UserWarning: None of the inputs have "
     b"requires_grad=True. Gradients will be None\n  warnings.warn(\n"),
    (b"[WARNING|2026-11-28 23:41:07] llamafactory.model.loader:154 >> Memory use is high; if reserved but unallocated "
     b"memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.\n"),
    (b"/opt/venv/lib/python3.11/site-packages/torch/cuda/memory.py:391: FutureWarning: PYTORCH_CUDA_ALLOC_CONF is "
     b"deprecated, use PYTORCH_ALLOC_CONF instead\n"),
    (b"[rank1]:[W1128 23:41:07.120000000 CUDAAllocatorConfig.h:28] Warning: expandable_segments not supported on this "
     b"platform (function operator())\n"),
)
PREAMBLE = b"".join(
    b"[INFO|2026-11-28 23:10:0%d] llamafactory.hparams.parser:468 >> Process rank: %d, world size: 4, device: cuda:%d, "
    b"distributed training: True, compute dtype: torch.bfloat16\n" % (r, r, r)
    for r in range(4)
) + (
    b"[INFO|modeling_utils.py:1121] 2026-11-28 23:10:03,120 >> loading weights file /data/models/Llama-3-70B/model.safetensors.index.json\n"
    b"Loading checkpoint shards: 100%%|\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88\xe2\x96\x88| 30/30 [01:04<00:00,  2.13s/it]\n"
    b"[INFO|trainer.py:2519] 2026-11-28 23:12:10,512 >> ***** Running training *****\n"
    b"[INFO|trainer.py:2527] 2026-11-28 23:12:10,512 >>   Total optimization steps = %d\n"
    b"[2026-11-28 23:12:12,100] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
    b"Attempted loss scale: 65536, reducing to 32768\n"
)
OOM_TAIL = (
    b"[rank3]: Traceback (most recent call last):\n"
    b'[rank3]:   File "/opt/venv/lib/python3.11/site-packages/transformers/trainer.py", line 2555, in _inner_training_loop\n'
    b"[rank3]:     tr_loss_step = self.training_step(model, inputs, num_items_in_batch)\n"
    b'[rank3]:   File "/opt/venv/lib/python3.11/site-packages/transformers/trainer.py", line 3745, in training_step\n'
    b"[rank3]:     self.accelerator.backward(loss, **kwargs)\n"
    b"[rank3]: torch.OutOfMemoryError: HIP out of memory. Tried to allocate 3.91 GiB. GPU 3 has a total capacity of "
    b"191.98 GiB of which 2.05 GiB is free. Of the allocated memory 183.62 GiB is allocated by PyTorch, and 5.27 GiB is "
    b"reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    b"PYTORCH_HIP_ALLOC_CONF=expandable_segments:True to avoid fragmentation.\n"
)


def generate(path: Path, size_bytes: int, seed: int = 0) -> int:
    """Write ~size_bytes of training log to `path`; return the OOM's line number."""
    rng = random.Random(seed)
    total = max(1000, size_bytes // 1200)
    step = 0
    lines = 0
    written = 0
    oom_line = 0
    fill = b"\xe2\x96\x88"
    with open(path, "wb", buffering=1 << 22) as fh:
        head = PREAMBLE % total
        fh.write(head)
        written += len(head)
        lines += head.count(b"\n")
        tail_at = size_bytes - 4096
        while written < tail_at:
            step += 1
            pct = min(99, step * 100 // total)
            bar = b"%3d%%|%-10s| %d/%d [%02d:%02d:%02d<%02d:%02d:%02d, %5.2fs/it]" % (
                pct, fill * (pct // 10), step, total, step // 3600, step // 60 % 60, step % 60,
                (total - step) // 3600, (total - step) // 60 % 60, (total - step) % 60, 2.5 + rng.random())
            parts = [b"\r" + bar] * 3  # tqdm redraws the same step (rate refresh)
            parts.append(b"\n{'loss': %.4f, 'grad_norm': %.4f, 'learning_rate': %.4e, 'epoch': %.2f}\n" % (
                2.0 - step / total + rng.random() * 0.1, 0.5 + rng.random(), 1e-5 * (1 - step / total), 3 * step / total))
            if step % 37 == 0:
                parts.append(WARNINGS[step // 37 % len(WARNINGS)])
            if step % 500 == 0:
                parts.append(b"[INFO|trainer.py:3815] 2026-11-29 01:10:20,001 >> Saving model checkpoint to "
                             b"saves/llama3-70b/full/sft/checkpoint-%d\n" % step)
            if step % 2000 == 0:
                parts.append(b"[INFO|trainer.py:4226] 2026-11-29 01:10:21,001 >> ***** Running Evaluation *****\n")
                parts.append(b"".join(b"\r%3d%%|          | %d/40 [00:%02d<00:10,  4.00it/s]" % (i * 100 // 40, i, i)
                                      for i in range(41)) + b"\n")
            chunk = b"".join(parts)
            fh.write(chunk)
            written += len(chunk)
            lines += chunk.count(b"\n")
        oom_line = lines + 6
        fh.write(OOM_TAIL)
    return oom_line


FLOOD_LINES = (
    b"[rank0]: Error: sample %d skipped (bad format)\n",
    b"[rank1]: ValueError: sample %d: CUDA out of memory. Tried to allocate 2.00 GiB (quoted from the dataset)\n",
    b"[WARNING|2026-11-28 23:41:07] llamafactory.data:12 >> sample %d mentions RuntimeError: CUDA error: an illegal memory access\n",
)


def generate_flood(path: Path, size_bytes: int) -> int:
    """Keyword-dense flood, then the OOM traceback; return the OOM's line number."""
    lines = 0
    with open(path, "wb", buffering=1 << 22) as fh:
        written, i = 0, 0
        while written < size_bytes:
            block = b"".join(FLOOD_LINES[(i + k) % 3] % (i + k) for k in range(3000))
            i += 3000
            fh.write(block)
            written += len(block)
            lines += 3000
        fh.write(OOM_TAIL)
    return lines + 6


def _peak_rss_kib() -> int:
    """This process's peak RSS. VmHWM belongs to the exec'd image only; getrusage() would
    also count the pages of the forked parent before exec."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _child_diagnose(path: str) -> None:
    from supervisor.core.models import ExitRecord
    from supervisor.judge.diagnosis import PREFILTER_ENGINE, diagnose_file

    t0 = time.perf_counter()
    d = diagnose_file(path, ExitRecord(returncode=1))
    dt = time.perf_counter() - t0
    print(json.dumps({"seconds": dt, "category": d.category.value, "rank": d.rank, "vendor": d.vendor,
                      "line": d.evidence[0].line_no if d.evidence else None, "engine": PREFILTER_ENGINE,
                      "peak_rss_kib": _peak_rss_kib()}))


def _child_import_only() -> None:
    import supervisor.judge.diagnosis  # noqa: F401

    print(json.dumps({"seconds": 0, "peak_rss_kib": _peak_rss_kib()}))


def _run_child(args: list[str]) -> tuple[dict, float]:
    """Run a child Python; return its JSON (with its own peak RSS) and wall seconds."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads(out.stdout), time.perf_counter() - t0


def _grep_pattern() -> str:
    """The scanner's keyword prefilter as a POSIX ERE."""
    sys.path.insert(0, str(REPO))
    from supervisor.judge.diagnosis.rules import KEYWORDS

    special = set(".[]()*+?{}|^$\\")
    return "|".join("".join("\\" + c if c in special else c for c in k) for k in KEYWORDS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="log size to generate (default 1024 = 1 GB)")
    ap.add_argument("--dir", default=None, help="where to write the log (default: the system temp dir; never the repo)")
    ap.add_argument("--keep", action="store_true", help="keep the generated log")
    ap.add_argument("--flood", action="store_true", help="a keyword-dense flood instead of a training log")
    ap.add_argument("--repeat", type=int, default=2, help="timed runs of each tool; the best is reported")
    ap.add_argument("--child", choices=["diagnose", "import"], help=argparse.SUPPRESS)
    ap.add_argument("path", nargs="?", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child == "diagnose":
        _child_diagnose(a.path)
        return 0
    if a.child == "import":
        _child_import_only()
        return 0

    grep = shutil.which("grep")
    if grep is None:
        print("grep not found", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="bench_diagnosis_", dir=a.dir))
    if REPO in workdir.resolve().parents:
        print("refusing to write the log inside the repository", file=sys.stderr)
        return 2
    log = workdir / "train.log"
    try:
        t0 = time.perf_counter()
        oom_line = (generate_flood if a.flood else generate)(log, a.size_mb * 1024 * 1024)
        size = log.stat().st_size
        print(f"generated {size / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s: {log} (OOM at line {oom_line})")
        with open(log, "rb") as fh:  # warm the page cache for both tools alike
            while fh.read(1 << 24):
                pass

        floor_kib = _run_child(["--child", "import"])[0]["peak_rss_kib"]
        best_diag = best_wall = None
        result: dict = {}
        diag_rss_kib = 0
        for _ in range(a.repeat):
            result, wall = _run_child(["--child", "diagnose", str(log)])
            best_diag = result["seconds"] if best_diag is None else min(best_diag, result["seconds"])
            best_wall = wall if best_wall is None else min(best_wall, wall)
            diag_rss_kib = max(diag_rss_kib, result["peak_rss_kib"])

        pattern = _grep_pattern()
        best_grep = None
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            g = subprocess.run([grep, "-c", "-E", pattern, str(log)], check=False, capture_output=True,
                               env={**os.environ, "LC_ALL": "C"})
            dt = time.perf_counter() - t0
            if g.returncode not in (0, 1):
                print(g.stderr.decode(), file=sys.stderr)
                return 2
            best_grep = dt if best_grep is None else min(best_grep, dt)
        # For scale: grep with a short, easy pattern (long literals skip fast in Boyer-Moore).
        light = "out of memory|Traceback|Watchdog caught|No space left on device"
        best_light = None
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            subprocess.run([grep, "-c", "-E", light, str(log)], check=True, capture_output=True,
                           env={**os.environ, "LC_ALL": "C"})
            dt = time.perf_counter() - t0
            best_light = dt if best_light is None else min(best_light, dt)
        mb = size / 1e6
        diag_mbs, grep_mbs = mb / best_diag, mb / best_grep
        print(f"diagnosis : {best_diag:7.2f} s  {diag_mbs:8.1f} MB/s  -> {result['category']} on rank {result['rank']}"
              f" ({result['vendor']}) at line {result['line']} [prefilter: {result['engine']}]")
        print(f"grep -E   : {best_grep:7.2f} s  {grep_mbs:8.1f} MB/s  ({g.stdout.decode().strip()} candidate lines, "
              f"{len(pattern.split('|'))} alternatives, LC_ALL=C)")
        print(f"grep -E   : {best_light:7.2f} s  {mb / best_light:8.1f} MB/s  (for scale only: '{light}')")
        print(f"ratio     : {diag_mbs / grep_mbs:.2f} vs grep with the same keywords (target >= 0.33);"
              f" {diag_mbs / (mb / best_light):.2f} vs the 4-literal grep; diagnosis child wall time incl."
              f" interpreter start: {best_wall:.2f} s")
        print(f"peak RSS  : {diag_rss_kib / 1024:.1f} MiB for the diagnosis child "
              f"(interpreter + imports alone: {floor_kib / 1024:.1f} MiB)")
        if result["category"] != "gpu_oom" or result["line"] != oom_line:
            print("WRONG ANSWER: expected gpu_oom at line", oom_line, file=sys.stderr)
            return 1
        return 0
    finally:
        if a.keep:
            print(f"kept {log}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
