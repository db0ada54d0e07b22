"""Config errors read from how the libraries raise them, not from corpus wording (issue 29).

Each case is a traceback in the shape Python prints it around a check the library's OWN source makes
(file named per case; message texts copied from its raise statement). The old reading knew these
only when the exact words had been seen in a corpus excerpt. The bug cases keep their class:
a TypeError/AttributeError from a moved API, a KeyError in the user's own code, a shape error."""

import pytest

from supervisor.core.models import Category
from supervisor.judge.diagnosis import diagnose_bytes


def _tb(frames: list[tuple[str, str]], exc_line: str) -> bytes:
    body = "".join(f'  File "{path}", line 12, in {func}\n    raise X\n' for path, func in frames)
    return f"Traceback (most recent call last):\n{body}{exc_line}\n".encode()


_MAIN = ("/home/u/train.py", "<module>")
CONFIG_CASES = {
    # peft/tuners/lora/config.py LoraConfig.__post_init__: a check of the adapter's configuration
    "peft_post_init": _tb(
        [_MAIN, ("/opt/conda/lib/python3.10/site-packages/peft/tuners/lora/config.py", "__post_init__")],
        "ValueError: `layers_to_transform` cannot be used when `target_modules` is a str.",
    ),
    # trl/trainer/*_config.py: a trainer config's own __post_init__ (any wording)
    "trl_config_frame": _tb(
        [_MAIN, ("/usr/lib/python3/site-packages/trl/trainer/dpo_config.py", "__post_init__")],
        "ValueError: Invalid value for loss_type: sigmoid2.",
    ),
    # transformers/configuration_utils.py PretrainedConfig validation, raised at a configuration_*.py frame
    "pretrained_config_frame": _tb(
        [_MAIN, ("/x/site-packages/transformers/models/llama/configuration_llama.py", "_rope_scaling_validation")],
        "ValueError: `rope_scaling`'s factor field must be a float > 1, got 0.5",
    ),
    # argparse.py ArgumentParser.error, raised from HfArgumentParser (exit_on_error=False style traceback)
    "argparse_error_class": _tb(
        [_MAIN, ("/usr/lib/python3.10/argparse.py", "_check_value")],
        "argparse.ArgumentError: argument --lr_scheduler_type: invalid choice: 'cosin' (choose from 'linear', 'cosine')",
    ),
    # hydra/errors.py InstantiationException: hydra/_internal/instantiate/_instantiate2.py
    "hydra_instantiation": _tb(
        [_MAIN, ("/x/site-packages/hydra/_internal/utils.py", "_locate")],
        "hydra.errors.InstantiationException: Error locating target 'models.Nett', set env var HYDRA_FULL_ERROR=1",
    ),
    # allennlp/common/checks.py ConfigurationError; any *ConfigError class is a framework's config check
    "configuration_error_class": _tb([_MAIN], "allennlp.common.checks.ConfigurationError: key \"model\" is required"),
    "config_error_class": _tb([_MAIN], "axolotl.utils.config.models.input.v0_4_1.ConfigError: bad value"),
    # pydantic's ValidationError for a model of any name (eole's, axolotl's, a trainer's arguments)
    "pydantic_any_model": _tb(
        [_MAIN, ("/x/site-packages/pydantic/main.py", "__init__")],
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for TrainingSpec",
    ),
    # the grammar of checks, raised from the user's own script (no library frame): key + requirement
    "key_must_be": _tb([_MAIN], "ValueError: `gradient_accumulation_steps` must be a positive integer, got 0"),
    "flag_not_supported": _tb([_MAIN], "ValueError: --fp16 is not supported with --device cpu"),
    "mutually_exclusive": _tb([_MAIN], "ValueError: `max_steps` and `num_epochs` are mutually exclusive"),
    "only_supported": _tb([_MAIN], "AssertionError: sequence_parallel is only supported with tensor_model_parallel_size > 1"),
    "unknown_type": _tb([_MAIN], "ValueError: Unknown scheduler type: cosine_with_restart"),
    "evenly_divisible": _tb(
        [_MAIN, ("/x/site-packages/megatron/training/arguments.py", "validate_args")],
        "AssertionError: number of layers should be divisible by the pipeline parallel size",
    ),
    "not_implemented_option": _tb([_MAIN], "NotImplementedError: optimizer `adafactor8` is not supported yet"),
    # accelerate/utils/dataclasses.py and a script's own `validate_*` / `check_*args` function
    "validate_func": _tb(
        [_MAIN, ("/home/u/src/setup.py", "validate_args")],
        "ValueError: warmup_ratio 1.5 out of range",
    ),
    # datasets: a column the config names is not in the data (arrow_dataset.py)
    "column_not_in_dataset": _tb(
        [_MAIN, ("/x/site-packages/datasets/arrow_dataset.py", "rename_column")],
        "ValueError: Original column name text not in the dataset. Current columns in the dataset: ['prompt']",
    ),
}
# Messages said outside an exception line, as the final error of the log
MENTION_CASES = {
    # argparse.py ArgumentParser.error(): "%(prog)s: error: %(message)s" then exit(2)
    "argparse_usage": b"usage: train.py [-h] [--mixed_precision {no,fp16,bf16}]\n"
                      b"train.py: error: argument --mixed_precision: invalid choice: 'fp8' (choose from 'no', 'fp16', 'bf16')\n",
    "argparse_required": b"usage: run.py [-h] --model_name_or_path MODEL_NAME_OR_PATH\n"
                         b"run.py: error: the following arguments are required: --model_name_or_path\n",
    "argparse_unrecognized": b"usage: run.py [-h]\nrun.py: error: unrecognized arguments: --lora_rnak 8\n",
    # click/exceptions.py UsageError.show(): usage, a hint, then "Error: {message}"
    "click_no_such_option": b"Usage: train.py [OPTIONS]\nTry 'train.py --help' for help.\n\nError: No such option: --lr\n",
    "click_invalid_value": b"Usage: train.py [OPTIONS]\nTry 'train.py --help' for help.\n\n"
                           b"Error: Invalid value for '--precision': 'fp8' is not one of 'fp16', 'bf16', 'fp32'.\n",
    # hydra/_internal/instantiate/_instantiate2.py: "Error in call to target '...':\n{repr(e)}"
    "hydra_call_target": b"Error executing job with overrides: []\n"
                         b"Error in call to target 'models.Encoder':\n"
                         b"TypeError(\"__init__() got an unexpected keyword argument 'dropuot'\")\n",
    # omegaconf/errors.py MissingMandatoryValue as printed by hydra
    "omegaconf_missing": b"Error executing job with overrides: []\nMissing mandatory value: model.name\n"
                         b"    full_key: model.name\n    object_type=dict\n",
    # torch/nn/modules/module.py load_state_dict, the message wrapped by a mail client mid-sentence
    "size_mismatch_wrapped": b"RuntimeError: Error(s) in loading\n"
                             b"        size mismatch for\nlayer.weight:\ncopying a param\n"
                             b"with shape torch.Size([8, 1280]) from checkpoint, the shape in current\n"
                             b"model is torch.Size([16, 1280]).\n",
}
BUG_CASES = {
    # a moved API (TypeError/AttributeError/ImportError in library code) stays a crash
    "moved_api_typeerror": _tb(
        [_MAIN, ("/x/site-packages/transformers/configuration_utils.py", "__init__")],
        "TypeError: __init__() got an unexpected keyword argument 'use_auth_token'",
    ),
    "attribute_in_config": _tb(
        [_MAIN, ("/x/site-packages/transformers/models/llama/configuration_llama.py", "__getattribute__")],
        "AttributeError: 'LlamaConfig' object has no attribute 'rope_theta'",
    ),
    "import_error": _tb([_MAIN], "ImportError: cannot import name 'is_torch_tpu_available' from 'transformers'"),
    # a KeyError in the user's own code is a bug
    "user_keyerror": _tb([_MAIN, ("/home/u/data.py", "__getitem__")], "KeyError: 'input_ids'"),
    # shapes and values of tensors: torch's checks of a program's arithmetic
    "shape_value": _tb([_MAIN], "ValueError: Expected input batch_size (32) to match target batch_size (64)."),
    "target_size": _tb([_MAIN], "ValueError: Target size (torch.Size([8])) must be the same as input size (torch.Size([8, 1]))"),
    "unpack": _tb([_MAIN], "ValueError: too many values to unpack (expected 2)"),
    "format_code": _tb([_MAIN], "ValueError: Unknown format code 'd' for object of type 'float'"),
    "runtime_must": _tb([_MAIN], "RuntimeError: Expected all tensors to be on the same device, but found at least two devices"),
    "int_literal": _tb([_MAIN], "ValueError: invalid literal for int() with base 10: 'abc'"),
}


@pytest.mark.parametrize("name", sorted(CONFIG_CASES))
def test_library_config_checks_are_config_errors(name: str) -> None:
    d = diagnose_bytes(CONFIG_CASES[name])
    assert d.category is Category.CONFIG_ERROR, (name, d.summary)
    assert d.strength != "hint"


@pytest.mark.parametrize("name", sorted(MENTION_CASES))
def test_config_checks_said_as_the_final_error(name: str) -> None:
    d = diagnose_bytes(MENTION_CASES[name])
    assert d.category is Category.CONFIG_ERROR, (name, d.summary)


@pytest.mark.parametrize("name", sorted(BUG_CASES))
def test_bugs_stay_crashes(name: str) -> None:
    d = diagnose_bytes(BUG_CASES[name])
    assert d.category is Category.CRASH_OTHER, (name, d.summary)


def test_printed_check_followed_by_training_is_not_the_end() -> None:
    """A usage error echoed by a sub-tool, then training that goes on: no config error."""
    log = (MENTION_CASES["argparse_unrecognized"]
           + b"".join(b"{'loss': 1.%d, 'learning_rate': 1e-05, 'epoch': 0.%d}\n" % (i, i) for i in range(1, 6)))
    d = diagnose_bytes(log)
    assert d.category is not Category.CONFIG_ERROR


BUG_CASES_2 = {
    # tensorflow/python/framework/errors_impl.py: an op's InvalidArgumentError is not an argument check
    "tf_invalid_argument": _tb([_MAIN], "tensorflow.python.framework.errors_impl.InvalidArgumentError: indices[3] = 7 is not in [0, 5)"),
    # a keyword a newer release removed (torchmetrics' compute_on_step): a moved API
    "removed_kwarg": _tb([_MAIN], "ValueError: Unexpected keyword arguments: `compute_on_step`"),
    # transformers/models/auto/configuration_auto.py: a model type the installed release lacks
    "auto_keyerror": _tb([_MAIN, ("/x/site-packages/transformers/models/auto/configuration_auto.py", "__getitem__")],
                         "KeyError: 'qwen2'"),
    "auto_valueerror": _tb(
        [_MAIN, ("/x/site-packages/transformers/models/auto/configuration_auto.py", "from_pretrained")],
        "ValueError: The checkpoint you are trying to load has model type `qwen2` but Transformers does not "
        "recognize this architecture."),
}


@pytest.mark.parametrize("name", sorted(BUG_CASES_2))
def test_version_mismatches_stay_crashes(name: str) -> None:
    d = diagnose_bytes(BUG_CASES_2[name])
    assert d.category is Category.CRASH_OTHER, (name, d.summary)


RUNTIME_BUGS = {
    # torch's checks of a program's arithmetic and autograd, in a RuntimeError's words
    "input_type": _tb([_MAIN], "RuntimeError: Input type (torch.cuda.HalfTensor) and weight type (torch.cuda.FloatTensor) "
                      "should be the same"),
    "scalar_type": _tb([_MAIN], "RuntimeError: expected scalar type Half but found Float"),
    "size_of_tensor": _tb([_MAIN], "RuntimeError: The size of tensor a (4096) must match the size of tensor b (2048)"),
    "inplace": _tb([_MAIN], "RuntimeError: one of the variables needed for gradient computation has been modified by an "
                   "inplace operation"),
    "cuda_error": _tb([_MAIN], "RuntimeError: CUDA error: an illegal memory access was encountered"),
}
RUNTIME_CHECKS = {
    # accelerate/accelerator.py _prepare_deepspeed: a RuntimeError/ValueError naming what must be passed
    "accelerate_prepare": _tb([_MAIN], "ValueError: When using DeepSpeed, `accelerate.prepare()` requires you to pass at "
                              "least one of training or evaluation dataloaders"),
    # deepspeed/runtime/zero/offload_config.py-style: what an option can only work with
    "can_only_work": _tb([_MAIN], "AssertionError: ZeRO Offload can only work with DeepSpeed optimizers"),
}


@pytest.mark.parametrize("name", sorted(RUNTIME_BUGS))
def test_runtime_bugs_stay_crashes(name: str) -> None:
    d = diagnose_bytes(RUNTIME_BUGS[name])
    assert d.category is not Category.CONFIG_ERROR, (name, d.summary)


@pytest.mark.parametrize("name", sorted(RUNTIME_CHECKS))
def test_checks_in_other_words(name: str) -> None:
    d = diagnose_bytes(RUNTIME_CHECKS[name])
    assert d.category is Category.CONFIG_ERROR, (name, d.summary)


MODULE_CASES = {
    # yaml/scanner.py: the user's YAML config does not parse
    "yaml_scanner": _tb([_MAIN, ("/x/site-packages/yaml/scanner.py", "fetch_value")],
                        "yaml.scanner.ScannerError: mapping values are not allowed here"),
    # omegaconf/errors.py: every class there is about the config (interpolations included)
    "omegaconf_interpolation": _tb([_MAIN, ("/x/site-packages/omegaconf/base.py", "_resolve_interpolation")],
                                   "omegaconf.errors.InterpolationKeyError: Interpolation key 'data.root' not found"),
    # transformers/modeling_utils.py: a weights folder that holds no weights (the path given is wrong)
    "no_weights_in_dir": _tb([_MAIN, ("/x/site-packages/transformers/modeling_utils.py", "from_pretrained")],
                             "OSError: Error no file named pytorch_model.bin, model.safetensors, tf_model.h5, "
                             "model.ckpt.index or flax_model.msgpack found in directory /data/ckpt/final."),
}
VERSION_CASES = {
    # transformers/models/auto/tokenization_auto.py: a tokenizer class the installed release lacks
    "tokenizer_class": _tb([_MAIN], "ValueError: Tokenizer class Qwen2Tokenizer does not exist or is not currently imported."),
    # transformers/models/auto/auto_factory.py: a model class the installed release does not map
    "auto_factory": _tb([_MAIN], "ValueError: Unrecognized configuration class <class 'transformers_modules.x.XConfig'> "
                        "for this kind of AutoModel: AutoModelForCausalLM."),
}


@pytest.mark.parametrize("name", sorted(MODULE_CASES))
def test_config_library_classes_and_missing_weights(name: str) -> None:
    d = diagnose_bytes(MODULE_CASES[name])
    assert d.category is Category.CONFIG_ERROR, (name, d.summary)


@pytest.mark.parametrize("name", sorted(VERSION_CASES))
def test_release_mismatches_stay_crashes(name: str) -> None:
    d = diagnose_bytes(VERSION_CASES[name])
    assert d.category is Category.CRASH_OTHER, (name, d.summary)


GRAMMAR_EDGE = {
    # transformers/trainer.py and TRL's checks in their own words (no corpus excerpt says these)
    ("config", "ValueError: `max_seq_length` (4096) is larger than the maximum length for the model"),
    ("config", "ValueError: Trainer: evaluation requires an eval_dataset."),
    ("config", "ValueError: Config name is missing. Please pick one among the available configs: ['a', 'b']"),
    # torch's TORCH_CHECKs on operands: bugs, even with 'expected ... got' and a dtype in them
    ("bug", "RuntimeError: expected mat1 and mat2 to have the same dtype, but got: float != c10::Half"),
    ("bug", ("RuntimeError: Given groups=1, weight of size [64, 3, 7, 7], expected input[1, 4, 224, 224] to have 3 "
             "channels, but got 4 channels instead")),
    ("bug", "RuntimeError: stack expects each tensor to be equal size, but got [3, 224, 224] at entry 0"),
}


@pytest.mark.parametrize(("kind", "line"), sorted(GRAMMAR_EDGE))
def test_check_grammar_edges(kind: str, line: str) -> None:
    d = diagnose_bytes(_tb([_MAIN], line))
    want = Category.CONFIG_ERROR if kind == "config" else Category.CRASH_OTHER
    assert d.category is want, (line, d.summary)
