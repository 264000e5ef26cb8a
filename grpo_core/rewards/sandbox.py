"""Running untrusted code (a completion's program) in a sandboxed process: the isolation of the code rewards.

Each run is one fresh process, started through a small launcher (``LAUNCHER``) that, before the code's first
instruction:

    namespaces   a new network namespace (no interface up: no network, not even loopback) and a new mount
                 namespace whose /tmp, /var/tmp and /dev/shm are fresh size-capped tmpfs: the run's own temporary
                 folder and working directory, gone when it ends
    identity     as root: a uid of its own (61000 + n) and no groups, so it can write nowhere else, read no other
                 process's /proc/<pid>/environ and signal no process of ours; the process limit counts its own
    limits       CPU seconds, address space, file size (its output too), processes, open files; no core files
    environment  only PATH, LANG and HOME=/tmp; the system Python (``interpreter()``) in isolated mode (-I: no user
                 site, no PYTHON* variables)

The parent kills the whole run when its wall-clock limit passes: its process group, then every process left with
its uid (a child that called setsid leaves the group, not the uid).

Threat model: the code is hostile but runs as an ordinary Linux process on our kernel. Contained: infinite loops,
fork bombs, memory bombs, big writes, writes outside its folder, network access, reading our environment,
signalling us. Not contained: kernel exploits, CPU side channels, reading world-readable files (what any local user
can read: the source tree, /etc; secrets belong in files only their owner reads). When we are not root there is no
uid to switch to: user (mapping our own ids), mount and network namespaces still come first, but the code runs as
our user, so it can signal our processes, and the process limit counts all of our user's processes.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BASE_UID = 61000
_uids = itertools.count()

# Runs first in the new process as our user, then replaces itself with the code's interpreter.
LAUNCHER = r"""
import ctypes, os, resource, sys
uid, cpu, mem, fsize, nproc, nofile, tmpfs_kib, code_fd = (int(a) for a in sys.argv[1:9])
python = sys.argv[9]
code = b""
while chunk := os.read(code_fd, 1 << 20):
    code += chunk
os.close(code_fd)
libc = ctypes.CDLL(None, use_errno=True)
def check(ok, what):
    if not ok:
        sys.stderr.write(f"sandbox: {what} failed: {os.strerror(ctypes.get_errno())}\n")
        os._exit(125)
root = os.geteuid() == 0
outer_uid, outer_gid = os.getuid(), os.getgid()
check(libc.unshare(0x00020000 | 0x40000000 | (0 if root else 0x10000000)) == 0, "unshare")
if not root:  # our own ids inside the new user namespace (unmapped, files could not be created)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{outer_uid} {outer_uid} 1"),
                       ("gid_map", f"{outer_gid} {outer_gid} 1")):
        with open(f"/proc/self/{name}", "w") as fh:
            fh.write(text)
check(libc.mount(b"none", b"/", None, 16384 | (1 << 18), None) == 0, "mount --make-rprivate /")
for where in (b"/tmp", b"/var/tmp", b"/dev/shm"):
    if os.path.isdir(where):
        check(libc.mount(b"tmpfs", where, b"tmpfs", 2 | 4, f"size={tmpfs_kib}k,mode=1777".encode()) == 0,
              "mount tmpfs on " + where.decode())
if root:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
os.chdir("/tmp")
with open("/tmp/main.py", "wb") as fh:
    fh.write(code)
for res, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
                   (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(res, (value, value))
os.execve(python, [python, "-I", "/tmp/main.py"],
          {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"})
"""


@dataclass(frozen=True)
class Limits:
    """What one run may use."""

    wall_s: float = 5.0           # killed after this many seconds, whatever it is doing
    cpu_s: int = 4                # RLIMIT_CPU (SIGXCPU, then SIGKILL)
    memory_mib: int = 512         # RLIMIT_AS: address space, so a 10 GB allocation fails at once
    file_mib: int = 16            # RLIMIT_FSIZE: any one file written, stdout and stderr included
    processes: int = 32           # RLIMIT_NPROC: processes and threads of its uid
    open_files: int = 64          # RLIMIT_NOFILE
    tmp_mib: int = 32             # the size of its own /tmp


@dataclass(frozen=True)
class RunResult:
    """status: ok (exit 0), error (non-zero exit), timeout (killed at wall_s), cpu (out of CPU time), killed (another
    signal), sandbox (the isolation itself could not be set up: nothing ran)."""

    status: str
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run_python(code: str, stdin: str = "", limits: Limits = Limits()) -> RunResult:
    """Run ``code`` (a Python program) with ``stdin`` in a fresh sandboxed process; its stdout, stderr and fate."""
    uid = BASE_UID + (os.getpid() * 1000 + next(_uids)) % 4000 if os.geteuid() == 0 else -1
    with tempfile.TemporaryDirectory(prefix="grpo-sandbox-") as work:
        src, out, err = (Path(work) / name for name in ("code.py", "stdout", "stderr"))
        src.write_text(code)
        start = time.perf_counter()
        with open(src, "rb") as code_fh, open(out, "wb") as out_fh, open(err, "wb") as err_fh:
            args = [sys.executable, "-I", "-c", LAUNCHER, str(uid), str(limits.cpu_s), str(limits.memory_mib << 20),
                    str(limits.file_mib << 20), str(limits.processes), str(limits.open_files),
                    str(limits.tmp_mib << 10), str(code_fh.fileno()), interpreter()]
            proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=out_fh, stderr=err_fh,
                                    pass_fds=(code_fh.fileno(),), start_new_session=True, cwd=work,
                                    env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"})
            try:
                proc.communicate(stdin.encode(), timeout=limits.wall_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            except BrokenPipeError:  # it exited without reading all of its input
                timed_out = False
            finally:
                kill_run(proc, uid)
        seconds = time.perf_counter() - start
        stdout, stderr = (p.read_bytes().decode(errors="replace") for p in (out, err))
    return RunResult(_status(proc.returncode, timed_out, stderr), proc.returncode, stdout, stderr, seconds)


def interpreter() -> str:
    """The Python the code runs under: one every user may execute (as root the code runs under its own uid, and a
    virtual environment under /root is not reachable by it); SANDBOX_PYTHON names another."""
    for candidate in (os.environ.get("SANDBOX_PYTHON"), "/usr/bin/python3", "/usr/local/bin/python3"):
        if candidate and os.path.isfile(candidate) and os.stat(candidate).st_mode & 0o001:
            return candidate
    return sys.executable


def kill_run(proc: subprocess.Popen, uid: int) -> None:
    """SIGKILL the run's process group and, as root, every process of its uid (until none is left: a fork bomb keeps
    forking while it is being killed); then reap the launcher."""
    for _ in range(100):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        left = _processes_of(uid) if uid >= 0 else []
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not left:
            break
    proc.wait()


def _processes_of(uid: int) -> list[int]:
    """Live processes whose real uid is ``uid`` (read from /proc/<pid>/status: after setuid a process is not
    dumpable and its /proc directory belongs to root); zombies are left to their reaper."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid and not fields.get("State", "").strip().startswith("Z"):
            pids.append(int(entry.name))
    return pids


def _status(returncode: int, timed_out: bool, stderr: str) -> str:
    if timed_out:
        return "timeout"
    if returncode == 125 and stderr.startswith("sandbox:"):
        return "sandbox"
    if returncode == -signal.SIGXCPU:
        return "cpu"
    if returncode < 0:
        return "killed"
    return "ok" if returncode == 0 else "error"
