"""Config checks told by what the libraries raise (issue 29, dev misses of r9a): a class whose name says the
configuration was wrong wherever the word sits in it, omegaconf's own detail lines under its error, and
transformers' Auto factories refusing a config class (a release or remote code that lacks it: a mismatch, not
a setting)."""

import pytest

from supervisor.core.models import Category
from supervisor.judge.diagnosis import diagnose_bytes

_TB = b'Traceback (most recent call last):\n  File "/home/u/train.py", line 40, in <module>\n    main()\n'


def _lib_frame(path: str, func: str, code: str) -> bytes:
    return f'  File "{path}", line 88, in {func}\n    {code}\n'.encode()


@pytest.mark.parametrize("exc", [
    # NeMo's exp_manager.py: class LoggerMisconfigurationError(NeMoBaseException)
    ("nemo.utils.exp_manager.LoggerMisconfigurationError: The pytorch lightning trainer that was passed to exp_manager"
    " contained a logger"),
    # NeMo's exp_manager.py: class CheckpointMisconfigurationError(NeMoBaseException)
    ("nemo.utils.exp_manager.CheckpointMisconfigurationError: The pytorch lightning trainer that was passed to"
    " exp_manager contained a ModelCheckpoint"),
])
@pytest.mark.parametrize("with_traceback", [False, True])
def test_a_misconfiguration_class_anywhere_in_the_name_is_config(exc: str, with_traceback: bool) -> None:
    head = _TB + _lib_frame("/usr/lib/python3.10/site-packages/nemo/utils/exp_manager.py", "exp_manager",
                            "raise LoggerMisconfigurationError(") if with_traceback else b""
    d = diagnose_bytes(head + exc.encode() + b"\n")
    assert d.category is Category.CONFIG_ERROR, d.summary
    assert d.strength != "hint", d.summary


def test_a_configuration_warning_class_is_not_an_error() -> None:
    d = diagnose_bytes(b"UserMisconfigurationWarning: the logger is set twice\n{'loss': 1.2, 'epoch': 0.5}\n")
    assert d.category is not Category.CONFIG_ERROR, d.summary


@pytest.mark.parametrize("ref_type", [True, False])
def test_omegaconfs_detail_lines_are_part_of_its_error(ref_type: bool) -> None:
    # omegaconf/_utils.py format_and_raise: "$MSG\n    full_key: $FULL_KEY\n    reference_type=$REF_TYPE\n
    #    object_type=$OBJECT_TYPE" (reference_type only when the node has one)
    log = (b"omegaconf.errors.ConfigAttributeError: Key 'min_lr' is not in struct\n"
           b"        full_key: optimization.min_lr\n"
           + (b"        reference_type=Optional[Dict[Union[str, Enum], Any]]\n" if ref_type else b"")
           + b"        object_type=dict\n")
    d = diagnose_bytes(log)
    assert d.category is Category.CONFIG_ERROR, d.summary
    assert d.strength != "hint", d.summary


@pytest.mark.parametrize(("path", "func", "msg"), [
    ("transformers/models/auto/tokenization_auto.py", "from_pretrained",
     ("Unrecognized configuration class <class 'transformers_modules.local.configuration_chatglm.ChatGLMConfig'> to"
     " build an AutoTokenizer.")),
    ("transformers/models/auto/processing_auto.py", "from_pretrained",
     ("Unrecognized configuration class <class 'transformers.models.x.configuration_x.XConfig'> to build an"
     " AutoProcessor.")),
    ("transformers/models/auto/auto_factory.py", "from_pretrained",
     ("Unrecognized configuration class <class 'transformers.models.qwen2_vl.configuration_qwen2_vl.Qwen2VLConfig'>"
     " for this kind of AutoModel: AutoModelForCausalLM.")),
])
def test_an_auto_factory_refusing_a_config_class_is_a_mismatch(path: str, func: str, msg: str) -> None:
    log = (_TB + _lib_frame(f"/usr/local/lib/python3.9/site-packages/{path}", func, "raise ValueError(")
           + f"ValueError: {msg}\nModel type should be one of AlbertConfig, BartConfig, BertConfig.\n".encode())
    d = diagnose_bytes(log)
    assert d.category is Category.CRASH_OTHER, d.summary


def test_a_scripts_check_raised_as_a_bare_exception_is_config() -> None:
    # `raise Exception(...)` over a setting: Python's base class ends the traceback like any other class.
    log = (_TB + b'  File "/home/u/train.py", line 9, in main\n    raise Exception(f"unknown dataset {args.dataset}")\n'
           b"Exception: unknown dataset foo\n")
    d = diagnose_bytes(log)
    assert d.category is Category.CONFIG_ERROR and d.strength != "hint", d.summary


@pytest.mark.parametrize(("path", "exc"), [
    # transformers modeling_utils.py from_pretrained: two ways of asking for the same setting
    ("transformers/modeling_utils.py",
     ("ValueError: You can't pass `load_in_4bit`or `load_in_8bit` as a kwarg when passing `quantization_config` argument"
     " at the same time.")),
    # DeepSpeed's argument check: a required --flag missing
    ("deepspeed/runtime/engine.py",
     "AssertionError: DeepSpeed requires --deepspeed_config to specify configuration file"),
])
def test_a_library_check_that_names_the_setting_it_requires_is_config(path: str, exc: str) -> None:
    log = _TB + _lib_frame(f"/usr/lib/python3.10/site-packages/{path}", "from_pretrained", "raise ValueError(") + (
        exc.encode() + b"\n")
    d = diagnose_bytes(log)
    assert d.category is Category.CONFIG_ERROR, d.summary


def test_a_requirement_on_tensors_stays_a_bug() -> None:
    log = _TB + _lib_frame("/usr/lib/python3.10/site-packages/somelib/ops.py", "forward", "raise ValueError(") + (
        b"ValueError: `input` requires a tensor of at least 2 dims, got 1\n")
    assert diagnose_bytes(log).category is Category.CRASH_OTHER
