"""LLaMA-Factory v0.9.5's own example training configs through `submit` and `plan`, from the
root of a checkout (issue 20, item 9). Accepted, warnings allowed, except the ones LLaMA-Factory
0.9.5 itself stops on, each refused with that reason and an accepted fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import FIXTURE

CONFIGS = sorted(str(p.relative_to(FIXTURE)) for p in (FIXTURE / "examples").rglob("*.yaml")
                 if "accelerate" not in p.parts)

# What LLaMA-Factory 0.9.5 (with the transformers 5.6 it installs) refuses too; see submit-audit.
REFUSED = {
    "examples/extras/asft/llama2_full_asft.yaml": "'med' is not in",          # Undefined dataset med
    "examples/extras/asft/qwen2_full_asft.yaml": "'math' is not in",         # Undefined dataset math
    "examples/extras/fp8/llama3_fp8_fsdp_sft.yaml": "write it inside fsdp_config",  # gone in transformers 5
    "examples/megatron/qwen2_vl_full.yaml": "USE_MCA=1",                     # mcore_adapter keys
    "examples/megatron/qwen3_moe_full.yaml": "USE_MCA=1",
    # predicts with the adapter another example trains: saves/llama3-8b/lora/sft is not there yet
    "examples/extras/nlg_eval/llama3_lora_predict.yaml": "saves/llama3-8b/lora/sft does not exist",
}


def test_the_fixture_has_every_training_config():
    assert len(CONFIGS) == 50, CONFIGS


@pytest.mark.parametrize("config", CONFIGS)
def test_submit_and_plan_accept_the_example(checkout, cli, config):
    rc, out, err = cli("submit", config)
    if config in REFUSED:
        assert rc == 2 and REFUSED[config] in err, err
        return
    assert rc == 0, err
    assert "submitted" in out and "Traceback" not in err
    rc, out, err = cli("plan", config)
    assert rc == 0, err
    assert "as submitted" in out


def test_the_refused_examples_are_accepted_once_fixed(checkout, cli):
    text = Path("examples/megatron/qwen3_moe_full.yaml").read_text()
    Path("mca.yaml").write_text(text + "\nsupervisor:\n  env: {USE_MCA: \"1\"}\n")
    rc, _, err = cli("submit", "mca.yaml")
    assert rc == 0 and "with USE_MCA=1 it goes to Megatron-Core" in err, err

    text = Path("examples/extras/fp8/llama3_fp8_fsdp_sft.yaml").read_text()
    Path("fsdp.yaml").write_text(text.replace("fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer",
                                              "fsdp_config: {transformer_layer_cls_to_wrap: [LlamaDecoderLayer]}"))
    rc, _, err = cli("submit", "fsdp.yaml")
    assert rc == 0, err

    (checkout / "saves/llama3-8b/lora/sft").mkdir(parents=True)  # the LoRA run it evaluates has finished
    (checkout / "saves/llama3-8b/lora/sft/adapter_config.json").write_text("{}")
    rc, _, err = cli("submit", "examples/extras/nlg_eval/llama3_lora_predict.yaml")
    assert rc == 0 and "trains nothing" in err, err


def test_deepspeed_sections_deepspeed_ignores_are_warnings(checkout, cli):
    rc, _, err = cli("submit", "examples/extras/fp8/llama3_fp8_deepspeed_sft.yaml")
    assert rc == 0, err
    assert "warning: line 44: deepspeed.comms_config: not a DeepSpeed config key" in err


def test_plan_resolves_relative_paths_against_the_current_directory(checkout, cli):
    """The deepspeed JSON was looked for under the YAML's folder (examples/train_full/examples/...)."""
    rc, _out, err = cli("plan", "examples/train_full/qwen3_full_sft.yaml")
    assert rc == 0, err


def test_plan_sizes_a_hub_model_from_the_cache_or_says_how_to_fetch_its_config(checkout, cli, tmp_path):
    rc, out, _ = cli("plan", "examples/train_lora/qwen3_lora_sft.yaml")
    assert rc == 0 and "hf download Qwen/Qwen3-4B-Instruct-2507 config.json" in out, out
    snap = tmp_path / "hf-home/hub/models--Qwen--Qwen3-4B-Instruct-2507/snapshots/0123abc"
    snap.mkdir(parents=True)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs/main").write_text("0123abc")
    (snap / "config.json").write_text('{"hidden_size": 2560, "num_hidden_layers": 36, "intermediate_size": 9728, '
                                      '"vocab_size": 151936, "num_attention_heads": 32, "num_key_value_heads": 8}')
    rc, out, _ = cli("plan", "examples/train_lora/qwen3_lora_sft.yaml", "--gpu-memory", "24")
    assert rc == 0 and "config.json from the Hugging Face cache" in out and "parameters" in out, out
    assert "GPU ~" in out
