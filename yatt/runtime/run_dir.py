"""The run directory's file names, each written once, and the one reader of its JSON lines.

Every process of a run writes into one directory (``runs/<time>/``); the launcher, the
roles, ``launch eval``, ``--resume`` and the benchmarks all read it back, so its names live
here rather than as string literals in each of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG = "config.yaml"
"""The resolved run config (every default filled in); ``--resume`` reads it back."""
PLAN = "plan.json"
"""The placement plan: which role process on which slots (``launch.placement.plan_file``)."""
PLACEMENT = "placement.jsonl"
"""One line per re-planning decision (``launch.placement.adapter``)."""
METRICS = "metrics.jsonl"
"""One line of scalars per step, written by trainer rank 0."""
EVAL = "eval.jsonl"
"""One line per evaluation."""
CURVES = "curves.png"
"""The training reward, held-out accuracy and step time over the steps, drawn at the run's end."""
ROLLOUTS = "rollouts.jsonl"
"""A sample of each step's groups as text."""
EVAL_ROLLOUTS = "eval_rollouts.jsonl"
"""Each evaluation's greedy completions."""
LEDGER = "ledger.db"
"""The buffer's ledger (SQLite in WAL mode: also ``-wal`` and ``-shm`` files beside it)."""
LEDGER_FILES = (LEDGER, f"{LEDGER}-wal", f"{LEDGER}-shm")
LAUNCHER = "launcher.json"
"""The launcher's pid, the registry's endpoint and the trainer group's store port."""
LOGS = "logs"
"""One log per role process (``<role>-<index>.log``)."""
KEYS = "keys"
"""The run's CURVE keys (readable by its user only)."""
CHECKPOINTS = "checkpoints"
"""``step_<k>/`` per checkpoint, complete once its ``done`` marker exists."""
FINAL = "final"
"""The Hugging Face export of the last step's model."""
CONSUMED = "consumed"
"""``trainer-<rank>.jsonl``: per step a rank trained, the group key of each row it trained
(``workers.trainer_rank``); checks exactly-once from the trainer's side."""
TENSORBOARD = "tensorboard"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, blank lines skipped; none when it does not exist."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
