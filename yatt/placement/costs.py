"""Stage costs measured by a run: calibrate the planner's FLOP-based estimate with the
per-step metrics a finished (or running) run wrote.

The planner needs costs per slot; a run measures seconds per step on the slots it had. So
each measured stage is compared with what the cost model predicts for that run's slots, and
the estimate's costs of that stage are scaled by the ratio::

    completion_mean  = median(tokens_per_s / samples_per_s)      (trained tokens are completions)
    acceptance       = the last buffer/acceptance_ema
    weight_sync_s    = median(time/weight_sync_s)
    train            x= median(time/train_s) / T(train_slots)    train_token_s and train_fixed_s
    generation       x= median(time/wait_for_buffer_s) / (G(gen_slots) + tail)
                        on-policy runs only: there the trainer waits for the whole rollout;
                        with max_staleness >= 1 the wait is only what generation failed to hide

The first step is left out when there are more (it pays for warm-up: compilation, the
first weight load). Pure: it takes parsed rows; ``launch.plan`` reads the file. This is the
entry point run-time re-planning will feed each step's times into.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace

from yatt.placement.planner import StageCosts, Workload, stage_times


def _median(rows: Sequence[Mapping[str, float]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if key in r]
    return statistics.median(values) if values else None


def calibrate(
    rows: Sequence[Mapping[str, float]],
    estimate: StageCosts,
    workload: Workload,
    *,
    gen_slots: int,
    train_slots: int,
) -> StageCosts:
    """``estimate`` corrected by the metrics ``rows`` of a run with ``workload`` whose
    generators computed on ``gen_slots`` slots and trainer ranks on ``train_slots``."""
    if len(rows) > 1:
        rows = rows[1:]
    if not rows:
        return estimate
    costs = estimate
    lengths = [r["tokens_per_s"] / r["samples_per_s"] for r in rows if r.get("samples_per_s", 0.0) > 0]
    if lengths:
        mean = statistics.median(lengths)
        costs = replace(costs, completion_mean=mean, completion_p90=max(costs.completion_p90, mean))
    acceptance = rows[-1].get("buffer/acceptance_ema", 0.0)
    if 0 < acceptance <= 1:
        costs = replace(costs, acceptance=acceptance)
    sync = _median(rows, "time/weight_sync_s")
    if sync is not None:
        costs = replace(costs, weight_sync_s=sync)
    gen, tail, train = stage_times(costs, workload, gen_slots=gen_slots, train_slots=train_slots)
    measured_train = _median(rows, "time/train_s")
    if measured_train is not None and measured_train > 0 and train > 0:
        f = measured_train / train
        costs = replace(costs, train_token_s=costs.train_token_s * f, train_fixed_s=costs.train_fixed_s * f)
    rollout = _median(rows, "time/wait_for_buffer_s")
    if workload.max_staleness == 0 and rollout is not None and rollout > 0 and gen + tail > 0:
        f = rollout / (gen + tail)
        costs = replace(costs, gen_token_s=costs.gen_token_s * f, gen_latency_s=costs.gen_latency_s * f)
    return costs
