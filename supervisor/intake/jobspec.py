"""Job files: the user's LLaMA-Factory YAML as is, plus an optional `supervisor:` block.

Parsing is strict and pure: the same checks run in `submit` and in the
daemon's intake, and every problem names the key, the line and, for a typo,
the nearest valid key. A generic job gives `supervisor: {command: [...]}` and
no LLaMA-Factory keys.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from supervisor.core.models import Problem
from supervisor.core.units import parse_duration, parse_size
from supervisor.intake.slurm_request import SlurmJobRequest

MAX_JOB_FILE_BYTES = 1024 * 1024
# Parse limits: a 6 KB file nested 3000 deep overflows the recursive composer, and an
# 837-byte alias bomb expands to billions of nodes in anything that walks the result.
MAX_DEPTH = 64
MAX_ALIASES = 100
MAX_NODES = 100_000  # counted with every alias expanded
# Mapping keys, all levels, aliases expanded. Each unknown key costs a nearest-key search
# (~2 ms against LLaMA-Factory's 346 keys): 45,000 of them in a 740 KB file took 170 s.
MAX_KEYS = 1000
MAX_TOP_LEVEL_KEYS = 400
MAX_PRIORITY = 1000
MAX_HANG_TIMEOUT_S = 30 * 86400.0
MAX_HOST_MEMORY_BYTES = 1 << 50  # 1 PiB
MAX_GPUS = 1024
POLICY_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


class JobFileError(ValueError):
    """A job file that cannot be accepted; carries every problem found (in file order), and
    what could still be read of it (`partial`), so later checks can report in the same round."""

    def __init__(self, problems: list[Problem], source: str = "", *, partial: Partial | None = None,
                 warnings: list[Problem] | None = None) -> None:
        self.problems = sorted(problems, key=lambda p: (p.line is None, p.line or 0))
        self.source = source
        self.partial = partial
        self.warnings = list(warnings or [])
        head = f"{source}: " if source else ""
        super().__init__(head + "; ".join(str(p) for p in self.problems))

    def report(self) -> str:
        lines = [f"{self.source or 'job file'} was refused ({len(self.problems)} problem(s)):"]
        lines += [f"  - {p}" for p in self.problems]
        if self.warnings:
            lines.append("and, not refused:")
            lines += [f"  - warning: {w}" for w in self.warnings]
        return "\n".join(lines)


@dataclass(frozen=True)
class Partial:
    """What a refused file still tells: its training keys, workdir, line map and job env."""

    config: Mapping[str, Any] | None
    workdir: Path
    lines: Mapping[str, int]
    env: Mapping[str, str]
    after: tuple[int, ...]
    kind: str


class NotifySpec(BaseModel):
    """Run a command (argv, no shell) with the event as JSON on stdin."""

    model_config = ConfigDict(extra="forbid")
    command: list[str] = Field(min_length=1)
    on: list[str] = Field(default_factory=lambda: ["succeeded", "failed", "escalated", "paused"])


class SupervisorBlock(BaseModel):
    """The `supervisor:` block of a job file. Unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, min_length=1, max_length=200)
    policy: str | None = None
    workdir: str | None = Field(default=None, max_length=4096)
    # Omit the key for "the whole box"; a list names the GPUs the job owns (disjoint from other
    # jobs'); `gpus: N` asks the daemon for any N free GPUs (moved to `gpu_count` on parsing).
    gpus: list[Annotated[int, Field(ge=0, lt=MAX_GPUS)]] | None = Field(default=None, min_length=1,
                                                                        max_length=MAX_GPUS)
    gpu_count: int | None = Field(default=None, ge=1, le=MAX_GPUS)
    # Jobs (ids) that must have succeeded before this one starts (`submit --after JOB`).
    after: list[Annotated[int, Field(ge=1)]] = Field(default_factory=list, max_length=100)
    # With the Slurm backend: nodes, gpus_per_node, mem, time for this job's sbatch (slurm.SlurmJobRequest).
    slurm: dict[str, Any] | None = None
    nproc_per_node: int | None = Field(default=None, ge=1, le=MAX_GPUS)
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)  # SQLite INTEGER is 64-bit
    max_attempts: int | None = Field(default=None, ge=1, le=100)
    hang_timeout: float | None = Field(default=None, gt=0, le=MAX_HANG_TIMEOUT_S)
    env: dict[str, str] = Field(default_factory=dict)
    notify: list[NotifySpec] = Field(default_factory=list)
    command: list[str] | None = None
    launcher: list[str] | None = None
    host_memory_limit: int | None = Field(default=None, gt=0, le=MAX_HOST_MEMORY_BYTES)
    # Stop the attempt at the first fatal log line (an OOM on any rank, a device fault) instead
    # of waiting for peers stuck in collectives. Turn off for programs that catch an OOM and
    # retry inside (accelerate's find_executable_batch_size): the exit status then decides.
    stop_on_fatal_line: bool = True

    @field_validator("hang_timeout", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        return None if v is None else parse_duration(v)

    @field_validator("host_memory_limit", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return None if v is None else parse_size(v)

    @model_validator(mode="before")
    @classmethod
    def _gpu_count(cls, data: Any) -> Any:
        if isinstance(data, dict) and "gpus" in data:
            v = data["gpus"]
            if isinstance(v, int) and not isinstance(v, bool):
                if "gpu_count" in data:
                    raise ValueError("gives both `gpus: N` and `gpu_count`; use one")
                data = {**data, "gpu_count": v}
                del data["gpus"]
        return data

    @field_validator("slurm")
    @classmethod
    def _slurm(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            SlurmJobRequest.model_validate(v)
        return v

    @property
    def slurm_request(self) -> SlurmJobRequest | None:
        return SlurmJobRequest.model_validate(self.slurm) if self.slurm is not None else None

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus_given(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("is an empty list, which is not 'no GPUs': omit the key to let the job "
                             "see every GPU, or name the GPUs it owns, e.g. [0, 1]")
        return v

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and len(set(v)) != len(v):
            dup = sorted({g for g in v if v.count(g) > 1})
            raise ValueError(f"names GPU(s) {dup} more than once")
        return v

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str | None) -> str | None:
        if v is not None:
            problem = policy_name_problem(v)
            if problem:
                raise ValueError(problem)
        return v

    @field_validator("command", "launcher")
    @classmethod
    def _argv(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or not all(isinstance(a, str) and a for a in v)):
            raise ValueError("must be a non-empty list of non-empty strings (argv, no shell)")
        if v is not None and any("\0" in a for a in v):
            raise ValueError("an argument contains a NUL byte, which no program can receive")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k, val in v.items():
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise ValueError(f"{k[:80]!r} is not a valid environment variable name")
            if "\0" in val:
                raise ValueError(f"the value of {k} contains a NUL byte, which no environment can hold")
        return v


def policy_name_problem(name: str) -> str | None:
    """Why `name` is not a policy name, or None. A job names a policy; it never gives a path
    (the daemon would read any file it can, and a parse error could echo its content)."""
    if not isinstance(name, str) or not POLICY_NAME_RE.fullmatch(name) or ".." in name:
        shown = name[:40] if isinstance(name, str) else type(name).__name__
        return (f"{shown!r} is not a policy name: use letters, digits, '_', '.' or '-' (at most 64, "
                "no '/' and no '..'); a job names a policy, never a path")
    return None


SUPERVISOR_KEYS = tuple(SupervisorBlock.model_fields)


@dataclass(frozen=True)
class JobSpec:
    """A validated job. `config` is the LLaMA-Factory config without the
    supervisor block, with relative paths left as the user wrote them (they
    resolve against `workdir`, which is also the attempt's working directory)."""

    kind: str  # "llamafactory" | "command"
    name: str
    sup: SupervisorBlock
    config: Mapping[str, Any]
    workdir: Path
    raw_text: str = field(repr=False, default="")
    lines: Mapping[str, int] = field(repr=False, default_factory=dict, compare=False)

    @property
    def world_size(self) -> int:
        if self.sup.nproc_per_node:
            return self.sup.nproc_per_node
        if self.sup.gpu_count:
            return self.sup.gpu_count
        return max(1, len(self.sup.gpus)) if self.sup.gpus else 1

    def resolve(self, p: str | Path) -> Path:
        p = Path(p).expanduser()
        return p if p.is_absolute() else (self.workdir / p)


def suggest(key: str, valid: list[str] | tuple[str, ...]) -> str | None:
    hits = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return hits[0] if hits else None


class YamlLimitError(yaml.YAMLError):
    """The file is beyond what a job file needs (depth, aliases, expanded size)."""

    def __init__(self, problem: str, mark: yaml.Mark | None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.problem_mark = mark


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that remembers the line of every mapping key and refuses, while
    composing (before anything is built or walked), files deeper than MAX_DEPTH,
    with more than MAX_ALIASES aliases, or more than MAX_NODES nodes once every
    alias is expanded - so the constructor, the line map and validation after it
    all work on a bounded tree."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.key_lines: dict[int, dict[Any, int]] = {}
        self._depth = 0
        self._nodes = 0
        self._aliases = 0
        self._anchor_size: dict[int, int] = {}  # id(anchored node) -> expanded size
        self._open_anchors: set[str] = set()

    def _count(self, n: int, mark: yaml.Mark | None) -> None:
        self._nodes += n
        if self._nodes > MAX_NODES:
            raise YamlLimitError(f"more than {MAX_NODES} YAML nodes once aliases are expanded "
                                 "(an alias bomb?); job files are small", mark)

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise YamlLimitError(f"more than {MAX_ALIASES} YAML aliases (*name); job files need few",
                                     event.start_mark)
            if event.anchor in self._open_anchors:
                raise YamlLimitError(f"alias *{event.anchor} refers to a node that contains it "
                                     "(a recursive structure)", event.start_mark)
            target = self.anchors.get(event.anchor)
            self._count(self._anchor_size.get(id(target), 1), event.start_mark)
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise YamlLimitError(f"nested more than {MAX_DEPTH} levels deep", event.start_mark)
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            self._open_anchors.add(anchor)
        before = self._nodes
        self._count(1, event.start_mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            if anchor is not None:
                self._open_anchors.discard(anchor)
        if anchor is not None:
            self._anchor_size[id(node)] = self._nodes - before
        return node


_BOOL_TAG = "tag:yaml.org,2002:bool"


def _construct_mapping(loader: _LineLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    # YAML 1.1 reads a key `on:` (notify's `on: [failed]`), `off:`, `yes:`, `no:` as a boolean; as a
    # KEY nobody means that: keep the word. Values keep YAML 1.1 (`stop_on_fatal_line: off` is False,
    # as LLaMA-Factory, which reads the training keys with PyYAML too, would read it).
    for key_node, _ in node.value:
        if (isinstance(key_node, yaml.ScalarNode) and key_node.tag == _BOOL_TAG
                and key_node.value.lower() not in ("true", "false")):
            key_node.tag = "tag:yaml.org,2002:str"
    mapping = yaml.SafeLoader.construct_mapping(loader, node, deep=deep)
    lines = {}
    for key_node, _ in node.value:
        try:
            lines[loader.construct_object(key_node)] = key_node.start_mark.line + 1
        except Exception:  # noqa: BLE001, S110 - key lines only place messages; the caller reports a bad key itself
            pass
    loader.key_lines[id(mapping)] = lines
    return mapping


_LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml_with_lines(text: str) -> tuple[Any, dict[str, int]]:
    """Parse YAML within the limits above; return the data and a map from dotted key path
    to line. Raises yaml.YAMLError (YamlLimitError for the limits) or ValueError."""
    loader = _LineLoader(text)
    try:
        data = loader.get_single_data()
    finally:
        loader.dispose()
    paths: dict[str, int] = {}
    budget = [MAX_KEYS]
    if isinstance(data, dict) and len(data) > MAX_TOP_LEVEL_KEYS:
        raise YamlLimitError(f"{len(data)} top-level keys; a job file has at most {MAX_TOP_LEVEL_KEYS} "
                             "(LLaMA-Factory knows fewer)", None)

    def walk(obj: Any, prefix: str, depth: int) -> None:
        if isinstance(obj, dict) and depth <= MAX_DEPTH:
            lines = loader.key_lines.get(id(obj), {})
            for k, v in obj.items():
                budget[0] -= 1
                if budget[0] < 0:
                    raise YamlLimitError(f"more than {MAX_KEYS} mapping keys once aliases are expanded; "
                                         "job files are small", None)
                path = f"{prefix}.{k}" if prefix else str(k)
                if k in lines:
                    paths[path] = lines[k]
                walk(v, path, depth + 1)

    walk(data, "", 0)
    return data, paths


def _huge_integers(data: Any, lines: dict[str, int]) -> list[Problem]:
    """Integers beyond 64 bits anywhere in the training keys: no setting needs one, and
    SQLite, JSON consumers and torch overflow on them. Bounded: the tree is."""
    out: list[Problem] = []
    stack, seen = [(data, "")], 0
    while stack and seen <= MAX_NODES and len(out) < 5:
        obj, path = stack.pop()
        seen += 1
        if isinstance(obj, bool):
            continue
        if isinstance(obj, int) and not -(1 << 63) <= obj < (1 << 63):
            out.append(Problem(path[:200] or "(file)", f"{str(obj)[:20]}... does not fit in 64 bits",
                               None, _line_for(path, lines)))
        elif isinstance(obj, dict):
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in obj.items())
        elif isinstance(obj, list):
            stack.extend((v, f"{path}.{i}") for i, v in enumerate(obj))
    return out


def _mark_line(exc: Exception) -> int | None:
    mark = getattr(exc, "problem_mark", None)
    return mark.line + 1 if mark else None


def _pydantic_problems(err: ValidationError, lines: dict[str, int]) -> list[Problem]:
    out = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        key = (f"supervisor.{loc}" if loc else "supervisor")[:200]
        if e["type"] == "extra_forbidden":
            last = str(e["loc"][-1])
            valid = SUPERVISOR_KEYS if len(e["loc"]) == 1 else tuple(NotifySpec.model_fields)
            out.append(Problem(key, "unknown key", suggest(last, valid), _line_for(key, lines)))
        elif e["loc"] and e["loc"][-1] in ("command", "launcher") and e["type"] == "list_type":
            out.append(Problem(key, _argv_message(str(e["loc"][-1]), e.get("input")), None, _line_for(key, lines)))
        elif e["loc"] == ("after",) and e["type"] == "list_type":
            out.append(Problem(key, "must be a list of job ids, e.g. `after: [3]` (or `submit --after 3`)", None,
                               _line_for(key, lines)))
        else:
            msg = e["msg"].removeprefix("Value error, ")
            out.append(Problem(key, msg, None, _line_for(key, lines)))
    return out


def _argv_message(key: str, given: Any) -> str:
    """`command: torchrun train.py` written as a string: show the list it must be."""
    import shlex

    example = "[torchrun, --nproc-per-node, \"2\", train.py]"
    if isinstance(given, str):
        try:
            words = shlex.split(given)[:12]
        except ValueError:
            words = given.split()[:12]
        if words:
            example = "[" + ", ".join(w if re.fullmatch(r"[A-Za-z_./-][A-Za-z0-9_./=-]*", w) and not
                                      re.fullmatch(r"-?[0-9.]+|true|false|yes|no|on|off|null|~", w, re.IGNORECASE)
                                      else json_quote(w) for w in words) + "]"
    return (f"must be a list of arguments, one per item, run without a shell (a string is not split), "
            f"e.g. `{key}: {example}`")


def json_quote(w: str) -> str:
    import json

    return json.dumps(w)


def _line_for(key: str, lines: dict[str, int]) -> int | None:
    while key:
        if key in lines:
            return lines[key]
        key = key.rpartition(".")[0]
    return None


def _yaml_problem(exc: Exception) -> Problem:
    """A YAML syntax error with its line and column; a tab gets "use spaces"."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    col = f"column {mark.column + 1}: " if mark is not None else ""
    if "'\\t'" in problem or "\t" in problem:
        return Problem("(file)", f"{col}a tab character: YAML allows only spaces for indentation and "
                                 "after a colon; replace the tab with spaces", None, _mark_line(exc))
    return Problem("(file)", f"{col}YAML does not parse: {problem}", None, _mark_line(exc))


def parse_job_text(text: str, *, source: str = "", submit_dir: Path | None = None,
                   check_lf: bool = True, policy_problem: Callable[[str], Problem | None] | None = None,
                   warnings: list[Problem] | None = None) -> JobSpec:
    """Validate a job file's text and return the JobSpec, or raise JobFileError with every
    problem found in one round (the supervisor block's, the policy name's, the training keys').

    `submit_dir` is where the user ran `submit` (or the spool folder for raw
    drops); relative `workdir` and paths resolve against it. `policy_problem` looks the
    policy name up (the caller knows where policies live). What does not stop a run goes
    to `warnings` when given.
    """
    data, lines = _load_mapping(text, source)
    problems: list[Problem] = []
    said: list[Problem] = warnings if warnings is not None else []
    raw_sup = data.get("supervisor") or {}
    if not isinstance(raw_sup, dict):
        raise JobFileError([Problem("supervisor", "must be a mapping", None, lines.get("supervisor"))], source)
    sup = _supervisor_block(raw_sup, lines, problems, policy_problem)
    config = {k: v for k, v in data.items() if k != "supervisor"}
    huge = _huge_integers(config, lines)
    if huge:
        raise JobFileError(problems + huge, source)
    workdir = _workdir(sup, raw_sup, submit_dir)
    env, after = _env_and_after(sup, raw_sup)
    is_command = sup.command is not None if sup is not None else "command" in raw_sup
    kind = "command" if is_command else "llamafactory"
    if is_command:
        if config:
            problems.append(Problem(
                next(iter(config)), "a job with supervisor.command runs that command; "
                "LLaMA-Factory keys beside it would be ignored, so they are refused",
                None, lines.get(next(iter(config)))))
    elif not config:
        problems.append(Problem("(file)", "no LLaMA-Factory training keys and no supervisor.command: nothing to run"))
    elif check_lf:
        _check_training_keys(config, workdir, env, lines, problems, said)
    if problems:
        partial = Partial(config if kind == "llamafactory" and config else None, workdir, lines, env, after, kind)
        raise JobFileError(problems, source, partial=partial)

    assert sup is not None
    name = sup.name or _default_name(config, source)
    return JobSpec(kind=kind, name=name, sup=sup, config=config, workdir=workdir, raw_text=text, lines=lines)


def _load_mapping(text: str, source: str) -> tuple[dict[str, Any], dict[str, int]]:
    """The file as a mapping with string keys, and each key's line; JobFileError otherwise."""
    try:
        data, lines = load_yaml_with_lines(text)
    except YamlLimitError as exc:
        raise JobFileError([Problem("(file)", f"refused: {exc.problem}", None, _mark_line(exc))], source) from None
    except yaml.YAMLError as exc:
        raise JobFileError([_yaml_problem(exc)], source) from None
    except (ValueError, TypeError, OverflowError, RecursionError, MemoryError) as exc:
        # e.g. an integer of more than 4300 digits, a date like 2024-13-45
        why = str(exc)[:200]
        if "integer string conversion" in why:  # worded differently by Python 3.10 and 3.11
            why = "an integer of more than 4300 digits (Python's limit; no setting needs one)"
        raise JobFileError([Problem("(file)", f"YAML value cannot be read: {why}")], source) from None
    if not isinstance(data, dict):
        kind = "empty" if data is None else type(data).__name__
        raise JobFileError([Problem("(file)", f"a job file must be a YAML mapping, this one is {kind}")], source)
    bad_keys = [k for k in data if not isinstance(k, str)]
    if bad_keys:
        raise JobFileError([Problem(str(k)[:80], "keys must be strings") for k in bad_keys[:20]], source)
    return data, lines


def _supervisor_block(raw_sup: dict, lines: dict[str, int], problems: list[Problem],
                      policy_problem: Callable[[str], Problem | None] | None) -> SupervisorBlock | None:
    """The validated supervisor block (None when it has problems, which go to `problems`)."""
    sup: SupervisorBlock | None
    try:
        sup = SupervisorBlock.model_validate(raw_sup)
    except ValidationError as err:
        sup = None
        problems += _pydantic_problems(err, lines)
    policy = sup.policy if sup is not None else raw_sup.get("policy")
    if policy_problem is not None and isinstance(policy, str) and policy_name_problem(policy) is None:
        found = policy_problem(policy)
        if found is not None:
            problems.append(Problem("supervisor.policy", found.message, found.suggestion,
                                    lines.get("supervisor.policy")))
    return sup


def _workdir(sup: SupervisorBlock | None, raw_sup: dict, submit_dir: Path | None) -> Path:
    base = submit_dir or Path.cwd()
    raw_workdir = sup.workdir if sup is not None else raw_sup.get("workdir")
    workdir = Path(raw_workdir).expanduser() if isinstance(raw_workdir, str) and raw_workdir else base
    if not workdir.is_absolute():
        workdir = base / workdir
    return Path(_normpath(workdir))


def _env_and_after(sup: SupervisorBlock | None, raw_sup: dict) -> tuple[dict[str, str], tuple[int, ...]]:
    """The job's env and `after:` jobs, read leniently from a block that failed validation (so
    the training keys can still be checked against the right environment)."""
    if sup is not None:
        return sup.env, tuple(sup.after)
    raw_env, raw_after = raw_sup.get("env"), raw_sup.get("after")
    env = {k: v for k, v in raw_env.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(raw_env, dict) else {}
    after = tuple(a for a in raw_after if isinstance(a, int) and not isinstance(a, bool)) \
        if isinstance(raw_after, list) else ()
    return env, after


def _check_training_keys(config: dict[str, Any], workdir: Path, env: dict[str, str], lines: dict[str, int],
                         problems: list[Problem], said: list[Problem]) -> None:
    from supervisor.intake.llamafactory.validate import config_warnings, validate_config

    found: list[Problem] = []
    for p in validate_config(config, workdir=workdir, env=env, warnings=found):
        problems.append(Problem(p.key, p.message, p.suggestion, p.line or _line_for(p.key, lines)))
    for p in found + config_warnings(config):
        said.append(Problem(p.key, p.message, p.suggestion, p.line or _line_for(p.key, lines)))


def _normpath(p: Path) -> str:
    import os

    return os.path.normpath(str(p))


def _default_name(config: Mapping[str, Any], source: str) -> str:
    if source:
        stem = Path(source).name
        for suffix in (".yaml", ".yml"):
            stem = stem.removesuffix(suffix)
        if stem:
            return stem
    out = config.get("output_dir")
    return Path(str(out)).name if out else "job"
