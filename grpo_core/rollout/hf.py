"""Rollouts with HF ``generate`` (``generation.backend: hf``, and ``auto`` on CUDA or for models the
hand-written loop cannot run)."""

from __future__ import annotations

import logging

import torch

from grpo_core.rollout.types import RolloutBatch, SamplingParams, assemble_batch, left_pad, pad_and_eos_ids

log = logging.getLogger(__name__)


class HFGenerateBackend:
    """Sampling with ``model.generate``: KV cache, batched, left padding, stops when all rows end."""

    def __init__(self, model: torch.nn.Module, tokenizer, eos_token_ids: list[int] | None = None,
                 max_batch_size: int | None = None, static_cache: bool | None = None,
                 prompt_multiple: int = 64):
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
                    # ours, never a hub model's generation_config's own repetition penalty or min_p
                    repetition_penalty=sampling.repetition_penalty,
                    min_p=sampling.min_p if sampling.do_sample and sampling.min_p > 0 else None,
                    **sampling.generation_kwargs,
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
