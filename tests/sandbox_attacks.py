"""Hostile programs against the code reward's jail (grpo_core/rewards/sandbox.py),
each with what must hold after it.

Every program is run by ``run_python`` as the trainer would run it. It tries its attack in several ways; each
try that works prints ``ESCAPED``. After the run the trainer's side is checked: nothing was written, no secret
reached the output, the victims are alive, and no process of the run is left (the program prints its pid
namespace first, and no process may remain in it).

Imported by tests/test_sandbox_hostile.py, and run as a script by it under an unprivileged user:

    python -m tests.sandbox_attacks REPO_DIR      (prints {attack: [problems]} as JSON)

Only the standard library and grpo_core.rewards.sandbox are imported, so that the script runs from a copy of
those files under any user.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from grpo_core.rewards.sandbox import Jail, Limits, RunResult, run_python

# Before every program: its targets, its pid namespace, and `attempt`, which reports a try that worked.
PRELUDE = '''import os, sys, time
T = {targets!r}
print("NS", os.readlink("/proc/self/ns/pid"), flush=True)
def attempt(what, fn):
    try:
        result = fn()
    except BaseException as exc:
        print("failed:", what, type(exc).__name__, exc, flush=True)
    else:
        print("ESCAPED:", what, type(result).__name__, flush=True)  # the type only: no secret in a test log
'''


@dataclass
class Targets:
    """What the programs aim at, on the trainer's side of the jail."""

    base: str                 # a folder of the trainer's, outside the jail
    home: str                 # the trainer's home (the unprivileged pass: a fresh one of its own)
    repo: str                 # the project tree
    secret: str = ""          # a 0600 file of the trainer's
    public: str = ""          # a 0644 file of the trainer's
    home_secret: str = ""     # a 0600 file in its home
    write_to: list[str] = field(default_factory=list)  # where a write must not land
    token: str = ""           # the secret files' content and an environment variable's value
    trainer: int = 0          # this process
    victim: int = 0           # a sleeping process of the trainer's
    port: int = 0             # a TCP server of the trainer's on 127.0.0.1
    abstract: str = ""        # an abstract unix socket of the trainer's
    accepted: list[str] = field(default_factory=list)  # connections its servers accepted (none,
                                                       # or the jail leaked)


@dataclass(frozen=True)
class Attack:
    name: str
    program: str
    statuses: tuple[str, ...]
    limits: Limits = Limits(wall_s=3, cpu_s=10)
    check: Callable[[RunResult, Targets], list[str]] | None = None


def _read_attempts() -> str:
    return '''
for path in (T["secret"], T["public"], T["home_secret"], "/etc/shadow", "/etc/passwd", "/etc/hostname",
             os.path.join(T["repo"], "pyproject.toml"), os.path.join(T["home"], ".bashrc"), "/root/.bashrc",
             "/proc/1/root/etc/passwd"):
    attempt("read " + path, lambda: open(path).read())
for folder in (T["home"], T["repo"], T["base"], "/root", "/home", "/work"):
    attempt("list " + folder, lambda: os.listdir(folder))
'''


def _write_attempts() -> str:
    return '''
for path in T["write_to"]:
    attempt("write " + path, lambda: open(path, "w").write("pwned"))
attempt("chmod /dev/null", lambda: os.chmod("/dev/null", 0o600))
attempt("chmod the interpreter", lambda: os.chmod(sys.executable, 0o700))
attempt("write into the interpreter's folder", lambda: open(os.path.join(os.path.dirname(sys.executable), \
"x"), "w"))
'''


def _signal_attempts() -> str:
    return '''
for pid in (T["trainer"], T["victim"]):
    for sig in (9, 15, 19):
        attempt(f"kill -{sig} {pid}", lambda: os.kill(pid, sig))
    attempt(f"killpg {pid}", lambda: os.killpg(pid, 9))
attempt("kill -1 (every process it may signal)", lambda: os.kill(-1, 9))
'''


def _privilege_attempts() -> str:
    return '''
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
def call(name, *args):
    if getattr(libc, name)(*args) == -1:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
attempt("setuid 0", lambda: os.setuid(0))
attempt("unshare a user namespace", lambda: call("unshare", 0x10000000))
attempt("unshare a network namespace", lambda: call("unshare", 0x40000000))
attempt("mount a tmpfs", lambda: call("mount", b"none", b"/usr", b"tmpfs", 0, None))
attempt("chroot", lambda: os.chroot("/tmp"))
attempt("ptrace pid 1", lambda: call("ptrace", 16, 1, 0, 0))
if platform.machine() == "x86_64":  # bpf, io_uring_setup, keyctl: denied by the seccomp policy
    for name, nr in (("bpf", 321), ("io_uring_setup", 425), ("keyctl", 250)):
        attempt(name, lambda: call("syscall", nr, 0, 0, 0))
def capabilities():
    caps = [line for line in open("/proc/self/status") if line.startswith("CapEff")][0].split()[1]
    if int(caps, 16) == 0:
        raise PermissionError("no effective capability")
    return caps
attempt("hold a capability", capabilities)
'''


def _network_attempts() -> str:
    return '''
import socket
def unix_abstract():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\\0" + T["abstract"])
    return s
attempt("connect to the trainer's 127.0.0.1 server", lambda: socket.create_connection(("127.0.0.1", \
T["port"]), 1))
attempt("connect to the trainer's abstract unix socket", unix_abstract)
attempt("connect out", lambda: socket.create_connection(("1.1.1.1", 53), 1))
attempt("send a datagram out", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", \
("8.8.8.8", 53)))
attempt("resolve a name", lambda: socket.getaddrinfo("pypi.org", 443))
'''


def _proc_snooping() -> str:
    return '''
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
print("PIDS", pids)
for pid in pids:
    for what in ("environ", "cmdline"):
        try:
            print(pid, what, open(f"/proc/{pid}/{what}", "rb").read())
        except OSError as exc:
            print(pid, what, exc)
print("SELF", open("/proc/self/environ", "rb").read())
attempt("read the trainer's environ", lambda: open(f"/proc/{T['trainer']}/environ").read())
attempt("see the trainer's pid", lambda: os.stat(f"/proc/{T['trainer']}"))
'''


SETSID_ESCAPE = '''
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.setsid()
        time.sleep(1)
        open(os.path.join(T["base"], "daemon-was-here"), "w").write("x")
        os._exit(0)
    os._exit(0)
time.sleep(0.2)
'''

ATTACKS = [
    Attack("write outside its folder", _write_attempts(), ("ok",)),
    Attack("read files outside the jail", _read_attempts(), ("ok",)),
    Attack("signal the trainer and its processes", _signal_attempts(), ("ok",)),
    Attack("gain privileges", _privilege_attempts(), ("ok",)),
    Attack("reach the network", _network_attempts(), ("ok",)),
    Attack("snoop in /proc", _proc_snooping(), ("ok",), check=lambda r, t: _proc_problems(r, t)),
    Attack("fork bomb", "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
           ("timeout",), Limits(wall_s=2, cpu_s=10)),
    Attack("memory bomb", "chunks = []\nwhile True:\n    chunks.append(b'x' * (32 << 20))\n", ("error",),
           check=lambda r, t: [] if "MemoryError" in r.stderr else [f"no MemoryError: {r.stderr[-300:]!r}"]),
    Attack("10 GB at once", "attempt('allocate 10 GB', lambda: bytearray(10 << 30))\n", ("ok",)),
    Attack("100 MB of output", "chunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)\n",
           ("error",),
           check=lambda r, t: [] if len(r.stdout) <= (16 << 20) + 4096 else [f"{len(r.stdout)} bytes"]),
    Attack("fill its /tmp and /dev/shm", "for folder in ('/tmp', '/dev/shm'):\n    attempt('fill ' + folder, "
           "lambda: [open(f'{folder}/f{i}', 'wb').write(b'x' * (8 << 20)) for i in range(100)])\n", ("ok",)),
    Attack("sleep past the wall clock", "time.sleep(60)\n", ("timeout",), Limits(wall_s=1.5, cpu_s=10),
           check=lambda r, t: [] if r.seconds < 3.5 else [f"took {r.seconds:.1f}s for a 1.5s limit"]),
    Attack("setsid and double fork, then exit", SETSID_ESCAPE, ("ok",)),
    Attack("setsid and double fork, then hang", SETSID_ESCAPE + "time.sleep(60)\n", ("timeout",),
           Limits(wall_s=1.5, cpu_s=10)),
]


def _proc_problems(result: RunResult, targets: Targets) -> list[str]:
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("PIDS")), "PIDS []")
    pids = json.loads(line[5:])
    problems = [f"sees {len(pids)} processes: {pids}"] if len(pids) > 3 else []
    if "sandbox_attacks" in result.stdout or "pytest" in result.stdout:
        problems.append("saw the trainer's command line")
    return problems


def prepare(base: Path, home: Path, repo: Path) -> tuple[Targets, Callable[[], None]]:
    """The trainer's files, processes and servers the programs aim at; and what stops them again."""
    token = secrets.token_hex(16)
    targets = Targets(base=str(base), home=str(home), repo=str(repo), token=token, trainer=os.getpid())
    for name, mode in (("secret", 0o600), ("public", 0o644)):
        path = base / name
        path.write_text(token)
        path.chmod(mode)
        setattr(targets, name, str(path))
    targets.home_secret = str(home / ".grpo-attack-secret")
    Path(targets.home_secret).write_text(token)
    os.chmod(targets.home_secret, 0o600)
    targets.write_to = [str(base / "pwned"), str(home / "pwned"), str(repo / "pwned"), "/etc/grpo-pwned",
                        "/usr/lib/grpo-pwned", "/root/grpo-pwned"]
    os.environ["GRPO_ATTACK_SECRET"] = token  # the trainer's environment: must not reach a program
    victim = subprocess.Popen(["sleep", "600"])
    targets.victim = victim.pid
    tcp, abstract = _servers(targets)

    def stop() -> None:
        victim.kill()
        victim.wait()
        tcp.close()
        abstract.close()
        os.environ.pop("GRPO_ATTACK_SECRET", None)

    return targets, stop


def _servers(targets: Targets) -> tuple[socket.socket, socket.socket]:
    """A TCP server on 127.0.0.1 and an abstract unix socket, each recording any connection it accepts."""
    tcp = socket.create_server(("127.0.0.1", 0))
    targets.port = tcp.getsockname()[1]
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    targets.abstract = "grpo-attack-" + targets.token
    abstract.bind("\0" + targets.abstract)
    abstract.listen()

    def serve(server: socket.socket, what: str) -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed by stop()
                return
            targets.accepted.append(what)
            conn.close()

    for server, what in ((tcp, "tcp"), (abstract, "abstract unix socket")):
        threading.Thread(target=serve, args=(server, what), daemon=True).start()
    return tcp, abstract


def run_attack(attack: Attack, targets: Targets, jail: Jail | None = None) -> list[str]:
    """Run one attack (in the default jail unless told); what went wrong (empty: it was contained and left
    nothing behind)."""
    fields = {k: v for k, v in vars(targets).items() if k != "accepted"}  # the program's T
    result = run_python(PRELUDE.format(targets=fields) + attack.program, limits=attack.limits,
                        jail=jail or Jail())
    problems = ([] if result.status in attack.statuses
                else [f"status {result.status} (want {attack.statuses})"])
    output = result.stdout + result.stderr
    problems += [line for line in output.splitlines() if line.startswith("ESCAPED")][:10]
    if targets.token in output:
        problems.append("a secret reached the output")
    problems += _left_behind(result, targets, wait_s=1.2 if "setsid" in attack.name else 0.0)
    if attack.check:
        problems += attack.check(result, targets)
    return problems


def _left_behind(result: RunResult, targets: Targets, wait_s: float) -> list[str]:
    """The trainer's side after the run: its processes, files and servers as they were,
    and no process of the run."""
    ns = next((line.split(" ", 1)[1] for line in result.stdout.splitlines() if line.startswith("NS ")), None)
    problems = [] if ns else ["the program did not report its pid namespace"]
    time.sleep(wait_s)  # a daemon that escaped would write its marker by now
    if ns and (left := processes_in(ns)):
        problems.append(f"processes left in its pid namespace: {left}")
    problems += [f"{path} was written" for path in targets.write_to if os.path.exists(path)]
    if os.path.exists(os.path.join(targets.base, "daemon-was-here")):
        problems.append("an escaped daemon wrote its marker")
    dev_null = os.stat("/dev/null")
    if not stat.S_ISCHR(dev_null.st_mode) or stat.S_IMODE(dev_null.st_mode) != 0o666:
        problems.append(f"/dev/null is now {oct(dev_null.st_mode)}")
    if not _alive(targets.victim):
        problems.append("the victim process was killed")
    if targets.accepted:
        problems.append(f"the trainer's servers accepted: {targets.accepted}")
    if subprocess.run(["true"]).returncode != 0:
        problems.append("the trainer can no longer start a process")
    return problems


def processes_in(ns: str) -> list[int]:
    """Live processes in the pid namespace ``ns`` ("pid:[inode]"), as /proc/<pid>/ns/pid names it. Its init
    may be there as a zombie: it has exited and waits for the host's init to collect its status."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.readlink(f"/proc/{entry.name}/ns/pid") == ns and _alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:  # gone, or another user's
                pass
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] not in "ZX"
    except OSError:
        return False


def run_all(repo: Path, home: Path) -> dict[str, list[str]]:
    """Every attack against fresh targets; {attack: problems}."""
    with tempfile.TemporaryDirectory(prefix="grpo-attacks-") as base:
        targets, stop = prepare(Path(base), home, repo)
        try:
            return {attack.name: run_attack(attack, targets) for attack in ATTACKS}
        finally:
            stop()


if __name__ == "__main__":
    report = run_all(Path(sys.argv[1]), Path(os.environ["HOME"]))
    print(json.dumps({"uid": os.geteuid(), "problems": report}))
