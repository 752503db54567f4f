"""The stages benchmark: its interval arithmetic and analysis on a hand-written trace, and
its quick form end to end on a real traced job."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.stages import analyse, cpu_between, load_traces, timeline, union_length
from tests.test_benchmarks import run_quick


def test_union_length_merges_overlaps_and_clips() -> None:
    assert union_length([], 0, 10) == 0
    assert union_length([(1, 3), (2, 5), (7, 8)], 0, 10) == 5  # [1,5] + [7,8]
    assert union_length([(1, 3), (2, 5), (7, 8)], 2.5, 7.5) == pytest.approx(2.5 + 0.5)
    assert union_length([(0, 10), (2, 3)], 4, 6) == 2
    assert union_length([(-5, -1), (11, 12)], 0, 10) == 0


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
    plot = timeline(roles, stages.steps, 1)
    assert list(plot.rows) == ["generator-0", "trainer-0"]
    assert {s.kind for s in plot.rows["trainer-0"]} == {"wait_for_buffer", "forward_backward", "optimizer", "weight_gather"}
    assert all(0 <= s.start and s.start + s.duration <= 1 + 1e-9 for row in plot.rows.values() for s in row)


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
    assert f["window_steps"] == 4  # 6 steps, 1 warm-up, the last left out
    for role in ("generator_0", "reward_0", "buffer_0", "trainer_0", "trainer_1"):
        assert 0 < f[f"{role}_busy_share"] <= 1, role
        assert f[f"{role}_busy_share"] + f[f"{role}_idle_share"] == pytest.approx(1)
    for role in ("controller_0", "controller_1", "generator_0", "trainer_0"):
        assert 0 < f[f"{role}_cpu_share"] <= 1.5, role  # a process may use a bit more than one core
    parts = sum(f[f"trainer_0_{p}_s_per_step"] for p in ("wait_for_buffer", "forward_backward", "optimizer", "weight_gather", "weight_push", "checkpoint", "other"))
    assert parts == pytest.approx(f["window_s"] / f["window_steps"], rel=0.1)  # steps run back to back
    assert f["generator_0_generate_s_per_step"] > 0 and f["trainer_0_forward_backward_s_per_step"] > 0
    for key, value in f.items():
        assert math.isfinite(value) and value >= 0, key
    png = tmp_path / data["plots"]["timeline"]["png"]
    assert png.stat().st_size > 10_000
    assert set(data["plots"]["timeline"]["rows"]) >= {"generator-0", "reward-0", "trainer-0", "trainer-1"}
