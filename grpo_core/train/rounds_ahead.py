"""Async rollouts, the training loop's side: which round it trains on, and what it sends the sampler worker
(grpo_core/train/sampler_worker.py, ``run.sampler``)."""

from __future__ import annotations

import time

import torch
from torch.profiler import record_function

from grpo_core.train.round import Round
from grpo_core.train.sampler_worker import SampleRequest
from grpo_core.train.state import Prompts, TrainingRun, TrainState


def take_round_ahead(run: TrainingRun, prompts: Prompts, state: TrainState, per_process: int) -> Round:
    """async_rollouts: the round to train on now (advantages still zero), and the next one submitted.

    The round in hand is the one sampled ahead: received at a checkpoint (``state.ahead``), or in flight
    (received now, waiting for it), or else - the first round, or max_staleness 0 - sampled now with the
    current weights. Then, max_staleness 1, the next round's prompts go to the worker with the current
    weights, and this process trains while it samples: that round is one round older than the weights that
    will train on it, and comes with the sampling weights' log-probs as its old log-probs.
    """
    wait_start = time.perf_counter()
    if state.ahead is None:
        if not run.sampler.in_flight:
            submit_round(run, prompts, state, per_process, ahead=False)
        receive_round(run, state)
    round_, sampled_at = state.ahead, state.ahead_step
    state.ahead = state.ahead_step = None
    waited = time.perf_counter() - wait_start
    if run.rollouts.max_staleness > 0:
        submit_round(run, prompts, state, per_process, ahead=True)
    round_.metrics.update({"async/staleness": float(state.step - sampled_at), "async/wait_time": waited})
    return round_


def submit_round(run: TrainingRun, prompts: Prompts, state: TrainState, per_process: int, *,
                 ahead: bool) -> None:
    """The next prompts, the current weights and RNG state to the sampler worker. ahead: later weights will
    train on it, so the worker also scores its tokens under these (the old log-probs) and, off this process's
    critical path, under the reference."""
    indices = state.sampler.take(per_process)
    run.sampler.copy_weights(run.policy.masters)
    run.sampler.submit(SampleRequest(row_ids=indices, rows=[prompts.dataset[i] for i in indices],
                                     rng_state=torch.get_rng_state(), old_logps=ahead,
                                     ref_logps=ahead and run.sampler.scores_reference,
                                     training=run.policy.masters.training, policy_step=state.step))


def receive_round(run: TrainingRun, state: TrainState) -> None:
    """The round in flight into ``state.ahead``; the RNG continues from the worker's state after sampling it
    (so the stream does not depend on when the round arrived)."""
    with record_function("grpo/wait_for_sampler"):
        sampled = run.sampler.receive()
    torch.set_rng_state(sampled.rng_state)
    state.ahead, state.ahead_step = sampled.round, sampled.policy_step
