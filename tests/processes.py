"""Waiting for processes the tests expect to die (``/proc``: Linux)."""

from __future__ import annotations

import time
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0]
    except (OSError, IndexError):
        return False
    return "zombie" not in state.lower()


def assert_gone(pids: list[int], what: str, timeout: float = 30.0) -> None:
    """Wait until none of ``pids`` runs; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"{what}: {[p for p in pids if alive(p)]} still running"
        time.sleep(0.05)
