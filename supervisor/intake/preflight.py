"""What is certain before launch: the checks `submit` and the daemon's intake both run.

Pure: `check()` judges a parsed job against `Facts`, a snapshot of what the edge
(`intake/facts.py`) read for it: which paths exist, the dataset registry, whether a Hub
model is in the cache, the job's environment, the jobs already recorded. A fact that was
not read, or could not be (a folder the reader may not enter), is unknown, and unknown
never refuses. `wanted()` runs the same checks to say which facts they still need, so
the edge reads exactly those (the dataset files a registry names need the registry first).

Refused (LLaMA-Factory would stop at launch, whatever the box): a required key missing,
a dataset name its registry lacks, a path that does not exist where the job will run, a
`model_name_or_path` that is neither a folder nor a valid Hub id, a Hub id the job's
environment forbids downloading (HF_HUB_OFFLINE) that is not cached, an `after:` job that
does not exist. Where the launch may see other files (the Slurm backend: another box; an
`after:` job that may create them), a missing path is a warning instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from supervisor.core.models import Problem

# What a path is, as the edge saw it.
DIR, FILE, MISSING, OTHER, UNKNOWN = "dir", "file", "missing", "other", "unknown"
TERMINAL = ("succeeded", "failed", "cancelled")
STAGES_RANKING = ("rm", "dpo")  # LLaMA-Factory's dpo workflow loads its data as stage "rm"
_TRUTHY_HF = ("1", "ON", "YES", "TRUE")  # huggingface_hub's constants._is_true


@dataclass(frozen=True)
class JobFact:
    """A job already in the record, as far as `submit` or intake can see it."""

    id: int
    state: str
    output_dir: str | None = None  # absolute, normalised; None when unknown or not a LLaMA-Factory job
    name: str = ""


@dataclass
class Facts:
    """What the edge read for one job. Keys are absolute, normalised paths / repo ids."""

    env: Mapping[str, str] = field(default_factory=dict)  # the job's environment, as far as known
    paths: dict[str, str] = field(default_factory=dict)  # path -> DIR | FILE | MISSING | OTHER | UNKNOWN
    json: dict[str, Any] = field(default_factory=dict)  # path -> JsonRead
    hub: dict[tuple[str, str | None, str], str | None] = field(default_factory=dict)  # (repo, cache_dir, rev) -> snapshot | None
    hub_cache: str | None = None  # the cache folder the edge looked in (said in messages)
    launch_here: bool = True  # False: attempts run on another box (Slurm): a missing path is not certain
    jobs: Mapping[int, JobFact] | None = None  # None: the record could not be read here
    where: str = "submit"  # "submit" | "intake": only wording
    output_dir: str | None = None  # this job's, absolute with symlinks resolved (as JobFact.output_dir)


@dataclass(frozen=True)
class JsonRead:
    value: Any = None
    error: str | None = None


@dataclass
class Wants:
    paths: set[str] = field(default_factory=set)
    json: set[str] = field(default_factory=set)
    hub: set[tuple[str, str | None, str]] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.paths or self.json or self.hub)


@dataclass
class Result:
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # said, not a problem: "waits for job 3"


# --- Hub ids ---------------------------------------------------------------------------------

# huggingface_hub.utils._validators.validate_repo_id (copied: the daemon never imports the ML stack).
_REPO_ID = re.compile(r"^(\b[\w\-.]+\b/)?\b[\w\-.]+\b$", re.ASCII)


def is_hub_id(name: str) -> bool:
    return (isinstance(name, str) and 0 < len(name) <= 96 * 2 + 1 and bool(_REPO_ID.match(name))
            and "--" not in name and ".." not in name and not name.endswith(".git")
            and all(0 < len(part) <= 96 for part in name.split("/")))


def hf_offline(env: Mapping[str, str]) -> str | None:
    """The variable that puts the job's Hugging Face libraries offline, or None."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if str(env.get(var, "")).strip().upper() in _TRUTHY_HF:
            return var
    return None


def _other_hub(env: Mapping[str, str]) -> str | None:
    for var in ("USE_MODELSCOPE_HUB", "USE_OPENMIND_HUB"):
        if str(env.get(var, "")).strip().lower() in ("true", "y", "1"):
            return var
    return None


# --- paths -----------------------------------------------------------------------------------

def resolve(workdir: str, value: str, env: Mapping[str, str] | None = None) -> str:
    """A job path as the attempt will see it: `~` is the job's home, relative is against workdir."""
    p = value
    if p.startswith("~"):
        home = (env or {}).get("HOME")
        p = (home + p[1:]) if home and (p == "~" or p.startswith("~/")) else os.path.expanduser(p)
    if not os.path.isabs(p):
        p = os.path.join(workdir, p)
    return os.path.normpath(p)


def is_inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def split_names(value: Any) -> list[str]:
    """LLaMA-Factory's split_arg: "a, b" and [a, b] are the same list."""
    if isinstance(value, str):
        return [s.strip() for s in value.split(",") if s.strip()]
    if isinstance(value, (list, tuple)):
        return [str(s).strip() for s in value if str(s).strip()]
    return []


# --- the checks --------------------------------------------------------------------------------

class _Check:
    def __init__(self, config: Mapping[str, Any], *, workdir: str, facts: Facts, after: Sequence[int],
                 lines: Mapping[str, int]) -> None:
        self.c, self.workdir, self.f, self.after, self.lines = config, workdir, facts, list(after), lines
        self.wants = Wants()
        self.out = Result()
        # Files an earlier job may still write before this one starts: not certain to be missing.
        self.maybe_made = bool(self.after) or not facts.launch_here

    # facts, recording what is still unread
    def path(self, p: str) -> str:
        if p not in self.f.paths:
            self.wants.paths.add(p)
            return UNKNOWN
        return self.f.paths[p]

    def json(self, p: str) -> JsonRead | None:
        if p not in self.f.json:
            self.wants.json.add(p)
            return None
        return self.f.json[p]

    def cached(self, repo: str, cache_dir: str | None, revision: str) -> str | bool | None:
        key = (repo, cache_dir, revision)
        if key not in self.f.hub:
            self.wants.hub.add(key)
            return False  # unknown
        return self.f.hub[key]

    def line(self, key: str) -> int | None:
        return self.lines.get(key)

    def refuse(self, key: str, message: str, suggestion: str | None = None) -> None:
        self.out.problems.append(Problem(key, message, suggestion, self.line(key)))

    def warn(self, key: str, message: str, suggestion: str | None = None) -> None:
        self.out.warnings.append(Problem(key, message, suggestion, self.line(key)))

    def missing(self, key: str, message: str, suggestion: str | None = None) -> None:
        """A path that is not there: certain only where the launch sees these files and no
        earlier job may still make it."""
        if not self.maybe_made:
            self.refuse(key, message, suggestion)
        elif self.after:
            self.warn(key, f"{message} (not refused: job(s) {', '.join(map(str, self.after))} run first and "
                           "may create it)", suggestion)
        else:
            self.warn(key, f"{message} here (not refused: attempts run on another box, which may have it)",
                      suggestion)

    def rel(self, value: str) -> str:
        return "" if os.path.isabs(value) or value.startswith("~") else \
            f" (relative to the job's workdir {self.workdir}, where you ran submit)"

    # ---------------------------------------------------------------------------------------
    def run(self) -> Result:
        if self.f.jobs is not None:
            self.after_jobs()
        if self.c is not None:
            self.required()
            self.models()
            self.datasets()
            self.output_dir()
        return self.out

    def after_jobs(self) -> None:
        jobs = self.f.jobs or {}
        newest = max(jobs) if jobs else None
        for dep in self.after:
            if dep not in jobs:
                tail = (f"the newest is job {newest}" if newest else "there are no jobs yet")
                self.refuse("supervisor.after", f"job {dep} does not exist ({tail}; see `oom-supervisor status`): "
                                                "a job can only wait for one already submitted")

    def required(self) -> None:
        c = self.c
        stage = c.get("stage", "sft")
        if not c.get("model_name_or_path"):
            self.refuse("model_name_or_path", "missing: LLaMA-Factory needs the model to train (\"Please provide "
                                              "`model_name_or_path`\"): a model folder or a Hub id, e.g. "
                                              "model_name_or_path: Qwen/Qwen3-4B-Instruct-2507")
        do_train = c.get("do_train") is True
        evaluating = any(c.get(k) is True for k in ("do_eval", "do_predict", "predict_with_generate"))
        if do_train and not c.get("dataset"):
            names = self._registry_names()
            example = ",".join(names[:2]) if names else "identity,alpaca_en_demo"
            self.refuse("dataset", "missing: do_train is true and LLaMA-Factory needs the datasets to train on "
                                   "(\"Please specify dataset for training.\"): add e.g. "
                                   f"`dataset: {example}` (names from dataset_info.json in dataset_dir)")
        if evaluating and not c.get("eval_dataset") and not (_num(c.get("val_size")) or 0) > 1e-6:
            self.refuse("eval_dataset", "missing: do_eval/do_predict needs `eval_dataset` or `val_size` > 0 "
                                        "(\"Please make sure eval_dataset be provided or val_size >1e-6\")")
        if stage == "sft" and c.get("do_predict") is True and c.get("predict_with_generate") is not True:
            self.refuse("do_predict", "needs `predict_with_generate: true` in stage sft (LLaMA-Factory: "
                                      "\"Please enable `predict_with_generate` to save model predictions\")")
        if stage == "ppo" and not c.get("reward_model"):
            self.refuse("reward_model", "missing: stage ppo needs a reward_model (a folder or Hub id)")
        if not do_train:
            what = "it only evaluates/predicts" if evaluating else "it does nothing at all"
            self.warn("do_train", f"is not true: LLaMA-Factory trains nothing and {what} (do_train defaults to "
                                  "false); add `do_train: true` to train")

    def output_dir(self) -> None:
        out = self.c.get("output_dir")
        if not out:
            self.warn("output_dir", "missing: LLaMA-Factory then writes to ./trainer_output, and the supervisor "
                                    "resumes from the checkpoints there; name a folder of this run's own")
            return
        if not isinstance(out, str) or self.f.jobs is None:
            return
        mine = self.f.output_dir or resolve(self.workdir, out, self.f.env)
        for job in sorted(self.f.jobs.values(), key=lambda j: j.id):
            if job.state in TERMINAL or not job.output_dir:
                continue
            if job.output_dir == mine:
                self.out.notes.append(
                    f"output_dir {mine} is also job {job.id}'s ({job.state}): this job starts when job "
                    f"{job.id} has ended (two trainings never write one output_dir at once)")
            elif is_inside(mine, job.output_dir) or is_inside(job.output_dir, mine):
                self.warn("output_dir", f"{mine} and job {job.id}'s output_dir {job.output_dir} are inside "
                                        "one another: their checkpoints would mix")

    # models -------------------------------------------------------------------------------
    def models(self) -> None:
        c = self.c
        env = self.f.env
        entries: list[tuple[str, str, str]] = []  # (key, value, kind)
        if isinstance(c.get("model_name_or_path"), str) and c["model_name_or_path"]:
            entries.append(("model_name_or_path", c["model_name_or_path"], "model"))
        for name in split_names(c.get("adapter_name_or_path")):
            entries.append(("adapter_name_or_path", name, "adapter"))
        if isinstance(c.get("ref_model"), str) and c["ref_model"]:
            entries.append(("ref_model", c["ref_model"], "either"))
        if (isinstance(c.get("reward_model"), str) and c["reward_model"]
                and c.get("reward_model_type", "lora") != "api"):
            entries.append(("reward_model", c["reward_model"], "either"))
        other = _other_hub(env)
        for key, value, kind in entries:
            self.model(key, value, kind, other)

    def model(self, key: str, value: str, kind: str, other_hub: str | None) -> None:
        path = resolve(self.workdir, value, self.f.env)
        seen = self.path(path)
        if seen == DIR:
            names = {"model": ("config.json",), "adapter": ("adapter_config.json",),
                     "either": ("config.json", "adapter_config.json")}[kind]
            kinds = [self.path(os.path.join(path, n)) for n in names]
            if UNKNOWN not in kinds and FILE not in kinds:
                what = "model" if kind != "adapter" else "LoRA adapter"
                self.refuse(key, f"{path} is a folder without {' or '.join(names)}: not a {what} folder; "
                                 f"give the folder that holds {names[0]}")
            return
        if seen == FILE:
            self.refuse(key, f"{path} is a file; LLaMA-Factory loads a model from a folder (with "
                             "config.json) or a Hub id")
            return
        if seen != MISSING:
            return  # unknown (unreadable here): the launch will tell
        produced = self._made_by_after(path)
        if produced:
            self.out.notes.append(f"{key}: {path} does not exist yet; job {produced} writes it and runs first")
            return
        if other_hub:
            self.warn(key, f"{value!r} is not a folder here; with {other_hub} set it is fetched from that hub "
                           "at launch")
            return
        if not is_hub_id(value):
            self.missing(key, f"{path} does not exist{self.rel(value)}, and as a path it cannot be a Hugging "
                              "Face Hub id: give the folder that holds config.json, or a Hub id such as "
                              "Qwen/Qwen3-4B-Instruct-2507")
            return
        cache_dir = self.c.get("cache_dir") if isinstance(self.c.get("cache_dir"), str) else None
        if cache_dir:
            cache_dir = resolve(self.workdir, cache_dir, self.f.env)
        revision = str(self.c.get("model_revision") or "main") if kind == "model" else "main"
        snap = self.cached(value, cache_dir, revision)
        if snap:
            return
        where = cache_dir or self.f.hub_cache or "the Hugging Face cache"
        local = path
        first = value.split("/")[0]
        looks_local = "/" in value and self.path(os.path.join(self.workdir, first)) == DIR
        hint = (f"; {os.path.join(self.workdir, first)} exists, so you probably meant a local folder that is "
                "not there" if looks_local else "")
        offline = hf_offline(self.f.env)
        if snap is None and offline:
            self.refuse(key, f"{value!r} is not a local folder ({local}) and not in the Hugging Face cache "
                             f"({where}), and {offline}=1 in the job's environment forbids downloading it{hint}. "
                             f"Give the model's folder, or download it first: `{offline}=0 hf download {value}`")
        elif snap is None:
            self.warn(key, f"{value!r}: no folder {local}, not in the Hugging Face cache ({where}): "
                           f"downloaded from the Hub at launch{hint}")

    def _made_by_after(self, path: str) -> int | None:
        for dep in self.after:
            job = (self.f.jobs or {}).get(dep)
            if job is not None and job.output_dir and is_inside(path, job.output_dir):
                return dep
        return None

    # datasets ------------------------------------------------------------------------------
    def _dataset_dir(self) -> str | None:
        ddir = self.c.get("dataset_dir", "data")
        return ddir if isinstance(ddir, str) else None

    def _registry_names(self) -> list[str]:
        ddir = self._dataset_dir()
        if not ddir or ddir == "ONLINE" or ddir.startswith("REMOTE:"):
            return []
        read = self.f.json.get(os.path.join(resolve(self.workdir, ddir, self.f.env), "dataset_info.json"))
        return list(read.value) if read and isinstance(read.value, dict) else []

    def datasets(self) -> None:
        c = self.c
        names = [("dataset", n) for n in split_names(c.get("dataset"))]
        names += [("eval_dataset", n) for n in split_names(c.get("eval_dataset"))]
        if not names:
            return
        tok = c.get("tokenized_path")
        if isinstance(tok, str) and tok and self.path(resolve(self.workdir, tok, self.f.env)) != MISSING:
            return  # a saved tokenized set is loaded instead (an empty folder is not: rare, not checked)
        ddir = self._dataset_dir()
        if ddir is None:
            return
        if ddir == "ONLINE":
            return  # every name is a Hub dataset id: only the Hub can tell
        if ddir.startswith("REMOTE:"):
            self.warn("dataset_dir", f"{ddir}: the registry is downloaded from the Hub at launch (needs the "
                                     "network then)")
            return
        folder = resolve(self.workdir, ddir, self.f.env)
        shown = ", ".join(repr(n) for _, n in names[:4])
        seen = self.path(folder)
        if seen == MISSING:
            self.missing("dataset_dir" if "dataset_dir" in c else "dataset",
                         f"{folder} does not exist{self.rel(ddir)}; LLaMA-Factory reads {folder}/dataset_info.json "
                         f"to find {shown}. Point dataset_dir at the folder holding dataset_info.json (in a "
                         "LLaMA-Factory checkout: <checkout>/data)")
            return
        if seen != DIR:
            if seen in (FILE, OTHER):
                self.refuse("dataset_dir", f"{folder} is not a folder; dataset_dir names the folder holding "
                                           "dataset_info.json")
            return
        info_path = os.path.join(folder, "dataset_info.json")
        read = self.json(info_path)
        if read is None:
            return
        if read.error == MISSING:
            self.missing("dataset_dir" if "dataset_dir" in c else "dataset",
                         f"{folder} has no dataset_info.json, which LLaMA-Factory reads to find {shown}")
            return
        if read.error is not None:
            if read.error != UNKNOWN:
                self.refuse("dataset_dir", f"{info_path} cannot be read as JSON ({read.error}); LLaMA-Factory "
                                           "stops on it (\"Cannot open ... dataset_info.json\")")
            return
        info = read.value
        if not isinstance(info, dict):
            self.refuse("dataset_dir", f"{info_path} is not a JSON object of dataset entries")
            return
        stage = c.get("stage", "sft")
        for key, name in names:
            entry = info.get(name)
            if entry is None:
                near = _nearest(name, list(info))
                self.refuse(key, f"{name!r} is not in {info_path} (dataset_dir: {ddir}{self.rel(ddir)}; "
                                 "LLaMA-Factory: \"Undefined dataset\"): fix the name, add an entry to that file, "
                                 "or set `dataset_dir: ONLINE` to load a Hub dataset by its id", near)
                continue
            if not isinstance(entry, dict):
                self.refuse(key, f"the entry {name!r} in {info_path} is not a JSON object")
                continue
            self.dataset_entry(key, name, entry, folder, info_path, stage)

    def dataset_entry(self, key: str, name: str, entry: dict, folder: str, info_path: str, stage: str) -> None:
        ranking = bool(entry.get("ranking", False))
        need = stage in STAGES_RANKING
        if ranking != need:
            why = (f"stage {stage} needs a ranking (preference) dataset: `\"ranking\": true` in its entry"
                   if need else f"it is a ranking (preference) dataset and stage {stage} takes none; use it "
                                "with stage rm or dpo")
            self.refuse(key, f"{name!r}: {why} (LLaMA-Factory: \"The dataset is not applicable in the current "
                             "training stage\")")
        if any(k in entry for k in ("hf_hub_url", "ms_hub_url", "om_hub_url", "cloud_file_name")):
            return  # fetched at launch (offline and cached: only the datasets library can tell)
        if "script_url" in entry:
            target, what = str(entry["script_url"]), "script_url"
        elif "file_name" in entry:
            target, what = str(entry["file_name"]), "file_name"
        else:
            self.refuse(key, f"the entry {name!r} in {info_path} has none of file_name, hf_hub_url, "
                             "ms_hub_url, om_hub_url, script_url, cloud_file_name")
            return
        path = os.path.normpath(os.path.join(folder, target))
        seen = self.path(path)
        if seen == MISSING and what == "file_name":
            self.missing(key, f"{name!r} is registered in {info_path} with file_name {target!r}, but {path} does "
                              "not exist (LLaMA-Factory: \"File ... not found\")")
        elif seen == MISSING and what == "script_url" and not is_hub_id(target):
            self.missing(key, f"{name!r}: its script_url {path} does not exist")


def _num(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _nearest(word: str, options: Iterable[str]) -> str | None:
    import difflib

    hits = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return hits[0] if hits else None


def check(config: Mapping[str, Any] | None, *, workdir: str, facts: Facts, after: Sequence[int] = (),
          lines: Mapping[str, int] | None = None) -> Result:
    """Problems (refuse), warnings and notes for one job. `config` is the LLaMA-Factory config
    (None for a command job: then only `after:` is checked)."""
    return _Check(config, workdir=workdir, facts=facts, after=after, lines=lines or {}).run()


def wanted(config: Mapping[str, Any] | None, *, workdir: str, facts: Facts, after: Sequence[int] = ()) -> Wants:
    """The facts `check` would read that `facts` does not hold yet."""
    c = _Check(config, workdir=workdir, facts=facts, after=after, lines={})
    c.run()
    return c.wants
