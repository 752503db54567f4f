"""The stages benchmark: its interval arithmetic and analysis on hand-written traces
(collectives and pool round trips nested in compute count as framework time; a colocated
rank's generation is a part of its step), and its quick form end to end on a real traced
job in the colocated layout."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.stages import analyse, cpu_between, load_traces, merge, subtract, timeline, union_length
from tests.benchmarks.test_benchmarks import run_quick


def test_union_length_merges_overlaps_and_clips() -> None:
    assert union_length([], 0, 10) == 0
    assert union_length([(1, 3), (2, 5), (7, 8)], 0, 10) == 5  # [1,5] + [7,8]
    assert union_length([(1, 3), (2, 5), (7, 8)], 2.5, 7.5) == pytest.approx(2.5 + 0.5)
    assert union_length([(0, 10), (2, 3)], 4, 6) == 2
    assert union_length([(-5, -1), (11, 12)], 0, 10) == 0


def test_merge_and_subtract_give_sorted_disjoint_intervals() -> None:
    assert merge([(5, 6), (1, 3), (2, 4), (4, 4.5), (7, 7)]) == [(1, 4.5), (5, 6)]
    assert subtract([(0, 10), (11, 15)], [(5, 12), (2, 3)]) == [(0, 2), (3, 5), (12, 15)]
    assert subtract([(0, 4), (2, 6)], [(1, 2), (3, 3.5)]) == [(0, 1), (2, 3), (3.5, 6)]
    assert subtract([(0, 1)], []) == [(0, 1)]
    assert subtract([], [(0, 1)]) == []
    assert subtract([(1, 2)], [(0, 3)]) == []


def test_cpu_between_interpolates_and_refuses_uncovered_windows() -> None:
    samples = [(0.0, 1.0), (1.0, 1.5), (2.0, 3.5)]
    assert cpu_between(samples, 0.5, 1.5) == pytest.approx((1.5 - 1.25) + (2.5 - 1.5))
    assert cpu_between(samples, 0.0, 2.0) == pytest.approx(2.5)
    assert cpu_between(samples, -1.0, 1.0) is None
    assert cpu_between(samples[:1], 0.0, 0.0) is None


def _write(trace_dir: Path, name: str, records: list[dict[str, float | str]]) -> None:
    trace_dir.mkdir(parents=True, exist_ok=True)
    (trace_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _span(kind: str, start: float, duration: float) -> dict[str, float | str]:
    return {"kind": kind, "start": start, "duration": duration}


def test_analyse_a_hand_written_two_role_trace(tmp_path: Path) -> None:
    # Four 1 s steps of trainer-0 at t = 0, 1, 2, 3; skip 1 leaves steps 1 and 2 (the
    # last one holds the final checkpoint): window [1, 3].
    trainer = []
    for k in range(4):
        t = float(k)
        trainer += [
            _span("step", t, 1.0),
            _span("wait_for_buffer", t, 0.5),
            _span("forward_backward", t + 0.5, 0.3),
            _span("optimizer", t + 0.8, 0.1),
            _span("weight_gather", t + 0.9, 0.05),
        ]
    trainer += [{"kind": "_cpu", "start": 0.0, "cpu_s": 0.0}, {"kind": "_cpu", "start": 4.0, "cpu_s": 2.0}]
    trainer.append({"kind": "_process", "cpu_s": 2.0, "wall_s": 4.0})
    # The generator works 0.4 s of each step's wait, overlapping nothing of the trainer.
    generator = [_span("generate", float(k) + 0.05, 0.4) for k in range(4)]
    generator += [_span("weight_load", float(k) + 0.95, 0.02) for k in range(4)]
    _write(tmp_path, "trainer-0", trainer)
    _write(tmp_path, "generator-0", generator)
    _write(tmp_path, "controller-0", [{"kind": "_cpu", "start": 0.0, "cpu_s": 1.0}, {"kind": "_cpu", "start": 4.0, "cpu_s": 1.4}])
    roles = load_traces(tmp_path)
    assert set(roles) == {"trainer-0", "generator-0", "controller-0"}
    stages = analyse(roles, skip=1)
    f = stages.figures
    assert stages.window == (1.0, 3.0) and f["window_steps"] == 2 and f["window_s"] == 2
    assert f["step_s_median"] == 1
    assert f["trainer_0_wait_for_buffer_s_per_step"] == pytest.approx(0.5)
    assert f["trainer_0_forward_backward_s_per_step"] == pytest.approx(0.3)
    assert f["trainer_0_optimizer_s_per_step"] == pytest.approx(0.1)
    assert f["trainer_0_weight_gather_s_per_step"] == pytest.approx(0.05)
    assert f["trainer_0_weight_push_s_per_step"] == 0
    for part in ("generate", "sleep", "wake", "collectives", "checkpoint"):
        assert f[f"trainer_0_{part}_s_per_step"] == 0, part
    assert f["trainer_0_other_s_per_step"] == pytest.approx(0.05)
    assert f["trainer_0_busy_share"] == pytest.approx(0.45)  # waiting is not work
    assert f["trainer_0_cpu_share"] == pytest.approx(0.5)
    assert f["generator_0_generate_s_per_step"] == pytest.approx(0.4)
    assert f["generator_0_busy_share"] == pytest.approx(0.42)
    assert f["generator_0_idle_share"] == pytest.approx(0.58)
    assert f["controller_0_cpu_share"] == pytest.approx(0.1)
    assert "controller_0_busy_share" not in f  # no spans: only its CPU says what it did
    # Compute per step: generate 0.4 + forward/backward 0.3 + optimizer 0.1 (disjoint) = 0.8.
    assert f["framework_overhead_share"] == pytest.approx(0.2)
    assert f["framework_in_compute_share"] == 0
    plot = timeline(roles, stages.steps, 1)
    assert list(plot.rows) == ["generator-0", "trainer-0"]
    assert {s.kind for s in plot.rows["trainer-0"]} == {"wait_for_buffer", "forward_backward", "optimizer", "weight_gather"}
    assert all(0 <= s.start and s.start + s.duration <= 1 + 1e-9 for row in plot.rows.values() for s in row)


def test_collectives_and_pool_round_trips_inside_compute_are_framework_time(tmp_path: Path) -> None:
    # Three 1 s steps; window [1, 2] (skip 1, the last left out). Trainer-0: forward_backward
    # [0.5, 0.8] with a reduce-scatter [0.7, 0.75] inside, optimizer [0.8, 0.9] with an
    # all-reduce [0.82, 0.86] inside. Reward: score [0.1, 0.4], a pool round trip [0.1, 0.3]
    # inside it. Counted as compute before: 0.3 + 0.1 + 0.3 = 0.7 of the 1 s window.
    trainer, reward = [], []
    for k in range(3):
        t = float(k)
        trainer += [
            _span("step", t, 1.0),
            _span("wait_for_buffer", t, 0.5),
            _span("forward_backward", t + 0.5, 0.3),
            _span("reduce_scatter", t + 0.7, 0.05),
            _span("optimizer", t + 0.8, 0.1),
            _span("all_reduce", t + 0.82, 0.04),
        ]
        reward += [_span("score", t + 0.1, 0.3), _span("pool_round_trip", t + 0.1, 0.2)]
    _write(tmp_path, "trainer-0", trainer)
    _write(tmp_path, "reward-0", reward)
    f = analyse(load_traces(tmp_path), skip=1).figures
    # Compute left: forward_backward 0.25 + optimizer 0.06 + score 0.1 = 0.41.
    assert f["framework_overhead_share"] == pytest.approx(1 - 0.41)
    assert f["framework_in_compute_share"] == pytest.approx(0.05 + 0.04 + 0.2)
    assert f["trainer_0_collectives_s_per_step"] == pytest.approx(0.09)
    assert f["trainer_0_forward_backward_s_per_step"] == pytest.approx(0.25)
    assert f["trainer_0_optimizer_s_per_step"] == pytest.approx(0.06)
    assert f["trainer_0_other_s_per_step"] == pytest.approx(0.1)
    assert f["reward_0_pool_round_trip_s_per_step"] == pytest.approx(0.2)
    assert f["reward_0_score_s_per_step"] == pytest.approx(0.3)
    assert "trainer_0_all_reduce_s_per_step" not in f  # in trainer_0_collectives


def test_a_colocated_rank_s_generation_is_a_part_of_its_step(tmp_path: Path) -> None:
    # Colocated: the rank's engine generates [0.05, 0.45] while the rank waits [0, 0.5] for
    # its micro-batches, sleeps [0.5, 0.52], trains [0.52, 0.9] (a collective inside) and
    # wakes [0.9, 0.96] (the all-gather of the new weights inside), all in trainer-0's file.
    trainer = []
    for k in range(3):
        t = float(k)
        trainer += [
            _span("step", t, 1.0),
            _span("wait_for_buffer", t, 0.5),
            _span("generate", t + 0.05, 0.4),
            _span("sleep", t + 0.5, 0.02),
            _span("forward_backward", t + 0.52, 0.28),
            _span("all_gather", t + 0.55, 0.01),
            _span("optimizer", t + 0.8, 0.1),
            _span("wake", t + 0.9, 0.06),
            _span("all_gather", t + 0.91, 0.04),
        ]
    _write(tmp_path, "trainer-0", trainer)
    f = analyse(load_traces(tmp_path), skip=1).figures
    expected = {
        "generate": 0.4, "wait_for_buffer": 0.1, "sleep": 0.02, "wake": 0.06, "collectives": 0.01,
        "forward_backward": 0.27, "optimizer": 0.1, "weight_gather": 0.0, "weight_push": 0.0, "checkpoint": 0.0,
        "other": 0.04,
    }
    for part, seconds in expected.items():
        assert f[f"trainer_0_{part}_s_per_step"] == pytest.approx(seconds, abs=1e-9), part
    # Compute: generate 0.4 + forward_backward 0.27 + optimizer 0.1; the wake's all-gather
    # is outside compute and changes nothing.
    assert f["framework_overhead_share"] == pytest.approx(1 - 0.77)
    assert f["framework_in_compute_share"] == pytest.approx(0.01)
    assert f["trainer_0_busy_share"] == pytest.approx(0.4 + 0.02 + 0.38 + 0.06)


def test_analyse_refuses_a_trace_without_enough_steps(tmp_path: Path) -> None:
    _write(tmp_path, "trainer-0", [_span("step", 0.0, 1.0), _span("step", 1.0, 1.0)])
    with pytest.raises(ValueError, match="leave none after 2 warm-up steps"):
        analyse(load_traces(tmp_path), skip=2)
    with pytest.raises(ValueError, match="no steps of trainer-0"):
        analyse(load_traces(tmp_path / "missing"), skip=0)


@pytest.mark.slow
def test_stages_quick_on_a_traced_default_job(tmp_path: Path) -> None:
    data = run_quick("stages", tmp_path)
    f = data["figures"]
    assert 0 < f["framework_overhead_share"] < 1
    assert 0 < f["framework_in_compute_share"] < f["framework_overhead_share"]
    assert f["window_steps"] == 4  # 6 steps, 1 warm-up, the last left out
    assert any(note.startswith("layout colocated") for note in data["notes"])
    for role in ("reward_0", "buffer_0", "trainer_0", "trainer_1"):
        assert 0 < f[f"{role}_busy_share"] <= 1, role
        assert f[f"{role}_busy_share"] + f[f"{role}_idle_share"] == pytest.approx(1)
    assert not any(key.startswith("generator_") for key in f)  # colocated: no generator process
    for role in ("controller_0", "controller_1", "trainer_0"):
        assert 0 < f[f"{role}_cpu_share"] <= 1.5, role  # a process may use a bit more than one core
    parts = ("generate", "wait_for_buffer", "sleep", "wake", "weight_gather", "weight_push", "checkpoint",
             "collectives", "forward_backward", "optimizer", "other")
    per_step = sum(f[f"trainer_0_{p}_s_per_step"] for p in parts)
    assert per_step == pytest.approx(f["window_s"] / f["window_steps"], rel=0.1)  # steps run back to back
    for part in ("generate", "sleep", "wake", "collectives", "forward_backward", "optimizer"):
        assert f[f"trainer_0_{part}_s_per_step"] > 0, part
    assert f["trainer_1_generate_s_per_step"] > 0 and f["trainer_1_reduce_scatter_s_per_step"] > 0
    assert f["reward_0_pool_round_trip_s_per_step"] > 0
    for key, value in f.items():
        assert math.isfinite(value) and value >= 0, key
    png = tmp_path / data["plots"]["timeline"]["png"]
    assert png.stat().st_size > 10_000
    assert set(data["plots"]["timeline"]["rows"]) >= {"reward-0", "trainer-0", "trainer-1"}
