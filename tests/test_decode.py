"""The hand-written decode loop (grpo_core/rollout/manual.py) against HF: same tokens, same logits,
same conventions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpo_core.rollout import HFGenerateBackend, SamplingParams, default_backend
from grpo_core.rollout.manual import ManualDecodeBackend, supports, unsupported_reason
from tests.tiny import random_qwen2

PAD, EOS = 0, 1
TOK = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
# Different lengths: rows are left-padded to the longest (3 to 9 tokens).
PROMPTS = [[5, 9, 11], [7, 3, 22, 8, 30, 2, 14, 6, 19], [12, 4, 4, 25, 17], [33, 21, 9, 10, 2, 8, 3]]
GREEDY = SamplingParams(max_new_tokens=12, do_sample=False)


def qwen2(**overrides):
    """Two layers, GQA (4 query heads on 2 KV heads), q/k/v bias, untied head, rope theta 1e4."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0)
    return Qwen2ForCausalLM(Qwen2Config(**{**cfg, **overrides})).eval()


def llama():
    """Llama: GQA, attention and MLP biases, tied head, its own rope theta."""
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                         attention_bias=True, mlp_bias=True, tie_word_embeddings=True, rope_theta=500.0)
    return LlamaForCausalLM(config).eval()


def hf_logits(model, batch) -> torch.Tensor:
    """HF forward over prompt + completion: (N, C, V) logits predicting each completion token."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, torch.ones_like(batch.completion_ids)], dim=1)
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
    P = batch.prompt_ids.shape[1]
    return logits[:, P - 1:-1].float()


@pytest.mark.parametrize("make", [qwen2, llama, random_qwen2], ids=["qwen2-gqa", "llama", "qwen2-1layer"])
def test_greedy_tokens_and_per_step_logits_match_hf(make):
    model = make()
    hf = HFGenerateBackend(model, TOK).generate(PROMPTS, 2, GREEDY)
    manual = ManualDecodeBackend(model, TOK)
    manual.record_logits = []
    ours = manual.generate(PROMPTS, 2, GREEDY)
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "is_truncated"):
        assert torch.equal(getattr(hf, name), getattr(ours, name)), name
    # Every step's logits equal the HF forward's at that position (rows still running; fp32).
    steps = torch.stack(manual.record_logits, dim=1)                       # (N, C, V)
    reference = hf_logits(model, ours)
    running = ours.completion_mask.bool()
    assert running.sum() > 20
    assert (steps - reference)[running].abs().max() < 1e-5


def test_eos_early_stop_and_masks_follow_hf_conventions():
    model = random_qwen2(vocab_size=37, seed=0)
    sampling = SamplingParams(max_new_tokens=10, do_sample=False)
    prompts = [[5 + i % 30, 7, (3 * i) % 30 + 2][: 1 + i % 3] for i in range(12)]
    hf = HFGenerateBackend(model, TOK).generate(prompts, 1, sampling)
    ours = ManualDecodeBackend(model, TOK).generate(prompts, 1, sampling)
    assert (torch.equal(hf.completion_ids, ours.completion_ids)
            and torch.equal(hf.completion_mask, ours.completion_mask))
    assert torch.equal(hf.is_truncated, ours.is_truncated)
    assert 0 < int(ours.is_truncated.sum()) < len(prompts)  # both kinds of rows are exercised
    for row in range(len(prompts)):
        n = int(ours.completion_lengths[row])
        assert (ours.completion_ids[row, n:] == PAD).all()
        assert (ours.completion_ids[row, n - 1] == EOS) != bool(ours.is_truncated[row])
    # Every row ends early: the loop stops at the last row's EOS, as HF generate does.
    with torch.no_grad():
        model.lm_head.weight[EOS] = 0
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(37).index_fill_(0, torch.tensor([EOS]), 50.0))
    assert supports(model)  # an LM head with a bias is still a plain Linear
    hf = HFGenerateBackend(model, TOK).generate(prompts, 1, sampling)
    ours = ManualDecodeBackend(model, TOK).generate(prompts, 1, sampling)
    assert ours.completion_ids.shape == hf.completion_ids.shape == (12, 1)
    assert torch.equal(hf.completion_ids, ours.completion_ids) and not ours.is_truncated.any()


def test_min_new_tokens_from_generation_config_masks_eos_as_hf_does():
    model = random_qwen2(vocab_size=37, seed=0)
    with torch.no_grad():  # EOS would be the first token of every row
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(37).index_fill_(0, torch.tensor([EOS]), 3.0))
    model.generation_config.min_new_tokens = 6
    sampling = SamplingParams(max_new_tokens=9, do_sample=False)
    hf = HFGenerateBackend(model, TOK).generate(PROMPTS, 2, sampling)
    ours = ManualDecodeBackend(model, TOK).generate(PROMPTS, 2, sampling)
    assert torch.equal(hf.completion_ids, ours.completion_ids)
    assert not (ours.completion_ids[:, :6] == EOS).any() and (ours.completion_lengths >= 7).all()
    model.generation_config.min_new_tokens = None
    assert (ManualDecodeBackend(model, TOK).generate(PROMPTS, 2, sampling).completion_lengths == 1).all()


@pytest.mark.parametrize("temperature,top_k,top_p,min_p",
                         [(1.0, 0, 1.0, 0), (0.7, 0, 1.0, 0), (1.3, 5, 1.0, 0),
                          (1.0, 0, 0.8, 0), (0.9, 7, 0.5, 0), (1.0, 100, 1.0, 0),
                          (1.0, 0, 1.0, 0.1), (0.6, 9, 0.9, 0.05)])
def test_warp_equals_hf_warpers(temperature, top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 37) * 3
    logits[0, :4] = logits[0, 4]  # ties at the top-k / top-p boundary
    hf = LogitsProcessorList()
    if temperature != 1.0:
        hf.append(TemperatureLogitsWarper(temperature))
    if top_k:
        hf.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        hf.append(TopPLogitsWarper(top_p))
    if min_p:
        hf.append(MinPLogitsWarper(min_p))
    expected = hf(None, logits.clone())
    got = ManualDecodeBackend.warp(logits.clone(), SamplingParams(8, temperature, top_p, top_k, min_p=min_p))
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    assert torch.allclose(got[~torch.isinf(got)], expected[~torch.isinf(expected)])
    # something was masked (top_k beyond the vocabulary masks nothing)
    if 0 < top_k < 37 or top_p < 1.0 or min_p:
        assert torch.isinf(got).any()


def test_repetition_penalty_equals_hf_processor_and_hf_generate():
    # the processor on one step: the prompt's real tokens (not its left padding) and the sampled ones
    torch.manual_seed(0)
    logits = torch.randn(2, 37) * 3
    ids, mask = torch.tensor([[PAD, PAD, 5, 9], [7, 3, 22, 5]]), torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    seen = ManualDecodeBackend._prompt_tokens(ids, mask, 37)
    # HF's processor row by row, each told its own left padding (a per-row tensor needs transformers >= 5.20)
    hf = torch.cat(
        [RepetitionPenaltyLogitsProcessor(1.7, prompt_ignore_length=int(pad))(ids[r:r + 1],
                                                                              logits[r:r + 1].clone())
         for r, pad in enumerate((mask == 0).sum(1))])
    assert torch.equal(ManualDecodeBackend.penalize_repetition(logits, seen, 1.7), hf)
    assert not seen[0, PAD] and seen[0, 5] and seen[1, 22]
    # whole decodes: greedy tokens equal HF generate's, and the penalty changes them
    model = qwen2()
    penalized = SamplingParams(max_new_tokens=12, do_sample=False, repetition_penalty=1.8)
    ours = ManualDecodeBackend(model, TOK).generate(PROMPTS, 2, penalized)
    assert torch.equal(ours.completion_ids,
                       HFGenerateBackend(model, TOK).generate(PROMPTS, 2, penalized).completion_ids)
    assert not torch.equal(ours.completion_ids,
                           ManualDecodeBackend(model, TOK).generate(PROMPTS, 2, GREEDY).completion_ids)


def test_min_p_one_keeps_only_the_top_token():
    model = qwen2()
    for backend in (ManualDecodeBackend(model, TOK), HFGenerateBackend(model, TOK)):
        torch.manual_seed(0)
        sampled = backend.generate(PROMPTS, 3, SamplingParams(max_new_tokens=12, temperature=1.5, min_p=1.0))
        assert torch.equal(sampled.completion_ids, backend.generate(PROMPTS, 3, GREEDY).completion_ids)


def test_generation_kwargs_reach_hf_generate_and_the_manual_loop_refuses_them():
    from grpo_core.rollout import backend_for
    from tests.tiny import generation_options

    model = qwen2()
    plain = HFGenerateBackend(model, TOK).generate(PROMPTS, 1, GREEDY)
    banned = int(plain.completion_ids[0, 0])
    kept = HFGenerateBackend(model, TOK).generate(
        PROMPTS, 1,
        SamplingParams(max_new_tokens=12, do_sample=False, generation_kwargs={"suppress_tokens": [banned]}))
    assert not (kept.completion_ids == banned).any() and (plain.completion_ids == banned).any()
    with pytest.raises(ValueError, match="takes no generation_kwargs"):
        ManualDecodeBackend(model, TOK).generate(PROMPTS, 1,
                                                 SamplingParams(8,
                                                                generation_kwargs={"suppress_tokens": [3]}))
    assert isinstance(backend_for(model, TOK, generation_options(), seed=0, max_prompt_length=None),
                      ManualDecodeBackend)
    chosen = backend_for(model, TOK, generation_options(generation_kwargs={"suppress_tokens": [3]}), seed=0,
                         max_prompt_length=None)
    assert isinstance(chosen, HFGenerateBackend)


def test_sample_draws_from_softmax_and_never_a_masked_token():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    logits = probs.log().expand(40000, -1).contiguous()   # log 0 = -inf: masked tokens
    torch.manual_seed(0)
    tokens = ManualDecodeBackend.sample(logits)
    freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
    assert freq[1] == 0 and freq[5] == 0
    assert (freq - probs).abs().max() < 0.01   # 4 standard errors of the largest frequency


def exact_two_token_distribution(model, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(completion) of every completion of at most 2 tokens, by HF forwards on the unpadded prompt: p(t1)
    p(t2 | t1), and p(EOS) alone for a completion that ends at once. Worked out without any sampling."""
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].float().softmax(-1)                         # (V,)
        V = first.shape[0]
        rows = torch.tensor([prompt + [t] for t in range(V)])
        second = model(rows).logits[:, -1].float().softmax(-1)                                        # (V, V)
    exact = {(EOS,): float(first[EOS])}
    exact.update({(a, b): float(first[a] * second[a, b]) for a in range(V) if a != EOS for b in range(V)})
    return exact


@pytest.mark.parametrize("backend", [ManualDecodeBackend, HFGenerateBackend], ids=["manual", "hf"])
def test_sampled_sequences_follow_the_models_distribution(backend):
    """Whole sampled completions (2 tokens; left-padded prompts of different lengths in one batch, the EOS
    ending a row early) against their exact probabilities: a chi-square goodness-of-fit per prompt. HF
    generate is held to the same test: both backends sample the model's distribution, and differ only in their
    random streams."""
    from scipy.stats import chisquare

    model = qwen2()
    with torch.no_grad():  # a peaked, uneven distribution (a random init is near uniform: a weak test)
        model.lm_head.weight.mul_(20.0)
    G = 3000
    torch.manual_seed(0)
    batch = backend(model, TOK).generate(PROMPTS, G, SamplingParams(max_new_tokens=2, temperature=1.0))
    for p, prompt in enumerate(PROMPTS):
        exact = exact_two_token_distribution(model, prompt)
        counts: dict[tuple[int, ...], int] = {}
        for ids, mask in zip(batch.completion_ids[p * G:(p + 1) * G],
                             batch.completion_mask[p * G:(p + 1) * G]):
            key = tuple(ids[mask.bool()].tolist())
            counts[key] = counts.get(key, 0) + 1
        assert set(counts) <= set(exact)  # nothing outside the support (e.g. a pad sampled after EOS)
        frequent = [k for k, q in exact.items() if q * G >= 5]      # cells too rare for chi-square are pooled
        observed = [counts.get(k, 0) for k in frequent] + [G - sum(counts.get(k, 0) for k in frequent)]
        expected = [exact[k] * G for k in frequent] + [G * (1 - sum(exact[k] for k in frequent))]
        assert len(frequent) > 20  # a distribution with many likely completions, not one dominant token
        result = chisquare(observed, [e * G / sum(expected) for e in expected])
        assert result.pvalue > 1e-3, f"prompt {p}: sampled completions do not follow the model ({result})"


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = qwen2()
    backend = ManualDecodeBackend(model, TOK)
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0)
    torch.manual_seed(3)
    a = backend.generate(PROMPTS, 4, sampling)
    torch.manual_seed(3)
    b = backend.generate(PROMPTS, 4, sampling)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert len({tuple(r.tolist()) for r in a.completion_ids[:4]}) > 1  # a group's samples differ
    top1 = backend.generate(PROMPTS, 2, SamplingParams(max_new_tokens=12, top_k=1))
    assert torch.equal(top1.completion_ids, backend.generate(PROMPTS, 2, GREEDY).completion_ids)


def test_training_updates_are_seen_and_chunks_change_nothing():
    model = qwen2()
    backend = ManualDecodeBackend(model, TOK, max_batch_size=3)
    before = backend.generate(PROMPTS, 2, GREEDY)
    assert torch.equal(before.completion_ids,
                       ManualDecodeBackend(model, TOK).generate(PROMPTS, 2, GREEDY).completion_ids)
    with torch.no_grad():  # an optimizer step, in place
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    after = backend.generate(PROMPTS, 2, GREEDY)
    assert not torch.equal(before.completion_ids, after.completion_ids)
    assert torch.equal(after.completion_ids,
                       HFGenerateBackend(model, TOK).generate(PROMPTS, 2, GREEDY).completion_ids)


class Wrapper(torch.nn.Module):  # stands in for a PEFT wrapper
    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config


@pytest.mark.parametrize("make,why", [
    (lambda: qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0), "sliding"),
    (lambda: qwen2(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope"),
    (lambda: qwen2(hidden_act="gelu"), "hidden_act"),
    (lambda: Wrapper(qwen2()), "not a plain"),
])
def test_unsupported_models_fall_back_to_hf(make, why):
    model = make()
    assert not supports(model) and why in unsupported_reason(model)
    assert isinstance(default_backend(model, TOK), HFGenerateBackend)
    with pytest.raises(ValueError, match="cannot run this model"):
        default_backend(model, TOK, "manual")


def test_default_backend_choice():
    model = qwen2()
    assert isinstance(default_backend(model, TOK), ManualDecodeBackend)      # CPU, supported
    assert isinstance(default_backend(model, TOK, "hf"), HFGenerateBackend)
    model.generation_config.no_repeat_ngram_size = 3                         # a processor we do not reproduce
    assert isinstance(default_backend(model, TOK), HFGenerateBackend)
    with pytest.raises(ValueError, match="auto, hf, manual or vllm"):
        default_backend(model, TOK, "sglang")
