"""Crashes the scanner did not see (issue 29, development part of bench/corpus): a Jupyter/IPython
traceback, whose header names the exception ("ImportError     Traceback (most recent call last)")
and was learned as a line prefix that then ate the exception line; a CUDA kernel's own device-side
assertion lines with no Python error after them. Both were 'no failure evidence'. The texts below
are copied from the excerpts named."""

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import diagnose_bytes
from supervisor.judge.diagnosis.scanner import LogScanner

# crash_other_lightninglm_import_save_state_warning (yang-zhang/lightning-language-modeling#2)
IPYTHON = (
    b"---------------------------------------------------------------------------\n"
    b"ImportError                               Traceback (most recent call last)\n"
    b"<ipython-input-2-279c49635b32> in <module>\n"
    b"----> 1 import transformers\n"
    b"\n"
    b"/net/vaosl01/opt/NFS/su0/anaconda3/envs/scatr/lib/python3.7/site-packages/transformers/trainer_pt_utils.py in <module>\n"
    b'     38     SAVE_STATE_WARNING = ""\n'
    b"     39 else:\n"
    b"---> 40     from torch.optim.lr_scheduler import SAVE_STATE_WARNING\n"
    b"     41 \n"
    b"     42 logger = logging.get_logger(__name__)\n"
    b"\n"
    b"ImportError: cannot import name 'SAVE_STATE_WARNING' from 'torch.optim.lr_scheduler' (/net/vaosl01/opt/NFS/su0/"
    b"anaconda3/envs/scatr/lib/python3.7/site-packages/torch/optim/lr_scheduler.py)\n"
)
# crash_other_unet_nll_loss2d_device_assert (milesial/Pytorch-UNet#375)
KERNEL_ASSERT = (
    b"Epoch 1/5:   0%|                                                        | 0/123 [00:00<?, ?img/s]\n"
    b"../aten/src/ATen/native/cuda/NLLLoss2d.cu:103: nll_loss2d_forward_kernel: block: [3,0,0], thread: [929,0,0] "
    b"Assertion `t >= 0 && t < n_classes` failed.\n"
    b"../aten/src/ATen/native/cuda/NLLLoss2d.cu:103: nll_loss2d_forward_kernel: block: [3,0,0], thread: [930,0,0] "
    b"Assertion `t >= 0 && t < n_classes` failed.\n"
)


def test_ipython_traceback_and_kernel_assertion_are_crashes():
    d = diagnose_bytes(IPYTHON, None)
    assert (d.category, d.subkind) == (Category.CRASH_OTHER, "python_exception"), d.summary
    assert "SAVE_STATE_WARNING" in d.summary
    d = diagnose_bytes(KERNEL_ASSERT, None)
    assert (d.category, d.subkind) == (Category.CRASH_OTHER, "device_assert"), d.summary


def test_the_same_lines_followed_by_training_are_a_hint_and_never_stop_a_run():
    going_on = KERNEL_ASSERT + b"Epoch 1/5:  50%|#####     | 62/123 [00:10<00:10, 6.00img/s]\n"
    s = LogScanner()
    assert s.feed(going_on) == [] and s.feed(IPYTHON) == []  # no header-ended Python traceback: not fatal live
    d = diagnose_bytes(going_on, ExitRecord(returncode=1))
    assert d.strength == "hint", d.summary
    assert diagnose_bytes(going_on, ExitRecord(returncode=0)).category is Category.SUCCESS
