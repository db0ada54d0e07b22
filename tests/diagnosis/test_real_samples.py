"""A real LLaMA-Factory run whose dataset is full of error messages is not torn down or blamed.

LLaMA-Factory prints the first tokenised example at start-up (`print_data_example`): here that
example holds a device-fault traceback, a full disk and an OOM. The log of the real run must
give no live teardown event and no verdict from that text.
"""

from __future__ import annotations

import json
import shutil

import pytest

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import LogScanner
from tests.conftest_ml import needs_llamafactory, tiny_assets, tiny_job, train, write_job

pytestmark = [pytest.mark.slow, pytest.mark.ml]

POISON = ("Traceback (most recent call last):\n"
          '  File "/x/trainer.py", line 3745, in training_step\n'
          "    loss.backward()\n"
          "RuntimeError: CUDA error: an illegal memory access was encountered\n"
          "OSError: [Errno 28] No space left on device\n"
          "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n")


def test_a_real_run_printing_error_texts_in_its_sample_is_not_torn_down_or_blamed(tmp_path):
    needs_llamafactory()
    assets = tiny_assets()
    data = tmp_path / "data"
    shutil.copytree(assets.dataset_dir, data)
    rows_file = data / json.loads((data / "dataset_info.json").read_text())[assets.dataset_name]["file_name"]
    rows = json.loads(rows_file.read_text())
    rows[0] = {"instruction": POISON, "input": "", "output": POISON}
    rows_file.write_text(json.dumps(rows))
    cfg = tiny_job(tmp_path / "out", dataset_dir=str(data), max_steps=2, save_steps=100, cutoff_len=512)
    log = tmp_path / "train.log"
    rc = train(write_job(tmp_path / "job.yaml", cfg), log, timeout=600)
    raw = log.read_bytes()
    assert rc == 0, raw[-3000:].decode(errors="replace")
    assert b"illegal memory access" in raw and b"training example:" in raw  # the sample really was printed

    scanner = LogScanner()
    fatal = []
    for i in range(0, len(raw), 4096):
        fatal += scanner.feed(raw[i:i + 4096])
    assert fatal == []
    assert scanner.samples_skipped >= 1
    # The block ended at LLaMA-Factory's next logger line: what followed was read (steps, total).
    assert (scanner.total_steps, scanner.last_step) == (2, 2)
    assert scanner.finish(ExitRecord(returncode=0)).category is Category.SUCCESS
    failed = scanner.finish(ExitRecord(returncode=1))
    assert failed.category not in (Category.DEVICE_FAULT, Category.DISK_FULL, Category.GPU_OOM), failed.summary
    assert not any("illegal memory access" in e.text or "Errno 28" in e.text for e in failed.evidence)
