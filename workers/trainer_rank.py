"""One trainer process of a run: the loop around ``workers.trainer.Trainer``.

Per step k, on every rank (rank 0 also talks to generators, writes metrics)::

    MicroBatchRequest(k, rank, i) -> buffer, i = 0..count-1, each trained as it arrives
    Trainer.train_step                          (forward/backward per micro-batch, one AdamW step)
    Trainer.weight_buckets(k+1)                 (collective; rank 0 gets the full tensors)
    rank 0: WeightUpdate buckets -> every generator, waits for their Acks
            PolicyVersion(k+1)   -> buffer (re-opens the dispatch window when on-policy)
    every trainer.checkpoint_every steps and at the end: DCP checkpoint + the buffer's
            state and ledger copy into checkpoints/step_{k+1}, then its ``done`` marker
    rank 0: one line of metrics.jsonl and TensorBoard scalars

The training itself runs in a worker thread so the event loop keeps answering
heartbeats. Rank 0 keeps the last published buckets and pushes them to any generator
that joins (or restarts) behind the current version, so a restarted generator catches up
without a collective.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

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
    WeightUpdate,
)
from workers.trainer import Trainer
from yatt import trace
from yatt.actor import Actor, Client, handles
from yatt.errors import PeerLost, RemoteError, RequestTimeout
from yatt.registry import Directory
from yatt.transport import Transport

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from launch.config import RunConfig


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

    def __init__(self, cfg: RunConfig, trainer: Trainer, *, run_dir: Path) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.run_dir = run_dir
        self.rank = trainer.rank
        self._buckets: list[WeightUpdate] = []  # rank 0: the last published version
        self._synced: dict[str, int] = {}  # rank 0: generator actor id -> version it holds
        self._push_locks: dict[str, asyncio.Lock] = {}
        self._writer: SummaryWriter | None = None

    @classmethod
    def create(cls, cfg: RunConfig, *, run_dir: Path, model_path: Path, resume: Path | None) -> TrainerRank:
        """Join the process group (env:// from the launcher) and build the trainer."""
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        trainer = Trainer(
            cfg.model,
            cfg.trainer,
            cfg.algorithm,
            model_path=str(model_path),
            run_steps=cfg.run.steps,
            temperature=cfg.controller.temperature,
        )
        if resume is not None:
            trainer.load_checkpoint(resume / "trainer")
        return cls(cfg, trainer, run_dir=run_dir)

    def actor(self, transport: Transport, *, endpoint: str) -> TrainerActor:
        return TrainerActor(transport, endpoint=endpoint, rank=self)

    async def run(self, directory: Directory, stop: asyncio.Event) -> None:
        """Train to ``run.steps``, then export the final model; returns when done."""
        await directory.wait_until(lambda d: bool(d.members("buffer")), timeout=self.cfg.run.ready_timeout_s)
        buffer = directory.client(directory.members("buffer")[0].actor_id)
        watcher = None
        if self.rank == 0:
            if self.trainer.step > 0:  # resumed: the generators start from the base weights
                self._buckets = await asyncio.to_thread(self._gather, self.trainer.step)
                await self._push_all(directory)
                await buffer.request(PolicyVersion(version=self.trainer.step), Ack)
            watcher = asyncio.get_running_loop().create_task(self._watch_generators(directory))
        else:
            if self.trainer.step > 0:
                await asyncio.to_thread(self._gather, self.trainer.step)
        try:
            while self.trainer.step < self.cfg.run.steps and not stop.is_set():
                await self._step(buffer, directory)
            if not stop.is_set():
                await asyncio.to_thread(self.trainer.export_hf, self.run_dir / "final")
        finally:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
            if self._writer is not None:
                self._writer.close()
        await asyncio.to_thread(dist.barrier)
        dist.destroy_process_group()

    async def _step(self, buffer: Client, directory: Directory) -> None:
        with trace.span("step"):
            await self._run_step(buffer, directory)

    async def _run_step(self, buffer: Client, directory: Directory) -> None:
        step = self.trainer.step
        loop = asyncio.get_running_loop()
        wait = [0.0]
        staleness = torch.zeros(3, dtype=torch.float64)  # [sum of staleness, samples, tokens]
        count = self.cfg.buffer.micro_batches_per_step

        def fetch() -> Iterator[MicroBatch]:
            for index in range(count):
                start = time.perf_counter()
                request = MicroBatchRequest(step=step, rank=self.rank, world_size=self.trainer.world_size, index=index)
                # As long as generation takes: a dead buffer is noticed by its heartbeats (PeerLost).
                waiting = buffer.request(request, MicroBatch, timeout=math.inf)
                with trace.span("wait_for_buffer"):
                    mb = asyncio.run_coroutine_threadsafe(waiting, loop).result()
                wait[0] += time.perf_counter() - start
                real = mb.loss_mask.any(dim=1)
                staleness.add_(torch.tensor(
                    [float((step - mb.policy_versions[real]).sum()), float(real.sum()), float(mb.loss_mask.sum())],
                    dtype=torch.float64,
                ))
                yield mb

        start = time.perf_counter()
        metrics = await asyncio.to_thread(self.trainer.train_step, fetch())
        train_s = time.perf_counter() - start
        await asyncio.to_thread(dist.all_reduce, staleness)
        sync_start = time.perf_counter()
        version = self.trainer.step
        if version % self.cfg.trainer.weight_sync_every == 0 or version == self.cfg.run.steps:
            with trace.span("weight_gather"):
                buckets = await asyncio.to_thread(self._gather, version)
            if self.rank == 0:
                with trace.span("weight_push"):
                    self._buckets = buckets
                    await self._push_all(directory)
                    await buffer.request(PolicyVersion(version=version), Ack)
        sync_s = time.perf_counter() - sync_start
        ckpt_start = time.perf_counter()
        every = self.cfg.trainer.checkpoint_every
        if (every and version % every == 0) or version == self.cfg.run.steps:
            with trace.span("checkpoint"):
                await self._checkpoint(buffer, version)
        ckpt_s = time.perf_counter() - ckpt_start
        if self.rank == 0:
            step_s = time.perf_counter() - start
            samples, tokens = float(staleness[1]), float(staleness[2])
            line: dict[str, float] = {
                "step": float(step),
                "samples_per_s": samples / step_s,
                "tokens_per_s": tokens / step_s,
                "staleness/mean": float(staleness[0]) / max(samples, 1.0),
                "time/step_s": step_s,
                "time/unix": time.time(),  # wall clock at the step's end (reward vs wall time)
                "time/wait_for_buffer_s": wait[0],
                "time/train_s": train_s - wait[0],
                "time/weight_sync_s": sync_s,
                "time/checkpoint_s": ckpt_s,
            }
            line.update({f"train/{k}": v for k, v in metrics.items()})
            rewards = await buffer.request(Query(what="step_rewards", args={"step": str(step)}), Metrics)
            line.update(rewards.values)
            stats = await buffer.request(Query(what="stats"), Metrics)
            line.update(stats.values)
            self._write_metrics(line)

    def _gather(self, version: int) -> list[WeightUpdate]:
        """Collective on every rank; rank 0 gets the buckets."""
        bucket_bytes = int(self.cfg.trainer.weight_bucket_mb * (1 << 20))
        return list(self.trainer.weight_buckets(version, bucket_bytes))

    async def _checkpoint(self, buffer: Client, version: int) -> None:
        directory = self.run_dir / "checkpoints" / f"step_{version}"
        await asyncio.to_thread(self.trainer.save_checkpoint, directory / "trainer")
        if self.rank == 0:
            await buffer.request(Query(what="checkpoint", args={"dir": str(directory)}), Ack)
        await asyncio.to_thread(dist.barrier)
        if self.rank == 0:
            (directory / "done").write_text(json.dumps({"step": version, "time": time.time()}))

    async def _push_all(self, directory: Directory) -> None:
        await asyncio.gather(*(self._push(directory, w.actor_id) for w in directory.members("generator")))

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
                    await client.request(bucket, Ack, timeout=self.cfg.transport.request_timeout_s)
            except (KeyError, PeerLost, RequestTimeout, RemoteError):
                return  # it left or died; the watcher pushes again if it comes back
            self._synced[actor_id] = version

    async def _watch_generators(self, directory: Directory) -> None:
        """Bring generators that (re)joined up to the current version."""
        while True:
            await asyncio.sleep(self.cfg.transport.heartbeat_interval_s)
            current = {w.actor_id for w in directory.members("generator")}
            for actor_id in list(self._synced):
                if actor_id not in current:
                    del self._synced[actor_id]
            behind = [a for a in current if self._synced.get(a, -1) < (self._buckets[0].version if self._buckets else 0)]
            await asyncio.gather(*(self._push(directory, a) for a in behind))

    def _write_metrics(self, line: dict[str, float]) -> None:
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter as Writer

            self._writer = Writer(str(self.run_dir / "tensorboard"))
        step = int(line["step"])
        for key, value in line.items():
            if key != "step":
                self._writer.add_scalar(key, value, step)
        self._writer.flush()
