"""A hand-written Qwen2/Llama forward: one implementation for the decode loop and for scoring tokens.

Why: on a small model on CPU the HF forward costs per-op overhead, not arithmetic (``benchmarks/README.md``).
Here the transformer is written out with fewer, larger ops: q/k/v and gate/up as one matmul each, each
RMSNorm weight folded into the matrix that reads the norm's output, RoPE on q and k at once, residual adds
inside ``addmm``. Weights are built from the HF modules' own parameters at every call (``prepare``) with
differentiable ops, so training updates are seen at once and, under autograd, gradients reach the HF
module's parameters exactly as through its own forward.

The forward, per layer (x: (N, D) rows, d = head_dim, g = num_heads / num_kv_heads):

    h = RMSNorm(x) = w ⊙ x / sqrt(mean(x²) + eps)
    q, k, v = h Wqᵀ + bq, h Wkᵀ + bk, h Wvᵀ + bv            (q: Hq heads, k/v: Hkv heads, of d)
    RoPE: q' = q cos + rotate_half(q) sin,  rotate_half([a, b]) = [-b, a]
          = q cos + roll(q, d/2) sin±  with  sin± = [-sin, +sin] (halves), cos/sin of position · inv_freq
    a = softmax(q' k'ᵀ / sqrt(d) + mask) v                  (GQA: query head i reads kv head i // g)
    x = x + a Woᵀ
    x = x + Wdown (silu(RMSNorm(x) Wgateᵀ) ⊙ RMSNorm(x) Wupᵀ)

then the final RMSNorm (and the LM head). Positions are cumsum(attention_mask) - 1 (left padding), as HF's.
``run_layers`` is the stack; the caller supplies the attention over its keys (``rollout/manual.py``: a KV
buffer; ``hidden_states`` here: whole sequences at once with a causal + padding mask, a prompt shared by
several rows computed once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from grpo_core.model.loading import Float32Head
from grpo_core.model.sharding import is_sharded

SUPPORTED = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
FORWARD_BACKENDS = ("auto", "hf", "manual")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the hand-written forward cannot reproduce ``model``'s HF forward, or None when it can."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if SUPPORTED.get(model_type) != type(model).__name__:  # a PEFT wrapper, another head, another family
        return f"{type(model).__name__} (model_type {model_type!r}) is not a plain Qwen2/Llama causal LM"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {config.hidden_act!r}"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope type {rope.get('rope_type', rope.get('type'))!r}"
    if (getattr(config, "use_sliding_window", False)
            or "sliding_attention" in (getattr(config, "layer_types", None) or [])):
        return "sliding-window attention"
    if (getattr(config, "pretraining_tp", 1) or 1) > 1:
        return "pretraining_tp > 1"
    if getattr(config, "attention_dropout", 0.0):  # applied by HF in train mode
        return f"attention_dropout {config.attention_dropout}"
    embed = model.model.embed_tokens
    if type(embed) is not nn.Embedding or embed.max_norm is not None:
        return f"{type(embed).__name__} embedding (not a plain nn.Embedding)"
    for layer in model.model.layers:  # LoRA-injected or quantized layers are not plain Linear modules
        a, m = layer.self_attn, layer.mlp
        for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            if type(lin) is not nn.Linear:
                return f"{type(lin).__name__} projection (not nn.Linear)"
    if type(model.lm_head) is Float32Head and model.lm_head.weight.dtype != torch.float32:
        return "a float32 LM head over a tied half-precision embedding (cast_lm_head_to_fp32)"
    # a float32 Float32Head computes as its Linear does
    if type(model.lm_head) not in (nn.Linear, Float32Head):
        return f"{type(model.lm_head).__name__} LM head"
    return None


def use_manual_forward(model: nn.Module, choice: str = "auto") -> bool:
    """Whether token scoring runs ``hidden_states`` (``train.forward_backend``): "hf" never; "auto" for a
    plain Qwen2/Llama model on CPU, called directly (no accelerate autocast wrapper or patched forward),
    without gradient checkpointing; "manual" always, a ValueError for a model it cannot run."""
    if choice not in FORWARD_BACKENDS:
        raise ValueError(f"forward backend must be one of {FORWARD_BACKENDS}, got {choice!r}")
    if choice == "hf":
        return False
    reason = unsupported_reason(model)
    if reason is None and is_sharded(model):
        reason = "an FSDP2-sharded model (its forward hooks gather each layer's weights)"
    if reason is None and ("forward" in vars(model) or getattr(model, "_original_forward", None) is not None):
        reason = "a wrapped or patched forward (accelerate autocast?)"
    if reason is None and getattr(model.model, "gradient_checkpointing", False):
        reason = "gradient checkpointing"
    if choice == "manual":
        if reason is not None:
            raise ValueError(f"the hand-written forward cannot run this model: {reason}")
        return True
    return reason is None and model.model.embed_tokens.weight.device.type == "cpu"


# -- building blocks ---------------------------------------------------------------------------------


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) over the last dim, in float32 as HF's RMSNorm (its weight is folded into
    the next matrix, see ``prepare``)."""
    if x.dtype != torch.float32:
        return _normalize(x.float(), eps).to(x.dtype)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _linear(x: torch.Tensor, w_t: torch.Tensor, b: torch.Tensor | None, residual: torch.Tensor | None = None):
    """residual + x w_t + b for 2-D x (N, in) and w_t (in, out): one addmm."""
    out = torch.addmm(residual, x, w_t) if residual is not None else (
        torch.addmm(b, x, w_t) if b is not None else torch.mm(x, w_t))
    return out.add_(b) if residual is not None and b is not None else out


def _cat_bias(*mods: nn.Linear) -> torch.Tensor | None:
    if all(m.bias is None for m in mods):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in mods])


def prepare(model: nn.Module, head: bool = True) -> tuple[list[dict], dict]:
    """Per call, from the modules' current parameters: transposed matrices (in, out) for addmm, q/k/v and
    gate/up concatenated into one matrix each, and each RMSNorm weight w folded into the matrix that reads
    the norm's output: W (w ⊙ x̂) = (W diag(w)) x̂. Differentiable ops only, rebuilt every call.
    ``head``: also fold the final norm into the LM head (``final["t"]``, for logits)."""
    cfg = model.config
    H = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or H
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    layers = []
    for layer in model.model.layers:
        a, m, n1, n2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
        layers.append({
            "heads": (H, n_kv, d), "scale": a.scaling,
            "qkv_t": (torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]) * n1.weight).t(),
            "qkv_b": _cat_bias(a.q_proj, a.k_proj, a.v_proj), "eps1": n1.variance_epsilon,
            "o_t": a.o_proj.weight.t(), "o_b": a.o_proj.bias,
            "gu_t": (torch.cat([m.gate_proj.weight, m.up_proj.weight]) * n2.weight).t(),
            "gu_b": _cat_bias(m.gate_proj, m.up_proj), "eps2": n2.variance_epsilon,
            "down_t": m.down_proj.weight.t(), "down_b": m.down_proj.bias,
        })
    norm, lm_head, embed = model.model.norm, model.lm_head, model.model.embed_tokens
    final = {"norm_w": norm.weight, "eps": norm.variance_epsilon, "embed": embed.weight,
             "padding_idx": embed.padding_idx, "b": lm_head.bias}
    if head:
        final["t"] = (lm_head.weight * norm.weight).t()
    return layers, final


def rope(model: nn.Module, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin± (``pos.shape`` + (1, d)) of integer positions, as HF's rotary embedding computes them
    (float32, times its attention scaling, then cast); sin± has the first half negated (see the module
    doc)."""
    rotary = model.model.rotary_emb
    freqs = pos[..., None].float() * rotary.inv_freq.float().to(pos.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    d = emb.shape[-1]
    sign = torch.ones(d, device=pos.device).index_fill_(0, torch.arange(d // 2, device=pos.device), -1.0)
    cos = (emb.cos() * rotary.attention_scaling).to(dtype)[..., None, :]
    sin = (emb.sin() * rotary.attention_scaling * sign).to(dtype)[..., None, :]
    return cos, sin


def embed(ids: torch.Tensor, final: dict) -> torch.Tensor:
    """(N,) ids -> (N, D) rows; ``padding_idx`` as nn.Embedding's (its row gets no gradient)."""
    return F.embedding(ids, final["embed"], final["padding_idx"])


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def run_layers(x: torch.Tensor, layers: list[dict], cos: torch.Tensor, sin: torch.Tensor,
               attend: Attend) -> torch.Tensor:
    """The decoder stack on (N, D) rows (before the final norm). cos/sin: (N, 1, d) of each row's position.
    attend(i, q, k, v) -> (N, Hq·d): layer i's attention of the rows' rotated queries q (N, Hq, d) over keys,
    given the rows' rotated keys k and values v (N, Hkv, d)."""
    for i, w in enumerate(layers):
        H, n_kv, d = w["heads"]
        # split, not slices: under autograd a slice's backward zero-fills the whole input, split's is one cat
        qk, v = _linear(_normalize(x, w["eps1"]), w["qkv_t"], w["qkv_b"]).split([(H + n_kv) * d, n_kv * d], 1)
        qk = qk.view(-1, H + n_kv, d)
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)        # RoPE on q and k at once
        att = attend(i, *qk.split([H, n_kv], 1), v.view(-1, n_kv, d))
        x = _linear(att, w["o_t"], w["o_b"], residual=x)
        gate, up = _linear(_normalize(x, w["eps2"]), w["gu_t"], w["gu_b"]).chunk(2, 1)  # (N, I) each
        x = _linear(F.silu(gate) * up, w["down_t"], w["down_b"], residual=x)
    return x


def causal_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) 0/1 -> (B, 1, L, L) bool, True where a query may attend a key: causal and a real key. A padding
    query sees itself (a row of -inf would give NaN; its output is never read by a real token)."""
    L = attention_mask.shape[1]
    ones = torch.ones(L, L, dtype=torch.bool, device=attention_mask.device)
    return ((ones.tril() & attention_mask.bool()[:, None, :]) | torch.eye(L, dtype=torch.bool,
                                                                         device=attention_mask.device))[:,
                                                                                                        None]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask (True = attend) as the additive 0 / -inf mask SDPA would make of it."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -float("inf"))


def hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  position_ids: torch.Tensor | None = None, prefix: int = 1,
                  rows: torch.Tensor | None = None, padding_free: bool = True) -> torch.Tensor:
    """Final hidden states (after the last RMSNorm, before the LM head) of positions [prefix - 1, L): the
    values of ``model.model(input_ids, attention_mask, position_ids=...).last_hidden_state[:, prefix - 1:]``,
    (B, L - prefix + 1, D), 0 at padding positions. Differentiable: under autograd the gradients reach the
    model's parameters.

    input_ids, attention_mask: (B, L), left padding allowed; position_ids: (B, L), default cumsum(mask) - 1.
    prefix (≥ 1): the first ``prefix`` columns are a prompt that rows may share (the G completions of a GRPO
    group, adjacent rows): each run of rows with the same prompt (ids, mask, positions) computes it once, and
    the rows' later tokens attend its keys and values. The same numbers as running every row in full; the
    prompt's gradient is the sum over its rows.
    rows: optional (B, L - prefix + 1) bool, the output positions wanted: then only those are returned, packed
    as (rows.sum(), D) in row-major order (a padding position asked for is a ValueError).

    Padding-free: only real tokens (mask 1) go through the embedding, the norms, the q/k/v, output and MLP
    matmuls; the rows are scattered into the padded (sequence, column) layout for attention alone and its
    output gathered back. A padding position costs attention work, not the matmuls'. ``padding_free=False``
    runs every column through them (the same numbers, slower; kept to measure what the saving is worth).

    Phases: the layout (shared prompts, real tokens: ``_Layout``), the packed ids and RoPE, the attention
    masks, the decoder stack over the packed rows, then each output position's row through the final norm.
    """
    B, L = input_ids.shape
    if not 1 <= prefix <= L:
        raise ValueError(f"prefix must be in [1, {L}], got {prefix}")
    if rows is not None and tuple(rows.shape) != (B, L - prefix + 1):
        raise ValueError(f"rows must be (B, L - prefix + 1) = {(B, L - prefix + 1)}, got {tuple(rows.shape)}")
    layers, final = prepare(model, head=False)
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    layout = _Layout.of(input_ids, attention_mask, position_ids, prefix, padding_free)
    where = layout.output_rows(rows)                                      # (B, S + 1), or (rows.sum(),)
    dtype = final["embed"].dtype
    cos, sin = rope(model, layout.packed(position_ids), dtype)            # (n, 1, d)
    attend = _shared_prompt_attention(layers, layout, *_attention_masks(attention_mask, layout, dtype))
    x = run_layers(embed(layout.packed(input_ids), final), layers, cos, sin, attend)  # (n_p + n_s, D)
    if rows is None:
        x = torch.cat([x, x.new_zeros(1, x.shape[1])])                    # the row padding positions point at
    return final["norm_w"] * _normalize(x.index_select(0, where.reshape(-1)), final["eps"]).view(*where.shape,
                                                                                                 -1)


@dataclass
class _Layout:
    """Which tokens ``hidden_states`` runs, and where they sit. The packed rows (N = n_p + n_s) are the U
    distinct prompts' real tokens (of their U·P columns), then every row's real later tokens (of B·S)."""

    B: int
    P: int
    S: int                 # L - P: the later columns
    first: torch.Tensor    # (U,) a row of each distinct prompt
    inverse: torch.Tensor  # (B,) each row's prompt
    idx_p: torch.Tensor    # (n_p,) the real prompt tokens' places in the flattened (U·P) columns
    idx_s: torch.Tensor    # (n_s,) the real later tokens' places in the flattened (B·S) columns
    group: int | None      # G when every prompt has G rows (GRPO's groups), else None

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, P: int,
           padding_free: bool) -> _Layout:
        # Runs of adjacent rows with the same prompt (ids, mask,
        # positions) share it: GRPO's G rows of a group.
        key = torch.cat([input_ids[:, :P], attention_mask[:, :P].long(), position_ids[:, :P]], dim=1)
        new_prompt = torch.cat([key.new_ones(1, dtype=torch.bool), (key[1:] != key[:-1]).any(1)])
        first = new_prompt.nonzero().squeeze(1)                                   # (U,)
        inverse = new_prompt.long().cumsum(0) - 1                                 # (B,)
        real_p, real_s = (attention_mask[first, :P].reshape(-1).bool(),
                          attention_mask[:, P:].reshape(-1).bool())
        if not padding_free:
            real_p, real_s = torch.ones_like(real_p), torch.ones_like(real_s)
        counts = torch.bincount(inverse, minlength=first.shape[0])
        G = int(counts[0])
        return cls(input_ids.shape[0], P, input_ids.shape[1] - P, first, inverse, real_p.nonzero().squeeze(1),
                   real_s.nonzero().squeeze(1), G if bool((counts == G).all()) else None)

    @property
    def U(self) -> int:
        return self.first.shape[0]

    @property
    def n_p(self) -> int:
        return self.idx_p.shape[0]

    @property
    def n_s(self) -> int:
        return self.idx_s.shape[0]

    @property
    def full_p(self) -> bool:  # no prompt padding: nothing to scatter
        return self.n_p == self.U * self.P

    @property
    def full_s(self) -> bool:
        return self.n_s == self.B * self.S

    def packed(self, t: torch.Tensor) -> torch.Tensor:
        """(B, L) per column -> (N,) per packed row."""
        return torch.cat([t[self.first, :self.P].reshape(-1)[self.idx_p],
                          t[:, self.P:].reshape(-1)[self.idx_s]])

    def per_row(self, t: torch.Tensor) -> torch.Tensor:
        """(U, ...) per prompt -> (B, ...) per row. Equal groups (GRPO's G rows each): an expand, whose
        backward is a sum over G; otherwise index_select (an index_add backward; ``t[inverse]``'s is a slower
        index_put)."""
        if self.group is not None:
            return t[:, None].expand(self.U, self.group, *t.shape[1:]).reshape(self.B, *t.shape[1:])
        return t.index_select(0, self.inverse)

    def output_rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        """Where each output position's row is among the N packed rows: a row's last prompt column, then its
        later columns, (B, S + 1); padding points at N (an extra zero row). With ``rows``: the wanted ones
        only."""
        n, device = self.n_p + self.n_s, self.idx_p.device
        where_p = torch.full((self.U * self.P,), n, dtype=torch.long, device=device).index_copy_(
            0, self.idx_p, torch.arange(self.n_p, device=device))
        where_s = torch.full((self.B * self.S,), n, dtype=torch.long, device=device).index_copy_(
            0, self.idx_s, torch.arange(self.n_p, n, device=device))
        where = torch.cat([where_p.view(self.U, self.P)[self.inverse, -1:], where_s.view(self.B, self.S)],
                          dim=1)
        if rows is None:
            return where
        where = where[rows.bool()]
        if bool((where == n).any()):
            raise ValueError("rows asks for the hidden state of a padding position")
        return where


def _attention_masks(attention_mask: torch.Tensor, layout: _Layout,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Additive masks: the distinct prompts' (U, 1, P, P), causal over their real tokens; the later tokens'
    (B, 1, S, P + S): a later token sees its prompt's real tokens, then causal over the real later tokens and
    itself. Additive, not bool: SDPA would convert a bool mask on every call."""
    B, P, S, device = layout.B, layout.P, layout.S, attention_mask.device
    mask_p = causal_mask(attention_mask[layout.first, :P])
    later = attention_mask[:, P:].bool()
    own = (torch.ones(S, S, dtype=torch.bool, device=device).tril() & later[:, None, :]) | torch.eye(
        S, dtype=torch.bool, device=device)
    mask_s = torch.cat([attention_mask[:, None, None, :P].bool().expand(B, 1, S, P), own[:, None]], dim=-1)
    return _additive(mask_p, dtype), _additive(mask_s, dtype)


def _padded(t: torch.Tensor, idx: torch.Tensor, full: bool, n_seq: int, width: int) -> torch.Tensor:
    """(n, h, d) real rows -> (n_seq, h, width, d), zeros at padding (a padding key is masked out; a padding
    query sees only itself, a zero value)."""
    if not full:
        t = t.new_zeros(n_seq * width, *t.shape[1:]).index_copy(0, idx, t)
    return t.view(n_seq, width, *t.shape[1:]).transpose(1, 2)


def _unpadded(t: torch.Tensor, idx: torch.Tensor, full: bool) -> torch.Tensor:
    """(n_seq, H, width, d) -> (n, H·d), the real rows."""
    t = t.transpose(1, 2).reshape(-1, t.shape[1] * t.shape[3])
    return t if full else t.index_select(0, idx)


def _shared_prompt_attention(layers: list[dict], layout: _Layout, mask_p: torch.Tensor,
                             mask_s: torch.Tensor) -> Attend:
    """``run_layers``' attend over the packed rows: the prompts' queries attend within their prompt; each
    row's later queries attend its prompt's keys and values (shared by the group's rows), then its own."""
    lo = layout

    def attend(i, q, k, v):
        (H, n_kv, _), scale = layers[i]["heads"], layers[i]["scale"]
        (qp, qs), (kp, ks), (vp, vs) = (t.split([lo.n_p, lo.n_s]) for t in (q, k, v))
        qp, kp, vp = (_padded(t, lo.idx_p, lo.full_p, lo.U, lo.P) for t in (qp, kp, vp))  # (U, h, P, d)
        out = _unpadded(F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask_p, scale=scale,
                                                       enable_gqa=n_kv != H), lo.idx_p, lo.full_p)
        if lo.S == 0:
            return out
        qs, ks, vs = (_padded(t, lo.idx_s, lo.full_s, lo.B, lo.S) for t in (qs, ks, vs))  # (B, h, S, d)
        ks, vs = torch.cat([lo.per_row(kp), ks], dim=2), torch.cat([lo.per_row(vp), vs],
                                                                   dim=2)  # (B, h, P + S, d)
        later_out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask_s, scale=scale,
                                                   enable_gqa=n_kv != H)
        return torch.cat([out, _unpadded(later_out, lo.idx_s, lo.full_s)])

    return attend
