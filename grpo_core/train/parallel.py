"""How training spreads over ``train.num_processes`` processes, read from ``train.accelerate_config``.

    no file, or distributed_type MULTI_GPU        DDP: every process holds the whole policy;
                                                  gradients all-reduced
    MULTI_GPU with fsdp_config (fsdp_version: 2)  FSDP2: the trainer shards policy and reference itself
                                                  with torch's ``fully_shard`` (grpo_core/model/sharding.py)

The file stays an accelerate config (accelerate's own parser reads it), and the trainer reads
``fsdp_config`` from it; torchrun starts the processes on GPUs and CPUs alike (flows/stages/launch.py).
Sharding is the trainer's own, not accelerate's ``distributed_type: FSDP``: one code path on GPUs and on CPU,
the one the tests run (accelerate's FSDP does not run on CPU processes). DeepSpeed is withdrawn: see
``DEEPSPEED_WITHDRAWN``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_core.common.errors import ConfigurationError
from grpo_core.common.options import ConfigError, Options, option
from grpo_core.model.sharding import FSDPSettings

DEEPSPEED_WITHDRAWN = (
    "DeepSpeed is not supported: a DeepSpeed engine takes over what this trainer owns (gradient "
    "accumulation, the skip-step guard, checkpoints, the export), and no ZeRO-3 path ships untested. FSDP2 "
    "shards the same state (weights, gradients, AdamW) and is tested: train.accelerate_config: "
    "infra/accelerate/fsdp2.yaml (docs/scaling.md)")


@dataclass
class ParallelOptions(Options):
    """params.yaml `train:` keys of how many processes train, on how many machines (flows/stages/train.py
    launches them)."""

    num_processes: int = option(1, "processes (GPUs) over all machines; > 1 launches them through torchrun "
                                "(NCCL on GPUs, gloo on CPU)", ge=1)
    num_machines: int = option(1, "machines (nodes) the processes are spread over; > 1: each machine runs "
                               "the train stage with MACHINE_RANK and MAIN_PROCESS_IP set (docs/scaling.md)",
                               ge=1)
    accelerate_config: str | None = option(
        None, "accelerate config for num_processes > 1: infra/accelerate/ddp.yaml, or "
        "infra/accelerate/fsdp2.yaml to shard (None = DDP)")
    collective_timeout_s: float = option(
        1800.0, "num_processes > 1: how long a process waits in one collective (an all-reduce, a barrier) "
        "before it fails with exit 1 (retried): a machine that died silently (power, a cut network: no "
        "connection reset reaches the others) is noticed after this; keep it above the longest time rank 0 "
        "spends alone (a checkpoint write, an evaluation). torch's default", gt=0)

    def check(self) -> None:
        if self.num_processes % self.num_machines:
            raise ConfigError(f"num_machines: {self.num_processes} processes do not split evenly over "
                              f"{self.num_machines} machines")


class ParallelConfigError(ConfigurationError, ValueError):
    """train.accelerate_config asks for something this trainer does not run; the message says what to use."""


@dataclass(frozen=True)
class Parallelism:
    fsdp: FSDPSettings | None = None  # None: DDP (each process holds the whole policy)

    @property
    def name(self) -> str:
        return "fsdp2" if self.fsdp is not None else "ddp"


_FSDP_KEYS = {"fsdp_version", "fsdp_reshard_after_forward", "fsdp_offload_params", "fsdp_auto_wrap_policy",
              "fsdp_state_dict_type", "fsdp_activation_checkpointing", "fsdp_cpu_ram_efficient_loading"}


def read_parallelism(path: str | Path | None) -> Parallelism:
    """The parallelism an accelerate config file asks for (None: DDP). Raises ParallelConfigError naming the
    file and key for what this trainer refuses."""
    if path is None:
        return Parallelism()
    doc = _read_yaml(Path(path))
    kind = str(doc.get("distributed_type", "MULTI_GPU"))
    where = f"train.accelerate_config {path}"
    if kind == "DEEPSPEED" or doc.get("deepspeed_config"):
        raise ParallelConfigError(f"{where}: {DEEPSPEED_WITHDRAWN}")
    if kind == "FSDP":
        raise ParallelConfigError(
            f"{where}: distributed_type FSDP hands sharding to accelerate, which this trainer does not use; "
            "set distributed_type: MULTI_GPU and keep fsdp_config (fsdp_version: 2): the trainer shards the "
            "policy itself (see infra/accelerate/fsdp2.yaml)")
    if kind not in ("MULTI_GPU", "NO"):
        raise ParallelConfigError(f"{where}: distributed_type {kind} is not supported (MULTI_GPU, with "
                                  "fsdp_config for FSDP2)")
    fsdp = doc.get("fsdp_config")
    if not fsdp:
        return Parallelism()
    unknown = sorted(set(fsdp) - _FSDP_KEYS)
    if unknown:
        raise ParallelConfigError(f"{where}: fsdp_config keys {unknown} are not read by this trainer "
                                  f"(it reads {sorted(_FSDP_KEYS)})")
    if fsdp.get("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP") != "TRANSFORMER_BASED_WRAP":
        raise ParallelConfigError(f"{where}: fsdp_config.fsdp_auto_wrap_policy must be "
                                  "TRANSFORMER_BASED_WRAP (one shard unit per decoder layer)")
    if int(fsdp.get("fsdp_version", 1)) != 2:
        raise ParallelConfigError(f"{where}: fsdp_config.fsdp_version must be 2 (FSDP2, torch's "
                                  f"fully_shard); got {fsdp.get('fsdp_version', 1)}")
    if fsdp.get("fsdp_state_dict_type", "FULL_STATE_DICT") != "FULL_STATE_DICT":
        raise ParallelConfigError(f"{where}: fsdp_config.fsdp_state_dict_type must be FULL_STATE_DICT: "
                                  "checkpoints hold whole weights, so they resume at any world size and "
                                  "export as HF")
    if fsdp.get("fsdp_activation_checkpointing"):
        raise ParallelConfigError(f"{where}: fsdp_config.fsdp_activation_checkpointing: use "
                                  "train.gradient_checkpointing (one switch for every way of training)")
    if fsdp.get("fsdp_cpu_ram_efficient_loading"):
        raise ParallelConfigError(f"{where}: fsdp_config.fsdp_cpu_ram_efficient_loading is accelerate's FSDP "
                                  "loading; every process loads the weights and keeps its shard: set it "
                                  "false")
    return Parallelism(FSDPSettings(reshard_after_forward=bool(fsdp.get("fsdp_reshard_after_forward", True)),
                                    offload_params=bool(fsdp.get("fsdp_offload_params", False))))


def check_parallelism(parallelism: Parallelism, *, lora: bool, mixed_precision: str = "no",
                      where: str = "train.accelerate_config", quantized: bool = False) -> None:
    """Cross-checks with the rest of the config. Under FSDP2: LoRA is refused (the adapter-off reference view,
    adapter checkpoints and the merged export are one-process code paths nobody has run sharded), and so is
    fp16 (it needs a sharded gradient scaler; bf16 does not)."""
    if parallelism.fsdp is None:
        return
    if mixed_precision == "fp16":
        raise ParallelConfigError(f"{where}: train.mixed_precision fp16 with FSDP2 is not supported (no "
                                  "sharded gradient scaler); use bf16")
    if quantized:
        raise ParallelConfigError(f"{where}: a 4-bit base (model.quantization, QLoRA) with FSDP2 is not "
                                  "supported: fully_shard splits plain tensors, and bitsandbytes' packed "
                                  "4-bit weights carry per-block quantization state that a shard cannot "
                                  "split - the 4-bit base is small enough for one GPU each: train it with "
                                  "DDP (drop fsdp_config)")
    if lora:
        raise ParallelConfigError(f"{where}: LoRA (model.lora) with FSDP2 is not supported: LoRA keeps the "
                                  "base frozen, so its trainable state is small - train it with DDP (drop "
                                  "fsdp_config) or without model.lora")


def _read_yaml(path: Path) -> dict:
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ParallelConfigError(f"train.accelerate_config: cannot read {path}: {err}") from err
    except yaml.YAMLError as err:
        raise ParallelConfigError(f"train.accelerate_config: {path} is not YAML: {err}") from err
    if not isinstance(doc, dict):
        raise ParallelConfigError(f"train.accelerate_config: {path} is not a mapping of accelerate settings")
    return doc


# The step's collectives: on one process each is the value itself.


def global_sum(accelerator, value: int) -> float:
    if accelerator.num_processes == 1:
        return float(value)
    return float(accelerator.reduce(torch.tensor(float(value), device=accelerator.device), "sum").item())


def finite_everywhere(accelerator, loss: torch.Tensor) -> bool:
    """Whether the micro-batch's loss is finite on every process: a NaN on one process skips the micro-batch
    on all (as one process on the global batch would), and keeps the gradient collectives of backward in
    step."""
    finite = bool(torch.isfinite(loss))
    if accelerator.num_processes == 1:
        return finite
    return global_sum(accelerator, int(not finite)) == 0


def gather_values(accelerator, values: torch.Tensor) -> torch.Tensor | None:
    """Every process's 1-D ``values`` (different lengths), concatenated; None on one process
    (the values alone)."""
    if accelerator.num_processes == 1:
        return None
    sentinel = -1e9  # below any entropy: marks the padding pad_across_processes adds
    padded = accelerator.pad_across_processes(values.to(accelerator.device), dim=0, pad_index=sentinel)
    gathered = accelerator.gather(padded)
    return gathered[gathered != sentinel]
