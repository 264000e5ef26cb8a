"""Helpers every stage uses: the repo root, params, atomic writes, the validated-data convention.

Paths: a stage reads and writes relative to the *work root* - the repository root found from the working
directory (``dvc exp run --temp/--queue`` runs stages in a copy under ``.dvc/tmp/exps/``; the copy is the
work root then). The MLflow store belongs to the *original* repository: ``store_root`` is DVC's
``DVC_ROOT`` (set by DVC for every stage command, and pointed at the parent repo for temp/queued
experiments), falling back to the work root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_core.common.errors import ConfigurationError, InputUnreadable, TransientFailure

#: validate's outputs, the only data the downstream stages read (canonical `prompt` / `answer` columns).
VALIDATED_TRAIN = "data/validated/train.parquet"
VALIDATED_EVAL = "data/validated/eval.parquet"
# = grpo_core.train.reward_weights's (a test holds)
CALIBRATION_WEIGHTS = "artifacts/calibration/reward_weights.json"
CALIBRATION_DIFFICULTY = "artifacts/calibration/difficulty.json"
TRAIN_LOG = "metrics/train_log.csv"


class StageInputError(InputUnreadable, RuntimeError):
    """An input a stage needs is missing or malformed; the message names the file and the stage that makes
    it."""


class StageConfigError(ConfigurationError, ValueError):
    """A stage cannot run with these parameters; the message names the key."""


class StageBusy(TransientFailure):
    """Another stage process holds this repo's stage lock; the message names it. Exit 1: worth a later
    retry."""


class FlowBusy(TransientFailure):
    """Another flow run holds this repo (its params.yaml and stages); the message names it."""


# --------------------------------------------------------------------------------------------------
# one writer at a time


def stage_lock_path(root: Path, machine: int = 0) -> Path:
    """Where a repo's stage lock lives: DVC's own tmp folder (git-ignored, per work root: a
    ``dvc exp run --temp`` copy has its own), or the repo root without one. Machine k > 0 of a multi-machine
    run holds a lock of its own there (machine 0's stage holds the repo's while they all train)."""
    tmp = root / ".dvc" / "tmp"
    name = "grpo-stage.lock" if machine == 0 else f"grpo-stage.machine-{machine}.lock"
    return (tmp if tmp.parent.is_dir() else root) / name


def flow_lock_path(root: Path) -> Path:
    """The lock a Prefect flow run holds on its repo from its params.yaml overrides to its last stage."""
    return stage_lock_path(root).with_name("grpo-flow.lock")


RANK_EXITS_ENV = "GRPO_RANK_EXITS"  # set by launch.run_launcher in the ranks it starts


def is_launched_child(environ=None) -> bool:
    """A rank that this project's launcher started (``run_launcher``: the stage process that launched it holds
    the lock for it). WORLD_SIZE, LOCAL_RANK or MACHINE_RANK alone do not say so: SLURM, Kubernetes and
    torchrun set them around a stage that nobody else locks for."""
    env = os.environ if environ is None else environ
    folder = env.get(RANK_EXITS_ENV)
    return "LOCAL_RANK" in env and bool(folder) and os.path.isdir(folder)


def machine_rank(environ=None) -> int:
    """MACHINE_RANK (0 when unset): which machine of a multi-machine run this is (docs/scaling.md)."""
    env = os.environ if environ is None else environ
    return int(env.get("MACHINE_RANK", "0") or 0)


@contextlib.contextmanager
def exclusive(path: Path, holder: str, refused: Callable[[str], Exception], record: dict | None = None):
    """Hold the lock file ``path`` as ``holder`` or raise ``refused(<who holds it>)`` at once; yields what the
    previous holder left in ``<path>.holder`` (None if nothing readable).

    filelock's lock is the kernel's (flock): it ends with its process, so the lock of a killed holder is free
    at once and the file it leaves behind is reused. The holder's name, PID and ``record`` go into
    ``<path>.holder``."""
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    holder_file = path.with_suffix(".holder")
    lock = FileLock(str(path), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        try:
            who = json.loads(holder_file.read_text())
            named = f"`{who['stage']}` (PID {who['pid']}, since {who['since']})"
        except (OSError, ValueError, KeyError):
            named = "another process"
        raise refused(named) from None
    try:
        previous = json.loads(holder_file.read_text())
    except (OSError, ValueError):
        previous = None
    try:
        holder_file.write_text(json.dumps({**(record or {}), "stage": holder, "pid": os.getpid(),
                                           "since": time.strftime("%Y-%m-%d %H:%M:%S")}))
        yield previous if isinstance(previous, dict) else None
    finally:
        lock.release()


def stage_lock(root: Path, stage: str, environ=None):
    """Hold the repo's stage lock while a stage writes its outputs: a second stage process in the same work
    root (two `python -m flows.stages train`, or evaluate while train runs) is refused at once, naming the
    holder. On machine k > 0 (MACHINE_RANK) the lock is that machine's."""
    path = stage_lock_path(root, machine_rank(environ))
    return exclusive(path, stage, lambda named: StageBusy(
        f"{stage}: {named} is running in {root} and holds {path}; two stages writing one repo's outputs at "
        "once would mix them. Wait for it to end, or stop it."))


# --------------------------------------------------------------------------------------------------
# process environment


def prepare_process_env() -> None:
    """Defaults for a stage process: no telemetry, no progress-bar noise, a headless matplotlib."""
    for key, value in {
        "DVC_NO_ANALYTICS": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "MPLBACKEND": "Agg",
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        # MLflow's own defaults (7 retries, backoff x2, 120 s timeout) block a training step for minutes
        # per request while a tracking server is down; MLflowTracker keeps a backlog and retries on a
        # later step itself, so one short try per attempt is enough.
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
    }.items():
        os.environ.setdefault(key, value)
    # bitsandbytes (imported by peft whenever it is installed) warns on AVX512-BF16 CPUs that the `kernels`
    # package, which fetches a 4-bit kernel from the hub, is absent: nothing here needs it (4-bit bases use
    # bitsandbytes' own CPU kernel), and a user reads the warning as a fault
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def quiet_libraries() -> None:
    """Switch off HF progress bars (call after the stage has imported transformers / datasets)."""
    try:
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    try:
        import datasets

        datasets.disable_progress_bars()
        datasets.utils.logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


# --------------------------------------------------------------------------------------------------
# roots and params


def find_repo_root(start: str | os.PathLike | None = None) -> Path:
    """The nearest directory at or above ``start`` (default: the cwd) holding ``dvc.yaml`` or ``.dvc/``."""
    here = Path(start or os.getcwd()).resolve()
    for candidate in (here, *here.parents):
        if (candidate / "dvc.yaml").is_file() or (candidate / ".dvc").is_dir():
            return candidate
    return here


def store_root(work_root: Path, environ: dict | None = None) -> Path:
    """Where the MLflow store lives: DVC_ROOT (the original repo,
    also for temp experiments) or the work root."""
    env = os.environ if environ is None else environ
    dvc_root = (env.get("DVC_ROOT") or "").strip()
    if dvc_root and Path(dvc_root).is_dir():
        return Path(dvc_root).resolve()
    return work_root


@dataclass
class StageContext:
    stage: str
    root: Path
    store_root: Path
    params_path: Path
    cfg: Any  # grpo_core.config.PipelineConfig

    @classmethod
    def create(cls, stage: str, params: str | os.PathLike = "params.yaml",
               start: str | os.PathLike | None = None) -> StageContext:
        root = find_repo_root(start)
        params_path = Path(params)
        if not params_path.is_absolute():
            params_path = root / params_path
        cfg = load_params(params_path)
        from grpo_core.model.cpu_kernels import pin_cpu_kernels

        pin_cpu_kernels(cfg.model.cpu_kernels)  # before the stage's first tensor op
        return cls(stage=stage, root=root, store_root=store_root(root), params_path=params_path, cfg=cfg)

    def path(self, relative: str | os.PathLike) -> Path:
        p = Path(relative)
        return p if p.is_absolute() else self.root / p


def load_params(path: Path):
    """params.yaml -> PipelineConfig (YAML 1.2, as DVC writes it: see grpo_core.config.load_config)."""
    from grpo_core.config import load_config

    return load_config(path)


def with_validated_data(cfg):
    """``cfg`` with ``data`` pointing at validate's parquet files (canonical columns, local, no hub)."""
    data = dataclasses.replace(cfg.data, train_files=[VALIDATED_TRAIN], eval_files=[VALIDATED_EVAL],
                               hub_dataset=None, hub_config=None, prompt_column="prompt",
                               answer_column="answer")
    return dataclasses.replace(cfg, data=data)


def require_file(path: Path, made_by: str) -> Path:
    if not path.exists():
        raise StageInputError(f"{path}: missing; it is written by the `{made_by}` stage "
                              f"(run `dvc repro {made_by}`)")
    return path


def read_json(path: Path, made_by: str) -> Any:
    require_file(path, made_by)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise StageInputError(f"{path}: not valid JSON ({err}); re-run `dvc repro -f {made_by}`") from err


# --------------------------------------------------------------------------------------------------
# hashing (for MLflow tags and the train stage's checkpoint fingerprint)


def md5_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.md5()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def md5_path(path: Path, max_full_bytes: int = 512 << 20,
             file_md5: Callable[[Path], str] | None = None) -> str | None:
    """md5 of a file, or of a directory (sorted relative names + file md5s). Files larger than
    ``max_full_bytes`` contribute their size and mtime instead of their content, unless ``file_md5`` hashes
    each file instead. None if absent."""
    path = Path(path)
    if path.is_file():
        if file_md5 is not None:
            return file_md5(path)
        return md5_file(path) if path.stat().st_size <= max_full_bytes else f"size:{path.stat().st_size}"
    if not path.is_dir():
        return None
    h = hashlib.md5()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        if file_md5 is not None:
            digest = file_md5(f)
        else:
            st = f.stat()
            digest = md5_file(f) if st.st_size <= max_full_bytes else f"{st.st_size}:{st.st_mtime_ns}"
        h.update(f"{f.relative_to(path).as_posix()}\0{digest}\n".encode())
    return h.hexdigest()
