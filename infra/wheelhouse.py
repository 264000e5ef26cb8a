"""What the GPU kit (benchmarks/gpu_kit.py) takes to a bare GPU machine: wheels and the commit it runs.

    python -m infra.wheelhouse            # = make bench-gpu-wheels: .whl/ filled, .whl/kit-stamp.json written
    python -m infra.wheelhouse --stamp    # the stamp alone (before every GPU call, after any commit)

The device machines' image (torch with CUDA, accelerate, numpy, pandas, pyarrow, pyyaml, peft, nvidia-ml-py,
...) lacks TRL, datasets and their own needs, and holds another transformers; they travel as wheels at the
versions this project's environment runs (``WHEELS``, read from the installed packages here), for the
machine's Python (3.12) and x86-64 Linux, downloaded without their dependencies (each one the kit needs is
named). vLLM's CUDA build does not travel: its wheel alone (vllm 0.32.0, manylinux_2_28) is 326.5 MB, over the
64 MiB a run may carry; the kit measures it where it is installed.

A copied work tree has no .git, so the stamp records the commit (``git rev-parse HEAD``), whether tracked
files differed from it, and a SHA-256 of every tracked file: on the GPU machine ``check_stamp`` says whether
the files that ran are the stamped ones, and names those that are not.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELHOUSE = REPO / ".whl"
STAMP = WHEELHOUSE / "kit-stamp.json"
# What the image lacks or holds at another version, for the sides of the kit: TRL 1.16 and its datasets (with
# dill, multiprocess), transformers as this project pins it (with the regex it needs), and ruamel.yaml (the
# config loader, grpo_core.config.load_config), gguf (part e converts the real model's GGUF), and pandera with
# what it needs that the image lacks (grpo_core.config imports validate's options, beside its schemas).
WHEELS = ("trl", "datasets", "dill", "multiprocess", "transformers", "regex", "ruamel.yaml", "gguf",
          "pandera", "typeguard", "pydantic", "pydantic-core", "typing-inspection", "annotated-types",
          "typing-extensions")
# Part e's model: the GGUF `make setup` puts in models/ (94 MiB) is over what one call carries, so it travels
# in thirds, one per call, into .kit-model/ (ignored by git); the third call joins them
# (benchmarks/README.md).
GGUF = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_PIECES = REPO / ".kit-model"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
UNSTAMPED = ("benchmarks/results/",)  # what the kit itself writes: not part of the code that ran


def pinned() -> list[str]:
    """NAME==VERSION for each of WHEELS, as installed here."""
    return [f"{name}=={md.version(name)}" for name in WHEELS]


def download(python_version: str = "3.12", dest: Path = WHEELHOUSE) -> list[Path]:
    dest.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", python_version, "--implementation", "cp",
               *(arg for p in PLATFORMS for arg in ("--platform", p)), "-d", str(dest), *pinned()]
    subprocess.run(command, check=True)
    return sorted(dest.glob("*.whl"))


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def file_hashes(paths: list[str]) -> dict[str, str | None]:
    """SHA-256 of each file (None: missing)."""
    out = {}
    for path in paths:
        target = REPO / path
        out[path] = hashlib.sha256(target.read_bytes()).hexdigest() if target.is_file() else None
    return out


def write_stamp() -> dict:
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        raise SystemExit("no git checkout here: the stamp records the commit `git rev-parse HEAD` names")
    tracked = [p for p in _git("ls-files").splitlines() if not p.startswith(UNSTAMPED)]
    stamp = {"commit": commit, "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
             "date": time.strftime("%Y-%m-%d %H:%M:%S"), "files": file_hashes(tracked)}
    WHEELHOUSE.mkdir(exist_ok=True)
    tmp = STAMP.with_suffix(".tmp")
    tmp.write_text(json.dumps(stamp, indent=0))
    tmp.replace(STAMP)
    return stamp


def check_stamp(stamp: dict) -> dict:
    """Whether this tree's files are the stamped ones: the differing paths (changed or missing), up to 20."""
    now = file_hashes(list(stamp["files"]))
    differing = sorted(p for p, h in stamp["files"].items() if now[p] != h)
    return {"files_match_stamp": not differing, "files_differing": differing[:20],
            "files_differing_count": len(differing)}


def commit_info() -> dict:
    """The commit the kit ran: git's where there is a checkout, else the stamp's
    (and whether the files match)."""
    commit = _git("rev-parse", "HEAD")
    if commit is not None:
        return {"commit": commit, "source": "git",
                "dirty": bool(_git("status", "--porcelain", "--untracked-files=no"))}
    if STAMP.is_file():
        stamp = json.loads(STAMP.read_text())
        return {"commit": stamp["commit"], "source": f".whl/kit-stamp.json ({stamp['date']})",
                "dirty": stamp["dirty"], **check_stamp(stamp)}
    return {"commit": None,
            "source": "none: no .git and no .whl/kit-stamp.json (make bench-gpu-wheels writes it)"}


def split_model(pieces: int = 3) -> list[Path]:
    """The GGUF in ``pieces`` files of (nearly) equal size in .kit-model/, named in order
    (``cat`` joins them)."""
    data = GGUF.read_bytes()
    MODEL_PIECES.mkdir(exist_ok=True)
    size = -(-len(data) // pieces)
    out = []
    for i in range(pieces):
        path = MODEL_PIECES / f"{GGUF.name}.part{i}"
        path.write_bytes(data[i * size:(i + 1) * size])
        out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stamp", action="store_true", help="write the stamp only")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    a = parser.parse_args(argv)
    stamp = write_stamp()
    print(f"stamp: {stamp['commit'][:12]}{' (tracked files differ from it)' if stamp['dirty'] else ''}, "
          f"{len(stamp['files'])} files -> {STAMP.relative_to(REPO)}")
    if a.stamp:
        return 0
    wheels = download(a.python_version)
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"  {w.stat().st_size / 2**20:6.2f} MiB  {w.name}")
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {WHEELHOUSE.relative_to(REPO)}/ (a run carries "
          "64 MiB in all, the work tree included)")
    if GGUF.is_file():
        for piece in split_model():
            print(f"  {piece.stat().st_size / 2**20:6.2f} MiB  {piece.relative_to(REPO)} (part e's model, "
                  "one per call)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
