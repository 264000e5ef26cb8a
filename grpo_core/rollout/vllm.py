"""Rollouts through a vLLM engine colocated with the policy (``generation.backend: vllm``; GPU only).

One engine per training process, on that process's GPU, in the same process (vLLM's
``external_launcher`` executor: no server, no weight broadcast). A generation round is

    wake weights -> load the policy's weights (when they changed) -> reset the prefix cache
    -> wake the KV cache -> generate -> sleep (level 2: weights and KV cache released)

so between rounds the GPU memory belongs to training. The engine never samples with stale weights: the
trainer calls ``sync_weights`` after every optimizer step (and after a rollback), which marks the weights
dirty; they are copied at the next ``generate`` — once, however many optimizer steps a round feeds.
Level-2 sleep discards the engine's copy, so with sleep mode on the weights are reloaded every round
(a GPU-to-GPU copy of the parameters, small next to generation).

Sampling follows exactly the distribution the loss's log-probs describe: temperature, top-p, top-k and
nothing else (no repetition penalty or min-p from a hub generation config). With ``return_logprobs`` the engine
also reports each sampled token's log-prob under that processed distribution (``logprobs_mode=
"processed_logprobs"``, as TRL asks for), for the trainer's sampler/trainer mismatch correction.

The engine's interface used here (``LLM``: ``generate``, ``sleep``, ``wake_up``, ``reset_prefix_cache``,
the in-process model's ``load_weights``) is the one TRL 1.16's colocate mode uses (vLLM 0.22–0.31).
``tests/test_vllm_backend.py`` checks this module's side of it against a stand-in engine; a run on a real
GPU with vLLM installed is the check of vLLM's side.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable

import torch

from grpo_core.errors import ConfigurationError
from grpo_core.rollout.types import RolloutBatch, SamplingParams, assemble_batch, left_pad, pad_and_eos_ids

log = logging.getLogger(__name__)


class VLLMUnavailable(ConfigurationError, RuntimeError):
    """The vLLM backend cannot run here (no CUDA policy, vLLM missing, a model layout it cannot take)."""


def check_can_run(model: torch.nn.Module) -> None:
    """Raise VLLMUnavailable naming what is missing; the trainer calls it before any work is done."""
    if hasattr(model, "peft_config"):
        raise VLLMUnavailable("generation.backend: vllm does not take a LoRA-wrapped policy (the engine "
                              "would need merged weights every step); use hf")
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise VLLMUnavailable("generation.backend: vllm needs whole parameters; under FSDP2 the trainer "
                              "hands the engine the whole copy it samples from (grpo_core/train/replica.py), not "
                              "the sharded policy")
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise VLLMUnavailable(f"generation.backend: vllm needs the policy on a CUDA GPU (it is on "
                              f"{device.type}); use auto, hf or manual here")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def build_engine(model: torch.nn.Module, *, gpu_memory_utilization: float, enable_sleep_mode: bool,
                 max_model_length: int | None, seed: int, rank: int = 0, local_rank: int = 0, world_size: int = 1):
    """A vLLM ``LLM`` for ``model``'s architecture, in this process, on this process's GPU."""
    try:
        from vllm import LLM
    except ImportError as err:
        raise VLLMUnavailable("generation.backend: vllm needs the vllm package: "
                              "pip install 'grpo-pipeline[gpu]'") from err
    source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if not source:
        raise VLLMUnavailable("generation.backend: vllm builds its engine from the policy's files, but the "
                              "policy has no name_or_path (it was not loaded with from_pretrained)")
    # external_launcher runs the engine inside this process (its model is then reachable for load_weights)
    # and reads the torch.distributed rendezvous from the environment, as under `accelerate launch`.
    for key, value in (("RANK", rank), ("LOCAL_RANK", local_rank), ("WORLD_SIZE", world_size),
                       ("MASTER_ADDR", "localhost")):
        os.environ.setdefault(key, str(value))
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    return LLM(model=source, dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
               gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
               max_model_len=max_model_length, seed=seed + rank, tensor_parallel_size=1,
               distributed_executor_backend="external_launcher", enable_prefix_caching=True,
               logprobs_mode="processed_logprobs")


def engine_model(llm) -> torch.nn.Module:
    """The engine's in-process model (its ``load_weights`` takes HF parameter names)."""
    executor = llm.llm_engine.model_executor
    worker = executor.driver_worker
    runner = getattr(worker, "model_runner", None) or worker.worker.model_runner
    return runner.model


def vllm_sampling_kwargs(sampling: SamplingParams, num_generations: int, eos_ids: list[int],
                         min_new_tokens: int, logprobs: bool = False) -> dict:
    """``vllm.SamplingParams`` keyword arguments for one round: n samples per prompt, our sampling only (min_p,
    repetition_penalty and ``generation_kwargs`` included); with ``logprobs`` the sampled token's log-prob too
    (``logprobs=0``)."""
    return dict(**({"logprobs": 0} if logprobs else {}),
        n=num_generations, max_tokens=sampling.max_new_tokens, min_tokens=min_new_tokens,
        temperature=sampling.temperature if sampling.do_sample else 0.0,
        top_p=sampling.top_p if sampling.do_sample else 1.0,
        top_k=sampling.top_k if sampling.do_sample and sampling.top_k > 0 else -1,
        repetition_penalty=sampling.repetition_penalty, presence_penalty=0.0, frequency_penalty=0.0,
        min_p=sampling.min_p if sampling.do_sample else 0.0,
        stop_token_ids=list(eos_ids), detokenize=False, **sampling.generation_kwargs,
    )


def completion_tensor(output, eos_ids: list[int]) -> torch.Tensor:
    """One completion's token ids, ending with its EOS when it stopped on one.

    vLLM reports ``finish_reason == "stop"`` for a stop token; whether the token itself is in ``token_ids``
    has varied, and ``assemble_batch`` reads "ended" from the EOS, so it is appended when absent."""
    ids = list(output.token_ids)
    if output.finish_reason == "stop" and (not ids or ids[-1] not in eos_ids):
        stop = output.stop_reason if isinstance(output.stop_reason, int) else eos_ids[0]
        ids.append(stop)
    return torch.tensor(ids, dtype=torch.long).unsqueeze(0)


def sampled_token_logps(outputs, completion_mask: torch.Tensor) -> torch.Tensor:
    """(N, C) float32: each output's log-prob of its sampled tokens (vLLM's ``logprobs``, one dict per token, the
    sampled token's entry among them), NaN where it gave none (a stop token it did not list), 0 on padding."""
    out = torch.full(completion_mask.shape, float("nan"))
    for row, output in enumerate(outputs):
        for col, (token, entries) in enumerate(zip(output.token_ids, output.logprobs or [])):
            entry = entries.get(token) if entries else None
            if entry is not None and col < out.shape[1]:
                out[row, col] = float(entry.logprob)
    return out.masked_fill(completion_mask == 0, 0.0)


class VLLMBackend:
    """``RolloutBackend`` over a colocated vLLM engine (see the module docstring for the phases)."""

    def __init__(self, model: torch.nn.Module, tokenizer, *, gpu_memory_utilization: float = 0.3,
                 enable_sleep_mode: bool = True, max_model_length: int | None = None, seed: int = 0, rank: int = 0,
                 local_rank: int = 0, world_size: int = 1, engine=None, return_logprobs: bool = False):
        """engine: an already-built ``vllm.LLM`` (or a stand-in with its interface); None builds one.
        return_logprobs: batches carry the engine's log-prob of each sampled token (``sampling_logps``)."""
        self.model = model
        self.return_logprobs = return_logprobs
        self.pad_id, self.eos_ids = pad_and_eos_ids(tokenizer)
        self.enable_sleep_mode = enable_sleep_mode
        if engine is None:
            check_can_run(model)
            engine = build_engine(model, gpu_memory_utilization=gpu_memory_utilization,
                                  enable_sleep_mode=enable_sleep_mode, max_model_length=max_model_length,
                                  seed=seed, rank=rank, local_rank=local_rank, world_size=world_size)
        self.llm = engine
        self.weights_stale = True  # the engine loaded the base files; the policy may differ (resume, warm start)
        self.asleep = False
        if enable_sleep_mode:
            self._sleep()
        self.weights_loaded = 0  # rounds that copied the policy's weights into the engine

    # -- phases -------------------------------------------------------------------------------------
    def _sleep(self) -> None:
        self.llm.sleep(level=2)  # weights and KV cache released; level 2 discards the weights' contents
        self.asleep, self.weights_stale = True, True

    def _named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            yield name, param.detach()

    def _load_weights(self) -> None:
        if self.asleep:
            self.llm.wake_up(tags=["weights"])  # map the weight memory before writing into it
        target = engine_model(self.llm)
        with torch.no_grad():
            target.load_weights(self._named_weights())
        self.llm.reset_prefix_cache()  # cached prompt K/V were computed with the old weights
        self.weights_stale = False
        self.weights_loaded += 1
        log.debug("vLLM engine: policy weights copied (%d times so far)", self.weights_loaded)

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model
        self.weights_stale = True

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], num_generations: int, sampling: SamplingParams) -> RolloutBatch:
        from vllm import SamplingParams as VLLMSamplingParams

        if self.weights_stale:
            self._load_weights()
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        min_new = int(getattr(getattr(self.model, "generation_config", None), "min_new_tokens", None) or 0)
        params = VLLMSamplingParams(**vllm_sampling_kwargs(sampling, num_generations, self.eos_ids, min_new,
                                                           logprobs=self.return_logprobs))
        try:
            results = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_ids],
                                        sampling_params=params, use_tqdm=False)
        finally:
            if self.enable_sleep_mode:
                self._sleep()
        if len(results) != len(prompt_ids) or any(len(r.outputs) != num_generations for r in results):
            raise RuntimeError(f"vLLM returned {[len(r.outputs) for r in results]} completions for "
                               f"{len(prompt_ids)} prompts x {num_generations}")
        outputs = [out for r in results for out in r.outputs]
        completions = [completion_tensor(out, self.eos_ids) for out in outputs]
        repeated = [ids for ids in prompt_ids for _ in range(num_generations)]
        ids, mask = left_pad(repeated, self.pad_id)
        batch = assemble_batch(ids, mask, completions, self.pad_id, self.eos_ids)
        if self.return_logprobs:
            batch.sampling_logps = sampled_token_logps(outputs, batch.completion_mask)
        return batch
