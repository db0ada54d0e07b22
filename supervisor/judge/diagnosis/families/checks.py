"""How a library's check of its configuration reads, whatever the library: the grammar of the message
and where it was raised. Written from the libraries' own raise statements (transformers'
training_args.py and configuration_utils.py, accelerate's utils/dataclasses.py, PEFT's
tuners/*/config.py, TRL's trainer/*_config.py, DeepSpeed's runtime/config.py, Megatron's arguments.py,
Lightning's connectors, datasets' arrow_dataset.py, LLaMA-Factory's hparams/parser.py), not from logs.

A check names what it checked (a `key`, a --flag, a snake_case option, the word argument/option/...)
and says what it requires of it (must be, is not supported, cannot be used with, only ... supported,
mutually exclusive, invalid choice). A bug's message names tensors, shapes and Python's own
operations instead (`Expected input batch_size (32) to match`, `too many values to unpack`);
those are kept out explicitly, and so is the runtime's own vocabulary (CUDA errors, kernels, autograd),
which a RuntimeError's "must"/"expected" usually speaks about a program's arithmetic.
"""

from __future__ import annotations

import re

# Classes defined by a configuration library (its parser, its schema, its interpolation): the config.
CONFIG_MODULE_RE = re.compile(r"^(?:omegaconf|hydra|yaml|ruamel\.yaml|jsonschema|pydantic|pydantic_core|toml|tomli"
                              r"|tomllib|jsonargparse|simple_parsing|ml_collections|gin|dacite|marshmallow)\.")
# A KeyError carries a registry's refusal in words ("dataset 'x' not found in the registry, choose from ...");
# a bug's KeyError carries the bare key, which the grammar below does not read as a check.
GRAMMAR_CARRIERS = frozenset({"ValueError", "AssertionError", "NotImplementedError", "RuntimeError", "Exception",
                              "KeyError"})

# What was checked: a backticked or quoted name, a --flag, a snake_case option, or the words for one.
_KEY = (r"(?:`[^`\s]{2,80}`|(?<![\w-])--?[A-Za-z][\w.-]+|'[A-Za-z_][\w.-]*'|\"[A-Za-z_][\w.-]*\"|\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b"
        r"|\b(?:argument|arguments|option|options|parameter|config(?:uration)?|setting|flag|mode|strategy|backend"
        r"|precision|dtype|fp16|bf16|fp8|int8|4-?bit|8-?bit|scheduler|optimizer|template|dataset|split|column|model_type"
        r"|batch size|micro batch|learning rate|world size|(?:number|num) of \w+|sequence length|max length|stage"
        r"|zero|offload|deepspeed|fsdp|lora|qlora|quantization|gpus?|nodes?|processes|workers|epochs?|steps?"
        r"|target[_ ]modules?|adapter|tokenizer|checkpoint)\b)")
# What the check requires of it.
_REQUIRE = (r"(?:\b(?:must|should|has to|have to|needs? to)(?: not)? (?:be|have|match|equal|contain|use|set|specify|provide"
            r"|pass|either|only|all|both|a|an|greater|less|at)\b|\bcannot be (?:used|combined|set|specified|enabled)\b"
            r"|\bcan(?:'t| not|not) (?:be used|use|both|specify|set|enable|train|run|load|find|mix|combine|pass)\b"
            r"|\bat the same time\b|\brequires? (?=--?[A-Za-z]|`)"
            r"|\bcan only (?:work|be used|be|use)\b|\bdoes(?:n't| not) support\b|\brequires? (?:you|a|an|the|at least|to)\b"
            r"|\bis not (?:supported|allowed|compatible|available|valid|recognized)\b"
            r"|\bare not (?:supported|allowed|compatible)\b|\bnot supported (?:for|with|when|by|in|yet)\b"
            r"|\b(?:is|are) only (?:supported|available|compatible|implemented|valid)\b|\bonly supports?\b"
            r"|\bonly\b.{0,60}\b(?:is|are) (?:supported|allowed|available|valid)\b"
            r"|\b(?:is|are) (?:incompatible|mutually exclusive|required|missing)\b|\bmutually exclusive\b"
            r"|\binvalid (?:choice|value)\b|\bis invalid\b|\bis not a valid\b|\b(?:expected one of|choose from)\b"
            r"|\bnot (?:found )?in the (?:dataset|config|registry|vocab)|\bout of range\b|\bdivisible by\b"
            r"|\bdoes not (?:exist|match)\b|\bnot found\b|\bavailable (?:configs|splits|options|choices)\b"
            r"|\bplease (?:pick|choose|select|set|specify|provide|pass|launch|use|run|add|remove|make sure|ensure)\b"
            r"|\bexpected\b.{0,80}\b(?:but )?(?:got|received|found)\b"
            r"|\bis (?:larger|greater|smaller|less|bigger|higher|lower|longer|shorter) than\b)")
# The forms with no key to name: an unknown/unsupported/invalid NAME of a kind of setting.
_KIND_RE = re.compile(r"\b(?:[Uu]nknown|[Uu]nsupported|[Ii]nvalid|[Uu]nrecognized) (?:\w+ ){0,2}?"
                      r"(?:type|mode|value|option|argument|strategy|backend|scheduler|optimizer|model[_ ]type"
                      r"|precision|dtype|config(?:uration)?|choice|architecture|activation|loss(?:_type)?|template"
                      r"|task|pooling|method|policy"
                      # a name the user picked from a factory (timm's create_model 'Unknown model (x)', a
                      # script's dataset/backbone/metric choice)
                      r"|model|dataset|backbone|arch|metric|network|criterion|sampler)s?\b(?!\s+code)")
_GRAMMAR_RE = re.compile(rf"{_KEY}.{{0,120}}?{_REQUIRE}|{_REQUIRE}.{{0,60}}?{_KEY}", re.IGNORECASE)
# A program's arithmetic, Python's own operations, torch's view of tensors: a bug, whatever else it says.
_BUG_RE = re.compile(r"values to unpack|torch\.Size|(?<!\w)[Tt]ensors?\b|\w+Tensor\b|\bshapes?\b|\bdimension|\bdims?\b"
                     r"|batch_size \(\d+\) to match|invalid literal for|format code|could not convert|\bindex\b"
                     r"|out of bounds|\bNone\b.{0,20}(?:has no|is not)|\bcallable\b|\biterable\b|\bsubscriptable\b"
                     # the runtime's own view: kernels, devices' errors, autograd (a RuntimeError's usual words)
                     r"|CUDA error|cuDNN|cuBLAS|CUBLAS|NCCL|\bHIP\b|\bkernel\b|device-side|illegal memory|scalar type"
                     r"|c10::|\bmat\d\b|same dtype|\bchannels\b"
                     r"|\bgrad(?:ient)?s?\b|backward|autograd|\bgraph\b|in-place|inplace|\barray\b"
                     # transformers' Auto classes on a release (or remote code) that lacks the model: a version
                     # mismatch; "Unrecognized configuration class" is every Auto factory's refusal (auto_factory,
                     # tokenization_auto, processing_auto, image_processing_auto)
                     r"|is not currently imported|for this kind of AutoModel|does not recognize this architecture"
                     r"|Unrecognized configuration class")


def says_config_check(msg: str) -> bool:
    """Whether an exception's message reads as a check of the configuration (not of a program's data)."""
    msg = msg[:600]
    if _BUG_RE.search(msg):
        return False
    return bool(_KIND_RE.search(msg) or _GRAMMAR_RE.search(msg))


# Where configurations are checked: the frameworks' argument parsers and config modules, any module
# named for its config or arguments, and the functions that validate them.
_CONFIG_PATH_RE = re.compile(
    r"(?:^|[/\\])(?:\w+_)?(?:config|configs|configuration(?:_\w+)?|cfg|hparams|arguments|args|arg_parser|argparse"
    r"|argparser|options|opts|settings|hyperparams)\.py$|[/\\](?:hparams|configs?|omegaconf|hydra|pydantic)[/\\]"
    r"|mmengine[/\\]config[/\\]|mmcv[/\\]utils[/\\]config\.py|[/\\]utils[/\\]dataclasses\.py$")
_CONFIG_FUNC_RE = re.compile(r"^(?:__post_init__|_?validate\w*|_?check_\w*(?:args|arguments|config|params|options)\w*"
                             r"|_?verify_\w*|sanity_check\w*|_?parse_\w*args\w*|_?get_\w*args|_?setup_\w*config\w*)$")
# A class raised at such a frame that is a check, not a bug (a TypeError/AttributeError/ImportError is a moved API).
# A KeyError there is a lookup of a name the installed release lacks (configuration_auto's model types).
FRAME_CARRIERS = frozenset({"ValueError", "AssertionError", "NotImplementedError", "Exception"})
# transformers' Auto classes: a model type the installed release does not know is a version mismatch.
_AUTO_RE = re.compile(r"[/\\]auto[/\\]\w+\.py$")


def raised_at_config_frame(exc: str | None, func: str, path: str) -> bool:
    """Whether an exception of class `exc`, raised in `func` of `path` (the traceback's last frame),
    is a configuration check by where it was raised."""
    if exc is None or exc.rsplit(".", 1)[-1] not in FRAME_CARRIERS:
        return False
    return not _AUTO_RE.search(path) and bool(_CONFIG_PATH_RE.search(path) or _CONFIG_FUNC_RE.match(func))


# A script checks its own arguments in two ways a traceback shows on the code line above the exception
# (argparse's namespace `args`, a yacs/omegaconf/mmcv `cfg`/`config`, `opt`, `hparams`, on self too):
# `assert args.x in (...)` / `raise ValueError(f"... {args.x}")`, and a lookup of a registry by a setting
# (`MODELS[args.model]`, `cfg["key"]`) whose KeyError is the name the setting gave. Only in the user's own
# code (not a library's): there a setting is the user's; in a library the same line is the library's state.
_SETTINGS = r"(?:self\.)?(?:args|cfg|config|conf|opt|opts|hparams|hp|params|flags|FLAGS|options)"
_CHECK_CODE_RE = re.compile(rf"^(?:assert\s+(?:not\s+)?\(?\s*{_SETTINGS}\.\w"
                            # ...or that a path a setting names exists: `assert os.path.exists(args.train_dir)`
                            rf"|assert\s+(?:not\s+)?(?:os\.path\.(?:exists|isfile|isdir)|os\.access|Path)\(\s*{_SETTINGS}\.\w"
                            rf"|raise \w+\(.*\b{_SETTINGS}\.\w)")
_LOOKUP_CODE_RE = re.compile(rf"\w\[\s*{_SETTINGS}\.\w[\w.]*\s*\]|\b{_SETTINGS}\[\s*['\"]")
_LIBRARY_PATH_RE = re.compile(r"[/\\](?:site|dist)-packages[/\\]|[/\\]lib[/\\]python\d[\d.]*[/\\]")
CODE_CARRIERS = frozenset({"ValueError", "AssertionError", "NotImplementedError", "Exception", "RuntimeError"})


def check_code(t: str) -> str | None:
    """Which kind of settings check a traceback code line is ("check", "lookup"), if any."""
    if t.startswith(("assert", "raise ")) and _CHECK_CODE_RE.search(t):
        return "check"
    if "[" in t and _LOOKUP_CODE_RE.search(t):
        return "lookup"
    return None


def raised_by_check_code(exc: str | None, code: tuple[int | None, int, str], rank: int | None, line_no: int,
                         path: str) -> bool:
    """Whether an exception at `line_no` is raised by the settings check shown at `code` (rank, line, kind),
    in the user's own code at `path` (a 3.11 caret line may sit between them)."""
    if exc is None or code[0] != rank or not 0 < line_no - code[1] <= 2 or _LIBRARY_PATH_RE.search(path):
        return False
    short = exc.rsplit(".", 1)[-1]
    return short == "KeyError" if code[2] == "lookup" else short in CODE_CARRIERS
