"""Which role process runs on which node of a SLURM allocation: the pure node placer.

``plan_layout`` places every process of a run on the allocation's nodes in a layout (or
raises ``ConfigError`` with what to ask for); ``placement_plan`` turns that into the run's
``Plan``. The launcher (``launch.slurm``) renders and submits the job from it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

from yatt.errors import ConfigError
from yatt.placement.plan import Assignment, Layout, Plan, Role

HEAVY = ("generator", "trainer")
"""Roles that get their own CPUs (srun --exact) and, on GPU nodes, one GPU per process."""
LAYOUT_NAMES = ("colocated", "partial", "disaggregated")
LIGHT = ("buffer", "reward", "env", "controller")
"""Roles that share the first node's CPUs with everything else (srun --overlap)."""


@dataclass(frozen=True)
class Placement:
    """Which role processes run on which node of the allocation (node 0 runs the head)."""

    nodes: tuple[tuple[tuple[str, int], ...], ...]
    """Per node, its (role, index) processes."""
    gpus_per_node: int
    """GPUs of each node; 0 for CPU nodes."""
    layout: str = "disaggregated"
    """The placement layout (``yatt.placement``): colocated, partial or disaggregated."""

    def node_of(self, role: str, index: int) -> int:
        for n, procs in enumerate(self.nodes):
            if (role, index) in procs:
                return n
        raise KeyError(f"{role}-{index} is not in the plan")

    def heavy_on(self, node: int) -> int:
        """Processes on ``node`` that get their own CPUs (and GPU); partial: the trainer
        ranks (the generators beside them overlap their CPUs)."""
        own = ("trainer",) if self.layout == "partial" else HEAVY
        return sum(role in own for role, _ in self.nodes[node])

    def exclusive(self, role: str) -> bool:
        """Whether ``role``'s steps get their own CPUs (srun --exact) rather than overlap."""
        return role == "trainer" if self.layout == "partial" else role in HEAVY

    def describe(self) -> list[str]:
        """One line per node, e.g. ``node 0: buffer-0 reward-0 controller-0 controller-1 generator-0``."""
        hosted = " (+ generator engine)" if self.layout == "colocated" else ""
        return [
            f"node {n}: " + " ".join(f"{r}-{i}{hosted if r == 'trainer' else ''}" for r, i in procs)
            for n, procs in enumerate(self.nodes)
        ]


def _chunks(items: list[tuple[str, int]], parts: int) -> list[list[tuple[str, int]]]:
    """``items`` in ``parts`` contiguous runs whose sizes differ by at most one."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        end = start + size + (p < extra)
        out.append(items[start:end])
        start = end
    return out


def plan_layout(counts: Mapping[str, int], nodes: int, gpus_per_node: int, layout: str = "disaggregated") -> Placement:
    """Place every process of ``counts`` (role -> processes) on ``nodes`` nodes in ``layout``.

    disaggregated: one node holds everything (one GPU per generator and trainer rank on GPU
    nodes). Several: node 0 holds the buffer, controllers and rewards; generators fill the
    first nodes and trainer ranks the last ones, never sharing a node (a CPU trainer rank
    is slowed by a generator beside it, a GPU one needs its GPU).
    colocated: no generator processes; the trainer ranks, each hosting its engine, spread
    over every node (one GPU each), the light roles on node 0.
    partial: the trainer ranks spread over every node and the generators share their nodes
    (their steps overlap the ranks' CPUs; they sleep while training runs); CPU nodes only.
    Raises ``ConfigError`` with the fix when the nodes or GPUs asked for do not fit the
    run, or leave nodes idle.
    """
    if nodes < 1:
        raise ConfigError(f"--nodes must be >= 1 (got {nodes})")
    if gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node must be >= 0 (got {gpus_per_node})")
    light = [(role, i) for role in LIGHT for i in range(counts[role])]
    gens = [("generator", i) for i in range(counts["generator"])]
    ranks = [("trainer", i) for i in range(counts["trainer"])]
    g = gpus_per_node
    fix = "or lower run.num_generators / trainer.world_size"
    if layout in ("colocated", "partial"):
        return _shared_layout(layout, light, [] if layout == "colocated" else gens, ranks, nodes, g)
    if layout != "disaggregated":
        raise ConfigError(f"placement.layout must be colocated, partial or disaggregated here (got {layout!r})")
    if nodes == 1:
        if g and len(gens) + len(ranks) > g:
            raise ConfigError(
                f"one node with {g} GPUs cannot hold {len(gens)} generators and {len(ranks)} trainer ranks "
                f"(one GPU each): ask for --gpus-per-node {len(gens) + len(ranks)} or --nodes 2, {fix}"
            )
        return Placement(((*light, *gens, *ranks),), g, "disaggregated")
    trainer_nodes = math.ceil(len(ranks) / g) if g else min(len(ranks), nodes - 1)
    gen_nodes = math.ceil(len(gens) / g) if g else min(len(gens), nodes - trainer_nodes)
    used = trainer_nodes + gen_nodes
    if used > nodes:
        raise ConfigError(
            f"{len(gens)} generators and {len(ranks)} trainer ranks at one GPU each need {gen_nodes} + "
            f"{trainer_nodes} nodes of {g} GPUs (generators and trainers never share a node): "
            f"ask for --nodes {used}, {fix}"
        )
    if used < nodes:
        raise ConfigError(
            f"the run fills only {used} of the {nodes} nodes asked for ({len(gens)} generators, "
            f"{len(ranks)} trainer ranks{f', {g} GPUs a node' if g else ''}): ask for --nodes {used}, "
            f"or raise run.num_generators / trainer.world_size to use them"
        )
    return _placement(nodes, g, "disaggregated", light, (gens, 0, gen_nodes), (ranks, gen_nodes, trainer_nodes))


def _placement(
    nodes: int, g: int, layout: str, light: list[tuple[str, int]], *spreads: tuple[list[tuple[str, int]], int, int]
) -> Placement:
    """The light roles on node 0; each (processes, first node, node count) of ``spreads``
    in contiguous runs over its nodes."""
    plan: list[list[tuple[str, int]]] = [[] for _ in range(nodes)]
    plan[0] += light
    for procs, first, count in spreads:
        for n, chunk in enumerate(_chunks(procs, count)):
            plan[first + n] += chunk
    return Placement(tuple(tuple(p) for p in plan), g, layout)


def _shared_layout(
    layout: str, light: list[tuple[str, int]], gens: list[tuple[str, int]], ranks: list[tuple[str, int]],
    nodes: int, g: int,
) -> Placement:
    """colocated / partial: the trainer ranks spread over every node, generators (partial)
    beside them on the same nodes; the light roles on node 0."""
    if layout == "partial" and g:
        raise ConfigError(
            "placement.layout=partial on GPU nodes under SLURM is not supported yet (the generators would "
            "share the trainer ranks' GPUs across job steps); use placement.layout=colocated or disaggregated"
        )
    if g and len(ranks) > nodes * g:
        raise ConfigError(
            f"{len(ranks)} trainer ranks at one GPU each need {math.ceil(len(ranks) / g)} nodes of {g} GPUs: "
            f"ask for --nodes {math.ceil(len(ranks) / g)}, or lower trainer.world_size"
        )
    if len(ranks) < nodes:
        raise ConfigError(
            f"placement.layout={layout} puts trainer ranks on every node: {len(ranks)} ranks fill only "
            f"{len(ranks)} of the {nodes} nodes asked for; ask for --nodes {len(ranks)} or raise trainer.world_size"
        )
    return _placement(nodes, g, layout, light, (gens, 0, nodes), (ranks, 0, nodes))


def placement_plan(placement: Placement, cpus: Sequence[int]) -> Plan:
    """The run's ``Plan`` (plan.json) of a node placement: no cores pinned (srun binds each
    step to its CPUs); a colocated rank hosts its generator engine; the threads of a heavy
    process are its node's share of the CPUs."""
    assignments = []
    for n, procs in enumerate(placement.nodes):
        share = max(1, cpus[n] // max(1, placement.heavy_on(n)))
        for role, index in procs:
            heavy = role in HEAVY
            assignments.append(Assignment(
                role=cast(Role, role), index=index, slots=(), cores=(), threads=share if heavy else 1,
                shared=heavy and placement.layout in ("colocated", "partial"),
                hosts_generator=role == "trainer" and placement.layout == "colocated",
            ))  # fmt: skip
    return Plan(layout=cast(Layout, placement.layout), assignments=tuple(assignments),
                reason=f"{placement.layout} over {len(placement.nodes)} SLURM node(s)")  # fmt: skip
