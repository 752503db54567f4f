"""A process that dies with its parent: the launcher's roles, its fork server, the reward
worker's scorer processes. And a long-lived process giving back what a start-up phase
freed (``release_freed_memory``).

Linux's ``PR_SET_PDEATHSIG`` has the kernel send SIGKILL when the parent exits, even by
SIGKILL, where no cleanup of the parent's can run. The "parent" is the thread that forked
this process, and a parent that died before the call goes unnoticed: the caller checks
``os.getppid()`` after it. Import-light: the fork server imports this before torch.
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None) -> None:
    """SIGKILL this process when its parent exits; exit now if ``parent`` (the pid it was
    started by; ``None``: the caller checks) is no longer its parent. Does nothing where
    the kernel cannot (not Linux)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != parent:  # it died before the call above
        os._exit(1)


def release_freed_memory() -> int:
    """Collect garbage and hand the heap's free pages back to the OS (glibc's
    ``malloc_trim``): after a phase that allocated and freed much (the launcher's warm start
    and prompt processing), glibc keeps the freed memory in its arenas, counted in the
    process's RSS/PSS for the rest of the run. Returns 1 where memory was released, 0 where
    not (or where the C library has no ``malloc_trim``)."""
    import ctypes
    import gc

    gc.collect()
    if not sys.platform.startswith("linux"):
        return 0
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except AttributeError:  # (musl)
        return 0
    return int(trim(0))
