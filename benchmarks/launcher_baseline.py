"""The hand-written launcher the code reward ran programs through before issue 30, kept verbatim (less the
dataclasses it shares with grpo_core/rewards/sandbox.py) for one use: benchmarks/sandbox_overhead.py measures the
jail against it. It does not isolate a program from a non-root trainer (docs/operations.md, Security): nothing in
grpo_core uses it.
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from grpo_core.rewards.sandbox import Limits, RunResult, interpreter

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


def run_python(code: str, stdin: str = "", limits: Limits | None = None) -> RunResult:
    """Run ``code`` (a Python program) with ``stdin`` in a fresh sandboxed process; its stdout, stderr and fate."""
    limits = limits or Limits()
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
