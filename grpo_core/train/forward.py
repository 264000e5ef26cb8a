"""The log-prob passes of training: the policy's (with gradients) on a micro-batch, and a frozen model's (old
policy, reference) over a whole round. Options: ``LogprobOptions`` (train's forward keys,
generation.temperature, and the rows per frozen pass)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from grpo_core.common.options import Options, option
from grpo_core.model.loading import model_device
from grpo_core.model.logprobs import ScoringPath, token_logprobs_and_entropy
from grpo_core.train.batching import trim_padding
from grpo_core.train.round import Round


@dataclass
class ForwardOptions(Options):
    """params.yaml `train:` keys of the log-prob passes of policy and reference (and their precision)."""

    forward_backend: Literal["auto", "hf", "manual"] = option(
        "auto", "log-prob passes (reference, old, policy forward/backward): hf = the model's forward; "
        "manual = the hand-written Qwen2/Llama forward (grpo_core/model/fastforward.py, a shared prompt "
        "computed once per group); auto = manual on CPU for a plain model it supports without gradient "
        "checkpointing, else hf")
    padding_free: bool = option(True, "forward_backend manual: only real tokens go through the dense layers "
                                "and the LM head (attention alone sees the padded layout); "
                                "false runs every column")
    fused_lm_head: bool = option(True, "apply the LM head chunk by chunk to the hidden states, so a "
                                 "micro-batch's (rows, tokens, vocab) logits never exist (plain "
                                 "Qwen2/Qwen3/Llama/Mistral heads)")
    trim_padding: bool = option(True, "drop a micro-batch's all-padding columns before its forward passes")
    mixed_precision: Literal["no", "bf16", "fp16"] = option(
        "no", "compute dtype. bf16: full fine-tuning trains and samples on a bf16 copy of the float32 "
        "masters (FSDP2: MixedPrecisionPolicy), LoRA under autocast; fp16: accelerate autocast with loss "
        "scaling; docs/precision.md")
    gradient_checkpointing: bool = option(False, "trade compute for activation memory")
    cast_lm_head_to_fp32: bool = option(False, "policy and reference LM heads compute their logits in "
                                        "float32, outside autocast (TRL's name; the ScaleRL recipe): bf16 "
                                        "logits round log-probs")
    disable_dropout: bool = option(False, "set every dropout module of policy and reference to p = 0 (LoRA's "
                                   "adapter dropout too), so training-mode log-probs match the sampling ones")

    def scoring_path(self) -> ScoringPath:
        """The ``ScoringPath`` these keys ask ``token_logprobs_and_entropy`` for (model/ cannot read them)."""
        return ScoringPath(forward=self.forward_backend, fused_head=self.fused_lm_head,
                           padding_free=self.padding_free)


@dataclass(frozen=True)
class LogprobOptions:
    """How the trainer computes log-probs."""

    forward: ForwardOptions  # train.forward_backend, fused_lm_head, padding_free, trim_padding, ...
    temperature: float       # generation.temperature: the log-probs of the distribution that was sampled
    batch_size: int          # rows per frozen pass (train.per_device_train_batch_size)


def policy_logprobs(model, mb: Round, opts: LogprobOptions, compute_entropy: bool):
    """Per-token log-probs and entropies of a micro-batch's completion tokens.

    Returns logps (B, C'), entropy (B, C') or None, and the completion mask (B, C'): C' is the trimmed width
    (the longest completion of the micro-batch; C with ``trim_padding`` off). Position ids follow the
    attention mask (as ``generate`` does with left padding), so a padded prompt sees the same positions at
    training time as at sampling time.
    """
    f = opts.forward
    if f.trim_padding:  # trimmed on the host: no device sync
        input_ids, attention, mask = trim_padding(mb.prompt_ids, mb.prompt_mask, mb.completion_ids,
                                                  mb.completion_mask)
    else:
        input_ids = torch.cat([mb.prompt_ids, mb.completion_ids], dim=1)
        attention, mask = torch.cat([mb.prompt_mask, mb.completion_mask], dim=1), mb.completion_mask
    device = model_device(model)
    input_ids, attention = input_ids.to(device, non_blocking=True), attention.to(device, non_blocking=True)
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0)
    logps, entropy = token_logprobs_and_entropy(model, input_ids, attention, logits_to_keep=mask.shape[1],
                                                temperature=opts.temperature, compute_entropy=compute_entropy,
                                                position_ids=position_ids, path=f.scoring_path())
    return logps, entropy, mask


@torch.no_grad()
def frozen_logprobs(model, round_: Round, opts: LogprobOptions) -> torch.Tensor:
    """(N, C) float32 on the CPU: the round's completion log-probs under a frozen model (old policy or
    reference), micro-batch by micro-batch, 0 past each micro-batch's trimmed width."""
    n, width = round_.completion_ids.shape
    out = torch.zeros(n, width)
    bs = opts.batch_size
    for start in range(0, n, bs):
        logps, _, _ = policy_logprobs(model, round_.rows(slice(start, min(start + bs, n))), opts,
                                      compute_entropy=False)
        out[start:start + logps.shape[0], :logps.shape[1]] = logps.float().cpu()
    return out
