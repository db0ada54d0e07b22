"""More of the lines a run prints right before a step known to block (issue 29, generalising), from the
libraries' own print/log statements: torch.utils.cpp_extension's JIT build (it waits on a file lock in
the extensions root a crashed build left behind), ColossalAI's runtime kernel build, DeepSpeed's
`init_distributed` records, mmcv's runner announcing its workflow, peft's trainable-parameter count.
A pasted log (no exit status) that stops there is a hang at hint strength; with an exit record never."""

import pytest

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import diagnose_bytes

STOPS = (
    # torch/utils/cpp_extension.py: print(f'Using {build_directory} as PyTorch extensions root...')
    b"Using /root/.cache/torch_extensions/py39_cu117 as PyTorch extensions root...\n",
    # cpp_extension.py: 'Emitting ninja build file {}...', 'Building extension module {}...'
    b"Emitting ninja build file /root/.cache/torch_extensions/fused_adam/build.ninja...\n",
    b"Building extension module fused_adam...\n",
    # colossalai/kernel/kernel_loader.py
    b"No pre-built kernel is found, build and load the cpu_adam kernel during runtime now\n",
    # deepspeed/comm/comm.py init_distributed (a record of that function, the group still forming)
    b"[2024-06-11 00:23:36,296] [INFO] [comm.py:637:init_distributed] cdb=None\n",
    # mmcv/runner/epoch_based_runner.py: self.logger.info('workflow: %s, max: %d epochs', ...)
    b"2023-01-01 10:00:00,000 - mmdet - INFO - workflow: [('train', 1)], max: 20 epochs\n",
    # peft's print_trainable_parameters, the last set-up step before the trainer starts
    b"trainable params: 52428800 || all params: 13068303360 || trainable%: 0.4011905643426998\n",
)


@pytest.mark.parametrize("last", STOPS)
def test_a_pasted_log_that_stops_at_a_blocking_step_is_a_hang(last):
    log = b"Special tokens have been added in the vocabulary.\n" + last
    d = diagnose_bytes(log, None)
    assert d.category is Category.HANG, d.summary
    assert d.strength == "hint"
    assert diagnose_bytes(log, ExitRecord(returncode=1)).category is not Category.HANG


def test_an_error_after_it_decides():
    log = STOPS[0] + b"Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\nRuntimeError: Error building extension 'fused_adam'\n"
    assert diagnose_bytes(log, None).category is not Category.HANG
