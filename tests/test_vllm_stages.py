"""evaluate through the real vLLM engine (``generation.backend: vllm``): each policy - base, then trained - is
sampled by an engine started for it from its own folder and stopped after it (``VLLMBackend.close``), greedy
and sampled modes alike. A module of its own: the engines here start and stop while no other engine lives in
the process (tests/test_vllm_engine.py's is stopped when its module ends)."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_core.config import config_from_dict
from grpo_core.data.loading import PromptEncoder
from grpo_core.rollout import HFGenerateBackend, SamplingParams
from grpo_core.rollout.types import decode_completions
from tests.tiny import make_prompts, make_tiny_model, require_vllm, tiny_config

DIGITS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]


def test_evaluate_samples_base_and_trained_each_through_an_engine_of_its_own(tmp_path):
    require_vllm()
    import flows.stages.evaluate as evaluate

    base = make_tiny_model(tmp_path / "base", hidden_size=64, heads=2)
    trained = make_tiny_model(tmp_path / "trained", hidden_size=64, heads=2, seed=1)  # other weights
    data = make_prompts(tmp_path / "eval.jsonl", n=4)
    raw = tiny_config(base, data, DIGITS, generation_backend="vllm").to_dict()
    raw.pop("embedded")
    raw["evaluate"].update(num_generations=2, pass_k=[1, 2])
    inp = evaluate.stage_inputs(config_from_dict(raw))
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    greedy = {}
    for policy, folder in (("base", base), ("trained", trained)):
        model_cfg = dataclasses.replace(inp.model, name_or_path=str(folder))
        records = evaluate.sample_policy(policy, model_cfg, inp, SimpleNamespace(root=tmp_path), rows,
                                         [0, 1, 2, 3])
        modes = [r["mode"] for r in records]
        assert modes.count("greedy") == 4 and modes.count("sampled") == 8
        greedy[policy] = [r["completion"] for r in records if r["mode"] == "greedy"]
        assert not torch.distributed.is_initialized()  # the policy's engine was stopped, its group with it
    # each engine sampled its own policy: greedy completions equal HF generate's from that folder (that the
    # engine's weights are the policy's, token for token, is tests/test_vllm_engine.py's)
    for policy, folder in (("base", base), ("trained", trained)):
        model, tok = (AutoModelForCausalLM.from_pretrained(folder).eval(),
                      AutoTokenizer.from_pretrained(folder))
        encoder = PromptEncoder.from_config(tok, inp.data)
        prompt_ids = [encoder.encode(row["prompt"]) for row in rows]
        batch = HFGenerateBackend(model, tok).generate(
            prompt_ids, 1,
            SamplingParams(max_new_tokens=inp.generation.max_completion_length, do_sample=False))
        assert greedy[policy] == decode_completions(tok, batch)


@pytest.mark.slow
def test_embedded_vllm_recipe_runs_under_dvc_repro(tmp_path):
    """README's `cp configs/embedded-vllm.yaml params.yaml && dvc repro` in a fresh clone, sizes scaled down
    as tests/test_pipeline.py scales the default (its hidden size 32 over 1 head: head size 32, as the
    recipe's 96 over 3). Every stage that samples did so through the engine: training logged the sampler
    correction, which only an engine's own log-probs give; calibrate's and evaluate's reports name the backend
    they sampled through."""
    require_vllm()
    from tests.test_pipeline import TINY, dvc, make_clone

    repo = make_clone(tmp_path / "repo")
    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs/embedded-vllm.yaml").read_text())
    for section, values in TINY.items():
        raw[section].update(values)
    raw["embedded"]["num_attention_heads"] = 1
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    out = dvc(repo, "repro", timeout=900)
    log = out.stdout + out.stderr
    for stage in ("prepare", "validate", "calibrate", "train", "evaluate"):
        assert f"Running stage '{stage}'" in log
    for report in ("calibration", "evaluation"):  # each report names the backend its stage sampled through
        assert "| backend | vllm | generation |" in (repo / f"reports/{report}.md").read_text()
    assert "Failed to load weights" not in log
    rows = list(csv.DictReader((repo / "metrics/train_log.csv").open()))
    assert len(rows) == TINY["train"]["max_steps"]
    assert all(float(row["sampling/importance_sampling_ratio/mean"]) > 0 for row in rows)
    metrics = json.loads((repo / "metrics/eval.json").read_text())
    assert metrics["trained"]["num_prompts"] == TINY["evaluate"]["max_samples"]
    assert dvc(repo, "status").stdout.strip().endswith("Data and pipelines are up to date.")


def test_the_engine_runs_in_model_dtype_from_float32_masters(tmp_path):
    """The trainer's weights are float32 masters; the engine is built and fed in model.dtype (backend_for's
    dtype: the trainer passes model.dtype), bfloat16 here, so sampling costs what a bf16 model costs."""
    require_vllm()
    from grpo_core.rollout import GenerationConfig, backend_for
    from grpo_core.rollout.vllm import engine_dtype, engine_weights

    folder = make_tiny_model(tmp_path / "model", hidden_size=64, heads=2)
    policy, tok = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    assert next(policy.parameters()).dtype == torch.float32
    backend = backend_for(policy, tok, GenerationConfig(backend="vllm", max_completion_length=8), seed=0,
                          max_prompt_length=48, dtype=torch.bfloat16)
    try:
        assert engine_dtype(backend.llm) == torch.bfloat16
        assert {t.dtype for _, t in engine_weights(policy, engine_dtype(backend.llm))} == {torch.bfloat16}
        batch = backend.generate([[5, 9, 11]], 2, SamplingParams(max_new_tokens=8, do_sample=True))
        assert batch.completion_mask.sum() > 0 and backend.weights_loaded == 1
    finally:
        backend.close()
