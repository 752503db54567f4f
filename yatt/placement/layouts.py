"""The three layouts as assignments of role processes to device slots (no costs here).

``assign`` turns a layout and the run's role counts into a ``Plan``; the planner
(``planner.py``) predicts each one's step time and picks. On a CPU machine a slot is a
core (``cpu_cluster``); on a GPU machine a GPU with its share of the cores
(``gpu_cluster``)::

    disaggregated  trainer ranks | generators     disjoint slots, asynchronous within
                                                  buffer.max_staleness
    colocated      rank r + its generator engine  one process per slot: generation and
                                                  training take turns (verl's hybrid engine)
    partial        trainer ranks on every slot;   generators (and reward engines) on
                   generators on a subset          disjoint subsets, asleep while training runs

Roles that only move messages (buffer, controllers, rule-based reward workers) are not
pinned and get one thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

from yatt.errors import LayoutError
from yatt.placement.plan import Assignment, ClusterSpec, Layout, Plan, Slot


@dataclass(frozen=True, kw_only=True)
class Roles:
    """How many processes of each role the run asks for."""

    trainers: int
    generators: int
    """Generator processes (disaggregated, partial); the colocated layout has one per rank."""
    rewards: int
    controllers: int
    envs: int = 0
    """Env role processes (episodes' environments out of the controllers)."""
    reward_engines: bool = False
    """The reward workers run a model (reward model or judge) and want slots of their own."""
    tensor_parallel: int = 1
    """Slots one generator spans (vLLM tensor parallelism; GPU only)."""


def cpu_cluster(cores: list[int], memory_bytes: int, *, peak_flops: float = 0.0, slots: int = 0) -> ClusterSpec:
    """One slot per core (``slots`` 0), or ``slots`` slots on the cores in turn (more slots
    than cores time-share them); each slot gets an equal share of the memory. ``peak_flops``
    is one slot's: a core's, times cores / slots when they share."""
    n = slots or len(cores)
    share = memory_bytes // max(1, n)
    made = tuple(Slot(index=i, kind="cpu", memory_bytes=share, cores=(cores[i % len(cores)],)) for i in range(n))
    return ClusterSpec(slots=made, peak_flops=peak_flops)


def slot_share(cluster: ClusterSpec) -> float:
    """The share of its cores' throughput one slot gets (1.0 unless slots time-share cores)."""
    cores = {c for s in cluster.slots for c in s.cores}
    return min(1.0, len(cores) / len(cluster.slots)) if cores and cluster.slots[0].kind == "cpu" else 1.0


def gpu_cluster(memory_bytes: list[int], cores: list[int], *, peak_flops: float = 0.0) -> ClusterSpec:
    """One slot per GPU; the cores are split evenly between them."""
    n = len(memory_bytes)
    per = max(1, len(cores) // max(1, n))
    slots = tuple(
        Slot(index=i, kind="gpu", memory_bytes=m, cores=tuple(cores[i * per : (i + 1) * per]), device=f"cuda:{i}")
        for i, m in enumerate(memory_bytes)
    )
    return ClusterSpec(slots=slots, peak_flops=peak_flops)


def _split(items: list[int], parts: int) -> list[list[int]]:
    """``items`` in ``parts`` contiguous runs as equal as possible (each non-empty when possible)."""
    out: list[list[int]] = []
    start = 0
    for p in range(parts):
        end = start + (len(items) - start) // (parts - p)
        out.append(items[start:max(end, start + 1)] if start < len(items) else items[-1:])
        start = max(end, start + 1)
    return out


def _cores(cluster: ClusterSpec, slots: list[int]) -> tuple[int, ...]:
    return tuple(chain.from_iterable(cluster.slots[s].cores for s in slots))


def _movers(roles: Roles, *, with_rewards: bool) -> list[Assignment]:
    """Buffer, controllers, env workers and (rule-based) reward workers: unpinned, one thread."""
    out = [Assignment(role="buffer", index=0, slots=())]
    if with_rewards:
        out += [Assignment(role="reward", index=i, slots=()) for i in range(roles.rewards)]
    out += [Assignment(role="env", index=i, slots=()) for i in range(roles.envs)]
    out += [Assignment(role="controller", index=i, slots=()) for i in range(roles.controllers)]
    return out


def _trainers(cluster: ClusterSpec, slots: list[int], roles: Roles, *, shared: bool, hosts: bool) -> list[Assignment]:
    """Trainer ranks spread over ``slots``: rank r on its run of slots (several ranks on one
    CPU slot when there are more ranks than slots). A GPU rank computes on one GPU: with
    fewer ranks than GPUs the ranks take the first ones and the rest stay idle; more ranks
    than GPUs is a ``LayoutError``."""
    out = []
    n = roles.trainers
    gpu = cluster.slots[slots[0]].kind == "gpu"
    if gpu and n > len(slots):  # NCCL refuses two ranks on one device ("Duplicate GPU detected")
        raise LayoutError(
            f"{n} trainer ranks need {n} GPUs, one each (NCCL runs no two ranks on one GPU), and "
            f"{len(slots)} {'is' if len(slots) == 1 else 'are'} here: set trainer.world_size={len(slots)}"
        )
    if gpu and n < len(slots):
        slots = slots[:n]
    if n <= len(slots):
        for r, run in enumerate(_split(slots, n)):
            cores = _cores(cluster, run)
            out.append(Assignment(role="trainer", index=r, slots=tuple(run), cores=cores,
                                  threads=max(1, len(cores)), shared=shared, hosts_generator=hosts))
    else:
        for r in range(n):
            s = slots[r * len(slots) // n]
            cores = _cores(cluster, [s])
            out.append(Assignment(role="trainer", index=r, slots=(s,), cores=cores, threads=1,
                                  shared=True, hosts_generator=hosts))
    return out


def assign(layout: Layout, cluster: ClusterSpec, roles: Roles) -> Plan:
    """The plan of ``layout`` for ``roles`` on ``cluster``; raises ``LayoutError`` when
    the layout cannot be placed (e.g. a colocated run with tensor parallelism > 1 slot per rank)."""
    if not cluster.slots:
        raise LayoutError("the cluster has no device slots")
    every = list(range(len(cluster.slots)))
    if layout == "colocated":
        if roles.tensor_parallel > 1:
            raise LayoutError("colocated: a generator hosted by a trainer rank spans its rank's slot only (tensor_parallel 1)")
        reward = _reward_engines(cluster, roles, every) if roles.reward_engines else []
        return Plan(
            layout=layout,
            assignments=tuple(_movers(roles, with_rewards=not roles.reward_engines)
                              + reward + _trainers(cluster, every, roles, shared=True, hosts=True)),
            reason=(f"{roles.trainers} trainer ranks on {len(every)} slots, each hosting a generator engine"
                    if roles.trainers > 1 else f"1 trainer rank on {len(every)} slots, hosting a generator engine"),
        )
    if layout == "partial":
        if len(every) < 2:
            raise LayoutError("partial: needs at least 2 slots (generators and reward engines on a subset)")
        gen_slots = roles.generators * roles.tensor_parallel
        rest = len(every) - gen_slots
        if rest < (1 if roles.reward_engines else 0) or gen_slots < 1 or gen_slots > len(every):
            raise LayoutError(
                f"partial: {roles.generators} generators x {roles.tensor_parallel} slots do not fit on "
                f"{len(every)} slots beside the reward engines"
            )
        gens = [
            Assignment(role="generator", index=g, slots=tuple(run), cores=_cores(cluster, run),
                       threads=max(1, len(_cores(cluster, run))), shared=True)
            for g, run in enumerate(_split(every[:gen_slots], roles.generators))
        ]
        reward = _reward_engines(cluster, roles, every[gen_slots:]) if roles.reward_engines else []
        return Plan(
            layout=layout,
            assignments=tuple(_movers(roles, with_rewards=not roles.reward_engines) + reward + gens
                              + _trainers(cluster, every, roles, shared=True, hosts=False)),
            reason=f"training on all {len(every)} slots; generators on slots {every[:gen_slots]}, asleep while training runs",
        )
    # disaggregated
    gen_slots = roles.generators * roles.tensor_parallel
    reward_slots = roles.rewards if roles.reward_engines else 0
    if gen_slots + reward_slots + roles.trainers > len(every):
        if cluster.slots[0].kind == "gpu":
            raise LayoutError(
                f"disaggregated: {roles.generators} generators x {roles.tensor_parallel} GPUs, {reward_slots} reward "
                f"engines and {roles.trainers} trainer ranks need {gen_slots + reward_slots + roles.trainers} GPUs; "
                f"the machine has {len(every)}"
            )
        # A CPU machine with fewer cores than processes: nothing pinned, each compute role
        # gets its share of the cores as threads (the OS interleaves them).
        cores = _cores(cluster, every)
        gens = [Assignment(role="generator", index=g, slots=(), threads=max(1, len(cores) // roles.generators))
                for g in range(roles.generators)]
        trainers = [Assignment(role="trainer", index=r, slots=(), threads=max(1, len(cores) // roles.trainers))
                    for r in range(roles.trainers)]
        return Plan(
            layout=layout,
            assignments=tuple(_movers(roles, with_rewards=True) + gens + trainers),
            reason=f"{len(every)} cores for {roles.generators + roles.trainers} compute processes: not pinned, "
                   "each gets its share as threads",
        )
    gens = [
        Assignment(role="generator", index=g, slots=tuple(run), cores=_cores(cluster, run),
                   threads=max(1, len(_cores(cluster, run))))
        for g, run in enumerate(_split(every[:gen_slots], roles.generators))
    ]
    reward = _reward_engines(cluster, roles, every[gen_slots:gen_slots + reward_slots]) if roles.reward_engines else []
    trainer_slots = every[gen_slots + reward_slots:]
    return Plan(
        layout=layout,
        assignments=tuple(_movers(roles, with_rewards=not roles.reward_engines) + reward + gens
                          + _trainers(cluster, trainer_slots, roles, shared=False, hosts=False)),
        reason=f"generators on slots {every[:gen_slots]}, trainer ranks on slots {trainer_slots}",
    )


def _reward_engines(cluster: ClusterSpec, roles: Roles, slots: list[int]) -> list[Assignment]:
    """Reward workers that run a model, spread over ``slots``."""
    return [
        Assignment(role="reward", index=i, slots=(s,), cores=_cores(cluster, [s]),
                   threads=max(1, len(_cores(cluster, [s]))), shared=True)
        for i, s in enumerate(slots[i * len(slots) // roles.rewards] for i in range(roles.rewards))
    ]
