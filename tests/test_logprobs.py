"""Chunked log-probs and entropies: equal to the naive full log-softmax, on tensors and on a tiny Qwen2."""

import math

import pytest
import torch
import torch.nn.functional as F

from grpo_core.model.logprobs import (
    ScoringPath,
    entropy_from_logits,
    selective_log_softmax,
    token_logprobs_and_entropy,
)

F64 = torch.float64


def naive_logps(logits, index, temperature=1.0):
    return F.log_softmax(logits / temperature, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


def naive_entropy(logits, temperature=1.0):
    log_probs = F.log_softmax(logits / temperature, -1)
    return -(log_probs.exp() * log_probs).sum(-1)


def random_logits(dtype, shape=(3, 5, 11), seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)
    index = torch.randint(0, shape[-1], shape[:-1], generator=generator)
    return logits, index


# --- hand-worked --------------------------------------------------------------------------------------------


def test_hand_worked_two_token_distribution():
    # logits [0, ln 3] -> p = [1/4, 3/4]: log p(1) = ln 0.75 = -0.287682,
    #   H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.346574 + 0.215762 = 0.562335
    # temperature 0.5 -> logits [0, 2 ln 3] -> p = [1/10, 9/10]: log p(1) = ln 0.9 = -0.105361
    logits = torch.tensor([[[0.0, math.log(3)]]], dtype=F64)
    index = torch.tensor([[1]])
    assert selective_log_softmax(logits, index).item() == pytest.approx(math.log(0.75), abs=1e-12)
    assert entropy_from_logits(logits).item() == pytest.approx(
        -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    )
    assert selective_log_softmax(logits, index, temperature=0.5).item() == pytest.approx(
        math.log(0.9), abs=1e-12
    )


def test_uniform_logits_give_log_vocab():
    # V = 4 equal logits: log p = -ln 4 = -1.386294 for any token, H = ln 4
    logits = torch.full((2, 3, 4), 7.0, dtype=F64)
    index = torch.tensor([[0, 1, 2], [3, 3, 0]])
    torch.testing.assert_close(
        selective_log_softmax(logits, index), torch.full((2, 3), -math.log(4), dtype=F64)
    )
    torch.testing.assert_close(entropy_from_logits(logits), torch.full((2, 3), math.log(4), dtype=F64))


# --- equal to the naive computation -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_selective_log_softmax_matches_naive(dtype, chunk_size, temperature):
    logits, index = random_logits(dtype)
    result = selective_log_softmax(logits, index, temperature=temperature, chunk_size=chunk_size)
    assert result.dtype == dtype and result.shape == index.shape
    torch.testing.assert_close(result, naive_logps(logits, index, temperature), atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 4, 1000])
def test_entropy_matches_naive(chunk_size):
    logits, _ = random_logits(F64)
    torch.testing.assert_close(
        entropy_from_logits(logits, chunk_size), naive_entropy(logits), atol=1e-12, rtol=0
    )
    torch.testing.assert_close(
        entropy_from_logits(logits, chunk_size, temperature=1.3),
        naive_entropy(logits, 1.3),
        atol=1e-12,
        rtol=0,
    )


def test_gradients_match_naive_through_the_checkpointed_chunks():
    logits, index = random_logits(F64)
    weights = torch.randn(index.shape, dtype=F64)
    chunked = logits.clone().requires_grad_(True)
    naive = logits.clone().requires_grad_(True)
    total_chunked = (selective_log_softmax(chunked, index, 0.8, chunk_size=4) * weights).sum()
    total_chunked = total_chunked + entropy_from_logits(chunked, 3, temperature=0.8).sum()
    total_naive = (naive_logps(naive, index, 0.8) * weights).sum() + naive_entropy(naive, 0.8).sum()
    total_chunked.backward()
    total_naive.backward()
    torch.testing.assert_close(chunked.grad, naive.grad, atol=1e-12, rtol=0)


def saved_bytes_besides(tensor, compute):
    """Bytes of the tensors autograd saves for backward while running compute(), other than tensor's own."""
    own_storage = tensor.untyped_storage().data_ptr()
    saved = {}

    def pack(saved_tensor):
        storage = saved_tensor.untyped_storage()
        if storage.data_ptr() != own_storage:
            saved[storage.data_ptr()] = storage.nbytes()
        return saved_tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda saved_tensor: saved_tensor):
        compute()
    return sum(saved.values())


def test_backward_keeps_no_vocabulary_sized_intermediates():
    # The naive log_softmax keeps its (B, T, V) output for backward; the checkpointed chunks keep only
    # views of the logits and the (B, T) index.
    logits = torch.randn(4, 8, 1000, requires_grad=True)
    index = torch.randint(0, 1000, (4, 8))
    full = logits.numel() * logits.element_size()
    naive = saved_bytes_besides(logits, lambda: naive_logps(logits, index, 0.7))
    chunked = saved_bytes_besides(logits, lambda: selective_log_softmax(logits, index, 0.7, chunk_size=4))
    entropy = saved_bytes_besides(logits, lambda: entropy_from_logits(logits, 4, temperature=0.7))
    assert naive >= full
    assert chunked <= index.numel() * index.element_size() and entropy == 0


def test_bf16_uses_log_softmax_in_bf16_like_trl():
    logits, index = random_logits(torch.bfloat16)
    result = selective_log_softmax(logits, index, chunk_size=4)
    assert result.dtype == torch.bfloat16
    torch.testing.assert_close(result, naive_logps(logits, index))  # the same bf16 arithmetic
    torch.testing.assert_close(result.float(), naive_logps(logits.float(), index), atol=0.05, rtol=0.02)


def test_empty_inputs():
    logits = torch.zeros(0, 5, 7)
    index = torch.zeros(0, 5, dtype=torch.long)
    assert selective_log_softmax(logits, index).shape == (0, 5)
    assert entropy_from_logits(logits).shape == (0, 5)


# --- token_logprobs_and_entropy on a tiny causal LM ---------------------------------------------------------

PROMPT, COMPLETION = 4, 5


@pytest.fixture(scope="module")
def tiny_model():
    from tests.tiny import random_qwen2

    return random_qwen2().to(F64)


@pytest.fixture(scope="module")
def batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 37, (3, PROMPT + COMPLETION), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # left-padded prompt
    attention_mask[1, -2:] = 0  # completion that ended early (right padding)
    return input_ids, attention_mask


def naive_model_logps(model, input_ids, attention_mask, temperature, position_ids=None):
    """Full (B, L, V) logits; logits at position j predict token j + 1."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, -COMPLETION - 1 : -1]
    completion = input_ids[:, -COMPLETION:]
    padding = attention_mask[:, -COMPLETION:] == 0
    logps = naive_logps(logits, completion, temperature).masked_fill(padding, 0.0)
    entropy = naive_entropy(logits, temperature).masked_fill(padding, 0.0)
    return logps, entropy


def test_matches_the_naive_full_logits(tiny_model, batch):
    input_ids, attention_mask = batch
    logps, entropies = token_logprobs_and_entropy(
        tiny_model, input_ids, attention_mask, COMPLETION, temperature=0.7, path=ScoringPath(chunk_size=3)
    )
    expected_logps, expected_entropies = naive_model_logps(tiny_model, input_ids, attention_mask, 0.7)
    assert logps.shape == (3, COMPLETION) and logps.dtype == F64
    torch.testing.assert_close(logps, expected_logps, atol=1e-10, rtol=0)
    torch.testing.assert_close(entropies, expected_entropies, atol=1e-10, rtol=0)
    assert (logps[1, -2:] == 0).all() and (entropies[1, -2:] == 0).all()  # padding, as TRL 1.16


def test_parameter_gradients_match_naive(tiny_model, batch):
    input_ids, attention_mask = batch
    weights = torch.randn(3, COMPLETION, dtype=F64)
    parameters = [p for p in tiny_model.parameters() if p.requires_grad]
    logps, entropies = token_logprobs_and_entropy(
        tiny_model, input_ids, attention_mask, COMPLETION, 0.7, path=ScoringPath(chunk_size=2)
    )
    grads = torch.autograd.grad((logps * weights).sum() + entropies.sum(), parameters)
    naive_lp, naive_ent = naive_model_logps(tiny_model, input_ids, attention_mask, 0.7)
    naive_grads = torch.autograd.grad((naive_lp * weights).sum() + naive_ent.sum(), parameters)
    for grad, naive_grad in zip(grads, naive_grads):
        torch.testing.assert_close(grad, naive_grad, atol=1e-10, rtol=1e-8)


class NoLogitsToKeep(torch.nn.Module):
    """A causal LM whose forward has no `logits_to_keep` argument: full logits come back."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def test_models_without_logits_to_keep_give_the_same(tiny_model, batch):
    input_ids, attention_mask = batch
    with torch.no_grad():
        expected = token_logprobs_and_entropy(tiny_model, input_ids, attention_mask, COMPLETION)
        wrapped = token_logprobs_and_entropy(
            NoLogitsToKeep(tiny_model), input_ids, attention_mask, COMPLETION
        )
    torch.testing.assert_close(wrapped, expected, atol=1e-12, rtol=0)


def test_position_ids_are_passed_to_the_model(tiny_model, batch):
    input_ids, attention_mask = batch
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    # RoPE sees only relative distances: a uniform shift would change nothing, stretching them does.
    with torch.no_grad():
        default, _ = token_logprobs_and_entropy(tiny_model, input_ids, attention_mask, COMPLETION)
        same, _ = token_logprobs_and_entropy(
            tiny_model, input_ids, attention_mask, COMPLETION, position_ids=positions
        )
        shifted, _ = token_logprobs_and_entropy(
            tiny_model, input_ids, attention_mask, COMPLETION, position_ids=positions * 3
        )
        expected, _ = naive_model_logps(
            tiny_model, input_ids, attention_mask, 1.0, position_ids=positions * 3
        )
    torch.testing.assert_close(same, default, atol=1e-12, rtol=0)
    torch.testing.assert_close(shifted, expected, atol=1e-10, rtol=0)
    assert not torch.allclose(shifted, default)


def test_half_precision_model_is_scored_in_float32(tiny_model, batch):
    input_ids, attention_mask = batch
    model = NoLogitsToKeep(tiny_model.to(torch.bfloat16))
    try:
        with torch.no_grad():
            logps, entropies = token_logprobs_and_entropy(
                model, input_ids, attention_mask, COMPLETION, 0.7, path=ScoringPath(chunk_size=2)
            )
            bf16_logits = model(input_ids, attention_mask).logits[:, -COMPLETION - 1 : -1].float()
    finally:
        tiny_model.to(F64)
    assert logps.dtype == torch.float32 and entropies.dtype == torch.float32
    padding = attention_mask[:, -COMPLETION:] == 0
    expected = naive_logps(bf16_logits, input_ids[:, -COMPLETION:], 0.7).masked_fill(padding, 0.0)
    torch.testing.assert_close(logps, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        entropies, naive_entropy(bf16_logits, 0.7).masked_fill(padding, 0.0), atol=1e-5, rtol=0
    )


def test_compute_entropy_false_returns_none(tiny_model, batch):
    input_ids, attention_mask = batch
    with torch.no_grad():
        _, entropies = token_logprobs_and_entropy(
            tiny_model, input_ids, attention_mask, 2, compute_entropy=False
        )
    assert entropies is None


# --- bad inputs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"logits_to_keep": 0}, "logits_to_keep"),
        ({"logits_to_keep": PROMPT + COMPLETION}, "logits_to_keep"),
        ({"attention_mask": torch.ones(3, 2, dtype=torch.long)}, "attention_mask"),
        ({"position_ids": torch.zeros(3, 2, dtype=torch.long)}, "position_ids"),
        ({"temperature": 0.0}, "temperature"),
        ({"path": ScoringPath(chunk_size=0)}, "chunk_size"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(tiny_model, batch, changes, named):
    input_ids, attention_mask = batch
    arguments = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "logits_to_keep": COMPLETION,
    } | changes
    with pytest.raises(ValueError, match=named):
        token_logprobs_and_entropy(tiny_model, **arguments)


def test_selective_log_softmax_rejects_a_misshapen_index():
    with pytest.raises(ValueError, match="index"):
        selective_log_softmax(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))
