"""`train`: GRPO on the validated training prompts (``grpo_core.train.loop.train``).

Reward weights: ``train.reward_weights`` when pinned, else calibration's ``weights_list``
(artifacts/calibration/reward_weights.json). Prompts: all, or calibration's ``kept_indices`` when
``calibrate.drop_always_solved`` / ``drop_never_solved`` is set.

Outputs: ``<train.output_dir>/checkpoints/`` (``persist: true``: DVC keeps it across runs so an
interrupted or extended run resumes), ``<train.output_dir>/model/``, ``metrics/train_log.csv`` (persistent
too: a resumed run keeps the steps before its checkpoint) and ``plots/training.png``.

Resume or start fresh? The checkpoints directory carries ``stage_fingerprint.json``: the training params
hash (``grpo_core.config.training_params_hash``, which leaves out max_steps and other bookkeeping keys)
plus md5s of the training data, the base model, the reward weights and the kept prompts. The stage
resumes only when the fingerprint matches (a crash, or a larger ``max_steps``); otherwise - new params,
new data, ``dvc exp run -S train.learning_rate=...``, ``train.resume: never`` - it empties the
checkpoints directory first, so a DVC re-run never silently continues a different run.

``train.num_processes > 1``: the stage re-launches itself as N processes (``launch_plan``: ``accelerate
launch`` with ``train.accelerate_config`` on GPUs, ``torch.distributed.run`` with gloo on CPU); rank 0
logs to MLflow and writes the plot. The launchers exit 1 whatever a rank failed with, so each rank records
its exit code and the stage exits with that of the rank that failed first (``run_launcher``).
``train.num_machines > 1``: every machine runs this stage, with MACHINE_RANK and MAIN_PROCESS_IP set, over a
shared filesystem (docs/scaling.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
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
    md5_path,
    read_json,
    require_file,
    with_validated_data,
)
from flows.stages.runs import StageRun
from grpo_core.common.errors import disk_full, exit_code_for
from grpo_core.common.files import write_json_atomic

FINGERPRINT = "stage_fingerprint.json"
MLFLOW_RUN_FILE = "mlflow_run.json"  # the train run's id: a resume continues that MLflow run
LAUNCH_MARKER = "launch.json"  # beside the checkpoints: machine 0's go for the other machines
PLOT = "plots/training.png"
RANK_EXITS_ENV = "GRPO_RANK_EXITS"  # the folder where each launched rank records the code it fails with


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


def fingerprint(ctx, cfg, weights: list[float], allowed: list[int] | None) -> dict:
    from grpo_core.config import training_params_hash
    from grpo_core.model.loading import resolve_model_path

    try:
        model_path = Path(resolve_model_path(cfg.model.name_or_path, ctx.root))
        model_md5 = md5_path(model_path) if model_path.exists() else cfg.model.name_or_path  # a hub id
    except Exception:  # noqa: BLE001 - the trainer reports model problems itself
        model_md5 = cfg.model.name_or_path
    return {
        "params_hash": training_params_hash(cfg, weights),
        "train_data_md5": md5_path(ctx.path(VALIDATED_TRAIN)),
        "base_model_md5": model_md5,
        "reward_weights": weights,
        "allowed_prompts_md5": None if allowed is None else md5_bytes(json.dumps(allowed).encode()),
    }


def md5_bytes(data: bytes) -> str:
    import hashlib

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


def prepare_checkpoints(ctx, cfg, fp: dict) -> str:
    """Keep the checkpoints (resume) when they belong to this exact run, else empty the directory."""
    from grpo_core.train.checkpoint import latest_checkpoint, latest_valid_checkpoint

    ckpt_dir = ctx.path(cfg.train.checkpoints.output_dir) / "checkpoints"
    fp_file = ckpt_dir / FINGERPRINT
    old = json.loads(fp_file.read_text()) if fp_file.is_file() else None
    latest = latest_checkpoint(ckpt_dir)
    latest_step = int(latest.name.rsplit("-", 1)[1]) if latest is not None else 0
    reason = None
    if cfg.train.checkpoints.resume == "never":
        reason = "train.resume is 'never'"
    elif old != fp:
        reason = "the training inputs changed (params, data, base model or reward weights)"
    elif latest_step > cfg.train.max_steps:
        reason = f"the newest checkpoint (step {latest_step}) is past train.max_steps={cfg.train.max_steps}"
    if reason and ckpt_dir.exists() and any(ckpt_dir.iterdir()):
        print(f"train: starting fresh, removing {ckpt_dir}: {reason}", file=sys.stderr)
        for child in ckpt_dir.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
        action = "fresh"
    elif reason or latest is None:
        action = "fresh"
    else:  # the newest whose files match its manifest (a corrupt newer one is named and skipped)
        latest = latest_valid_checkpoint(ckpt_dir,
                                         warn=lambda msg: print(f"train: warning: {msg}", file=sys.stderr))
        print(f"train: resuming from {latest}", file=sys.stderr)
        action = f"resume:{latest.name}"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(fp_file, fp)
    return action


def _launched() -> bool:
    return "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass(frozen=True)
class Machine:
    """Where this machine stands among ``train.num_machines``
    (read from the environment the scheduler sets)."""

    rank: int = 0
    main_address: str | None = None  # the IP or host name of machine 0, where the rendezvous listens
    main_port: int = 29500

    @classmethod
    def from_environment(cls, machines: int, environ=None) -> Machine:
        env = os.environ if environ is None else environ
        if machines == 1:
            return cls()
        missing = [k for k in ("MACHINE_RANK", "MAIN_PROCESS_IP") if not env.get(k)]
        if missing:
            raise StageConfigError(f"train.num_machines: {machines} machines, but {' and '.join(missing)} "
                                   "not set: each machine runs the stage with MACHINE_RANK (0.."
                                   f"{machines - 1}) and MAIN_PROCESS_IP (machine 0's address); "
                                   "see docs/scaling.md")
        rank = int(env["MACHINE_RANK"])
        if not 0 <= rank < machines:
            raise StageConfigError(f"MACHINE_RANK={rank}: must be in 0..{machines - 1} (train.num_machines)")
        return cls(rank, env["MAIN_PROCESS_IP"], int(env.get("MAIN_PROCESS_PORT", "29500")))


def _launch_marker(ctx, cfg) -> Path:
    return ctx.path(cfg.train.checkpoints.output_dir) / "checkpoints" / LAUNCH_MARKER


def announce_launch(ctx, cfg, environ=None) -> None:
    """Machine 0, about to launch: tell the other machines (waiting in ``wait_for_machine_zero``) to
    follow."""
    env = os.environ if environ is None else environ
    write_json_atomic(_launch_marker(ctx, cfg), {"launch_id": env.get("LAUNCH_ID", ""),
                                                 "machines": cfg.train.parallel.num_machines,
                                                 "time": time.time()})


def wait_for_machine_zero(ctx, cfg, environ=None, poll_s: float = 2.0) -> None:
    """Machines 1..M-1 started together with machine 0 (one Kubernetes Indexed Job, docs/scaling.md) wait
    until machine 0's train stage announces launch ``LAUNCH_ID`` (the Job's name): until then the stages
    before train are still writing what this stage reads. No LAUNCH_ID: started by hand once machine 0 is
    training, no wait. Gives up after MACHINE_WAIT_S seconds (default a day)."""
    env = os.environ if environ is None else environ
    launch_id = env.get("LAUNCH_ID")
    if not launch_id:
        return
    deadline = time.monotonic() + float(env.get("MACHINE_WAIT_S", 86400))
    marker = _launch_marker(ctx, cfg)
    print(f"train: machine {env.get('MACHINE_RANK')} waits for machine 0 to launch {launch_id} ({marker})",
          file=sys.stderr, flush=True)
    while True:
        try:
            if json.loads(marker.read_text()).get("launch_id") == launch_id:
                return
        except (OSError, ValueError):
            pass  # not written yet (it is replaced atomically, so never half-written)
        if time.monotonic() > deadline:
            raise StageConfigError(f"train: machine 0 did not launch {launch_id} within MACHINE_WAIT_S="
                                   f"{env.get('MACHINE_WAIT_S', 86400)} s (no {marker} naming it)")
        time.sleep(poll_s)


def launch_command(n: int, *, cuda: bool, accelerate_config: str | Path | None = None, machines: int = 1,
                   machine: Machine = Machine()) -> list[str]:
    """The launcher prefix for ``n`` processes over ``machines`` machines, as run on ``machine`` (the module
    and its arguments follow).

    GPUs: ``accelerate launch`` with ``train.accelerate_config`` (infra/accelerate/: DDP, or FSDP2, which the
    trainer applies itself), or plain multi-GPU DDP without one. CPU: ``torch.distributed.run`` (gloo);
    accelerate's own multi-CPU launch needs mpirun, and the Accelerator picks the gloo process group up from
    torchrun's environment all the same.
    """
    if not cuda:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n // machines)]
        if machines == 1:
            return cmd + ["--standalone"]
        return cmd + ["--nnodes", str(machines), "--node_rank", str(machine.rank), "--master_addr",
                      str(machine.main_address), "--master_port", str(machine.main_port)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n)]
    cmd += ["--config_file", str(accelerate_config)] if accelerate_config else ["--multi_gpu"]
    if machines > 1:
        cmd += ["--num_machines", str(machines), "--machine_rank", str(machine.rank), "--main_process_ip",
                str(machine.main_address), "--main_process_port", str(machine.main_port)]
    return cmd


def launch_plan(ctx, cfg, *, cuda: bool, environ=None) -> list[str]:
    """The whole command this machine runs for ``train.num_processes`` > 1: the accelerate config checked
    (what the trainer would refuse is refused here, before any process starts), the launcher, then this
    stage."""
    from grpo_core.train.parallel import check_parallelism, read_parallelism

    p = cfg.train.parallel
    config = p.accelerate_config
    if config:
        config = Path(config) if Path(config).is_absolute() else ctx.root / config
        if not config.is_file():
            raise StageConfigError(f"train.accelerate_config: {config} is not a file (see infra/accelerate/)")
    check_parallelism(read_parallelism(config), lora=cfg.model.lora is not None,
                      mixed_precision=cfg.train.forward.mixed_precision,
                      quantized=cfg.model.quantization is not None)
    machine = Machine.from_environment(p.num_machines, environ)
    cmd = launch_command(p.num_processes, cuda=cuda, accelerate_config=config, machines=p.num_machines,
                         machine=machine)
    return cmd + ["-m", "flows.stages", "train", "--params", str(ctx.params_path)]


def _relaunch(ctx, cfg) -> int:
    import torch

    cmd = launch_plan(ctx, cfg, cuda=torch.cuda.is_available())
    print(f"train: launching {cfg.train.parallel.num_processes} processes: {' '.join(cmd)}", file=sys.stderr,
          flush=True)
    return run_launcher(cmd, cwd=ctx.root)


def run_launcher(cmd: list[str], cwd: str | os.PathLike) -> int:
    """Run a launcher (torchrun, accelerate launch) and exit as its ranks did: launchers exit 1 whatever code
    a rank failed with, so a failure is the code of the rank that failed first (``rank_exit_recorded``), or
    the launcher's own when no rank recorded one (a rank killed by a signal, a rendezvous never formed)."""
    with tempfile.TemporaryDirectory(prefix="grpo-rank-exits-") as folder:
        rc = subprocess.call(cmd, cwd=cwd, env={**os.environ, RANK_EXITS_ENV: folder})
        first = first_rank_failure(Path(folder)) if rc != 0 else None
    return rc if first is None else first


def first_rank_failure(folder: str | os.PathLike) -> int | None:
    """The stage exit code of the rank that failed first, of those recorded in ``folder`` (None: none)."""
    failures = []
    for path in Path(folder).glob("rank-*.json"):
        try:
            record = json.loads(path.read_text())
            failures.append((int(record["time_ns"]), int(record["rank"]), int(record["exit_code"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a record of ours
    failures = [f for f in failures if f[2] != 0]
    return min(failures)[2] if failures else None


@contextlib.contextmanager
def rank_exit_recorded(environ: Mapping[str, str] | None = None) -> Iterator[None]:
    """In a rank ``run_launcher`` started: an error leaving the block is recorded with the stage exit code it
    becomes (as ``python -m flows.stages`` maps it) in ``$GRPO_RANK_EXITS/rank-<RANK>.json``, then raised on.
    Elsewhere, nothing is recorded."""
    env = os.environ if environ is None else environ
    folder = env.get(RANK_EXITS_ENV)
    try:
        yield
    except Exception as exc:
        if folder:
            rank = int(env.get("RANK", "0"))
            code = exit_code_for(disk_full(exc) or exc)
            record = {"rank": rank, "exit_code": code, "time_ns": time.time_ns()}
            with contextlib.suppress(OSError):  # unrecorded, the launcher's own code stands
                write_json_atomic(Path(folder) / f"rank-{rank}.json", record)
        raise


def run(ctx) -> int:
    with rank_exit_recorded():
        return _run_stage(ctx)


def _run_stage(ctx) -> int:
    from flows.stages.common import quiet_libraries
    from grpo_core.config import only_sections

    drop_prompts = stage_inputs(ctx.cfg).drop_prompts
    cfg = only_sections(with_validated_data(ctx.cfg), TRAINER_SECTIONS)
    machine = Machine.from_environment(cfg.train.parallel.num_machines)
    if machine.rank > 0 and not _launched():
        wait_for_machine_zero(ctx, cfg)  # its stages before train write what this one reads
    require_file(ctx.path(VALIDATED_TRAIN), "validate")
    weights, weights_source = reward_weights(ctx, cfg)
    allowed = allowed_prompts(ctx, drop_prompts)
    if not _launched():
        # machine 0 alone decides resume-or-fresh: the others reach the checkpoints through the shared
        # filesystem only after machine 0's processes have joined the rendezvous, i.e. after this
        if machine.rank == 0:
            action = prepare_checkpoints(ctx, cfg, fingerprint(ctx, cfg, weights, allowed))
            if cfg.train.parallel.num_machines > 1:
                announce_launch(ctx, cfg)
        if cfg.train.parallel.num_processes > 1:
            return _relaunch(ctx, cfg)
    else:
        action = "distributed"
    if int(os.environ.get("RANK", "0")) != 0:
        return _train(ctx, cfg, weights, allowed, tracker=None)

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
