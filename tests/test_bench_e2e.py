"""The job-level benchmarks: benchmarks/jobs.py's measuring and metrics arithmetic on
hand-computed cases, and the quick forms of ``e2e`` (yatt vs TRL) and ``staleness`` end to
end, with bad ``--set`` options refused by field name."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.jobs import moving_average, reward_at, run_monitored, time_to_reward, training
from tests.test_benchmarks import run_quick

# ---------------------------------------------------------------- pure functions


def test_moving_average_is_trailing_and_shorter_at_the_start() -> None:
    assert moving_average([1.0, 2.0, 3.0, 4.0], 3) == [1.0, 1.5, 2.0, 3.0]
    assert moving_average([1.0, 2.0, 3.0], 1) == [1.0, 2.0, 3.0]
    assert moving_average([2.0, 4.0], 5) == [2.0, 3.0]
    assert moving_average([], 3) == []
    with pytest.raises(ValueError, match="window must be >= 1"):
        moving_average([1.0], 0)


def test_time_to_reward_is_the_first_time_at_or_above_the_target() -> None:
    times, rewards = [1.0, 2.0, 3.0, 4.0], [0.1, 0.3, 0.2, 0.4]
    assert time_to_reward(times, rewards, 0.25) == 2.0
    assert time_to_reward(times, rewards, 0.3) == 2.0  # equal counts as reached
    assert time_to_reward(times, rewards, 0.05) == 1.0
    assert time_to_reward(times, rewards, 0.5) is None


def test_reward_at_holds_the_last_value_reached() -> None:
    times, rewards = [1.0, 2.0, 3.0], [0.1, 0.2, 0.3]
    assert reward_at(times, rewards, 1.0) == 0.1
    assert reward_at(times, rewards, 2.5) == 0.2
    assert reward_at(times, rewards, 3.0) == 0.3
    assert reward_at(times, rewards, 10.0) == 0.3
    with pytest.raises(ValueError, match="no point at or before"):
        reward_at(times, rewards, 0.5)


def test_training_window_runs_from_the_first_step_start_to_the_last_step_end() -> None:
    metrics = [
        {"time/unix": 100.0, "time/step_s": 2.0, "samples_per_s": 32.0, "tokens_per_s": 100.0, "reward/mean": 0.1},
        {"time/unix": 103.0, "time/step_s": 1.0, "samples_per_s": 64.0, "tokens_per_s": 300.0, "reward/mean": 0.3},
    ]
    tr = training(metrics)
    assert tr.start_unix == 98.0
    assert tr.duration_s == 5.0
    assert tr.samples == 128.0  # 32 x 2 + 64 x 1
    assert tr.tokens == 500.0  # 100 x 2 + 300 x 1
    assert tr.samples_per_s == pytest.approx(25.6)
    assert tr.tokens_per_s == pytest.approx(100.0)
    assert tr.times_s == [2.0, 5.0]
    assert tr.step_s == [2.0, 1.0]
    assert tr.rewards == [0.1, 0.3]
    with pytest.raises(ValueError, match="no steps"):
        training([])


# ---------------------------------------------------------------- measuring a process tree


def test_run_monitored_counts_the_memory_of_descendants(tmp_path: Path) -> None:
    # The parent only waits; its child holds ~100 MB of touched memory for a second.
    child = "import time; x = bytes(range(256)) * 400_000; time.sleep(1.5)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    measured = run_monitored([sys.executable, "-c", parent], tmp_path / "log", timeout_s=60, what="test job")
    assert measured.peak_memory_mb > 100
    assert measured.wall_s >= 1.5


def test_run_monitored_raises_with_the_log_tail(tmp_path: Path) -> None:
    failing = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)test job failed with exit code 3.*boom"):
        run_monitored(failing, tmp_path / "log", timeout_s=60, what="test job")
    sleeping = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(RuntimeError, match="ran past 1 s"):
        run_monitored(sleeping, tmp_path / "log2", timeout_s=1, what="test job")


# ---------------------------------------------------------------- the quick forms


def _finite(data: dict[str, Any]) -> None:
    for key, value in {**data["figures"], **data["ratios"]}.items():
        assert math.isfinite(value) and value >= 0, f"{key} = {value}"


@pytest.mark.slow
def test_e2e_quick_measures_both_frameworks(tmp_path: Path) -> None:
    data = run_quick("e2e", tmp_path)
    figures, ratios = data["figures"], data["ratios"]
    names = ["samples_per_s", "tokens_per_s", "step_s_median", "training_s", "startup_s", "wall_s", "peak_memory_mb"]
    rewards = ["reward_first3", "reward_last3"]
    assert set(figures) == {f"tiny_{side}_{n}" for side in ("yatt", "trl") for n in names + rewards}
    assert set(ratios) == {"tiny_samples_per_s_vs_trl", "tiny_time_to_reward_vs_trl"}
    _finite(data)
    for side in ("yatt", "trl"):
        for n in names:
            assert figures[f"tiny_{side}_{n}"] > 0, f"tiny_{side}_{n}"
        # Training is inside the job: startup + training < the whole job.
        assert figures[f"tiny_{side}_startup_s"] + figures[f"tiny_{side}_training_s"] < figures[f"tiny_{side}_wall_s"]
        # 6 steps of 64 samples, each at most 8 completion tokens.
        samples = figures[f"tiny_{side}_samples_per_s"] * figures[f"tiny_{side}_training_s"]
        tokens = figures[f"tiny_{side}_tokens_per_s"] * figures[f"tiny_{side}_training_s"]
        assert samples == pytest.approx(6 * 64)
        assert 6 * 64 <= tokens <= 6 * 64 * 8 + 1e-6
    assert ratios["tiny_samples_per_s_vs_trl"] == pytest.approx(
        figures["tiny_yatt_samples_per_s"] / figures["tiny_trl_samples_per_s"]
    )
    if ratios["tiny_time_to_reward_vs_trl"] == 0:
        assert any("never reached" in note for note in data["notes"])
    plot = data["plots"]["tiny_reward"]
    assert (tmp_path / plot["png"]).stat().st_size > 0
    assert [s["label"] for s in plot["series"]] == ["yatt", "TRL"]
    assert all(len(s["x"]) == len(s["y"]) == 6 for s in plot["series"])


@pytest.mark.slow
def test_staleness_quick_measures_each_bound(tmp_path: Path) -> None:
    data = run_quick("staleness", tmp_path)
    figures, ratios = data["figures"], data["ratios"]
    names = ["samples_per_s", "step_s_median", "staleness_mean", "reward_at_equal_time", "reward_final"]
    assert set(figures) == {"equal_time_s"} | {f"staleness_{k}_{n}" for k in (0, 2) for n in names}
    _finite(data)
    for k in (0, 2):
        assert figures[f"staleness_{k}_samples_per_s"] > 0
        assert figures[f"staleness_{k}_step_s_median"] > 0
    assert figures["equal_time_s"] > 0
    assert figures["staleness_0_staleness_mean"] == 0
    assert 0 <= figures["staleness_2_staleness_mean"] <= 2
    assert ratios["staleness_2_samples_per_s_vs_0"] == pytest.approx(
        figures["staleness_2_samples_per_s"] / figures["staleness_0_samples_per_s"]
    )
    if figures["staleness_0_reward_at_equal_time"] > 0:
        assert set(ratios) == {"staleness_2_samples_per_s_vs_0", "staleness_2_reward_at_equal_time_vs_0"}
        assert ratios["staleness_2_reward_at_equal_time_vs_0"] == pytest.approx(
            figures["staleness_2_reward_at_equal_time"] / figures["staleness_0_reward_at_equal_time"]
        )
    plot = data["plots"]["reward"]
    assert (tmp_path / plot["png"]).stat().st_size > 0
    assert [s["label"] for s in plot["series"]] == ["max_staleness=0", "max_staleness=2"]
