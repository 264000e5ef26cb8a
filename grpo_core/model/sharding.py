"""FSDP2: a model sharded across processes with torch's ``fully_shard``, and its weights and optimizer state
as one full, unsharded state dict - the very format a one-process run saves - so a checkpoint resumes at any
world size and the export is a plain HF folder.

    shard_model            fully_shard each decoder layer (the model's ``_no_split_modules``), then the root
    gather_weights         the full weights (a collective: every process calls it;
                           rank 0, or all, get tensors)
    load_full_weights      full weights into the shards (every process passes the whole dict)
    gather_optimizer_state / load_optimizer_state
                           AdamW's state in torch's plain format ({index: state}, indices in parameter order),
                           converted from and to the fully-qualified names torch's distributed state dict uses

Every function here is collective under sharding: all processes call it, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIXED_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class FSDPSettings:
    """What ``fsdp_config`` in an accelerate config file asks of the sharding
    (infra/accelerate/fsdp2.yaml)."""

    reshard_after_forward: bool = True  # free a layer's gathered weights after its forward (ZeRO-3-like)
    offload_params: bool = False        # keep shards, gradients and AdamW state in CPU memory
                                        # (CPUOffloadPolicy)


def is_sharded(model) -> bool:
    """True for a model ``fully_shard`` has wrapped (its class becomes ``FSDP<Name>``)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_model(model: torch.nn.Module, settings: FSDPSettings,
                mixed_precision: str = "no") -> torch.nn.Module:
    """Shard ``model`` in place over the default process group: each decoder layer one unit, the rest
    (embeddings, final norm, LM head, tied or not) the root's. ``mixed_precision`` bf16/fp16: the forward and
    backward run in that dtype on gathered copies, gradients are reduced in float32 onto the float32 shards
    (FSDP2's MixedPrecisionPolicy, in place of accelerate's autocast)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    layer_names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules) to shard "
                         "by")
    policy = MixedPrecisionPolicy(param_dtype=_MIXED_PRECISION.get(mixed_precision),
                                  reduce_dtype=torch.float32 if mixed_precision in _MIXED_PRECISION else None)
    options = {"reshard_after_forward": settings.reshard_after_forward, "mp_policy": policy,
               "offload_policy": CPUOffloadPolicy() if settings.offload_params else OffloadPolicy()}
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def _options(to_all: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # cpu_offload: the full tensors land in CPU memory, on rank 0 alone
    return StateDictOptions(full_state_dict=True, cpu_offload=not to_all)


def gather_weights(model: torch.nn.Module, *, to_all: bool = False) -> dict[str, torch.Tensor]:
    """Every weight of a sharded model, whole: on rank 0 (in CPU memory; the others get {}), or with
    ``to_all`` on every process (on the model's device). Collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(to_all))


def load_full_weights(model: torch.nn.Module,
                      weights: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Whole weights (the same dict on every process) into a sharded model's shards; (missing, unexpected)
    keys. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    result = set_model_state_dict(model, weights,
                                  options=StateDictOptions(full_state_dict=True, strict=False))
    return list(result.missing_keys), list(result.unexpected_keys)


def _parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each parameter the optimizer steps, in its own order: position i = torch's plain index
    i."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def gather_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's whole state in torch's plain ``Optimizer.state_dict()`` format - what the same
    optimizer on one process would return - on rank 0 ({} elsewhere). Collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    named = get_optimizer_state_dict(model, optimizer, options=_options(to_all=False))
    if "state" not in named:  # not rank 0
        return {}
    index = {name: i for i, name in enumerate(_parameter_names(model, optimizer))}
    groups = [{**group, "params": [index[name] for name in group["params"]]}
              for group in named["param_groups"]]
    return {"state": {index[name]: state for name, state in named["state"].items()}, "param_groups": groups}


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """A plain ``Optimizer.state_dict()`` (from a checkpoint of any world size; the same dict on every
    process) into the optimizer of a sharded model. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _parameter_names(model, optimizer)
    saved = sum(len(g["params"]) for g in state["param_groups"])
    if saved != len(names):
        raise ValueError(f"the optimizer state holds {saved} parameters, the model trains {len(names)}")
    groups = [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]]
    named = {"state": {names[int(i)]: s for i, s in state["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))


def clip_gradients(parameters, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm; the norm before clipping, a plain tensor (sharded gradients are DTensors
    whose norm is reduced across processes)."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
