"""The tiny causal LM: a Qwen2 built from a config (no download), sized by params.yaml `embedded:`."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

# Prompts ≤ 64 tokens + completions ≤ 32 tokens fit with room to spare.
MAX_POSITIONS = 128


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    intermediate_size: int,
    seed: int,
) -> Qwen2ForCausalLM:
    """A freshly initialised Qwen2ForCausalLM (float32) whose vocabulary and special ids match `tokenizer`.

    Initial weights depend only on the arguments: the global torch RNG is seeded here.
    """
    if hidden_size % num_attention_heads:
        raise ValueError(
            f"embedded.hidden_size ({hidden_size}) must be divisible by num_attention_heads "
            f"({num_attention_heads})"
        )
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,  # a small vocabulary: tying halves the embedding parameters
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_sliding_window=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=32,
    )
    return model
