"""Length rewards: reasoning-length bands, and DAPO's soft overlong penalty (in tokens)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from grpo_core.rewards.base import RewardFunction, RewardValue, named, texts
from grpo_core.rewards.parsing import extract_section


def reasoning_length(
    bands: Sequence[Sequence[float | None]] = ((20, 400, 1.0),),
    unit: Literal["chars", "words"] = "chars",
    default: float = 0.0,
    missing: float | None = 0.0,
    reasoning_tag: str = "reasoning",
) -> RewardFunction:
    """Reward by the length of the reasoning section: the first band `[lo, hi, reward]` with
    lo ≤ length ≤ hi gives `reward` (hi None = unbounded); no band matches → `default`; no reasoning
    section → `missing` (None = "does not apply"). Length counts `unit`s of the stripped section."""
    parsed: list[tuple[float, float, float]] = []
    for band in bands:
        if len(band) != 3:
            raise ValueError(f"reasoning_length: each band is [lo, hi, reward], got {list(band)!r}")
        lo, hi, value = band
        parsed.append((float(lo or 0), float("inf") if hi is None else float(hi), float(value or 0.0)))
    if unit not in ("chars", "words"):
        raise ValueError(f"reasoning_length: unit must be 'chars' or 'words', got {unit!r}")

    def score(text: str) -> RewardValue:
        section = extract_section(text, reasoning_tag, last=False)
        if section is None:
            return missing
        length = len(section) if unit == "chars" else len(section.split())
        return next((value for lo, hi, value in parsed if lo <= length <= hi), default)

    def reasoning_length(prompts: list, completions: list, **kwargs: Any) -> list[RewardValue]:
        return [score(t) for t in texts(completions)]

    return named(reasoning_length, "reasoning_length")


def overlong_penalty(
    max_completion_length: int, cache_length: int | None = None, scale: float = 1.0
) -> RewardFunction:
    """DAPO's soft overlong punishment (eq. 13), in tokens; L = completion length, Lmax, Lcache:

        0                          if L ≤ Lmax − Lcache
        ((Lmax − Lcache) − L)/Lcache  if Lmax − Lcache < L ≤ Lmax     (linear from 0 to −1)
        −1                         if L > Lmax

    times `scale`. `cache_length` None = Lmax // 4. Lengths come from the `completion_ids` kwarg
    (list of token-id lists, as TRL passes) or a `completion_lengths` kwarg (list of ints).
    """
    if max_completion_length <= 0:
        raise ValueError(f"overlong_penalty: max_completion_length must be > 0, got {max_completion_length}")
    cache = max_completion_length // 4 if cache_length is None else cache_length
    if not 0 <= cache <= max_completion_length:
        raise ValueError(
            f"overlong_penalty: cache_length must be in [0, {max_completion_length}], got {cache}"
        )
    free = max_completion_length - cache

    def score(length: int) -> float:
        if length <= free:
            return 0.0
        if length <= max_completion_length:
            return scale * (free - length) / cache
        return -scale

    def overlong_penalty(
        prompts: list,
        completions: list,
        completion_ids: Sequence[Sequence[int]] | None = None,
        completion_lengths: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> list[RewardValue]:
        if completion_lengths is not None:
            lengths = [int(n) for n in completion_lengths]
        elif completion_ids is not None:
            lengths = [len(ids) for ids in completion_ids]
        else:
            raise ValueError(
                "overlong_penalty needs completion lengths in tokens: pass `completion_ids` or "
                "`completion_lengths`"
            )
        return [score(n) for n in lengths]

    return named(overlong_penalty, "overlong_penalty")
