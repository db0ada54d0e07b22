"""Rules generalised from the development part of batch r10 (issue 29): the formats a library prints,
not the words of one excerpt. Log text below is written from the libraries' own output formats, cited
per case; each test also holds the near miss that must not change."""

from supervisor.core.models import Category, ExitRecord, HostEvidence
from supervisor.judge.diagnosis import diagnose_bytes


def _ds(msg: str, t: str = "22:05:35,108") -> bytes:
    return f"[2021-01-26 {t}] [INFO] [fused_optimizer.py:316:_update_scale] {msg}\n".encode()


def test_deepspeeds_fused_optimizer_reducing_the_scale_from_1_to_1_is_the_floor():
    """deepspeed/runtime/fp16/fused_optimizer.py `_update_scale` logs "Reducing dynamic loss scale from
    {prev} to {new}" on each overflow, and log_dist "Overflow detected. Skipping step. Attempted loss
    scale: {prev}, reducing to {new}": at 1 (min_loss_scale's default) every step is skipped for good
    (bench r10b dev). Early calibration halving from 65536 is not a floor."""
    floor = _ds("Reducing dynamic loss scale from 1 to 1") * 2 + (
        b"[2021-01-26 22:05:35,108] [INFO] [logging.py:60:log_dist] [Rank 0] Overflow detected. Skipping step."
        b" Attempted loss scale: 1, reducing to 1\n")
    d = diagnose_bytes(floor, None)
    assert d.category is Category.NUMERIC, d.summary
    calibrating = b"".join(_ds(f"Reducing dynamic loss scale from {2 ** k} to {2 ** (k - 1)}") for k in (16, 15, 14))
    assert diagnose_bytes(calibrating, None).category is not Category.NUMERIC


def test_a_yolo_epoch_table_pasted_with_its_line_numbers_is_read_like_one_without():
    """ultralytics' BaseTrainer row ('%11s' * 2 + '%11.4g' * n: epoch/epochs, GPU memory, the mean
    losses, instances, size), copied from a numbered log view (bench r10b dev): the view's line number
    in front does not hide the NaN losses; finite ones stay finite."""
    head = b" 510       Epoch    GPU_mem   box_loss   cls_loss   dfl_loss  Instances       Size\n"

    def row(n: int, epoch: int, losses: str) -> bytes:
        return (f" {n}      {epoch}/300        17G {losses}          2        640: 100%|##########| 278/278"
                f" [02:11<00:00,  2.11it/s]\n").encode()

    d = diagnose_bytes(head + row(511, 91, "       nan        nan        nan") + head
                       + row(516, 92, "       nan        nan        nan"), None)
    assert d.category is Category.NUMERIC, d.summary
    fine = head + row(511, 91, "     1.757      1.015       0.96") + head + row(516, 92, "     1.749      1.011      0.958")
    assert diagnose_bytes(fine, None).category is not Category.NUMERIC


def test_a_trainers_own_words_for_a_non_finite_loss_and_grad_norm_at_the_end():
    """ESPnet's asr.py / e2e_asr_transformer.py warn "loss (=inf) is not correct" and "grad norm is nan.
    Do not update model." (bench r10b dev): two such reports ending the log are a numeric failure; one
    followed by finite training is not."""
    pre = b"2020-12-10 17:06:00,690 (e2e_asr_transformer:406) WARNING: "
    bad = pre + b"loss (=inf) is not correct\n" + b"2020-12-10 17:06:00,777 (asr:236) WARNING: grad norm is nan. Do not update model.\n"
    d = diagnose_bytes(bad, None)
    assert d.category is Category.NUMERIC, d.summary
    recovered = bad + b"2020-12-10 17:06:10,001 (asr:240) INFO: loss: 98.58, grad norm: 12.3\n"
    assert diagnose_bytes(recovered, None).category is not Category.NUMERIC


def test_please_input_a_setting_is_a_configuration_check():
    """ms-swift's argument check `raise ValueError(f'self.dataset: {self.dataset}, Please input the
    training dataset.')` (bench r10a dev), as other frameworks word theirs "Please specify the ...",
    "Please provide a ...". A program's request for a bug report is no such check."""
    d = diagnose_bytes(b"ValueError: self.dataset: [], Please input the training dataset.\n", None)
    assert d.category is Category.CONFIG_ERROR, d.summary
    other = diagnose_bytes(b"RuntimeError: internal state corrupted. Please report this at github.com/x/y\n", None)
    assert other.category is not Category.CONFIG_ERROR, other.summary


def test_rusts_failed_allocation_is_host_memory():
    """Rust's default alloc error handler (std::alloc::handle_alloc_error, used by the tokenizers and
    safetensors extensions) prints "memory allocation of N bytes failed" and aborts (bench r10c dev):
    host memory ran out. The words inside another line (a printed message) are not that line."""
    log = (b"[2023-04-16 21:36:16,042] [INFO] [comm.py:586:init_distributed] Initializing TorchBackend\n"
           b"memory allocation of 2097152 bytes failed\n"
           b"[2023-04-16 21:54:13,235] [INFO] [launch.py:428:sigkill_handler] Killing subprocess 62215\n")
    d = diagnose_bytes(log, None)
    assert d.category is Category.HOST_OOM and d.subkind == "bad_alloc", d.summary
    echoed = b"{'text': 'the log said memory allocation of 2097152 bytes failed'}\n"
    assert diagnose_bytes(echoed, None).category is not Category.HOST_OOM


def test_the_kernel_killing_a_process_of_the_job_is_host_oom_whatever_the_launcher_exits_with():
    """DeepSpeed's launcher kills the other ranks ("Killing subprocess N") and exits 1 when one rank was
    OOM-killed: the exit is no SIGKILL, but the kernel's line names the rank (the daemon keeps only
    lines naming the job's own processes: run/kernel_log.py) (bench r10c dev). Without that line, or
    with a kernel log read and no OOM in it, nothing says memory."""
    log = (b"[2025-06-02 20:51:24,182] [INFO] [launch.py:319:sigkill_handler] Killing subprocess 410126\n"
           b"[2025-06-02 20:51:24,184] [INFO] [launch.py:319:sigkill_handler] Killing subprocess 410127\n")
    kernel = ("[856341.770960] Out of memory: Killed process 410126 (python) total-vm:79905000kB, "
              "anon-rss:22957108kB, file-rss:72036kB, shmem-rss:15143164kB, UID:1000 pgtables:78032kB oom_score_adj:0")
    d = diagnose_bytes(log, ExitRecord(1, None), HostEvidence(kernel_lines=(kernel,), kernel_log_read=True))
    assert d.category is Category.HOST_OOM and "kernel" in d.summary, d.summary
    quiet = diagnose_bytes(log, ExitRecord(1, None), HostEvidence(kernel_log_read=True))
    assert quiet.category is not Category.HOST_OOM, quiet.summary


# --- batch r11's development part ---------------------------------------------------------------

def test_a_programs_one_word_nan_alarm_ending_the_log_is_numeric():
    """dl4mt's nmt.py prints "NaN detected" and returns; other trainers tag it ("[NaN/Inf detected] Loss
    'x' is invalid. Setting to zero.") (bench r11b dev). "No NaN detected" is the opposite."""
    log = b"> Valid  2.78936\n> Epoch  0 Update  88100 Cost  0.587470054626 UD  1.63904905319\n> NaN detected\n"
    d = diagnose_bytes(log, None)
    assert d.category is Category.NUMERIC, d.summary
    fine = b"> Epoch  0 Update  88100 Cost  0.587470054626 UD  1.63904905319\n> No NaN detected\n"
    assert diagnose_bytes(fine, None).category is not Category.NUMERIC


def test_a_kernels_own_assertion_is_a_crash_whatever_the_kernel_is_called():
    """ATen's CUDA_KERNEL_ASSERT prints "<file>.cu:<line>: <kernel>: block: [...], thread: [...] Assertion
    `...` failed." with the kernel's name as the compiler spells it ("operator()"), and glibc's assert()
    "prog: file.cpp:223: int f(...): Assertion `expr' failed." before abort() (bench r11a/r11b dev): the
    program's own check failed, a crash even when the paste stops before Python's error."""
    cuda = (b"/opt/conda/conda-bld/pytorch_1595629403081/work/aten/src/ATen/native/cuda/Loss.cu:106: operator(): "
            b"block: [101,0,0], thread: [31,0,0] Assertion `input_val >= zero && input_val <= one` failed.\n"
            b"Traceback (most recent call last):\n  File \"./tools/train.py\", line 188, in <module>\n    main()\n")
    d = diagnose_bytes(cuda, None)
    assert (d.category, d.subkind) == (Category.CRASH_OTHER, "device_assert"), d.summary
    glibc = (b"python3: /usr/local/lib/python3.6/dist-packages/deepspeed/ops/csrc/aio/py_lib/deepspeed_py_aio_handle"
             b".cpp:223: int deepspeed_aio_handle_t::pread(const at::Tensor&, const char*, bool, bool): Assertion "
             b"`static_cast<long long int>(buffer_bytes) == num_file_bytes' failed.\n")
    d = diagnose_bytes(glibc, None)
    assert (d.category, d.subkind) == (Category.CRASH_OTHER, "abort"), d.summary
    said = b"INFO: checked that the Assertion `x > 0' in kernels.cpp holds\n"
    assert diagnose_bytes(said, None).category is Category.UNKNOWN


def test_a_scripts_check_that_a_path_it_was_given_exists_is_configuration():
    """diffusers' DreamBooth dataset: `raise ValueError("Instance images root doesn't exists.")` (bench
    r11a dev), the same check FileNotFoundError makes. A path the program made itself is not in such words
    checked by a ValueError about a model's internals."""
    d = diagnose_bytes(b"ValueError: Instance images root doesn't exists.\n", None)
    assert (d.category, d.subkind) == (Category.CONFIG_ERROR, "path_not_found"), d.summary
    other = diagnose_bytes(b"ValueError: Expected a non-empty tensor; the layer has no weights\n", None)
    assert other.category is not Category.CONFIG_ERROR


def test_an_argparse_error_before_kaldis_run_pl_footer_is_the_final_error():
    """Kaldi's and ESPnet1's run.pl/queue.pl close every job log with "# Accounting: time=..." and "# Ended
    (code N) at ...": framing, not what the job said (bench r11a dev). argparse's "prog: error: ..." above
    it is the log's final error, a configuration error, as it is without the footer."""
    err = b"asr_train.py: error: unrecognized arguments: --lsm-type=unigram --sampling-probability=0.0\n"
    footer = b"# Accounting: time=2 threads=1\n# Ended (code 2) at Thu Feb 20 12:16:09 CST 2020, elapsed time 2 seconds\n"
    assert diagnose_bytes(err, None).category is Category.CONFIG_ERROR
    d = diagnose_bytes(err + footer, None)
    assert d.category is Category.CONFIG_ERROR and d.strength != "hint", d.summary


# --- batch r12's development part ---------------------------------------------------------------

def test_one_metrics_line_whose_losses_are_nan_is_numeric_even_beside_a_grad_norm():
    """verl's console logger prints a step's metrics as "key:value - key:value" (bench r12b dev): with
    the policy and KL losses NaN the loss itself is gone, not a skipped fp16 step's grad norm."""
    line = (b"step:59 - actor/kl_loss:nan - actor/kl_coef:0.001 - actor/entropy_loss:nan - actor/pg_loss:nan"
            b" - actor/grad_norm:nan - critic/score/mean:0.412\n")
    d = diagnose_bytes(line, None)
    assert d.category is Category.NUMERIC, d.summary
    skipped = b"step:59 - actor/kl_loss:0.012 - actor/pg_loss:0.31 - actor/grad_norm:nan\n"
    assert diagnose_bytes(skipped, None).category is not Category.NUMERIC


def test_a_registry_that_refuses_a_name_in_other_words_is_configuration():
    """ms-swift's `model_type: 'got-ocr2' is not registered` and detectron2's catalog `Dataset
    'coco_2017_train' is already registered!` (bench r12a/r12b dev): the name the config gives."""
    for msg in (b"ValueError: model_type: 'got-ocr2' is not registered\n",
                b"AssertionError: Dataset 'coco_2017_train' is already registered!\n"):
        d = diagnose_bytes(msg, None)
        assert (d.category, d.subkind) == (Category.CONFIG_ERROR, "unknown_keys"), d.summary
    assert diagnose_bytes(b"RuntimeError: hook is not registered for this module\n", None).category \
        is not Category.CONFIG_ERROR


def test_a_deepspeed_config_path_that_does_not_exist_is_configuration():
    """transformers' HfDeepSpeedConfig: "Expected a string path to an existing deepspeed config, or a
    dictionary, or a base64 encoded string. Received: ds_config_zero2.json" (bench r12b dev)."""
    d = diagnose_bytes(b"ValueError: Expected a string path to an existing deepspeed config, or a dictionary,"
                       b" or a base64 encoded string. Received: ds_config_zero2.json\n", None)
    assert (d.category, d.subkind) == (Category.CONFIG_ERROR, "path_not_found"), d.summary


def test_jsonargparses_error_and_its_indented_message_end_the_log():
    """LightningCLI's parser (jsonargparse) prints its usage, then "error: Parser key ...:" with the
    reasons indented under it, then exits 2 (bench r12a dev): that block is the final error, the user's
    configuration; an indented block under no error head stays what it was."""
    log = (b"usage: main.py [-h] [-c CONFIG] [--print_config[=flags]] {fit,validate,test,predict} ...\n"
           b'error: Parser key "trainer.deterministic":\n  Does not validate against any of the Union subtypes\n'
           b"  Subtypes: (<class 'bool'>, <class 'NoneType'>)\n  Given value type: <class 'str'>\n  Given value: warn\n")
    d = diagnose_bytes(log, None)
    assert d.category is Category.CONFIG_ERROR and d.strength != "hint", d.summary
    short = b"usage: trainer.py [-h] [-c CONFIG]\nerror: Validation failed: Key 'model.init_args.seq_length' is not expected\n"
    assert diagnose_bytes(short, None).category is Category.CONFIG_ERROR


def test_a_check_that_tells_the_user_to_correct_their_labels_is_configuration():
    """YOLOv5's dataset check: `assert mlc < nc, f'Label class {mlc} exceeds nc={nc} in {data}. Possible
    class labels are 0-{nc - 1}'` / "... Correct your labels or your model." (bench r12a dev)."""
    d = diagnose_bytes(b"AssertionError: Label class 20 exceeds nc=20 in data/yolov5m.yaml. Correct your labels"
                       b" or your model.\n", None)
    assert d.category is Category.CONFIG_ERROR, d.summary


def test_a_scripts_assert_that_a_path_setting_exists_is_configuration():
    """`assert os.path.exists(args.train_dir)` in the user's own train.py, a bare AssertionError under it
    (bench r12a dev): the path the user passed. The same assert on the script's own variable is not a
    setting."""
    def tb(code: bytes) -> bytes:
        return (b'Traceback (most recent call last):\n  File "train.py", line 286, in <module>\n    main()\n'
                b'  File "train.py", line 107, in main\n    ' + code + b"\nAssertionError\n")
    d = diagnose_bytes(tb(b"assert os.path.exists(args.train_dir)"), None)
    assert d.category is Category.CONFIG_ERROR, d.summary
    assert diagnose_bytes(tb(b"assert os.path.exists(tmp_file)"), None).category is not Category.CONFIG_ERROR


def test_torch_2_0s_agent_summary_after_an_argparse_error_is_teardown():
    """torch 2.0-2.2's elastic agent logs "torch.distributed.elastic.multiprocessing.api: [ERROR] failed
    (exitcode: 2) local_rank: 0 ..." after the child's own error (bench r12a dev, MONAI): a launcher's
    report, so argparse's error above it is the final error."""
    log = (b"brats_training_ddp.py: error: unrecognized arguments: --local-rank=0\n"
           b"[2024-03-16 03:30:01,302] torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: 2)"
           b" local_rank: 0 (pid: 380) of binary: /usr/bin/python\n")
    d = diagnose_bytes(log, None)
    assert d.category is Category.CONFIG_ERROR and d.strength != "hint", d.summary
