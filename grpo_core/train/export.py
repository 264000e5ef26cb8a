"""The final policy as a model folder anyone can ``from_pretrained``."""

from __future__ import annotations

import torch

from grpo_core.files import write_dir_atomic
from grpo_core.model.loading import is_peft_model


def export_model(policy, tokenizer, model_dir, dtype: torch.dtype) -> None:
    """The policy in ``dtype`` (``model.dtype``), HF format, written to a temp folder then renamed into place.
    Under LoRA: the merged model (base + adapters) with the adapters themselves in ``adapter/``. Casts and, under
    LoRA, merges ``policy`` itself: call it when training is over."""

    def fill(tmp):
        model = policy
        if is_peft_model(model):
            model.save_pretrained(tmp / "adapter", safe_serialization=True)
            tokenizer.save_pretrained(tmp / "adapter")
            model = model.merge_and_unload()
        model.to(dtype).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    write_dir_atomic(model_dir, fill)
