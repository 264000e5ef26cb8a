"""Rollouts: G sampled completions per prompt, behind one small interface (``RolloutBackend.generate`` ->
``RolloutBatch``), with the backend chosen here, in one place.

    types.py   SamplingParams, RolloutBatch, RolloutBackend, padding / EOS helpers (what every backend shares)
    hf.py      HFGenerateBackend: HF ``generate``
    manual.py  ManualDecodeBackend: the hand-written Qwen2/Llama decode loop over a preallocated KV buffer
    vllm.py    VLLMBackend: a vLLM engine colocated in each training process (GPU, the ``gpu`` extra)

Backends import ``types`` only; this package's factory imports the backends: one direction, no cycle.
Layout: rows are grouped G at a time - rows ``[g*G, (g+1)*G)`` are prompt g's samples - which is the layout
``compute_advantages`` expects.
"""

from __future__ import annotations

import logging

import torch

from grpo_core.rollout.hf import HFGenerateBackend
from grpo_core.rollout.manual import ManualDecodeBackend, unsupported_reason
from grpo_core.rollout.types import (
    RolloutBackend,
    RolloutBatch,
    SamplingParams,
    assemble_batch,
    completion_mask_from_eos,
    decode_completions,
    left_pad,
    pad_and_eos_ids,
)
from grpo_core.rollout.vllm import VLLMBackend  # light: vllm itself is imported when an engine is built

__all__ = ["HFGenerateBackend", "ManualDecodeBackend", "VLLMBackend", "RolloutBackend", "RolloutBatch", "SamplingParams",
           "assemble_batch", "backend_for", "completion_mask_from_eos", "decode_completions", "default_backend",
           "left_pad", "pad_and_eos_ids"]

log = logging.getLogger(__name__)


def backend_for(model: torch.nn.Module, tokenizer, t, *, rank: int = 0, local_rank: int = 0, world_size: int = 1):
    """The rollout backend ``train.generation_backend`` names, with its options from ``t`` (a TrainConfig):
    the trainer, calibrate and evaluate all sample through this, so they sample the same way."""
    if t.generation_backend != "vllm":  # generation_kwargs: HF generate's, which the hand-written loop cannot take
        choice = "hf" if t.generation_backend == "auto" and t.generation_kwargs else t.generation_backend
        return default_backend(model, tokenizer, choice)
    return default_backend(
        model, tokenizer, "vllm", gpu_memory_utilization=t.vllm_gpu_memory_utilization,
        enable_sleep_mode=t.vllm_enable_sleep_mode, seed=t.seed, rank=rank, local_rank=local_rank,
        world_size=world_size,
        return_logprobs=t.vllm_importance_sampling_correction or t.off_policy_mask_threshold is not None,
        max_model_length=t.max_prompt_length and t.max_prompt_length + t.max_completion_length)


def default_backend(model: torch.nn.Module, tokenizer, choice: str = "auto", **vllm_options):
    """The rollout backend for ``model``, chosen in one place (``train.generation_backend``).

    "auto": the hand-written decode loop (``rollout.manual.ManualDecodeBackend``) for a plain Qwen2/Llama
    model on CPU, where HF ``generate`` costs per-op overhead; ``HFGenerateBackend`` otherwise (on CUDA it
    has its static cache and compiled decode step; PEFT-wrapped, sliding-window or other models).
    "hf": always ``HFGenerateBackend``. "manual": the decode loop, an error for a model it cannot run.
    "vllm": a colocated vLLM engine (``rollout.vllm.VLLMBackend(model, tokenizer, **vllm_options)``;
    CUDA and the ``gpu`` extra; never picked by "auto").
    """
    if choice not in ("auto", "hf", "manual", "vllm"):
        raise ValueError(f"generation backend must be auto, hf, manual or vllm, got {choice!r}")
    if choice == "vllm":
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
