"""Rollouts: G sampled completions per prompt, behind a small backend interface.

The trainer only sees ``RolloutBackend.generate`` and ``RolloutBatch``: HF ``generate`` here, the hand-written
decode loop (``decode.py``) and a colocated vLLM engine (``vllm_backend.py``) behind the same interface.

Layout: rows are grouped G at a time — rows ``[g*G, (g+1)*G)`` are prompt g's samples — which is the
layout ``compute_advantages`` expects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    do_sample: bool = True


@dataclass
class RolloutBatch:
    """Prompts and sampled completions, padded into rectangles.

    prompt_ids, prompt_mask:         (N, P) left-padded (mask 1 on real tokens)
    completion_ids, completion_mask: (N, C) right-padded; mask 1 up to and including the first EOS
    is_truncated:                    (N,) bool, True when no EOS was produced within max_new_tokens
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    is_truncated: torch.Tensor

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(dim=1)


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


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask up to and including the first EOS; a row without EOS is truncated (mask all ones).

    completion_ids: (N, C) -> mask (N, C) long, is_truncated (N,) bool
    """
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    n, c = completion_ids.shape
    has_eos = is_eos.any(dim=1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full((n,), c, device=completion_ids.device))
    positions = torch.arange(c, device=completion_ids.device).expand(n, c)
    mask = (positions <= first_eos.unsqueeze(1)).long()
    return mask, ~has_eos


def assemble_batch(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, outputs: list[torch.Tensor], pad_id: int,
                   eos_ids: list[int]) -> RolloutBatch:
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


class HFGenerateBackend:
    """Sampling with ``model.generate``: KV cache, batched, left padding, stops when all rows end."""

    def __init__(self, model: torch.nn.Module, tokenizer, eos_token_ids: list[int] | None = None,
                 max_batch_size: int | None = None, static_cache: bool | None = None, prompt_multiple: int = 64):
        """static_cache: a static KV cache, with which ``generate`` compiles the decode step (CUDA graphs);
        None = on CUDA only (on CPU compiling does not pay). Prompts are then left-padded to a multiple of
        ``prompt_multiple`` so the cache — and the compiled graph — keeps its shape from round to round."""
        self.model = model
        self.static_cache = static_cache
        self.prompt_multiple = prompt_multiple
        self.pad_id, self.eos_ids = pad_and_eos_ids(tokenizer, eos_token_ids)
        self.max_batch_size = max_batch_size

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model  # same process, same weights: nothing to copy

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], num_generations: int,
                 sampling: SamplingParams) -> RolloutBatch:
        repeated = [ids for ids in prompt_ids for _ in range(num_generations)]
        device = next(self.model.parameters()).device
        static = self.static_cache if self.static_cache is not None else device.type == "cuda"
        ids, mask = left_pad(repeated, self.pad_id, multiple=self.prompt_multiple if static else 1)
        step = self.max_batch_size or len(repeated)
        outputs = []
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(repeated), step):
                chunk_ids = ids[start:start + step].to(device)
                chunk_mask = mask[start:start + step].to(device)
                kwargs = dict(
                    input_ids=chunk_ids, attention_mask=chunk_mask,
                    max_new_tokens=sampling.max_new_tokens, do_sample=sampling.do_sample,
                    temperature=sampling.temperature if sampling.do_sample else None,
                    top_p=sampling.top_p if sampling.do_sample else None,
                    top_k=sampling.top_k if sampling.do_sample else None,
                    pad_token_id=self.pad_id, eos_token_id=self.eos_ids,
                    # A hub model's generation_config may carry its own repetition penalty or min_p;
                    # sampling must follow exactly the distribution the loss's log-probs describe.
                    repetition_penalty=1.0, min_p=None,
                )
                if static:
                    try:
                        out = self.model.generate(**kwargs, cache_implementation="static")
                    except Exception as err:  # a model or torch build that cannot compile: sample without it
                        log.warning("static-cache generation failed (%s: %s); using the dynamic cache",
                                    type(err).__name__, err)
                        self.static_cache = static = False
                        out = self.model.generate(**kwargs)
                else:
                    out = self.model.generate(**kwargs)
                outputs.append(out[:, chunk_ids.shape[1]:].cpu())
        finally:
            self.model.train(was_training)
        return assemble_batch(ids, mask, outputs, self.pad_id, self.eos_ids)


def decode_completions(tokenizer, batch: RolloutBatch) -> list[str]:
    """Completion texts without the EOS and padding (what reward functions read)."""
    texts = []
    for ids, m in zip(batch.completion_ids, batch.completion_mask):
        texts.append(tokenizer.decode(ids[m.bool()].tolist(), skip_special_tokens=True))
    return texts


def backend_for(model: torch.nn.Module, tokenizer, t, *, rank: int = 0, local_rank: int = 0, world_size: int = 1):
    """The rollout backend ``train.generation_backend`` names, with its options from ``t`` (a TrainConfig):
    the trainer, calibrate and evaluate all sample through this, so they sample the same way."""
    if t.generation_backend != "vllm":
        return default_backend(model, tokenizer, t.generation_backend)
    return default_backend(
        model, tokenizer, "vllm", gpu_memory_utilization=t.vllm_gpu_memory_utilization,
        enable_sleep_mode=t.vllm_enable_sleep_mode, seed=t.seed, rank=rank, local_rank=local_rank,
        world_size=world_size,
        max_model_length=t.max_prompt_length and t.max_prompt_length + t.max_completion_length)


def default_backend(model: torch.nn.Module, tokenizer, choice: str = "auto", **vllm_options):
    """The rollout backend for ``model``, chosen in one place (``train.generation_backend``).

    "auto": the hand-written decode loop (``grpo_core.decode.ManualDecodeBackend``) for a plain Qwen2/Llama
    model on CPU, where HF ``generate`` costs per-op overhead; ``HFGenerateBackend`` otherwise (on CUDA it
    has its static cache and compiled decode step; PEFT-wrapped, sliding-window or other models).
    "hf": always ``HFGenerateBackend``. "manual": the decode loop, an error for a model it cannot run.
    "vllm": a colocated vLLM engine (``grpo_core.vllm_backend.VLLMBackend(model, tokenizer, **vllm_options)``;
    CUDA and the ``gpu`` extra; never picked by "auto").
    """
    from grpo_core.decode import ManualDecodeBackend, unsupported_reason

    if choice not in ("auto", "hf", "manual", "vllm"):
        raise ValueError(f"generation backend must be auto, hf, manual or vllm, got {choice!r}")
    if choice == "vllm":
        from grpo_core.vllm_backend import VLLMBackend

        return VLLMBackend(model, tokenizer, **vllm_options)
    if choice == "manual":
        return ManualDecodeBackend(model, tokenizer)
    if choice == "auto":
        device = next(model.parameters()).device
        reason = unsupported_reason(model) if device.type == "cpu" else f"device {device.type}"
        if reason is None:
            return ManualDecodeBackend(model, tokenizer)
        log.debug("generation with HF generate (%s)", reason)
    return HFGenerateBackend(model, tokenizer)
