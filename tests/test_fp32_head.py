"""train.cast_lm_head_to_fp32 (TRL's option, the ScaleRL recipe): the LM head computes float32 logits under
bf16 autocast and over bf16 weights, on every log-prob path, with the state-dict keys unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from grpo_core.model.loading import Float32Head, cast_lm_head_to_fp32
from grpo_core.model.logprobs import ScoringPath, token_logprobs_and_entropy
from tests.test_decode import llama, qwen2
from tests.tiny import make_prompts, make_tiny_model, read_log

REPO = Path(__file__).resolve().parents[1]


def test_the_head_computes_in_float32_under_bf16_autocast():
    head = torch.nn.Linear(16, 37)
    x = torch.randn(5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = head(x)
        head.__class__ = Float32Head
        exact = head(x)
    assert plain.dtype == torch.bfloat16 and exact.dtype == torch.float32
    assert torch.equal(exact, F.linear(x, head.weight, head.bias))
    assert not torch.equal(plain.float(), exact)


def float32_head_logps(model, ids, mask, k, manual):
    """By hand: the backbone's last hidden states (its own dtype; the hand-written stack's for the manual
    path, whose bf16 kernels round differently), then a float32 head and log-softmax."""
    from grpo_core.model.fastforward import hidden_states

    with torch.no_grad():
        if manual:
            hidden = hidden_states(model, ids[:, :-1], mask[:, :-1], prefix=ids.shape[1] - k)
        else:
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -k - 1:-1]
        logits = F.linear(hidden.float(), model.lm_head.weight.float())
    return logits.log_softmax(-1).gather(-1, ids[:, -k:, None]).squeeze(-1)


@pytest.mark.parametrize("path", [dict(forward="hf", fused_head=False), dict(forward="hf", fused_head=True),
                                  dict(forward="manual", fused_head=True)],
                         ids=["hf-logits", "fused", "manual"])
def test_every_log_prob_path_takes_the_float32_head_over_bf16_weights(path):
    model = qwen2().to(torch.bfloat16)  # an untied head
    ids = torch.randint(2, 37, (3, 10))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        before, _ = token_logprobs_and_entropy(model, ids, mask, logits_to_keep=4, compute_entropy=False,
                                               path=ScoringPath(**path))
    head = cast_lm_head_to_fp32(model)
    assert head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.bfloat16
    with torch.no_grad():
        after, _ = token_logprobs_and_entropy(model, ids, mask, logits_to_keep=4, compute_entropy=False,
                                              path=ScoringPath(**path))
    expected = float32_head_logps(model, ids, mask, 4, manual=path["forward"] == "manual")
    assert torch.allclose(after, expected, atol=1e-5)
    assert (before - expected).abs().max() > 10 * (after - expected).abs().max()


def test_a_tied_head_keeps_its_embedding_and_still_computes_in_float32():
    model = llama().to(torch.bfloat16)
    head = cast_lm_head_to_fp32(model)
    assert head.weight is model.model.embed_tokens.weight and head.weight.dtype == torch.bfloat16
    assert head(torch.randn(2, 32, dtype=torch.bfloat16)).dtype == torch.float32
    assert list(model.state_dict()) == list(llama().state_dict())


# one bf16 run per process: accelerate's mixed-precision state is process-wide (a stage is a process too)
RUN = """
import sys
from grpo_core.train.loop import train
from tests.tiny import tiny_config
model_dir, data, root, cast = sys.argv[1:5]
cfg = tiny_config(model_dir, data, [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}],
                  max_steps=2, mixed_precision="bf16", cast_lm_head_to_fp32=cast == "1", beta=0.04)
train(cfg, root=root, progress=False)
"""


def test_training_with_it_under_bf16_keeps_the_checkpoint_layout(tmp_path):
    from safetensors.torch import load_file

    model_dir, data = make_tiny_model(tmp_path / "model"), make_prompts(tmp_path / "p.jsonl")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for cast in ("0", "1"):
        proc = subprocess.run([sys.executable, "-c", RUN, str(model_dir), str(data), str(tmp_path / cast),
                               cast],
                              env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
    plain, cast = (load_file(tmp_path / c / "out/checkpoints/checkpoint-2/model.safetensors") for c in ("0",
                                                                                                        "1"))
    assert sorted(plain) == sorted(cast) and all(plain[k].dtype == cast[k].dtype for k in plain)
    kl = [read_log(tmp_path / c / "metrics/train_log.csv")[-1]["kl"] for c in ("0", "1")]
    assert kl[0] != kl[1]  # the logits did change


def test_a_lora_adapter_on_the_head_is_refused(tmp_path):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(qwen2(), LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))
    with pytest.raises(ValueError, match="cast_lm_head_to_fp32: the LM head is a .*lm_head"):
        cast_lm_head_to_fp32(model)
