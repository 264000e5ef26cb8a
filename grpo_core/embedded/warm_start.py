"""Supervised warm start: prompt → demonstration, loss on the tokens the model writes only.

Each step draws `batch_size` training prompts and, for each, a fresh demonstration: the wrong variant (the
wrong operation; for the calculator task, a guess without the tool) with the prompt's template rate, and a
broken format (a broken tag layout; a broken tool call) with probability `format_noise`. Re-drawing per visit
(rather than fixing one label per prompt) makes the model learn the *rates*, i.e. a policy that puts that much
probability on each reading — the mixed-outcome groups GRPO needs.

A demonstration is either text after a text prompt (the word problems: every completion token is learnt), or
chat messages after a chat prompt (the calculator task: assistant turns, tool calls, tool results), rendered
with the tokenizer's chat template and learnt on the assistant's tokens only (the template's
`{% generation %}` spans, transformers' assistant mask) — the tool results and role markers between turns are
context, as they are for GRPO's loss (the rollouts' tool mask).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

IGNORE_INDEX = -100


class Demonstrable(Protocol):
    """A task's problem as the warm start reads it (tasks.Problem, tool_tasks.CalculatorProblem)."""

    template: int  # index of its template: the wrong variant's rate
    format_breaks: tuple[str, ...]  # the format_break values `completion` takes

    @property
    def prompt(self) -> str | list[dict]: ...

    def completion(self, wrong: bool, format_break: int) -> str | list[dict]:
        """The demonstration after the prompt: text, or chat messages."""
        ...


@dataclass
class Demonstrations:
    """Pre-tokenised demonstrations for P prompts and V = 2 × num_breaks variants each.

    prompt_ids: P lists of ids; variant_ids: P × V lists of ids after the prompt, the last one EOS;
    variant_mask: the same shape, 1 on the tokens learnt (the model's), 0 on context (tool results, role
    markers); variant v = wrong * num_breaks + format_break; wrong_rate: (P,) probability of the wrong
    variant.
    """

    prompt_ids: list[list[int]]
    variant_ids: list[list[list[int]]]
    variant_mask: list[list[list[int]]]
    wrong_rate: torch.Tensor
    pad_id: int
    num_breaks: int


def demonstration_tokens(
    tokenizer: PreTrainedTokenizerFast, prompt: Any, completion: Any, tools: Sequence[Callable] = ()
) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, completion_ids, completion_mask) of one demonstration.

    Text: the completion's tokens + EOS, all learnt. Chat messages: the conversation rendered with the chat
    template (and `tools`), the prompt being its rendering with the generation prompt; mask = the template's
    assistant mask. Raises if the template renders the prompt otherwise inside the conversation (a rollout
    appends tokens to the prompt, so the warm start must see the same prefix).
    """
    if isinstance(prompt, str):
        ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return tokenizer(prompt, add_special_tokens=False)["input_ids"], ids, [1] * len(ids)
    tools = list(tools) or None
    prompt_ids = tokenizer.apply_chat_template(
        prompt, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    full = tokenizer.apply_chat_template(
        [*prompt, *completion], tools=tools, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True
    )
    if full["input_ids"][: len(prompt_ids)] != prompt_ids:
        raise RuntimeError("chat template: a conversation does not start with its prompt's rendering")
    n = len(prompt_ids)
    return prompt_ids, full["input_ids"][n:], full["assistant_masks"][n:]


def build_demonstrations(
    problems: Sequence[Demonstrable],
    tokenizer: PreTrainedTokenizerFast,
    rates: Sequence[float],
    tools: Sequence[Callable] = (),
) -> Demonstrations:
    """Tokenise every problem's prompt and its demonstration variants (`problem.completion(wrong, break)`, for
    break in `problem.format_breaks`); `rates[t]` is template t's wrong-variant share; `tools` those the chat
    template shows (chat prompts)."""
    num_breaks = len(problems[0].format_breaks)
    prompt_ids, variant_ids, variant_mask = [], [], []
    for p in problems:
        variants = [
            demonstration_tokens(tokenizer, p.prompt, p.completion(bool(w), f), tools)
            for w in (0, 1)
            for f in range(num_breaks)
        ]
        prompt_ids.append(variants[0][0])
        variant_ids.append([ids for _, ids, _ in variants])
        variant_mask.append([mask for _, _, mask in variants])
    wrong_rate = torch.tensor([rates[p.template] for p in problems], dtype=torch.float64)
    return Demonstrations(prompt_ids, variant_ids, variant_mask, wrong_rate, tokenizer.pad_token_id,
                          num_breaks)


def sample_batch(
    demos: Demonstrations, batch_size: int, format_noise: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch: (input_ids, attention_mask, labels), each (B, L) right-padded; labels are -100 on the
    prompt, the padding and the variant's context tokens, so only the model's tokens (EOS included) are
    learnt."""
    num_breaks = demos.num_breaks
    idx = torch.randint(len(demos.prompt_ids), (batch_size,), generator=generator)
    wrong = torch.rand(batch_size, generator=generator, dtype=torch.float64) < demos.wrong_rate[idx]
    broken = torch.rand(batch_size, generator=generator, dtype=torch.float64) < format_noise
    which_break = torch.randint(1, num_breaks, (batch_size,), generator=generator)
    variant = wrong.long() * num_breaks + torch.where(broken, which_break, torch.zeros_like(which_break))

    rows = [
        (demos.prompt_ids[i], demos.variant_ids[i][v], demos.variant_mask[i][v])
        for i, v in zip(idx.tolist(), variant.tolist())
    ]
    length = max(len(p) + len(c) for p, c, _ in rows)
    input_ids = torch.full((batch_size, length), demos.pad_id, dtype=torch.long)
    labels = torch.full((batch_size, length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, length), dtype=torch.long)
    for r, (p, c, m) in enumerate(rows):
        n = len(p) + len(c)
        input_ids[r, :n] = torch.tensor(p + c)
        learnt = torch.tensor(m, dtype=torch.bool)
        labels[r, len(p) : n] = torch.where(learnt, torch.tensor(c), IGNORE_INDEX)
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
