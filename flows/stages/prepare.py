"""`prepare`: the embedded default's synthetic prompts and tiny warm-started base model, or reasoning-gym
tasks.

Outputs (dvc.yaml): ``data/prepared/{train,eval}.jsonl`` and ``artifacts/base_model/`` (written atomically by
``grpo_core.embedded.build.prepare``). With ``reasoning_gym:`` set (and ``embedded: null``) it writes the two
splits and ``data/prepared/summary.json`` from reasoning-gym's generators
(``grpo_core.data.reasoning_gym.prepare_reasoning_gym``) and leaves ``artifacts/base_model/`` empty: the model
is ``model.name_or_path``'s. With your own data and model, params.yaml says ``embedded: null`` and
``reasoning_gym: null``, and the stage does no work: it leaves both folders empty (DVC still wants its outputs
to exist) and says so.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys

from flows.stages.runs import StageRun
from grpo_core.embedded.config import EMBEDDED_DATA_DIR, EMBEDDED_MODEL_DIR


@dataclasses.dataclass(frozen=True)
class PrepareInputs:
    """What prepare reads of params.yaml (tests/test_dvc_params.py checks dvc.yaml lists it)."""

    embedded: object
    reasoning_gym: object


def stage_inputs(cfg) -> PrepareInputs:
    return PrepareInputs(cfg.embedded, cfg.reasoning_gym)


def _empty(ctx, *folders: str) -> None:
    for folder in folders:
        shutil.rmtree(ctx.path(folder), ignore_errors=True)
        ctx.path(folder).mkdir(parents=True)


def prepare_reasoning_gym(ctx, cfg) -> int:
    """The splits from reasoning-gym's generators; no base model (model.name_or_path names it)."""
    from grpo_core.data.reasoning_gym import SUMMARY_FILE, prepare_reasoning_gym

    _empty(ctx, EMBEDDED_DATA_DIR, EMBEDDED_MODEL_DIR)  # nothing of an earlier embedded run left over
    with StageRun(ctx) as run:
        summary = prepare_reasoning_gym(cfg, ctx.path(EMBEDDED_DATA_DIR),
                                        log=lambda msg: print(msg, file=sys.stderr, flush=True))
        run.log_metrics({"num_train": summary["num_train"], "num_eval": summary["num_eval"],
                         **{f"{split}/{task}/{k}": v for split, tasks in summary["tasks"].items()
                            for task, stats in tasks.items() for k, v in stats.items()
                            if isinstance(v, int) and not isinstance(v, bool)}})
        run.log_data_hashes([EMBEDDED_DATA_DIR])
        run.log_artifact(ctx.path(EMBEDDED_DATA_DIR) / SUMMARY_FILE)
    return 0


def run(ctx) -> int:
    from flows.stages.common import quiet_libraries

    inputs = stage_inputs(ctx.cfg)
    emb = inputs.embedded
    if inputs.reasoning_gym is not None:
        quiet_libraries()
        return prepare_reasoning_gym(ctx, inputs.reasoning_gym)
    if emb is None:
        _empty(ctx, EMBEDDED_DATA_DIR, EMBEDDED_MODEL_DIR)
        print("prepare: embedded: null - the embedded default is not used; nothing to prepare "
              "(reasoning_gym: null too)", file=sys.stderr)
        return 0
    from grpo_core.embedded.build import prepare

    quiet_libraries()
    cfg = dataclasses.replace(emb, data_dir=str(ctx.path(emb.data_dir)),
                              model_dir=str(ctx.path(emb.model_dir)))
    with StageRun(ctx) as run:
        summary = prepare(cfg, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        run.log_metrics({k: v for k, v in summary.items() if isinstance(v, int | float)
                         and not isinstance(v, bool)})
        run.log_data_hashes([emb.data_dir])
        run.log_artifact(ctx.path(emb.model_dir) / "embedded.json")
    return 0
