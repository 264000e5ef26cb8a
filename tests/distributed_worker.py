"""Run by tests/test_distributed.py and tests/test_fsdp.py: ``train()`` with a deterministic rollout backend,
as one process or as N processes under the train stage's CPU launcher (``torch.distributed.run``, gloo).

    python -m tests.distributed_worker OUT_DIR MODEL_DIR DATA_FILE SPEC_JSON

SPEC_JSON: {"train": {train.* overrides}, "generation": {generation.* overrides}, "guards": {...},
"nan_loss_at": [grpo_loss calls on rank 0 whose loss becomes NaN], "sampled": true for the configured
backend}. Sampling is the only random part of a GRPO step; with completions that depend only on the prompt and
the sample index, one process with batch 2B and two processes with B each see the same global batch, so their
losses and updates must agree.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

import grpo_core.train.loop as loop
from grpo_core.config import config_from_dict
from grpo_core.loss import GRPOLoss
from grpo_core.rollout import RolloutBatch, completion_mask_from_eos, left_pad


class DeterministicBackend:
    """Completions as a fixed function of (prompt ids, sample index): lengths vary, some end with EOS."""

    def __init__(self, model, tokenizer):
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.vocab = len(tokenizer)
        self.num_special = len(tokenizer.all_special_ids) + 2

    def sync_weights(self, model) -> None:
        pass

    def generate(self, prompt_ids, num_generations, sampling) -> RolloutBatch:
        rows = [p for p in prompt_ids for _ in range(num_generations)]
        ids, mask = left_pad(rows, self.pad)
        width = sampling.max_new_tokens
        completion = torch.full((len(rows), width), self.pad, dtype=torch.long)
        for r, prompt in enumerate(rows):
            g, h = r % num_generations, sum(prompt)
            n = 2 + (h + 3 * g) % (width - 1)  # 2 .. width tokens
            span = self.vocab - self.num_special
            tokens = [self.num_special + (h * 7 + 11 * g + 5 * j) % span for j in range(n)]
            if n < width:
                tokens[-1] = self.eos
            completion[r, :n] = torch.tensor(tokens)
        completion_mask, truncated = completion_mask_from_eos(completion, [self.eos])
        completion = completion.masked_fill(completion_mask == 0, self.pad)
        return RolloutBatch(ids, mask, completion, completion_mask, truncated)


def poison_losses(calls: set[int]) -> None:
    """Rank 0's loss calls (GRPOLoss) numbered in ``calls`` return NaN
    (a guard's trigger on one process only)."""
    real, count = GRPOLoss.__call__, {"n": 0}

    def poisoned(self, *a, **k):
        count["n"] += 1
        loss, stats = real(self, *a, **k)
        return (loss * math.nan if count["n"] in calls else loss), stats

    if int(os.environ.get("RANK", "0")) == 0:
        GRPOLoss.__call__ = poisoned


def launch(out: Path, model: Path, data: Path, processes: int, spec: dict) -> None:
    """Run this worker as ``processes`` processes with the train stage's CPU launcher (one: plain python)."""
    import subprocess

    from flows.stages.launch import launch_command

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(repo)}
    launcher = launch_command(processes) if processes > 1 else [sys.executable]
    cmd = [*launcher, "-m", "tests.distributed_worker", str(out), str(model), str(data), json.dumps(spec)]
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def main(out_dir: str, model_dir: str, data_file: str, spec_json: str) -> None:
    torch.set_num_threads(1)
    spec = json.loads(spec_json)
    train = {"learning_rate": 1e-2, "num_generations": 4, "per_device_train_batch_size": 16,
             "max_steps": 2, "save_steps": 100,
             "output_dir": "out", "beta": 0.04, "seed": 0,
             # DDP-wrapped and sharded models take the HF forward; the single process must too, or Adam turns
             # the 1e-7 float differences of two forward implementations into visible weight differences
             "forward_backend": "hf", **spec.get("train", {})}
    cfg = config_from_dict({
        "data": {"train_files": [data_file], "eval_files": [data_file], "max_prompt_length": 48},
        "model": {"name_or_path": model_dir},
        "generation": {"max_completion_length": 8, **spec.get("generation", {})},
        "rewards": [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}],
        "train": train, "guards": spec.get("guards", {})})
    poison_losses(set(spec.get("nan_loss_at", [])))
    if spec.get("engine"):
        return train_with_engine(cfg, Path(out_dir))
    # "sampled": the real sampling backend (the train config's: the hand-written decode on CPU), which draws
    # from each process's RNG; else completions that are a fixed function of the prompt
    backend_factory = None if spec.get("sampled") else DeterministicBackend
    loop.train(cfg, root=out_dir, progress=False, hooks=loop.TrainHooks(backend_factory=backend_factory))


# Scored by each process's engine after training: (prompt ids, completion ids) it did not sample.
FIXED = [([5, 9, 11, 13], [21, 40, 7, 33, 12, 60]), ([8, 8, 30], [14, 15, 16, 17, 18, 19])]


def train_with_engine(cfg, out: Path) -> None:
    """train() sampling through a real vLLM engine in each process (generation.backend vllm); then each
    process writes its engine's log-probs of FIXED (T = 1) and how many times the policy's weights were copied
    into it."""
    import dataclasses

    from vllm import SamplingParams as VLLMSamplingParams

    from grpo_core.rollout import Placement
    from grpo_core.rollout.vllm import EngineSettings, VLLMBackend

    cfg = dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, backend="vllm"))
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    built = []

    def engine_backend(model, tokenizer):
        settings = EngineSettings(seed=0, max_model_length=64, dtype=torch.float32)
        built.append(VLLMBackend(model, tokenizer, settings, place=Placement(rank, rank, world),
                                 return_logprobs=True))
        return built[-1]

    loop.train(cfg, root=out, progress=False, hooks=loop.TrainHooks(backend_factory=engine_backend))
    params = VLLMSamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
    results = built[0].llm.generate([{"prompt_token_ids": p + c} for p, c in FIXED], sampling_params=params,
                                    use_tqdm=False)
    logps = [[r.prompt_logprobs[len(p) + i][token].logprob for i, token in enumerate(c)]
             for r, (p, c) in zip(results, FIXED)]
    (out / f"engine-rank{rank}.json").write_text(
        json.dumps({"logps": logps, "loads": built[0].weights_loaded}))


if __name__ == "__main__":
    main(*sys.argv[1:])
