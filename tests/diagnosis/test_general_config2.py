"""A script's check of its own settings (issue 29), read from the code line a traceback shows above the
exception, as a Python traceback prints it: `assert args.x in (...)`, `raise ValueError(f"..{args.x}")`
(argparse's namespace, a yacs/omegaconf/mmcv cfg, opt, hparams), and a registry looked up by a setting
(`MODELS[args.model]`) failing with KeyError. The same lines in a library, and other code lines over
the same classes, stay crashes (bugs)."""

import pytest

from supervisor.core.models import Category
from supervisor.judge.diagnosis import diagnose_bytes


def _tb(code: str, exc: str, path: str = "/home/u/project/train.py", caret: bool = False) -> bytes:
    return (b'Traceback (most recent call last):\n  File "/home/u/project/train.py", line 210, in <module>\n'
            b"    main()\n" + f'  File "{path}", line 88, in main\n    {code}\n'.encode()
            + (b"           ^^^^^^^^^^^^^^^^^^^^^^\n" if caret else b"") + exc.encode() + b"\n")


CONFIG = {
    "assert_choice": ("assert args.model_type in ['bert', 'roberta']", "AssertionError"),
    "assert_cfg": ("assert cfg.MODEL.NUM_CLASSES > 0, cfg.MODEL.NUM_CLASSES", "AssertionError: 0"),
    "assert_self_opt": ("assert self.opt.batch_size % self.opt.world_size == 0", "AssertionError"),
    "raise_named": ('raise ValueError(f"unknown backbone {args.backbone}")', "ValueError: unknown backbone resnet5"),
    "raise_not_impl": ("raise NotImplementedError(cfg.loss)", "NotImplementedError: focal2"),
    "registry_lookup": ("model = MODELS[args.arch](pretrained=True)", "KeyError: 'resnet5'"),
    "cfg_key": ("lr = config['learning_rate']", "KeyError: 'learning_rate'"),
}


@pytest.mark.parametrize("caret", [False, True])
@pytest.mark.parametrize("name", sorted(CONFIG))
def test_a_scripts_check_of_its_settings_is_config(name: str, caret: bool) -> None:
    code, exc = CONFIG[name]
    d = diagnose_bytes(_tb(code, exc, caret=caret))
    assert d.category is Category.CONFIG_ERROR, (name, d.summary)


BUGS = {
    "assert_other": ("assert len(batch) > 0", "AssertionError"),
    "lookup_other": ("x = batch['input_ids']", "KeyError: 'input_ids'"),
    "settings_line_other_class": ("assert args.model_type in ['bert']", "TypeError: 'NoneType' object is not iterable"),
    "lookup_by_setting_other_class": ("model = MODELS[args.arch](pretrained=True)",
                                      "TypeError: __init__() got an unexpected keyword argument 'pretrained'"),
}


@pytest.mark.parametrize("name", sorted(BUGS))
def test_other_code_lines_and_classes_stay_crashes(name: str) -> None:
    code, exc = BUGS[name]
    assert diagnose_bytes(_tb(code, exc)).category is Category.CRASH_OTHER, name


def test_the_same_line_in_a_library_is_not_the_users_setting() -> None:
    d = diagnose_bytes(_tb("assert config.hidden_size % config.num_heads == 0", "AssertionError",
                           path="/usr/lib/python3.10/site-packages/somelib/layers.py"))
    assert d.category is Category.CRASH_OTHER, d.summary


def _lib_tb(path: str, func: str, exc_line: str) -> bytes:
    return (f'Traceback (most recent call last):\n  File "/home/u/train.py", line 3, in <module>\n    main()\n'
            f'  File "{path}", line 40, in {func}\n    raise X\n{exc_line}\n').encode()


@pytest.mark.parametrize("log", [
    # timm/models/_factory.py create_model: raise RuntimeError('Unknown model (%s)' % model_name)
    _lib_tb("/x/timm/models/_factory.py", "create_model", "RuntimeError: Unknown model (vit_base_patch16_225)"),
    # a registry's KeyError that says what it checked, not only the key
    _lib_tb("/home/u/project/datasets/__init__.py", "build_dataset",
            "KeyError: \"dataset 'coco17' is not supported, choose from ['coco', 'voc']\""),
], ids=["timm_unknown_model", "registry_keyerror_words"])
def test_a_factory_refusing_the_name_given(log: bytes) -> None:
    assert diagnose_bytes(log).category is Category.CONFIG_ERROR


def test_a_bare_keyerror_stays_a_crash() -> None:
    assert diagnose_bytes(_lib_tb("/home/u/project/data.py", "__getitem__", "KeyError: 'labels'")).category \
        is Category.CRASH_OTHER


def test_a_key_the_loaded_config_lacks() -> None:
    """mmcv/utils/config.py ConfigDict.__getattr__: the KeyError re-raised as AttributeError; EasyDict the same."""
    for cls in ("ConfigDict", "EasyDict"):
        log = _lib_tb("/x/mmdet/apis/train.py", "train_detector",
                      f"AttributeError: '{cls}' object has no attribute 'workflow'")
        assert diagnose_bytes(log).category is Category.CONFIG_ERROR, cls
    # any other object missing an attribute is a bug or a moved API
    log = _lib_tb("/home/u/project/train.py", "main", "AttributeError: 'Namespace' object has no attribute 'workflow'")
    assert diagnose_bytes(log).category is Category.CRASH_OTHER
