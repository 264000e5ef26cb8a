"""How the train stage runs as several processes and machines: ``train.num_processes > 1`` re-launches the
stage as N processes (``launch_plan``: ``accelerate launch`` with ``train.accelerate_config`` on GPUs,
``torch.distributed.run`` with gloo on CPU); ``train.num_machines > 1``: every machine runs the stage, with
MACHINE_RANK and MAIN_PROCESS_IP set, machine 0 announcing its launch to the others over the shared
checkpoints folder (docs/scaling.md). The launchers exit 1 whatever a rank failed with, so each rank records
its exit code and the stage exits with that of the rank that failed first (``run_launcher``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from flows.stages.common import RANK_EXITS_ENV, StageConfigError
from grpo_core.common.errors import disk_full, exit_code_for
from grpo_core.common.files import write_json_atomic

LAUNCH_MARKER = "launch.json"  # beside the checkpoints: machine 0's go for the other machines
# RANK_EXITS_ENV: the folder where each launched rank records the code it fails with; it also marks the rank
# as ours, so it runs under its launching stage's lock (flows/stages/common.py)


def launched() -> bool:
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


def relaunch(ctx, cfg) -> int:
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
