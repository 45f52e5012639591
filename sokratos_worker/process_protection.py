"""Keep the worker's environment and memory from the processes it starts.

A child running as the worker's OS user could read ``/proc/WORKER_PID/environ`` (the database
URL with its password, API keys as set at start) and ``/proc/WORKER_PID/mem``, and attach a
debugger. The local model server parses a model file and answers HTTP from anyone on the host,
so it is started only after the worker marks itself non-dumpable: the kernel then owns those
files by root and refuses other processes of the same user (``ptrace_may_access``). Root (and
``CAP_SYS_PTRACE``) still may. The cost: no core dumps of the worker, and a debugger or
``py-spy`` must run as root.

The worker itself keeps reading what it reads from /proc: its own ``fd``, ``net/tcp``,
``status`` and the children's files. Its own mode-0400 files (``/proc/self/environ``, ``io``,
``auxv``, ``mem``) and its ``fd`` directory become root's for other processes (``ls
/proc/PID/fd`` or ``lsof`` by its user is refused); nothing in the worker needs them there.
"""

from __future__ import annotations

import ctypes
import sys
import threading

import structlog

log = structlog.get_logger(__name__)

_PR_SET_DUMPABLE = 4  # <linux/prctl.h>

_warned = threading.Event()  # the warning is said once per process, not at every restart


def _prctl(option: int, value: int = 0) -> tuple[int, int]:
    """prctl(2) through libc: its result and errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    result = int(libc.prctl(option, value, 0, 0, 0))
    return result, ctypes.get_errno()


def protect_from_same_user() -> bool:
    """Mark this process non-dumpable, so processes of its own user (the children it starts)
    cannot read its environment or memory; False, with a warning logged once, when it cannot."""
    if not sys.platform.startswith("linux"):
        reason = f"not Linux ({sys.platform}): prctl(PR_SET_DUMPABLE) is not available"
    else:
        try:
            result, errno = _prctl(_PR_SET_DUMPABLE, 0)
        except (OSError, AttributeError) as exc:  # no libc, or one without prctl
            reason = f"prctl is not available: {exc}"
        else:
            if result == 0:
                return True
            reason = f"prctl(PR_SET_DUMPABLE, 0) failed: errno {errno}"
    if not _warned.is_set():
        _warned.set()
        log.warning(
            "process_protection_unavailable",
            reason=reason,
            hint="the processes the worker starts, running as its user, can read its"
            " environment (secrets included) through /proc",
        )
    return False


__all__ = ["protect_from_same_user"]
