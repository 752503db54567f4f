"""A checkpoint asked for between the periodic ones (``trainer.checkpoint_every``).

The launcher asks when a re-planned run moves the trainer's slots: the new trainer group
starts from a checkpoint, and waiting for the next periodic one (or for none at all, with
``checkpoint_every=0``) would keep the old group training for nothing. The ask is a file
in the run dir, ``checkpoint_request``, holding the step after which it was made: the
trainer group writes one checkpoint of a later version at the end of the step under way.
Trainer rank 0 reads it once a step and the group agrees in the step's all-reduce, so
every rank saves the same step.
"""

from __future__ import annotations

import os
from pathlib import Path

REQUEST_FILE = "checkpoint_request"


def ask_for_checkpoint(run_dir: Path, after_step: int) -> None:
    """Ask the trainer group for a checkpoint of a version after ``after_step`` (atomic: a
    rank never reads half of it)."""
    part = run_dir / f"{REQUEST_FILE}.part"
    part.write_text(f"{after_step}\n")
    os.replace(part, run_dir / REQUEST_FILE)


def asked_for_checkpoint(run_dir: Path) -> int | None:
    """The step after which a checkpoint is asked for; None when none is (or the file is
    not one this module wrote: ignored, the periodic checkpoints go on)."""
    try:
        return int((run_dir / REQUEST_FILE).read_text())
    except (OSError, ValueError):
        return None


def withdraw_checkpoint_request(run_dir: Path) -> None:
    """The ask is served (or no longer wanted)."""
    (run_dir / REQUEST_FILE).unlink(missing_ok=True)
