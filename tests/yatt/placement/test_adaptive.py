"""Run-time re-planning as a pure function: measured times back to costs, the occupancy of
a generating slot, the moves and what they cost, and the decision rule (margin, payback,
hysteresis) fed by hand-made step times."""

from __future__ import annotations

from dataclasses import replace

import pytest

from yatt.placement.adaptive import (
    Replanner,
    StepTimes,
    SwitchCosts,
    change_cost,
    costs_from_times,
    new_trainer_group,
    pools,
    roles_of_plan,
    slot_moves,
    trainer_slots,
)
from yatt.placement.layouts import Roles, assign, gpu_cluster
from yatt.placement.plan import ClusterSpec, Layout
from yatt.placement.planner import (
    GIB,
    ModelSizes,
    StageCosts,
    Workload,
    gen_token_cost,
    predict,
    with_gen_cost,
)

SIZES = ModelSizes(policy_params=1_000_000, weight_bytes=2, train_bytes=16)
WORK = Workload(groups_per_step=8, group_size=8, max_staleness=1, max_new_tokens=512, prompt_tokens=64,
                max_batch_sequences=16)  # fmt: skip
COSTS = StageCosts(
    gen_token_s=0.001, gen_latency_s=0.004, completion_mean=100, completion_p90=200, acceptance=1.0,
    train_token_s=0.0005, train_fixed_s=0.5, weight_sync_s=0.5, switch_s=1.0, gen_scaling=1.0, train_scaling=1.0,
)  # fmt: skip
SWITCH = SwitchCosts(to_rollout_s=2.0, to_train_s=1.0, reshard_s=4.0)


def gpus(n: int) -> ClusterSpec:
    return gpu_cluster([int(80 * GIB)] * n, list(range(2 * n)), peak_flops=1e15)


def split(generators: int, trainers: int, rewards: int = 1, engines: bool = False) -> Roles:
    return Roles(trainers=trainers, generators=generators, rewards=rewards, controllers=1, reward_engines=engines)


def times(gen: float, train: float, *, reward: float = 0.0, tail: float = 0.4) -> StepTimes:
    return StepTimes(generate_s=gen, tail_s=tail, reward_s=reward, train_s=train, weight_sync_s=0.5,
                     completion_mean=100, completion_p90=200, acceptance=1.0)


def test_a_thin_batch_costs_more_per_token_and_the_inverse_recovers_it() -> None:
    assert gen_token_cost(COSTS, WORK, 16) == pytest.approx(0.001)  # a full batch
    assert gen_token_cost(COSTS, WORK, 1000) == pytest.approx(0.001)  # more than fit: still a full batch
    assert gen_token_cost(COSTS, WORK, 1) == pytest.approx(0.004)  # one sequence alone
    # step of b sequences = 0.004 + (b - 1) * p, p = (0.016 - 0.004) / 15 = 0.0008: at b = 4, 0.0064 / 4
    assert gen_token_cost(COSTS, WORK, 4) == pytest.approx(0.0064 / 4)
    fitted = with_gen_cost(COSTS, WORK, 4, 0.002)
    assert fitted.gen_latency_s == COSTS.gen_latency_s
    assert gen_token_cost(fitted, WORK, 4) == pytest.approx(0.002)
    faster = with_gen_cost(COSTS, WORK, 4, 0.0005)  # below what the latency allows: both scale
    assert gen_token_cost(faster, WORK, 4) == pytest.approx(0.0005) and faster.gen_latency_s < COSTS.gen_latency_s


@pytest.mark.parametrize("layout", ["disaggregated", "partial", "colocated"])
def test_costs_from_times_predict_the_measured_step(layout: Layout) -> None:
    cluster = gpus(8)
    plan = assign(layout, cluster, split(3, 8 if layout != "disaggregated" else 5))
    measured = replace(times(2.0, 3.0), switch_s=1.5 if layout != "disaggregated" else 0.0,
                       weight_sync_s=0.7 if layout != "colocated" else 0.0)
    costs = costs_from_times(measured, COSTS, WORK, plan)
    stages = predict(plan, cluster, SIZES, costs, WORK).stages
    assert stages["train"] == pytest.approx(3.0)
    assert stages["tail"] == pytest.approx(0.4)
    assert stages["generate"] == pytest.approx(2.0)
    if layout != "colocated":
        assert stages["weight_sync"] == pytest.approx(0.7)
    if layout != "disaggregated":
        assert stages["switch"] == pytest.approx(1.5)
    else:  # not measured by a plan that never switches: the estimate stays
        assert costs.switch_s == COSTS.switch_s


def test_the_env_roles_measured_cpu_time_calibrates_its_cost_per_sample() -> None:
    cluster = gpus(8)
    roles = replace(split(3, 5), envs=2)
    plan = assign("disaggregated", cluster, roles)
    costs = costs_from_times(replace(times(2.0, 3.0), env_s=8.0), COSTS, WORK, plan)
    samples = WORK.groups_per_step * WORK.group_size / times(2.0, 3.0).acceptance
    assert costs.env_s == pytest.approx(8.0 / samples)
    cores = len({c for s in cluster.slots for c in s.cores})
    assert predict(plan, cluster, SIZES, costs, WORK).stages["env"] == pytest.approx(8.0 / cores)


def test_slot_moves_keep_every_slot_in_a_pool() -> None:
    roles = split(4, 8, rewards=2, engines=True)
    moves = slot_moves("disaggregated", roles)
    assert {what for _, what in moves} >= {"1 slots generate -> train", "2 slots train -> generate",
                                          "1 slots reward -> train", "1 slots generate -> reward"}
    for option, _ in moves:
        assert option.generators + option.rewards + option.trainers == 14
    for option, _ in slot_moves("partial", roles):
        assert option.trainers == 8 and option != roles
    assert slot_moves("colocated", roles) == []
    tp = replace(roles, tensor_parallel=2)
    assert all(o.generators * 2 + o.rewards + o.trainers == 18 for o, _ in slot_moves("disaggregated", tp))


def test_a_change_pays_for_the_engines_it_starts_and_stops_and_a_reshard() -> None:
    cluster = gpus(8)
    base = assign("disaggregated", cluster, split(2, 5, rewards=1, engines=True))
    to_judge = assign("disaggregated", cluster, split(1, 5, rewards=2, engines=True))
    to_train = assign("disaggregated", cluster, split(1, 6, rewards=1, engines=True))
    assert change_cost(base, base, SWITCH) == 0.0
    # slot 1 stops its generator and starts a judge; the trainer keeps its slots
    assert change_cost(base, to_judge, SWITCH) == pytest.approx(2.0 + 1.0)
    # a generator stops, the trainer group grows
    assert change_cost(base, to_train, SWITCH) == pytest.approx(1.0 + 4.0)
    colocated = assign("colocated", cluster, split(8, 8))
    assert change_cost(base, colocated, SWITCH) == pytest.approx(2.0 + 1.0 + 4.0)


def replanner(plan_roles: Roles, **kw: object) -> Replanner:
    cluster = gpus(8)
    plan = assign("disaggregated", cluster, plan_roles)
    return Replanner(plan, cluster=cluster, sizes=SIZES, costs=COSTS, workload=WORK, switch=SWITCH,
                     layouts=("disaggregated",), smoothing=1.0, **kw)  # type: ignore[arg-type]


def test_one_slow_step_is_noise_a_lasting_shift_moves_slots_after_patience_steps() -> None:
    r = replanner(split(4, 4), patience=3)
    balanced = times(2.0, 1.5)
    assert not r.observe(0, balanced).changed
    d = r.observe(1, times(6.0, 1.5))  # generation slow once
    assert d.best is not None and "train -> generate" in d.best.what and d.streak == 1 and not d.changed
    assert not r.observe(2, balanced).changed and r.streak == 0
    for k in (3, 4):
        assert not r.observe(k, times(6.0, 1.5)).changed
    d = r.observe(5, times(6.0, 1.5))
    assert d.changed and d.reason.startswith("change: ") and "train -> generate" in d.reason
    assert pools(r.plan)["generate"] > 4 and pools(r.plan)["generate"] + pools(r.plan)["train"] == 8
    assert d.metrics()["placement/changed"] == 1.0 and d.metrics()["placement/predicted_gain_s"] > 0
    assert r.streak == 0 and roles_of_plan(r.plan).generators > 4


def test_a_change_that_cannot_pay_back_its_switch_is_not_made() -> None:
    costly = replanner(split(4, 4), patience=1, horizon_steps=20)
    costly.switch = SwitchCosts(to_rollout_s=1000.0, to_train_s=0.0, reshard_s=0.0)
    assert not costly.observe(0, times(6.0, 1.5)).changed
    near_end = replanner(split(4, 4), patience=1)
    assert not near_end.observe(0, times(6.0, 1.5), steps_left=1).changed  # 1 step left to pay 6 s of switch
    assert replanner(split(4, 4), patience=1).observe(0, times(6.0, 1.5), steps_left=20).changed


def test_within_the_margin_the_plan_stays() -> None:
    r = replanner(split(4, 4), patience=1, margin=0.5)
    d = r.observe(0, times(3.0, 1.5))
    assert not d.changed and d.best is None and d.reason.startswith("keep disaggregated")


def test_keep_trainers_offers_only_moves_that_leave_the_trainer_ranks_in_place() -> None:
    free = replanner(split(2, 4, rewards=2, engines=True))
    kept = replanner(split(2, 4, rewards=2, engines=True), keep_trainers=True)
    trainer_slots = [a.slots for a in free.plan.of("trainer")]
    assert any([a.slots for a in m.plan.of("trainer")] != trainer_slots for m in free.neighbours())
    moves = kept.neighbours()
    assert {m.what for m in moves} == {"1 slots generate -> reward", "1 slots reward -> generate"}
    assert all([a.slots for a in m.plan.of("trainer")] == trainer_slots for m in moves)
    # a generation-bound step would move slots to the generators from the trainer: not offered
    d = kept.observe(0, times(6.0, 1.5, reward=0.1))
    assert d.best is None or "train" not in d.best.what


def test_world_sizes_leave_out_trainer_groups_the_micro_batches_cannot_split_over() -> None:
    free = replanner(split(4, 4))
    assert {len(m.plan.of("trainer")) for m in free.neighbours()} >= {2, 3, 5, 6}
    even = replanner(split(4, 4), world_sizes=frozenset({2, 4, 8}))
    sizes = {len(m.plan.of("trainer")) for m in even.neighbours()}
    assert sizes <= {2, 4, 8} and 2 in sizes  # 4 -> 2 (and the generation moves that keep 4)
    d = even.observe(0, times(6.0, 1.5))  # generation-bound: slots go from the trainer, to 2 ranks at most
    assert d.best is not None and len(d.best.plan.of("trainer")) in (2, 4)


def test_a_trainer_move_is_paid_for_by_the_steps_after_the_checkpoint_it_waits_for() -> None:
    """A run carries out a move of the trainer's slots at the checkpoint it asks for, after
    the step under way: the steps until then do not pay for it; the other moves wait for
    nothing."""
    at_once = replanner(split(4, 4), patience=1, horizon_steps=20)
    d = at_once.observe(0, times(6.0, 1.5))
    assert d.changed and d.best is not None and "train -> generate" in d.best.what
    gain = d.predicted_step_s - d.best.predicted_step_s
    assert "x 20 steps" in d.reason
    for waits in (1, 4, 9):
        r = replanner(split(4, 4), patience=1, horizon_steps=20, trainer_wait_steps=waits)
        r.switch = SwitchCosts(to_rollout_s=0.0, to_train_s=0.0, reshard_s=gain * 15)  # paid by 15 steps of gain
        d = r.observe(0, times(6.0, 1.5))
        assert d.changed == (20 - waits > 15), (waits, d.reason)
        if d.best is not None and "train" in d.best.what:
            assert f"x {20 - waits} steps" in d.reason
    judge = replanner(split(2, 4, rewards=2, engines=True), patience=1, horizon_steps=20, trainer_wait_steps=9,
                      keep_trainers=True)
    d = judge.observe(0, times(1.0, 1.5, reward=4.0))  # judging-bound: a generator's slot to the judges
    assert d.changed and d.best is not None and d.best.what == "1 slots generate -> reward" and "x 20 steps" in d.reason


def test_a_layout_change_takes_a_new_trainer_group_and_waits_like_one() -> None:
    """Colocated ranks host engines, disaggregated ones do not: a layout change restarts the
    trainer group (through its checkpoint) even where the ranks would keep their slots."""
    cluster = gpus(8)
    colocated = assign("colocated", cluster, split(8, 8))
    partial = assign("partial", cluster, split(4, 8))
    assert trainer_slots(colocated) == trainer_slots(partial) and new_trainer_group(colocated, partial)
    assert not new_trainer_group(colocated, colocated)
    kept = replanner(split(2, 4, rewards=2, engines=True), keep_trainers=True)
    kept.layouts = ("disaggregated", "colocated")
    assert kept.neighbours() and not any(m.what.startswith("layout") for m in kept.neighbours())
    free = replanner(split(4, 4), patience=1, horizon_steps=20, trainer_wait_steps=3)
    free.layouts = ("disaggregated", "colocated")
    d = free.observe(0, times(0.2, 12.0))  # training-bound: every slot trains, the engines take turns
    assert d.best is not None and d.best.what == "layout disaggregated -> colocated", d.reason
    assert "x 17 steps" in d.reason
