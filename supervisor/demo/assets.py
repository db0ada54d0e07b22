"""Build (once, cached, atomically) the tiny local Llama + tokenizer + dataset of the demo.

Why this shape: the first `n_short` samples are short and the last `n_long` are long, and the
demo job reads them in order (`disable_shuffling: true`). A run therefore trains a few cheap
steps, saves a checkpoint, then meets the long batch and runs out of (host) memory under a
limit that the short steps fit in: a reproducible *mid-run* OOM after >= 1 checkpoint, which is
exactly what the supervisor has to survive. See `demo_job_config` for the job that does it.

Nothing is downloaded: the tokenizer is trained here with `tokenizers` on generated text and the
model weights are random. torch/transformers/tokenizers are imported inside the builder only, so
importing this module (e.g. from the daemon or CLI) stays light.

Run `python -m supervisor.demo.assets --cache-dir DIR` to build and print the paths.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Bump when the generated content changes, so old caches are not reused.
BUILDER_VERSION = 1
DATASET_NAME = "demo_sft"
_DATA_FILE = "demo_sft.json"
_MANIFEST = "assets.json"
_SPECIAL = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


@dataclass(frozen=True)
class DemoAssets:
    """Paths of a built asset set. `dataset_dir` holds dataset_info.json naming `dataset_name`."""

    model_dir: Path
    dataset_dir: Path
    dataset_name: str
    n_short: int
    n_long: int


def build_demo_assets(
    cache_dir: Path,
    *,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 4,
    max_positions: int = 4096,
    n_short: int = 128,
    n_long: int = 16,
    long_tokens: int = 1000,
    seed: int = 0,
) -> DemoAssets:
    """Return the assets for these parameters, building them on first use.

    The result lives in `cache_dir/demo-<key>` where key hashes every parameter, so different
    shapes coexist and a repeated call costs one `stat`. The build happens in a temporary sibling
    folder that is renamed into place, so a crash or a concurrent builder never leaves (or reads)
    a half-built set.
    """
    params = {
        "version": BUILDER_VERSION,
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "max_positions": max_positions,
        "n_short": n_short,
        "n_long": n_long,
        "long_tokens": long_tokens,
        "seed": seed,
    }
    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    if long_tokens + 64 > max_positions:
        raise ValueError(f"long_tokens ({long_tokens}) must fit in max_positions ({max_positions})")
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:12]
    cache_dir = Path(cache_dir).expanduser().resolve()
    final = cache_dir / f"demo-{key}"
    if not (final / _MANIFEST).is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".demo-{key}.", dir=cache_dir))
        try:
            _build_into(tmp, params)
            tmp.chmod(0o755)  # mkdtemp makes it private; the set is meant to be shared
            try:
                os.rename(tmp, final)
            except OSError:
                # Someone else finished first (rename onto a non-empty dir fails): use theirs.
                if not (final / _MANIFEST).is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return DemoAssets(
        model_dir=final / "model",
        dataset_dir=final / "data",
        dataset_name=DATASET_NAME,
        n_short=n_short,
        n_long=n_long,
    )


def demo_job_config(
    assets: DemoAssets,
    output_dir: Path,
    *,
    micro_batch: int = 16,
    grad_accum: int = 1,
    save_steps: int = 4,
    epochs: float = 1.0,
) -> dict[str, Any]:
    """The LLaMA-Factory training YAML (as a dict) of the demo job.

    With the defaults (16 x 1, one epoch over 128 short + 16 long samples in order) steps 1-8 are
    short batches and step 9 is the long one; checkpoints land at steps 4 and 8. Under a host
    memory limit that fits the short steps but not the long one, the attempt dies at step 9 with
    checkpoint-8 complete, and the remedy "micro-batch 4 x accumulation 4" (same effective batch)
    finishes. `overwrite_output_dir: false` keeps the output dir (and its checkpoints) across
    attempts; the supervisor still names the checkpoint to resume from explicitly.
    """
    return {
        "model_name_or_path": str(assets.model_dir),
        "trust_remote_code": False,
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "full",
        "dataset": assets.dataset_name,
        "dataset_dir": str(assets.dataset_dir),
        "template": "default",
        "cutoff_len": 2048,
        "overwrite_cache": True,
        "disable_shuffling": True,
        "output_dir": str(output_dir),
        "overwrite_output_dir": False,
        "logging_steps": 1,
        "save_steps": save_steps,
        "plot_loss": False,
        "per_device_train_batch_size": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "learning_rate": 1.0e-4,
        "num_train_epochs": epochs,
        "lr_scheduler_type": "cosine",
        "warmup_ratio": 0.1,
        "bf16": False,
        "include_num_input_tokens_seen": True,
        "report_to": "none",
        "seed": 42,
    }


# Environment for a fast, offline LLaMA-Factory run on this kind of machine.
DEMO_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "DISABLE_VERSION_CHECK": "1",
}


# --------------------------------------------------------------------------- building


def _build_into(root: Path, params: dict[str, Any]) -> None:
    rng = random.Random(params["seed"])
    lexicon = _lexicon(rng, 400)
    tokenizer = _train_tokenizer(rng, lexicon)
    tokenizer.save_pretrained(root / "model")
    _save_random_llama(root / "model", tokenizer, params)
    _write_dataset(root / "data", rng, lexicon, tokenizer, params)
    (root / _MANIFEST).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")


def _lexicon(rng: random.Random, size: int) -> list[str]:
    """Pronounceable pseudo-words: a closed vocabulary the tokenizer can learn well."""
    onsets = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "sh", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou"]
    words: set[str] = set()
    while len(words) < size:
        n = rng.choice((1, 2, 2, 3))
        words.add("".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(n)))
    return sorted(words)


def _sentence(rng: random.Random, lexicon: list[str], n_words: int) -> str:
    words = [rng.choice(lexicon) for _ in range(n_words)]
    return " ".join(words).capitalize() + rng.choice((".", ".", "?", "!"))


def _corpus(rng: random.Random, lexicon: list[str]) -> Iterator[str]:
    # The template's own strings must be learnt too, or they would split into bytes.
    for _ in range(50):
        yield "Human: Assistant: System: \n"
    for _ in range(3000):
        yield _sentence(rng, lexicon, rng.randint(4, 14))


def _train_tokenizer(rng: random.Random, lexicon: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=_SPECIAL["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        special_tokens=list(_SPECIAL.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(rng, lexicon), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=4096, **_SPECIAL)


def _save_random_llama(model_dir: Path, tokenizer: Any, params: dict[str, Any]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = params["hidden"]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=(hidden * 8 // 3 + 15) // 16 * 16,
        num_hidden_layers=params["layers"],
        num_attention_heads=params["heads"],
        num_key_value_heads=params["heads"],
        max_position_embeddings=params["max_positions"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(params["seed"])
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(model_dir)


def _write_dataset(
    data_dir: Path, rng: random.Random, lexicon: list[str], tokenizer: Any, params: dict[str, Any]
) -> None:
    """Short samples first, long ones last; order is the file order (no shuffling)."""

    def n_tokens(text: str) -> int:
        return len(tokenizer.encode(" " + text, add_special_tokens=False))

    rows: list[dict[str, str]] = []
    for _i in range(params["n_short"]):
        rows.append(
            {
                "instruction": _sentence(rng, lexicon, rng.randint(4, 8)),
                "input": "",
                "output": _sentence(rng, lexicon, rng.randint(6, 16)),
            }
        )
    target = params["long_tokens"]
    for _i in range(params["n_long"]):
        instruction = _sentence(rng, lexicon, 12)
        budget = target - n_tokens(instruction) - 8  # the template adds a few tokens
        sentences: list[str] = []
        used = 0
        while True:
            s = _sentence(rng, lexicon, rng.randint(6, 14))
            cost = n_tokens(s)
            if used + cost > budget:
                break
            sentences.append(s)
            used += cost
        rows.append({"instruction": instruction, "input": "", "output": " ".join(sentences)})
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / _DATA_FILE).write_text(json.dumps(rows, indent=1) + "\n")
    info = {DATASET_NAME: {"file_name": _DATA_FILE}}
    (data_dir / "dataset_info.json").write_text(json.dumps(info, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m supervisor.demo.assets", description=__doc__)
    ap.add_argument("--cache-dir", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--n-short", type=int, default=128)
    ap.add_argument("--n-long", type=int, default=16)
    ap.add_argument("--long-tokens", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    assets = build_demo_assets(
        a.cache_dir,
        hidden=a.hidden,
        layers=a.layers,
        n_short=a.n_short,
        n_long=a.n_long,
        long_tokens=a.long_tokens,
        seed=a.seed,
    )
    print(json.dumps({k: str(v) for k, v in asdict(assets).items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
