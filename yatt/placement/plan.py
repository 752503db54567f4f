"""The data of placement: a cluster of device slots, stage costs, and a plan.

A device slot is a GPU on a GPU machine and a set of cores on a CPU machine. A plan says,
for every role process, which slots it runs on and whether it has them to itself or takes
turns with another role there (time-shared). It is plain, frozen data, written to the run
dir as JSON and printed at start, so a later plan (run-time re-planning) can replace it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, Literal

Layout = Literal["colocated", "partial", "disaggregated"]
Role = Literal["buffer", "controller", "env", "generator", "reward", "trainer"]
LAYOUTS: tuple[Layout, ...] = ("colocated", "partial", "disaggregated")


@dataclass(frozen=True, kw_only=True)
class Slot:
    """One device slot."""

    index: int
    kind: Literal["cpu", "gpu"]
    memory_bytes: int
    """Memory the slot's processes may use (GPU memory; on CPU the machine's share)."""
    cores: tuple[int, ...] = ()
    """CPU cores of the slot (pinned with os.sched_setaffinity); on GPU, the cores beside it."""
    device: str = "cpu"
    """torch device of the slot: cpu, or cuda:i."""


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """The slots a run may use."""

    slots: tuple[Slot, ...]
    peak_flops: float = 0.0
    """Measured dense bf16 matmul FLOP/s of one slot (0: unknown)."""


@dataclass(frozen=True, kw_only=True)
class Assignment:
    """One role process and where it runs."""

    role: Role
    index: int
    slots: tuple[int, ...]
    """Slot indices it computes on (empty: it only moves messages; any core)."""
    cores: tuple[int, ...] = ()
    """CPU cores it is pinned to (empty: not pinned)."""
    threads: int = 1
    """Compute threads (OMP_NUM_THREADS) while it runs."""
    shared: bool = False
    """True when it takes turns on its slots with another role (sleeps while that one runs)."""
    hosts_generator: bool = False
    """trainer ranks of the colocated layout: the rank also serves a generator engine."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Where every role process of a run runs, and what the planner predicts of it."""

    layout: Layout
    assignments: tuple[Assignment, ...]
    predicted_step_s: float = 0.0
    """Predicted seconds per training step (0: not predicted)."""
    idle_share: dict[int, float] = field(default_factory=dict)
    """Predicted share of a step each slot sits idle."""
    reason: str = ""
    """Why this plan (the planner's one-line summary)."""

    def of(self, role: str) -> list[Assignment]:
        """The assignments of one role, by index."""
        return list(self._by_role.get(role, ()))

    @cached_property
    def _by_role(self) -> dict[str, tuple[Assignment, ...]]:
        """Assignments grouped by role, by index (the planner asks for them thousands of times at 1024 slots)."""
        out: dict[str, list[Assignment]] = {}
        for a in self.assignments:
            out.setdefault(a.role, []).append(a)
        return {role: tuple(sorted(group, key=lambda a: a.index)) for role, group in out.items()}

    def counts(self) -> dict[str, int]:
        """Processes per role, in start order (generators hosted by trainer ranks are not processes)."""
        order = ("buffer", "reward", "env", "generator", "controller", "trainer")
        return {role: len(self.of(role)) for role in order}

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def plan_from_json(data: dict[str, Any]) -> Plan:
    """The plan ``Plan.to_json`` wrote (``plan.json`` in a run dir)."""
    raw = dict(data)
    assignments = tuple(
        Assignment(**{**a, "slots": tuple(a["slots"]), "cores": tuple(a["cores"])}) for a in raw.pop("assignments")
    )
    idle = {int(k): float(v) for k, v in raw.pop("idle_share", {}).items()}
    return Plan(assignments=assignments, idle_share=idle, **raw)
