"""The pipeline's stage commands, one module per stage, run by DVC as ``python -m flows.stages <stage>``.

    prepare   embedded default only: synthetic data + tiny warm-started base model
    validate  schema / gold-answer / overlap checks -> data/validated/*.parquet + reports/validation.*
    calibrate sample the base policy, score, derive reward weights -> artifacts/calibration/*
    train     GRPO (grpo_core.trainer.train) -> checkpoints, final model, metrics/train_log.csv
    evaluate  base vs trained policy on held-out prompts -> metrics/eval.json, registry

Each stage reads params.yaml (``--params`` to override the path), writes only its declared outputs (each
atomically: temp path, then ``os.replace``) and logs an MLflow child run under the pipeline's parent run
(see ``flows/stages/runs.py``). Stages are thin: the algorithms live in ``grpo_core``.

Exit codes (the Prefect flow reads them to decide what to retry):
    0 ok; 1 unexpected error (retried); 2 bad configuration; 3 data validation failed;
    4 training failed deterministically (non-finite loss, incompatible checkpoint); 5 data or model
    cannot be read. 2-5 are permanent: retrying cannot help.
"""

STAGES = ("prepare", "validate", "calibrate", "train", "evaluate")

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_VALIDATION = 3
EXIT_TRAINING = 4
EXIT_DATA = 5
PERMANENT_EXIT_CODES = frozenset({EXIT_CONFIG, EXIT_VALIDATION, EXIT_TRAINING, EXIT_DATA})

# Exception class names (matched along the MRO, so grpo_core need not be imported to classify) -> exit code.
EXIT_CODES_BY_EXCEPTION = {
    "ConfigError": EXIT_CONFIG,
    "RewardConfigError": EXIT_CONFIG,
    "StageConfigError": EXIT_CONFIG,
    "DataValidationError": EXIT_VALIDATION,
    "ValidationFailed": EXIT_VALIDATION,
    "TrainingError": EXIT_TRAINING,
    "CheckpointError": EXIT_TRAINING,
    "RewardFunctionError": EXIT_TRAINING,
    "GuardStop": EXIT_TRAINING,  # a guard stopped a run going wrong: a retry would only repeat it
    "DataError": EXIT_DATA,
    "DataFileError": EXIT_DATA,
    "ModelLoadError": EXIT_DATA,
    "StageInputError": EXIT_DATA,
}


def exit_code_for(exc: BaseException) -> int:
    for cls in type(exc).__mro__:
        if cls.__name__ in EXIT_CODES_BY_EXCEPTION:
            return EXIT_CODES_BY_EXCEPTION[cls.__name__]
    return EXIT_ERROR
