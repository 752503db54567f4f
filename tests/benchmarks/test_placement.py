"""The cluster simulator (``benchmarks/placement.py``): its engine is event by event and
agrees with the closed form where every request fits in one batch; its runs order as they
must (per-step oracle <= best static in hindsight <= every static plan); and the replanner
in the loop moves slots when the judge's cost jumps and finishes sooner than the plan it
started from."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.placement import (
    BATCH,
    WORKLOADS,
    World,
    _engine,
    _sync_pool,
    decode_step_s,
    run,
    run_workload,
)


def test_the_engine_decodes_in_lockstep_and_queues_past_its_batch() -> None:
    t = [float(decode_step_s(b)) for b in range(4)]
    done = _engine(np.array([3, 1, 2]))
    assert done.tolist() == pytest.approx([t[3], t[3] + t[2], t[3] + t[2] + t[1]])
    makespan, _, busy = _sync_pool(np.array([3, 1, 2]), 1)
    assert makespan == pytest.approx(t[3] + t[2] + t[1]) and busy == pytest.approx(makespan)
    # one more request than the batch holds: it starts when the first finishes
    lengths = np.array([1] + [5] * BATCH)
    later = _engine(lengths)
    assert later[0] == pytest.approx(float(decode_step_s(BATCH)))
    assert later.max() > 5 * float(decode_step_s(BATCH))


def test_a_judge_that_turns_slow_moves_slots_to_it_and_adaptive_beats_its_start() -> None:
    world = World(WORKLOADS["judge"], 32, 30, seed=0)
    runs = run_workload(world)
    statics = [runs[k].wall_s for k in ("colocated", "partial", "disaggregated") if k in runs]
    assert runs["oracle"].wall_s <= runs["hindsight"].wall_s <= min(statics)
    adaptive = runs["adaptive"]
    assert adaptive.changes and any("-> reward" in c for c in adaptive.changes)
    assert adaptive.plans[0] == runs["disaggregated"].plans[0]  # the planner's step-0 pick
    assert adaptive.wall_s < runs["disaggregated"].wall_s


def test_the_quick_form_reports_every_policy_of_every_workload() -> None:
    result = run(quick=True)
    for workload in WORKLOADS:
        for policy in ("colocated", "partial", "disaggregated", "hindsight", "oracle", "adaptive"):
            assert result.figures[f"{workload}_16gpu_{policy}_step_s"] > 0
        assert result.ratios[f"{workload}_16gpu_adaptive_vs_best_static"] > 0
        assert f"idle_{workload}_16" in result.plots
    assert not any(k.startswith("calibration") for k in result.figures)  # real runs only in the full form
