"""Per-token log-probabilities and entropies of sampled tokens, computed in chunks of rows.

The (B, T, V) logits of a language model are large (V ~ 1e5); a full float32 log-softmax of them can
cost more memory than the model. Every function here walks the flattened (B*T, V) rows ``chunk_size``
at a time. When gradients are needed each chunk runs under activation checkpointing, so autograd keeps
only the chunk's input (a view of the logits) and recomputes the chunk's softmax in backward, instead of
keeping every chunk's float32 intermediates alive until then.

Semantics follow TRL 1.16: ``selective_log_softmax`` and ``entropy_from_logits`` as in
``trl.trainer.utils``, ``token_logprobs_and_entropy`` as ``GRPOTrainer._get_per_token_logps_and_entropies``
(temperature-scaled logits, fp32 arithmetic for half-precision models, 0 at padded positions).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from grpo_core.model.fastforward import hidden_states, use_manual_forward
from grpo_core.model.loading import AdapterDisabledReference, Float32Head

DEFAULT_CHUNK_SIZE = 256  # rows of V logits per chunk: 256 x 152k vocab x 4 bytes ~ 156 MB in float32
HALF_DTYPES = (torch.float16, torch.bfloat16)


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """log softmax(logits / temperature)[index] without materialising the full log-softmax.

    Args:
        logits: (..., V), e.g. (B, T, V).
        index: (...) token ids, e.g. (B, T).
        temperature: logits are divided by it first (> 0).
        chunk_size: rows of V logits processed at once.

    Returns:
        (...) log-probs in the dtype of ``logits``.
        fp32/fp64: logit[index] - logsumexp(logits)  (exact, no (rows, V) log-softmax kept).
        fp16/bf16: gather from F.log_softmax per chunk, as TRL (logsumexp is unstable in bf16).
    """
    _check_logits_and_index(logits, index)
    _check_positive("temperature", temperature)
    _check_chunk_size(chunk_size)
    flat_logits, flat_index = logits.reshape(-1, logits.shape[-1]), index.reshape(-1)
    gather = _gather_log_softmax_half if logits.dtype in HALF_DTYPES else _gather_logsumexp
    per_chunk = [
        _maybe_checkpoint(gather, logits_chunk, index_chunk, temperature)
        for logits_chunk, index_chunk in zip(flat_logits.split(chunk_size), flat_index.split(chunk_size))
    ]
    return _concat_rows(per_chunk, logits).reshape(index.shape)


def entropy_from_logits(
    logits: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE, temperature: float = 1.0
) -> torch.Tensor:
    """Shannon entropy in nats of softmax(logits / temperature), row by row: (..., V) -> (...).

    H = -sum_v p_v log p_v, computed from log_softmax in the dtype of ``logits`` (TRL's
    ``entropy_from_logits``), ``chunk_size`` rows at a time.
    """
    _check_positive("temperature", temperature)
    _check_chunk_size(chunk_size)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    per_chunk = [_maybe_checkpoint(_entropy, chunk, temperature) for chunk in flat_logits.split(chunk_size)]
    return _concat_rows(per_chunk, logits).reshape(logits.shape[:-1])


@dataclass(frozen=True)
class ScoringPath:
    """How ``token_logprobs_and_entropy`` runs the model and its LM head (``ForwardOptions`` builds one)."""

    chunk_size: int = DEFAULT_CHUNK_SIZE  # rows of V logits processed at once
    # "hf": the model's own forward; "manual": fastforward's hand-written Qwen2/Llama forward (same numbers,
    # fewer ops; an error for a model it cannot run); "auto": manual where ``use_manual_forward`` says so.
    forward: str = "hf"
    # The LM head applied chunk by chunk inside the model's own forward, so the (B, K, V) logits never exist
    # (``train.fused_lm_head``; only plain Qwen2/Qwen3/Llama/Mistral heads, see ``scoring_head``).
    fused_head: bool = True
    padding_free: bool = True  # the manual forward runs and scores only real tokens (``train.padding_free``)


def token_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    position_ids: torch.Tensor | None = None,
    path: ScoringPath = ScoringPath(),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the last ``logits_to_keep`` tokens of input_ids under a causal LM.

    Args:
        model: a causal LM returning ``.logits`` (B, L', V) (HF ``*ForCausalLM``, PEFT wrapped or not).
        input_ids: (B, L) prompt + completion token ids, completion = the last logits_to_keep columns.
        attention_mask: (B, L) 1 for real tokens, 0 for padding.
        logits_to_keep: K, number of completion positions to score (>= 1).
        temperature: the sampling temperature; logits are divided by it, so the log-probs are those of
            the distribution the completions were sampled from.
        compute_entropy: also return the entropy of each position's next-token distribution.
        position_ids: optional (B, L) positions (padding-free packing); passed through to the model.
        path: which forward runs and how (chunk size, hf or manual forward, fused LM head, padding-free).

    Returns:
        (logps (B, K), entropies (B, K) or None): position j scores input_ids[:, L-K+j] with the logits
        of position L-K+j-1. Computed in float32 for half-precision models (TRL 1.16's fused LM head
        does the same), otherwise in the logits' dtype. 0 where attention_mask is 0, as TRL 1.16.
    """
    _check_scoring_arguments(input_ids, attention_mask, logits_to_keep, position_ids, temperature)
    if isinstance(model, AdapterDisabledReference):  # the LoRA reference: the policy, adapters off,
                                                     # scored the
        with model.adapters_off():                # policy's way (fused head, logits_to_keep), not full logits
            return token_logprobs_and_entropy(model.policy, input_ids, attention_mask, logits_to_keep,
                                              temperature, compute_entropy, position_ids, path)
    model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if position_ids is not None:
        model_inputs["position_ids"] = position_ids
    completion_ids = input_ids[:, -logits_to_keep:]                             # (B, K)
    scoring = (temperature, compute_entropy, path.chunk_size)
    head = scoring_head(model) if path.fused_head else None
    if path.forward != "hf" and use_manual_forward(model, path.forward):
        logps, entropies = _manual_forward_logps(model, input_ids, attention_mask, position_ids,
                                                 logits_to_keep, scoring, path.padding_free)
    elif head is not None:
        logps, entropies = _head_scored_logps(model, head, model_inputs, completion_ids, scoring)
    else:
        logps, entropies = _full_logits_logps(model, model_inputs, completion_ids, scoring)
    is_padding = attention_mask[:, -logits_to_keep:] == 0                       # (B, K)
    logps = logps.masked_fill(is_padding, 0.0)
    if entropies is not None:
        entropies = entropies.masked_fill(is_padding, 0.0)
    return logps, entropies


def _check_scoring_arguments(input_ids, attention_mask, logits_to_keep, position_ids, temperature) -> None:
    """Raise ValueError naming the first argument of ``token_logprobs_and_entropy`` out of contract."""
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 1:
        raise ValueError(f"logits_to_keep must be an int >= 1, got {logits_to_keep!r}")
    if input_ids.ndim != 2 or logits_to_keep >= input_ids.shape[1]:
        raise ValueError(
            f"input_ids must be (B, L) with L > logits_to_keep={logits_to_keep} (a prompt token precedes the "
            f"first completion token), got shape {tuple(input_ids.shape)}"
        )
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got "
            f"{tuple(attention_mask.shape)}"
        )
    if position_ids is not None and tuple(position_ids.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"position_ids must have the shape of input_ids {tuple(input_ids.shape)}, got "
            f"{tuple(position_ids.shape)}"
        )
    _check_positive("temperature", temperature)


def _manual_forward_logps(model, input_ids, attention_mask, position_ids, logits_to_keep: int, scoring: tuple,
                          padding_free: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The hand-written forward's final hidden states through the LM head, chunk by chunk
    (``_head_scored_logps``).

    The last token only predicts beyond the sequence: it is left out. The prompt columns are computed once per
    distinct prompt (the G rows of a group share them). Padding-free: only the real completion positions are
    scored (packed rows), then put back in place. -> (B, K) log-probs, entropies or None.
    """
    L = input_ids.shape[1]
    completion_ids = input_ids[:, -logits_to_keep:]                             # (B, K)
    real = attention_mask[:, -logits_to_keep:].bool() if padding_free else None  # (B, K)
    hidden = hidden_states(model, input_ids[:, :-1], attention_mask[:, :-1],
                           None if position_ids is None else position_ids[:, :-1], prefix=L - logits_to_keep,
                           rows=real, padding_free=padding_free)               # (B, K, D), or (real.sum(), D)
    logps, entropies = _chunked_head_logps_and_entropy(
        hidden, model.lm_head, completion_ids if real is None else completion_ids[real], *scoring
    )
    if real is not None:
        logps, entropies = (None if t is None else t.new_zeros(real.shape).masked_scatter(real, t)
                            for t in (logps, entropies))
    return logps, entropies


def _head_scored_logps(model: torch.nn.Module, head: torch.nn.Linear, model_inputs: dict,
                       completion_ids: torch.Tensor,
                       scoring: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused LM head inside the model's own forward: the (B, K, V) logits never exist, forward or backward.

    The model's forward runs as it is (accelerate's autocast and fp32-output wrapper, DDP's reducer, FSDP2's
    unsharding of the root's weights, a LoRA policy's adapters), with ``logits_to_keep = K + 1``; only for
    this call its LM head (the same module, so hooks, parameters and their identity are untouched) scores
    instead of projecting: it takes the last K + 1 hidden states and returns (B, K, 2) log-probs and entropies
    ((B, K, 1) without entropy), the head's weight read inside the forward (FSDP2: the gathered one) and
    applied chunk by chunk, each chunk recomputed in backward (``_chunked_head_logps_and_entropy``). The
    head's own forward is restored however the call ends.
    """
    temperature, compute_entropy, chunk_size = scoring

    # (B, K + 1, H); the last position predicts past the sequence
    def score(hidden: torch.Tensor) -> torch.Tensor:
        logps, entropies = _chunked_head_logps_and_entropy(hidden[:, :-1], head, completion_ids, *scoring)
        return torch.stack((logps, entropies), dim=-1) if compute_entropy else logps.unsqueeze(-1)

    head.forward = score  # an instance attribute: nn.Module.__call__ (and every hook on the head) still runs
    try:
        scores = model(**model_inputs, logits_to_keep=completion_ids.shape[1] + 1, use_cache=False).logits
    finally:
        del head.forward  # the class's forward again
    return scores[..., 0], (scores[..., 1] if compute_entropy else None)


def _full_logits_logps(model: torch.nn.Module, model_inputs: dict, completion_ids: torch.Tensor,
                       scoring: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's own forward and its logits, scored chunk by chunk."""
    logits_to_keep = completion_ids.shape[1]
    if _accepts_logits_to_keep(model):
        # One extra position: the logits at L-K-1 predict the first completion token.
        model_inputs = {**model_inputs, "logits_to_keep": logits_to_keep + 1}
    logits = model(**model_inputs).logits  # (B, K+1, V), or (B, L, V) without logits_to_keep
    # Drop the last position (it predicts the token after the sequence), keep the K that predict completions.
    logits = logits[:, :-1][:, -logits_to_keep:]  # (B, K, V)
    # Half-precision logits are upcast one chunk at a time: the per-token numbers match TRL's fused head
    # (fp32) and the full (B, K, V) float32 copy never exists.
    return _chunked_logps_and_entropy(logits, completion_ids, *scoring)


def _chunked_logps_and_entropy(
    logits: torch.Tensor, index: torch.Tensor, temperature: float, compute_entropy: bool, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, K, V), (B, K) -> log-probs (B, K) and entropies (B, K) or None, fp32 for half logits."""
    kernel = _logps_and_entropy_upcast if compute_entropy else _logps_upcast
    return _by_chunks(kernel, logits, index, (temperature,), compute_entropy, chunk_size, empty_like=logits)


def _chunked_head_logps_and_entropy(
    hidden: torch.Tensor, head: torch.nn.Linear, index: torch.Tensor, temperature: float,
    compute_entropy: bool, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, K, H) hidden states through the LM head chunk by chunk -> log-probs (B, K), entropies
    (B, K) or None."""
    kernel = _head_logps_and_entropy if compute_entropy else _head_logps
    if isinstance(head, Float32Head):  # train.cast_lm_head_to_fp32: the logits in float32, outside autocast
        kernel = _in_float32(kernel)
    return _by_chunks(kernel, hidden, index, (head.weight, head.bias, temperature), compute_entropy,
                      chunk_size, empty_like=hidden.new_zeros(0, 1))


def _in_float32(kernel: Callable) -> Callable:
    def float32_kernel(hidden, index, weight, bias, temperature):
        with torch.autocast(hidden.device.type, enabled=False):
            return kernel(hidden.float(), index, weight.float(), None if bias is None else bias.float(),
                          temperature)
    return float32_kernel


def _by_chunks(kernel: Callable, rows: torch.Tensor, index: torch.Tensor, args: tuple, compute_entropy: bool,
               chunk_size: int, empty_like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``kernel(rows_chunk, index_chunk, *args)`` over (B, K, D) rows ``chunk_size`` at a time (checkpointed
    under autograd) -> log-probs (B, K) and, with ``compute_entropy``, entropies (B, K); ``empty_like`` sets
    the dtype of an empty result."""
    _check_chunk_size(chunk_size)
    flat_rows, flat_index = rows.reshape(-1, rows.shape[-1]), index.reshape(-1)
    logps_chunks, entropy_chunks = [], []
    for rows_chunk, index_chunk in zip(flat_rows.split(chunk_size), flat_index.split(chunk_size)):
        result = _maybe_checkpoint(kernel, rows_chunk, index_chunk, *args)
        if compute_entropy:
            logps_chunks.append(result[0])
            entropy_chunks.append(result[1])
        else:
            logps_chunks.append(result)
    logps = _concat_rows(logps_chunks, empty_like, upcast=True).reshape(index.shape)
    entropies = (_concat_rows(entropy_chunks, empty_like, upcast=True).reshape(index.shape) if compute_entropy
                 else None)
    return logps, entropies


def _head_logps(hidden, index, weight, bias, temperature):
    return _logps_upcast(F.linear(hidden, weight, bias), index, temperature)


def _head_logps_and_entropy(hidden, index, weight, bias, temperature):
    return _logps_and_entropy_upcast(F.linear(hidden, weight, bias), index, temperature)


# Causal LMs whose forward is exactly lm_head(backbone(...).last_hidden_state): no logit scaling or
# soft-capping.
_PLAIN_HEAD_MODEL_TYPES = {"qwen2", "qwen3", "llama", "mistral"}


def scoring_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The LM head whose forward ``token_logprobs_and_entropy`` replaces by chunked scoring for one call, or
    None (the logits path).

    Only for the plain architectures above (their forward returns ``lm_head(hidden[:, -logits_to_keep:])`` as
    the logits, untouched), looked up through DDP and PEFT wrappers, with a plain ``nn.Linear`` or
    ``Float32Head`` head (no adapter on it, no patched forward of its own), and no patched model forward other
    than accelerate's autocast wrapper (which only casts the output to float32: the scores already are).
    """
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    base = _unwrapped(model)
    config = getattr(base, "config", None)
    if getattr(config, "model_type", None) not in _PLAIN_HEAD_MODEL_TYPES:
        return None
    for m in {id(m): m for m in (model, inner, base)}.values():
        # patched, not by accelerate
        if "forward" in vars(m) and getattr(m, "_original_forward", None) is None:
            return None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if type(head) not in (torch.nn.Linear, Float32Head) or "forward" in vars(head):
        return None
    return head


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM inside DDP and PEFT wrappers (an FSDP2-sharded model is its own class's subclass)."""
    if isinstance(model, DistributedDataParallel):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# --- per-chunk kernels: (rows, V) logits -> (rows,) ---------------------------------------------------------


def _gather_logsumexp(logits: torch.Tensor, index: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(index) = z[index] - logsumexp(z),  z = logits / temperature."""
    scaled = logits / temperature if temperature != 1.0 else logits
    return scaled.gather(-1, index.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


def _gather_log_softmax_half(logits: torch.Tensor, index: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(z)[index] in the half dtype itself (TRL's path for bf16/fp16)."""
    scaled = logits / temperature if temperature != 1.0 else logits
    return F.log_softmax(scaled, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


def _entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """H = -sum_v p_v log p_v with log p = log_softmax(logits / temperature)."""
    scaled = logits / temperature if temperature != 1.0 else logits
    log_probs = F.log_softmax(scaled, dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def _logps_upcast(logits: torch.Tensor, index: torch.Tensor, temperature: float) -> torch.Tensor:
    return _gather_logsumexp(_upcast(logits), index, temperature)


def _logps_and_entropy_upcast(
    logits: torch.Tensor, index: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One log-softmax of the chunk serves both: log p(index) and H = -sum_v p_v log p_v."""
    scaled = _upcast(logits)
    scaled = scaled / temperature if temperature != 1.0 else scaled
    log_probs = F.log_softmax(scaled, dim=-1)
    logps = log_probs.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return logps, -(log_probs.exp() * log_probs).sum(-1)


# --- helpers ------------------------------------------------------------------------------------------------


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    return logits.float() if logits.dtype in HALF_DTYPES else logits


def _maybe_checkpoint(function: Callable, *args):
    """function(*args), recomputed in backward rather than stored, when a gradient will be needed.

    No RNG state is saved: the chunk kernels are deterministic, and saving it costs a device query.
    """
    if torch.is_grad_enabled() and args[0].requires_grad:
        return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False)
    return function(*args)


def _concat_rows(chunks: list[torch.Tensor], logits: torch.Tensor, upcast: bool = False) -> torch.Tensor:
    """Concatenate per-chunk (rows,) results; an empty (0-row) input gives an empty result."""
    if chunks:
        return torch.cat(chunks)
    dtype = _upcast(logits[:0]).dtype if upcast else logits.dtype
    return torch.zeros(0, dtype=dtype, device=logits.device)


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (HF causal LMs do); looks through DDP and PEFT
    wrappers and a patched forward (its class's forward)."""
    return "logits_to_keep" in inspect.signature(type(_unwrapped(model)).forward).parameters


def _check_logits_and_index(logits: torch.Tensor, index: torch.Tensor) -> None:
    if logits.ndim < 1 or tuple(index.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"index must have the shape of logits without the vocabulary axis {tuple(logits.shape[:-1])}, "
            f"got {tuple(index.shape)}"
        )


def _check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
