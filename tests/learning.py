"""The one definition of "the default job learned", shared by the local and SLURM runs."""

from __future__ import annotations

import json
from pathlib import Path

from launch.config import load_run_config

ACCURACY = "eval/digits/accuracy"
"""The default job's headline: greedy exact-match accuracy on the held-out sums."""


def assert_default_job_learned(rows: list[dict[str, float]], run_dir: Path) -> None:
    """Every step ran; the held-out exact-match accuracy after the last step is at least 0.1
    above the warm-started policy's before the first (typically ~0.15 -> ~0.35-0.4: 20
    held-out prompts, so 0.1 is two of them); the final Hugging Face export exists."""
    steps = load_run_config(None).run.steps
    assert [int(r["step"]) for r in rows] == list(range(steps))
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [int(e["step"]) for e in evals] == [0, 20, 40]
    start, end = evals[0][ACCURACY], evals[-1][ACCURACY]
    assert end >= start + 0.1, f"held-out accuracy went from {start:.2f} to {end:.2f} ({[e[ACCURACY] for e in evals]})"
    assert (run_dir / "model" / "warm_start.json").exists()
    assert (run_dir / "final" / "config.json").exists()
