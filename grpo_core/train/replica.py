"""Rollouts for a sharded (FSDP2) policy: each process samples from a whole copy of the policy, refreshed from the
shards after every optimizer step.

Why a copy: a sharded forward gathers each layer's weights from every process, so all processes would have to
run the same number of decode steps in lockstep; each process samples its own prompts, whose completions end at
different lengths. A whole copy samples alone, with any backend (the hand-written decode loop on CPU, HF
``generate``, a vLLM engine fed from it). The copy is in ``model.dtype``; docs/scaling.md counts its memory.
"""

from __future__ import annotations

import torch

from grpo_core.model.sharding import gather_weights


class ReplicaRollouts:
    """A rollout backend (``grpo_core.rollout.RolloutBackend``) over a whole copy of a sharded policy.

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
