"""A short soak (the CI version of ``python -m benchmarks faults``' 2,000 steps): 200 steps
of the default job, every role process's open fds flat and its RSS growing by less than
``MAX_RSS_MB_PER_STEP`` a step after warm-up; its buffer rebuilt from the last
checkpoint's snapshot as from the whole ledger."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.faults import replay_cost, soak

pytestmark = pytest.mark.slow

STEPS = 200
MAX_RSS_MB_PER_STEP = 0.75
"""MiB a step, from the median RSS of the first tenth of the samples (from step 20 on) to
that of the last (~165 steps later): 124 MiB over the soak. Half a 1.5 MB/step leak (1.43
MiB, ~240 MiB over the soak), which fails it wherever it lands; the 50% relative bound
this replaced let a 360 MiB trainer rank leak 1.1 MiB a step. Undisturbed here: 0.2 MiB a
step at most (trainer-1, glibc's arenas growing in 12 MiB jumps; +2.9% over 2,000 steps)."""


def test_200_steps_leak_no_fds_and_no_memory_per_step(tmp_path: Path) -> None:
    usage = soak(tmp_path / "soak", STEPS, ["placement.layout=disaggregated"])
    assert {"buffer-0", "controller-0", "generator-0", "reward-0", "trainer-0"} <= set(usage), sorted(usage)
    for name, u in usage.items():
        assert u.fds[1] - u.fds[0] <= 2, f"{name} opened fds: {u.fds}"
        assert u.steps[1] - u.steps[0] >= STEPS / 2, f"{name} sampled only between steps {u.steps}"
        assert u.rss_mb_per_step < MAX_RSS_MB_PER_STEP, (
            f"{name} RSS grew {u.rss_mb[0]:.0f} -> {u.rss_mb[1]:.0f} MiB from step {u.steps[0]:.0f} to "
            f"{u.steps[1]:.0f}: {u.rss_mb_per_step:.2f} MiB a step"
        )
    # Rebuilding the buffer from the snapshot of the checkpoints after steps 200 and 180
    # replays what came after them; the same state as the whole ledger (or replay_cost raises).
    cost = replay_cost(tmp_path / "soak")
    assert cost["snapshot_events"] < cost["previous_events"] < cost["whole_events"] / 5, cost
