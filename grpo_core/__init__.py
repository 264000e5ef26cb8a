"""grpo_core: GRPO, framework-free. Layers, bottom to top;
a module imports only its own layer and those below.

    common/                          errors (exit codes), atomic files, RNG states, expressions, typed options
    embedded/                        the embedded default: synthetic tasks, tiny model, warm start
    advantages.py, loss.py,          the math: group-relative advantages; the whole objective (GRPOLoss);
    calibration.py                   reward statistics and weights
    model/                           loading, precision, the hand-written forward, log-probs, sharding
    data/, rewards/, tools/          prompts (loading, validation); reward functions; tool calling
    rollout/                         generation: backends behind one interface, multi-turn, sample-and-score
    evaluation.py                    a policy on held-out prompts and its metrics (pass@k)
    train/                           the training loop as named phases; `train:`'s options (train/options.py)
    config.py                        params.yaml assembled from the options each module above declares

``flows/`` (the stage commands, Prefect, MLflow) sits on top and is never imported from here.
"""
