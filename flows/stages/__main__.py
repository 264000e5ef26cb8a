"""``python -m flows.stages <stage> [--params params.yaml]``: the command each DVC stage runs.

Kept import-light (argparse only) so ``--help`` and argument errors answer at once; the stage's module,
and with it torch / transformers / mlflow, is imported only once the arguments are known.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from flows.stages import EXIT_CONFIG, EXIT_ERROR, STAGES
from grpo_core.common.errors import PipelineError, stage_failure


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flows.stages",
        description="Run one stage of the GRPO pipeline (DVC runs these; see dvc.yaml).")
    parser.add_argument("stage", choices=STAGES, help="the stage to run")
    parser.add_argument("--params", default="params.yaml",
                        help="parameters file, relative to the repo root unless absolute (default: "
                             "params.yaml)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from flows.stages import common

    common.prepare_process_env()
    if common.is_launched_child():  # before anything slow: a rank whose launcher is already gone ends here
        from flows.stages.launch import die_with_launcher

        die_with_launcher()
    try:
        ctx = common.StageContext.create(args.stage, args.params)
        module = importlib.import_module(f"flows.stages.{args.stage}")
        if common.is_launched_child():
            return int(module.run(ctx) or 0)
        with common.stage_lock(ctx.root, args.stage):
            return int(module.run(ctx) or 0)
    except KeyboardInterrupt:
        print(f"{args.stage}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - turned into a readable message and an exit code
        exc, code = stage_failure(exc)
        if code == EXIT_ERROR and not isinstance(exc, PipelineError):  # unexpected: where it happened matters
            traceback.print_exc()
        print(f"\n{args.stage} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return code if code else EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
