"""The hand-written Qwen2/Llama forward (grpo_core/model/fastforward.py) against the HF forward: the same
per-token log-probs, entropies and parameter gradients; models it cannot reproduce fall back to HF."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo_core.model import fastforward
from grpo_core.model.logprobs import ScoringPath, token_logprobs_and_entropy
from grpo_core.train.forward import policy_logprobs
from tests.test_decode import llama, qwen2
from tests.tiny import as_round, logprob_options, random_qwen2

PAD = 0


def grpo_batch(G: int = 3, completion: int = 7, seed: int = 0):
    """Prompts of different lengths (left padding), each repeated G times on adjacent rows (a GRPO group),
    plus a row whose prompt equals the first group's but is not adjacent to it; completions end early
    (right padding after EOS) on some rows."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 37, (n,), generator=g).tolist() for n in (3, 9, 5, 7)]
    rows = [p for p in prompts for _ in range(G)] + [prompts[0]]
    P = max(map(len, rows))
    prompt_ids = torch.tensor([[PAD] * (P - len(p)) + p for p in rows])
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in rows])
    completion_ids = torch.randint(2, 37, (len(rows), completion), generator=g)
    completion_mask = torch.ones_like(completion_ids)
    for i in range(0, len(rows), 2):  # every other row stops early
        completion_mask[i, completion - 1 - i % completion:] = 0
    completion_ids = completion_ids.masked_fill(completion_mask == 0, PAD)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask}


def scored(model, mb, forward, grad=True, temperature=0.7, padding_free=True):
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        logps, entropy, mask = policy_logprobs(model, as_round(mb), logprob_options(
            temperature=temperature, forward_backend=forward, padding_free=padding_free),
                                               compute_entropy=True)
        if grad:
            weights = torch.linspace(-1.0, 1.0, logps.numel()).view_as(logps)
            ((logps * weights).sum() + 0.3 * entropy.sum()).backward()
    grads = ({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None} if grad
             else {})
    return logps.detach(), entropy.detach(), grads


MODELS = [qwen2, llama, random_qwen2, lambda: qwen2(num_key_value_heads=4, tie_word_embeddings=True)]
IDS = ["qwen2-gqa", "llama-tied-bias", "qwen2-1layer", "qwen2-mha-tied"]


@pytest.mark.parametrize("make", MODELS, ids=IDS)
def test_logprobs_entropies_and_gradients_match_hf(make):
    model = make().train()  # train mode, as in the training loop (no dropout in these models)
    mb = grpo_batch()
    assert fastforward.use_manual_forward(model, "auto")
    hf_logps, hf_entropy, hf_grads = scored(model, mb, "hf")
    logps, entropy, grads = scored(model, mb, "manual")
    assert (logps != 0).sum() > 40
    assert (logps - hf_logps).abs().max() < 1e-5
    assert (entropy - hf_entropy).abs().max() < 1e-5
    assert set(grads) == set(hf_grads) == {n for n, p in model.named_parameters() if p.requires_grad}
    for name, g in grads.items():
        ref = hf_grads[name]
        assert (g - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-9, name
    # no grad (reference / old log-probs): the same numbers
    nograd_logps, _, _ = scored(model, mb, "manual", grad=False)
    assert (nograd_logps - hf_logps).abs().max() < 1e-5


@pytest.mark.parametrize("prefix", [1, 4, 9])
def test_hidden_states_equal_the_backbone_from_any_prefix(prefix):
    model = qwen2()
    mb = grpo_batch(G=2)
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    with torch.no_grad():
        ref = model.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                          use_cache=False).last_hidden_state
        ours = fastforward.hidden_states(model, ids, mask, prefix=prefix)
    assert ours.shape == (ids.shape[0], ids.shape[1] - prefix + 1, ref.shape[-1])
    real = mask[:, prefix - 1:].bool()  # padding positions are never read by a real token
    assert (ours - ref[:, prefix - 1:])[real].abs().max() < 1e-5


def test_last_completion_token_only():
    """logits_to_keep = 1: the forward covers the prompt alone (no later tokens)."""
    model = random_qwen2()
    ids = torch.tensor([[PAD, 5, 6, 7], [8, 9, 10, 11]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    hf, _ = token_logprobs_and_entropy(model, ids, mask, 1, path=ScoringPath(forward="hf"))
    ours, _ = token_logprobs_and_entropy(model, ids, mask, 1, path=ScoringPath(forward="manual"))
    assert (hf - ours).abs().max() < 1e-5


def test_unsupported_models_fall_back_to_hf(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the hand-written forward ran")

    monkeypatch.setattr("grpo_core.model.logprobs.hidden_states", refuse)
    mb = grpo_batch()
    checkpointed = qwen2().train()
    checkpointed.gradient_checkpointing_enable()
    dropout = qwen2(attention_dropout=0.1)
    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=37, hidden_size=32, intermediate_size=48,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           use_sliding_window=True, sliding_window=4,
                                           max_window_layers=0)).eval()
    patched = qwen2()
    # an instance attribute: a wrapped forward (accelerate autocast does so)
    patched.forward = patched.forward
    for model in (checkpointed, dropout, sliding, patched):
        assert not fastforward.use_manual_forward(model, "auto")
        with pytest.raises(ValueError, match="cannot run"):
            fastforward.use_manual_forward(model, "manual")
        scored(model, mb, "auto")  # the HF path: no AssertionError
    plain = qwen2()
    assert not fastforward.use_manual_forward(plain, "hf")
    scored(plain, mb, "hf")
    with pytest.raises(ValueError, match="forward backend"):
        fastforward.use_manual_forward(plain, "fast")


def test_wrapped_module_is_not_supported():
    """A wrapper (PEFT, DDP) is not the plain class: HF path."""
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

    assert fastforward.unsupported_reason(Wrapper(qwen2())) is not None


def test_padding_tokens_never_reach_the_dense_layers(monkeypatch):
    """Padding-free: the rows through the matmuls are the distinct prompts' real tokens plus every row's real
    later tokens, counted here from the batch's masks."""
    model = qwen2()
    mb = grpo_batch()  # prompts of 3, 9, 5, 7 tokens, G = 3 each, then the first prompt again (not adjacent)
    seen = []
    real_run_layers = fastforward.run_layers

    def counting(x, *args, **kwargs):
        seen.append(x.shape[0])
        return real_run_layers(x, *args, **kwargs)

    monkeypatch.setattr(fastforward, "run_layers", counting)
    with torch.no_grad():
        logps, _, mask = policy_logprobs(model, as_round(mb),
                                         logprob_options(temperature=1.0, forward_backend="manual"),
                                         compute_entropy=False)
    width = mask.shape[1]
    later = int(mb["completion_mask"][:, :width - 1].sum())  # the last completion column is never an input
    assert seen == [(3 + 9 + 5 + 7 + 3) + later]
    assert (logps[mask == 0] == 0).all() and (logps[mask == 1] != 0).all()


def test_packed_rows_equal_the_padded_output():
    model = qwen2()
    mb = grpo_batch()
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    P = mb["prompt_ids"].shape[1]
    wanted = mask[:, P - 1:].bool()
    with torch.no_grad():
        padded = fastforward.hidden_states(model, ids, mask, prefix=P)
        packed = fastforward.hidden_states(model, ids, mask, prefix=P, rows=wanted)
    assert packed.shape == (int(wanted.sum()), padded.shape[-1])
    assert torch.equal(packed, padded[wanted])
    assert (padded[~wanted] == 0).all()  # padding positions: zeros, never NaN
    with pytest.raises(ValueError, match="padding position"):
        fastforward.hidden_states(model, ids, mask, prefix=P, rows=torch.ones_like(wanted))
    with pytest.raises(ValueError, match="rows must be"):
        fastforward.hidden_states(model, ids, mask, prefix=P, rows=wanted[:, 1:])


def test_equal_groups_match_hf_gradients():
    """G rows per prompt, every group complete (the trainer's case): the prompt's keys and values are expanded
    to the group's rows, their gradient summed back."""
    model = qwen2().train()
    mb = {k: v[:-1] for k, v in grpo_batch(G=4).items()}  # drop the lone non-adjacent row
    hf_logps, hf_entropy, hf_grads = scored(model, mb, "hf")
    logps, entropy, grads = scored(model, mb, "manual")
    assert (logps - hf_logps).abs().max() < 1e-5 and (entropy - hf_entropy).abs().max() < 1e-5
    for name, g in grads.items():
        assert (g - hf_grads[name]).abs().max() <= 1e-5 * hf_grads[name].abs().max() + 1e-9, name


def test_padding_free_off_runs_every_column_with_the_same_numbers(monkeypatch):
    """``train.padding_free: false``: every column through the matmuls, the same log-probs."""
    model = qwen2()
    mb = grpo_batch()
    on, _, _ = scored(model, mb, "manual", grad=False)
    seen = []
    real_run_layers = fastforward.run_layers
    monkeypatch.setattr(fastforward, "run_layers",
                        lambda x, *a, **k: seen.append(x.shape[0]) or real_run_layers(x, *a, **k))
    off, _, _ = scored(model, mb, "manual", grad=False, padding_free=False)
    U, P, B, K = 5, mb["prompt_ids"].shape[1], mb["prompt_ids"].shape[0], off.shape[1]
    assert seen == [U * P + B * (K - 1)]
    assert (on - off).abs().max() < 1e-5
