"""Numeric failures read from how the libraries report a non-finite run and stop (issue 29), not from
corpus wording. Messages are copied from the libraries' own raise/print statements (file per case).
A bug that merely mentions a number (a shape, an index) stays a crash."""

import pytest

from supervisor.core.models import Category
from supervisor.judge.diagnosis import diagnose_bytes


def _tb(path: str, func: str, exc_line: str) -> bytes:
    return (f'Traceback (most recent call last):\n  File "/home/u/train.py", line 3, in <module>\n    main()\n'
            f'  File "{path}", line 40, in {func}\n    raise X\n{exc_line}\n').encode()


NUMERIC_CASES = {
    # fairseq/optim/dynamic_loss_scaler.py check_overflow
    "fairseq_min_scale": _tb(
        "/x/fairseq/optim/dynamic_loss_scaler.py", "check_overflow",
        "FloatingPointError: Minimum loss scale reached (0.0001). Your loss is probably exploding. Try lowering the "
        "learning rate, using gradient clipping or increasing the batch size."),
    # numpy with np.seterr(all="raise"): the class alone says the arithmetic left the finite numbers
    "numpy_seterr": _tb("/home/u/model.py", "forward", "FloatingPointError: overflow encountered in exp"),
    # detectron2/engine/train_loop.py _write_metrics
    "detectron2": _tb("/x/detectron2/engine/train_loop.py", "_write_metrics",
                      "FloatingPointError: Loss became infinite or NaN at iteration=1234!"),
    # torch/distributions/distribution.py: a parameter computed from NaN weights
    "distribution_constraint": _tb(
        "/x/torch/distributions/distribution.py", "__init__",
        "ValueError: Expected parameter loc (Tensor of shape (64, 2)) of distribution Normal(loc: torch.Size([64, 2]),"
        " scale: torch.Size([64, 2])) to satisfy the constraint Real(), but found invalid values:"),
    # aten/src/ATen/native/Distributions.cpp multinomial: sampling from NaN logits
    "multinomial": _tb("/x/transformers/generation/utils.py", "_sample",
                       "RuntimeError: probability tensor contains either `inf`, `nan` or element < 0"),
    # torch/nn/utils/clip_grad.py with error_if_nonfinite=True
    "clip_grad": _tb("/x/torch/nn/utils/clip_grad.py", "clip_grad_norm_",
                     "RuntimeError: The total norm of order 2.0 for gradients from `parameters` is non-finite, so it "
                     "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                     "set `error_if_nonfinite=False`"),
    # megatron/training/training.py (check_for_nan_in_loss_and_grad)
    "megatron_forward_loss": _tb("/x/megatron/training/training.py", "train_step",
                                 "AssertionError: Rank 3: found NaN in local forward loss calculation. Device: 3, node: n1"),
    # tensorflow/python/training/basic_session_run_hooks.py NanTensorHook
    "tf_nan_tensor_hook": _tb("/x/tensorflow/python/training/basic_session_run_hooks.py", "after_run",
                              "tensorflow.python.training.basic_session_run_hooks.NanLossDuringTrainingError: "
                              "NaN loss during training."),
}
MENTION_CASES = {
    # lightning/pytorch/callbacks/early_stopping.py (check_finite=True), the run's last words
    "lightning_early_stopping": b"Epoch 3:  40%|####      | 40/100 [00:10<00:15, loss=nan, v_num=1]\n"
                                b"Monitored metric val_loss = nan is not finite. Previous best value was 0.412. "
                                b"Signaling Trainer to stop.\n",
    # a script's own stop in any of the usual words
    "script_stop": b"step 812 | lr 3e-4\nNaN loss detected at step 813, stopping training\n",
    "loss_was_inf": b"epoch 2 iter 40\nERROR: loss was inf at iteration 41, aborting\n",
}
NOT_NUMERIC = {
    # an index error that mentions inf-like words is a bug, not a blow-up
    "index_bug": _tb("/home/u/data.py", "__getitem__", "IndexError: index 5 is out of bounds for dimension 0 with size 5"),
    # a ValueError about a config value with "inf" in a name
    "info_key": _tb("/home/u/train.py", "main", "KeyError: 'info'"),
}


@pytest.mark.parametrize("name", sorted(NUMERIC_CASES))
def test_library_nonfinite_reports_are_numeric(name: str) -> None:
    d = diagnose_bytes(NUMERIC_CASES[name])
    assert d.category is Category.NUMERIC, (name, d.summary)
    assert d.strength != "hint"


@pytest.mark.parametrize("name", sorted(MENTION_CASES))
def test_nonfinite_stop_said_as_the_final_line(name: str) -> None:
    d = diagnose_bytes(MENTION_CASES[name])
    assert d.category is Category.NUMERIC, (name, d.summary)


@pytest.mark.parametrize("name", sorted(NOT_NUMERIC))
def test_bugs_mentioning_numbers_are_not_numeric(name: str) -> None:
    d = diagnose_bytes(NOT_NUMERIC[name])
    assert d.category is Category.CRASH_OTHER, (name, d.summary)


def test_nan_stop_followed_by_training_is_not_the_end() -> None:
    log = MENTION_CASES["script_stop"] + b"".join(b"{'loss': 1.%d, 'epoch': 0.%d}\n" % (i, i) for i in range(1, 6))
    assert diagnose_bytes(log).category is not Category.NUMERIC


def test_fairseq_loss_scale_collapse_told_by_its_overflow_notes() -> None:
    """fairseq/trainer.py logs each overflow as 'NOTE: gradient overflow detected, ignoring gradient, setting
    loss scale to: X'; a run of them halving the scale down to its floor, and nothing after, is a collapse."""
    log = b"".join(b"2021-03-08 12:33:%02d | INFO | fairseq.trainer | NOTE: gradient overflow detected, ignoring "
                   b"gradient, setting loss scale to: %s\n" % (i, v) for i, v in enumerate([b"64.0", b"32.0", b"16.0",
                                                                                          b"8.0", b"4.0", b"2.0", b"1.0"]))
    d = diagnose_bytes(log)
    assert d.category is Category.NUMERIC, d.summary


def test_loss_table_without_separator() -> None:
    """pytorch/examples word_language_model/main.py: '| loss {:5.2f} | ppl {:8.2f}' prints 'loss   nan'."""
    log = b"".join(b"| epoch   1 |  %d/ 2983 batches | lr 20.00 | ms/batch 11.49 | loss   nan | ppl      nan\n" % (200 * i)
                   for i in range(1, 5))
    d = diagnose_bytes(log)
    assert d.category is Category.NUMERIC, d.summary


def test_loss_table_recovered_is_not_numeric() -> None:
    log = (b"| epoch   1 |   200/ 2983 batches | lr 20.00 | loss   nan | ppl      nan\n"
           b"| epoch   1 |   400/ 2983 batches | lr 20.00 | loss   nan | ppl      nan\n"
           b"| epoch   1 |   600/ 2983 batches | lr 20.00 | loss  5.21 | ppl   183.12\n")
    assert diagnose_bytes(log).category is not Category.NUMERIC


MORE_NUMERIC = {
    # sklearn/utils/validation.py _assert_all_finite: a metric computed over NaN outputs
    "sklearn_metric": _tb("/x/sklearn/utils/validation.py", "_assert_all_finite",
                          "ValueError: Input contains NaN, infinity or a value too large for dtype('float32')."),
    # Python's int()/math.ceil of a NaN loss (a perplexity, a step count from it)
    "int_of_nan": _tb("/home/u/train.py", "log_metrics", "ValueError: cannot convert float NaN to integer"),
}


@pytest.mark.parametrize("name", sorted(MORE_NUMERIC))
def test_nan_reaching_a_consumer_is_numeric(name: str) -> None:
    d = diagnose_bytes(MORE_NUMERIC[name])
    assert d.category is Category.NUMERIC, (name, d.summary)


def test_tensorboardx_nan_warning_as_the_last_words() -> None:
    """tensorboardX/x2num.py check_nan warns 'NaN or Inf found in input tensor.' for every NaN scalar logged."""
    log = b"epoch 3 iter 1200\n" + b"WARNING:root:NaN or Inf found in input tensor.\n" * 3
    assert diagnose_bytes(log).category is Category.NUMERIC


def test_fairseq_gnorm_nan_tail() -> None:
    """fairseq's progress lines log the grad norm as gnorm."""
    log = b"".join(b"epoch 001:  %d / 500 loss=7.412, nll_loss=6.9, ppl=119.4, wps=1200, ups=2, gnorm=nan, clip=100\n" % i
                   for i in (10, 20, 30))
    assert diagnose_bytes(log).category is Category.NUMERIC


def _assert_tb(code: str, exc: str, caret: bool) -> bytes:
    return (b'Traceback (most recent call last):\n  File "/home/u/train.py", line 88, in train_step\n'
            + f"    {code}\n".encode() + (b"           ^^^^^^^^^^^^^^^^^^^^^^\n" if caret else b"") + exc.encode() + b"\n")


@pytest.mark.parametrize("caret", [False, True])
@pytest.mark.parametrize("code", ["assert not torch.isnan(loss).any()", "assert torch.isfinite(grad_norm)",
                                  "assert not np.isinf(x).any(), step"])
def test_bare_assertion_of_finiteness_is_numeric(code: str, caret: bool) -> None:
    """A program's own `assert not torch.isnan(loss)` fails with a bare AssertionError: what was asserted
    is on the code line the traceback shows above it."""
    d = diagnose_bytes(_assert_tb(code, "AssertionError", caret))
    assert d.category is Category.NUMERIC, d.summary


def test_other_asserts_and_other_exceptions_stay_crashes() -> None:
    assert diagnose_bytes(_assert_tb("assert len(batch) > 0", "AssertionError", False)).category is Category.CRASH_OTHER
    # an isnan() code line over a different exception: that exception speaks
    d = diagnose_bytes(_assert_tb("assert not torch.isnan(loss).any()", "KeyError: 'loss'", False))
    assert d.category is Category.CRASH_OTHER


def test_deepspeed_unfused_optimizer_overflow_run() -> None:
    """deepspeed/runtime/fp16/unfused_optimizer.py logs '[deepspeed] fp16 dynamic loss scale overflow! Skipping step.
    Attempted loss scale: X, reducing to Y'; halving down to 1 with nothing after is a collapse."""
    scales = [16.0, 8.0, 4.0, 2.0, 1.0]
    log = b"".join(b"[INFO] [unfused_optimizer.py:207:step] [deepspeed] fp16 dynamic loss scale overflow! Skipping step. "
                   b"Attempted loss scale: %.1f, reducing to %.1f\n" % (a, b) for a, b in zip(scales, scales[1:] + [1.0]))
    assert diagnose_bytes(log).category is Category.NUMERIC


def test_megatron_and_wandb_style_names() -> None:
    """Megatron's ' lm loss: NaN | grad norm: nan |' and a logger's 'train/loss nan' are losses too."""
    meg = b"".join(b" iteration %d/ 500000 | lm loss: 7.1E+00 | loss scale: 1.0 | grad norm: nan |\n" % i for i in (10, 20, 30))
    assert diagnose_bytes(meg).category is Category.NUMERIC
    wb = b"".join(b"step %d train/loss nan lr 1e-4\n" % i for i in (10, 20, 30))
    assert diagnose_bytes(wb).category is Category.NUMERIC
