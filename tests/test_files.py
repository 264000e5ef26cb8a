"""Folders written whole or not at all, and what a killed write leaves behind cleaned by the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from grpo_core.common.files import write_dir_atomic

REPO = Path(__file__).resolve().parents[1]
KILLED_WRITE = """
import os, signal, sys
from pathlib import Path
from grpo_core.common.files import write_dir_atomic

def fill(tmp):
    (tmp / "model.safetensors").write_bytes(b"half")
    os.kill(os.getpid(), signal.SIGKILL)   # mid-export

write_dir_atomic(Path(sys.argv[1]), fill)
"""


def test_a_killed_write_keeps_the_old_folder_and_the_next_write_removes_its_leftovers(tmp_path):
    model = tmp_path / "model"
    write_dir_atomic(model, lambda d: (d / "v").write_text("1"))
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITE, str(model)],
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == -signal.SIGKILL
    assert (model / "v").read_text() == "1"  # the old folder is whole
    (tmp_path / ".model.x1y2.old").mkdir()  # as a kill between the two renames leaves it
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".model.")]
    assert sorted(name.rsplit(".", 1)[1] for name in leftovers) == ["old", "tmp"]

    (tmp_path / ".other.abc.tmp").mkdir()  # another folder's temp: not this write's to remove
    write_dir_atomic(model, lambda d: (d / "v").write_text("2"))
    assert (model / "v").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.abc.tmp", "model"]
