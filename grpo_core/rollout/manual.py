"""A hand-written decode loop for Qwen2/Llama-family causal LMs: the same rollouts as ``HFGenerateBackend``.

Why: on a small model on CPU, HF ``generate`` costs per-op overhead, not arithmetic (a decode step of the
3-layer benchmark model is ~930 aten ops). Here a step is the hand-written transformer of
``grpo_core/model/fastforward.py`` (weights rebuilt from the HF modules at every call, so ``sync_weights`` is
free and training updates are seen by the next rollout) over a KV buffer preallocated once per call:
~440 aten ops, 13 matmuls (``benchmarks/README.md`` has the numbers). The prompt (prefill) runs once per
distinct prompt — the G rows of a group share it — with a causal+padding mask; positions are
cumsum(attention_mask) - 1 (left padding), as HF's.

Sampling follows HF ``generate`` step by step: float32 logits; EOS masked while fewer than
``generation_config.min_new_tokens`` tokens exist (and while the row is shorter than ``min_length``);
the repetition penalty over the prompt's real tokens and those sampled so far (HF's processor); then
temperature, top-k, top-p, min-p (HF's warpers, same order and tie rules); a draw from softmax (inverse CDF,
``sample``: the same distribution as HF's ``torch.multinomial``, another random stream) or ``argmax`` when
greedy; a finished row gets the pad token; the loop stops once every row has an EOS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from grpo_core.model.fastforward import _linear, _normalize, causal_mask, embed, prepare, rope, run_layers
from grpo_core.model.fastforward import unsupported_reason as forward_unsupported_reason
from grpo_core.rollout.types import RolloutBatch, SamplingParams, assemble_batch, left_pad, pad_and_eos_ids

# generation_config fields that add a logits processor this loop does not reproduce (HF backend parity).
_UNSUPPORTED_GENERATION = ("no_repeat_ngram_size", "bad_words_ids", "suppress_tokens",
                           "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                           "sequence_bias", "watermarking_config", "exponential_decay_length_penalty",
                           "renormalize_logits", "top_h")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the manual loop cannot reproduce ``model``'s HF generation, or None when it can: the forward's
    own conditions (``fastforward.unsupported_reason``) and no logits processor it lacks."""
    reason = forward_unsupported_reason(model)
    if reason is not None:
        return reason
    gen = getattr(model, "generation_config", None)
    for name in _UNSUPPORTED_GENERATION:
        if getattr(gen, name, None) not in (None, False, [], {}):
            return f"generation_config.{name} = {getattr(gen, name)!r}"
    return None


def supports(model: nn.Module) -> bool:
    return unsupported_reason(model) is None


class ManualDecodeBackend:
    """``RolloutBackend`` with a hand-written Qwen2/Llama forward and a preallocated KV buffer.

    Same constructor, output layout and semantics as ``HFGenerateBackend``; raises ValueError for a
    model ``supports`` rejects (callers pick a backend with ``grpo_core.rollout.default_backend``).
    """

    def __init__(self, model: nn.Module, tokenizer, eos_token_ids: list[int] | None = None,
                 max_batch_size: int | None = None, return_logprobs: bool = False):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"ManualDecodeBackend cannot run this model: {reason}")
        self.model = model
        self.pad_id, self.eos_ids = pad_and_eos_ids(tokenizer, eos_token_ids)
        self.max_batch_size = max_batch_size
        # batches carry each sampled token's log-prob under the sampling weights, log softmax(logits / T) as
        # the training forward computes it (no top-k/top-p/penalty): the old log-probs of a round sampled
        # ahead
        self.return_logprobs = return_logprobs
        self.record_logits: list[torch.Tensor] | None = None  # a list: each step's (B, V) logits (tests)

    def sync_weights(self, model: nn.Module) -> None:
        self.model = model  # the loop reads the modules' own parameters: nothing to copy

    # -- the forward --------------------------------------------------------------------------------

    @staticmethod
    def _forward(ids: torch.Tensor, start: int, weights, cache, cos: torch.Tensor, sin: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) float32 of the last of S new tokens, written at buffer columns [start, start + S).

        ids: (B, S); weights: ``fastforward.prepare``'s; cache: per layer (K, V), each (B·Hkv, T, d); cos/sin:
        (B·S, 1, d) of the new tokens' positions; mask: prefill (B, 1, S, S) bool, True where a query may
        attend a key; decode (B·Hkv, 1, start + 1) float, 0 or -inf, added to the scores. Rows are kept 2-D,
        (B·S, D).
        """
        layers, final = weights
        (B, S), stop = ids.shape, start + ids.shape[1]

        # K/V of the new tokens into the buffer, then attention over columns [0, stop)
        def attend(i, q, k, v):
            (k_buf, v_buf), (H, n_kv, d) = cache[i], layers[i]["heads"]
            T = k_buf.shape[1]
            k_buf.view(B, n_kv, T, d)[:, :, start:stop] = k.view(B, S, n_kv, d).transpose(1, 2)
            v_buf.view(B, n_kv, T, d)[:, :, start:stop] = v.view(B, S, n_kv, d).transpose(1, 2)
            # decode: (B·Hkv, g, d) queries against (B·Hkv, stop, d) keys (GQA without a KV repeat)
            if S == 1:
                scores = torch.baddbmm(mask, q.reshape(B * n_kv, -1, d), k_buf[:, :stop].transpose(1, 2),
                                       alpha=layers[i]["scale"])                # (B·Hkv, g, stop)
                return torch.bmm(scores.softmax(dim=-1), v_buf[:, :stop]).view(B, H * d)
            kv = (k_buf.view(B, n_kv, T, d)[:, :, :stop], v_buf.view(B, n_kv, T, d)[:, :, :stop])
            att = F.scaled_dot_product_attention(q.reshape(B, S, H, d).transpose(1, 2), *kv, attn_mask=mask,
                                                 scale=layers[i]["scale"], enable_gqa=True)
            return att.transpose(1, 2).reshape(B * S, H * d)

        x = run_layers(embed(ids.reshape(-1), final), layers, cos, sin, attend)
        x = x.view(B, S, -1)[:, -1]
        return _linear(_normalize(x, final["eps"]), final["t"], final["b"]).float()

    # -- sampling -----------------------------------------------------------------------------------

    @staticmethod
    def warp(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        """HF's sampling warpers in HF's order: temperature, top-k, top-p, min-p (min_tokens_to_keep = 1).
        (B, V)."""
        if sampling.temperature is not None and sampling.temperature != 1.0:
            logits = logits / sampling.temperature
        if sampling.top_k:
            kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1])).values[..., -1:]
            logits = logits.masked_fill(logits < kth, -float("inf"))
        if sampling.top_p is not None and sampling.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=False)
            remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p
            remove[..., -1:] = False  # keep at least the most likely token
            logits = logits.masked_fill(remove.scatter(1, order, remove), -float("inf"))
        if sampling.min_p > 0:  # the top token always stays (its probability is the threshold's scale)
            probs = logits.softmax(dim=-1)
            logits = logits.masked_fill(probs < sampling.min_p * probs.amax(dim=-1, keepdim=True),
                                        -float("inf"))
        return logits

    @staticmethod
    def penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
        """HF's repetition penalty: each token already seen (B, V) bool has its logit divided by ``penalty``,
        or multiplied when negative. (B, V)."""
        return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)

    @staticmethod
    def sample(logits: torch.Tensor) -> torch.Tensor:
        """One token per row from softmax(logits) (B, V) by inverse CDF: the first index whose cumulative
        probability exceeds u ~ U[0, 1). One uniform per row (``torch.multinomial`` draws V exponentials,
        ~0.4 ms a step here); a zero-probability token never has a cumulative sum above u, so is never
        picked."""
        cdf = logits.softmax(dim=-1).cumsum(dim=-1)
        u = torch.rand(cdf.shape[0], 1, device=cdf.device, dtype=cdf.dtype) * cdf[:, -1:]
        return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)

    @staticmethod
    def _prompt_tokens(ids: torch.Tensor, mask: torch.Tensor, vocab: int) -> torch.Tensor:
        """(B, V) bool: the tokens among each row's real prompt ids (ids past the LM head's V cannot be
        sampled, so carry no penalty: HF's rule)."""
        seen = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
        seen.scatter_(1, torch.where(mask.bool(), ids.clamp(max=vocab), vocab), True)
        return seen[:, :vocab]

    @torch.no_grad()
    def _generate_chunk(self, ids: torch.Tensor, mask: torch.Tensor,
                        sampling: SamplingParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, P) left-padded ids and mask -> (B, n) sampled ids, n ≤ max_new_tokens (pad after a row's EOS),
        and with ``return_logprobs`` their (B, n) float32 log-probs (else None)."""
        model, (B, P), n_new = self.model, ids.shape, sampling.max_new_tokens
        cfg, device, dtype = model.config, ids.device, model.model.embed_tokens.weight.dtype
        T, n_kv = P + n_new, cfg.num_key_value_heads or cfg.num_attention_heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        weights = prepare(model)
        cache = [(torch.empty(B * n_kv, T, d, device=device, dtype=dtype),
                  torch.empty(B * n_kv, T, d, device=device, dtype=dtype)) for _ in model.model.layers]
        # Keys: the prompt's real tokens and every generated column. Positions: cumsum(mask) - 1 (as HF's).
        key_ok = torch.cat([mask.bool(), mask.new_ones(B, n_new, dtype=torch.bool)], dim=1)   # (B, T)
        pos = (key_ok.long().cumsum(1) - 1).clamp(min=0)
        cos, sin = rope(model, pos.t(), dtype)                                                # (T, B, 1, d)
        prefill_mask = causal_mask(key_ok[:, :P])                                            # (B, 1, P, P)
        step_mask = torch.zeros(B, n_kv, 1, T, dtype=dtype, device=device).masked_fill(
            ~key_ok[:, None, None, :], -float("inf")).flatten(0, 1)                            # (B·Hkv, 1, T)

        gen = model.generation_config
        min_new = max(getattr(gen, "min_new_tokens", None) or 0, (getattr(gen, "min_length", None) or 0) - P)
        eos = torch.tensor(self.eos_ids, device=device)
        out = torch.full((B, n_new), self.pad_id, dtype=torch.long, device=device)
        logps = torch.zeros(B, n_new, device=device) if self.return_logprobs else None
        temperature = sampling.temperature if sampling.do_sample and sampling.temperature else 1.0
        unfinished = torch.ones(B, dtype=torch.bool, device=device)
        # Prefill each distinct prompt once (the G rows of a group share it), then copy its K/V to its rows.
        _, inverse = torch.unique(torch.cat([ids, mask], dim=1), dim=0, return_inverse=True)
        first = torch.full((int(inverse.max()) + 1,), B, device=device).scatter_reduce_(
            0, inverse, torch.arange(B, device=device), "amin")                           # (U,) a row of each
        U = first.shape[0]
        prompt_cache = [(torch.empty(U * n_kv, P, d, device=device, dtype=dtype),
                         torch.empty(U * n_kv, P, d, device=device, dtype=dtype)) for _ in cache]
        logits = self._forward(ids[first], 0, weights, prompt_cache,
                               cos[:P, first].transpose(0, 1).reshape(U * P, 1, d),
                               sin[:P, first].transpose(0, 1).reshape(U * P, 1, d),
                               prefill_mask[first])[inverse]
        for (k_buf, v_buf), (k, v) in zip(cache, prompt_cache):
            k_buf.view(B, n_kv, T, d)[:, :, :P] = k.view(U, n_kv, P, d)[inverse]
            v_buf.view(B, n_kv, T, d)[:, :, :P] = v.view(U, n_kv, P, d)[inverse]
        seen = (self._prompt_tokens(ids, mask, logits.shape[-1]) if sampling.repetition_penalty != 1.0
                else None)
        for t in range(n_new):
            if t > 0:  # feed the previous token: its K/V go to column P + t - 1
                c = P + t - 1
                logits = self._forward(out[:, t - 1:t], c, weights, cache, cos[c], sin[c],
                                       step_mask[..., :c + 1])
            if self.record_logits is not None:
                self.record_logits.append(logits.clone())
            step_logps = ((logits / temperature).log_softmax(dim=-1) if logps is not None
                          else None)  # before masks
            if t < min_new:
                logits.index_fill_(1, eos, -float("inf"))
            if seen is not None:
                logits = self.penalize_repetition(logits, seen, sampling.repetition_penalty)
            if sampling.do_sample:
                token = self.sample(self.warp(logits, sampling))
            else:
                token = logits.argmax(dim=-1)
            out[:, t] = torch.where(unfinished, token, self.pad_id)
            if step_logps is not None:
                logps[:, t] = step_logps.gather(1, token.unsqueeze(1)).squeeze(1)
            if seen is not None:
                seen[torch.arange(B, device=device), token] = True
            unfinished &= ~torch.isin(out[:, t], eos)
            if not unfinished.any():
                return out[:, :t + 1], None if logps is None else logps[:, :t + 1]
        return out, logps

    def generate(self, prompt_ids: list[list[int]], num_generations: int,
                 sampling: SamplingParams) -> RolloutBatch:
        if sampling.generation_kwargs:
            raise ValueError("the hand-written decode loop takes no generation_kwargs "
                             f"({sorted(sampling.generation_kwargs)}); sample with generation.backend hf "
                             "(auto picks it when generation_kwargs are set)")
        repeated = [ids for ids in prompt_ids for _ in range(num_generations)]
        device = self.model.model.embed_tokens.weight.device
        ids, mask = left_pad(repeated, self.pad_id)
        step = self.max_batch_size or len(repeated)
        chunks = [self._generate_chunk(ids[s:s + step].to(device), mask[s:s + step].to(device), sampling)
                  for s in range(0, len(repeated), step)]
        batch = assemble_batch(ids, mask, [c.cpu() for c, _ in chunks], self.pad_id, self.eos_ids)
        if self.return_logprobs:  # (N, C) like the completions, 0 past each row's EOS
            width = batch.completion_ids.shape[1]
            logps = torch.cat([F.pad(lp.cpu(), (0, width - lp.shape[1])) for _, lp in chunks])
            batch.sampling_logps = logps * batch.completion_mask
        return batch
