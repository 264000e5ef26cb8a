"""The one error base of the project: every failure a user can cause or meet carries its stage exit code.

A stage (``python -m flows.stages <stage>``) exits with ``exc.exit_code``; the Prefect flow retries only
``EXIT_ERROR`` (1): a transient or unknown failure. The other codes are permanent - retrying cannot help:

    0 ok; 1 unexpected error (retried); 2 bad configuration; 3 data validation failed;
    4 training failed deterministically (non-finite loss, incompatible checkpoint, a guard stop);
    5 data or model cannot be read.

Each module's error derives from one of the categories below and from the built-in type callers may
already catch (``ValueError`` for bad input, ``RuntimeError`` for failures at run time). Nothing here
imports torch or any other heavy library: the stage CLI classifies errors before loading them.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_VALIDATION = 3
EXIT_TRAINING = 4
EXIT_DATA = 5
PERMANENT_EXIT_CODES = frozenset({EXIT_CONFIG, EXIT_VALIDATION, EXIT_TRAINING, EXIT_DATA})


class PipelineError(Exception):
    """Base of every project error; ``exit_code`` 1 = retryable. Subclass a category, not this."""

    exit_code: int = EXIT_ERROR


class ConfigurationError(PipelineError):
    """params.yaml (or a combination of its values) cannot run; the message names the key."""

    exit_code = EXIT_CONFIG


class ValidationFailure(PipelineError):
    """The data failed validation; the report names rows, columns and checks."""

    exit_code = EXIT_VALIDATION


class TrainingFailure(PipelineError):
    """Training stopped deterministically: a retry would stop the same way."""

    exit_code = EXIT_TRAINING


class InputUnreadable(PipelineError):
    """A data file, a model folder or a stage's input cannot be read; the message names it."""

    exit_code = EXIT_DATA


def exit_code_for(exc: BaseException) -> int:
    """The stage exit code for ``exc``: its own for a project error, 1 (retryable) for anything else."""
    return exc.exit_code if isinstance(exc, PipelineError) else EXIT_ERROR
