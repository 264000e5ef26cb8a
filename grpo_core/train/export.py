"""The final policy as a model folder anyone can ``from_pretrained``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_core.common.files import write_dir_atomic
from grpo_core.model.loading import is_peft_model, is_quantized
from grpo_core.model.sharding import gather_weights, is_sharded


def export_model(policy, tokenizer, model_dir, dtype: torch.dtype,
                 full_precision_base: Callable[[], torch.nn.Module] | None = None) -> None:
    """The policy in ``dtype`` (``model.dtype``), HF format, written to a temp folder then renamed into place.
    Under LoRA: the merged model (base + adapters) with the adapters themselves in ``adapter/``. Casts and,
    under LoRA, merges ``policy`` itself: call it when training is over.

    Under QLoRA (a 4-bit base) the adapters are merged into the base as it was before quantization, not into
    its 4-bit rounding: ``full_precision_base()`` loads it (``model.dtype``, no quantization config), the
    saved adapters go onto it and are merged. The export is thus what the adapters were trained for plus the
    NF4 rounding error given back, and a plain model anyone can load without bitsandbytes."""

    def fill(tmp):
        model = policy
        if is_peft_model(model):
            model.save_pretrained(tmp / "adapter", safe_serialization=True)
            tokenizer.save_pretrained(tmp / "adapter")
            if is_quantized(model):
                if full_precision_base is None:
                    raise ValueError("export_model: a 4-bit (QLoRA) policy needs full_precision_base to "
                                     "merge into")
                from peft import PeftModel

                model = PeftModel.from_pretrained(full_precision_base(), tmp / "adapter").merge_and_unload()
            else:
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
