"""Training: the GRPO loop as named phases, and what it holds and writes.

    loop.py        train(): set up, resume, then per step round -> gradients -> guards -> update -> log -> save
    state.py       TrainState (what a checkpoint holds), TrainingRun (the long-lived objects), PromptSampler
    round.py       Round: one generation round's tensors, typed, with their shapes
    rollouts.py    a new round: sample and score (grpo_core/sampling.py), advantages, reward metrics
    forward.py     the policy's and the frozen models' log-prob passes over micro-batches
    optim.py       AdamW and the learning-rate schedule
    reward_weights.py  the weights a run trains with: pinned, calibrated, or 1 each (the stage's rule too)
    guards.py      guards that warn, skip the update, roll back or stop
    step_log.py    the per-step CSV log
    checkpoint.py  atomic checkpoint folders: write, list, read, load weights
    export.py      the final model folder

Everything below (math, model/, rollout/, data, rewards, sampling) is used, never the other way round.
"""
