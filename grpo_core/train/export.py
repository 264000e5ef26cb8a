"""The final policy as a model folder anyone can ``from_pretrained``."""

from __future__ import annotations

import torch

from grpo_core.files import write_dir_atomic
from grpo_core.model.loading import is_peft_model
from grpo_core.model.sharding import gather_weights, is_sharded


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


def whole_model(policy: torch.nn.Module, replica: torch.nn.Module | None = None) -> torch.nn.Module | None:
    """What to export at the end of training: the policy itself when it is whole; a sharded run's replica (its
    whole copy, synced after the last step); else (sharded, sampling through vLLM: no replica) a whole model
    built on the main process from the shards, gathered there (collective: every process calls it; None on the
    others)."""
    if replica is not None or not is_sharded(policy):
        return replica if replica is not None else policy
    from transformers import AutoModelForCausalLM

    weights = gather_weights(policy)  # rank 0: every weight, whole, in CPU memory; {} elsewhere
    if not weights:
        return None
    model = AutoModelForCausalLM.from_config(policy.config)
    model.load_state_dict(weights)
    return model
