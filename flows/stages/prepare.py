"""`prepare` (embedded default only): synthetic train/eval prompts and the tiny warm-started base model.

Outputs: ``<embedded.data_dir>/{train,eval}.jsonl`` and ``<embedded.model_dir>/`` (written atomically by
``grpo_core.embedded.build.prepare``). With your own data and model the stage still runs (it is cheap); point
``data.*`` / ``model.name_or_path`` elsewhere and downstream stages ignore what it wrote.
"""

from __future__ import annotations

import dataclasses
import sys


def run(ctx) -> int:
    from flows.stages.common import quiet_libraries
    from grpo_core.embedded.build import prepare

    quiet_libraries()
    emb = ctx.cfg.embedded
    cfg = dataclasses.replace(emb, data_dir=str(ctx.path(emb.data_dir)), model_dir=str(ctx.path(emb.model_dir)))
    with ctx.stage_run() as run:
        summary = prepare(cfg, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        run.log_metrics({k: v for k, v in summary.items() if isinstance(v, int | float) and not isinstance(v, bool)})
        run.log_data_hashes([emb.data_dir])
        run.log_artifact(ctx.path(emb.model_dir) / "embedded.json")
    return 0
