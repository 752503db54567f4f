"""The executor of placement: this machine's slots, the run's plan, and each role's share.

The launcher asks ``make_plan`` for the plan before it starts anything (explicit layouts
are assigned; ``auto`` asks the planner), writes it to ``<run_dir>/plan.json`` and prints
it; every role process reads its own assignment back (``assignment_for``) and pins itself
to its cores (``pin``) before it loads a model. The planner (``yatt.placement``) never
imports this module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from launch.config import RunConfig
from yatt.errors import ConfigError
from yatt.placement.layouts import LayoutError, Roles
from yatt.placement.plan import Assignment, ClusterSpec, Plan, plan_from_json

PLAN_FILE = "plan.json"


def roles_of(cfg: RunConfig) -> Roles:
    """How many processes of each role the config asks for."""
    return Roles(
        trainers=cfg.trainer.world_size,
        generators=cfg.run.num_generators,
        rewards=cfg.run.num_rewards,
        controllers=cfg.controller.num_controllers,
        reward_engines=any(s.kind in ("reward_model", "judge") for s in cfg.reward.scorers),
        tensor_parallel=cfg.generator.tensor_parallel,
    )


def make_plan(cfg: RunConfig, cluster: ClusterSpec) -> Plan:
    """The plan of ``cfg.placement.layout`` on ``cluster`` with its predicted step time:
    ``auto`` is the planner's pick; an explicit layout is placed as asked (``ConfigError``
    when it cannot be, or does not fit in memory)."""
    from launch.placement.inputs import plan_for_run

    try:
        return plan_for_run(cfg, cluster)
    except LayoutError as e:
        raise ConfigError(f"placement.layout={cfg.placement.layout}: {e}") from None


def describe(plan: Plan) -> str:
    """The plan as a few lines for the console and the log."""
    lines = [f"placement: {plan.reason}"]
    for a in plan.assignments:
        if not a.slots and a.threads <= 1:
            continue
        where = f"slots {list(a.slots)}" if a.slots else "any core"
        extra = " + generator engine" if a.hosts_generator else ""
        turns = ", takes turns" if a.shared else ""
        lines.append(f"  {a.role}-{a.index}{extra}: {where}, {a.threads} threads{turns}")
    return "\n".join(lines)


def write_plan(plan: Plan, run_dir: Path) -> None:
    (run_dir / PLAN_FILE).write_text(json.dumps(plan.to_json(), indent=1) + "\n")


def read_plan(run_dir: Path) -> Plan | None:
    """The run's plan, or None for a run launched without one (SLURM places roles by node)."""
    path = run_dir / PLAN_FILE
    if not path.exists():
        return None
    return plan_from_json(json.loads(path.read_text()))


def world_size_of(plan: Plan | None, configured: int) -> int:
    """The trainer group's ranks: the plan's (a re-planned run can change them), else
    ``configured`` (``trainer.world_size``; a run without a plan)."""
    ranks = len(plan.of("trainer")) if plan is not None else 0
    return ranks or configured


def assignment_for(plan: Plan | None, role: str, index: int) -> Assignment | None:
    if plan is None:
        return None
    return next((a for a in plan.assignments if a.role == role and a.index == index), None)


def pin(assignment: Assignment | None) -> None:
    """Pin this process to its assignment's cores (a no-op when it has none)."""
    if assignment is not None and assignment.cores:
        os.sched_setaffinity(0, set(assignment.cores))
