"""Build the benchmark's inputs once — model weights, tokenizer, prompts — so both sides load the same files.

The model's ``generation_config.json`` carries ``min_new_tokens = max_completion_length``: EOS is masked
until that many tokens exist, so every completion on both sides is exactly ``max_completion_length``
tokens long (random or barely trained weights would otherwise end rows at random points, and the two
sides would not process the same number of tokens). TRL gets the same setting through
``GRPOConfig.generation_kwargs``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.configs import QWEN25_05B, REPO, BenchConfig


def embedded_sizes(cfg: BenchConfig) -> dict:
    """The tiny model's sizes from params.yaml ``embedded:`` (the embedded default's own), then overrides."""
    import yaml

    from grpo_core.embedded.config import EmbeddedConfig

    sizes = {k: getattr(EmbeddedConfig(), k) for k in
             ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "seed")}
    params = REPO / "params.yaml"
    if params.is_file():
        section = (yaml.safe_load(params.read_text()) or {}).get("embedded") or {}
        sizes.update({k: section[k] for k in sizes if k in section})
    sizes.update(cfg.embedded_overrides)
    return sizes


def build_model_and_tokenizer(cfg: BenchConfig):
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from grpo_core.embedded.model import build_model
    from grpo_core.embedded.tasks import vocabulary_words
    from grpo_core.embedded.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(vocabulary_words())
    tokenizer.padding_side = "left"
    if cfg.model == "embedded":
        sizes = embedded_sizes(cfg)
        model = build_model(tokenizer, hidden_size=sizes["hidden_size"],
                            num_hidden_layers=sizes["num_hidden_layers"],
                            num_attention_heads=sizes["num_attention_heads"],
                            intermediate_size=sizes["intermediate_size"], seed=sizes["seed"])
    elif cfg.model == "qwen2.5-0.5b":
        arch = dict(QWEN25_05B)
        rope_theta = arch.pop("rope_theta")
        config = Qwen2Config(**arch, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, use_sliding_window=False)
        torch.manual_seed(cfg.seed)
        # Built directly in the target dtype (half the memory and time of an fp32 init, then a cast).
        previous = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, cfg.dtype))
        try:
            model = Qwen2ForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
        # Qwen's init (std 0.02) on a 152k vocabulary gives nearly uniform next-token distributions.
    else:
        raise ValueError(f"unknown benchmark model {cfg.model!r}")
    model = model.to(getattr(torch, cfg.dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, min_new_tokens=cfg.max_completion_length,
        max_new_tokens=cfg.max_completion_length, do_sample=True)
    return model, tokenizer


def prompt_rows(cfg: BenchConfig, n: int) -> list[dict]:
    """n distinct embedded-task prompts (arithmetic and multiple choice), deterministic in the seed."""
    from grpo_core.embedded.tasks import generate_splits

    train, _ = generate_splits(n, 1, ["arithmetic", "multiple_choice"], max_operand=99, seed=cfg.seed)
    return [p.row() for p in train[:n]]


def prepare(cfg: BenchConfig, workdir: Path) -> dict:
    """Write model/, train.jsonl under ``workdir``; return what the sides need to know about them."""
    workdir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = build_model_and_tokenizer(cfg)
    model_dir = workdir / "model"
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer.save_pretrained(model_dir)
    # Every step draws new prompts (both trainers sample without replacement within an epoch).
    rows = prompt_rows(cfg, cfg.num_prompts * cfg.steps)
    data = workdir / "train.jsonl"
    with open(data, "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    n_params = sum(p.numel() for p in model.parameters())
    prompt_tokens = [len(tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]) for r in rows]
    return {"model_dir": str(model_dir), "data": str(data), "num_parameters": n_params,
            "vocab_size": model.config.vocab_size, "tokenizer_size": len(tokenizer),
            "mean_prompt_tokens": sum(prompt_tokens) / len(prompt_tokens),
            "architecture": {k: getattr(model.config, k) for k in
                             ("hidden_size", "num_hidden_layers", "num_attention_heads",
                              "num_key_value_heads", "intermediate_size", "vocab_size",
                              "tie_word_embeddings")}}
