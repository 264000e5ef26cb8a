"""The vLLM rollout backend where the real engine cannot be used here, against a stand-in; and its pure parts.

The real engine (vLLM's CPU build) runs in tests/test_vllm_engine.py. A stand-in stays for two things it
lacks:

- sleep mode (CUDA only): the stand-in's level-2 sleep destroys its weights (NaN) and releases the KV cache,
  ``generate`` refuses to run asleep, so the backend's wake / load / sleep order is checked here;
- a sampler whose log-probs differ from the trainer's (``logprob_shift``): float32 vLLM on CPU agrees with the
  trainer to ~1e-6, so the sampler correction's effect is checked with this one (tests/test_trl_parity.py).

The stand-in (``StandInLLM``) has vllm.LLM's colocate interface as the backend uses it: it loads its own copy
of the model from the policy's files, weights arrive through ``collective_rpc("reload_weights", ...)`` under
HF names, and it samples with ``HFGenerateBackend`` on its copy.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_core.config import ConfigError, load_config
from grpo_core.rollout import HFGenerateBackend, SamplingParams
from grpo_core.rollout.vllm import (
    EngineSettings,
    VLLMBackend,
    completion_tensor,
    vllm_sampling_kwargs,
)
from tests.tiny import make_prompts, make_tiny_model

PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"
DIGITS = [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}]
# The keyword arguments of vllm.SamplingParams this backend may use (all exist in vLLM 0.22-0.31).
VLLM_SAMPLING_FIELDS = {"n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k",
                        "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p",
                        "stop_token_ids", "detokenize", "logprobs"}


class StandInSamplingParams(SimpleNamespace):
    def __init__(self, **kwargs):
        unknown = set(kwargs) - VLLM_SAMPLING_FIELDS
        assert not unknown, f"not a vllm.SamplingParams field: {unknown}"
        assert kwargs.get("temperature", 1.0) > 0 or kwargs.get("n", 1) == 1, "vLLM: n must be 1 when greedy"
        super().__init__(**kwargs)


class StandInLLM:
    """vLLM's ``LLM`` as the backend uses it, over HF generate; with ``logprobs=0`` it reports each sampled
    token's log-prob under the processed (temperature-scaled) distribution plus ``logprob_shift(row, col)``: a
    sampler whose numbers differ from the trainer's, as vLLM's kernels do."""

    def __init__(self, model=None, include_stop_token: bool = True, logprob_shift=None, **engine_kwargs):
        self.engine_kwargs = {"model": model, **engine_kwargs}
        self.include_stop_token = include_stop_token
        self.logprob_shift = logprob_shift or (lambda row, col: 0.0)
        self.calls: list[str] = []
        self.weights_awake = self.kv_awake = True
        if model is None:
            return  # build_engine's check only looks at the arguments
        self.model = AutoModelForCausalLM.from_pretrained(model).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        model_config = SimpleNamespace(dtype=torch.float32,
                                       enable_sleep_mode=engine_kwargs.get("enable_sleep_mode", True))
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(model_config=model_config))

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights"
        self._load_weights(kwargs["weights_iterator"])

    def apply_model(self, fn):
        return [fn(self.model)]

    def _load_weights(self, weights):
        assert self.weights_awake, "load_weights into released memory"
        params = dict(self.model.named_parameters())
        names = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            names.add(name)
        assert names == set(params), f"weights not loaded: {set(params) - names}"
        self.calls.append("load_weights")

    def sleep(self, level):
        assert level == 2
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float("nan"))  # level 2 discards the weights' contents
        self.weights_awake = self.kv_awake = False
        self.calls.append("sleep")

    def wake_up(self, tags):
        self.weights_awake |= "weights" in tags
        self.kv_awake |= "kv_cache" in tags
        self.calls.append(f"wake_up:{','.join(tags)}")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def generate(self, prompts, sampling_params, use_tqdm=True):
        assert self.weights_awake and self.kv_awake, "generate while asleep"
        assert all(torch.isfinite(p).all()
                   for p in self.model.parameters()), "generate with discarded weights"
        self.calls.append("generate")
        sp = sampling_params
        ours = SamplingParams(max_new_tokens=sp.max_tokens, temperature=sp.temperature or 1.0, top_p=sp.top_p,
                              top_k=max(sp.top_k, 0), do_sample=sp.temperature > 0)
        eos = sp.stop_token_ids
        tok = SimpleNamespace(pad_token_id=self.tokenizer.pad_token_id, eos_token_id=eos)
        batch = HFGenerateBackend(self.model, tok).generate([p["prompt_token_ids"] for p in prompts], sp.n,
                                                            ours)
        logps = self._sampled_logps(batch, ours.temperature) if getattr(sp, "logprobs", None) == 0 else None
        outputs = []
        for row, (ids, mask, truncated) in enumerate(zip(batch.completion_ids, batch.completion_mask,
                                                         batch.is_truncated)):
            tokens = ids[mask.bool()].tolist()
            if not truncated and not self.include_stop_token:
                tokens = tokens[:-1]
            entries = None if logps is None else [
                {tok: SimpleNamespace(logprob=float(logps[row, col]) + self.logprob_shift(row, col), rank=1)}
                for col, tok in enumerate(tokens)]
            outputs.append(SimpleNamespace(token_ids=tokens, finish_reason="length" if truncated else "stop",
                                           stop_reason=None, logprobs=entries))
        return [SimpleNamespace(outputs=outputs[i * sp.n:(i + 1) * sp.n]) for i in range(len(prompts))]


    @torch.no_grad()
    def _sampled_logps(self, batch, temperature):
        from grpo_core.model.logprobs import token_logprobs_and_entropy

        ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
        attention = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
        logps, _ = token_logprobs_and_entropy(self.model, ids, attention,
                                              logits_to_keep=batch.completion_ids.shape[1],
                                              temperature=temperature,
                                              position_ids=(attention.cumsum(1) - 1).clamp(min=0))
        return logps


@pytest.fixture
def fake_vllm(monkeypatch):
    module = ModuleType("vllm")
    module.LLM, module.SamplingParams = StandInLLM, StandInSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm")
    return make_tiny_model(d / "model"), make_prompts(d / "train.jsonl")


def policy_and_tokenizer(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)


PROMPTS = [[5, 9, 11, 14], [7, 3, 22, 8, 30, 2, 14], [12, 4, 25]]
GREEDY = SamplingParams(max_new_tokens=10, do_sample=False)


def test_sleep_mode_phases_and_weight_reload(assets, fake_vllm, monkeypatch):
    """CUDA's sleep mode (vLLM's CPU build has none): the allocator's cache emptied before each wake-up (the
    trainer's freed blocks go back to the GPU first), weights woken before the copy, KV cache before
    generating."""
    policy, tok = policy_and_tokenizer(assets[0])
    engine = StandInLLM(str(assets[0]))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: engine.calls.append("empty_cache"))
    backend = VLLMBackend(policy, tok, EngineSettings(enable_sleep_mode=True), engine=engine)
    assert engine.calls == ["sleep"]
    round_ = ["empty_cache", "wake_up:weights", "load_weights", "reset_prefix_cache", "empty_cache",
              "wake_up:kv_cache", "generate", "sleep"]
    backend.generate(PROMPTS, 2, GREEDY)
    assert engine.calls[1:] == round_
    backend.generate(PROMPTS, 2, GREEDY)  # level 2 discarded the weights: reloaded although unchanged
    assert engine.calls[1 + len(round_):] == round_ and backend.weights_loaded == 2


def test_sampling_arguments_are_ours_and_nothing_else():
    sampled = vllm_sampling_kwargs(SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.9, top_k=0), 8,
                                   [1, 2], 0)
    assert sampled == dict(n=8, max_tokens=32, min_tokens=0, temperature=0.7, top_p=0.9, top_k=-1,
                           repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0,
                           stop_token_ids=[1, 2], detokenize=False)
    assert vllm_sampling_kwargs(SamplingParams(max_new_tokens=4, top_k=5), 2, [1], 3)["top_k"] == 5
    greedy = vllm_sampling_kwargs(SamplingParams(max_new_tokens=4, temperature=0.7, top_k=5, do_sample=False),
                                  1, [1], 0)
    assert (greedy["temperature"], greedy["top_p"], greedy["top_k"]) == (0.0, 1.0, -1)
    tuned = vllm_sampling_kwargs(SamplingParams(max_new_tokens=4, min_p=0.05, repetition_penalty=1.1,
                                                generation_kwargs={"bad_words": ["x"]}), 2, [1], 0)
    assert (tuned["min_p"], tuned["repetition_penalty"], tuned["bad_words"]) == (0.05, 1.1, ["x"])


def test_completion_tensor_restores_a_missing_stop_token():
    out = SimpleNamespace(token_ids=[4, 5], finish_reason="stop", stop_reason=None)
    assert completion_tensor(out, [1, 2]).tolist() == [[4, 5, 1]]
    out = SimpleNamespace(token_ids=[4, 5], finish_reason="stop", stop_reason=2)
    assert completion_tensor(out, [1, 2]).tolist() == [[4, 5, 2]]
    out = SimpleNamespace(token_ids=[4, 5, 2], finish_reason="stop", stop_reason=2)
    assert completion_tensor(out, [1, 2]).tolist() == [[4, 5, 2]]
    out = SimpleNamespace(token_ids=[4, 5, 6], finish_reason="length", stop_reason=None)
    assert completion_tensor(out, [1, 2]).tolist() == [[4, 5, 6]]


@pytest.mark.parametrize("key,value,message", [
    ("vllm_gpu_memory_utilization", 0.0, "vllm_gpu_memory_utilization"),
    ("vllm_gpu_memory_utilization", 1.5, "vllm_gpu_memory_utilization"),
    ("backend", "sglang", "generation.backend"),
])
def test_config_validates_the_vllm_keys(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(PARAMS, {f"generation.{key}": value})
    cfg = load_config(PARAMS, {"generation.backend": "vllm", "generation.vllm_gpu_memory_utilization": 0.5})
    g = cfg.generation
    assert (g.backend, g.vllm_gpu_memory_utilization, g.vllm_enable_sleep_mode) == ("vllm", 0.5, True)
