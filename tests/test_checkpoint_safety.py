"""No checkpoint is lost to inference: the train stage's fingerprint hashes contents (a touched or copied
model resumes), changed inputs set the checkpoints aside instead of deleting them (and switching back takes
them back), a ``max_steps`` below the newest checkpoint stops with a clear error, a checkpoint without its
manifest is never trusted, deletes go through a trash name, and a kill between the two renames of a folder
replace never costs the old folder."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.stages.common import StageConfigError, StageContext, md5_path
from flows.stages.train import (
    FINGERPRINT,
    INPUT_HASHES,
    KEPT_SETS_DIR,
    fingerprint,
    prepare_checkpoints,
)
from grpo_core.common.files import write_dir_atomic
from grpo_core.train.checkpoint import (
    MANIFEST_FILE,
    CheckpointError,
    checkpoint_problem,
    kept_sets,
    latest_valid_checkpoint,
    list_checkpoints,
    remove_stale_temp_dirs,
    write_manifest,
)
from tests.test_checkpoint import _save

REPO = Path(__file__).resolve().parents[1]
SMALL = 1024  # the large-file threshold the tests pass: the 4 KiB weights below take the cached path
WEIGHTS = [1.0, 1.0]


def _stage(root: Path, **train: object) -> StageContext:
    """A repo at ``root`` with the project's params.yaml, ``train`` keys overridden."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["train"].update(train)
    (root / "dvc.yaml").write_text("stages: {}\n")
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return StageContext.create("train", start=root)


def _model(root: Path, seed: int = 0) -> Path:
    """A 'base model' folder at params.yaml's name_or_path: a small config and 4 KiB of weights."""
    folder = root / "artifacts" / "base_model"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "qwen2"}')
    (folder / "model.safetensors").write_bytes(bytes((seed + i * 7) % 251 for i in range(4096)))
    return folder


def _checkpoint(ckpt_dir: Path, step: int, tag: str = "") -> Path:
    """A checkpoint folder as the trainer leaves it: a state file, weights, and the manifest written last."""
    folder = ckpt_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    (folder / "model.safetensors").write_text(f"weights of step {step} {tag}")
    write_manifest(folder)
    return folder


def _fp(ctx: StageContext) -> dict:
    return fingerprint(ctx, ctx.cfg, WEIGHTS, None, large_file_bytes=SMALL)


def _steps(ckpt_dir: Path) -> list[str]:
    return [p.name for p in list_checkpoints(ckpt_dir)]


# ---------------------------------------------------------------------------------------------------
# the fingerprint hashes contents


def test_a_touched_or_copied_model_resumes_and_keeps_its_checkpoints(tmp_path, capsys):
    ctx = _stage(tmp_path)
    weights = _model(tmp_path) / "model.safetensors"
    ckpt = tmp_path / "artifacts" / "checkpoints"
    fp = _fp(ctx)
    assert prepare_checkpoints(ctx, ctx.cfg, fp) == "fresh"
    _checkpoint(ckpt, 1)

    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))  # `touch`
    assert _fp(ctx) == fp
    assert prepare_checkpoints(ctx, ctx.cfg, _fp(ctx)) == "resume:checkpoint-1"

    model = weights.parent
    shutil.copytree(model, tmp_path / "copy")  # a re-download / `dvc checkout`: new inodes, new times
    shutil.rmtree(model)
    (tmp_path / "copy").rename(model)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 9_000_000_000))
    assert weights.stat().st_ino != st.st_ino
    assert _fp(ctx) == fp
    assert prepare_checkpoints(ctx, ctx.cfg, _fp(ctx)) == "resume:checkpoint-1"
    assert _steps(ckpt) == ["checkpoint-1"] and checkpoint_problem(ckpt / "checkpoint-1") is None
    assert "starting fresh" not in capsys.readouterr().err


def test_a_large_file_is_hashed_in_full_once_per_size_mtime_inode(tmp_path):
    """The cache entry holds the md5 of the whole file; while the file's (size, mtime, inode, device) stay,
    the cached md5 is used (a planted one shows it); a touch reads the file again."""
    ctx = _stage(tmp_path)
    weights = _model(tmp_path) / "model.safetensors"
    fp = _fp(ctx)
    cache_file = tmp_path / "artifacts" / KEPT_SETS_DIR / INPUT_HASHES
    cache = json.loads(cache_file.read_text())
    st = weights.stat()
    entry = cache[str(weights)]
    assert entry == {"md5": hashlib.md5(weights.read_bytes()).hexdigest(),
                     "stat": [st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev]}
    assert set(cache) == {str(weights)}  # config.json is under the threshold: read each time, not cached

    entry["md5"] = "0" * 32
    cache_file.write_text(json.dumps(cache))
    assert _fp(ctx)["base_model_md5"] != fp["base_model_md5"]  # served from the cache, not read
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert _fp(ctx) == fp  # a new stamp: read again, the true md5
    # the default threshold reads small files in full each time: the same fingerprint, and the same md5s
    # as before content hashing (a small model's run resumes across the upgrade)
    assert fingerprint(ctx, ctx.cfg, WEIGHTS, None) == fp
    assert fp["base_model_md5"] == md5_path(weights.parent)


# ---------------------------------------------------------------------------------------------------
# changed inputs: set aside, kept, taken back


def test_changed_inputs_set_the_checkpoints_aside_and_switching_back_resumes_from_them(tmp_path, capsys):
    ctx = _stage(tmp_path)
    _model(tmp_path, seed=0)
    ckpt = tmp_path / "artifacts" / "checkpoints"
    kept = tmp_path / "artifacts" / KEPT_SETS_DIR
    log = tmp_path / "metrics" / "train_log.csv"
    log.parent.mkdir()
    fp_a = _fp(ctx)
    assert prepare_checkpoints(ctx, ctx.cfg, fp_a) == "fresh"
    _checkpoint(ckpt, 3, "run A")
    log.write_text("step,reward\n1,0.1\n2,0.2\n3,0.3\n")

    _model(tmp_path, seed=1)  # the same size, other bytes: a real change
    fp_b = _fp(ctx)
    assert fp_b["base_model_md5"] != fp_a["base_model_md5"]
    assert prepare_checkpoints(ctx, ctx.cfg, fp_b) == "fresh"
    assert _steps(ckpt) == []
    (set_a,) = kept_sets(kept)
    assert set_a.name.startswith(hashlib.md5(json.dumps(fp_a, sort_keys=True).encode()).hexdigest()[:12])
    assert (set_a / "checkpoint-3" / "model.safetensors").read_text() == "weights of step 3 run A"
    assert (set_a / "train_log.csv").read_text().endswith("3,0.3\n")
    assert f"moved, not deleted, to {set_a}" in capsys.readouterr().err
    _checkpoint(ckpt, 5, "run B")
    log.write_text("step,reward\n5,0.9\n")

    _model(tmp_path, seed=0)  # back to A
    assert _fp(ctx) == fp_a
    assert prepare_checkpoints(ctx, ctx.cfg, fp_a) == "resume:checkpoint-3"
    assert checkpoint_problem(ckpt / "checkpoint-3") is None
    assert (ckpt / "checkpoint-3" / "model.safetensors").read_text() == "weights of step 3 run A"
    assert log.read_text().endswith("3,0.3\n")  # A's curve back with A's checkpoints
    assert not (ckpt / "train_log.csv").exists()
    assert "moved back" in capsys.readouterr().err
    (set_b,) = kept_sets(kept)
    assert [p.name for p in list_checkpoints(set_b)] == ["checkpoint-5"]

    _model(tmp_path, seed=1)  # and to B again
    assert prepare_checkpoints(ctx, ctx.cfg, _fp(ctx)) == "resume:checkpoint-5"
    assert log.read_text() == "step,reward\n5,0.9\n"


def test_only_the_newest_kept_sets_stay_and_the_removal_is_logged(tmp_path, capsys):
    ctx = _stage(tmp_path)
    ckpt = tmp_path / "artifacts" / "checkpoints"
    kept = tmp_path / "artifacts" / KEPT_SETS_DIR

    def run(name: str, step: int) -> str:
        action = prepare_checkpoints(ctx, ctx.cfg, {"params_hash": name})
        if action == "fresh":
            _checkpoint(ckpt, step, name)
        return action

    def kept_names() -> list[str]:
        return [json.loads((s / FINGERPRINT).read_text())["params_hash"] for s in kept_sets(kept)]

    for step, name in enumerate(["p0", "p1", "p2"], start=1):
        assert run(name, step) == "fresh"
    assert kept_names() == ["p0", "p1"]
    assert "removed" not in capsys.readouterr().err
    assert run("p3", 4) == "fresh"
    assert kept_names() == ["p1", "p2"]  # p0, the oldest beyond two, removed and said so
    assert re.search(r"removed .*p?\w+-\d{8}T\d{12}Z, the oldest set of checkpoints kept aside",
                     capsys.readouterr().err)
    # taking a kept set back first: three sets for a moment, never the one about to be resumed removed
    assert run("p1", 0) == "resume:checkpoint-2"
    assert kept_names() == ["p2", "p3"]
    assert run("p0", 5) == "fresh"  # gone for good: trained again


def test_kept_sets_are_neither_a_dvc_out_nor_seen_by_git(tmp_path):
    """dvc.yaml's outs (checkpoints is one, cached whole) hold no kept set, and a repo's git status does
    not list them (their folder ignores itself)."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    output_dir = yaml.safe_load((REPO / "params.yaml").read_text())["train"]["output_dir"]
    kept = Path(output_dir, KEPT_SETS_DIR)
    outs = [Path(str(next(iter(o)) if isinstance(o, dict) else o).replace("${train.output_dir}", output_dir))
            for stage in stages.values() for o in stage.get("outs", [])]
    assert Path(output_dir, "checkpoints") in outs
    assert not [o for o in outs if o == kept or o in kept.parents or kept in o.parents]

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    ctx = _stage(tmp_path)
    ckpt = tmp_path / "artifacts" / "checkpoints"
    assert prepare_checkpoints(ctx, ctx.cfg, {"params_hash": "a"}) == "fresh"
    _checkpoint(ckpt, 1)
    assert prepare_checkpoints(ctx, ctx.cfg, {"params_hash": "b"}) == "fresh"
    assert len(kept_sets(tmp_path / kept)) == 1
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=tmp_path,
                            capture_output=True, text=True, check=True).stdout
    assert "artifacts/checkpoints/" in status  # git sees the rest of the tree (DVC ignores its outs itself)
    assert KEPT_SETS_DIR not in status


# ---------------------------------------------------------------------------------------------------
# max_steps below the newest checkpoint


def test_max_steps_below_the_newest_checkpoint_stops_deleting_nothing(tmp_path):
    ctx = _stage(tmp_path, max_steps=150)
    ckpt = tmp_path / "artifacts" / "checkpoints"
    fp = {"params_hash": "a"}
    assert prepare_checkpoints(ctx, ctx.cfg, fp) == "fresh"
    for step in (100, 200):
        _checkpoint(ckpt, step)
    with pytest.raises(StageConfigError, match=re.escape(
            f"train.max_steps=150 is below the newest checkpoint, {ckpt / 'checkpoint-200'} (step 200); "
            "nothing was deleted. Raise train.max_steps to 200 or more to resume from it, or set "
            "train.resume: never to train from step 0")):
        prepare_checkpoints(ctx, ctx.cfg, fp)
    assert _steps(ckpt) == ["checkpoint-100", "checkpoint-200"]
    assert all(checkpoint_problem(p) is None for p in list_checkpoints(ckpt))
    assert kept_sets(tmp_path / "artifacts" / KEPT_SETS_DIR) == []

    ctx = _stage(tmp_path, max_steps=200)
    assert prepare_checkpoints(ctx, ctx.cfg, fp) == "resume:checkpoint-200"
    ctx = _stage(tmp_path, max_steps=150, resume="never")  # asked: a fresh run, the old one kept aside
    assert prepare_checkpoints(ctx, ctx.cfg, fp) == "fresh"
    (kept,) = kept_sets(tmp_path / "artifacts" / KEPT_SETS_DIR)
    assert _steps(kept) == ["checkpoint-100", "checkpoint-200"] and _steps(ckpt) == []


# ---------------------------------------------------------------------------------------------------
# what resume trusts


def test_a_checkpoint_without_its_manifest_is_skipped_with_the_reason(tmp_path, capsys):
    ctx = _stage(tmp_path)
    ckpt = tmp_path / "artifacts" / "checkpoints"
    fp = {"params_hash": "a"}
    prepare_checkpoints(ctx, ctx.cfg, fp)
    _checkpoint(ckpt, 4)
    (_checkpoint(ckpt, 8) / MANIFEST_FILE).unlink()
    assert prepare_checkpoints(ctx, ctx.cfg, fp) == "resume:checkpoint-4"
    err = capsys.readouterr().err
    manifest = ckpt / "checkpoint-8" / MANIFEST_FILE
    assert f"checkpoint checkpoint-8 is corrupt, skipped: {manifest} is missing" in err
    (ckpt / "checkpoint-4" / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match="no valid checkpoint to resume from: .*checkpoint-8/manifest"
                                              r".json is missing.*checkpoint-4/manifest.json is missing"):
        latest_valid_checkpoint(ckpt, warn=lambda msg: None)
    assert _steps(ckpt) == ["checkpoint-4", "checkpoint-8"]  # untrusted, not deleted


KILL_IN_RMTREE = """
import os, shutil, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tests.test_checkpoint import _save
d = Path(sys.argv[1])
_save(d, 1); _save(d, 2)
def dying_rmtree(path, *a, **k):  # a delete cut off half-way: the manifest and the weights already gone
    for name in ("manifest.json", "model.safetensors"):
        Path(path, name).unlink(missing_ok=True)
    os.kill(os.getpid(), signal.SIGKILL)
shutil.rmtree = dying_rmtree
_save(d, *map(int, sys.argv[3:]))
"""


def _killed(script: str, *args: object) -> None:
    proc = subprocess.run([sys.executable, "-c", script, *map(str, args)],
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == -signal.SIGKILL


def test_a_kill_while_pruning_leaves_no_half_checkpoint_and_the_next_start_clears_it(tmp_path):
    _killed(KILL_IN_RMTREE, tmp_path, REPO, 3, 2)  # checkpoint-3, keep_last=2: checkpoint-1 pruned
    assert not (tmp_path / "checkpoint-1").exists()
    (trash,) = [p for p in tmp_path.iterdir() if p.name.startswith("checkpoint-1.")]
    assert re.fullmatch(r"checkpoint-1\.trash-\d+", trash.name) and (trash / "trainer_state.json").is_file()
    assert _steps(tmp_path) == ["checkpoint-2", "checkpoint-3"]
    assert latest_valid_checkpoint(tmp_path).name == "checkpoint-3"
    assert remove_stale_temp_dirs(tmp_path) == 1 and not trash.exists()


def test_a_kill_while_a_same_step_resave_deletes_the_old_one_resumes_the_new_one_whole(tmp_path):
    _killed(KILL_IN_RMTREE, tmp_path, REPO, 2)  # checkpoint-2 again: the old one goes after the new lands
    remove_stale_temp_dirs(tmp_path)  # what resume does first
    assert _steps(tmp_path) == ["checkpoint-1", "checkpoint-2"]
    assert latest_valid_checkpoint(tmp_path).name == "checkpoint-2"
    assert (tmp_path / "checkpoint-2" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-2"]


KILL_BETWEEN_RENAMES = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from tests.test_checkpoint import _save
d = Path(sys.argv[1])
_save(d, 1); _save(d, 2)
real_replace = os.replace
def dying_replace(src, dst):  # the new checkpoint-2 complete, about to be renamed in
    if Path(src).name.startswith("checkpoint-2.tmp-") and Path(dst).name == "checkpoint-2":
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)
os.replace = dying_replace
_save(d, 2)
"""


def test_a_kill_between_the_two_renames_of_a_resave_keeps_the_old_checkpoint(tmp_path):
    _killed(KILL_BETWEEN_RENAMES, tmp_path, REPO)
    assert not (tmp_path / "checkpoint-2").exists()  # cut off between the renames
    (aside,) = tmp_path.glob("checkpoint-2.old-*")
    old_manifest = (aside / MANIFEST_FILE).read_text()
    _save(tmp_path, 3)  # the next write puts the old checkpoint-2 back, whole, before anything else
    assert _steps(tmp_path) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert (tmp_path / "checkpoint-2" / MANIFEST_FILE).read_text() == old_manifest
    assert checkpoint_problem(tmp_path / "checkpoint-2") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_one_leftover_pattern_for_the_save_and_the_start_and_user_folders_are_left_alone(tmp_path):
    for name in ("checkpoint-7.tmp-11", "checkpoint-7.trash-11", "checkpoint-7.old-11.trash-12",
                 "notes.tmp-mine", "checkpoint-7.tmp-draft"):
        (tmp_path / name).mkdir()
    _save(tmp_path, 1)  # a save clears what a start would
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-7.tmp-draft",
                                                          "notes.tmp-mine"]
    (tmp_path / "checkpoint-7.trash-11").mkdir()
    assert remove_stale_temp_dirs(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-7.tmp-draft",
                                                          "notes.tmp-mine"]


# ---------------------------------------------------------------------------------------------------
# write_dir_atomic (the exported model, the converted GGUF): the `.old` window


KILL_DIR_WRITE_BETWEEN_RENAMES = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from grpo_core.common.files import write_dir_atomic
real_replace = os.replace
def dying_replace(src, dst):
    if Path(src).name.endswith(".tmp") and Path(dst) == Path(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)
os.replace = dying_replace
write_dir_atomic(Path(sys.argv[1]), lambda d: (d / "v").write_text("2"))
"""


def test_a_kill_between_the_renames_of_a_folder_write_loses_not_the_old_folder(tmp_path):
    model = tmp_path / "model"
    write_dir_atomic(model, lambda d: (d / "v").write_text("1"))
    _killed(KILL_DIR_WRITE_BETWEEN_RENAMES, model, REPO)
    assert not model.exists()
    assert [p.name for p in tmp_path.glob(".model.*.old/model")] == ["model"]

    def failing(folder: Path) -> None:
        raise ValueError("conversion failed")

    with pytest.raises(ValueError, match="conversion failed"):
        write_dir_atomic(model, failing)  # the next write fails: the old folder is back, not deleted
    assert (model / "v").read_text() == "1"
    write_dir_atomic(model, lambda d: (d / "v").write_text("3"))
    assert (model / "v").read_text() == "3"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_a_failed_rename_in_of_a_folder_write_puts_the_old_folder_back(tmp_path, monkeypatch):
    model = tmp_path / "model"
    write_dir_atomic(model, lambda d: (d / "v").write_text("1"))
    real_replace = os.replace

    def refusing(src, dst):
        if Path(dst) == model and Path(src).name.endswith(".tmp"):
            raise PermissionError(13, "Permission denied", str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", refusing)
    with pytest.raises(PermissionError):
        write_dir_atomic(model, lambda d: (d / "v").write_text("2"))
    assert (model / "v").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
