"""The one error base of the project: every failure a user can cause or meet carries its stage exit code.

A stage (``python -m flows.stages <stage>``) exits with ``exc.exit_code``; the Prefect flow retries only
``EXIT_ERROR`` (1): a transient or unknown failure. The other codes are permanent - retrying cannot help:

    0 ok; 1 transient (retried): a server, worker or store that died or did not answer, a full disk, an
    unexpected error; 2 bad configuration; 3 data validation failed;
    4 training failed deterministically (non-finite loss, incompatible checkpoint, a guard stop);
    5 data or model cannot be read.

Each module's error derives from one of the categories below and from the built-in type callers may
already catch (``ValueError`` for bad input, ``RuntimeError`` for failures at run time). Nothing here
imports torch or any other heavy library: the stage CLI classifies errors before loading them.
"""

from __future__ import annotations

import errno
import os
import shutil

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


class TransientFailure(PipelineError, RuntimeError):
    """A component the stage depends on died, went silent or ran out of room (a vLLM server, the sampler
    worker, a full disk): re-running once it is back resumes from the last checkpoint. The message names the
    component and what to check."""

    exit_code = EXIT_ERROR


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


NEARLY_FULL_BYTES = 1 << 20  # less free than this where a write failed: the disk was full (torch's writer
                             # says only "iostream error", with no errno)


def disk_full(exc: BaseException, path: str | os.PathLike | None = None) -> TransientFailure | None:
    """A TransientFailure naming the path and its filesystem's free space when ``exc`` comes from a full disk
    or quota: ENOSPC / EDQUOT anywhere in its chain, or (``path`` given: where the write went) less than a MiB
    left there. None otherwise. Call it before removing what the failed write left, which frees the space
    again."""
    chain, seen = [], exc
    while seen is not None and len(chain) < 10:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    errnos = [e for e in chain if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)]
    where = path or (errnos[0].filename if errnos else None)
    free = _free_bytes(where) if where else None
    if not errnos and (free is None or free >= NEARLY_FULL_BYTES):
        return None
    named = f" writing {where}" if where else ""
    left = f" ({free / 2**20:.1f} MiB free on its filesystem)" if free is not None else ""
    return TransientFailure(f"disk full{named}{left}: {type(exc).__name__}: {exc}; free space and run the "
                            "stage again: training resumes from its last complete checkpoint")


def _free_bytes(path: str | os.PathLike) -> int | None:
    where = os.path.abspath(path)
    while not os.path.exists(where) and os.path.dirname(where) != where:  # the file itself was never created
        where = os.path.dirname(where)
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


def exit_code_for(exc: BaseException) -> int:
    """The stage exit code for ``exc``: its own for a project error, 1 (retryable) for anything else."""
    return exc.exit_code if isinstance(exc, PipelineError) else EXIT_ERROR


def stage_failure(exc: BaseException) -> tuple[BaseException, int]:
    """What a stage reports for ``exc`` (a full disk said as such, ``disk_full``) and the code it exits with:
    the one mapping a stage's exit code and a launched rank's recorded code share."""
    reported = disk_full(exc) or exc
    return reported, exit_code_for(reported)
