"""The real-model path on hub-shaped stand-ins (tests/hub_fixture.py): the shipped recipes against dvc.yaml,
one prompt rendering in every stage, validate failing fast, and `dvc repro` end to end on each recipe exactly
as README's "Switching to a real model" section says (sizes scaled by a params overlay)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.hub_fixture import CHATML_TEMPLATE, IM_END, gsm8k_rows, make_chat_model, make_gsm8k
from tests.tiny import in_stage_repo, undo_recipe_changes

REPO = Path(__file__).resolve().parents[1]
ALL_CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
# The hub-model recipes (embedded: null); configs/embedded-*.yaml are the embedded default on another engine,
# and configs/smollm2-*.yaml runs the real SmolLM2 model itself (tests/test_smollm2.py), no stand-in.
CONFIGS = [name for name in ALL_CONFIGS if name.startswith("gsm8k-")]
# What configs/gsm8k-qwen2.5-0.5b-tools.yaml changes of the GSM8K recipe besides the system prompt, and
# nothing else (its header says why).
TOOLS_RECIPE_CHANGES = {
    ("data", "max_prompt_length"): 512, ("generation", "max_completion_length"): 768,
    ("train", "tools"): ["grpo_core.tools.calculator:calculator"],
    ("train", "max_tool_calling_iterations"): 4, ("tracking", "experiment_name"): "gsm8k-qwen2.5-0.5b-tools",
    ("tracking", "registered_model_name"): "gsm8k-qwen2.5-0.5b-tools",
}
# What configs/embedded-vllm.yaml changes of params.yaml, and nothing else (its header says why).
EMBEDDED_VLLM = {("embedded", "num_attention_heads"): 3, ("generation", "backend"): "vllm"}
MODEL_DIR = "models/Qwen2.5-0.5B-Instruct"  # where README's `hf download` puts the model
DATA_DIR = "data/gsm8k"
# What the end-to-end runs scale down (sizes only: the recipe's algorithm, precision and format stay).
OVERLAY = {
    "calibrate": {"num_prompts": 4, "num_generations": 4},
    "generation": {"max_completion_length": 24},
    "train": {"num_generations": 4, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
              "max_steps": 3, "save_steps": 2},
    "evaluate": {"max_samples": 4, "num_generations": 4, "pass_k": [1, 4], "max_completion_length": 24,
                 "batch_size": 8},
}


def recipe(name: str) -> dict:
    return yaml.safe_load((REPO / "configs" / name).read_text())


def scaled(raw: dict, overlay: dict | None = None) -> dict:
    raw = json.loads(json.dumps(raw))
    for section, values in (overlay or OVERLAY).items():
        raw[section].update(values)
    return raw


@pytest.fixture(scope="module")
def hub_assets(tmp_path_factory):
    """The hub-shaped model and GSM8K files, built once: (model folder, gsm8k folder)."""
    root = tmp_path_factory.mktemp("hub")
    make_gsm8k(root / "gsm8k")
    system = recipe(CONFIGS[0])["data"]["system_prompt"]
    make_chat_model(root / "model", [r["question"] for r in gsm8k_rows(64, 0)], system)
    return root / "model", root / "gsm8k"


@pytest.fixture(scope="module")
def hub_tools_model(tmp_path_factory):
    """The hub-shaped model with Qwen2.5-Instruct's own chat template, warm-started to call the tools recipe's
    calculator on about half the questions (tests/hub_fixture.py)."""
    from grpo_core.tools.calculator import calculator

    path = tmp_path_factory.mktemp("hub-tools") / "model"
    system = recipe("gsm8k-qwen2.5-0.5b-tools.yaml")["data"]["system_prompt"]
    return make_chat_model(path, [r["question"] for r in gsm8k_rows(64, 0)], system, hidden_size=64,
                           warm_start_steps=200, tools=[calculator])


# ---------------------------------------------------------------------------------------------------
# every shipped config against dvc.yaml


def interpolations(node) -> list[str]:
    """Every ``${key}`` in a dvc.yaml fragment; dict keys count too
    (an out with options is ``{path: {...}}``)."""
    if isinstance(node, dict):
        return [key for k, v in node.items() for key in (*interpolations(k), *interpolations(v))]
    if isinstance(node, list):
        return [key for v in node for key in interpolations(v)]
    return re.findall(r"\$\{([^}]+)\}", node) if isinstance(node, str) else []


def lookup(raw: dict, dotted: str):
    node = raw
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(dotted)
        node = node[part]
    return node


@pytest.mark.parametrize("name", ["params.yaml", *ALL_CONFIGS])
def test_config_is_complete_for_dvc(name):
    """What `dvc repro` needs of params.yaml: every `${...}` in dvc.yaml resolves to one path (DVC cannot hash
    a list), every key a stage lists under `params` exists, and the file loads as our config."""
    from grpo_core.config import config_from_dict

    raw = yaml.safe_load((REPO / name).read_text()) if name == "params.yaml" else recipe(name)
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for stage, spec in stages.items():
        for key in interpolations({"deps": spec.get("deps", []), "outs": spec.get("outs", [])}):
            value = lookup(raw, key)
            assert isinstance(value,
                              str), f"{name}: dvc.yaml {stage} needs ${{{key}}} as one path, got {value!r}"
        for key in spec.get("params", []):
            lookup(raw, key)  # KeyError names the missing key
    cfg = config_from_dict(raw)
    if name in CONFIGS:
        assert cfg.embedded is None  # prepare does no work
        assert not Path(cfg.model.name_or_path).is_absolute() and cfg.model.name_or_path == MODEL_DIR
        for split in ("train", "eval"):
            assert cfg.data.paths(split)[0].startswith(DATA_DIR + "/main/")


def test_tools_recipe_is_the_gsm8k_recipe_with_a_calculator():
    """configs/gsm8k-qwen2.5-0.5b-tools.yaml is the GSM8K recipe with TOOLS_RECIPE_CHANGES and a system prompt
    that names the tool, and nothing else; its tool imports and passes the registry's checks (type hints,
    docstring)."""
    from grpo_core.config import load_config
    from grpo_core.tools import build_toolbox

    base, tools = recipe("gsm8k-qwen2.5-0.5b.yaml"), recipe("gsm8k-qwen2.5-0.5b-tools.yaml")
    undo_recipe_changes(tools, base, TOOLS_RECIPE_CHANGES)
    prompt = base["data"]["system_prompt"]
    assert (tools["data"]["system_prompt"]
            == "Use the calculator tool for every computation, then r" + prompt[1:])
    tools["data"]["system_prompt"] = prompt
    assert tools == base
    toolbox = build_toolbox(load_config(REPO / "configs/gsm8k-qwen2.5-0.5b-tools.yaml").train.tool_use)
    assert [t.__name__ for t in toolbox.tools] == ["calculator"] and toolbox.max_iterations == 4


def test_embedded_vllm_recipe_is_the_default_with_the_engine_and_a_head_size_it_runs():
    """configs/embedded-vllm.yaml is params.yaml with EMBEDDED_VLLM's keys changed, and nothing else: a key
    added to or changed in params.yaml must reach the recipe too (the recipe claims "the embedded default with
    vLLM")."""
    default = yaml.safe_load((REPO / "params.yaml").read_text())
    vllm = recipe("embedded-vllm.yaml")
    undo_recipe_changes(vllm, default, EMBEDDED_VLLM)
    assert vllm == default
    embedded = recipe("embedded-vllm.yaml")["embedded"]
    # a size vLLM's CPU attention takes
    assert embedded["hidden_size"] // embedded["num_attention_heads"] == 32


# ---------------------------------------------------------------------------------------------------
# stages in-process on the hub-shaped model: one rendering, validate failing fast


@pytest.fixture()
def chat_repo(tmp_path, monkeypatch, hub_assets):
    """A repo root holding the GSM8K recipe (scaled, float32 compute: one process runs several stages and
    accelerate's precision is process-wide) with the hub-shaped model and files where README puts them."""
    model, gsm8k = hub_assets
    shutil.copytree(model, tmp_path / MODEL_DIR)
    shutil.copytree(gsm8k, tmp_path / DATA_DIR)
    raw = scaled(recipe("gsm8k-qwen2.5-0.5b.yaml"))
    raw["train"].update(mixed_precision="no", gradient_checkpointing=False, max_steps=1)
    raw["data"]["chat_template_kwargs"] = {"enable_thinking": False}
    return in_stage_repo(tmp_path, raw, monkeypatch, "test-real-model")


def edit_params(root: Path, edit) -> None:
    raw = yaml.safe_load((root / "params.yaml").read_text())
    edit(raw)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


@pytest.mark.slow
def test_validate_calibrate_train_and_evaluate_render_the_same_prompt(chat_repo, monkeypatch):
    from flows.stages.__main__ import main
    from grpo_core.data.loading import PromptEncoder

    seen: dict[str, dict[str, str]] = {}
    stage = {"name": None}
    render = PromptEncoder.render

    def spy(self, prompt, *args, **kwargs):
        text = render(self, prompt, *args, **kwargs)
        seen.setdefault(stage["name"], {})[prompt] = text
        return text

    monkeypatch.setattr(PromptEncoder, "render", spy)
    for name in ("validate", "calibrate", "train", "evaluate"):
        stage["name"] = name
        assert main([name]) == 0, name
    assert set(seen) == {"validate", "calibrate", "train", "evaluate"}
    system = recipe("gsm8k-qwen2.5-0.5b.yaml")["data"]["system_prompt"]
    checked = 0
    for name in ("calibrate", "train", "evaluate"):
        for prompt, text in seen[name].items():
            # by hand: ChatML with the recipe's system message, the question as the user turn, the generation
            # prompt, and the template keyword from data.chat_template_kwargs
            assert text == (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n"
                            "<|im_start|>assistant\n<think>\n\n</think>\n\n"), name
            assert seen["validate"][prompt] == text, name  # validate measured the same string
            checked += 1
    assert checked >= 3


def test_validate_passes_gsm8k_golds_and_checks_the_model(chat_repo, capsys):
    from flows.stages.__main__ import main

    assert main(["validate"]) == 0
    report = json.loads((chat_repo / "reports/validation.json").read_text())
    # `#### 72` and `#### 1,200` golds score 1
    assert report["ok"] and report["summary"]["total_failures"] == 0
    assert "qwen2, 26 tensors" in (chat_repo / "reports/validation.txt").read_text()


def test_validate_fails_fast_on_a_reward_that_does_not_import(chat_repo, capsys):
    from flows.stages.__main__ import main

    edit_params(chat_repo, lambda r: r["rewards"].append(
        {"name": "mine", "function": "my_rewards.gsm8k:strict", "kwargs": {}, "target_share": 0.1}))
    assert main(["validate"]) == 2
    assert "reward 'mine': cannot import module 'my_rewards.gsm8k'" in capsys.readouterr().err
    assert not (chat_repo / "data/validated/train.parquet").exists()


def test_validate_fails_on_a_reward_that_raises_on_a_smoke_batch(chat_repo, capsys):
    from flows.stages.__main__ import main

    edit_params(chat_repo, lambda r: r["rewards"].append(
        {"name": "buggy", "function": "tests.reward_helpers:always_raises", "kwargs": {},
         "target_share": 0.1}))
    assert main(["validate"]) == 3
    text = (chat_repo / "reports/validation.txt").read_text()
    assert "reward_smoke:buggy" in text and "KeyError" in text
    assert not (chat_repo / "data/validated/train.parquet").exists()


def test_validate_fails_fast_on_a_model_folder_that_does_not_load(chat_repo, capsys):
    from flows.stages.__main__ import main

    (chat_repo / MODEL_DIR / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    assert main(["validate"]) == 5
    assert "model.safetensors is not a readable safetensors file" in capsys.readouterr().err
    (chat_repo / MODEL_DIR / "model.safetensors").unlink()
    assert main(["validate"]) == 5
    assert "holds no *.safetensors weights" in capsys.readouterr().err


def test_validate_fails_fast_on_chat_prompts_without_a_chat_template(chat_repo, capsys):
    from flows.stages.__main__ import main

    cfg_file = chat_repo / MODEL_DIR / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_file.read_text())
    tok_cfg.pop("chat_template", None)
    cfg_file.write_text(json.dumps(tok_cfg))
    (chat_repo / MODEL_DIR / "chat_template.jinja").unlink(missing_ok=True)
    assert main(["validate"]) == 5
    err = capsys.readouterr().err
    assert "data.prompt_format 'chat'" in err and "needs a tokenizer with a chat template" in err


def test_fixture_is_shaped_like_the_hub(hub_assets):
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    model, gsm8k = hub_assets
    tok = AutoTokenizer.from_pretrained(model)
    config = AutoConfig.from_pretrained(model)
    assert config.model_type == "qwen2" and config.tie_word_embeddings and config.dtype == torch.bfloat16
    assert (tok.eos_token == IM_END and tok.pad_token == "<|endoftext|>"
            and tok.pad_token_id != tok.eos_token_id)
    assert tok.bos_token is None and tok.chat_template == CHATML_TEMPLATE
    assert GenerationConfig.from_pretrained(model).eos_token_id == [tok.eos_token_id, tok.pad_token_id]
    import pandas as pd

    train = pd.read_parquet(gsm8k / "main/train-00000-of-00001.parquet")
    assert list(train.columns) == ["question", "answer"]
    assert train["answer"].str.contains(r"<<[^>]+>>").all() and train["answer"].str.contains(r"\n#### ").all()
    assert train["answer"].str.contains(r"#### \d{1,3},\d{3}$").any()


# ---------------------------------------------------------------------------------------------------
# end to end, as README says


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_recipe_runs_end_to_end_under_dvc_repro(name, hub_assets, tmp_path, request):
    """README's "Switching to a real model": the download steps (here: the hub-shaped stand-ins at the same
    paths), `cp configs/<name> params.yaml`, `dvc repro`; sizes scaled by OVERLAY. Then an edit of the data
    file re-runs validate and everything after it. The tools recipe's model calls the calculator: the calls
    and their outcomes reach train_log.csv and eval.json."""
    from tests.test_pipeline import dvc, make_clone, run

    repo = make_clone(tmp_path / "repo")
    model, gsm8k = hub_assets
    tools = bool(recipe(name)["train"]["tools"])
    if tools:
        model = request.getfixturevalue("hub_tools_model")
    shutil.copytree(model, repo / MODEL_DIR)
    shutil.copytree(gsm8k, repo / DATA_DIR)
    run(repo, "cp", f"configs/{name}", "params.yaml")
    overlay = json.loads(json.dumps(OVERLAY))
    if tools:  # a call (~25 tokens), its result block and an answer: room for a second turn
        overlay["generation"]["max_completion_length"] = overlay["evaluate"]["max_completion_length"] = 96
    edit_params(repo, lambda raw: raw.update(scaled(raw, overlay)))
    out = dvc(repo, "repro", timeout=1200)
    log = out.stdout + out.stderr
    assert "embedded: null - the embedded default is not used; nothing to prepare" in log
    for stage in ("validate", "calibrate", "train", "evaluate"):
        assert f"Running stage '{stage}'" in log
    metrics = json.loads((repo / "metrics/eval.json").read_text())
    assert {"base", "trained", "delta"} <= set(metrics) and metrics["trained"]["num_prompts"] == 4
    rows = (repo / "metrics/train_log.csv").read_text().splitlines()
    assert len(rows) == 1 + 3
    if tools:
        import pandas as pd

        log = pd.read_csv(repo / "metrics/train_log.csv")
        assert (log["tools/call_frequency"] > 0).all() and log["tools/failure_frequency"].between(0, 1).all()
        assert log["tools/mean_turns"].max() > 1
        for policy in ("base", "trained"):  # evaluate samples with the tool too (greedy may not call it)
            assert 0 < metrics[policy]["sampled/tool_call_frequency"]
            assert 0 <= metrics[policy]["tool_success_rate"] <= 1
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    assert AutoConfig.from_pretrained(repo / "artifacts/model").dtype == torch.bfloat16
    AutoModelForCausalLM.from_pretrained(repo / "artifacts/model")
    lora = recipe(name)["model"]["lora"] is not None
    assert (repo / "artifacts/model/adapter/adapter_model.safetensors").is_file() == lora
    assert dvc(repo, "status").stdout.strip().endswith("Data and pipelines are up to date.")
    if lora or tools:
        return  # the DAG check below is the same for every recipe

    # the DAG follows the file params.yaml names: edit it, and validate and everything after it re-run
    import pandas as pd

    path = repo / DATA_DIR / "main/train-00000-of-00001.parquet"
    pd.read_parquet(path).iloc[:-1].to_parquet(path, index=False)
    status = dvc(repo, "status").stdout
    assert "validate" in status and "modified:" in status and f"{DATA_DIR}/main" in status  # data.train_dir
    out = dvc(repo, "repro", "--dry", timeout=300).stdout  # (a dry run cannot know validate's outputs change,
    assert "Running stage 'validate'" in out and "Running stage 'prepare'" not in out  # so it stops there)
