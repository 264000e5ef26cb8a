"""A learned reward model as a reward function: a sequence-classification model (a local folder or a hub id)
scores prompt + completion as TRL's ``reward_funcs=<model>`` does.

    chat prompts    the model's own chat template over prompt messages + the completion message (no generation
                    prompt); plain prompts: prompt + completion as text
    tokenized       by the model's own tokenizer, right-padded, no special tokens added (the template has
                    them); the pad token is EOS when the tokenizer has none, and the model's config is told
                    which it is, since a classifier reads the last non-pad token
    reward          logits[:, 0], batch_size texts per forward, under inference mode
"""

from __future__ import annotations

from typing import Any

from grpo_core.rewards.base import RewardFunction, RewardValue, named


def _texts(tokenizer, prompts: list, completions: list) -> list[str]:
    texts = []
    for prompt, completion in zip(prompts, completions, strict=True):
        if isinstance(prompt, list):  # chat messages: the completion is one assistant message (or its text)
            reply = (completion if isinstance(completion, list)
                     else [{"role": "assistant", "content": completion}])
            texts.append(tokenizer.apply_chat_template(prompt + reply, tokenize=False))
        else:
            texts.append(prompt + (completion if isinstance(completion, str) else completion[0]["content"]))
    return texts


def reward_model(model: str, batch_size: int = 16, max_length: int | None = None, dtype: str = "float32",
                 trust_remote_code: bool = False) -> RewardFunction:
    """logits[:, 0] of the sequence classifier ``model`` (a folder, or a hub id) on each prompt + completion.
    max_length: truncate longer texts (from the right); None keeps them whole."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from grpo_core.model.loading import compute_device

    tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    classifier = AutoModelForSequenceClassification.from_pretrained(
        model, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code).eval().to(compute_device())
    if classifier.config.num_labels < 1:
        raise ValueError(f"reward_model: {model} has no output label to read a reward from")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    classifier.config.get_text_config().pad_token_id = tokenizer.pad_token_id

    def reward(prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]:
        texts = _texts(tokenizer, list(prompts), list(completions))
        out: list[RewardValue] = []
        for start in range(0, len(texts), batch_size):
            inputs = tokenizer(text=texts[start:start + batch_size], return_tensors="pt", padding=True,
                               padding_side="right", add_special_tokens=False,
                               truncation=max_length is not None, max_length=max_length).to(classifier.device)
            with torch.inference_mode():
                out += classifier(**inputs).logits[:, 0].float().tolist()
        return out

    return named(reward, "reward_model")
