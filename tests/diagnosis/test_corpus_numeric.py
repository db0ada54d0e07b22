"""Numeric blow-ups in other frameworks' words (issue 29, development part of bench/corpus): an
MMSeg iteration log with NaN losses, a LLaMA-Factory run whose logged steps are interleaved with its
callback's own copy, Megatron's rerun state machine, Keras' TerminateOnNaN. Each was called
crash_other or 'no failure evidence'. The texts below are copied from the excerpts named."""

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import diagnose_bytes
from supervisor.judge.diagnosis.scanner import LogScanner

from .test_trust import sample_block

# numeric_daformer_mmseg_decode_loss_seg_nan (lhoyer/DAFormer#22)
MMSEG = (
    b"2022-05-07 17:02:57,696 - mmseg - INFO - Iter [50/40000]        lr: 1.958e-06, eta: 1 day, 0:29:42, time: 2.207, "
    b"data_time: 0.029, memory: 9801, decode.loss_seg: nan, decode.acc_seg: 32.2611, src.loss_imnet_feat_dist: nan, "
    b"mix.decode.loss_seg: nan, mix.decode.acc_seg: 54.3771\n"
    b"2022-05-07 17:04:45,225 - mmseg - INFO - Iter [100/40000]       lr: 3.950e-06, eta: 1 day, 0:08:59, time: 2.151, "
    b"data_time: 0.017, memory: 9801, decode.loss_seg: nan, decode.acc_seg: 41.2013, src.loss_imnet_feat_dist: nan, "
    b"mix.decode.loss_seg: nan, mix.decode.acc_seg: 69.9605\n"
)
# numeric_llamafactory_llama2_lora_loss0_gradnorm_nan (hiyouga/LlamaFactory#2810)
LF_STEPS = (
    b"03/12/2024 11:24:33 - INFO - llmtuner.extras.callbacks - {'loss': 0.0000, 'learning_rate': 4.9999e-02, 'epoch': 0.01}\n"
    b"{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 0.04999871292419044, 'epoch': 0.01}\n"
    b"03/12/2024 11:24:42 - INFO - llmtuner.extras.callbacks - {'loss': 0.0000, 'learning_rate': 4.9995e-02, 'epoch': 0.02}\n"
    b"{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 0.04999485182928687, 'epoch': 0.02}\n"
    b"03/12/2024 11:24:50 - INFO - llmtuner.extras.callbacks - {'loss': 0.0000, 'learning_rate': 4.9988e-02, 'epoch': 0.03}\n"
    b"{'loss': 0.0, 'grad_norm': nan, 'learning_rate': 0.04998841711285104, 'epoch': 0.03}\n"
)
# numeric_megatronlm_ci_moe_rerun_nan_grad_norm (NVIDIA/Megatron-LM#5026)
MEGATRON = (
    b"ERROR:megatron.core.rerun_state_machine:Unexpected result nan on rank 3 at iteration #3 invocation #2 "
    b"(message='found NaN in local grad norm for bucket #0 in backward pass before data-parallel communication "
    b"collective')\n"
)
# numeric_mobilenet_ssd_keras_invalid_loss_inf (manishsoni1908/Mobilenet-ssd-keras#21)
KERAS = (
    b"Epoch 1/10\n"
    b"  3/234 [..............................] - ETA: 33:37:24 - loss: 44.4110Batch 3: Invalid loss, terminating training\n"
    b"  4/234 [..............................] - ETA: 25:09:00 - loss: inf \n"
)
HEALTHY_STEP = b"{'loss': 1.2031, 'grad_norm': 0.8, 'learning_rate': 0.04998, 'epoch': 0.04}\n"


def test_numeric_blowups_in_other_formats():
    for name, log in (("mmseg", MMSEG), ("megatron", MEGATRON), ("keras", KERAS), ("llamafactory", LF_STEPS)):
        d = diagnose_bytes(log, ExitRecord(returncode=1))
        assert d.category is Category.NUMERIC, (name, d.summary)


def test_a_logger_copy_between_bad_steps_does_not_reset_the_live_run():
    s = LogScanner()
    assert [e.rule for e in s.feed(LF_STEPS)] == ["numeric_run"]


def test_a_healthy_step_after_them_or_a_printed_sample_does_not_act():
    for log in (MMSEG + b"2022-05-07 17:10:07,001 - mmseg - INFO - Iter [250/40000]  lr: 9.9e-06, decode.loss_seg: "
                b"0.4120, decode.acc_seg: 80.1\n", KERAS + b"  5/234 [....] - ETA: 20:00:00 - loss: 3.2100\n"):
        assert diagnose_bytes(log, ExitRecord(returncode=1)).category is not Category.NUMERIC
    s = LogScanner()
    # the same lines inside a printed training example: the user's data, never evidence
    assert s.feed(sample_block(LF_STEPS + MEGATRON) + HEALTHY_STEP) == []
    assert s.finish(ExitRecord(returncode=0)).category is Category.SUCCESS
    t = LogScanner()
    assert t.feed(LF_STEPS[:-85] + HEALTHY_STEP + LF_STEPS[-85:]) == []


def test_healthy_json_metrics_lines_between_bad_ones_end_the_run():
    # A JSON metrics logger (double quotes): its healthy steps were not seen as healthy, so three
    # scattered NaN steps stopped a live run that was learning.
    bad = b'{"loss": NaN, "grad_norm": NaN, "learning_rate": 1e-05, "epoch": 0.1}\n'
    good = b'{"loss": 1.25, "grad_norm": 0.8, "learning_rate": 1e-05, "epoch": 0.1}\n'
    assert LogScanner().feed(bad + good + bad + good + bad) == []
    assert [e.rule for e in LogScanner().feed(bad * 3)] == ["numeric_run"]
