"""A loss or grad norm logged non-finite at the end of the log, in each trainer's own print format
(issue 29): one reader (families/nan_tail.py), its lines built from the libraries' print statements
(file per case), its conditions tested: one report of the loss itself decides, one grad norm does
not, a finite value after ends it, a printed sample or a setting never acts, an OOM is not outranked."""

import pytest

from supervisor.core.models import Category
from supervisor.judge.diagnosis import diagnose_bytes

ONE_REPORT = {
    # keras/src/utils/progbar.py: info += f" - {k}: {avg:.4f}" (a NaN mean prints 'nan')
    "keras_progbar": b"Epoch 3/10\n100/100 [==============================] - 5s 50ms/step - loss: nan - accuracy: 0.1000\n",
    # mmengine/runner/log_processor.py: f'{key}: {val:.4f}' joined by two spaces
    "mmengine": (b"01/02 10:00:00 - mmengine - INFO - Epoch(train)  [1][  50/1000]  lr: 1.0000e-02  eta: 1:00:00  "
                 b"time: 0.5000  data_time: 0.0100  memory: 3000  loss: nan  loss_cls: nan  loss_bbox: nan\n"),
    # detectron2/utils/events.py CommonMetricPrinter: ' iter: {}  total_loss: ..  {losses}  lr: ..'
    "detectron2": (b"[01/02 10:00:00 d2.utils.events]:  eta: 1:00:00  iter: 19  total_loss: nan  loss_cls: nan  "
                   b"loss_box_reg: nan  time: 0.5  data_time: 0.01  lr: 0.0002  max_mem: 3000M\n"),
    # lightning's TQDMProgressBar: the bar's postfix from tqdm set_postfix ('k=v, k=v')
    "lightning_bar": b"Epoch 0:  45%|####5     | 45/100 [00:10<00:12,  4.50it/s, v_num=0, train_loss=nan.0]\n",
    # json.dumps of a dict with a float NaN/inf (fairseq's json progress bar, a script's jsonl log)
    "json_nan": b'{"epoch": 1, "train_loss": NaN, "lr": 0.001}\n',
    "json_infinity": b'{"epoch": 1, "loss": Infinity, "lr": 0.001}\n',
    # ultralytics/engine/trainer.py: ('%11s' * 2 + '%11.4g' * (2 + n)) % (f'{epoch+1}/{epochs}', f'{mem:.3g}G', *losses, ..)
    "ultralytics_row": (b"      Epoch    GPU_mem   box_loss   cls_loss   dfl_loss  Instances       Size\n"
                        b"      1/100      2.13G        nan        nan        nan         12        640: 100%|##########| 8/8\n"),
    # fairseq/logging/progress_bar.py SimpleProgressBar: ' | '.join(f'{k} {v}')
    "fairseq_simple": (b"epoch 001 | loss nan | nll_loss nan | ppl nan | wps 1200 | ups 2 | num_updates 10 | lr 0.0005"
                       b" | gnorm nan\n"),
    # a tensorboard/wandb tag as the name
    "logger_tag": b"step 120 loss/train: nan lr: 0.0001\n",
}


@pytest.mark.parametrize("name", sorted(ONE_REPORT))
def test_one_nonfinite_loss_report_at_the_end_is_numeric(name: str) -> None:
    d = diagnose_bytes(b"starting training\n" + ONE_REPORT[name])
    assert d.category is Category.NUMERIC, (name, d.summary)


def test_a_finite_report_after_it_ends_the_run() -> None:
    log = ONE_REPORT["keras_progbar"] + b"100/100 [==============================] - 5s 50ms/step - loss: 0.4123\n"
    assert diagnose_bytes(log).category is not Category.NUMERIC


def test_one_grad_norm_overflow_is_not_enough() -> None:
    """An fp16 step that overflows logs a non-finite grad norm once and is skipped (transformers trainer.log)."""
    log = b"{'loss': 1.2, 'grad_norm': 0.8, 'epoch': 0.1}\n{'loss': 1.1, 'grad_norm': inf, 'epoch': 0.2}\n"
    assert diagnose_bytes(log).category is not Category.NUMERIC


def test_settings_named_like_a_loss_are_not_metrics() -> None:
    """DeepSpeed prints its config ('loss_scale', 'initial_loss_scale'); a loss_weight is a setting."""
    log = b"  loss_scale ................... inf\n  initial_loss_scale: inf\n  loss_weight: inf\n"
    assert diagnose_bytes(log).category is not Category.NUMERIC


def test_a_printed_sample_never_acts() -> None:
    """LLaMA-Factory prints a training example; its decoded text is the user's data, never evidence."""
    log = (b"[INFO|trainer.py:2000] >> ***** Running training *****\ntraining example:\ninput_ids:\n[1, 2, 3]\n"
           b"inputs:\n<|im_start|>user\nwhy is my log {'loss': nan, 'grad_norm': nan} and loss: nan<|im_end|>\n"
           b"label_ids:\n[1, 2, 3]\nlabels:\nloss: nan\nloss: nan<|im_end|>\n")
    assert diagnose_bytes(log).category is not Category.NUMERIC


def test_a_single_report_does_not_outrank_an_oom() -> None:
    log = (b"{'loss': nan, 'grad_norm': nan, 'epoch': 0.2}\nTraceback (most recent call last):\n"
           b'  File "/home/u/train.py", line 3, in <module>\n    main()\n'
           b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity"
           b" of 79.15 GiB of which 1.00 GiB is free.\n")
    assert diagnose_bytes(log).category is Category.GPU_OOM


def _tb(path: str, func: str, exc_line: str) -> bytes:
    return (f'Traceback (most recent call last):\n  File "/home/u/train.py", line 3, in <module>\n    main()\n'
            f'  File "{path}", line 40, in {func}\n    raise X\n{exc_line}\n').encode()


@pytest.mark.parametrize("log", [
    # lightning/pytorch/utilities/finite_checks.py detect_nan_parameters
    _tb("/x/lightning/pytorch/utilities/finite_checks.py", "detect_nan_parameters",
        "ValueError: Detected nan and/or inf values in `encoder.weight`. Check your forward pass for numerically "
        "unstable operations."),
    # scipy/linalg/_basic.py via _asarray_validated(check_finite=True)
    _tb("/x/scipy/_lib/_util.py", "_asarray_validated", "ValueError: array must not contain infs or NaNs"),
    # numpy/linalg/linalg.py _assert_finite
    _tb("/x/numpy/linalg/linalg.py", "_assert_finite", "numpy.linalg.LinAlgError: Array must not contain infs or NaNs"),
], ids=["lightning_nan_parameters", "scipy_check_finite", "numpy_linalg_finite"])
def test_libraries_refusing_nonfinite_numbers(log: bytes) -> None:
    assert diagnose_bytes(log).category is Category.NUMERIC


@pytest.mark.parametrize("line", [
    b"step 40, loss: [nan]\n",  # Paddle/TF print a one-element array
    b"Iteration 300, loss = -nan\n",  # C/C++ printf of a negative NaN (Caffe's solver)
    b"epoch 3 | loss_rpn_cls: 0.0312 | loss_rpn_bbox: nan | acc: 0.98\n",  # a component non-finite, no total
])
def test_more_value_spellings(line: bytes) -> None:
    assert diagnose_bytes(b"starting\n" + line).category is Category.NUMERIC


def test_zero_loss_beside_a_nonfinite_grad_norm() -> None:
    """transformers' trainer.log: a run gone NaN logs 'loss': 0.0 with 'grad_norm': nan."""
    log = b"{'loss': 1.2, 'grad_norm': 0.8, 'epoch': 0.1}\n{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 1e-05, 'epoch': 0.2}\n"
    assert diagnose_bytes(log).category is Category.NUMERIC


@pytest.mark.parametrize("printed", [
    b"tensor([[nan, nan, nan, nan],\n        [nan, nan, nan, nan]], device='cuda:0', grad_fn=<AddmmBackward0>)\n",
    b"[[nan nan nan nan]\n [nan nan nan nan]]\n",
])
def test_outputs_printed_all_nan_at_the_end(printed: bytes) -> None:
    """torch's and numpy's reprs of a tensor whose every element is NaN, as the program's last words."""
    assert diagnose_bytes(b"epoch 3 step 120\n" + printed).category is Category.NUMERIC


def test_a_tensor_with_some_finite_elements_is_not_a_blow_up() -> None:
    log = b"epoch 3 step 120\ntensor([[0.1000, nan, 0.3000],\n        [0.2000, 0.5000, 0.1000]], device='cuda:0')\n"
    assert diagnose_bytes(log).category is not Category.NUMERIC
