"""Switches for measuring one optimisation at a time on our side (``--variant NAME:lever=value,...``).

Each lever is applied inside the side's own process by patching the trainer's modules (``apply``
returns the undo), so production code keeps one path and the benchmark can still turn a lever off to
measure what it is worth. Levers (default = what the trainer does):

  generation     auto/hf/manual/vllm  rollout backend (``train.generation_backend``): HF ``generate``, the
                                  hand-written decode loop of grpo_core/rollout/manual.py (auto = manual on CPU), or a
                                  colocated vLLM engine (grpo_core/rollout/vllm.py; CUDA and the gpu extra)
  forward        auto/hf/manual   forward of the reference/old/policy log-prob passes (``train.forward_backend``):
                                  the HF model's, or the hand-written one of grpo_core/fastforward.py (a group's
                                  shared prompt computed once; auto = manual on CPU)
  static_cache   true/false/null  generation with a static KV cache + compiled decode step (null = CUDA only;
                                  implies generation=hf)
  padding_free   true/false       the hand-written forward runs only real tokens through its matmuls (attention
                                  alone sees the padded layout) and scores only real completion positions
  fused_head     true/false       LM head applied chunk by chunk to hidden states (no (B, K, V) logits)
  trim           true/false       drop the micro-batch's all-padding columns before the forward passes
  fused_adamw    true/false       torch's fused AdamW (one kernel) instead of the per-tensor/foreach one
"""

from __future__ import annotations

from collections.abc import Callable


def apply(variant: dict) -> Callable[[], None]:
    import grpo_core.logprobs as logprobs

    undo: list[Callable[[], None]] = []

    def setattr_undo(obj, name, value):
        old = getattr(obj, name)
        setattr(obj, name, value)
        undo.append(lambda: setattr(obj, name, old))

    if "padding_free" in variant:
        import grpo_core.fastforward as fastforward

        setattr_undo(fastforward, "PADDING_FREE", bool(variant["padding_free"]))
    if "fused_head" in variant:
        setattr_undo(logprobs, "FUSED_LM_HEAD", bool(variant["fused_head"]))
    if "fused_adamw" in variant:
        import grpo_core.trainer as trainer_module

        setattr_undo(trainer_module, "FUSED_ADAMW", bool(variant["fused_adamw"]))
    if variant.get("trim") is False:
        import torch

        import grpo_core.trainer as trainer

        def untrimmed(mb):  # prompt + completion at full padded width
            cm = mb["completion_mask"]
            return (torch.cat([mb["prompt_ids"], mb["completion_ids"]], dim=1),
                    torch.cat([mb["prompt_mask"], cm], dim=1), cm, cm.shape[1])

        setattr_undo(trainer, "_trim", untrimmed)

    def restore() -> None:
        for fn in reversed(undo):
            fn()

    return restore


def backend_factory(variant: dict):
    if "static_cache" in variant:
        from grpo_core.rollout import HFGenerateBackend

        def factory(policy, tokenizer):
            return HFGenerateBackend(policy, tokenizer, static_cache=variant["static_cache"])

        return factory
    if "generation" in variant:
        from grpo_core.rollout import default_backend

        return lambda policy, tokenizer: default_backend(policy, tokenizer, variant["generation"])
    return None
