"""`train`: GRPO on the validated training prompts (``grpo_core.train.loop.train``).

Reward weights: ``train.reward_weights`` when pinned, else calibration's ``weights_list``
(artifacts/calibration/reward_weights.json). Prompts: all, or calibration's ``kept_indices`` when
``calibrate.drop_always_solved`` / ``drop_never_solved`` is set.

Outputs: ``<train.output_dir>/checkpoints/`` (``persist: true``: DVC keeps it across runs so an
interrupted or extended run resumes), ``<train.output_dir>/model/``, ``metrics/train_log.csv`` (persistent
too: a resumed run keeps the steps before its checkpoint) and ``plots/training.png``.

Resume or start fresh? The checkpoints directory carries ``stage_fingerprint.json``: the training params
hash (``grpo_core.train.options.training_params_hash``, which leaves out max_steps and other bookkeeping keys)
plus md5s of the contents of the training data and the base model, the reward weights and the kept prompts
(``ContentHashes``: a touched, copied or re-downloaded model has the same fingerprint). The stage resumes only
when the fingerprint matches (a crash, or a larger ``max_steps``); otherwise - new params, new data, ``dvc
exp run -S train.learning_rate=...``, ``train.resume: never`` - it moves the checkpoints folder aside, whole,
to ``<output_dir>/checkpoints-previous/<fingerprint prefix>-<time>/`` with its train log (the 2 newest sets
are kept), so a DVC re-run never silently continues a different run and never deletes one; a run whose
inputs match a kept set takes it back and resumes. That folder is no DVC out (DVC neither caches nor
deletes it) and ignores itself in git. A ``max_steps`` below the newest checkpoint stops the stage (exit 2),
deleting nothing.

``train.num_processes > 1`` / ``train.num_machines > 1``: the stage re-launches itself as N processes on
each machine (flows/stages/launch.py); rank 0 logs to MLflow and writes the plot.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flows.comparison import pipeline_summary
from flows.stages.common import (
    CALIBRATION_DIFFICULTY,
    CALIBRATION_WEIGHTS,
    TRAIN_LOG,
    VALIDATED_EVAL,
    VALIDATED_TRAIN,
    StageConfigError,
    is_launched_child,
    md5_file,
    md5_path,
    read_json,
    require_file,
    with_validated_data,
)
from flows.stages.launch import (
    LAUNCH_MARKER,
    Machine,
    announce_launch,
    rank_exit_recorded,
    relaunch,
    wait_for_machine_zero,
)
from flows.stages.runs import StageRun
from grpo_core.common.files import atomic_path, write_json_atomic, write_text_atomic

FINGERPRINT = "stage_fingerprint.json"
MLFLOW_RUN_FILE = "mlflow_run.json"  # the train run's id: a resume continues that MLflow run
# Beside <output_dir>/checkpoints (a DVC out, cached whole): the checkpoint sets moved aside, and the cache of
# large inputs' md5s. Not an out, so DVC neither caches nor deletes it; its own .gitignore hides it from git.
KEPT_SETS_DIR = "checkpoints-previous"
KEPT_SETS_LIMIT = 2
INPUT_HASHES = "input_md5.json"
LARGE_FILE_BYTES = 512 << 20  # files above this are read once per (size, mtime, inode, device)
STASHED_LOG = "train_log.csv"  # a kept set's copy of metrics/train_log.csv, put back when it is taken back
PLOT = "plots/training.png"


@dataclass(frozen=True)
class TrainInputs:
    """Everything train reads of params.yaml (tests/test_dvc_params.py checks dvc.yaml lists each): the
    sections the trainer is handed - it gets a config holding only those (``only_sections``) - and
    calibration's drop flags."""

    train: Any
    generation: Any
    model: Any
    rewards: list
    data: Any
    guards: Any
    drop_prompts: tuple[bool, bool] = field(
        metadata={"param": ("calibrate.drop_always_solved", "calibrate.drop_never_solved")})


TRAINER_SECTIONS = ("train", "generation", "model", "rewards", "data", "guards")


def stage_inputs(cfg) -> TrainInputs:
    c = cfg.calibrate
    return TrainInputs(*(getattr(cfg, name) for name in TRAINER_SECTIONS),
                       drop_prompts=(c.drop_always_solved, c.drop_never_solved))


def reward_weights(ctx, cfg) -> tuple[list[float], str]:
    """(weights, where they came from): grpo_core's own rule (the one train() applies),
    calibration required."""
    from grpo_core.train.reward_weights import training_reward_weights

    return training_reward_weights([r.name for r in cfg.rewards], cfg.train.advantage.reward_weights,
                                   ctx.root, calibration_required=True)


def allowed_prompts(ctx, drop_prompts: tuple[bool, bool]) -> list[int] | None:
    """calibrate.drop_always_solved / drop_never_solved: the training prompts calibration kept
    (None = all)."""
    if not any(drop_prompts):
        return None
    doc = read_json(ctx.path(CALIBRATION_DIFFICULTY), "calibrate")
    kept = doc.get("kept_indices")
    return None if kept is None else [int(i) for i in kept]


def kept_sets_root(ctx, cfg) -> Path:
    """``<output_dir>/checkpoints-previous``, created with a .gitignore of ``*`` (big, and never git's)."""
    root = ctx.path(cfg.train.checkpoints.output_dir) / KEPT_SETS_DIR
    root.mkdir(parents=True, exist_ok=True)
    if not (root / ".gitignore").is_file():
        write_text_atomic(root / ".gitignore", "# the train stage's kept checkpoint sets and input md5s\n*\n")
    return root


class ContentHashes:
    """md5s of contents, as ``flows.stages.common.md5_path`` hashes a file or folder, except that files above
    ``large_file_bytes`` are read in full too - once: their md5 is remembered in ``cache_file`` under their
    (size, mtime_ns, inode, device), so a touch or a copy costs one more read, never another fingerprint."""

    def __init__(self, cache_file: Path, large_file_bytes: int = LARGE_FILE_BYTES):
        self.cache_file, self.large_file_bytes = cache_file, large_file_bytes
        try:
            entries = json.loads(cache_file.read_text())
        except (OSError, ValueError):  # none yet, or damaged: hashed afresh
            entries = {}
        self.entries: dict[str, dict] = entries if isinstance(entries, dict) else {}

    def path_md5(self, path: Path) -> str | None:
        """A file's md5, or a folder's (its sorted relative names and file md5s); None if absent."""
        return md5_path(path, file_md5=self.file_md5)

    def file_md5(self, path: Path) -> str:
        stamp = _stat_stamp(path)
        if stamp[0] <= self.large_file_bytes:
            return md5_file(path)
        key = str(path.absolute())
        entry = self.entries.get(key)
        if isinstance(entry, dict) and entry.get("stat") == stamp and isinstance(entry.get("md5"), str):
            return entry["md5"]
        md5 = md5_file(path)
        if _stat_stamp(path) == stamp:  # not rewritten while it was read
            self.entries[key] = {"stat": stamp, "md5": md5}
        return md5

    def save(self) -> None:
        """Write the cache, without the entries of files gone since (a warning if it cannot be written)."""
        self.entries = {k: v for k, v in self.entries.items() if Path(k).is_file()}
        try:
            write_json_atomic(self.cache_file, self.entries)
        except OSError as err:
            print(f"train: warning: cannot write {self.cache_file} ({err}): large inputs are read again next "
                  "time", file=sys.stderr)


def _stat_stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]


def fingerprint(ctx, cfg, weights: list[float], allowed: list[int] | None,
                large_file_bytes: int = LARGE_FILE_BYTES) -> dict:
    """What the checkpoints belong to: the training params hash and the md5s of the inputs' contents."""
    from grpo_core.model.loading import resolve_model_path
    from grpo_core.train.options import training_params_hash

    hashes = ContentHashes(kept_sets_root(ctx, cfg) / INPUT_HASHES, large_file_bytes)
    try:
        model_path = Path(resolve_model_path(cfg.model.name_or_path, ctx.root))
        model_md5 = hashes.path_md5(model_path) if model_path.exists() else cfg.model.name_or_path  # a hub id
    except Exception:  # noqa: BLE001 - the trainer reports model problems itself
        model_md5 = cfg.model.name_or_path
    fp = {
        "params_hash": training_params_hash(cfg, weights),
        "train_data_md5": hashes.path_md5(ctx.path(VALIDATED_TRAIN)),
        "base_model_md5": model_md5,
        "reward_weights": weights,
        "allowed_prompts_md5": None if allowed is None else md5_bytes(json.dumps(allowed).encode()),
    }
    hashes.save()
    return fp


def md5_bytes(data: bytes) -> str:

    return hashlib.md5(data).hexdigest()


def previous_run_id(run_file: Path) -> str | None:
    """The MLflow run the checkpoints were written under (``checkpoints/mlflow_run.json``), if recorded."""
    return _run_record(run_file).get("run_id") or None


def first_logged_step(run_file: Path, run, action: str) -> int:
    """The step the MLflow run's curve starts after: 0 for a fresh run; for a new run that resumed from
    checkpoint-k (an extended run, or one whose old run had finished), k - the steps before it are the earlier
    run's; a continued run keeps what its first process recorded."""
    from grpo_core.train.checkpoint import checkpoint_step

    if run.continued:
        return int(_run_record(run_file).get("first_step", 0))
    return checkpoint_step(action.removeprefix("resume:")) if action.startswith("resume:") else 0


def _run_record(run_file: Path) -> dict:
    try:
        record = json.loads(run_file.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def prepare_checkpoints(ctx, cfg, fp: dict, kept_limit: int = KEPT_SETS_LIMIT) -> str:
    """Resume (``resume:checkpoint-N``) when the checkpoints belong to these very inputs. Otherwise set them
    aside (kept, never deleted: ``kept_limit`` sets stay), take back a kept set of these inputs if there is
    one and resume from it, else start ``fresh``."""
    from grpo_core.train.checkpoint import remove_stale_temp_dirs

    ckpt_dir = ctx.path(cfg.train.checkpoints.output_dir) / "checkpoints"
    kept = kept_sets_root(ctx, cfg)
    remove_stale_temp_dirs(ckpt_dir)  # a crash's half-deleted or half-written folders, before anything counts
    remove_stale_temp_dirs(kept)
    fresh_asked = cfg.train.checkpoints.resume == "never"
    recorded = _read_fingerprint(ckpt_dir / FINGERPRINT)
    if fresh_asked or recorded != fp:
        reason = ("train.resume is 'never'" if fresh_asked
                  else "the training inputs changed (params, data, base model or reward weights)")
        _set_aside_run(ctx, ckpt_dir, kept, recorded, reason)
        if not fresh_asked:
            _take_back_run(ctx, ckpt_dir, kept, fp)
        _prune_kept_sets(kept, kept_limit)
    action = _resume_point(ckpt_dir, cfg.train.max_steps, kept)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(ckpt_dir / FINGERPRINT, fp)
    return action


def _read_fingerprint(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _is_bookkeeping(path: Path) -> bool:
    """A file of the stage's own beside the checkpoints (or the temp file of an interrupted write of one)."""
    return path.is_file() and (path.name in (FINGERPRINT, MLFLOW_RUN_FILE, LAUNCH_MARKER)
                               or path.name.startswith("."))


def _set_aside_run(ctx, ckpt_dir: Path, kept: Path, recorded: dict | None, reason: str) -> None:
    """Move the checkpoints folder, whole, into ``kept`` with a copy of the train log (its curve); one
    holding only the stage's bookkeeping (no checkpoint was written) is just emptied."""
    from grpo_core.train.checkpoint import set_aside

    entries = list(ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []
    if all(_is_bookkeeping(p) for p in entries):
        for p in entries:
            p.unlink()
        return
    label = md5_bytes(json.dumps(recorded, sort_keys=True).encode())[:12] if recorded else "unknown"
    where = set_aside(ckpt_dir, kept, label)
    if ctx.path(TRAIN_LOG).is_file():
        shutil.copyfile(ctx.path(TRAIN_LOG), where / STASHED_LOG)
    print(f"train: starting fresh ({reason}); the previous checkpoints were moved, not deleted, to {where}: "
          "a run with their inputs takes them back and resumes", file=sys.stderr)


def _take_back_run(ctx, ckpt_dir: Path, kept: Path, fp: dict) -> None:
    """Move the newest kept set recorded under ``fp`` back into place, with its train log."""
    from grpo_core.train.checkpoint import kept_sets

    match = next((s for s in reversed(kept_sets(kept)) if _read_fingerprint(s / FINGERPRINT) == fp), None)
    if match is None:
        return
    if ckpt_dir.exists():
        ckpt_dir.rmdir()  # empty now (an error, not a loss, if anything is left in it)
    os.replace(match, ckpt_dir)
    stash = ckpt_dir / STASHED_LOG
    if stash.is_file():
        with atomic_path(ctx.path(TRAIN_LOG)) as tmp:
            shutil.copyfile(stash, tmp)
        stash.unlink()
    print(f"train: these inputs match checkpoints set aside earlier: {match} moved back to {ckpt_dir}",
          file=sys.stderr)


def _prune_kept_sets(kept: Path, limit: int) -> None:
    from grpo_core.train.checkpoint import prune_kept_sets

    for gone in prune_kept_sets(kept, limit):
        print(f"train: removed {gone}, the oldest set of checkpoints kept aside (the {limit} newest stay)",
              file=sys.stderr)


def _resume_point(ckpt_dir: Path, max_steps: int, kept: Path) -> str:
    """``resume:<the newest valid checkpoint>``, or ``fresh`` without one; a StageConfigError, deleting
    nothing, when that checkpoint is past ``max_steps`` (resuming would export a model trained longer than
    asked, retraining would throw its steps away: the user decides)."""
    from grpo_core.train.checkpoint import checkpoint_step, latest_valid_checkpoint, list_checkpoints

    if not list_checkpoints(ckpt_dir):
        return "fresh"
    latest = latest_valid_checkpoint(ckpt_dir,
                                     warn=lambda msg: print(f"train: warning: {msg}", file=sys.stderr))
    step = checkpoint_step(latest)
    if step > max_steps:
        raise StageConfigError(
            f"train.max_steps={max_steps} is below the newest checkpoint, {latest} (step {step}); nothing "
            f"was deleted. Raise train.max_steps to {step} or more to resume from it, or set train.resume: "
            f"never to train from step 0 (the checkpoints are then moved to {kept}, which keeps the newest "
            "sets).")
    print(f"train: resuming from {latest}", file=sys.stderr)
    return f"resume:{latest.name}"


def run(ctx) -> int:
    with rank_exit_recorded(ctx):
        return _run_stage(ctx)


def _run_stage(ctx) -> int:
    from flows.stages.common import quiet_libraries
    from grpo_core.config import only_sections

    drop_prompts = stage_inputs(ctx.cfg).drop_prompts
    cfg = only_sections(with_validated_data(ctx.cfg), TRAINER_SECTIONS)
    machine = Machine.from_environment(cfg.train.parallel.num_machines)
    rank = is_launched_child()  # a process our launcher started, not the stage a user or DVC ran
    if machine.rank > 0 and not rank:
        wait_for_machine_zero(ctx, cfg)  # its stages before train write what this one reads
    require_file(ctx.path(VALIDATED_TRAIN), "validate")
    weights, weights_source = reward_weights(ctx, cfg)
    allowed = allowed_prompts(ctx, drop_prompts)
    if not rank:
        # machine 0 alone decides resume-or-fresh: the others reach the checkpoints through the shared
        # filesystem only after machine 0's processes have joined the rendezvous, i.e. after this
        if machine.rank == 0:
            action = prepare_checkpoints(ctx, cfg, fingerprint(ctx, cfg, weights, allowed))
            if cfg.train.parallel.num_machines > 1:
                announce_launch(ctx, cfg)
        if cfg.train.parallel.num_processes > 1:
            return relaunch(ctx, cfg)
    else:
        action = "distributed"
    if rank and int(os.environ.get("RANK", "0")) != 0:
        _train(ctx, cfg, weights, allowed, tracker=None)
        return 0  # the stage's exit code; rank 0 alone reports the result

    quiet_libraries()
    from flows.stages.plots import read_train_log, training_figure

    run_file = ctx.path(cfg.train.checkpoints.output_dir) / "checkpoints" / MLFLOW_RUN_FILE
    worker = _spawn_sampler(cfg)
    try:
        with StageRun(ctx,
                      continue_run_id=previous_run_id(run_file) if action.startswith("resume:")
                                      else None) as run:
            first = first_logged_step(run_file, run, action)
            if run.run_id:  # a resume after a crash logs on into this run: one continuous curve
                write_json_atomic(run_file, {"run_id": run.run_id, "first_step": first})
            run.set_tags({"train.reward_weights_source": weights_source, "train.checkpoints": action,
                          "train.num_allowed_prompts": "all" if allowed is None else str(len(allowed))})
            run.log_params({f"reward_weight.{r.name}": w for r, w in zip(cfg.rewards, weights)})
            evaluates = cfg.train.evaluation.eval_strategy == "steps"
            run.log_data_hashes([VALIDATED_TRAIN, VALIDATED_EVAL] if evaluates else [VALIDATED_TRAIN])
            run.log_datasets([("train", VALIDATED_TRAIN, "training")]
                             + ([("eval", VALIDATED_EVAL, "evaluation")] if evaluates else []))
            result = _train(ctx, cfg, weights, allowed, tracker=run if run.tracker is not None else None,
                            sampler_worker=worker)
            log = read_train_log(ctx.path(TRAIN_LOG))
            # what an outage or a killed run's backlog lost, of the steps this MLflow run owns
            if sent := run.backfill(r for r in log.to_dict("records") if r["step"] > first):
                print(f"train: {sent} metric value(s) from {TRAIN_LOG} that MLflow lacked were sent",
                      file=sys.stderr)
            run.log_to_parent(pipeline_summary(ctx.root, eval_path=None, train_log=TRAIN_LOG))
            training_figure(log, ctx.path(PLOT))
            run.set_tags({"train.final_step": str(result.final_step),
                          "train.resumed_from": str(result.resumed_from) if result.resumed_from else "none",
                          "train.exported_step": str(result.exported_step)})
            if result.best_step is not None:
                run.set_tags({"train.best_step": str(result.best_step),
                              f"train.best.{cfg.train.evaluation.best_metric}": f"{result.best_value:.6g}"})
            run.log_artifact(ctx.path(TRAIN_LOG), "metrics")
            run.log_artifact(ctx.path(PLOT), "plots")
            if weights_source == CALIBRATION_WEIGHTS:
                run.log_artifact(ctx.path(CALIBRATION_WEIGHTS), "calibration")
            last = result.last_metrics
            if last:
                best = (f" (from the best step, {result.exported_step})"
                        if result.exported_step != result.final_step else "")
                print(f"train: step {result.final_step}: reward {last.get('reward', float('nan')):.4f}, "
                      f"kl {last.get('kl', float('nan')):.5f}; model in {result.model_dir}{best}",
                      file=sys.stderr)
    finally:
        if worker is not None:
            worker.close()
    return 0


def _spawn_sampler(cfg):
    """train.async_rollouts: the sampler worker, spawned before the MLflow run and the trainer's set-up, which
    its imports (seconds) then overlap; None otherwise."""
    if not cfg.train.rollouts.async_rollouts:
        return None
    from grpo_core.train.sampler_worker import SamplerWorker

    return SamplerWorker()


def _train(ctx, cfg, weights, allowed, tracker, sampler_worker=None):
    from grpo_core.train.loop import TrainHooks, train

    quiet = not sys.stderr.isatty()
    return train(cfg, reward_weights=weights, root=ctx.root, allowed_prompts=allowed, progress=not quiet,
                 log_path=TRAIN_LOG, hooks=TrainHooks(tracker=tracker, sampler_worker=sampler_worker))
