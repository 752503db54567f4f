"""The local launcher's placement of CPU threads: computing roles share the cores, the
rest get one thread; an explicit setting wins."""

from __future__ import annotations

import os

from launch.config import load_run_config
from launch.local import role_threads


def test_threads_share_the_cores_between_computing_roles() -> None:
    cores = len(os.sched_getaffinity(0))
    cfg = load_run_config(None, ["trainer.world_size=2", "run.num_generators=1"])
    assert role_threads(cfg, "generator") == cores
    assert role_threads(cfg, "trainer") == max(1, cores // 2)
    for role in ("buffer", "controller", "reward"):
        assert role_threads(cfg, role) == 1
    many = load_run_config(None, [f"run.num_generators={4 * cores}", f"trainer.world_size={4 * cores}"])
    assert role_threads(many, "generator") == role_threads(many, "trainer") == 1


def test_explicit_threads_win() -> None:
    cfg = load_run_config(None, ["generator.threads=3", "trainer.threads=5"])
    assert role_threads(cfg, "generator") == 3
    assert role_threads(cfg, "trainer") == 5
