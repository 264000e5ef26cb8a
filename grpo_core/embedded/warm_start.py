"""Supervised warm start: prompt → demonstration, loss on completion tokens only.

Each step draws `batch_size` training prompts and, for each, a fresh demonstration: the wrong-operation
variant with the prompt's template rate, and a broken tag layout with probability `format_noise`.
Re-drawing per visit (rather than fixing one label per prompt) makes the model learn the *rates*, i.e. a
policy that puts that much probability on each reading — the mixed-outcome groups GRPO needs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from grpo_core.embedded.tasks import FORMAT_BREAKS, Problem

IGNORE_INDEX = -100


@dataclass
class Demonstrations:
    """Pre-tokenised demonstrations for P prompts and V = 2 × len(FORMAT_BREAKS) variants each.

    prompt_ids: P lists of ids; variant_ids: P × V lists of ids ending with EOS, variant v = wrong_op *
    len(FORMAT_BREAKS) + format_break; wrong_rate: (P,) probability of the wrong-operation variant.
    """

    prompt_ids: list[list[int]]
    variant_ids: list[list[list[int]]]
    wrong_rate: torch.Tensor
    pad_id: int


def build_demonstrations(
    problems: Sequence[Problem], tokenizer: PreTrainedTokenizerFast, rates: Sequence[float]
) -> Demonstrations:
    """Tokenise every problem's prompt and its demonstration variants; `rates[t]` is template t's
    wrong-operation share."""
    eos = tokenizer.eos_token_id

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prompt_ids = [ids(p.prompt) for p in problems]
    variant_ids = [
        [ids(p.completion(bool(w), f)) + [eos] for w in (0, 1) for f in range(len(FORMAT_BREAKS))]
        for p in problems
    ]
    wrong_rate = torch.tensor([rates[p.template] for p in problems], dtype=torch.float64)
    return Demonstrations(prompt_ids, variant_ids, wrong_rate, tokenizer.pad_token_id)


def sample_batch(
    demos: Demonstrations, batch_size: int, format_noise: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch: (input_ids, attention_mask, labels), each (B, L) right-padded; labels are -100 on the
    prompt and padding, so only completion tokens (EOS included) are learnt."""
    num_breaks = len(FORMAT_BREAKS)
    idx = torch.randint(len(demos.prompt_ids), (batch_size,), generator=generator)
    wrong = torch.rand(batch_size, generator=generator, dtype=torch.float64) < demos.wrong_rate[idx]
    broken = torch.rand(batch_size, generator=generator, dtype=torch.float64) < format_noise
    which_break = torch.randint(1, num_breaks, (batch_size,), generator=generator)
    variant = wrong.long() * num_breaks + torch.where(broken, which_break, torch.zeros_like(which_break))

    rows = [(demos.prompt_ids[i], demos.variant_ids[i][v]) for i, v in zip(idx.tolist(), variant.tolist())]
    length = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.full((batch_size, length), demos.pad_id, dtype=torch.long)
    labels = torch.full((batch_size, length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, length), dtype=torch.long)
    for r, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        input_ids[r, :n] = torch.tensor(p + c)
        labels[r, len(p) : n] = torch.tensor(c)
        attention_mask[r, :n] = 1
    return input_ids, attention_mask, labels


def _lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10% of the peak."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def warm_start(
    model: PreTrainedModel,
    demos: Demonstrations,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    format_noise: float,
    seed: int,
    log: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """Train `model` in place for `steps` AdamW steps; deterministic given `seed` (and thread count).

    Returns {"first_loss", "final_loss" (mean of the last 10% of steps), "seconds"}.
    """
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=learning_rate, betas=(0.9, 0.98), weight_decay=0.01, eps=1e-8
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, steps))
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(steps):
        input_ids, attention_mask, labels = sample_batch(demos, batch_size, format_noise, generator)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if log is not None and (step + 1) % max(1, steps // 10) == 0:
            log(f"warm start step {step + 1}/{steps}: loss {losses[-1]:.4f}")
    model.eval()
    tail = losses[-max(1, steps // 10) :] if losses else [math.nan]
    return {
        "first_loss": losses[0] if losses else math.nan,
        "final_loss": sum(tail) / len(tail),
        "seconds": time.perf_counter() - start,
    }
