"""A process's resident memory, for the benchmarks that measure it in a fresh subprocess.

Read from /proc/self/status, not ``resource.getrusage(RUSAGE_SELF).ru_maxrss``: Linux folds the peak of the
memory image a process replaces at exec into its ru_maxrss, and Python's subprocess starts children with
vfork + exec, so a child started from a large parent (a pytest session holding models, a benchmark driver)
reports at least the parent's peak. VmHWM is the peak of the process's own memory image only.
"""

from __future__ import annotations


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_rss_bytes() -> int:
    """The peak resident set of this process's own memory image (VmHWM)."""
    return _status_bytes("VmHWM")


def current_rss_bytes() -> int:
    """The resident set now (VmRSS)."""
    return _status_bytes("VmRSS")
