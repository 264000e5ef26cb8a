"""Micro-batch shapes: the length-grouped order of a round's rows, and the padding trim of one micro-batch.

Length-grouped micro-batches: order a generation round's rows so each micro-batch pads to its own longest row.

A micro-batch's forward runs at width max(prompt length) + max(completion length) over its rows (left-padded
prompts, right-padded completions, all-padding columns trimmed). With rows in sampling order every micro-batch
of a step tends to hold one long row and pads everyone to it; sorted by length, the long rows share one
micro-batch and the others are cut short.

Rows move only within their optimizer step's span (``span`` = gradient_accumulation_steps × micro-batch rows),
so every step trains on exactly the rows it would have, and the step's gradient is the same sum: dapo divides
by the step's token count, grpo and dr_grpo by constants (rows per micro-batch, max_completion_length). Only
bnpo, normalised by each micro-batch's own token count, weighs tokens differently; it is defined that way.
"""

from __future__ import annotations

import torch


def length_grouped_order(prompt_lengths: torch.Tensor, completion_lengths: torch.Tensor, group_size: int,
                         span: int, keep_groups: bool) -> torch.Tensor:
    """A permutation of the N rows: rows [s, s + span) stay in that range, sorted there longest first.

    prompt_lengths, completion_lengths: (N,) real tokens per row; rows come G = group_size at a time (a prompt's
    G samples on adjacent rows). A row's length is prompt + completion.
    keep_groups: a group's rows stay adjacent (the hand-written forward computes a prompt shared by adjacent
    rows once): the pieces of groups inside a span are ordered by their longest row, and rows inside a piece by
    their own length. Otherwise every row is placed by its own length.
    Ties keep their order (a stable sort): the result is a pure function of the lengths.

    Returns: (N,) long, ``new_rows = rows[order]``.
    """
    n = prompt_lengths.shape[0]
    if completion_lengths.shape != (n,) or prompt_lengths.ndim != 1:
        raise ValueError(f"prompt_lengths and completion_lengths must be (N,) alike, got "
                         f"{tuple(prompt_lengths.shape)} and {tuple(completion_lengths.shape)}")
    if group_size < 1 or span < 1:
        raise ValueError(f"group_size and span must be >= 1, got {group_size} and {span}")
    length = (prompt_lengths + completion_lengths).long()
    order = []
    for start in range(0, n, span):
        rows = torch.arange(start, min(start + span, n))
        key = length[rows]
        if keep_groups:
            # Rank each row by (its piece's longest row, then its own length), longest first; pieces with equal
            # longest rows stay in order, so a piece is never split.
            piece = rows // group_size
            piece_max = torch.zeros(int(piece.max()) + 1, dtype=torch.long).scatter_reduce(
                0, piece, key, reduce="amax", include_self=False)[piece]
            # Sort by row length first, then stably by (piece max, piece): the last sort wins, ties keep the first's.
            by_row = torch.sort(key, descending=True, stable=True).indices
            by_piece = torch.sort(piece_max[by_row] * (n + 1) + (n - piece[by_row]), descending=True, stable=True).indices
            order.append(rows[by_row[by_piece]])
        else:
            order.append(rows[torch.sort(key, descending=True, stable=True).indices])
    return torch.cat(order) if order else torch.zeros(0, dtype=torch.long)


def trim_padding(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                 completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt and completion side by side, without the columns that are padding in every row.

    prompt_ids, prompt_mask: (B, P), left-padded; completion_ids, completion_mask: (B, C), right-padded.
    Returns input_ids (B, P' + C'), attention_mask (B, P' + C') and completion_mask (B, C'), where P' drops the
    leading all-padding prompt columns and C' = the longest completion (at least 1 column).
    """
    first = int((prompt_mask.sum(0) > 0).int().argmax()) if prompt_mask.any() else prompt_mask.shape[1]
    width = int(completion_mask.sum(1).max()) if completion_mask.any() else 1
    input_ids = torch.cat([prompt_ids[:, first:], completion_ids[:, :width]], dim=1)
    attention_mask = torch.cat([prompt_mask[:, first:], completion_mask[:, :width]], dim=1)
    return input_ids, attention_mask, completion_mask[:, :width]
