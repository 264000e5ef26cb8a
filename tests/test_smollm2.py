"""The real pretrained model end to end: configs/smollm2-135m-word-problems.yaml under `dvc repro` in a fresh
clone, sizes scaled down (SCALE). The GGUF conversion, SmolLM2's own tokenizer and ChatML template in every
stage that renders a prompt, a checkpoint resume, and an export that generates what the trained policy
generates."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from tests.real_model import SCALE, set_params, smollm2_gguf
from tests.test_pipeline import copy_repo, dvc

CHAT_PREFIX = ("<|im_start|>system\nSolve the problem. End your reply with: The answer is N.<|im_end|>\n"
               "<|im_start|>user\n")

# with tests/test_gguf.py's real-model tests: one xdist worker builds the shared run (conftest.py)
pytestmark = pytest.mark.slow


def test_the_recipe_converts_the_gguf_and_runs_every_stage(smollm2_pipeline):
    repo, log = smollm2_pipeline
    for stage in ("convert", "validate", "calibrate", "train", "evaluate"):
        assert f"Running stage '{stage}'" in log
    assert "convert: 134,515,008 parameters (llama) from models/SmolLM2-135M-Instruct.Q4_1.gguf" in log
    source = json.loads((repo / "artifacts/converted_model/gguf_source.json").read_text())
    assert (source["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
            and source["bytes"] == smollm2_gguf().stat().st_size)
    assert len(pd.read_csv(repo / "metrics/train_log.csv")) == 2
    metrics = json.loads((repo / "metrics/eval.json").read_text())
    assert metrics["base"]["num_prompts"] == metrics["trained"]["num_prompts"] == 4
    assert dvc(repo, "status").stdout.strip().endswith("Data and pipelines are up to date.")


def test_prompts_are_rendered_with_smollm2s_own_chatml_template(smollm2_pipeline):
    """The prompt is the system message and the problem under SmolLM2's template (its <|im_start|>/<|im_end|>
    specials; by hand below), and evaluate sampled from exactly that: HF generate on the rendered prompt
    writes the base policy's greedy reply the stage recorded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_core.config import load_config
    from grpo_core.data.loading import PromptEncoder

    repo, _ = smollm2_pipeline
    tok = AutoTokenizer.from_pretrained(repo / "artifacts/converted_model")
    assert len(tok) == 49152 and tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id == 2
    problem = json.loads((repo / "data/word-problems/eval.jsonl").read_text().splitlines()[0])["prompt"]
    text = PromptEncoder.from_config(tok, load_config(repo / "params.yaml").data).render(problem)
    assert text == f"{CHAT_PREFIX}{problem}<|im_end|>\n<|im_start|>assistant\n"

    rows = pd.read_parquet(repo / "artifacts/eval/completions.parquet")
    (recorded,) = rows[(rows["policy"] == "base") & (rows["mode"] == "greedy") & (rows["prompt_index"] == 0)][
        "completion"]
    model = AutoModelForCausalLM.from_pretrained(repo / "artifacts/converted_model",
                                                 dtype=torch.float32).eval()
    ids = tok(text, add_special_tokens=False, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=SCALE["generation"]["max_completion_length"], do_sample=False)
    assert tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True) == recorded


def test_resume_from_a_checkpoint_then_export_generates_what_the_policy_generates(smollm2_pipeline, tmp_path):
    """max_steps 2 -> 3: train resumes from checkpoint-2 (nothing before it re-runs) and logs step 3 once; the
    exported model's weights are the last checkpoint's, and both write the same greedy replies."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    repo = copy_repo(smollm2_pipeline[0], tmp_path / "repo")
    set_params(repo, {"train": {"max_steps": 3}})
    out = dvc(repo, "repro", "train", timeout=900)  # the export is train's; evaluate has nothing to add here
    log = out.stdout + out.stderr
    assert "train: resuming from" in log and "checkpoint-2" in log
    for stage in ("convert", "validate", "calibrate"):
        assert f"Stage '{stage}' didn't change" in log
    assert pd.read_csv(repo / "metrics/train_log.csv")["step"].tolist() == [1, 2, 3]

    exported = AutoModelForCausalLM.from_pretrained(repo / "artifacts/model", dtype=torch.float32).eval()
    policy = AutoModelForCausalLM.from_pretrained(repo / "artifacts/checkpoints/checkpoint-3",
                                                  dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(repo / "artifacts/converted_model", dtype=torch.float32)
    exported_w, policy_w, base_w = exported.state_dict(), policy.eval().state_dict(), base.state_dict()
    assert all(torch.equal(exported_w[k], policy_w[k]) for k in policy_w)
    assert any(not torch.equal(base_w[k], policy_w[k]) for k in policy_w)  # three steps moved it
    tok = AutoTokenizer.from_pretrained(repo / "artifacts/model")
    tok.padding_side = "left"
    problems = [json.loads(line)["prompt"]
                for line in (repo / "data/word-problems/eval.jsonl").read_text().splitlines()[:3]]
    chats = [[{"role": "system", "content": "Solve the problem. End your reply with: The answer is N."},
              {"role": "user", "content": p}] for p in problems]
    batch = tok.apply_chat_template(chats, add_generation_prompt=True, padding=True, return_tensors="pt",
                                    return_dict=True)
    replies = [
        tok.batch_decode(m.generate(**batch, max_new_tokens=24,
                                    do_sample=False)[:, batch["input_ids"].shape[1]:],
                         skip_special_tokens=True) for m in (exported, policy)]
    assert replies[0] == replies[1] and all(replies[0])
