"""Environments for the env role's tests (imported by its episode processes, by name)."""

from __future__ import annotations

import os
import socket
import time
from typing import Any


class Counter:
    """Counts its steps (the observation says how many); ends after ``turns``; ``show_pid``:
    its first observation names its process. Its action
    picks a misbehaviour: 'raise', 'hang', 'spin' (burns CPU), 'grab' (allocates 1 GiB
    and keeps it), 'connect:PORT' (opens a TCP connection to this machine's PORT), 'exit' (the process dies)."""

    def __init__(self, turns: int = 3, show_pid: bool = False) -> None:
        self.turns, self.steps, self.seed, self.show_pid = turns, 0, 0, show_pid
        self.kept: list[bytes] = []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.seed = seed or 0
        row = (options or {}).get("row", {})
        pid = f" pid {os.getpid()}" if self.show_pid else ""  # (not deterministic: a rebuilt episode differs)
        return f"seed {self.seed} row {row.get('prompt', '')}{pid}", {}

    def step(self, action: str) -> tuple[str, float | None, bool, bool, dict[str, Any]]:
        if action == "raise":
            raise ValueError("the action was 'raise'")
        if action == "hang":
            time.sleep(3600)
        if action == "spin":
            while True:
                pass
        if action == "grab":
            self.kept.append(bytearray(1 << 30))  # type: ignore[arg-type]
        if action.startswith("connect:"):  # connect:PORT, on this machine
            socket.create_connection(("127.0.0.1", int(action.partition(":")[2])), timeout=2).close()
            return "connected", None, False, False, {}
        if action == "exit":
            os._exit(3)
        self.steps += 1
        done = self.steps >= self.turns
        return f"step {self.steps} of seed {self.seed}: {action}", float(self.steps) if done else None, done, False, {}


class SavedCounter(Counter):
    """A Counter with ``snapshot()``/``restore(state)``: its step count saved as text."""

    def snapshot(self) -> bytes:
        return f"{self.seed} {self.steps}".encode()

    def restore(self, state: bytes) -> None:
        seed, steps = state.decode().split()
        self.seed, self.steps = int(seed), int(steps)
