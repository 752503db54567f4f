"""One trainer process of a run: the loop around ``workers.trainer.Trainer``.

Per step k, on every rank (rank 0 also talks to generators, writes metrics)::

    MicroBatchRequest(k, rank, i) -> buffer, i = 0..count-1, each trained as it arrives
    Trainer.train_step                          (forward/backward per micro-batch, one AdamW step)
    consumed/trainer-<rank>.jsonl               (the group key of each row trained: ``record_consumed``)
    Trainer.weight_buckets(k+1)                 (collective; rank 0 gets the full tensors)
    rank 0: WeightUpdate buckets -> every generator, waits for their Acks
            PolicyVersion(k+1)   -> buffer (re-opens the dispatch window when on-policy)
    every trainer.checkpoint_every steps, at the end and when the launcher asks
    (yatt.rl.checkpoints: a re-planned trainer group): DCP checkpoint of step k+1 into
            checkpoints/step_{k+1} (copied now, written in the background:
            trainer.checkpoint_async), the buffer's ledger mark beside it; rank 0 writes its
            ``done`` marker the moment the write ends and the step's metrics line is written
    rank 0: one line of metrics.jsonl and TensorBoard scalars

Layouts that take turns (``yatt.placement``): in the colocated layout every rank also
hosts a generator engine, served as an ordinary generator actor; in the partial layout
the generators are processes of their own on a subset of the trainer's slots. Either way
a step cannot stream: the engines must finish the step's batch before training may take
their slot, so each rank first fetches all its micro-batches while the engines generate,
the ranks meet in a barrier, and then::

    colocated: pause the own engine, release the gathered policy (local) -> train ->
               checkpoint when due -> gather_policy (collective: full weights resident
               again, the engine generates on the module itself) -> version k+1, resume
    partial:   rank 0 puts the generators to sleep (Query sleep) -> train -> the weight
               push (or a Query wake) wakes them

The training itself runs in a worker thread so the event loop keeps answering
heartbeats. Rank 0 keeps the last published buckets and pushes them to any generator
that joins (or restarts) behind the current version, so a restarted generator catches up
without a collective.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from protocols.messages import (
    Ack,
    Message,
    Metrics,
    MicroBatch,
    MicroBatchRequest,
    PolicyVersion,
    Query,
    StepReport,
    WeightUpdate,
    WorkerInfo,
)
from workers.engines.base import Engine
from workers.generator import Generator
from workers.lora import is_adapter
from workers.run_log import RunLog
from workers.trainer import Trainer
from yatt.errors import PeerLost, RemoteError, RequestTimeout, storage_error
from yatt.placement.plan import Layout
from yatt.rl.checkpoints import asked_for_checkpoint
from yatt.rl.config import AlgorithmConfig, GeneratorConfig, ModelConfig, TrainerConfig
from yatt.runtime import run_dir as names
from yatt.runtime import trace
from yatt.runtime.actor import Actor, handles
from yatt.runtime.registry import Directory
from yatt.runtime.transport import Transport, TransportConfig


@dataclass(frozen=True, kw_only=True)
class RankConfig:
    """What a trainer rank needs of a run's config. The launcher builds it from its own
    config (``launch.role``), so the rank runs the same under any launcher."""

    model: ModelConfig
    trainer: TrainerConfig
    algorithm: AlgorithmConfig
    generator: GeneratorConfig
    """The engine a colocated rank hosts."""
    transport: TransportConfig
    steps: int
    """Optimizer steps of the run (``run.steps``)."""
    micro_batches_per_step: int
    """Micro-batches each rank trains per step (``buffer.micro_batches_per_step``)."""
    temperature: float
    """The rollouts' sampling temperature (``controller.temperature``): log-probs are taken at it."""
    ready_timeout_s: float
    """How long to wait for the buffer to register (``run.ready_timeout_s``)."""
    rollouts_per_step: int = 2
    """Groups of each step written to rollouts.jsonl (``run.rollouts_per_step``)."""
    eval_every: int = 0
    """Evaluate the policy before step 0, every this many steps and after the last (``run.eval_every``; 0: never)."""
    report_to: list[str] = dataclasses.field(default_factory=lambda: ["tensorboard"])
    """Metric sinks besides metrics.jsonl (``run.report_to``)."""
    wandb_project: str = "yatt"
    """``run.wandb_project``."""
    incarnation: int = 0
    """Restarts of the trainer group in this run: its weight updates carry it, so the
    generators take them over the weights of a group that died (even at a lower version)."""


@dataclass(frozen=True, kw_only=True)
class RankLayout:
    """What the run's placement layout means for a trainer rank: the one place that reads
    the layout's name (the module docstring pictures the layouts that take turns)."""

    pushes_weights: bool
    """The generators are processes of their own: rank 0 pushes each synced version to
    them and to any that joins behind it (partial, disaggregated)."""
    takes_turns: bool
    """Engines and training share the slots: a step fetches its whole batch before it trains
    (colocated, partial); else it trains each micro-batch as it arrives."""
    hosts_engines: bool
    """Every rank hosts an engine: it pauses it to train and resumes it on the new weights,
    gathered in place (colocated)."""
    sleeps_generators: bool
    """Rank 0 puts the generators to sleep to train and wakes them after, by the weight push
    or a Query wake (partial)."""

    @classmethod
    def of(cls, layout: Layout) -> RankLayout:
        return cls(
            pushes_weights=layout != "colocated",
            takes_turns=layout in ("colocated", "partial"),
            hosts_engines=layout == "colocated",
            sleeps_generators=layout == "partial",
        )


R = TypeVar("R", bound=Message)


class BufferLink:
    """The rank's calls to the buffer, across a buffer restart: every one is idempotent
    (a micro-batch is served again, a version published twice is one), so a lost buffer is
    looked up again in the directory and the call sent again."""

    def __init__(self, directory: Directory, within: float) -> None:
        self.directory = directory
        self.within = within

    async def request(self, msg: Message, expect: type[R], *, timeout: float | None = None) -> R:
        return await self.directory.request("buffer", msg, expect, timeout=timeout, within=self.within)


class TrainerActor(Actor):
    """A trainer rank's endpoint: READY registration and ``Query("stats")``."""

    role = "trainer"

    def __init__(self, transport: Transport, *, endpoint: str, rank: TrainerRank) -> None:
        super().__init__(transport, endpoint=endpoint, actor_id=f"trainer-{rank.rank}")
        self.owner = rank

    @handles(Query)
    async def query(self, msg: Query) -> Message:
        if msg.what == "stats":
            return Metrics(values={"trainer/step": float(self.owner.trainer.step)})
        raise ValueError(f"trainer: unknown query {msg.what!r}; known: stats")


class TrainerRank:
    """The loop of one rank; build it with ``create`` (it initialises torch.distributed)."""

    def __init__(
        self, cfg: RankConfig, trainer: Trainer, *, run_dir: Path, layout: Layout = "disaggregated",
        engine: Engine | None = None,
    ) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.run_dir = run_dir
        self.rank = trainer.rank
        self.layout = RankLayout.of(layout)
        self.engine = engine  # colocated: the engine this rank hosts
        self.generator: Generator | None = None  # colocated: the actor serving it
        self._paused: contextlib.AsyncExitStack | None = None  # colocated: the engine held while training
        self._training_turn = False  # partial, rank 0: the generators' slots are training's now
        self.switch_s = 0.0
        self._buckets: list[WeightUpdate] = []  # rank 0: the last published version
        self._synced: dict[str, int] = {}  # rank 0: generator actor id -> version it holds
        self._push_locks: dict[str, asyncio.Lock] = {}
        self._log = (
            RunLog(run_dir, trainer.model_path, report_to=cfg.report_to, wandb_project=cfg.wandb_project)
            if trainer.rank == 0
            else None
        )
        self._saving: tuple[Path, int, Future[None]] | None = None  # the checkpoint being written
        self._marking: asyncio.Task[None] | None = None  # rank 0: marks it done as soon as it is written
        self._slow = trace.training_slowdown(run_dir)  # an injected workload shift (YATT_SLOW_TRAIN)
        self._checkpointed = trainer.step  # the version of the group's last checkpoint (or its start)
        self._logged = trainer.step - 1  # rank 0: the last step with its metrics line
        self._unmarked: tuple[Path, int] | None = None  # rank 0: a checkpoint written before its step's line

    @classmethod
    def create(
        cls, cfg: RankConfig, *, run_dir: Path, model_path: Path, resume: Path | None,
        layout: Layout = "disaggregated", hosts_generator: bool = False,
    ) -> TrainerRank:
        """Join the process group (env:// from the launcher) and build the trainer (and, when
        the rank hosts a generator, its engine with the current weights: a collective)."""
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        with trace.span("join_group"):
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        with trace.span("build_trainer"):
            trainer = Trainer(
                cfg.model,
                cfg.trainer,
                cfg.algorithm,
                model_path=str(model_path),
                run_steps=cfg.steps,
                temperature=cfg.temperature,
            )
        if resume is not None:
            with trace.span("load_checkpoint"):
                trainer.load_checkpoint(resume / "trainer")
        engine: Engine | None = None
        if hosts_generator:
            if cfg.generator.backend == "vllm":
                from workers.engines import make_engine

                engine = make_engine(
                    str(model_path), cfg.generator, device=str(trainer.device), dtype=cfg.model.dtype, lora=cfg.model.lora
                )
            else:
                from workers.engines.hf import HFEngine

                engine = HFEngine.on_module(trainer.policy, cfg.generator, device=trainer.device, tokenizer_path=str(model_path))
        rank = cls(cfg, trainer, run_dir=run_dir, layout=layout, engine=engine)
        if engine is not None:
            rank._wake_engine()
        return rank

    def colocated_generator(self, transport: Transport, *, endpoint: str) -> Generator | None:
        """The generator actor serving this rank's engine (colocated layout), else None."""
        if self.engine is None:
            return None
        if self.generator is None:
            self.generator = Generator(
                transport, endpoint=endpoint, engine=self.engine, config=self.cfg.generator,
                version=self.trainer.step, actor_id=f"{COLOCATED_PREFIX}{self.rank}",
            )
        return self.generator

    def _wake_engine(self) -> None:
        """Give the hosted engine the current weights; collective (every rank at once).
        transformers: the full weights become resident in the module it generates with;
        vLLM: they are gathered, loaded into the waking engine in place, and released."""
        assert self.engine is not None
        start = time.perf_counter()
        with trace.span("wake"):
            self.trainer.gather_policy()
            if self.cfg.generator.backend == "vllm":
                self.engine.wake_up()
                tensors = self.trainer.gathered_tensors()
                if self.cfg.model.lora.rank:  # the engine keeps the base weights; adapters only
                    tensors = ((name, t) for name, t in tensors if is_adapter(name))
                self.engine.update_weights(tensors)
                self.trainer.release_policy()
        self.switch_s += time.perf_counter() - start

    def _sleep_engine(self) -> None:
        """Free the hosted engine's share of the slot for training (local, no collective)."""
        assert self.engine is not None
        start = time.perf_counter()
        with trace.span("sleep"):
            self.engine.sleep()
            self.trainer.release_policy()
        self.switch_s += time.perf_counter() - start
    def actor(self, transport: Transport, *, endpoint: str) -> TrainerActor:
        return TrainerActor(transport, endpoint=endpoint, rank=self)

    async def run(self, directory: Directory, stop: asyncio.Event) -> None:
        """Train to ``run.steps``, then export the final model; returns when done."""
        await directory.wait_until(lambda d: bool(d.members("buffer")), timeout=self.cfg.ready_timeout_s)
        buffer = BufferLink(directory, self.cfg.ready_timeout_s)
        watcher = None
        # Resumed or restarted: the generators hold the base weights, or a dead group's.
        restored = self.trainer.step > 0 or self.cfg.incarnation > 0
        if self.rank == 0:
            if restored:
                if self.layout.pushes_weights:
                    self._buckets = await asyncio.to_thread(self._gather, self.trainer.step)
                    await self._push_all(directory)
                await buffer.request(PolicyVersion(version=self.trainer.step), Ack)
            if self.layout.pushes_weights:
                watcher = asyncio.get_running_loop().create_task(self._watch_generators(directory))
        else:
            if restored and self.layout.pushes_weights:
                await asyncio.to_thread(self._gather, self.trainer.step)
        try:
            if self.trainer.step == 0 and self._eval_due(0):
                await self._evaluate(buffer, 0)
            while self.trainer.step < self.cfg.steps and not stop.is_set():
                await self._step(buffer, directory)
            await self._mark_written(wait=True)
            if not stop.is_set():
                await asyncio.to_thread(self.trainer.export_hf, self.run_dir / "final")
        finally:
            if self._marking is not None:  # stopped with a write in flight: it is not done
                self._marking.cancel()
            if self._paused is not None:
                await self._paused.aclose()
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
            if self._log is not None:
                self._log.close()
        await asyncio.to_thread(dist.barrier)
        dist.destroy_process_group()

    async def _step(self, buffer: BufferLink, directory: Directory) -> None:
        with trace.span("step"):
            await self._run_step(buffer, directory)

    async def _run_step(self, buffer: BufferLink, directory: Directory) -> None:
        """Step ``trainer.step``: train, publish the new version, checkpoint when due, hand
        the slots back to the engines, log (rank 0), evaluate when due."""
        step = self.trainer.step
        # [sum of staleness, samples, tokens, a checkpoint asked for (rank 0's read, so that
        # every rank saves the same step)], on the rank's device: NCCL reduces no CPU tensor
        staleness = torch.zeros(4, dtype=torch.float64, device=self.trainer.device)
        start = time.perf_counter()
        metrics, wait_s, keys = await self._train(buffer, directory, step, staleness)
        train_s = time.perf_counter() - start
        await asyncio.to_thread(record_consumed, self.run_dir, self.rank, step=step, incarnation=self.cfg.incarnation, keys=keys)
        self._training_turn = False  # a generator that joined meanwhile gets its weights now
        if self.rank == 0 and self._checkpoint_asked():
            staleness[3] = 1.0
        await asyncio.to_thread(dist.all_reduce, staleness)
        sync_start = time.perf_counter()
        version = self.trainer.step
        pushed = await self._publish(buffer, directory, version)
        sync_s = time.perf_counter() - sync_start
        ckpt_start = time.perf_counter()
        await self._checkpoint_if_due(buffer, version, staleness)
        ckpt_s = time.perf_counter() - ckpt_start
        wake_start = time.perf_counter()
        await self._end_turn(buffer, directory, version, pushed=pushed)
        if self.layout.sleeps_generators:  # weight sync time; a hosted engine's wake counts in switch_s
            sync_s += time.perf_counter() - wake_start
        if self.rank == 0:
            times = {
                "time/wait_for_buffer_s": wait_s,
                "time/train_s": train_s - wait_s,
                "time/weight_sync_s": sync_s,
                "time/checkpoint_s": ckpt_s,
            }
            await self._log_step(buffer, step, metrics, staleness, start=start, times=times)
        if self._eval_due(version):
            await self._evaluate(buffer, version)

    async def _train(
        self, buffer: BufferLink, directory: Directory, step: int, staleness: torch.Tensor
    ) -> tuple[dict[str, float], float, list[str]]:
        """Fetch and train the step's micro-batches, adding each one's staleness, samples and
        tokens to ``staleness``; returns the training metrics, the seconds spent waiting (for
        the buffer and, when the layout takes turns, for the engines to hand over) and the
        group key of every row trained, padding aside, in micro-batch order."""
        loop = asyncio.get_running_loop()
        wait = [0.0]
        count = self.cfg.micro_batches_per_step
        keys: list[str] = []

        async def fetch_one(index: int) -> MicroBatch:
            start = time.perf_counter()
            request = MicroBatchRequest(step=step, rank=self.rank, world_size=self.trainer.world_size, index=index)
            # As long as generation takes: a dead buffer is noticed by its heartbeats (PeerLost).
            with trace.span("wait_for_buffer"):
                mb = await buffer.request(request, MicroBatch, timeout=math.inf)
            wait[0] += time.perf_counter() - start
            real = mb.loss_mask.any(dim=1)
            keys.extend(key.as_str() for key, counts in zip(mb.group_keys, real.tolist(), strict=True) if counts)
            staleness.add_(torch.tensor(
                [float((step - mb.policy_versions[real]).sum()), float(real.sum()), float(mb.loss_mask.sum()), 0.0],
                dtype=torch.float64, device=staleness.device,
            ))
            return mb

        def fetch() -> Iterator[MicroBatch]:  # streamed: trained as each arrives
            for index in range(count):
                yield asyncio.run_coroutine_threadsafe(fetch_one(index), loop).result()

        if self.layout.takes_turns:
            batch = [await fetch_one(index) for index in range(count)]  # the engines generate meanwhile
            await asyncio.to_thread(dist.barrier)  # every rank holds its batch: all switch together
            switch = time.perf_counter()
            await self._take_turn(directory)
            wait[0] += time.perf_counter() - switch
            metrics = await asyncio.to_thread(self.trainer.train_step, iter(batch))
        else:
            metrics = await asyncio.to_thread(self.trainer.train_step, fetch())
        if self._slow is not None and self._slow.active(step):  # the step's extra compute, split over the ranks
            await asyncio.sleep(self._slow.seconds / self.trainer.world_size)
        return metrics, wait[0], keys

    async def _publish(self, buffer: BufferLink, directory: Directory, version: int) -> bool:
        """Push ``version`` to the generator processes when a weight sync is due (every rank
        gathers, rank 0 pushes and tells the buffer); returns whether it pushed."""
        synced = version % self.cfg.trainer.weight_sync_every == 0 or version == self.cfg.steps
        if not (self.layout.pushes_weights and synced):
            return False
        with trace.span("weight_gather"):
            buckets = await asyncio.to_thread(self._gather, version)
        if self.rank == 0:
            with trace.span("weight_push"):
                self._buckets = buckets
                await self._push_all(directory)
                await buffer.request(PolicyVersion(version=version), Ack)
        return True

    async def _checkpoint_if_due(self, buffer: BufferLink, version: int, staleness: torch.Tensor) -> None:
        """Checkpoint ``version`` every checkpoint_every steps, after the last and when the
        launcher asked (``staleness[3]``, reduced over the ranks); else mark a written one."""
        every = self.cfg.trainer.checkpoint_every
        if (every and version % every == 0) or version == self.cfg.steps or float(staleness[3]) > 0:
            with trace.span("checkpoint"):
                await self._checkpoint(buffer, version)
        else:
            await self._mark_written(wait=False)

    async def _end_turn(self, buffer: BufferLink, directory: Directory, version: int, *, pushed: bool) -> None:
        """Hand the slots back to the engines: the hosted engines take ``version`` (unless the
        run ends without an evaluation), or rank 0 wakes generators that no push woke."""
        if self.layout.hosts_engines and (version < self.cfg.steps or self._eval_due(version)):
            await self._resume_generation(buffer, version)
        elif self.layout.sleeps_generators and not pushed and self.rank == 0:
            await self._wake_generators(directory)

    async def _log_step(
        self, buffer: BufferLink, step: int, metrics: dict[str, float], staleness: torch.Tensor, *,
        start: float, times: dict[str, float],
    ) -> None:
        """Rank 0: the step's metrics line (throughput, staleness, ``times`` as time/*, the
        training metrics, the buffer's report and stats) and rollouts; then the ``done``
        marker of a checkpoint that waited for this line."""
        step_s = time.perf_counter() - start
        samples, tokens = float(staleness[1]), float(staleness[2])
        line: dict[str, float] = {
            "step": float(step),
            "samples_per_s": samples / step_s,
            "tokens_per_s": tokens / step_s,
            "staleness/mean": float(staleness[0]) / max(samples, 1.0),
            "time/step_s": step_s,
            "time/unix": time.time(),  # wall clock at the step's end (reward vs wall time)
            **times,
        }
        if self.engine is not None:
            line["time/switch_s"] = self.switch_s
            self.switch_s = 0.0
        line.update({f"train/{k}": v for k, v in metrics.items()})
        with trace.span("log_step"):
            report = await buffer.request(
                Query(what="step_report", args={"step": str(step), "rollouts": str(self.cfg.rollouts_per_step)}), StepReport
            )
            line.update(report.values)
            stats = await buffer.request(Query(what="stats"), Metrics)
            line.update(stats.values)
            assert self._log is not None
            self._log.metrics(line)
            await asyncio.to_thread(self._log.rollouts, step, report.groups)
        self._logged = step
        if self._unmarked is not None and self._unmarked[1] - 1 <= step:
            await self._write_done(*self._unmarked)

    def _checkpoint_asked(self) -> bool:
        """Rank 0: whether the launcher asks for a checkpoint (``yatt.rl.checkpoints``) that
        this group has not written: none of a version after the step it was asked after."""
        after = asked_for_checkpoint(self.run_dir)
        return after is not None and self._checkpointed <= after

    def _eval_due(self, version: int) -> bool:
        """Evaluate the weights of ``version``: before the first step, every eval_every, after the last."""
        every = self.cfg.eval_every
        return bool(every) and (version % every == 0 or version == self.cfg.steps)

    async def _evaluate(self, buffer: BufferLink, version: int) -> None:
        """Evaluate the generators' weights of ``version`` on the held-out prompts: rank 0
        asks the buffer (which runs the round through the controllers) and logs eval/*; every
        rank waits for it in a barrier, its event loop free, so a colocated engine serves the
        evaluation and nothing newer is trained or published meanwhile."""
        start, report = time.perf_counter(), None
        with trace.span("evaluate"):
            if self.rank == 0:
                query = Query(what="evaluate", args={"version": str(version), "rollouts": str(self.cfg.rollouts_per_step)})
                report = await buffer.request(query, StepReport, timeout=math.inf)
            await asyncio.to_thread(dist.barrier)
        if self._log is not None and report is not None:
            line = {"step": float(version), **report.values, "time/eval_s": time.perf_counter() - start}
            self._log.metrics(line, kind="eval")
            await asyncio.to_thread(self._log.rollouts, version, report.groups, kind="eval")

    async def _take_turn(self, directory: Directory) -> None:
        """Hand the slots from the engines to training: the colocated rank pauses its own
        engine (waits for its current call) and releases the gathered weights; in the
        partial layout rank 0 puts every generator to sleep."""
        if self.generator is not None:
            self._paused = contextlib.AsyncExitStack()
            await self._paused.enter_async_context(self.generator.paused())
            await asyncio.to_thread(self._sleep_engine)
        elif self.layout.sleeps_generators and self.rank == 0:
            self._training_turn = True
            await self._ask_generators(directory, "sleep")

    async def _resume_generation(self, buffer: BufferLink, version: int) -> None:
        """Colocated: every rank gathers the new weights into its engine (collective), the
        engine serves version ``version``; rank 0 tells the buffer."""
        await asyncio.to_thread(self._wake_engine)
        if self.generator is not None:
            await self.generator.set_version(version)
        if self._paused is not None:
            await self._paused.aclose()
            self._paused = None
        if self.rank == 0:
            await buffer.request(PolicyVersion(version=version), Ack)

    async def _wake_generators(self, directory: Directory) -> None:
        """Partial, a step without a weight push: wake the sleeping generators."""
        await self._ask_generators(directory, "wake")

    async def _ask_generators(self, directory: Directory, what: str) -> None:
        async def ask(actor_id: str) -> None:
            try:
                await directory.client(actor_id).request(
                    Query(what=what), Ack, timeout=self.cfg.transport.request_timeout_s
                )
            except (KeyError, PeerLost, RequestTimeout, RemoteError):
                pass  # it left or died; a restarted generator starts awake
        with trace.span(f"generators_{what}"):
            await asyncio.gather(*(ask(w.actor_id) for w in _external(directory)))

    def _gather(self, version: int) -> list[WeightUpdate]:
        """Collective on every rank; rank 0 gets the buckets."""
        bucket_bytes = int(self.cfg.trainer.weight_bucket_mb * (1 << 20))
        return [
            dataclasses.replace(b, incarnation=self.cfg.incarnation) for b in self.trainer.weight_buckets(version, bucket_bytes)
        ]

    async def _checkpoint(self, buffer: BufferLink, version: int) -> None:
        """Save step ``version``: the trainer state is copied now (collective) and, with
        ``trainer.checkpoint_async``, written while training goes on; the buffer records its
        ledger mark now, for the same step. The checkpoint counts (``done``) once written."""
        # The previous one first: saving waits for its write anyway, and a checkpoint every
        # step would otherwise never be marked (its write outlasts a step).
        await self._mark_written(wait=True)
        directory = self.run_dir / "checkpoints" / f"step_{version}"
        self._checkpointed = version
        background = self.cfg.trainer.checkpoint_async and version < self.cfg.steps
        writing = await asyncio.to_thread(self.trainer.save_checkpoint, directory / "trainer", background=background)
        if self.cfg.trainer.checkpoint_hf:
            await asyncio.to_thread(self.trainer.export_hf, directory / "hf")
        if self.rank == 0:
            await buffer.request(Query(what="checkpoint", args={"dir": str(directory)}), Ack)
        self._saving = (directory, version, writing)
        if background and self.rank == 0:
            self._marking = asyncio.get_running_loop().create_task(self._mark_when_written(writing))
        await self._mark_written(wait=not background)

    async def _mark_when_written(self, writing: Future[None]) -> None:
        """Rank 0: mark the checkpoint ``done`` the moment its write ends, not at the end of
        the step that finds it written: a rank that dies in that step costs one step less
        (the group restarts from it). A failed write is left to the step loop to raise."""
        with contextlib.suppress(Exception):
            await asyncio.wrap_future(writing)
        if writing.exception() is None and self._saving is not None and self._saving[2] is writing:
            await self._mark_written(wait=False)

    async def _mark_written(self, *, wait: bool) -> None:
        """Rank 0 writes the ``done`` marker of the checkpoint being saved once it is written
        (DCP's coordinator writes ``.metadata`` after every rank's files, so rank 0's save
        ends last) and its step's metrics line is (else right after the line: a group
        restarted from it must not miss that line); ``wait``: until written, else only when
        already written."""
        marking = self._marking
        if marking is not None and marking is not asyncio.current_task() and (wait or marking.done()):
            self._marking = None
            await marking  # raises what failed in it (the marker's or the pruning's write)
        if self._saving is None:
            return
        directory, version, writing = self._saving
        if not (wait or writing.done()):
            return
        self._saving = None
        await asyncio.to_thread(self.trainer.wait_for_checkpoint)  # raises a failed write's error
        if self.rank == 0:
            if version - 1 > self._logged:  # the step's metrics line first: a group restarted
                self._unmarked = (directory, version)  # from it goes on after that line
            else:
                await self._write_done(directory, version)

    async def _write_done(self, directory: Path, version: int) -> None:
        """Rank 0: the checkpoint of ``version`` counts (resumes and restarts take it)."""
        self._unmarked = None
        (directory / "done").write_text(json.dumps({"step": version, "time": time.time()}))
        if self.cfg.trainer.keep_checkpoints:
            await asyncio.to_thread(prune_checkpoints, self.run_dir / "checkpoints", self.cfg.trainer.keep_checkpoints)

    async def _push_all(self, directory: Directory) -> None:
        await asyncio.gather(*(self._push(directory, w.actor_id) for w in _external(directory)))

    async def _push(self, directory: Directory, actor_id: str) -> None:
        """Send the last published version to one generator unless it holds it already."""
        if not self._buckets:
            return
        version = self._buckets[0].version
        lock = self._push_locks.setdefault(actor_id, asyncio.Lock())
        async with lock:
            if self._synced.get(actor_id, -1) >= version:
                return
            try:
                client = directory.client(actor_id)
                for bucket in self._buckets:
                    with trace.span("weight_bucket"):
                        await client.request(bucket, Ack, timeout=self.cfg.transport.request_timeout_s)
            except (KeyError, PeerLost, RequestTimeout, RemoteError):
                return  # it left or died; the watcher pushes again if it comes back
            self._synced[actor_id] = version

    async def _watch_generators(self, directory: Directory) -> None:
        """Bring generators that (re)joined up to the current version: as the directory
        sees one join (a restarted generator waited up to a heartbeat interval, 1 s, for
        its weights), and every heartbeat interval (a push that failed is tried again). Not
        while a partial step trains on the generators' slots: the push would wake a woken
        (parked) generator into the memory training holds; it comes once training ends."""
        while True:
            seen = {w.actor_id for w in _external(directory)}

            def joined(d: Directory, seen: set[str] = seen) -> bool:
                return not {w.actor_id for w in _external(d)} <= seen

            with contextlib.suppress(RequestTimeout):
                await directory.wait_until(joined, self.cfg.transport.heartbeat_interval_s)
            if self._training_turn:  # a push would wake it into the memory training holds (partial)
                continue
            current = {w.actor_id for w in _external(directory)}
            for actor_id in list(self._synced):
                if actor_id not in current:
                    del self._synced[actor_id]
            behind = [a for a in current if self._synced.get(a, -1) < (self._buckets[0].version if self._buckets else 0)]
            await asyncio.gather(*(self._push(directory, a) for a in behind))


def record_consumed(run_dir: Path, rank: int, *, step: int, incarnation: int, keys: list[str]) -> None:
    """Append what ``rank`` trained in ``step`` to ``consumed/trainer-<rank>.jsonl``, one
    line ``{"step", "incarnation", "keys"}`` (``keys``: the group key of each row, so a
    group's samples over the ranks add up to its size), fsync'd before the step's weights
    go anywhere. The buffer's ledger says what it handed out; this is what was trained. A
    restarted group (``incarnation``) or a resumed run trains some steps again: their new
    lines come later in the file, and the last line of a step is the one that stands
    (``read_consumed``)."""
    path = run_dir / names.CONSUMED / f"trainer-{rank}.jsonl"
    line = json.dumps({"step": step, "incarnation": incarnation, "keys": keys}) + "\n"
    try:
        path.parent.mkdir(exist_ok=True)
        with path.open("a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise storage_error(path, e) from e


def read_consumed(run_dir: Path) -> dict[int, dict[int, list[str]]]:
    """step -> rank -> the keys that rank trained in it, from every rank's record
    (``record_consumed``): of a step trained more than once, its last line."""
    steps: dict[int, dict[int, list[str]]] = {}
    for path in sorted((run_dir / names.CONSUMED).glob("trainer-*.jsonl")):
        rank = int(path.stem.removeprefix("trainer-"))
        for line in names.read_jsonl(path):
            steps.setdefault(int(line["step"]), {})[rank] = [str(k) for k in line["keys"]]
    return dict(sorted(steps.items()))


def prune_checkpoints(checkpoints: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (``step_<k>/done``), and any
    incomplete one older than the newest complete one (no resume or restart can take it);
    returns what was deleted. A checkpoint newer than every complete one is being written."""
    steps = sorted((d for d in checkpoints.glob("step_*") if d.name[5:].isdigit()), key=lambda d: int(d.name[5:]))
    complete = [d for d in steps if (d / "done").exists()]
    if not complete:
        return []
    kept = set(complete[-keep:])
    newest = int(complete[-1].name[5:])
    gone = [d for d in steps if d not in kept and int(d.name[5:]) < newest]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return gone


COLOCATED_PREFIX = "generator-colocated-"
"""Actor id prefix of the generators that trainer ranks host (they need no weight push)."""


def _external(directory: Directory) -> list[WorkerInfo]:
    """The generators in their own processes (not hosted by a trainer rank)."""
    return [w for w in directory.members("generator") if not w.actor_id.startswith(COLOCATED_PREFIX)]
