"""The definition of "the default job learned" (``tests/learning.py``) and the launcher's
last line, on hand-made runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.progress import finish_line
from tests.learning import assert_default_job_learned, assert_learned


def fake_run(run_dir: Path, rewards: list[float], accuracy: tuple[float, float], prompts: int = 20) -> list[dict[str, float]]:
    """A finished run of ``len(rewards)`` steps evaluated at its start, half-way and end on
    ``prompts`` held-out prompts, its accuracy going ``accuracy[0]`` -> ``accuracy[1]``."""
    steps = len(rewards)
    rows = [{"step": float(i), "reward/mean": r} for i, r in enumerate(rewards)]
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "final").mkdir()
    (run_dir / "model" / "warm_start.json").write_text("{}")
    (run_dir / "final" / "config.json").write_text("{}")
    (run_dir / "config.yaml").write_text(f"run: {{steps: {steps}, eval_every: {steps // 2}}}\ndata: {{eval_split: {prompts}}}\n")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [(0, accuracy[0]), (steps // 2, (accuracy[0] + accuracy[1]) / 2), (steps, accuracy[1])]
    (run_dir / "eval.jsonl").write_text(
        "".join(json.dumps({"step": s, "eval/prompts": prompts, "eval/reward/accuracy": a}) + "\n" for s, a in evals)
    )
    return rows


@pytest.mark.parametrize(
    ("accuracy", "prompts", "learned"),
    [
        ((0.10, 0.25), 200, True),  # +0.15 on 200 prompts
        ((0.14, 0.59), 200, True),  # the default seed here
        ((0.10, 0.245), 200, False),  # +0.145
        ((0.30, 0.30), 200, False),  # flat (the training reward does not count here)
        ((0.10, 0.50), 20, False),  # too few prompts to say
    ],
)
def test_the_default_job_learned_means_held_out_accuracy_rose_on_100_prompts(
    tmp_path: Path, accuracy: tuple[float, float], prompts: int, learned: bool
) -> None:
    rows = fake_run(tmp_path / "run", [0.1 + 0.4 * i / 79 for i in range(80)], accuracy, prompts)
    if learned:
        assert_default_job_learned(rows, tmp_path / "run")
    else:
        with pytest.raises(AssertionError, match="prompts|less than"):
            assert_default_job_learned(rows, tmp_path / "run")
    with pytest.raises(AssertionError):  # a step missing
        assert_default_job_learned(rows[:-1], tmp_path / "run")


@pytest.mark.parametrize(
    ("rewards", "accuracy", "learned"),
    [
        ([0.65] * 20 + [0.72] * 20, (0.30, 0.30), True),  # the training reward rose 0.07 (0.10 on the line)
        ([0.65 + 0.045 * i / 39 for i in range(40)], (0.30, 0.30), True),  # last 10 over first 10 +0.035 only
        ([0.62] * 5 + [0.66] * 35, (0.30, 0.30), False),  # a slow start, then flat: +0.026 on the line
        ([0.65] * 40, (0.15, 0.40), True),  # the held-out accuracy rose 0.25
        ([0.65] * 40, (0.30000001192092896, 0.4000000059604645), True),  # 0.1 in float32 (2 prompts)
        ([0.65] * 20 + [0.66] * 20, (0.30, 0.35), False),  # neither beyond its noise
    ],
)
def test_a_digits_job_learned_means_held_out_accuracy_or_training_reward_rose(
    tmp_path: Path, rewards: list[float], accuracy: tuple[float, float], learned: bool
) -> None:
    rows = fake_run(tmp_path / "run", rewards, accuracy)
    if learned:
        assert_learned(rows, tmp_path / "run")
    else:
        with pytest.raises(AssertionError, match="training reward rose"):
            assert_learned(rows, tmp_path / "run")


def test_the_last_line_says_the_training_reward_and_the_held_out_accuracy(tmp_path: Path) -> None:
    fake_run(tmp_path / "run", [0.6] * 10 + [0.7] * 20 + [0.8] * 10, (0.15, 0.40))
    assert finish_line(tmp_path / "run") == (
        "done: 40 steps trained; training reward 0.60 -> 0.80; held-out greedy accuracy "
        f"(eval/reward/accuracy, eval.jsonl) 0.15 at step 0 -> 0.40 at step 40; model in {tmp_path / 'run' / 'final'}"
    )


def test_a_run_draws_its_curves(tmp_path: Path) -> None:
    """curves.png: the training reward, the held-out accuracy and the step time over the
    steps, named by the last line; a run with no step logged draws nothing."""
    from PIL import Image

    from launch.progress import write_curves

    assert write_curves(tmp_path / "empty") is None
    run = tmp_path / "run"
    fake_run(run, [0.6] * 20 + [0.7] * 20, (0.15, 0.40))
    path = write_curves(run)
    assert path == run / "curves.png"
    with Image.open(path) as image:
        assert image.size == (1300, 360)
    assert finish_line(run).endswith(f"; model in {run / 'final'}; curves in {path}")
