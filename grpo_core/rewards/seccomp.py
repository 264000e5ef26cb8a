"""The jail's seccomp policy (``grpo_core/rewards/sandbox.py``): system calls a program scored by a reward has
no use for, denied with EPERM, compiled to the BPF program bubblewrap loads (``bwrap --seccomp FD``).

The filter is compiled by libseccomp, the library Flatpak, Docker and systemd build theirs with: it also
handles what a hand-assembled filter tends to miss (a foreign architecture's system calls, x32 numbers on
x86_64: the process is killed). libseccomp's own Python bindings are not on PyPI, so the five calls needed go
through ctypes; the library itself is the system's (Debian's ``libseccomp2``, which apt and systemd depend
on).

The list follows Docker's default profile: what changes the machine rather than the process (modules, kexec,
clocks, swap, quotas, reboot), what reaches other processes (ptrace, process_vm_*, pidfd_getfd), what builds
namespaces or mounts (the jail has built its own and forbids nested user namespaces as well), and the kernel
interfaces most exploits of recent years went through (io_uring, bpf, userfaultfd, perf_event_open, keyrings).
A deny list cannot name system calls a newer kernel adds; the namespaces, not this list, are what keep the
program in.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

from grpo_core.common.errors import ConfigurationError

DENIED = (
    # the machine: modules, kexec, clocks, swap, quotas, accounting, reboot, the kernel log
    "init_module", "finit_module", "delete_module", "create_module", "query_module", "get_kernel_syms",
    "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd",
    "syslog", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "stime", "iopl", "ioperm",
    "vhangup", "_sysctl", "sysfs", "uselib", "ustat", "nfsservctl", "lookup_dcookie", "vm86", "vm86old",
    "modify_ldt",
    # other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "process_madvise", "kcmp",
    # namespaces and mounts
    "unshare", "setns", "mount", "umount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "name_to_handle_at", "open_by_handle_at",
    # kernel interfaces with a record of exploits
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key", "fanotify_init", "personality",
)

# libseccomp's constants (seccomp.h)
_ACT_ALLOW = 0x7FFF0000
_ACT_KILL_PROCESS = 0x80000000
_ACT_ERRNO = 0x00050000
_ATTR_ACT_BADARCH = 2
_NR_UNKNOWN = -1  # __NR_SCMP_ERROR: a name this libseccomp does not know


class SeccompUnavailable(ConfigurationError, RuntimeError):
    """libseccomp cannot be loaded or refused the policy; the message names the library and the package."""


@functools.cache
def deny_filter() -> bytes:
    """The compiled filter: every call in ``DENIED`` fails with EPERM, a foreign architecture's calls kill."""
    lib = _libseccomp()
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise SeccompUnavailable("libseccomp: seccomp_init failed")
    try:
        _check(lib.seccomp_attr_set(ctx, _ATTR_ACT_BADARCH, _ACT_KILL_PROCESS), "seccomp_attr_set")
        for name in DENIED:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr != _NR_UNKNOWN:  # unknown to this libseccomp: not a call of this architecture
                _check(lib.seccomp_rule_add(ctx, _ACT_ERRNO | errno.EPERM, nr, 0),
                       f"seccomp_rule_add({name})")
        return _export(lib, ctx)
    finally:
        lib.seccomp_release(ctx)


def _export(lib: ctypes.CDLL, ctx: int) -> bytes:
    fd = os.memfd_create("grpo-seccomp")
    try:
        _check(lib.seccomp_export_bpf(ctx, fd), "seccomp_export_bpf")
        os.lseek(fd, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _libseccomp() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise SeccompUnavailable(f"libseccomp is not installed ({exc}); it compiles the jail's seccomp "
                                 "policy: apt-get install libseccomp2 (Debian, "
                                 "Ubuntu) or dnf install libseccomp") from exc
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.restype = None
    return lib


def _check(rc: int, call: str) -> None:
    if rc < 0:
        raise SeccompUnavailable(f"libseccomp: {call} failed: {os.strerror(-rc)}")
