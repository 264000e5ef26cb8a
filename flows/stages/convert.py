"""`convert`: a GGUF ``model.name_or_path`` becomes a safetensors folder, ``artifacts/converted_model``.

Later stages load that folder whenever ``model.name_or_path`` names a ``.gguf`` file
(``grpo_core.model.loading.resolve_model_path``). With a model folder or a hub id there is nothing to convert:
the stage leaves the folder empty (DVC still wants its output to exist) and says so. The folder is written
atomically (temp folder, then rename): a failed conversion leaves nothing half-written.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys

from flows.stages.runs import StageRun
from grpo_core.model.gguf import CONVERTED_MODEL_DIR, convert_gguf, is_gguf


@dataclasses.dataclass(frozen=True)
class ConvertInputs:
    """What convert reads of params.yaml (tests/test_dvc_params.py checks dvc.yaml lists it)."""

    name_or_path: str = dataclasses.field(metadata={"param": "model.name_or_path"})


def stage_inputs(cfg) -> ConvertInputs:
    return ConvertInputs(cfg.model.name_or_path)


def run(ctx) -> int:
    source = stage_inputs(ctx.cfg).name_or_path
    out = ctx.path(CONVERTED_MODEL_DIR)
    if not is_gguf(source):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        print(f"convert: model.name_or_path '{source}' is not a GGUF file; nothing to convert",
              file=sys.stderr)
        return 0
    from flows.stages.common import quiet_libraries

    quiet_libraries()
    print(f"convert: {source} -> {CONVERTED_MODEL_DIR}", file=sys.stderr, flush=True)
    with StageRun(ctx) as run:
        summary = convert_gguf(ctx.path(source), out)
        run.log_metrics({"parameters": summary["parameters"], "gguf_bytes": summary["bytes"]})
        run.log_artifact(out / "gguf_source.json")
    print(f"convert: {summary['parameters']:,} parameters ({summary['architecture']}) from {source}",
          file=sys.stderr)
    return 0
