"""Custom scorer functions for tests/workers/reward/test_scorers.py.

They live in an importable module (not in the test file) because the reward mix runs
custom scorers in spawned pool processes, which import them by dotted path.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

NOT_A_FUNCTION = 3
"""A module attribute that is not callable, for the bad-path test."""


def length_tenths(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    """len(completion) / 10."""
    return len(completion) / 10


async def async_length_tenths(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    """The async twin of ``length_tenths``."""
    await asyncio.sleep(0)
    return len(completion) / 10


def hang_on_request(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    """Sleeps forever when metadata["hang"] names a file (it first writes its pid there), else 1.0."""
    if "hang" in metadata:
        Path(metadata["hang"]).write_text(str(os.getpid()))
        time.sleep(1000)
    return 1.0


def exit_on_request(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    """Ends its process at once (os._exit, no cleanup) when metadata has "exit", else 1.0."""
    if "exit" in metadata:
        os._exit(int(metadata["exit"]))
    return 1.0


def raise_value_error(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    """Always raises."""
    raise ValueError(f"cannot grade {completion!r}")


def return_text(prompt: str, completion: str, metadata: dict[str, str]) -> str:
    """Returns a string where a float is due."""
    return "high"


def return_nan(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    """Returns NaN, which the mix must not let into a reward."""
    return float("nan")


def never_solved(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    """A task the model never solves: every group's rewards are equal (all 0)."""
    return 0.0


def trl_exact(prompts: list[str], completions: list[str], answer: list[str], **kwargs: object) -> list[float]:
    """TRL's reward-function signature: one score per completion, dataset columns as lists."""
    return [1.0 if c.strip().endswith(a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def trl_needs_solution(prompts: list[str], completions: list[str], solution: list[str]) -> list[float]:
    """A TRL-style function that needs a column the prompts lack."""
    return [0.0 for _ in completions]


def two_arguments(prompt: str, completion: str) -> float:
    """Neither yatt's nor TRL's signature."""
    return 0.0


def fail_sometimes(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    """Raises ZeroDivisionError when the completion says "fail", else 1.0."""
    if completion == "fail":
        return 1 / 0
    return 1.0


def sleep_on_request(prompt: str, completion: str, metadata: dict[str, str]) -> float:
    """Sleeps metadata["sleep"] seconds (0 when absent), then 1.0."""
    time.sleep(float(metadata.get("sleep", "0")))
    return 1.0
