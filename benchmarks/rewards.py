"""The benchmark's reward: cheap, identical on both sides, and with within-group variance (so the
advantages, hence the policy-gradient term, are not all zero)."""

from __future__ import annotations


def length_parity(prompts, completions, **columns) -> list[float]:
    """1.0 when the completion text has an even number of characters, else 0.0."""
    out = []
    for c in completions:
        text = c if isinstance(c, str) else c[0]["content"]
        out.append(float(len(text) % 2 == 0))
    return out
