"""Configuration errors as frameworks check them (issue 29, development part of bench/corpus): a
DeepSpeed batch-size assertion under a rich-style traceback, a yacs key typo, an mmengine registry
miss, a checkpoint whose shapes do not fit the model, hydra refusing an override. Each was called
crash_other or 'no failure evidence'. The texts below are copied from the excerpts named."""

from supervisor.core.models import Category, ExitRecord
from supervisor.judge.diagnosis import diagnose_bytes

# config_error_hfblog_starchat_rich_ds_batch_assertion (huggingface/blog#1270): rich's boxed frames.
RICH_BATCH = (
    "│ /opt/conda/lib/python3.7/site-packages/deepspeed/runtime/config.py: │\n"
    "│ 891 in _batch_assertion                                             │\n"
    "│                                                                     │\n"
    "│ ❱  891 │   │   │   f\"Check batch related parameters. train_batch_si │\n"
    "│    892 │   │   │   \"to micro_batch_per_gpu * gradient_acc_step * wo │\n"
    "╰─────────────────────────────────────────────────────────────────────╯\n"
    "AssertionError: Check batch related parameters. train_batch_size is not\n"
    "equal to micro_batch_per_gpu * gradient_acc_step * world_size 64 != 4 *\n"
    "8 * 1\n"
).encode()
# config_error_fsdet_yacs_typo_model_wetghts (ucbdrive/few-shot-object-detection#180)
YACS = (
    b"Traceback (most recent call last):\n"
    b'  File "/home/sjk/anaconda3/envs/chpy/lib/python3.8/site-packages/yacs/config.py", line 491, in _merge_a_into_b\n'
    b'    raise KeyError("Non-existent config key: {}".format(full_key))\n'
    b"KeyError: 'Non-existent config key: MODEL.WETGHTS'\n"
)
# config_error_mmengine_cocodataset_not_in_registry (open-mmlab/mmengine#1463)
REGISTRY = (
    b"KeyError: 'CocoDataset is not in the mmengine::dataset registry. Please check whether the value of "
    b"`CocoDataset` is correct or it was registered as expected. More details can be found at "
    b"https://mmengine.readthedocs.io/en/latest/advanced_tutorials/config.html#import-the-custom-module'\n"
)
# config_error_pive_t5_vocab_size_mismatch (Jiuzhouh/PiVe#4): load_state_dict's message lines alone.
SIZE_MISMATCH = (
    b"size mismatch for shared.weight: copying a param with shape torch.Size([32101, 768]) from checkpoint, "
    b"the shape in current model is torch.Size([32128, 768]).\n"
    b"\tsize mismatch for lm_head.weight: copying a param with shape torch.Size([32101, 768]) from checkpoint, "
    b"the shape in current model is torch.Size([32128, 768]).\n"
)
# config_error_verl_hydra_cannot_override_rollout_n (verl-project/verl#4262)
HYDRA = (
    b"Could not override 'actor_rollout_ref.rollout.n'.\n"
    b"To append to your config use +actor_rollout_ref.rollout.n=16\n"
    b"Key 'n' is not in struct\n"
    b"    full_key: actor_rollout_ref.rollout.n\n"
    b"    object_type=dict\n"
    b"\n"
    b"Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n"
)
# config_error_facechain_caption_column_not_in_dataset (modelscope/facechain#171): a `[stderr   ]` stream tag
STDERR_TAG = (
    b"Traceback (most recent call last):\n"
    b'2023-09-04 08:11:57.459 [stderr   ]   File "/data/repos/facechain/facechain/train_text_to_image_lora.py", '
    b"line 1469, in <module>\n"
    b"2023-09-04 08:11:57.460 [stderr   ]     main()\n"
    b'2023-09-04 08:11:57.460 [stderr   ]   File "/data/repos/facechain/facechain/train_text_to_image_lora.py", '
    b"line 1015, in main\n"
    b"2023-09-04 08:11:57.460 [stderr   ]     raise ValueError(\n"
    b"2023-09-04 08:11:57.460 [stderr   ] ValueError: --caption_column' value 'text' needs to be one of: image\n"
)
# config_error_yolop_label_json_not_found (hustvl/YOLOP#191): a dataset file the config points at
NOT_FOUND = (
    b"Traceback (most recent call last):\n"
    b'  File "/home/user/YOLOP/lib/dataset/bdd.py", line 37, in _get_db\n'
    b"    with open(label_path, 'r') as f:\n"
    b"FileNotFoundError: [Errno 2] No such file or directory: "
    b"'/media/user/LaCie/DataSet/YOLOP/det_annotation/train/1f864b3f-a736fa8b.json'\n"
)

# config_error_deepspeed_interleaved_inference_config_validation (deepspeedai/DeepSpeed#2890): two
# processes' tracebacks interleaved; the exception's module path was split from its class
INTERLEAVED = (
    b"Traceback (most recent call last):\n"
    b'  File "inference-test-zero.py", line 95, in <module>\n'
    b"    pipe.model = deepspeed.init_inference(pipe.model,\n"
    b'  File "/home/lambda7xx/.local/lib/python3.8/site-packages/deepspeed/__init__.py", line 309, in init_inference\n'
    b"    [2023-02-24 02:08:06,001] [INFO] [logging.py:68:log_dist] [Rank -1] DeepSpeed info: version=0.7.6, "
    b"git-hash=unknown, git-branch=unknown\n"
    b"ds_inference_config = DeepSpeedInferenceConfig(**config_dict)\n"
    b'  File "/home/lambda7xx/.local/lib/python3.8/site-packages/deepspeed/runtime/config_utils.py", line 55, in __init__\n'
    b"    super().__init__(**data)\n"
    b'  File "pydantic/main.py", line 342, in pydantic.main.BaseModel.__init__\n'
    b"Traceback (most recent call last):\n"
    b'pydantic.error_wrappers  File "inference-test-zero.py", line 95, in <module>\n'
    b".ValidationError: 3 validation errors for DeepSpeedInferenceConfig\n"
    b"tp\n"
    b"  value is not a valid dict (type=type_error.dict)\n"
)

# config_error_kohya_ss_rich_log_no_data_found (bmaltais/kohya_ss#2118): rich's logging handler wraps
# the record onto lines indented to its message column
RICH_LOG = (
    " INFO     mean ar error (without repeats): nan                                      train_util.py:856\n"
    "                    ERROR    No data found. Please verify arguments (train_data_dir must be the     train_network.py:213\n"
    "                             parent of folders with images) /\n"
    "                             画像がありません。引数指定を確認してください（train_data_dirには画像が\n"
    "                             あるフォルダではなく、画像があるフォルダの親フォルダを指定する必要があ\n"
    "                             ります）\n"
).encode()


def test_framework_config_checks_are_config_errors():
    for name, log in (("rich", RICH_BATCH), ("yacs", YACS), ("registry", REGISTRY),
                      ("size_mismatch", SIZE_MISMATCH), ("hydra", HYDRA), ("stderr_tag", STDERR_TAG),
                      ("not_found", NOT_FOUND), ("interleaved", INTERLEAVED),
                      ("rich_log", RICH_LOG)):
        d = diagnose_bytes(log, ExitRecord(returncode=1))
        assert d.category is Category.CONFIG_ERROR, (name, d.summary)
        assert d.strength == "structural", (name, d.summary)


def test_the_same_words_in_ordinary_output_do_not_act():
    # printed while training went on, not what ended the run
    for log in (SIZE_MISMATCH + b"{'loss': 1.2, 'learning_rate': 1e-05, 'epoch': 0.1}\n",
                (b"note: 'size mismatch for shared.weight: copying a param with shape' was fixed in v2\n"
                 b"{'train_runtime': 10.0, 'train_loss': 1.1, 'epoch': 1.0}\n")):
        d = diagnose_bytes(log, ExitRecord(returncode=0))
        assert d.category is Category.SUCCESS, d.summary


def test_a_wrapped_rich_record_before_more_output_is_no_final_error():
    going_on = RICH_LOG + b" INFO     epoch 1/10                                                               train_network.py:700\n"
    assert diagnose_bytes(going_on, ExitRecord(returncode=1)).category is not Category.CONFIG_ERROR


def test_a_missing_tool_or_library_is_not_the_users_path():
    for exc in (b"FileNotFoundError: [Errno 2] No such file or directory: 'nvcc'",
                b"FileNotFoundError: Could not find module 'C:\\cuda\\bin\\cudart64_110.dll'"):
        log = NOT_FOUND.replace(NOT_FOUND.splitlines()[-1], exc)
        assert diagnose_bytes(log, ExitRecord(returncode=1)).category is not Category.CONFIG_ERROR


def test_a_version_mismatch_typeerror_stays_a_crash():
    # crash_other_trl_trainer_unexpected_kwarg_tokenizer (huggingface/trl#6168): a library's API moved
    log = (b"Traceback (most recent call last):\n"
           b'  File ".../Comm_Pretrain.py", line 596, in <module>\n'
           b"    sfttrainer = SFTTrainer(\n"
           b'  File ".../miniconda3/envs/agentic-frozenlake/lib/python3.10/site-packages/trl/trainer/sft_trainer.py",'
           b" line 401, in __init__\n"
           b"    super().__init__(\n"
           b"TypeError: Trainer.__init__() got an unexpected keyword argument 'tokenizer'\n")
    assert diagnose_bytes(log, ExitRecord(returncode=1)).category is Category.CRASH_OTHER
