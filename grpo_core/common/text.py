"""The one rule that says two prompts are the same: validate's duplicate and train/eval overlap checks key
every prompt with it, and the reasoning-gym source deduplicates with it, so what prepare keeps validate
passes."""

from __future__ import annotations

import re


def text_key(text: str) -> str:
    """``text`` case-folded, its whitespace runs collapsed to one space, stripped."""
    return re.sub(r"\s+", " ", text).strip().casefold()
