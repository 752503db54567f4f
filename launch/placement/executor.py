"""A changed plan carried out inside a run, between two steps (``placement.adaptive``).

The replanner (``yatt.placement.adaptive``, fed by ``launch.placement.adapter``) decides;
this module carries its decisions out on the launcher's processes through a small
``Supervisor`` interface (spawn, stop, forget, restart the trainer group), so it never
imports the launcher::

    feed(metrics lines)  -> _replan task: measure the step, decide (beside the watch loop)
    change_plan(plan)    <- a decision (or a test): kept until a step boundary can take it
    at_step_boundary()   <- the watch loop, each turn: carries a pending plan out when it can
        can_go           now: the trainer ranks keep their slots; later: a new trainer group
                         waits for a complete checkpoint after the decision; never: the run's
                         last checkpoint came first
        apply            leaving generators / reward workers stop (a partial plan's
                         generators park), plan.json is rewritten, joining ones start (or
                         wake); a new trainer group restarts from the checkpoint
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from launch.config import RunConfig
from launch.placement.adapter import Adapter
from launch.placement.plan_file import assignment_for, write_plan
from launch.prepare import checkpoint_step, latest_checkpoint
from launch.processes import Proc, signal_group
from protocols.messages import Ack, Query, WorkerInfo
from yatt.errors import PeerLost, RemoteError, RequestTimeout, TransportError
from yatt.placement.adaptive import new_trainer_group
from yatt.placement.changes import keep_places, moved, parks
from yatt.placement.plan import Plan
from yatt.rl.checkpoints import ask_for_checkpoint, withdraw_checkpoint_request
from yatt.runtime.actor import Client
from yatt.runtime.registry import Directory


class Supervisor(Protocol):
    """What the executor needs of the launcher that owns the processes."""

    cfg: RunConfig
    run_dir: Path
    plan: Plan | None
    procs: list[Proc]

    @property
    def world_size(self) -> int: ...

    def spawn(self, role: str, index: int, restarts: int = 0) -> Proc: ...

    async def stop(self, procs: list[Proc]) -> None: ...

    async def forget(self, procs: list[Proc]) -> None: ...

    async def restart_trainers(self, directory: Directory, world_size: int | None = None) -> Path | None: ...


@dataclass
class Parked:
    """A generator of a partial plan that a change took out of the pool: asleep, its
    process kept for a later change that gives its slots back (``parks``)."""

    proc: Proc
    worker: WorkerInfo
    """Its directory entry when it left (the endpoint it still serves on)."""
    slots: tuple[int, ...]


class PlanExecutor:
    """Carries the run's plan changes out on a ``Supervisor``'s processes."""

    def __init__(self, supervisor: Supervisor, *, replan_from: int) -> None:
        self.run = supervisor
        self.adapter: Adapter | None = None
        """Re-plans from each step's measured times (placement.adaptive); None: the plan stays."""
        self.parked: dict[int, Parked] = {}
        """Parked generators by index: out of the pool and the watch, asleep (``parks``)."""
        self.replan_from = replan_from
        """The first step re-planned from: a resumed run's earlier ones were, by the run it resumed."""
        self._decisions: asyncio.Queue[dict[str, float]] = asyncio.Queue()
        self._next_plan: tuple[Plan, str, int] | None = None
        """A re-planned plan to carry out, why, and the step it was decided after."""
        self._task: asyncio.Future[None] | None = None

    def start(self, directory: Directory, adapter: Adapter | None) -> None:
        """Re-plan from now on with ``adapter`` (None: the plan stays)."""
        self.adapter = adapter
        if adapter is not None:
            adapter.settle(self.replan_from)
            self._task = asyncio.ensure_future(self._replan(directory))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.adapter is not None:
            self.adapter.close()

    def feed(self, lines: list[dict[str, float]]) -> None:
        """New metrics lines: each step's times go to the replanner."""
        if self.adapter is not None:
            for line in lines:
                if line["step"] >= self.replan_from:
                    self._decisions.put_nowait(line)

    async def at_step_boundary(self, directory: Directory, *, logged: int) -> int | None:
        """Carry out the pending plan if it can go now (``logged``: the last step with a
        metrics line). Returns the step the trainer group restarted from when the change
        restarted it at a new size (the watch loop reads the metrics from there), else None."""
        pending = self._next_plan
        if pending is None:
            return None
        plan, reason, decided_after = pending
        when = self.can_go(plan, decided_after, logged=logged)
        if when != "later":
            self._next_plan = None  # (a decision made while this one is carried out is kept)
        if when == "never":  # the run's last checkpoint came first
            withdraw_checkpoint_request(self.run.run_dir)
            print(f"yatt: placement: the run ended before its next checkpoint; not carried out: {reason}", flush=True)
        elif when == "now":
            resumed = await self._apply(directory, plan, reason)
            if self.adapter is not None:  # the steps on the new plan warm up first
                self.adapter.settle(resumed if resumed is not None else decided_after + 1)
            return resumed
        return None

    async def _replan(self, directory: Directory) -> None:
        """Feed each step's times to the replanner (beside the watch loop: a stats query may
        wait on a busy worker); a changed plan is carried out by the watch loop."""
        assert self.adapter is not None
        while True:
            line = await self._decisions.get()
            try:
                times = await self.adapter.measure(directory, line)
                if times is None:
                    continue
                plan = self.run.plan
                if (pending := self._next_plan) is not None and plan is not None and new_trainer_group(plan, pending[0]):
                    # The old group still trains: its times would be credited to the new plan.
                    self.adapter.wait(int(line["step"]), times, f"wait for a checkpoint after step {pending[2]}: {pending[1]}")
                    continue
                if self.adapter.warming(int(line["step"]), times):
                    continue
                decision = self.adapter.decide(int(line["step"]), times)
            except Exception as e:  # the run goes on with its plan; the next step re-plans
                print(f"yatt: re-planning after step {int(line['step'])} failed ({e!r}); the plan stays", file=sys.stderr, flush=True)
                continue
            if decision.changed:
                self.change_plan(decision.plan, decision.reason, int(line["step"]))

    def change_plan(self, plan: Plan, reason: str, step: int) -> None:
        """Carry out ``plan`` (decided after ``step``, for ``reason``) at the next step
        boundary it can go at (``can_go``): the replanner's decisions come here."""
        self._next_plan = (plan, reason, step)
        if self.run.plan is not None and new_trainer_group(self.run.plan, plan):
            ask_for_checkpoint(self.run.run_dir, step)  # the new group starts from it

    def can_go(self, plan: Plan, step: int, *, logged: int) -> Literal["now", "later", "never"]:
        """When a re-planned ``plan``, decided after ``step``, can be carried out: at once when
        the trainer ranks keep their slots; a new trainer group goes through a checkpoint, so
        it waits for the first complete one after that step (the one it asked for, or a
        periodic one: nothing trained is thrown away but the step under way), and for the
        metrics line of the checkpoint's step (``logged``: the last step with one; rank 0
        writes it after the checkpoint, and the new group trains from the next step); never
        when that checkpoint is the run's last (nothing left to train)."""
        assert self.run.plan is not None
        if not new_trainer_group(self.run.plan, plan):
            return "now"
        checkpoint = latest_checkpoint(self.run.run_dir)
        if checkpoint is None or checkpoint_step(checkpoint) <= step or logged < checkpoint_step(checkpoint) - 1:
            return "later"
        return "never" if checkpoint_step(checkpoint) >= self.run.cfg.run.steps else "now"

    async def _apply(self, directory: Directory, plan: Plan, reason: str) -> int | None:
        """Carry out a re-planned ``plan`` between two steps: the leaving generators and
        reward workers stop (their in-flight requests are re-issued), the plan is written,
        the joining ones start on their slots. When the trainer ranks move or the layout
        changes, the group restarts at its new size (its ranks hosting engines or not, as
        ``plan.json`` says) from the newest checkpoint (DCP reshards it on load) with the
        buffer rewound to it; returns that checkpoint's step then, else None."""
        run = self.run
        assert run.plan is not None
        plan = keep_places(run.plan, plan)
        stop, start = moved(run.plan, plan)
        regroup = new_trainer_group(run.plan, plan)
        began = time.monotonic()
        if regroup:  # the ranks first: what they train after the checkpoint is thrown away
            for p in run.procs:
                if p.role == "trainer" and p.popen.poll() is None:
                    signal_group(p.popen, signal.SIGKILL)
        leaving = [p for p in run.procs if (p.role, p.index) in stop]
        parked = await self._park(directory, [p for p in leaving if parks(run.plan, plan, p.role)])
        stopping = [p for p in leaving if p not in parked]
        await run.stop(stopping)
        await run.forget(stopping)
        for p in leaving:
            run.procs.remove(p)
        old, layout, before, run.plan = run.plan, run.plan.layout, run.world_size, plan
        write_plan(plan, run.run_dir)
        resumed = None
        if regroup:
            withdraw_checkpoint_request(run.run_dir)
            checkpoint = await run.restart_trainers(directory, world_size=len(plan.of("trainer")))
            resumed = checkpoint_step(checkpoint) if checkpoint is not None else 0
        woken = []
        for role, index in start:
            if parks(old, plan, role) and await self._unpark(directory, index, plan):
                woken.append((role, index))
            else:
                run.procs.append(run.spawn(role, index))
        said = {**{(p.role, p.index): " (parked)" for p in parked}, **{name: " (woken)" for name in woken}}
        stopped, started = (", ".join(f"{r}-{i}{said.get((r, i), '')}" for r, i in pairs) or "none" for pairs in (stop, start))
        if regroup:
            started += f"; trainer group {before} -> {run.world_size} ranks from step {resumed}"
            if plan.layout != layout:
                started += f", {layout} -> {plan.layout}"
        print(f"yatt: placement {reason}; stopped {stopped} ({time.monotonic() - began:.1f} s), started {started}", flush=True)
        return resumed

    async def _park(self, directory: Directory, procs: list[Proc]) -> list[Proc]:
        """Ask each generator of ``procs`` to leave the pool and sleep (``Query("park")``);
        the ones that did, now in ``self.parked`` (the others are stopped instead)."""
        members = {w.meta.get("pid"): w for w in directory.members("generator")}
        done = []
        for p in procs:
            worker = members.get(str(p.popen.pid))
            mine = assignment_for(self.run.plan, "generator", p.index)
            if worker is None or mine is None or not await self._ask(directory, worker, "park"):
                continue
            assert p.index not in self.parked  # a start under its index woke it or stopped it
            self.parked[p.index] = Parked(proc=p, worker=worker, slots=mine.slots)
            done.append(p)
        return done

    async def _unpark(self, directory: Directory, index: int, plan: Plan) -> bool:
        """Bring parked generator ``index`` back into the pool if it sits on the slots ``plan``
        gives that index (``Query("unpark")``; the trainer's weight push wakes it)."""
        parked = self.parked.pop(index, None)
        if parked is None:
            return False
        mine = assignment_for(plan, "generator", index)
        if parked.proc.popen.poll() is None and mine is not None and parked.slots == mine.slots:
            if await self._ask(directory, parked.worker, "unpark"):
                self.run.procs.append(parked.proc)
                return True
        await self.run.stop([parked.proc])
        await self.run.forget([parked.proc])  # in case it registered again before it failed
        return False

    async def _ask(self, directory: Directory, worker: WorkerInfo, what: str) -> bool:
        """``Query(what)`` to ``worker`` on a client of its own (a parking generator leaves the
        directory before it answers); whether it acknowledged."""
        client = Client(directory.transport, worker.endpoint, name="launcher")
        try:
            await client.request(Query(what=what), Ack, timeout=self.run.cfg.transport.request_timeout_s)
        except (PeerLost, RemoteError, RequestTimeout, TransportError) as e:
            print(f"yatt: placement: {worker.actor_id} did not {what} ({e}); it is stopped (and a new process started where the plan has one)", file=sys.stderr, flush=True)
            return False
        finally:
            await client.close()
        return True
