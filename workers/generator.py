"""The generator role: one inference engine serving GenerateRequests from every controller.

Why an actor around the engine: requests arrive one group at a time from several
controllers, but engines are fast only on batches, and weights must change only between
engine calls. So requests queue, a batching loop hands up to ``max_batch_prompts`` of
them (waiting ``batch_wait_ms``, or ``batch_wait_share`` of the last call if longer, for
company) to one engine call in a thread, and a weight update waits for the engine lock::

    controllers --GenerateRequest--> queue --(batch)--> engine.generate (thread) --> Completions
    trainer 0   --WeightUpdate buckets--> (all buckets of version v) --lock--> engine.update_weights
                                                                          --> Ack(v)

A request with ``min_policy_version`` v waits until the generator holds version v (the
on-policy mode); every completion reports the version that produced it.

Taking turns with training (the colocated and partial layouts): a colocated trainer rank
holds the engine between calls with ``paused()`` while it trains on the module the engine
generates with, then ``set_version``; a generator of the partial layout is put to sleep by
``Query("sleep")`` (it finishes the current call, then makes none, and the engine frees
what it can: vLLM's sleep mode on GPU) and wakes with the next weight update it applies.

Parked (a re-planned partial run whose new plan takes this generator's slot for training
or a judge, ``launch.placement.adapter``): ``Query("park")`` takes it out of the pool (it
deregisters: the controllers re-issue its in-flight requests elsewhere; those it holds fail)
and puts it to sleep, the process kept; ``Query("unpark")`` registers it again when a
later change gives the slot back, and trainer rank 0's push of the current weights wakes
it: a wake instead of a process start and a model load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator

import torch

from protocols.messages import (
    Ack,
    Completion,
    Completions,
    GenerateRequest,
    Message,
    Metrics,
    Query,
    WeightUpdate,
)
from workers.engines.base import Engine, PromptRequest, Sample
from yatt.errors import ProtocolError, YattError
from yatt.rl.config import GeneratorConfig
from yatt.runtime import trace
from yatt.runtime.actor import Actor, handles
from yatt.runtime.registry import Registration
from yatt.runtime.transport import Transport

logger = logging.getLogger(__name__)


class Generator(Actor):
    """Batches GenerateRequests into engine calls and applies versioned weight updates."""

    role = "generator"

    def __init__(
        self,
        transport: Transport,
        *,
        endpoint: str,
        engine: Engine,
        config: GeneratorConfig,
        version: int = 0,
        actor_id: str | None = None,
    ) -> None:
        super().__init__(transport, endpoint=endpoint, actor_id=actor_id)
        self.engine = engine
        self.gen_config = config
        self.version = version
        self._queue: asyncio.Queue[tuple[GenerateRequest, asyncio.Future[Completions]]] = asyncio.Queue()
        self._engine_lock = asyncio.Lock()
        self._version_changed = asyncio.Condition()
        self.incarnation = 0  # of the trainer group whose weights the engine holds
        self._buckets: dict[tuple[int, int], dict[int, WeightUpdate]] = {}  # (incarnation, version) -> index -> bucket
        self.generate_s = 0.0  # time inside engine.generate
        self.sync_s = 0.0  # time inside engine.update_weights
        self.tokens = 0
        self.batches = 0
        self._last_call_s = 0.0
        self._awake = asyncio.Event()
        self._awake.set()
        self.sleeps = 0
        self.registration: Registration | None = None
        """Its entry in the registry (set by whoever registers it): parking leaves it."""
        self.parks = 0  # times parked; a request that began before a park fails
        self._parked = False
        self._pending: set[asyncio.Future[Completions]] = set()  # requests queued or in a batch

    async def on_start(self) -> None:
        self.spawn(self._batching(), name="batching")

    @handles(GenerateRequest)
    async def generate(self, msg: GenerateRequest) -> Completions:
        if msg.n < 1:
            raise ProtocolError(f"GenerateRequest.n must be >= 1 (got {msg.n})")
        if msg.prompt_ids.ndim != 1 or msg.prompt_ids.numel() == 0:
            raise ProtocolError(f"GenerateRequest.prompt_ids must be a non-empty [P] tensor (got {list(msg.prompt_ids.shape)})")
        parks = self.parks
        async with self._version_changed:
            await self._version_changed.wait_for(lambda: self.version >= msg.min_policy_version or self.parks != parks)
        if self._parked or self.parks != parks:
            raise self._parked_error()
        future: asyncio.Future[Completions] = asyncio.get_running_loop().create_future()
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        await self._queue.put((msg, future))
        return await future

    async def _batching(self) -> None:
        max_batch = self.gen_config.max_batch_prompts
        while True:
            batch = [await self._queue.get()]
            wait_s = max(self.gen_config.batch_wait_ms / 1000, self.gen_config.batch_wait_share * self._last_call_s)
            deadline = time.monotonic() + wait_s
            while len(batch) < max_batch:
                timeout = deadline - time.monotonic()
                if timeout <= 0 and self._queue.empty():
                    break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), max(timeout, 0)))
                except asyncio.TimeoutError:
                    break
            batch = [(msg, fut) for msg, fut in batch if not fut.done()]  # the requester gave up
            if batch:
                await self._run(batch)

    async def _run(self, batch: list[tuple[GenerateRequest, asyncio.Future[Completions]]]) -> None:
        await self._awake.wait()
        batch = [(msg, fut) for msg, fut in batch if not fut.done()]  # failed by a park meanwhile
        if not batch:
            return
        requests = [
            PromptRequest(
                prompt_ids=msg.prompt_ids.tolist(), n=msg.n, sampling=msg.sampling, mm_inputs=msg.mm_inputs,
                images=msg.images,
            )
            for msg, _ in batch
        ]
        failed: Exception | None = None
        async with self._engine_lock:
            version = self.version
            start = time.perf_counter()
            try:
                with trace.span("generate"):
                    results = await asyncio.to_thread(self.engine.generate, requests)
            except Exception as e:  # a bad batch fails its requests, not the worker
                failed = e
            else:
                self._last_call_s = time.perf_counter() - start
                self.generate_s += self._last_call_s
        if failed is not None:
            if len(batch) == 1:
                if not batch[0][1].done():
                    batch[0][1].set_exception(failed)
                return
            # One bad request (a token id past the vocabulary) must not fail its batch-mates.
            logger.warning("generator: a batch of %d failed (%s); running each request alone", len(batch), failed)
            for one in batch:
                await self._run([one])
            return
        self.batches += 1
        for (msg, fut), samples in zip(batch, results, strict=True):
            self.tokens += sum(len(s.token_ids) for s in samples)
            if not fut.done():
                fut.set_result(Completions(group_key=msg.group_key, completions=[_completion(s, version) for s in samples]))

    @handles(WeightUpdate, serial=True)
    async def weights(self, msg: WeightUpdate) -> Ack:
        if msg.incarnation < self.incarnation:
            raise ProtocolError(
                f"WeightUpdate.incarnation={msg.incarnation}: the trainer group of incarnation "
                f"{self.incarnation} replaced it; its weights are not taken"
            )
        if msg.incarnation == self.incarnation and msg.version <= self.version:
            return Ack(seq=msg.version, info={"status": "already applied"})
        if len(msg.names) != len(msg.tensors):
            raise ProtocolError(f"WeightUpdate has {len(msg.names)} names but {len(msg.tensors)} tensors")
        if not 0 <= msg.bucket_index < msg.num_buckets:
            raise ProtocolError(f"WeightUpdate.bucket_index={msg.bucket_index} is outside 0..{msg.num_buckets - 1}")
        label = (msg.incarnation, msg.version)
        buckets = self._buckets.setdefault(label, {})
        buckets[msg.bucket_index] = msg
        if len(buckets) < msg.num_buckets:
            return Ack(seq=msg.version, info={"status": f"bucket {msg.bucket_index + 1}/{msg.num_buckets}"})
        del self._buckets[label]
        for old in [v for v in self._buckets if v < label]:
            del self._buckets[old]  # an update that never completed was overtaken

        def named() -> Iterator[tuple[str, torch.Tensor]]:
            for i in range(msg.num_buckets):
                yield from zip(buckets[i].names, buckets[i].tensors, strict=True)

        async with self._engine_lock:
            start = time.perf_counter()
            if not self._awake.is_set():
                await asyncio.to_thread(self.engine.wake_up)  # weights back before they are written
            with trace.span("weight_load"):
                await asyncio.to_thread(self.engine.update_weights, named())
            self.sync_s += time.perf_counter() - start
            self.incarnation = msg.incarnation
            await self.set_version(msg.version)
        self._awake.set()
        return Ack(seq=msg.version, info={"status": "applied"})

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """Hold the engine between two calls (waits for the current one to finish): the
        colocated trainer rank trains on the engine's own module meanwhile."""
        async with self._engine_lock:
            yield

    async def set_version(self, version: int) -> None:
        """The engine now runs the weights of ``version`` (the colocated rank's own policy,
        or a weight update just applied); requests waiting for it go ahead."""
        async with self._version_changed:
            self.version = version
            self._version_changed.notify_all()

    async def _sleep(self) -> None:
        """Make no engine call until the next applied weight update; returns once idle."""
        self._awake.clear()
        async with self._engine_lock:
            if not self._awake.is_set():
                await asyncio.to_thread(self.engine.sleep)
        self.sleeps += 1

    async def _park(self) -> None:
        """Leave the pool and sleep, the process and its engine kept (module docstring)."""
        if self._parked:
            return
        if self.registration is None:
            raise ProtocolError(f"Query('park'): {self.actor_id} is not registered by its own process (a colocated engine): it cannot leave the pool")
        self._parked = True
        self.parks += 1
        with trace.span("park"):
            await self.registration.close()  # the pool's controllers re-issue what it has in flight
            async with self._version_changed:
                self._version_changed.notify_all()  # requests waiting for a version fail now
            for fut in list(self._pending):  # queued, or in a batch that waits for the engine
                fut.set_exception(self._parked_error())
            await self._sleep()

    def _parked_error(self) -> YattError:
        return YattError(f"{self.actor_id} was parked (out of the pool): the request goes to another generator")

    async def _unpark(self) -> None:
        """Back in the pool; asleep until the trainer's weight push (it is behind)."""
        if not self._parked:
            return
        self._parked = False
        if self.registration is not None:
            with trace.span("unpark"):
                await self.registration.start(timeout=self.transport.config.request_timeout_s)

    @handles(Query)
    async def query(self, msg: Query) -> Message:
        if msg.what == "version":
            return Ack(seq=self.version)
        if msg.what == "sleep":
            await self._sleep()
            return Ack(seq=self.version, info={"status": "asleep"})
        if msg.what == "wake":
            async with self._engine_lock:
                if not self._awake.is_set():
                    await asyncio.to_thread(self.engine.wake_up)
            self._awake.set()
            return Ack(seq=self.version, info={"status": "awake"})
        if msg.what == "park":
            await self._park()
            return Ack(seq=self.version, info={"status": "parked"})
        if msg.what == "unpark":
            await self._unpark()
            return Ack(seq=self.version, info={"status": "in the pool"})
        if msg.what == "stats":
            return Metrics(
                values={
                    "generator/version": float(self.version),
                    "generator/generate_s": self.generate_s,
                    "generator/weight_sync_s": self.sync_s,
                    "generator/tokens": float(self.tokens),
                    "generator/batches": float(self.batches),
                    "generator/queued": float(self._queue.qsize()),
                    "generator/sleeps": float(self.sleeps),
                    "generator/parks": float(self.parks),
                    # (the transformers engine's shared prefills; vLLM's prefix cache does its own)
                    "generator/prompt_tokens_saved": float(getattr(self.engine, "prompt_tokens_saved", 0)),
                }
            )
        raise ValueError(f"generator: unknown query {msg.what!r}; known: version, sleep, wake, park, unpark, stats")

    async def on_stop(self) -> None:
        while not self._queue.empty():
            _, fut = self._queue.get_nowait()
            fut.cancel()
        await asyncio.to_thread(self.engine.close)


def _completion(sample: Sample, version: int) -> Completion:
    return Completion(
        token_ids=torch.tensor(sample.token_ids, dtype=torch.int32),
        logprobs=torch.tensor(sample.logprobs, dtype=torch.float32),
        finish_reason=sample.finish_reason,
        policy_version_min=version,
        policy_version_max=version,
    )

