"""What every layer above uses and that imports nothing of the project.

    errors.py       the one error base: each error carries its stage exit code
    files.py        atomic writes (temp path, then rename) and the NaN helper
    rng.py          every RNG of a process as one JSON-safe state (checkpoints, the vLLM engine's reseeding)
    expressions.py  a calculator's expression parsed with ast, never eval
    options.py      how a component declares the params.yaml keys it reads, and how YAML becomes them
    text.py         the one key that says two prompts are the same (validate's checks, reasoning-gym's dedupe)
"""
