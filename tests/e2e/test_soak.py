"""A short soak (the CI version of ``python -m benchmarks faults``' 2,000 steps): 200 steps
of the default job, every role process's open fds flat and no gross memory growth; its
buffer rebuilt from the last checkpoint's snapshot as from the whole ledger."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.faults import replay_cost, soak

pytestmark = pytest.mark.slow


def test_200_steps_leak_no_fds_and_no_gross_memory(tmp_path: Path) -> None:
    usage = soak(tmp_path / "soak", 200, ["placement.layout=disaggregated"])
    assert {"buffer-0", "controller-0", "generator-0", "reward-0", "trainer-0"} <= set(usage), sorted(usage)
    for name, u in usage.items():
        assert u.fds[1] - u.fds[0] <= 2, f"{name} opened fds: {u.fds}"
        assert u.rss_growth < 0.5, f"{name} RSS grew {u.rss_mb[0]:.0f} -> {u.rss_mb[1]:.0f} MiB"
    # Rebuilding the buffer from the snapshot of the checkpoints after steps 200 and 180
    # replays what came after them; the same state as the whole ledger (or replay_cost raises).
    cost = replay_cost(tmp_path / "soak")
    assert cost["snapshot_events"] < cost["previous_events"] < cost["whole_events"] / 5, cost
