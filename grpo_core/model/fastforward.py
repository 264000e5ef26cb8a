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
``run_layers`` is the stack; the caller supplies the attention over its keys (``rollout/manual.py``: a KV buffer;
``hidden_states`` here: whole sequences at once with a causal + padding mask, a prompt shared by several rows
computed once).
"""

from __future__ import annotations

from collections.abc import Callable

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
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None) or []):
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
    if type(model.lm_head) not in (nn.Linear, Float32Head):  # a float32 Float32Head computes as its Linear does
        return f"{type(model.lm_head).__name__} LM head"
    return None


def use_manual_forward(model: nn.Module, choice: str = "auto") -> bool:
    """Whether token scoring runs ``hidden_states`` (``train.forward_backend``): "hf" never; "auto" for a plain
    Qwen2/Llama model on CPU, called directly (no accelerate autocast wrapper or patched forward), without
    gradient checkpointing; "manual" always, a ValueError for a model it cannot run."""
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
    (float32, times its attention scaling, then cast); sin± has the first half negated (see the module doc)."""
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
                                                                         device=attention_mask.device))[:, None]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask (True = attend) as the additive 0 / -inf mask SDPA would make of it."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -float("inf"))


def hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  position_ids: torch.Tensor | None = None, prefix: int = 1,
                  rows: torch.Tensor | None = None, padding_free: bool = True) -> torch.Tensor:
    """Final hidden states (after the last RMSNorm, before the LM head) of positions [prefix - 1, L): the values
    of ``model.model(input_ids, attention_mask, position_ids=...).last_hidden_state[:, prefix - 1:]``, (B, L -
    prefix + 1, D), 0 at padding positions. Differentiable: under autograd the gradients reach the model's
    parameters.

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
    """
    B, L = input_ids.shape
    P, S = prefix, L - prefix
    if not 1 <= P <= L:
        raise ValueError(f"prefix must be in [1, {L}], got {prefix}")
    if rows is not None and tuple(rows.shape) != (B, S + 1):
        raise ValueError(f"rows must be (B, L - prefix + 1) = {(B, S + 1)}, got {tuple(rows.shape)}")
    layers, final = prepare(model, head=False)
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    device = input_ids.device
    # Runs of adjacent rows with the same prompt (ids, mask, positions) share it: GRPO's G rows of a group.
    key = torch.cat([input_ids[:, :P], attention_mask[:, :P].long(), position_ids[:, :P]], dim=1)
    new_prompt = torch.cat([key.new_ones(1, dtype=torch.bool), (key[1:] != key[:-1]).any(1)])
    first = new_prompt.nonzero().squeeze(1)                                       # (U,) a row of each prompt
    inverse = new_prompt.long().cumsum(0) - 1                                     # (B,) its prompt's index
    U = first.shape[0]
    # The real tokens: the U distinct prompts' (of their U·P columns), then every row's later ones (of B·S).
    real_p, real_s = attention_mask[first, :P].reshape(-1).bool(), attention_mask[:, P:].reshape(-1).bool()
    if not padding_free:
        real_p, real_s = torch.ones_like(real_p), torch.ones_like(real_s)
    idx_p, idx_s = real_p.nonzero().squeeze(1), real_s.nonzero().squeeze(1)
    n_p, n_s = idx_p.shape[0], idx_s.shape[0]
    ids = torch.cat([input_ids[first, :P].reshape(-1)[idx_p], input_ids[:, P:].reshape(-1)[idx_s]])
    cos, sin = rope(model, torch.cat([position_ids[first, :P].reshape(-1)[idx_p],
                                      position_ids[:, P:].reshape(-1)[idx_s]]), final["embed"].dtype)  # (n, 1, d)
    mask_p = causal_mask(attention_mask[first, :P])                               # (U, 1, P, P)
    # A later token sees its prompt's real tokens, then causal over the real later tokens and itself.
    later = attention_mask[:, P:].bool()
    own = (torch.ones(S, S, dtype=torch.bool, device=device).tril() & later[:, None, :]) | torch.eye(
        S, dtype=torch.bool, device=device)
    mask_s = torch.cat([attention_mask[:, None, None, :P].bool().expand(B, 1, S, P), own[:, None]], dim=-1)
    mask_p, mask_s = (_additive(m, final["embed"].dtype) for m in (mask_p, mask_s))  # SDPA converts bool per call
    full_p, full_s = n_p == U * P, n_s == B * S  # no padding: nothing to scatter

    def padded(t, idx, full, n_seq, width):
        """(n, h, d) real rows -> (n_seq, h, width, d), zeros at padding (a padding key is masked out; a
        padding query sees only itself, a zero value)."""
        if not full:
            t = t.new_zeros(n_seq * width, *t.shape[1:]).index_copy(0, idx, t)
        return t.view(n_seq, width, *t.shape[1:]).transpose(1, 2)

    def unpadded(t, idx, full):
        """(n_seq, H, width, d) -> (n, H·d), the real rows."""
        t = t.transpose(1, 2).reshape(-1, t.shape[1] * t.shape[3])
        return t if full else t.index_select(0, idx)

    counts = torch.bincount(inverse, minlength=U)
    G = int(counts[0])
    equal_groups = bool((counts == G).all())

    def per_row(t):
        """(U, ...) per prompt -> (B, ...) per row. Equal groups (GRPO's G rows each): an expand, whose backward
        is a sum over G; otherwise index_select (an index_add backward; ``t[inverse]``'s is a slower index_put)."""
        if equal_groups:
            return t[:, None].expand(U, G, *t.shape[1:]).reshape(B, *t.shape[1:])
        return t.index_select(0, inverse)

    def attend(i, q, k, v):
        (H, n_kv, _), scale = layers[i]["heads"], layers[i]["scale"]
        (qp, qs), (kp, ks), (vp, vs) = (t.split([n_p, n_s]) for t in (q, k, v))
        qp, kp, vp = (padded(t, idx_p, full_p, U, P) for t in (qp, kp, vp))
        out = unpadded(F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask_p, scale=scale,
                                                      enable_gqa=n_kv != H), idx_p, full_p)
        if S == 0:
            return out
        qs, ks, vs = (padded(t, idx_s, full_s, B, S) for t in (qs, ks, vs))
        ks, vs = torch.cat([per_row(kp), ks], dim=2), torch.cat([per_row(vp), vs], dim=2)
        later_out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask_s, scale=scale, enable_gqa=n_kv != H)
        return torch.cat([out, unpadded(later_out, idx_s, full_s)])

    x = run_layers(embed(ids, final), layers, cos, sin, attend)                  # (n_p + n_s, D)
    # Where each output position's row is in x: a row's last prompt column, then its later columns; padding
    # points at an extra zero row.
    where_p = torch.full((U * P,), n_p + n_s, dtype=torch.long, device=device).index_copy_(
        0, idx_p, torch.arange(n_p, device=device))
    where_s = torch.full((B * S,), n_p + n_s, dtype=torch.long, device=device).index_copy_(
        0, idx_s, torch.arange(n_p, n_p + n_s, device=device))
    where = torch.cat([where_p.view(U, P)[inverse, -1:], where_s.view(B, S)], dim=1)  # (B, S + 1)
    if rows is not None:
        where = where[rows.bool()]
        if bool((where == n_p + n_s).any()):
            raise ValueError("rows asks for the hidden state of a padding position")
    else:
        x = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return final["norm_w"] * _normalize(x.index_select(0, where.reshape(-1)), final["eps"]).view(*where.shape, -1)
