"""What every rollout backend shares: sampling parameters, the batch it returns, padding and EOS handling.

Layout: rows are grouped G at a time — rows ``[g*G, (g+1)*G)`` are prompt g's samples — which is the
layout ``compute_advantages`` expects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """This process among the training processes: each process's vLLM engine joins their rendezvous, and rank
    0 alone pushes weights to a vLLM server."""

    rank: int = 0
    local_rank: int = 0  # the process's index on its machine (its GPU)
    world_size: int = 1


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True
    min_p: float = 0.0                  # drop tokens below min_p x the top token's probability (0 = off)
    repetition_penalty: float = 1.0     # HF's: logits of tokens already in the prompt or completion / p
                                        # (x p if < 0)
    # more for HF generate / vLLM (not manual)
    generation_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RolloutBatch:
    """Prompts and sampled completions, padded into rectangles.

    prompt_ids, prompt_mask:         (N, P) left-padded (mask 1 on real tokens)
    completion_ids, completion_mask: (N, C) right-padded; mask 1 up to and including the first EOS
    is_truncated:                    (N,) bool, True when no EOS was produced within max_new_tokens
    sampling_logps:                  (N, C) float32, the sampler's own log-prob of each completion token
                                     (NaN where it gave none, 0 on padding), from backends that report them;
                                     else None
    tool_mask:                       (N, C) long, multi-turn rollouts with tools (rollout/multiturn.py): 1 on
                                     the model's tokens, 0 on the tool/template tokens between its turns and
                                     on padding; None = every completion token is the model's
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    is_truncated: torch.Tensor
    sampling_logps: torch.Tensor | None = None
    tool_mask: torch.Tensor | None = None

    @property
    def model_mask(self) -> torch.Tensor:
        """(N, C) long: the completion tokens the model sampled (tool/template tokens out)."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    @property
    def completion_lengths(self) -> torch.Tensor:
        """(N,) tokens the model sampled per completion (TRL counts the model's tokens only)."""
        return self.model_mask.sum(dim=1)


class RolloutBackend(Protocol):
    def generate(self, prompt_ids: list[list[int]], num_generations: int,
                 sampling: SamplingParams) -> RolloutBatch: ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Called after each optimizer step (an external engine reloads weights here)."""


def pad_and_eos_ids(tokenizer, eos_token_ids: int | list[int] | None = None) -> tuple[int, list[int]]:
    """The pad id (the EOS when the tokenizer has no pad token) and the ids that end a completion
    (``eos_token_ids``, else the tokenizer's EOS). Every rollout backend pads and stops with these."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = eos_token_ids if eos_token_ids is not None else tokenizer.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not eos_ids or pad_id is None:
        raise ValueError("the tokenizer has neither an EOS nor a pad token: generation cannot stop")
    return pad_id, eos_ids


def left_pad(sequences: list[list[int]], pad_id: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, max_len) ids and mask, padded on the left so every prompt ends at the same column.

    multiple: round the width up to a multiple of it (a fixed shape for compiled generation)."""
    width = max(len(s) for s in sequences)
    width = -(-width // multiple) * multiple
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
            mask[i, width - len(seq):] = 1
    return ids, mask


def completion_mask_from_eos(completion_ids: torch.Tensor,
                             eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask up to and including the first EOS; a row without EOS is truncated (mask all ones).

    completion_ids: (N, C) -> mask (N, C) long, is_truncated (N,) bool
    """
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    n, c = completion_ids.shape
    has_eos = is_eos.any(dim=1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1),
                            torch.full((n,), c, device=completion_ids.device))
    positions = torch.arange(c, device=completion_ids.device).expand(n, c)
    mask = (positions <= first_eos.unsqueeze(1)).long()
    return mask, ~has_eos


def assemble_batch(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, outputs: list[torch.Tensor],
                   pad_id: int, eos_ids: list[int]) -> RolloutBatch:
    """A RolloutBatch from per-chunk completion ids (each (n_i, C_i), rows in order): padded to the widest
    chunk, masked up to and including the first EOS, pad after it."""
    width = max(o.shape[1] for o in outputs)
    completion_ids = torch.full((sum(o.shape[0] for o in outputs), width), pad_id, dtype=torch.long)
    row = 0
    for o in outputs:
        completion_ids[row:row + o.shape[0], :o.shape[1]] = o
        row += o.shape[0]
    completion_mask, is_truncated = completion_mask_from_eos(completion_ids, eos_ids)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad_id)
    return RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, is_truncated)


def decode_completions(tokenizer, batch: RolloutBatch) -> list[str]:
    """Completion texts without the EOS and padding (what reward functions read)."""
    texts = []
    for ids, m in zip(batch.completion_ids, batch.completion_mask):
        texts.append(tokenizer.decode(ids[m.bool()].tolist(), skip_special_tokens=True))
    return texts
