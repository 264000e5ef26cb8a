"""Rollouts: masks, padding, grouping — and the log-probs the loss uses are those the samples came from."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo_core.model.loading import ModelConfig, load_policy
from grpo_core.model.logprobs import token_logprobs_and_entropy
from grpo_core.rollout import (
    HFGenerateBackend,
    SamplingParams,
    completion_mask_from_eos,
    decode_completions,
    left_pad,
    pad_and_eos_ids,
)
from grpo_core.train.forward import policy_logprobs
from tests.tiny import as_round, logprob_options, make_tiny_model

EOS = 9


def test_completion_mask_includes_the_first_eos_and_nothing_after():
    ids = torch.tensor([
        [5, 6, EOS, 7, EOS],   # EOS at 2 -> mask 1,1,1,0,0
        [EOS, 1, 1, 1, 1],     # EOS first -> only it counts
        [5, 5, 5, 5, 5],       # no EOS -> truncated, all ones
    ])
    mask, truncated = completion_mask_from_eos(ids, [EOS])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]


def test_completion_mask_accepts_several_eos_ids():
    mask, truncated = completion_mask_from_eos(torch.tensor([[3, 8, 1], [3, 3, 9]]), [8, 9])
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1]] and truncated.tolist() == [False, False]


def test_left_pad_aligns_prompt_ends():
    ids, mask = left_pad([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("m") / "model")
    model, tokenizer = load_policy(ModelConfig(name_or_path=str(path)))
    return model, tokenizer


def test_generate_groups_rows_and_stops_at_eos(policy):
    model, tokenizer = policy
    backend = HFGenerateBackend(model, tokenizer)
    prompts = [tokenizer("Mia has 3 apples")["input_ids"], tokenizer("2 + 2?")["input_ids"]]
    torch.manual_seed(0)
    batch = backend.generate(prompts, num_generations=3, sampling=SamplingParams(max_new_tokens=12))
    assert batch.prompt_ids.shape[0] == batch.completion_ids.shape[0] == 6
    # rows 0-2 are prompt 0's, rows 3-5 prompt 1's (left padded to the longer prompt)
    for row in range(3):
        assert batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist() == prompts[0]
        assert batch.prompt_ids[row + 3][batch.prompt_mask[row + 3].bool()].tolist() == prompts[1]
    lengths = batch.completion_lengths
    for row in range(6):
        n = int(lengths[row])
        ended = batch.completion_ids[row, n - 1].item() == tokenizer.eos_token_id
        assert ended != bool(batch.is_truncated[row])
        assert (batch.completion_ids[row, n:] == tokenizer.pad_token_id).all()
    assert len(decode_completions(tokenizer, batch)) == 6


def test_training_logprobs_equal_sampling_logprobs_with_left_padding(policy):
    """The loss's log-probs must describe the distribution the tokens were drawn from.

    Greedy decoding with output_scores gives the sampler's own (temperature-free) log-softmax at each
    step; recomputing them with the training forward (position ids from the attention mask) must agree
    for prompts of different lengths. The check is sensitive: positions 0..L-1 that ignore the left
    padding (a classic bug) give the short, padded prompt different log-probs.
    """
    model, tokenizer = policy
    prompts = [tokenizer("Q: what is what is 17 + 25?")["input_ids"], tokenizer("3 + 4?")["input_ids"]]
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             output_scores=True, return_dict_in_generate=True,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=[-1])  # never stop early
    completion = out.sequences[:, ids.shape[1]:]
    scores = torch.stack(out.scores, dim=1).log_softmax(-1)  # (B, C, V)
    sampler_logps = scores.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    mb = {"prompt_ids": ids, "prompt_mask": mask, "completion_ids": completion,
          "completion_mask": torch.ones_like(completion)}
    with torch.no_grad():
        train_logps, _, _ = policy_logprobs(model, as_round(mb), logprob_options(temperature=1.0),
                                            compute_entropy=False)
    torch.testing.assert_close(train_logps, sampler_logps, atol=1e-4, rtol=0)

    input_ids = torch.cat([ids, completion], 1)
    naive_positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    with torch.no_grad():
        naive, _ = token_logprobs_and_entropy(model, input_ids, torch.ones_like(input_ids), logits_to_keep=6,
                                              position_ids=naive_positions, compute_entropy=False)
    assert (naive[1] - sampler_logps[1]).abs().max() > 1e-3  # the padded row is off
    torch.testing.assert_close(naive[0], sampler_logps[0], atol=1e-4, rtol=0)  # the unpadded row is not


def test_pad_and_eos_ids_for_every_backend():
    assert pad_and_eos_ids(SimpleNamespace(pad_token_id=0, eos_token_id=9)) == (0, [9])
    assert pad_and_eos_ids(SimpleNamespace(pad_token_id=None, eos_token_id=9)) == (9, [9])  # pad with the EOS
    assert pad_and_eos_ids(SimpleNamespace(pad_token_id=0, eos_token_id=[9, 7])) == (0, [9, 7])
    assert pad_and_eos_ids(SimpleNamespace(pad_token_id=0, eos_token_id=9), [4, 5]) == (0, [4, 5])
    from grpo_core.rollout.manual import ManualDecodeBackend
    from grpo_core.rollout.vllm import VLLMBackend
    from tests.tiny import random_qwen2

    model = random_qwen2()
    for tok in (SimpleNamespace(pad_token_id=None, eos_token_id=None),
                SimpleNamespace(pad_token_id=0, eos_token_id=None)):
        for backend in (HFGenerateBackend, ManualDecodeBackend,
                        lambda m, t: VLLMBackend(m, t, engine=object())):
            with pytest.raises(ValueError, match="neither an EOS nor a pad token"):
                backend(model, tok)

