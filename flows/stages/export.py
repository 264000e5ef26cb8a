"""`export`: the trained policy as GGUF files and an Ollama Modelfile, ``artifacts/export/``, attached to its
registered MLflow model version.

One ``<name>.<type>.gguf`` per ``export.gguf_types`` (``source``: the type of the GGUF
``model.name_or_path`` names) and, with ``export.modelfile``, a ``Modelfile`` running the first of them
(grpo_core/model/gguf_export.py says how each is written). ``export.name`` null: the source model's name +
``-grpo``. Every check (architecture, tensors, tokenizer, types) runs before the first file is written, and
the folder is replaced whole (a temp folder, then a rename): a failed export leaves the previous one as it
was. ``export: null`` leaves the folder empty (DVC still wants its output to exist).

The stage runs after evaluate (``reports/registry.json`` is its dependency) so that the files go to the model
version evaluate registered: the one whose model files are ``<train.output_dir>/model`` (found by their md5
tag, so a re-run attaches to the same version) gets them in its logged model's artifacts under ``gguf/`` - a
download of ``models:/<name>@champion`` holds a file llama.cpp, Ollama and LM Studio run - and a
``gguf.files`` tag naming them. A change to ``export:`` re-runs this stage alone, not the evaluation.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flows.stages.common import require_file
from flows.stages.runs import StageRun
from grpo_core.common.files import write_dir_atomic
from grpo_core.model.gguf import is_gguf, read_architecture
from grpo_core.model.gguf_export import (
    ExportPlan,
    Sampling,
    default_name,
    plan_export,
    resolve_types,
    write_gguf,
)
from grpo_core.model.modelfile import MODELFILE, modelfile_text

EXPORT_DIR = "artifacts/export"


@dataclass(frozen=True)
class ExportInputs:
    """What export reads of params.yaml (tests/test_dvc_params.py checks dvc.yaml lists it)."""

    export: Any
    generation: Any       # the sampling defaults the files and the Modelfile carry
    tracking: Any         # the registered model the files are attached to
    name_or_path: str = field(metadata={"param": "model.name_or_path"})   # the source GGUF, if it is one
    output_dir: str = field(metadata={"param": "train.output_dir"})       # where train wrote the model
    system_prompt: str | None = field(metadata={"param": "data.system_prompt"})  # the Modelfile's SYSTEM


def stage_inputs(cfg) -> ExportInputs:
    return ExportInputs(cfg.export, cfg.generation, cfg.tracking, cfg.model.name_or_path,
                        cfg.train.checkpoints.output_dir, cfg.data.system_prompt)


def sampling_of(generation) -> Sampling:
    """The policy's training sampling (params.yaml `generation:`) as the GGUF's and Modelfile's defaults."""
    return Sampling(temperature=generation.temperature, top_p=generation.top_p, top_k=generation.top_k,
                    min_p=generation.min_p or 0.0, repeat_penalty=generation.repetition_penalty)


def plan(ctx, inp: ExportInputs) -> tuple[ExportPlan, list[str], str]:
    """(plan, types, name): every check done, nothing written."""
    model_dir = require_file(ctx.path(inp.output_dir) / "model", "train")
    source = None
    if is_gguf(inp.name_or_path):
        source = ctx.path(inp.name_or_path)
        read_architecture(source)  # a missing or damaged source GGUF is named before anything else
    name = inp.export.name or default_name(inp.name_or_path)
    export_plan = plan_export(model_dir, source, name=name, sampling=sampling_of(inp.generation))
    return export_plan, resolve_types(inp.export.gguf_types, export_plan, inp.name_or_path), name


def write_export(out: Path, export_plan: ExportPlan, types: list[str], name: str, modelfile: str | None
                 ) -> list[dict]:
    """The folder: one GGUF per type, and the Modelfile (``modelfile``: its text, or None for none)."""
    summaries: list[dict] = []

    def fill(tmp: Path) -> None:
        for t in types:
            summaries.append(write_gguf(export_plan, tmp / f"{name}.{t}.gguf", t))
            print(f"export: {summaries[-1]['file']} ({summaries[-1]['bytes']:,} bytes)", file=sys.stderr,
                  flush=True)
        if modelfile is not None:
            (tmp / MODELFILE).write_text(modelfile, encoding="utf-8")

    write_dir_atomic(out, fill)
    return summaries


def run(ctx) -> int:
    from flows.stages.common import quiet_libraries

    inp = stage_inputs(ctx.cfg)
    out = ctx.path(EXPORT_DIR)
    if inp.export is None:
        write_dir_atomic(out, lambda tmp: None)
        print("export: export is null; nothing to export", file=sys.stderr)
        return 0
    quiet_libraries()
    export_plan, types, name = plan(ctx, inp)
    modelfile = None
    if inp.export.modelfile:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(export_plan.model_dir)
        modelfile = modelfile_text(f"{name}.{types[0]}.gguf", tokenizer, sampling_of(inp.generation),
                                   system=inp.system_prompt)
    with StageRun(ctx) as run:
        summaries = write_export(out, export_plan, types, name, modelfile)
        run.log_metrics({f"gguf_bytes/{s['type']}": s["bytes"] for s in summaries})
        version = attach(run, inp, export_plan.model_dir, out)
        run.set_tags({"export.files": ",".join(sorted(p.name for p in out.iterdir())),
                      "export.registered_version": str(version or "")})
    where = f"attached to {inp.tracking.registered_model_name} v{version}" if version else "not attached"
    print(f"export: {', '.join(types)} -> {EXPORT_DIR} ({where})", file=sys.stderr)
    return 0


def attach(run, inp: ExportInputs, model_dir: Path, out: Path) -> int | None:
    """The registered version of these model files, with the export attached; None when there is none."""
    from flows.stages.evaluate import attach_export

    if not inp.tracking.register_model or run.client is None or run.run_id is None or not run.flush():
        return None
    try:
        return attach_export(run.client, inp.tracking.registered_model_name, model_dir, out)
    except Exception as exc:  # noqa: BLE001 - the registry is a side effect; the files stand
        print(f"export: warning: could not attach the files to the registered model: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return None
