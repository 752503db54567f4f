"""The three layouts as assignments of role processes to slots (``yatt.placement.layouts``)."""

from __future__ import annotations

import pytest

from yatt.errors import LayoutError
from yatt.placement.layouts import Roles, assign, cpu_cluster, gpu_cluster

ROLES = Roles(trainers=2, generators=1, rewards=1, controllers=2)
GIB = 1 << 30


def slots(plan: object, role: str) -> list[tuple[int, ...]]:
    return [a.slots for a in plan.of(role)]  # type: ignore[attr-defined]


def test_colocated_on_cpu_pins_a_rank_per_core_and_hosts_the_engines() -> None:
    plan = assign("colocated", cpu_cluster([4, 5], 8 * GIB), ROLES)
    assert plan.counts() == {"buffer": 1, "reward": 1, "env": 0, "generator": 0, "controller": 2, "trainer": 2}
    assert [(a.slots, a.cores, a.threads, a.shared, a.hosts_generator) for a in plan.of("trainer")] == [
        ((0,), (4,), 1, True, True), ((1,), (5,), 1, True, True)
    ]
    assert all(a.slots == () and a.threads == 1 for a in plan.of("controller") + plan.of("buffer"))


def test_partial_trains_on_every_slot_and_generates_on_a_subset() -> None:
    plan = assign("partial", cpu_cluster([0, 1, 2, 3], 8 * GIB), ROLES)
    assert slots(plan, "generator") == [(0,)] and slots(plan, "trainer") == [(0, 1), (2, 3)]
    assert all(a.shared for a in plan.of("generator") + plan.of("trainer"))
    with pytest.raises(LayoutError, match="at least 2 slots"):
        assign("partial", cpu_cluster([0], 8 * GIB), ROLES)


def test_disaggregated_pins_disjoint_slots_or_shares_too_few_cores() -> None:
    plan = assign("disaggregated", cpu_cluster(list(range(6)), 8 * GIB), ROLES)
    assert slots(plan, "generator") == [(0,)] and slots(plan, "trainer") == [(1, 2), (3, 4, 5)]
    few = assign("disaggregated", cpu_cluster([0, 1], 8 * GIB), ROLES)  # 3 compute processes, 2 cores
    assert all(a.slots == () for a in few.of("generator") + few.of("trainer"))
    assert [a.threads for a in few.of("generator") + few.of("trainer")] == [2, 1, 1]


def test_a_gpu_rank_gets_one_gpu() -> None:
    gpus = gpu_cluster([80 * GIB] * 4, list(range(16)))
    plan = assign("disaggregated", gpus, ROLES)
    assert slots(plan, "generator") == [(0,)] and slots(plan, "trainer") == [(1,), (2,)]  # GPU 3 idle
    assert slots(assign("colocated", gpus, ROLES), "trainer") == [(0,), (1,)]
    tp = assign("disaggregated", gpus, Roles(trainers=2, generators=1, rewards=1, controllers=1, tensor_parallel=2))
    assert slots(tp, "generator") == [(0, 1)]
    with pytest.raises(LayoutError, match="need 5 GPUs; the machine has 4"):
        assign("disaggregated", gpus, Roles(trainers=3, generators=1, rewards=1, controllers=1, tensor_parallel=2))
    with pytest.raises(LayoutError, match="tensor_parallel 1"):
        assign("colocated", gpus, Roles(trainers=2, generators=1, rewards=1, controllers=1, tensor_parallel=2))
    # NCCL runs no two ranks on one GPU (a CPU slot can be shared: gloo)
    one = gpu_cluster([80 * GIB], list(range(16)))
    with pytest.raises(LayoutError, match=r"2 trainer ranks need 2 GPUs.*set trainer.world_size=1"):
        assign("colocated", one, ROLES)
    with pytest.raises(LayoutError, match=r"5 trainer ranks need 5 GPUs.*set trainer.world_size=4"):
        assign("partial", gpus, Roles(trainers=5, generators=1, rewards=1, controllers=1))


def test_env_workers_are_placed_unpinned_like_the_other_movers_in_every_layout() -> None:
    from dataclasses import replace

    for layout in ("colocated", "partial", "disaggregated"):
        plan = assign(layout, cpu_cluster([0, 1, 2, 3], 8 * GIB), replace(ROLES, envs=2))
        assert [(a.index, a.slots, a.threads) for a in plan.of("env")] == [(0, (), 1), (1, (), 1)]
        assert plan.counts()["env"] == 2
