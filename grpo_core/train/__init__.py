"""Training: the GRPO loop as named phases, and what it holds and writes.

    loop.py        train(): set up, resume, then
                   per step round -> gradients -> guards -> update -> log -> save
    setup.py       the set-up phase: accelerator, policy placement, reference, data, rewards, rollout backend
    state.py       TrainState (what a checkpoint holds), TrainingRun (the long-lived objects), PromptSampler
    batching.py    the batch arithmetic (BatchPlan) and the order of a step's rows across micro-batches
    round.py       Round: one generation round's tensors; sampling, scoring and advantages of a new one
    dynamic.py     DAPO's dynamic sampling
    sampler_worker.py  async rollouts: a sampler process one round ahead, and the loop's side of it
    forward.py     the policy's and the frozen models' log-prob passes over micro-batches
    reference.py   TR-DPO's reference syncing
    optim.py       AdamW and the learning-rate schedule
    parallel.py    processes and machines; DDP or FSDP2; the step's collectives
    compute_weights.py, replica.py  what trains and what samples under bf16 compute weights and sharding
    evaluation.py  evaluation during training and the best checkpoint
    reward_weights.py  the weights a run trains with: pinned, calibrated, or 1 each (the stage's rule too)
    guards.py      guards that warn, skip the update, roll back or stop
    step_log.py, completions.py  the per-step CSV log; completions you can read
    checkpoint.py  atomic checkpoint folders: write, list, read, load weights
    export.py      the final model folder

Everything below (the math, model/, data/, rewards/, tools/, rollout/, evaluation) is used,
never the other way.
"""
