"""Rollouts for a sharded (FSDP2) policy, two ways.

``EngineFromShards`` (generation.backend vllm): each process's vLLM engine holds the only whole copy; after
every optimizer step the shards are gathered one parameter at a time, cast to the engine's dtype and streamed
into it. Nothing else is whole: at most one gathered parameter besides the engine's weights.

``ReplicaRollouts`` (every other backend): each process samples from a whole copy of the policy, refreshed
from the shards after every optimizer step.

Why a copy: a sharded forward gathers each layer's weights from every process, so all processes would have to
run the same number of decode steps in lockstep; each process samples its own prompts, whose completions end
at different lengths. A whole copy samples alone, with any backend (the hand-written decode loop on CPU, HF
``generate``, a vLLM engine fed from it). The copy is in ``model.dtype``; docs/scaling.md counts its memory.
"""

from __future__ import annotations

import torch

from grpo_core.model.sharding import gather_weights


class ReplicaRollouts:
    """A rollout backend (``grpo_core.rollout.RolloutBackend``) over a whole copy of the policy: a sharded
    policy's, or (unsharded, half-precision model.dtype) the copy in model.dtype that
    ``policy.samples_from_a_cast_copy`` asks for.

    replica: an unsharded model with the policy's architecture (built before sharding); make_backend: replica
    -> the backend that samples from it. ``sync_weights(policy)`` is collective: every process calls it.
    """

    def __init__(self, replica: torch.nn.Module, make_backend):
        self.replica = replica.eval().requires_grad_(False)
        self.inner = make_backend(self.replica)

    def sync_weights(self, policy: torch.nn.Module) -> None:
        weights = gather_weights(policy, to_all=True)
        own = self.replica.state_dict()
        with torch.no_grad():
            for name, tensor in weights.items():  # tied weights come twice: the same values into one tensor
                own[name].copy_(tensor)
        self.inner.sync_weights(self.replica)

    def generate(self, prompt_ids, num_generations, sampling):
        return self.inner.generate(prompt_ids, num_generations, sampling)


class EngineFromShards:
    """A vLLM backend (``grpo_core.rollout.VLLMBackend``) over the sharded policy itself.

    The copy into the engine gathers each parameter from every process, so it cannot wait for the next
    ``generate`` (the main process alone samples the held-out prompts): ``sync_weights`` copies at once, and
    every process calls it, after every optimizer step and rollback, as the trainer does."""

    def __init__(self, engine_backend):
        self.inner = engine_backend
        self.inner.push_weights()  # collective: every process builds its backend at the same point of set-up

    def sync_weights(self, policy: torch.nn.Module) -> None:
        self.inner.sync_weights(policy)
        self.inner.push_weights()

    def generate(self, prompt_ids, num_generations, sampling):
        return self.inner.generate(prompt_ids, num_generations, sampling)
