"""Every random number generator a process draws from, as one JSON-safe state: saved in checkpoints (each
process its own), restored on resume, and kept around anything that reseeds them (an in-process vLLM engine
seeds the global generators with its own seed)."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict:
    """Every RNG this process draws from, in JSON-safe form: python, numpy, torch's CPU generator and, on a
    GPU, the generator of this process's own device (not every device's: on 8 GPUs each rank owns one)."""
    np_state = np.random.get_state()
    state = {
        "python": _to_json(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda_device"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_from_json(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda_device" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda_device"], dtype=torch.uint8))


def restore_rngs(saved: list[dict] | dict, rank: int, seed: int, step: int) -> bool:
    """Process ``rank``'s RNGs from a checkpoint's per-process states; True if they were saved. A rank the
    checkpoint has no state for (resuming on more processes than saved it) is seeded from (seed, step, rank):
    the same resume twice samples the same, and no two ranks share a stream. ``saved``: one state per process
    saved, or one dict (checkpoints written before states were per process: rank 0's)."""
    states = [saved] if isinstance(saved, dict) else list(saved)
    if rank < len(states):
        set_rng_state(states[rank])
        return True
    derived = int.from_bytes(hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()[:4], "little")
    random.seed(derived)
    np.random.seed(derived)
    torch.manual_seed(derived)  # every device's generator too
    return False


def _to_json(obj: Any) -> Any:
    return [_to_json(o) for o in obj] if isinstance(obj, (tuple, list)) else obj


def _from_json(obj: Any) -> Any:
    return tuple(_from_json(o) for o in obj) if isinstance(obj, list) else obj
