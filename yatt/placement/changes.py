"""What a change of plan moves: the pure diffs between an old plan and a new one.

The executor beside the launcher (``launch.placement.executor``) carries a change out:
staying processes keep their slots (``keep_places``), the moved ones stop and start
(``moved``), and a partial plan's generators are parked and woken instead (``parks``).
"""

from __future__ import annotations

from dataclasses import replace

from yatt.placement.plan import Assignment, Plan, Role

MOVABLE: tuple[Role, ...] = ("generator", "reward")
"""The roles whose processes a change moves between slots without a new trainer group."""


def keep_places(old: Plan, new: Plan) -> Plan:
    """``new`` with its generators and reward workers renumbered so that as many processes as
    possible keep their index and slots: an index whose slots are still in its role's pool
    keeps them; the others take what is left, in order."""
    assignments: list[Assignment] = [a for a in new.assignments if a.role not in MOVABLE]
    for role in MOVABLE:
        before = {a.index: a.slots for a in old.of(role)}
        free = list(new.of(role))
        count = len(free)
        kept: dict[int, Assignment] = {}
        for index in range(count):
            same = next((a for a in free if a.slots == before.get(index)), None)
            if same is not None:
                kept[index] = same
                free.remove(same)
        for index in range(count):
            if index not in kept:
                kept[index] = free.pop(0)
        assignments += [replace(kept[i], index=i) for i in sorted(kept)]
    return replace(new, assignments=tuple(assignments))


def moved(old: Plan, new: Plan) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The processes a change stops and the ones it starts: (role, index) of each, for the
    generators and reward workers whose slots differ (or that exist on one side only)."""
    stop: list[tuple[str, int]] = []
    start: list[tuple[str, int]] = []
    for role in MOVABLE:
        a = {x.index: x.slots for x in old.of(role)}
        b = {x.index: x.slots for x in new.of(role)}
        stop += [(role, i) for i in sorted(a) if b.get(i) != a[i]]
        start += [(role, i) for i in sorted(b) if a.get(i) != b[i]]
    return stop, start


def parks(old: Plan, new: Plan, role: str) -> bool:
    """Whether a change from ``old`` to ``new`` parks (and wakes) the ``role`` processes it
    moves rather than stopping (and starting) them: the generators of a partial plan."""
    return role == "generator" and old.layout == new.layout == "partial"
