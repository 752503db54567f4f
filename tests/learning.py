"""The one definition of "the default job learned", shared by the local and SLURM runs."""

from __future__ import annotations

from pathlib import Path

from launch.config import load_run_config


def assert_default_job_learned(rows: list[dict[str, float]], run_dir: Path) -> None:
    """Every step ran, the mean reward of the last 3 steps is >= 3x the first 3's, and the
    final Hugging Face export exists."""
    steps = load_run_config(None).run.steps
    assert [int(r["step"]) for r in rows] == list(range(steps))
    start = sum(r["reward/mean"] for r in rows[:3]) / 3
    end = sum(r["reward/mean"] for r in rows[-3:]) / 3
    assert end >= 3 * start, f"mean reward went from {start:.3f} to {end:.3f}"
    assert (run_dir / "final" / "config.json").exists()
