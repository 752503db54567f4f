"""The run's plan as a file: ``<run_dir>/plan.json``, and each role's share of it.

The launcher asks ``launch.placement.inputs.make_plan`` for the plan before it starts
anything, writes it here (``write_plan``) and prints it (``describe``); every role process
reads its own assignment back (``assignment_for``) and pins itself to its cores (``pin``)
before it loads a model. The planner (``yatt.placement``) never imports this module.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from launch.config import RunConfig
from yatt.placement.plan import Assignment, Plan, plan_from_json
from yatt.runtime import run_dir as names


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
    (run_dir / names.PLAN).write_text(json.dumps(plan.to_json(), indent=1) + "\n")


def read_plan(run_dir: Path) -> Plan | None:
    """The run's plan, or None for a run launched without one (SLURM places roles by node)."""
    path = run_dir / names.PLAN
    if not path.exists():
        return None
    return plan_from_json(json.loads(path.read_text()))


def world_size_of(plan: Plan | None, configured: int) -> int:
    """The trainer group's ranks: the plan's (a re-planned run can change them), else
    ``configured`` (``trainer.world_size``; a run without a plan)."""
    ranks = len(plan.of("trainer")) if plan is not None else 0
    return ranks or configured


def with_planned_ranks(cfg: RunConfig, plan: Plan | None) -> RunConfig:
    """``cfg`` with ``trainer.world_size`` 0 (the plan picks) set to the plan's rank count, so
    that the run dir's config.yaml, the roles and a resume read a number; else ``cfg``."""
    if cfg.trainer.world_size != 0 or plan is None:
        return cfg
    return replace(cfg, trainer=replace(cfg.trainer, world_size=max(1, len(plan.of("trainer")))))


def assignment_for(plan: Plan | None, role: str, index: int) -> Assignment | None:
    if plan is None:
        return None
    return next((a for a in plan.assignments if a.role == role and a.index == index), None)


def pin(assignment: Assignment | None) -> None:
    """Pin this process to its assignment's cores (a no-op when it has none)."""
    if assignment is not None and assignment.cores:
        os.sched_setaffinity(0, set(assignment.cores))
