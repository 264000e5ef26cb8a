"""A generation round: the rows one process trains on until the next round is sampled.

N rows, grouped G at a time (rows ``[g*G, (g+1)*G)`` are one prompt's samples); P = prompt width (left-padded),
C = completion width (right-padded). A round feeds ``steps_per_generation / gradient_accumulation_steps`` optimizer
steps, ``num_iterations`` times over; each micro-batch is ``round.rows(slice(...))``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace

import torch


@dataclass
class Round:
    prompt_ids: torch.Tensor       # (N, P) long
    prompt_mask: torch.Tensor      # (N, P) long, 1 = real token
    completion_ids: torch.Tensor   # (N, C) long
    completion_mask: torch.Tensor  # (N, C) long, 1 up to and including the EOS
    is_truncated: torch.Tensor     # (N,) bool: no EOS within max_completion_length
    advantages: torch.Tensor       # (N,) float32, group-relative
    metrics: dict[str, float] = field(default_factory=dict)  # reward/length metrics, over all processes
    old_logps: torch.Tensor | None = None  # (N, C) float32: the sampling policy's, when the round feeds > 1 step
    ref_logps: torch.Tensor | None = None  # (N, C) float32: the reference's, when beta > 0
    rewards: torch.Tensor | None = None    # (N, K) float32 per-function rewards (NaN = None), kept while the
                                           # round is assembled (dynamic sampling recomputes the advantages)
    sampling_logps: torch.Tensor | None = None  # (N, C) float32: the sampling engine's own (vLLM), NaN = none
    sampler_ratio: torch.Tensor | None = None   # (N, C) or (N, 1): pi_old / pi_sampler, truncated or masked
    tool_mask: torch.Tensor | None = None       # (N, C) long, rollouts with tools: 1 on the model's tokens, 0 on the
                                                # tool/template tokens between its turns (None: all the model's)
    tool_counts: torch.Tensor | None = None     # (N, 3) long, rollouts with tools: per row the tool calls the model
                                                # made, those answered with an error, and its assistant turns

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def row_fields(self) -> list[str]:
        """The per-row tensors the round holds (log-probs only once computed)."""
        return [f.name for f in fields(self) if f.name != "metrics" and getattr(self, f.name) is not None]

    def rows(self, index: slice | torch.Tensor) -> Round:
        """Those rows (a slice, or an index tensor) of every per-row tensor; the metrics are the round's."""
        return replace(self, **{name: getattr(self, name)[index] for name in self.row_fields()})

    def model_mask(self) -> torch.Tensor:
        """(N, C) long: the completion tokens the model sampled - tool results and the template's tokens around them
        out. What the loss, entropy, the sampler correction and the length metrics count (as TRL's
        ``completion_mask * tool_mask``); the forward passes attend to every completion token."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask

    def loss_mask(self, mask_truncated_completions: bool) -> torch.Tensor:
        """(N, C) long: the completion tokens the loss counts: the model's (``model_mask``), a truncated row's none
        when asked."""
        mask = self.model_mask().clone()
        if mask_truncated_completions:
            mask = mask * (~self.is_truncated).unsqueeze(1).long()
        return mask

    def to_buffer(self) -> dict[str, torch.Tensor]:
        """Tensors only (``torch.load(weights_only=True)`` reads it back): the metrics as JSON bytes."""
        buffer = {name: getattr(self, name) for name in self.row_fields()}
        buffer["metrics_json"] = torch.tensor(list(json.dumps(self.metrics).encode()), dtype=torch.uint8)
        return buffer

    @classmethod
    def concat(cls, rounds: list[Round]) -> Round:
        """The rows of several rounds in order, prompts left-padded and completions right-padded to the widest
        (padding: id 0, mask 0); per-row fields that some round lacks are dropped; the metrics are the first's."""
        prompt = max(r.prompt_ids.shape[1] for r in rounds)
        completion = max(r.completion_ids.shape[1] for r in rounds)

        def widened(r: Round) -> dict:
            return {"prompt_ids": _pad(r.prompt_ids, prompt, left=True), "prompt_mask": _pad(r.prompt_mask, prompt, left=True),
                    "completion_ids": _pad(r.completion_ids, completion), "completion_mask": _pad(r.completion_mask, completion),
                    "sampling_logps": None if r.sampling_logps is None else _pad(r.sampling_logps, completion),
                    "tool_mask": None if r.tool_mask is None else _pad(r.tool_mask, completion),
                    **{n: getattr(r, n) for n in ("is_truncated", "advantages", "rewards", "tool_counts")}}

        parts = [widened(r) for r in rounds]
        shared = [n for n in parts[0] if all(p[n] is not None for p in parts)]
        return cls(metrics=dict(rounds[0].metrics), **{n: torch.cat([p[n] for p in parts]) for n in shared})

    @classmethod
    def from_buffer(cls, buffer: dict[str, torch.Tensor]) -> Round:
        buffer = dict(buffer)
        metrics = json.loads(bytes(buffer.pop("metrics_json").tolist()))
        return cls(metrics=metrics, **buffer)


def _pad(x: torch.Tensor, width: int, left: bool = False) -> torch.Tensor:
    """(N, w) -> (N, width) with zeros on the left (prompts) or the right (completions)."""
    missing = width - x.shape[1]
    if missing == 0:
        return x
    zeros = x.new_zeros(x.shape[0], missing)
    return torch.cat([zeros, x] if left else [x, zeros], dim=1)
