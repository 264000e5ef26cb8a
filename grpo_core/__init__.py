"""grpo_core: GRPO, framework-free. Layers, bottom to top; a module imports only its own layer and those below.

    errors.py, files.py, rng.py                  the error base (exit codes), the atomic writer, the NaN helper;
                                                 every RNG's state (checkpoints, the vLLM engine's reseeding)
    config.py, embedded/                         typed params.yaml; the embedded default's builders
    advantages.py, loss.py, microbatch.py,       the math: group-relative advantages, the loss family, micro-batch
    calibration.py, evaluation.py                shapes; reward statistics and weights; pass@k
    model/                                       loading, the hand-written forward, log-probs
    tools/, rollout/                             tool calling (import, parse, run); sampling backends behind one
                                                 interface (HF, hand-written, vLLM), the multi-turn loop above them
    data.py, rewards/, sampling.py, validation.py  prompts, reward functions, the one sample-and-score, data checks
    held_out.py                                  a policy scored on held-out prompts (evaluate and eval during training)
    train/                                       the training loop as named phases, its state, checkpoints

``flows/`` (the stage commands, Prefect, MLflow) sits on top and is never imported from here.
"""
