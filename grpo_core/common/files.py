"""Files written whole or not at all, and values JSON can hold: the one place for both.

Atomic writes: a reader sees the old file/folder or the complete new one, never a partial one (a temp
path beside the target, then ``os.replace``). JSON has no NaN or inf: ``finite_or_none`` and ``jsonable``
turn them into null.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from grpo_core.common.errors import disk_full


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success it replaces ``path`` atomically,
    on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Indented strict JSON (a NaN is an error here: pass the object through ``jsonable`` first)."""
    return write_text_atomic(path,
                             json.dumps(obj, indent=2, sort_keys=False, allow_nan=False, default=str) + "\n")


def write_jsonl_atomic(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> int:
    """Write `rows` as JSON lines, flushed to disk before the rename; returns the row count. Keys keep their
    order and non-ASCII is escaped, so the bytes depend only on `rows`."""
    count = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            count += 1
        f.flush()
        os.fsync(f.fileno())
    return count


def write_dir_atomic(path: str | Path, fill: Callable[[Path], None]) -> None:
    """Have `fill(tmp_dir)` write a folder's content, then move it to `path` (replacing an old one).

    The old folder is renamed aside before the new one is renamed in, so `path` is always absent or
    complete; the aside copy is removed afterwards, and put back if the new one fails to land. What a killed
    earlier write left beside `path` (its ``.<name>.*.tmp`` and ``.<name>.*.old`` folders) is removed first -
    except an old folder whose successor never landed (a kill between the two renames), which is put back:
    one writer at a time (the stage lock).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for old in path.parent.glob(f".{path.name}.*.old"):
        if not path.exists() and (old / path.name).is_dir():
            os.replace(old / path.name, path)
    for stale in [*path.parent.glob(f".{path.name}.*.tmp"), *path.parent.glob(f".{path.name}.*.old")]:
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    aside = None
    try:
        fill(tmp)
        if path.exists():
            aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, aside / path.name)
        os.replace(tmp, path)
    except BaseException as err:
        if aside is not None:
            if not path.exists() and (aside / path.name).is_dir():
                os.replace(aside / path.name, path)
            with contextlib.suppress(OSError):
                aside.rmdir()  # empty now; the old folder is never deleted here
        discard_partial(tmp, path, err)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def discard_partial(tmp: Path, target: Path, err: BaseException) -> None:
    """Remove a failed write's partial folder ``tmp``; raise a TransientFailure naming ``target`` and the free
    space (from ``err``) when a full disk is why, else return so the caller re-raises ``err``."""
    full = disk_full(err, target)  # measured before the partial folder goes, which frees its space again
    shutil.rmtree(tmp, ignore_errors=True)
    if full is not None:
        raise full from err


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """The file's sha256 (hex), read in chunks: the checksum checkpoint manifests and GGUF sources record."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def finite_or_none(x: float) -> float | None:
    """A number as JSON can hold it: NaN and inf (an undefined statistic) become None."""
    x = float(x)
    return x if math.isfinite(x) else None


def jsonable(obj: Any) -> Any:
    """``finite_or_none`` through dicts, lists and tuples; numpy / torch scalars become Python numbers."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 0) == 0:
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
