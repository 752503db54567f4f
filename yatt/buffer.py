"""The buffer role: the dynamic sampling buffer served over ZeroMQ.

It wraps ``SamplingBuffer`` (the decisions, in ``yatt.sampling``) in an actor, and adds
the waiting: a controller's ``PlanRequest`` is a long poll answered when the plan
changes, and a trainer rank's ``MicroBatchRequest`` is answered as soon as its
micro-batch is assembled, so training starts before the step's batch is complete::

    controllers --ScoredGroup--> offer -> Ack{decision}      (ledger written first)
    controllers --PlanRequest--> (wait for a new plan) -> DispatchPlan
    trainer r   --MicroBatchRequest(step, index)--> (wait for the wave) -> MicroBatch
    trainer 0   --PolicyVersion(k+1)--> reopens the window (on-policy mode)
    trainer 0   --Query("checkpoint", dir)--> state + ledger copy into the checkpoint
    anyone      --Query("stats")--> Metrics
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from protocols.messages import (
    Ack,
    DispatchPlan,
    Message,
    Metrics,
    MicroBatch,
    MicroBatchRequest,
    PlanRequest,
    PolicyVersion,
    Query,
    ScoredGroup,
)
from yatt import trace
from yatt.actor import Actor, handles
from yatt.config import BufferConfig
from yatt.errors import ConfigError
from yatt.ledger import Ledger
from yatt.sampling import SamplingBuffer
from yatt.transport import Transport

STATE_FILE = "buffer_state.msgpack"
LEDGER_FILE = "ledger.db"


class Buffer(Actor):
    """Serves the sampling buffer to controllers and trainer ranks."""

    role = "buffer"

    def __init__(
        self,
        transport: Transport,
        *,
        endpoint: str,
        config: BufferConfig,
        num_prompts: int,
        num_shards: int,
        world_size: int,
        seed: int,
        ledger_path: Path,
        resume_from: Path | None = None,
        total_steps: int | None = None,
    ) -> None:
        super().__init__(transport, endpoint=endpoint)
        self.ledger = Ledger(ledger_path, group_commit=True)
        self.core = SamplingBuffer(
            config,
            num_prompts=num_prompts,
            num_shards=num_shards,
            world_size=world_size,
            seed=seed,
            ledger=self.ledger,
            total_steps=total_steps,
        )
        if resume_from is not None:
            self.ledger.restore_from(resume_from / LEDGER_FILE)
            self.core.load(resume_from / STATE_FILE)
        self._changed = asyncio.Condition()
        self._trainer_wait_s = 0.0
        self._controller_wait_s = 0.0
        self._decisions: dict[str, int] = {}
        self._commit: asyncio.Task[None] | None = None

    async def _durable(self) -> None:
        """Return once every decision made so far is committed. Handlers that decided in the
        same turn of the event loop share one commit (one fsync) before any of them replies."""
        if not self.ledger.pending:
            return
        if self._commit is None:
            self._commit = asyncio.get_running_loop().create_task(self._group_commit())
        await asyncio.shield(self._commit)

    async def _group_commit(self) -> None:
        await asyncio.sleep(0)  # let the handlers already woken decide first
        self._commit = None
        with trace.span("ledger_commit"):
            self.ledger.commit()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    @handles(ScoredGroup)
    async def offer(self, msg: ScoredGroup) -> Ack:
        with trace.span("offer"):
            decision = self.core.offer(msg)
        self._decisions[decision] = self._decisions.get(decision, 0) + 1
        await self._durable()  # the ledger has it before anyone hears of it
        await self._notify()
        return Ack(info={"decision": decision})

    @handles(PlanRequest)
    async def plan(self, msg: PlanRequest) -> DispatchPlan:
        if msg.num_shards != self.core.num_shards:
            raise ConfigError(
                f"controller of shard {msg.shard} runs with {msg.num_shards} shards, the buffer with "
                f"{self.core.num_shards}; start every controller from the same config"
            )
        start = time.perf_counter()
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.core.plan_seq > msg.after_seq), timeout=msg.wait_s
                )
            except asyncio.TimeoutError:
                pass  # a long poll: answer with the unchanged plan
        self._controller_wait_s += time.perf_counter() - start
        return DispatchPlan(
            plan_seq=self.core.plan_seq,
            keys=self.core.plan(msg.shard),
            min_policy_version=self.core.min_policy_version,
            step=self.core.step,
        )

    @handles(MicroBatchRequest)
    async def micro_batch(self, msg: MicroBatchRequest) -> MicroBatch:
        if msg.world_size != self.core.world_size:
            raise ConfigError(
                f"trainer rank {msg.rank} runs with world size {msg.world_size}, the buffer with "
                f"{self.core.world_size}; start every rank from the same config"
            )
        # A rank that asks for step k has finished fetching every wave before it, and so
        # have the others (step k-1 ended in a collective): those waves can go.
        for key in [k for k in self.core.ready if k[0] < msg.step]:
            self.core.release(*key)
        start = time.perf_counter()
        async with self._changed:
            await self._changed.wait_for(lambda: self.core.take(msg.step, msg.index, msg.rank) is not None)
        self._trainer_wait_s += time.perf_counter() - start
        batch = self.core.take(msg.step, msg.index, msg.rank)
        assert batch is not None
        return batch

    @handles(PolicyVersion)
    async def version(self, msg: PolicyVersion) -> Ack:
        self.core.publish_version(msg.version)
        await self._durable()
        await self._notify()
        return Ack(seq=msg.version)

    @handles(Query)
    async def query(self, msg: Query) -> Message:
        if msg.what == "stats":
            return Metrics(values=self.stats())
        if msg.what == "checkpoint":
            directory = Path(msg.args["dir"])
            directory.mkdir(parents=True, exist_ok=True)
            self.core.save(directory / STATE_FILE)
            self.ledger.backup_to(directory / LEDGER_FILE)
            return Ack(info={"dir": str(directory)})
        if msg.what == "step_rewards":
            step = int(msg.args["step"])
            rewards = self.core.step_rewards.pop(step, [])
            return Metrics(values={"reward/mean": sum(rewards) / len(rewards) if rewards else float("nan"), "groups": float(len(rewards))})
        raise ValueError(f"buffer: unknown query {msg.what!r}; known: stats, checkpoint, step_rewards")

    def stats(self) -> dict[str, float]:
        """Depth, acceptance, drops by reason and waiting times (the issue's ``stats()``)."""
        s = self.core.stats
        values = {
            "buffer/depth": float(sum(1 for _, accepted in self.core.decided.values() if accepted)),
            "buffer/accepted": float(s.accepted),
            "buffer/stale_dropped": float(s.stale_dropped),
            "buffer/superseded": float(s.superseded),
            "buffer/duplicates": float(s.duplicates),
            "buffer/trained_groups": float(s.trained_groups),
            "buffer/acceptance_ema": self.core.ema,
            "buffer/step": float(self.core.step),
            "buffer/policy_version": float(self.core.version),
            "buffer/trainer_wait_s": self._trainer_wait_s,
            "buffer/controller_wait_s": self._controller_wait_s,
        }
        values.update({f"buffer/filtered/{reason}": float(n) for reason, n in s.filtered.items()})
        return values

    async def on_stop(self) -> None:
        self.ledger.close()
