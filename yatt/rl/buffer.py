"""The buffer role: the dynamic sampling buffer served over ZeroMQ.

It wraps ``SamplingBuffer`` (the decisions, in ``yatt.rl.sampling``) in an actor, and adds
the waiting: a controller's ``PlanRequest`` is a long poll answered when the plan
changes, and a trainer rank's ``MicroBatchRequest`` is answered as soon as its
micro-batch is assembled, so training starts before the step's batch is complete::

    controllers --ScoredGroup--> offer -> Ack{decision}      (ledger written first)
    controllers --PlanRequest--> (wait for a new plan) -> DispatchPlan
    controllers --TurnRecord--> an episode's finished turn into the ledger -> Ack
    controllers --TurnsRequest--> a group's recorded turns (resuming its episodes) -> TurnRecords
    trainer r   --MicroBatchRequest(step, index)--> (wait for the wave) -> MicroBatch
    trainer 0   --PolicyVersion(k+1)--> reopens the window (on-policy mode)
    trainer 0   --Query("evaluate", version)--> (wait for the round) -> StepReport of eval/*
                (its keys join the controllers' plans; yatt.rl.evaluation)
    trainer 0   --Query("checkpoint", dir)--> the ledger's mark into the checkpoint
    launcher    --Query("rewind", dir)--> back to a checkpoint (a trainer group restarts)
    anyone      --Query("stats")--> Metrics

Its state is rebuilt from the ledger (``SamplingBuffer.replay``: from the snapshot stored
with the last checkpoint's mark, then the events after it) whenever it starts: a buffer
restarted in a run carries on where the ledger ends (undecided and uncommitted groups are
simply offered again by the controllers, whose ``Ack`` never came); a resumed run first
appends a ``rewind`` to the checkpoint's mark. Plan numbers start from a random
base in every incarnation, so a controller's long poll returns at once after a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Callable, Iterator
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
    StepReport,
    TurnRecord,
    TurnRecords,
    TurnsRequest,
)
from yatt.errors import ConfigError, ProtocolError, RunStopped, StorageError
from yatt.rl.config import BufferConfig, EvalConfig
from yatt.rl.evaluation import EvalRound, is_eval
from yatt.rl.ledger import Ledger
from yatt.rl.sampling import SamplingBuffer, pack, step_report, unpack_turn
from yatt.runtime import trace
from yatt.runtime.actor import Actor, handles
from yatt.runtime.transport import Transport

MARK_FILE = "buffer.json"
logger = logging.getLogger(__name__)


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
        num_eval_prompts: int = 0,
        eval_config: EvalConfig | None = None,
        keep_groups: bool = False,
    ) -> None:
        super().__init__(transport, endpoint=endpoint)
        self.num_eval_prompts = num_eval_prompts
        self.eval_config = eval_config or EvalConfig()
        self.evaluation: EvalRound | None = None  # the round being run, or the last one
        self.ledger = Ledger(ledger_path, group_commit=True)
        self.buffer_config = config
        self.world_size = world_size
        """The trainer ranks the micro-batches are split for (a rewind can change it)."""
        self._new_core: Callable[[], SamplingBuffer] = lambda: SamplingBuffer(
            config,
            num_prompts=num_prompts,
            num_shards=num_shards,
            world_size=self.world_size,
            seed=seed,
            ledger=self.ledger,
            total_steps=total_steps,
            keep_groups=keep_groups,
        )
        if resume_from is not None:
            self.ledger.rewind(read_mark(resume_from), f"resumed from {resume_from}")
        self.core = self._rebuild()
        self._changed = asyncio.Condition()
        self._trainer_wait_s = 0.0
        self._controller_wait_s = 0.0
        self._decisions: dict[str, int] = {}
        self._commit: asyncio.Task[None] | None = None

    def _rebuild(self) -> SamplingBuffer:
        """A sampling buffer in the state the ledger records (empty for a new run)."""
        start = time.perf_counter()
        core = self._new_core()
        events = core.replay()
        core.plan_seq = random.getrandbits(48)  # differs from every plan a controller saw
        if events or core.replayed_from:
            logger.warning(
                "buffer: state rebuilt from %s and %d ledger events after it in %.2f s (step %d, version %d)",
                f"the snapshot at ledger row {core.replayed_from}" if core.replayed_from else "the start",
                events, time.perf_counter() - start, core.step, core.version,
            )  # fmt: skip
        return core

    async def _durable(self) -> None:
        """Return once every decision made so far is committed. Handlers that decided in the
        same turn of the event loop share one commit (one fsync) before any of them replies."""
        if not self.ledger.pending:
            return
        if self._commit is None:  # a failed commit closes the buffer: its memory is ahead of the ledger
            self._commit = self.spawn(self._group_commit(), name="ledger commit")
        await asyncio.shield(self._commit)

    async def _group_commit(self) -> None:
        await asyncio.sleep(0)  # let the handlers already woken decide first
        self._commit = None
        with trace.span("ledger_commit"):
            self.ledger.commit()

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    @contextlib.contextmanager
    def _ledger_writes(self) -> Iterator[None]:
        """A failed ledger write (a full disk) closes the buffer: its memory would run ahead
        of the ledger. The launcher restarts it, and it replays what the ledger holds."""
        try:
            yield
        except StorageError as e:
            self.spawn(self._stop_with(e), name="ledger write")
            raise

    async def _stop_with(self, error: BaseException) -> None:
        """Fail the buffer with ``error`` (a task that raises closes the actor)."""
        raise error

    @handles(ScoredGroup)
    async def offer(self, msg: ScoredGroup) -> Ack:
        if is_eval(msg.group_key):
            return await self._offer_eval(msg)
        with trace.span("offer"), self._ledger_writes():
            decision = self.core.offer(msg)
            self.ledger.drop_turns(msg.group_key)  # (in the decision's commit: its episodes are in its payload)
        self._decisions[decision] = self._decisions.get(decision, 0) + 1
        await self._durable()  # the ledger has it before anyone hears of it
        await self._notify()
        if self.core.stalled:
            self.spawn(self._stop_with(RunStopped(self.core.stalled)), name="stalled")
        return Ack(info={"decision": decision})

    @handles(TurnRecord)
    async def turn(self, msg: TurnRecord) -> Ack:
        """A finished turn of an episode in flight, durable before the controller goes on."""
        size = self.core.config.group_size if not is_eval(msg.group_key) else None
        if msg.turn < 0 or msg.sample < 0 or (size is not None and msg.sample >= size):
            raise ProtocolError(
                f"TurnRecord {msg.group_key.as_str()}: sample {msg.sample}, turn {msg.turn}: a group has samples "
                f"0..{(size or 1) - 1} and turns from 0"
            )
        if not is_eval(msg.group_key) and not self.core.in_flight(msg.group_key):
            return Ack(info={"recorded": "no: the group is decided or superseded"})  # (a slow controller's)
        with self._ledger_writes():
            self.ledger.record_turn(msg.group_key, msg.sample, msg.turn, pack(msg))
        await self._durable()
        return Ack(info={"recorded": "yes"})

    @handles(TurnsRequest)
    async def turns(self, msg: TurnsRequest) -> TurnRecords:
        """What a (restarted) controller resumes a group's episodes from (after forgetting
        ``drop_sample``'s, an episode that runs again from its start)."""
        if msg.drop_sample >= 0:
            with self._ledger_writes():
                self.ledger.drop_turns(msg.group_key, msg.drop_sample)
            await self._durable()
        records = [unpack_turn(payload) for payload in self.ledger.turns(msg.group_key)]
        return TurnRecords(group_key=msg.group_key, records=records)

    async def _offer_eval(self, msg: ScoredGroup) -> Ack:
        """A result of an evaluation: kept by the round it belongs to (late ones of another
        round are ignored); never in the ledger, which holds what trains."""
        round_ = self.evaluation
        if round_ is None or round_.keys[0].epoch != msg.group_key.epoch:
            return Ack(info={"decision": "not evaluating this version"})
        decision = round_.offer(msg)
        if round_.done:
            self.core.plan_seq += 1  # the eval keys leave the plans
            await self._notify()
        return Ack(info={"decision": decision})

    async def _evaluate(self, version: int, rollouts: int) -> StepReport:
        """Run the evaluation of ``version`` (or join the one running, or answer the one
        done): its keys join the plans; returns once every result is in."""
        if not self.num_eval_prompts:
            raise ConfigError("the run has no held-out prompts to evaluate on: set data.eval_split or data.eval_path")
        if not 0 <= version <= self.core.version:
            raise ProtocolError(
                f"Query('evaluate').args.version={version}: the generators have versions 0..{self.core.version}; "
                "evaluate a version once it is published"
            )
        if self.evaluation is None or self.evaluation.version != version:
            self.evaluation = EvalRound(
                self.eval_config, version=version, num_prompts=self.num_eval_prompts, num_shards=self.core.num_shards
            )
            self.core.plan_seq += 1
            await self._notify()
        round_ = self.evaluation
        async with self._changed:
            await self._changed.wait_for(lambda: round_.done or self.evaluation is not round_)
        if self.evaluation is not round_:
            raise ProtocolError(f"the evaluation of version {version} was replaced by one of version {self.evaluation.version}")
        values, groups = round_.report()
        return StepReport(step=version, values=values, groups=groups[:rollouts])

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
                    self._changed.wait_for(lambda: self.core.plan_seq != msg.after_seq), timeout=msg.wait_s
                )
            except asyncio.TimeoutError:
                pass  # a long poll: answer with the unchanged plan
        self._controller_wait_s += time.perf_counter() - start
        return DispatchPlan(
            plan_seq=self.core.plan_seq,
            keys=(self.evaluation.plan(msg.shard) if self.evaluation is not None else []) + self.core.plan(msg.shard),
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
        self._check_request(msg)
        # A rank that asks for step k has finished fetching every wave before it, and so
        # have the others (step k-1 ended in a collective): those waves can go.
        for key in [k for k in self.core.ready if k[0] < msg.step]:
            self.core.release(*key)
        start = time.perf_counter()
        async with self._changed:
            await self._changed.wait_for(
                lambda: self.core.take(msg.step, msg.index, msg.rank) is not None or msg.step > self.core.step
            )
        self._trainer_wait_s += time.perf_counter() - start
        self._check_request(msg)  # (a rewind meanwhile)
        batch = self.core.take(msg.step, msg.index, msg.rank)
        assert batch is not None
        return batch

    def _check_request(self, msg: MicroBatchRequest) -> None:
        """A rank asks for step k only after every rank trained step k - 1, so k is at most
        the step being assembled; anything else would wait for good."""
        core = self.core
        if not 0 <= msg.rank < core.world_size:
            raise ProtocolError(f"MicroBatchRequest.rank={msg.rank}: the run has ranks 0..{core.world_size - 1}")
        if not 0 <= msg.index < core.config.micro_batches_per_step:
            raise ProtocolError(
                f"MicroBatchRequest.index={msg.index}: a step has {core.config.micro_batches_per_step} micro-batches"
            )
        if not 0 <= msg.step <= core.step or (core.total_steps is not None and msg.step >= core.total_steps):
            raise ProtocolError(
                f"MicroBatchRequest.step={msg.step}: the buffer assembles step {core.step} of {core.total_steps}; "
                "a rank asks only for a step every rank has reached"
            )

    @handles(PolicyVersion)
    async def version(self, msg: PolicyVersion) -> Ack:
        with self._ledger_writes():
            self.core.publish_version(msg.version)
            # A step's end supersedes the groups dispatched past it (on-policy): their
            # episodes' turns are never read again.
            for key in self.ledger.turn_keys():
                if not self.core.in_flight(key):
                    self.ledger.drop_turns(key)
        await self._durable()
        await self._notify()
        return Ack(seq=msg.version)

    @handles(Query)
    async def query(self, msg: Query) -> Message:
        if msg.what == "stats":
            return Metrics(values=self.stats())
        if msg.what == "checkpoint":
            directory = self._checkpoint_dir(msg)
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / (MARK_FILE + ".tmp")
            with self._ledger_writes():
                mark = self.core.mark()  # (with a snapshot of the state at it)
            tmp.write_text(json.dumps({"ledger_mark": mark, "step": self.core.step}))
            tmp.replace(directory / MARK_FILE)
            return Ack(info={"dir": str(directory)})
        if msg.what == "rewind":  # no dir: back to the start (no checkpoint yet)
            start = self._checkpoint_dir(msg) if msg.args.get("dir") else None
            mark = read_mark(start) if start is not None else 0
            world_size = _count_arg(msg, "world_size", str(self.world_size))  # a new trainer group's size
            try:
                self.buffer_config.check_world_size(world_size)
            except ConfigError as e:
                raise ProtocolError(f"Query('rewind').args.world_size={world_size}: {e}") from e
            previous, self.world_size = self.world_size, world_size
            try:
                with self._ledger_writes():
                    self.ledger.rewind(mark, f"trainer restarted from {start or 'the start'}")
                self.core = self._rebuild()
            except BaseException:
                self.world_size = previous
                raise
            await self._notify()
            # version: the steps trained at the mark (the trainer resumes there); step: the
            # step being assembled (the steps between them have their batches ready)
            return Ack(info={"version": str(self.core.version), "step": str(self.core.step)})
        if msg.what == "evaluate":
            return await self._evaluate(_count_arg(msg, "version"), _count_arg(msg, "rollouts", "0"))
        if msg.what == "step_report":
            step = _count_arg(msg, "step")
            # Kept until the version after it is published (a snapshot holds the steps not trained yet).
            consumed = self.core.step_groups.pop(step, []) if step < self.core.version else self.core.step_groups.get(step, [])
            values, groups = step_report(consumed, rollouts=_count_arg(msg, "rollouts", "0"))
            return StepReport(step=step, values=values, groups=groups)
        raise ValueError(f"buffer: unknown query {msg.what!r}; known: stats, checkpoint, rewind, step_report, evaluate")

    def _checkpoint_dir(self, msg: Query) -> Path:
        """A checkpoint directory of this run: nothing a message says makes the buffer write
        (or read) outside ``<run dir>/checkpoints``."""
        root = (self.ledger.path.parent / "checkpoints").resolve()
        directory = Path(msg.args.get("dir", "")).resolve()
        if directory.parent != root:
            raise ProtocolError(f"Query({msg.what!r}).args.dir={msg.args.get('dir')!r} is not a checkpoint of this run ({root}/<name>)")
        return directory

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
            "buffer/rolled_back": float(s.rolled_back),
            "buffer/skipped_settled": float(self.core.skipped_settled),
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


def read_mark(checkpoint: Path) -> int:
    """The ledger mark a checkpoint recorded (the last row the buffer had decided)."""
    path = checkpoint / MARK_FILE
    try:
        return int(json.loads(path.read_text())["ledger_mark"])
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"checkpoint {checkpoint} has no readable buffer mark ({path}: {e}); resume from another one") from None


def _count_arg(msg: Query, name: str, default: str | None = None) -> int:
    """``msg.args[name]`` as a whole number >= 0 (a step, a version, a count of rollouts)."""
    text = msg.args.get(name, default)
    if text is None:
        raise ProtocolError(f"Query({msg.what!r}).args.{name} is missing")
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ProtocolError(f"Query({msg.what!r}).args.{name}={text!r} must be a whole number >= 0")
    return value
