"""How the train stage runs as several processes and machines: ``train.num_processes > 1`` re-launches the
stage as N processes (``launch_plan``: torchrun, its sockets on one address, ``flows/stages/torchrun.py``;
NCCL on GPUs, gloo on CPU); ``train.num_machines > 1``: every machine runs the stage, with
MACHINE_RANK and MAIN_PROCESS_IP set, machine 0 announcing its launch to the others over the shared
checkpoints folder (docs/scaling.md). The launchers exit 1 whatever a rank failed with, so each rank records
its exit code and the stage exits with that of the rank that failed first (``run_launcher``); on several
machines every failed process also records it in the shared checkpoints folder, so that a machine whose rank
only saw its peer vanish exits with the peer's code too. A launch ends with its stage process
(``parent_death_signal``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flows.stages.common import RANK_EXITS_ENV, StageConfigError, machine_rank
from grpo_core.common.errors import stage_failure
from grpo_core.common.files import write_json_atomic

LAUNCH_MARKER = "launch.json"  # beside the checkpoints: machine 0's go for the other machines
# beside it, each failed process's record for the other machines: .exit-<attempt>-machine-<k>[-rank-<n>].json
# (a hidden file: the train stage counts it as its own bookkeeping, never as a checkpoint)
EXIT_RECORD_PREFIX = ".exit-"
PEER_POLL_S = 0.5
PEER_GRACE_S = 10.0  # machine 0's launch, once another machine recorded a failure, before it is stopped
# RANK_EXITS_ENV: the folder where each launched rank records the code it fails with; it also marks the rank
# as ours, so it runs under its launching stage's lock (flows/stages/common.py)


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


def checkpoints_dir(ctx, cfg) -> Path:
    """``<train.output_dir>/checkpoints``: the folder every machine of a multi-machine run shares."""
    return ctx.path(cfg.train.checkpoints.output_dir) / "checkpoints"


def _launch_marker(ctx, cfg) -> Path:
    return checkpoints_dir(ctx, cfg) / LAUNCH_MARKER


def announce_launch(ctx, cfg, environ=None) -> str:
    """Machine 0, about to launch: tell the other machines (waiting in ``wait_for_machine_zero``) to
    follow. Every announce names a new attempt (returned), under which the ranks of every machine record
    their failures; the records of earlier attempts are removed first."""
    env = os.environ if environ is None else environ
    folder = checkpoints_dir(ctx, cfg)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob(f"{EXIT_RECORD_PREFIX}*.json"):
        old.unlink(missing_ok=True)
    attempt = uuid.uuid4().hex
    write_json_atomic(folder / LAUNCH_MARKER, {"launch_id": env.get("LAUNCH_ID", ""), "attempt": attempt,
                                               "machines": cfg.train.parallel.num_machines,
                                               "time": time.time()})
    return attempt


def launch_attempt(folder: Path) -> str | None:
    """The attempt machine 0 last announced in the checkpoints ``folder`` (None: none readable)."""
    try:
        attempt = json.loads((folder / LAUNCH_MARKER).read_text()).get("attempt")
    except (OSError, ValueError, AttributeError):
        return None
    return attempt if _is_attempt(attempt) else None


def _is_attempt(value) -> bool:
    return isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)


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


def launch_command(n: int, *, machines: int = 1, machine: Machine = Machine()) -> list[str]:
    """The launcher prefix for ``n`` processes over ``machines`` machines, as run on ``machine`` (the module
    and its arguments follow): torchrun with its sockets on one address (``flows.stages.torchrun``; one
    machine: loopback, a free port), on GPUs (NCCL) and CPUs (gloo) alike. The trainer reads
    ``train.accelerate_config`` itself (DDP, or FSDP2 which it applies), and the Accelerator takes the process
    group from torchrun's environment: ``accelerate launch`` would add nothing the trainer uses, and it opens
    its rendezvous store on every interface (it checks the port is free, so no store can be bound for it)."""
    if machines == 1:
        from grpo_core.rollout.sockets import LOOPBACK

        machine = Machine(0, LOOPBACK, 0)
    return [sys.executable, "-m", "flows.stages.torchrun", "--nproc_per_node", str(n // machines),
            "--nnodes", str(machines), "--node_rank", str(machine.rank), "--master_addr",
            str(machine.main_address), "--master_port", str(machine.main_port)]


def launch_plan(ctx, cfg, *, environ=None) -> list[str]:
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
    cmd = launch_command(p.num_processes, machines=p.num_machines, machine=machine)
    return cmd + ["-m", "flows.stages", "train", "--params", str(ctx.params_path)]


def relaunch(ctx, cfg) -> int:
    cmd = launch_plan(ctx, cfg)
    print(f"train: launching {cfg.train.parallel.num_processes} processes: {' '.join(cmd)}", file=sys.stderr,
          flush=True)
    return run_launcher(cmd, cwd=ctx.root, peers=launch_peers(ctx, cfg))


# --------------------------------------------------------------------------------------------------
# exit codes: each rank records its own; machines share theirs through the checkpoints folder


@dataclass(frozen=True, order=True)
class ExitRecord:
    """What a failed process recorded, ordered by when it failed."""

    time_ns: int
    machine: int
    rank: int  # -1: the stage process of machine ``machine`` itself, before it launched
    exit_code: int
    attempt: str | None = field(default=None, compare=False)  # machine 0's launch attempt (several machines)


@dataclass(frozen=True)
class Peers:
    """The other machines of a launch, as this machine sees them through the shared checkpoints folder."""

    folder: Path  # <output_dir>/checkpoints
    machine: int  # this machine's MACHINE_RANK
    attempt: str | None = None  # known on machine 0, which announced it: it then watches the others' records


def launch_peers(ctx, cfg, environ=None) -> Peers | None:
    """None for one machine; machine 0 watches the attempt it announced, the others read the records of the
    attempt their ranks recorded."""
    if cfg.train.parallel.num_machines == 1:
        return None
    folder, machine = checkpoints_dir(ctx, cfg), machine_rank(environ)
    return Peers(folder, machine, launch_attempt(folder) if machine == 0 else None)


def run_launcher(cmd: list[str], cwd: str | os.PathLike, peers: Peers | None = None,
                 grace_s: float = PEER_GRACE_S) -> int:
    """Run a launcher (torchrun) and exit as its ranks did: launchers exit 1 whatever code
    a rank failed with, so a failure is the code of the process that failed first (``first_rank_failure``:
    this machine's ranks, and with ``peers`` those of every machine), or the launcher's own when none recorded
    one (a rank killed by a signal, a rendezvous never formed). The launcher gets SIGTERM if this process
    dies (it passes it on to its ranks). On machine 0, once another machine has recorded a failure, the
    launcher has ``grace_s`` to end by itself, then it is stopped (``_wait_for_launch``)."""
    with tempfile.TemporaryDirectory(prefix="grpo-rank-exits-") as folder:
        env = {**os.environ, RANK_EXITS_ENV: folder}
        with subprocess.Popen(cmd, cwd=cwd, env=env, preexec_fn=parent_death_signal(signal.SIGTERM)) as proc:
            try:
                rc = _wait_for_launch(proc, peers, grace_s)
            except BaseException:
                proc.kill()  # its ranks die with it (die_with_launcher)
                raise
        if rc == 0:
            return 0
        shared, attempt = (peers.folder, peers.attempt) if peers else (None, None)
        first = first_rank_failure(folder, shared, attempt)
    return rc if first is None else first


def _wait_for_launch(proc: subprocess.Popen, peers: Peers | None, grace_s: float) -> int:
    """The launcher's exit code. Machine 0 also polls the other machines' records: a rank whose peer failed
    before joining waits out the rendezvous (15 min) or the process group's timeout (30 min), and the agent of
    a launch whose ranks all ended waits 5 min for the other machines' agents."""
    if peers is None or peers.attempt is None:
        return proc.wait()
    failed_at = None
    while (rc := proc.poll()) is None:
        time.sleep(PEER_POLL_S)
        if failed_at is None and (failure := _peer_failure(peers)) is not None:
            failed_at = time.monotonic()
            print(f"train: machine {failure.machine} failed (exit {failure.exit_code}); this machine's "
                  f"launch stops within {grace_s:.0f} s", file=sys.stderr, flush=True)
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            proc.terminate()  # torchrun passes SIGTERM on to its ranks and waits up to 30 s for them
            try:
                return proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                return proc.wait()
    return rc


def _peer_failure(peers: Peers) -> ExitRecord | None:
    failed = [r for r in shared_records(peers.folder, peers.attempt)
              if r.machine != peers.machine and r.exit_code != 0]
    return min(failed) if failed else None


def first_rank_failure(folder: str | os.PathLike, shared: str | os.PathLike | None = None,
                       attempt: str | None = None) -> int | None:
    """The stage exit code of the process that failed first (None: none did), of this machine's ranks
    (``rank-*.json`` in ``folder``, run_launcher's own) and, with ``shared`` (the checkpoints folder of a
    multi-machine run), of every machine's processes that recorded a failure there under ``attempt``
    (default: the attempt this machine's ranks recorded)."""
    records = read_exit_records(Path(folder).glob("rank-*.json"))
    if shared is not None:
        attempt = attempt or next((r.attempt for r in records if r.attempt), None)
        records += shared_records(Path(shared), attempt) if attempt else []
    failures = [r for r in records if r.exit_code != 0]
    return min(failures).exit_code if failures else None


def shared_records(folder: Path, attempt: str | None) -> list[ExitRecord]:
    if not _is_attempt(attempt):
        return []
    return [r for r in read_exit_records(folder.glob(f"{EXIT_RECORD_PREFIX}{attempt}-*.json"))
            if r.attempt == attempt]


def read_exit_records(paths: Iterable[Path]) -> list[ExitRecord]:
    """The records among ``paths``; a file that is not one (unreadable, half-copied, another shape) is
    skipped."""
    records = []
    for path in paths:
        try:
            raw = json.loads(path.read_text())
            attempt = raw.get("attempt")
            records.append(ExitRecord(int(raw["time_ns"]), int(raw.get("machine", 0)), int(raw["rank"]),
                                      int(raw["exit_code"]), attempt if _is_attempt(attempt) else None))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return records


def _shared_record_path(folder: Path, record: ExitRecord) -> Path:
    who = f"machine-{record.machine}" + (f"-rank-{record.rank}" if record.rank >= 0 else "")
    return folder / f"{EXIT_RECORD_PREFIX}{record.attempt}-{who}.json"


@contextlib.contextmanager
def rank_exit_recorded(ctx=None, environ: Mapping[str, str] | None = None) -> Iterator[None]:
    """An error leaving the block is recorded with the stage exit code it becomes (as ``python -m
    flows.stages`` maps it), then raised on: in a rank ``run_launcher`` started, in
    ``$GRPO_RANK_EXITS/rank-<RANK>.json``; on several machines (``ctx`` given), also in the shared checkpoints
    folder under machine 0's launch attempt, by every rank and by the stage process of a machine k > 0 (which
    fails before its ranks exist: machine 0's launch would wait for them). Elsewhere, nothing is recorded."""
    env = os.environ if environ is None else environ
    try:
        yield
    except Exception as exc:
        with contextlib.suppress(OSError, ValueError):  # unrecorded, the launcher's own code stands
            _record_failure(stage_failure(exc)[1], ctx, env)
        raise


def _record_failure(code: int, ctx, env: Mapping[str, str]) -> None:
    local = env.get(RANK_EXITS_ENV)
    machines = ctx.cfg.train.parallel.num_machines if ctx is not None else 1
    machine = machine_rank(env) if machines > 1 else 0
    if not local and machine == 0:
        return  # machine 0's stage process: no launch to tell, or its own launcher reports
    shared = checkpoints_dir(ctx, ctx.cfg) if machines > 1 else None
    attempt = launch_attempt(shared) if shared is not None else None
    record = ExitRecord(time.time_ns(), machine, int(env.get("RANK", "0")) if local else -1, code, attempt)
    if local:
        write_json_atomic(Path(local) / f"rank-{record.rank}.json", asdict(record))
    if shared is not None and attempt is not None:
        write_json_atomic(_shared_record_path(shared, record), asdict(record))


# --------------------------------------------------------------------------------------------------
# a launch ends with its stage: no rank trains on, unlocked, after the stage process is gone

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def parent_death_signal(sig: int, parent: int | None = None) -> Callable[[], None] | None:
    """A function that makes the process calling it receive ``sig`` once its parent dies (Linux's
    ``PR_SET_PDEATHSIG``) - or at once if its parent is no longer ``parent`` (default: this process, for a
    child forked from it) - bound beforehand, so that a forked child only calls it; None off Linux.
    Without it a launcher's ranks, each in a session of its own, outlive a SIGKILL of their stage and go on
    writing checkpoints beside the stage's retry."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    expected = os.getpid() if parent is None else parent

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != expected:  # it died before the signal was armed
            os.kill(os.getpid(), sig)

    return arm


def die_with_launcher() -> None:
    """In a rank that run_launcher's launcher started: be killed when that launcher (torchrun's agent) dies,
    however it dies."""
    arm = parent_death_signal(signal.SIGKILL, parent=os.getppid())
    if arm is not None:
        arm()
