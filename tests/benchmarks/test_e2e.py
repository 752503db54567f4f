"""The job-level benchmarks: benchmarks/jobs.py's measuring and metrics arithmetic and
e2e's training FLOPs on hand-computed cases, the TRL job derived from a yatt config (its
dtype), and the quick forms of ``e2e`` (yatt vs TRL) and ``staleness`` end to end, with
bad ``--set`` options refused by field name."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.__main__ import main
from benchmarks.e2e import (
    HELD_OUT,
    JOBS,
    _trl_spec,
    heldout_answers,
    heldout_figures,
    training_flops,
    unmatchable,
)
from benchmarks.jobs import moving_average, reward_at, run_monitored, time_to_reward, training
from launch.config import load_run_config
from launch.placement.inputs import compute_dtype
from tests.benchmarks.test_benchmarks import run_quick
from yatt.rl.data import load_prompt_sets

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


def test_training_flops_count_prompt_and_completion_tokens_of_every_sample() -> None:
    yatt_line = {"samples_per_s": 32.0, "time/step_s": 2.0, "tokens_per_s": 100.0, "time/train_s": 1.0}
    trl_line = {**yatt_line, "train/prompt_tokens": 500.0}
    # yatt: 64 samples x 10 prompt tokens (the mean) + 200 completion tokens; 6 x 1000 params each.
    assert training_flops([yatt_line], params=1000, prompt_tokens=10.0) == pytest.approx(6 * 1000 * (640 + 200))
    # TRL counts its prompt tokens: the mean is not used.
    assert training_flops([trl_line], params=1000, prompt_tokens=10.0) == pytest.approx(6 * 1000 * (500 + 200))
    assert training_flops([yatt_line, trl_line], params=1, prompt_tokens=0.0) == pytest.approx(6 * (200 + 700))
    assert training_flops([], params=1000, prompt_tokens=10.0) == 0


def test_the_trl_job_computes_in_yatt_s_dtype(tiny_model_dir: Path) -> None:
    items = [f"model.path={tiny_model_dir}", "run.steps=3", *JOBS["tiny"]]
    cfg = load_run_config(None, items)
    assert unmatchable(cfg) == []
    spec, prompt_tokens = _trl_spec(cfg, tiny_model_dir, threads=1)
    assert spec.bf16 == (compute_dtype("auto", "cpu") == "bfloat16")
    assert spec.steps == 3 and spec.group_size == 8 and spec.prompts_per_step == 8
    assert 5 < prompt_tokens < 100
    assert not _trl_spec(load_run_config(None, [*items, "model.dtype=float32"]), tiny_model_dir, threads=1)[0].bf16
    problems = unmatchable(load_run_config(None, [*items, "model.dtype=float16", "buffer.filter=all_equal"]))
    assert len(problems) == 2
    assert any("model.dtype = 'float16' computes in float16" in p for p in problems)
    # TRL scores with the digits reward: a job on another reward (the default job's) is refused.
    assert cfg.data.task == "digits"
    other = "reward.scorers=[{kind: custom, function: 'yatt.rl.tasks:repeated_reward'}]"
    [problem] = unmatchable(load_run_config(None, [*items, "data.task=repeated", other]))
    assert problem.startswith("reward.scorers = [('custom', 'yatt.rl.tasks:repeated_reward', 1.0)] (TRL job needs")


def test_the_heldout_evaluator_answers_each_prompt_as_it_would_alone(tiny_model_dir: Path) -> None:
    """Both jobs hold out the same prompts; the evaluator's left-padded batches give every
    prompt the greedy answer it gets in a batch of its own."""
    cfg = load_run_config(None, [f"model.path={tiny_model_dir}", *JOBS["tiny"]])
    train, held = load_prompt_sets(cfg.data, str(tiny_model_dir))
    assert len(held) == HELD_OUT and not {tuple(p.prompt_ids) for p in held} & {tuple(p.prompt_ids) for p in train}
    # Prompts of 13 to 17 tokens (the first token repeated), so the batch pads most of them.
    varied = [dataclasses.replace(p, prompt_ids=p.prompt_ids[:1] * (i % 5) + p.prompt_ids) for i, p in enumerate(held[:10])]
    batched = heldout_answers(tiny_model_dir, varied, max_new_tokens=8, bf16=False)
    alone = [heldout_answers(tiny_model_dir, [p], max_new_tokens=8, bf16=False)[0] for p in varied]
    assert batched == alone and len(set(batched)) > 1  # the untrained model's answers differ by prompt
    assert heldout_figures([1.0, 0.6, 0.0, 1.0]) == {"heldout_reward": pytest.approx(0.65), "heldout_exact": 0.5}


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("layouts=[auto,mixed]", "layouts[1] must be one of 'auto', 'colocated', 'partial', 'disaggregated'"),
        ("layouts=[auto,auto]", "layouts must not repeat a layout"),
        ("layouts=[]", "layouts must name at least one layout"),
        ("repeats=0", "repeats must be >= 1 (got 0)"),
    ],
)
def test_bad_e2e_options_are_refused_with_the_field_named(
    option: str, message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["e2e", "--set", option, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "a refused run must write nothing"


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
    data = run_quick("e2e", tmp_path)  # tiny, 6 steps, placement auto, 1 repeat
    figures, ratios = data["figures"], data["ratios"]
    names = ["samples_per_s", "tokens_per_s", "step_s_median", "training_s", "startup_s", "wall_s", "peak_memory_mb"]
    names += ["train_s_median", "train_gflops_per_s", "mfu"]
    rewards = ["reward_first3", "reward_last3"]
    shared = ["prompt_tokens_saved_per_step", "computed_token_share"]
    heldout = ["heldout_reward", "heldout_exact"]  # each final model, and the initial one, on the held-out prompts
    sides = ("yatt_auto", "trl")
    assert set(figures) == {"peak_gflops"} | {f"tiny_{side}_{n}" for side in (*sides, "initial") for n in heldout} | {
        f"tiny_{side}_{n}" for side in sides for n in names + rewards + shared
    }
    for side in (*sides, "initial"):
        assert 0 <= figures[f"tiny_{side}_heldout_exact"] <= figures[f"tiny_{side}_heldout_reward"] <= 1
    assert any(note.startswith("tiny auto: held-out reward (exact share) per repeat") for note in data["notes"])
    # TRL computes every row's prompt; yatt computes each group's once where that pays.
    assert figures["tiny_trl_prompt_tokens_saved_per_step"] == 0 and figures["tiny_trl_computed_token_share"] == 1
    assert 0 < figures["tiny_yatt_auto_computed_token_share"] <= 1
    assert set(ratios) == {f"tiny_auto_{r}_vs_trl" for r in ("samples_per_s", "time_to_reward", "memory")}
    _finite(data)
    assert figures["peak_gflops"] > 0
    for side in sides:
        for n in names:
            assert figures[f"tiny_{side}_{n}"] > 0, f"tiny_{side}_{n}"
        # Training is inside the job: startup + training < the whole job.
        assert figures[f"tiny_{side}_startup_s"] + figures[f"tiny_{side}_training_s"] < figures[f"tiny_{side}_wall_s"]
        # 6 steps of 64 samples, each at most 8 completion tokens.
        samples = figures[f"tiny_{side}_samples_per_s"] * figures[f"tiny_{side}_training_s"]
        tokens = figures[f"tiny_{side}_tokens_per_s"] * figures[f"tiny_{side}_training_s"]
        assert samples == pytest.approx(6 * 64)
        assert 6 * 64 <= tokens <= 6 * 64 * 8 + 1e-6
        assert figures[f"tiny_{side}_mfu"] == pytest.approx(
            figures[f"tiny_{side}_train_gflops_per_s"] / figures["peak_gflops"]
        )
        assert figures[f"tiny_{side}_mfu"] < 1
    # One repeat: each ratio is the ratio of the two runs' figures.
    for ratio, figure in (("samples_per_s", "samples_per_s"), ("memory", "peak_memory_mb")):
        assert ratios[f"tiny_auto_{ratio}_vs_trl"] == pytest.approx(
            figures[f"tiny_yatt_auto_{figure}"] / figures[f"tiny_trl_{figure}"]
        )
    if ratios["tiny_auto_time_to_reward_vs_trl"] == 0:
        assert any("never reached" in note for note in data["notes"])
    assert any(note.startswith("tiny: placement auto picked ") for note in data["notes"])
    plot = data["plots"]["tiny_reward"]
    assert (tmp_path / plot["png"]).stat().st_size > 0
    assert [s["label"] for s in plot["series"]] == ["yatt auto", "TRL"]
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


@pytest.mark.slow
def test_vlm_quick_measures_yatt_and_trl_on_the_same_pictures(tmp_path: Path) -> None:
    data = run_quick("vlm", tmp_path)  # the vision example's job, 4 steps, placement auto, 1 repeat
    figures, ratios = data["figures"], data["ratios"]
    assert {f"vlm_{side}_samples_per_s" for side in ("yatt_auto", "trl")} <= set(figures)
    assert set(ratios) == {f"vlm_auto_{r}_vs_trl" for r in ("samples_per_s", "time_to_reward", "memory")}
    _finite(data)
    for side in ("yatt_auto", "trl"):  # 4 steps of 16 pictures x 8 answers each
        samples = figures[f"vlm_{side}_samples_per_s"] * figures[f"vlm_{side}_training_s"]
        assert samples == pytest.approx(4 * 128)
        assert figures[f"vlm_{side}_peak_memory_mb"] > 0
    assert ratios["vlm_auto_memory_vs_trl"] == pytest.approx(
        figures["vlm_yatt_auto_peak_memory_mb"] / figures["vlm_trl_peak_memory_mb"]
    )
