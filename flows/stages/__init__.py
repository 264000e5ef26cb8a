"""The pipeline's stage commands, one module per stage, run by DVC as ``python -m flows.stages <stage>``.

    prepare   embedded default only: synthetic data + tiny warm-started base model
    convert   a GGUF model.name_or_path only: the model as a safetensors folder (artifacts/converted_model)
    validate  schema / gold-answer / overlap checks -> data/validated/*.parquet + reports/validation.*
    calibrate sample the base policy, score, derive reward weights -> artifacts/calibration/*
    train     GRPO (grpo_core.train.loop.train) -> checkpoints, final model, metrics/train_log.csv
    evaluate  base vs trained policy on held-out prompts -> metrics/eval.json, registry
    export    the trained policy as GGUF files + an Ollama Modelfile (artifacts/export), attached to its
              registered version

Each stage reads params.yaml (``--params`` to override the path), writes only its declared outputs (each
atomically: temp path, then ``os.replace``) and logs an MLflow child run under the pipeline's parent run
(see ``flows/stages/runs.py``). Stages are thin: the algorithms live in ``grpo_core``.

Exit codes (the Prefect flow reads them to decide what to retry) come from the exception itself: every project
error derives from ``grpo_core.common.errors.PipelineError`` and carries its ``exit_code``:
    0 ok; 1 unexpected error (retried); 2 bad configuration; 3 data validation failed;
    4 training failed deterministically (non-finite loss, incompatible checkpoint, a guard stop); 5 data or
    model cannot be read. 2-5 are permanent: retrying cannot help.
"""

from grpo_core.common.errors import (  # noqa: F401 - re-exported: the stage CLI and the Prefect flow read them here
    EXIT_CONFIG,
    EXIT_DATA,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_TRAINING,
    EXIT_VALIDATION,
    PERMANENT_EXIT_CODES,
    exit_code_for,
)

STAGES = ("prepare", "convert", "validate", "calibrate", "train", "evaluate", "export")
