"""The 2 a.m. mistakes of issue 20: each refused at `submit` with its line and advice, and the
advice, followed, gives an accepted job. From a LLaMA-Factory checkout (tests/intake/conftest.py),
through the real CLI entry point; the same checks run in the daemon's intake (last tests)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

BASE = Path("examples/train_lora/qwen3_lora_sft.yaml")


def variant(name: str, old: str | None, new: str) -> str:
    text = BASE.read_text()
    if old is None:
        text += new
    else:
        assert old in text, old
        text = text.replace(old, new)
    Path(name).write_text(text)
    return name


def local_model(root: Path) -> Path:
    model = root / "models" / "Qwen3-4B-Instruct-2507"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"hidden_size": 2560, "num_hidden_layers": 36}))
    return model


def test_a_model_typo_on_an_offline_box_is_refused_with_how_to_fix_it(checkout, cli, monkeypatch):
    f = variant("m.yaml", "model_name_or_path: Qwen/Qwen3-4B-Instruct-2507", "model_name_or_path: x")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, _, err = cli("submit", f)
    assert rc == 2, err
    assert "line 2: model_name_or_path: 'x' is not a local folder" in err
    assert "HF_HUB_OFFLINE=1 in the job's environment forbids downloading it" in err
    assert "Give the model's folder, or download it first: `HF_HUB_OFFLINE=0 hf download x`" in err
    model = local_model(checkout)
    variant("m.yaml", "model_name_or_path: Qwen/Qwen3-4B-Instruct-2507", f"model_name_or_path: {model}")
    rc, _, err = cli("submit", f)
    assert rc == 0, err


def test_a_hub_id_online_is_a_warning_and_a_cached_one_nothing(checkout, cli, tmp_path):
    rc, _, err = cli("submit", str(BASE))
    assert rc == 0 and "downloaded from the Hub at launch" in err, err
    snap = tmp_path / "hf-home/hub/models--Qwen--Qwen3-4B-Instruct-2507/snapshots/abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs/main").write_text("abc123")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        rc, _, err = cli("submit", str(BASE))
    finally:
        del os.environ["HF_HUB_OFFLINE"]
    assert rc == 0 and "model_name_or_path" not in err, err


@pytest.mark.parametrize("path", ["/models/Qwen3-4B-Instruct-2507", "./models/Qwen3-4B"])
def test_a_missing_model_folder_is_refused(checkout, cli, path):
    f = variant("m.yaml", "model_name_or_path: Qwen/Qwen3-4B-Instruct-2507", f"model_name_or_path: {path}")
    rc, _, err = cli("submit", f)
    assert rc == 2 and "does not exist" in err and "cannot be a Hugging Face Hub id" in err, err


def test_no_dataset_key_is_refused_and_the_example_given_is_accepted(checkout, cli):
    f = variant("d.yaml", "dataset: identity,alpaca_en_demo\n", "")
    rc, _, err = cli("submit", f)
    assert rc == 2, err
    assert "dataset: missing: do_train is true" in err and "add e.g. `dataset: identity,alpaca_en_demo`" in err
    variant("d.yaml", None, "")  # the advice, followed
    rc, _, err = cli("submit", f)
    assert rc == 0, err


def test_an_unregistered_dataset_gets_the_nearest_name(checkout, cli):
    f = variant("d.yaml", "dataset: identity,alpaca_en_demo", "dataset: identiy,alpaca_en_demo")
    rc, _, err = cli("submit", f)
    assert rc == 2, err
    assert "line 13: dataset: 'identiy' is not in" in err and "(did you mean 'identity'?)" in err
    variant("d.yaml", None, "")
    assert cli("submit", f)[0] == 0


def test_a_missing_dataset_dir_is_refused(checkout, cli):
    f = variant("d.yaml", "dataset: identity,alpaca_en_demo\n", "dataset: identity,alpaca_en_demo\n"
                "dataset_dir: /srv/data/lf\n")
    rc, _, err = cli("submit", f)
    assert rc == 2 and "line 14: dataset_dir: /srv/data/lf does not exist" in err, err
    assert "Point dataset_dir at the folder holding dataset_info.json" in err


def test_a_bare_deepspeed_preset_name_gets_the_checkouts_path(checkout, cli):
    f = variant("z.yaml", "### output", "deepspeed: ds_z3_offload_config.json\n### output")
    rc, _, err = cli("submit", f)
    assert rc == 2, err
    wanted = str(checkout / "examples/deepspeed/ds_z3_offload_config.json")
    assert f"found it at {wanted}: give that path (did you mean {wanted!r}?)" in err
    variant("z.yaml", "### output", f"deepspeed: {wanted}\n### output")
    rc, _, err = cli("submit", f)
    assert rc == 0, err


def test_a_preset_path_from_elsewhere_says_drop_deepspeed_and_that_is_accepted(checkout, cli, tmp_path,
                                                                              monkeypatch):
    import shutil

    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(checkout / "data", elsewhere / "mydata")  # the user's own data, no checkout near
    text = BASE.read_text().replace("### output", "deepspeed: examples/deepspeed/ds_z3_offload_config.json\n"
                                    "dataset_dir: mydata\n### output")
    (elsewhere / "z.yaml").write_text(text)
    monkeypatch.chdir(elsewhere)
    rc, _, err = cli("submit", "z.yaml")
    assert rc == 2, err
    assert f"looked for {elsewhere}/examples/deepspeed/ds_z3_offload_config.json" in err
    assert "or drop `deepspeed:`: when memory runs out, the supervisor's zero3 remedies generate" in err
    (elsewhere / "z.yaml").write_text(text.replace("deepspeed: examples/deepspeed/ds_z3_offload_config.json\n", ""))
    rc, _, err = cli("submit", "z.yaml")
    assert rc == 0, err
    # With dataset_dir in a checkout, that checkout's preset is offered (its absolute path), and taken.
    (elsewhere / "z.yaml").write_text(text.replace("dataset_dir: mydata", f"dataset_dir: {checkout / 'data'}"))
    rc, _, err = cli("submit", "z.yaml")
    wanted = str(checkout / "examples/deepspeed/ds_z3_offload_config.json")
    assert rc == 2 and f"(did you mean {wanted!r}?)" in err, err
    (elsewhere / "z.yaml").write_text(text.replace("dataset_dir: mydata", f"dataset_dir: {checkout / 'data'}")
                                      .replace("examples/deepspeed/ds_z3_offload_config.json", wanted))
    assert cli("submit", "z.yaml")[0] == 0


def test_gpu_memory_utilization_advice_does_not_go_in_a_circle(checkout, cli):
    f = variant("g.yaml", None, "gpu_memory_utilization: 0.88\n")
    rc, _, err = cli("submit", f)
    assert rc == 2 and "remove this line" in err and "vllm_gpu_util" not in err, err
    variant("g.yaml", None, "vllm_gpu_util: 0.88\n")  # what the old advice led to
    rc, _, err = cli("submit", f)
    assert rc == 0 and "warning: line 46: vllm_gpu_util: only LLaMA-Factory's vLLM/SGLang inference" in err, err


def test_after_a_job_that_does_not_exist_is_refused(checkout, cli):
    rc, _, err = cli("submit", str(BASE), "--after", "99")
    assert rc == 2 and "supervisor.after: job 99 does not exist (there are no jobs yet" in err, err


def test_every_problem_in_one_report_with_lines(checkout, cli):
    f = variant("p.yaml", None, "supervisor:\n  policy: conservativ\n  gpus: [0]\n")
    Path(f).write_text(Path(f).read_text().replace("cutoff_len: 2048", "cutof_len: 2048")
                       .replace("dataset: identity,", "dataset: identiy,"))
    rc, _, err = cli("submit", f)
    assert rc == 2, err
    lines = [ln.strip() for ln in err.splitlines() if ln.strip().startswith("- line")]
    assert [ln.split(":")[0] for ln in lines] == ["- line 13", "- line 15", "- line 47"], err
    assert "line 47: supervisor.policy: no policy 'conservativ'" in err and "did you mean 'conservative'" in err
    assert "line 15: cutof_len: not a LLaMA-Factory training argument" in err


def test_a_tab_gets_its_column_and_use_spaces(checkout, cli):
    f = variant("t.yaml", "cutoff_len: 2048", "cutoff_len:\t2048")
    rc, _, err = cli("submit", f)
    assert rc == 2 and "line 15: (file): column 12: a tab character" in err and "replace the tab with spaces" in err


def test_command_as_a_string_gets_the_list_it_must_be(tmp_path, cli):
    (tmp_path / "c.yaml").write_text("supervisor:\n  command: torchrun --nproc-per-node 2 train.py\n")
    rc, _, err = cli("submit", str(tmp_path / "c.yaml"))
    assert rc == 2 and "Input should be" not in err, err
    assert 'line 2: supervisor.command: must be a list of arguments' in err
    assert 'e.g. `command: [torchrun, --nproc-per-node, "2", train.py]`' in err


def test_the_daemons_intake_runs_the_same_checks(checkout, tmp_path):
    """A raw drop into incoming/ (no submit) meets the same refusal, written beside it."""
    from supervisor.core.paths import SpoolPaths, StatePaths
    from supervisor.intake.spool import CheckContext, intake
    from supervisor.record.store import Store

    spool, state = SpoolPaths(tmp_path / "spool2"), StatePaths(tmp_path / "state2")
    spool.ensure()
    text = BASE.read_text().replace("dataset: identity,", "dataset: identiy,")
    (spool.incoming / "j.yaml").write_text(text + f"supervisor:\n  workdir: {checkout}\n  after: [7]\n")
    store = Store(state.db)
    res = intake(spool, state, store, settle_s=0, max_bytes=1 << 20, context=CheckContext(where="intake"))
    store.close()
    assert res.accepted == []
    reason = (spool.rejected / "j.yaml.error.txt").read_text()
    assert "'identiy' is not in" in reason and "job 7 does not exist" in reason
