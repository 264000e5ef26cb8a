"""Atomic, resumable checkpoints.

``<dir>/checkpoint-<step>/`` holds everything a bit-exact resume needs:

- ``model.safetensors`` + config + tokenizer (HF format, ``save_pretrained``) — loadable on its own; under
  LoRA ``adapter_model.safetensors`` + ``adapter_config.json`` instead (peft's format: the adapters alone,
  the frozen base is not copied into every checkpoint);
- ``optimizer.pt``, ``scheduler.pt`` — loaded with ``torch.load(weights_only=True)``;
- ``rollout_buffer.pt`` — the generation batch in use when a step boundary falls inside it
  (``num_iterations`` > 1 or ``steps_per_generation`` > 1), else absent;
- ``reference.safetensors`` — the reference weights when they have been synced (TR-DPO);
- ``pending_groups.pt`` — dynamic sampling's kept groups not yet trained on, one entry per process;
- ``ahead_round.pt`` — ``train.async_rollouts``: the next round, sampled ahead by older weights (its sampling
  step is in ``trainer_state.json``);
- ``trainer_state.json`` — step, data-sampler position, the RNG states of every process (python, numpy,
  torch, and the process's own GPU), the params hash, and the metrics of the last step;
- ``manifest.json`` — written last: each other file's size and sha256. Resume verifies it and falls back to
  the newest checkpoint that matches (``latest_valid_checkpoint``): a file truncated, changed or lost since it
  was written is named, never loaded.

A checkpoint is written into ``checkpoint-<step>.tmp-<pid>`` and renamed into place only once every
file is flushed, so a crash never leaves a partial checkpoint under a valid name: a checkpoint is
complete or absent. Deleting one (pruning, a same-step re-save) first renames it to ``.trash-<pid>``, and a
replaced one waits as ``.old-<pid>`` until its successor is in place; ``remove_stale_temp_dirs`` clears such
leftovers (``LEFTOVER``) and puts back an ``.old`` whose successor never landed. A checkpoint without its
manifest is never trusted.

Kept sets: the stage moves a whole checkpoints folder aside (``set_aside``) instead of deleting it when its
inputs change, into a folder of at most a few sets (``kept_sets``, ``prune_kept_sets``).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from grpo_core.common.errors import TrainingFailure
from grpo_core.common.files import discard_partial, sha256_file
from grpo_core.common.options import Options, option
from grpo_core.common.rng import rng_state
from grpo_core.model.loading import is_peft_model
from grpo_core.model.sharding import is_sharded, load_full_weights

STATE_FILE = "trainer_state.json"
REFERENCE_FILE = "reference.safetensors"
PENDING_FILE = "pending_groups.pt"
AHEAD_FILE = "ahead_round.pt"
MANIFEST_FILE = "manifest.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")
# What an interrupted write, replace or delete leaves beside a folder ``<name>``: ``tmp`` a write not yet
# renamed in, ``old`` the folder a write of the same name replaces, ``trash`` a folder being deleted. Never
# resumed.
LEFTOVER = re.compile(r"^(?P<name>[^.].*?)\.(?P<kind>tmp|old|trash)-\d+$")
# A kept set: <label>-<UTC time it was set aside>, the time sorting the sets oldest first
_KEPT_SET = re.compile(r"^(?P<label>\w+)-(?P<stamp>\d{8}T\d{12}Z)$")


log = logging.getLogger(__name__)


@dataclass
class CheckpointOptions(Options):
    """params.yaml `train:` keys of where checkpoints go, how often, how many are kept, and resuming."""

    output_dir: str = option("artifacts", "checkpoints go to <output_dir>/checkpoints, the model to "
                             "<output_dir>/model")
    save_strategy: Literal["steps", "no"] = option(
        "steps", "steps = a checkpoint every save_steps and at the end; no = none (nothing to resume or roll "
        "back to)")
    save_steps: int = option(50, "checkpoint every N optimizer steps (and at the end)", ge=1)
    save_total_limit: int = option(2, "checkpoints kept (oldest deleted first)", ge=1)
    resume: Literal["auto", "never"] = option("auto",
                                              "resume from the latest valid checkpoint, or start fresh")


class CheckpointError(TrainingFailure, RuntimeError):
    """A checkpoint cannot be used (incompatible params, unreadable files); the message says which."""


def _fsync_tree(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class CheckpointContents:
    """What one checkpoint holds (the module docstring names each file); a None field writes no file."""

    model: Any                  # saved with ``save_pretrained`` (under LoRA, peft's adapters alone)
    tokenizer: Any
    optimizer_state: dict       # ``optimizer.state_dict()`` (plain format)
    scheduler: Any              # its ``state_dict()`` is saved
    state: dict                 # trainer_state.json's entries; the step and the RNG states are added to them
    rollout_buffer: dict | None = None  # the generation round in use, when the step ends inside it
    # The model's whole weights when it holds only a shard (FSDP2, ``model.sharding.gather_weights``);
    # None: the model's own are saved.
    weights: dict[str, torch.Tensor] | None = None
    pending_groups: list[dict | None] | None = None  # dynamic sampling's pending groups, one per process
    ahead_round: dict | None = None  # async rollouts: the round sampled ahead
    reference: dict[str, torch.Tensor] | None = None  # the synced reference's whole weights (TR-DPO)
    rng_states: list[dict] | None = None  # every process's ``rng_state()`` in rank order (None: this one's)


def save_checkpoint(directory: str | Path, step: int, contents: CheckpointContents, *,
                    keep_last: int | None = None, keep_step: int | None = None) -> Path:
    """Write checkpoint-<step> with ``contents`` atomically; prune to the newest ``keep_last`` and
    checkpoint-<keep_step> (the best one, kept beside them as transformers' Trainer keeps its best).
    Returns the final path."""
    from safetensors.torch import save_file

    c = contents
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"checkpoint-{step}"
    remove_stale_temp_dirs(directory)  # a killed or failed earlier write's (one writer: the lock)
    tmp = _leftover_path(final, "tmp")
    tmp.mkdir()
    try:
        if c.weights is None:
            c.model.save_pretrained(tmp, safe_serialization=True)
        else:  # transformers writes config.json (architecture without the FSDP prefix) and the tensors given
            c.model.save_pretrained(tmp, safe_serialization=True, state_dict=untie(c.weights, c.model))
        c.tokenizer.save_pretrained(tmp)
        torch.save(c.optimizer_state, tmp / "optimizer.pt")
        torch.save(c.scheduler.state_dict(), tmp / "scheduler.pt")
        if c.rollout_buffer is not None:
            torch.save(c.rollout_buffer, tmp / "rollout_buffer.pt")
        if c.pending_groups is not None:
            torch.save(c.pending_groups, tmp / PENDING_FILE)
        if c.ahead_round is not None:
            torch.save(c.ahead_round, tmp / AHEAD_FILE)
        if c.reference is not None:  # tied tensors once (safetensors refuses shared storage); loading re-ties
            save_file(untie(c.reference, c.model), tmp / REFERENCE_FILE)
        rngs = c.rng_states if c.rng_states is not None else [rng_state()]
        full_state = {**c.state, "step": step, "rng": rngs}
        (tmp / STATE_FILE).write_text(json.dumps(full_state, indent=1))
        write_manifest(tmp)
        _fsync_tree(tmp)
    except BaseException as err:
        discard_partial(tmp, final, err)
        raise
    replace_folder(tmp, final)  # re-saving the same step (e.g. the end of a resumed run) replaces it whole
    if keep_last:
        for old in list_checkpoints(directory)[:-keep_last]:
            if keep_step is None or old.name != f"checkpoint-{keep_step}":
                discard_folder(old)
    return final


def _leftover_path(path: Path, kind: str) -> Path:
    return path.with_name(f"{path.name}.{kind}-{os.getpid()}")


def replace_folder(new: Path, target: Path) -> None:
    """Rename ``new`` to ``target``; an existing ``target`` waits as ``<target>.old-<pid>`` until ``new`` is
    in place (``remove_stale_temp_dirs`` puts it back if a kill comes between the two renames)."""
    aside = None
    if target.exists():
        aside = _leftover_path(target, "old")
        os.replace(target, aside)
    os.replace(new, target)
    if aside is not None:
        discard_folder(aside)


def discard_folder(path: Path) -> None:
    """Delete the folder ``path`` atomically: renamed to ``<path>.trash-<pid>`` first, so a crash mid-delete
    leaves a leftover nothing resumes from (the next start removes it), never a half folder under its name."""
    trash = _leftover_path(path, "trash")
    if trash.exists():  # a crashed earlier process of the same pid's
        shutil.rmtree(trash)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def write_manifest(folder: Path) -> None:
    """``manifest.json``: every file of the checkpoint folder (relative path -> bytes, sha256),
    written last."""
    files = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE}
    (folder / MANIFEST_FILE).write_text(json.dumps({"files": files}, indent=1))


def checkpoint_problem(path: str | Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be trusted, naming the file (None: every file is as written).

    No manifest (written last) means an unfinished write, a half-deleted folder or an unknown copy: not
    trusted."""
    path = Path(path)
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        return (f"{manifest} is missing, so its files cannot be verified (a checkpoint's manifest is written "
                "last: without it the folder may be partial)")
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{manifest}: unreadable ({err})"
    for name, want in files.items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing (the manifest lists it)"
        size = file.stat().st_size
        if size != want["bytes"]:
            return f"{file} has {size} bytes, the manifest says {want['bytes']} (truncated or rewritten)"
        if sha256_file(file) != want["sha256"]:
            return f"{file}: its sha256 differs from the manifest's (its bytes changed after it was written)"
    return None


def latest_valid_checkpoint(directory: str | Path, warn: Callable[[str], None] = log.warning) -> Path | None:
    """The newest checkpoint whose files match its manifest; each newer one that does not is skipped with a
    warning naming the file. None when there is no checkpoint; a CheckpointError when none is valid."""
    checkpoints = list_checkpoints(directory)
    problems = []
    for path in reversed(checkpoints):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        problems.append(problem)
        warn(f"checkpoint {path.name} is corrupt, skipped: {problem}")
    if problems:
        raise CheckpointError(f"{directory}: no valid checkpoint to resume from: " + "; ".join(problems)
                              + ". Start fresh with train.resume: never (or delete the folder).")
    return None


def untie(weights: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """Whole weights without the tied copies (``lm_head.weight`` when it is the embedding): gathered weights
    come once per name, and the file must hold what an unsharded save holds (loading re-ties)."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return {k: v for k, v in weights.items() if not (k in tied and tied[k] in weights)}


def checkpoint_step(path: str | Path) -> int:
    """The step of a ``checkpoint-<step>`` folder."""
    m = _NAME.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path} is not a checkpoint-<step> folder")
    return int(m.group(1))


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temp dirs and dirs without a state file are ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    ckpts = list_checkpoints(directory)
    return ckpts[-1] if ckpts else None


def remove_stale_temp_dirs(directory: str | Path) -> int:
    """Clear the ``LEFTOVER`` folders of interrupted writes, replaces and deletes in ``directory``; an
    ``.old`` one whose successor never landed is put back under its name instead. Returns how many were
    removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    removed = 0
    for p in sorted(directory.iterdir()):
        m = LEFTOVER.match(p.name)
        if m is None or not p.is_dir() or p.is_symlink():
            continue
        target = directory / m["name"]
        if m["kind"] == "old" and not target.exists():
            os.replace(p, target)
            log.warning("put %s back: the write that replaced it was cut off before its new folder landed",
                        target)
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed += 1
    return removed


def set_aside(folder: Path, kept_root: Path, label: str) -> Path:
    """Move the whole ``folder`` (one rename: never half moved) to ``<kept_root>/<label>-<UTC time>``."""
    if not re.fullmatch(r"\w+", label):
        raise ValueError(f"set_aside: label {label!r} must be letters, digits or _")
    kept_root.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    target = kept_root / f"{label}-{stamp}"
    if target.exists():
        raise FileExistsError(f"{target} exists: cannot set {folder} aside there")
    try:
        os.replace(folder, target)
    except OSError as err:
        raise CheckpointError(f"cannot move {folder} to {target} ({err}); nothing was moved or deleted: move "
                              "it yourself, or keep the checkpoints folder on the same filesystem as its "
                              "parent") from err
    return target


def kept_sets(kept_root: Path) -> list[Path]:
    """The sets ``set_aside`` moved into ``kept_root``, oldest first (leftovers and other files ignored)."""
    if not kept_root.is_dir():
        return []
    found = [(m["stamp"], p) for p in kept_root.iterdir()
             if (m := _KEPT_SET.match(p.name)) and p.is_dir() and not p.is_symlink()]
    return [p for _, p in sorted(found)]


def prune_kept_sets(kept_root: Path, limit: int) -> list[Path]:
    """Delete (``discard_folder``) the oldest kept sets beyond the newest ``limit``; returns those removed."""
    remove_stale_temp_dirs(kept_root)
    sets = kept_sets(kept_root)
    doomed = sets[:-limit] if limit > 0 else sets
    for path in doomed:
        discard_folder(path)
    return doomed


@dataclass
class LoadedCheckpoint:
    path: Path
    state: dict
    optimizer: dict
    scheduler: dict
    rollout_buffer: dict | None
    reference_file: Path | None  # the synced reference's weights (load with ``restore_reference_weights``)
    pending_groups: list | None = None  # dynamic sampling's pending groups, one buffer (or None) per process
    ahead_round: dict | None = None     # async rollouts: the round sampled ahead (a Round buffer)


def load_checkpoint(path: str | Path, expected_hash: str | None = None,
                    device: torch.device | str = "cpu") -> LoadedCheckpoint:
    """Read a checkpoint's training state (the weights load with ``from_pretrained(path)``).

    device: where the optimizer's and scheduler's tensors go (the loading process's own device: without it
    torch.load puts them where they were saved, so every rank of an 8-GPU resume would fill GPU 0).
    Buffers of samples go to the CPU, where the loop keeps them. Refuses, with a clear error, a checkpoint
    written under different training params.
    """

    path = Path(path)
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: unreadable {STATE_FILE}: {err}") from err
    if expected_hash is not None and state.get("params_hash") != expected_hash:
        raise CheckpointError(
            f"{path}: written under different training params (hash {str(state.get('params_hash'))[:12]}, "
            f"now {expected_hash[:12]}). Resuming would mix two runs. Start fresh with train.resume: never "
            f"(or delete {path.parent}), or restore the params it was written with.")
    device = torch.device(device)
    # (torch.load knows no "cpu:0", accelerate's)
    device = torch.device("cpu") if device.type == "cpu" else device
    buffer_file = path / "rollout_buffer.pt"
    ref_file = path / REFERENCE_FILE
    pending_file = path / PENDING_FILE
    ahead_file = path / AHEAD_FILE
    return LoadedCheckpoint(
        path=path,
        state=state,
        optimizer=torch.load(path / "optimizer.pt", weights_only=True, map_location=device),
        scheduler=torch.load(path / "scheduler.pt", weights_only=True, map_location=device),
        rollout_buffer=_load_on_cpu(buffer_file),
        reference_file=ref_file if ref_file.exists() else None,
        pending_groups=_load_on_cpu(pending_file),
        ahead_round=_load_on_cpu(ahead_file),
    )


def _load_on_cpu(file: Path) -> Any:
    return torch.load(file, weights_only=True, map_location="cpu") if file.exists() else None


def restore_policy_weights(model, path: Path) -> None:
    """A checkpoint's trained weights into ``model``: every weight, or under LoRA the adapters alone (what
    peft's ``save_pretrained`` wrote, in its own key names)."""
    from safetensors.torch import load_file

    if is_peft_model(model):
        from peft import set_peft_model_state_dict

        adapter = path / "adapter_model.safetensors"
        if not adapter.is_file():
            raise CheckpointError(f"{path}: no adapter_model.safetensors; the checkpoint was not written by "
                                "a LoRA run (model.lora is set now)")
        state = load_file(adapter)
        result = set_peft_model_state_dict(model, state)
        lora_keys = [k for k, _ in model.named_parameters() if "lora_" in k]
        missing = [k for k in result.missing_keys if "lora_" in k]
        if result.unexpected_keys or missing or len(state) != len(lora_keys):
            raise CheckpointError(f"{path}: checkpoint adapters do not match the model (missing "
                                f"{missing[:5]}, unexpected {list(result.unexpected_keys)[:5]}; {len(state)} "
                                f"tensors saved, {len(lora_keys)} adapter weights in the model)")
        return
    files = sorted(path.glob("*.safetensors"))
    files = [f for f in files if f.name != REFERENCE_FILE]
    state = {}
    for f in files:
        state.update(load_file(f))
    missing, unexpected = _load_whole(model, state)
    # Tied embeddings are saved once; anything else missing means a different architecture.
    missing = [k for k in missing if "lm_head" not in k]
    if missing or unexpected:
        raise CheckpointError(f"{path}: checkpoint weights do not match the model (missing {missing[:5]}, "
                            f"unexpected {unexpected[:5]})")


def restore_reference_weights(model: torch.nn.Module, path: Path) -> None:
    """A checkpoint's synced reference weights (``CheckpointContents.reference``) into ``model``."""
    from safetensors.torch import load_file, load_model

    if is_sharded(model):
        missing, unexpected = _load_whole(model, load_file(path))
        missing = [k for k in missing if "lm_head" not in k]  # a tied head is saved once, as the embedding
    else:
        missing, unexpected = load_model(model, path, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{path}: reference weights do not match the model (missing "
                              f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")


def _load_whole(model, weights: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Whole weights into ``model`` (into its shards when it is sharded: collective); (missing,
    unexpected)."""
    if is_sharded(model):
        return load_full_weights(model, weights)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    return list(missing), list(unexpected)
