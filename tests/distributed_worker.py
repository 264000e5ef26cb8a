"""Run by tests/test_distributed.py: ``train()`` with a deterministic rollout backend, as one process or
under ``accelerate launch --multi_cpu --num_processes 2`` (gloo).

    python -m tests.distributed_worker OUT_DIR MODEL_DIR DATA_FILE PER_DEVICE_BATCH LOSS_TYPE

Sampling is the only random part of a GRPO step; with completions that depend only on the prompt and
the sample index, one process with batch 2B and two processes with B each see the same global batch,
so their losses and updates must agree.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from grpo_core.rollout import RolloutBatch, completion_mask_from_eos, left_pad
from grpo_core.train.loop import train
from tests.tiny import tiny_config


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


def main(out_dir: str, model_dir: str, data_file: str, per_device_batch: str, loss_type: str) -> None:
    torch.set_num_threads(1)
    cfg = tiny_config(Path(model_dir), Path(data_file),
                      [{"name": "digits", "function": "tests.reward_helpers:digit_fraction"}],
                      max_steps=2, per_device_train_batch_size=int(per_device_batch), num_generations=4,
                      beta=0.04, loss_type=loss_type, learning_rate=1e-2, save_steps=100,
                      # DDP-wrapped models take the HF forward; the single process must too, or Adam turns the
                      # 1e-7 float differences of two forward implementations into visible weight differences
                      forward_backend="hf")
    train(cfg, root=out_dir, progress=False, backend_factory=DeterministicBackend)


if __name__ == "__main__":
    main(*sys.argv[1:])
