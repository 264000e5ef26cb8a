"""`prepare` (embedded default only): synthetic train/eval prompts and the tiny warm-started base model.

Outputs (dvc.yaml): ``data/prepared/{train,eval}.jsonl`` and ``artifacts/base_model/`` (written atomically by
``grpo_core.embedded.build.prepare``). With your own data and model, params.yaml says ``embedded: null`` and
the stage does no work: it leaves both folders empty (DVC still wants its outputs to exist) and says so.
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


def stage_inputs(cfg) -> PrepareInputs:
    return PrepareInputs(cfg.embedded)


def run(ctx) -> int:
    from flows.stages.common import quiet_libraries
    from grpo_core.embedded.build import prepare

    emb = stage_inputs(ctx.cfg).embedded
    if emb is None:
        for folder in (EMBEDDED_DATA_DIR, EMBEDDED_MODEL_DIR):
            shutil.rmtree(ctx.path(folder), ignore_errors=True)
            ctx.path(folder).mkdir(parents=True)
        print("prepare: embedded: null - the embedded default is not used; nothing to prepare",
              file=sys.stderr)
        return 0
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
