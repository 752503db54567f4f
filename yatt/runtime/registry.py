"""The service directory: who is in the run, at which endpoint, in which role, still alive.

Why it exists: workers come and go at run time (placement moves them between roles, a
crashed one restarts elsewhere), so no one may hold a fixed list of endpoints. Instead::

    worker ── Registration ──Register/heartbeats/Deregister──> Registry (an Actor)
                                                                 │ drops the silent
    controller ── Directory <──Membership(epoch) over PUB────────┘ (+ Query("members"))
                     │
                     └─ pick("generator") -> the Client with the fewest requests in flight

The ``Registry`` holds the membership, bumps ``epoch`` on every change and publishes it
(and re-publishes it every heartbeat interval, so a subscriber that joined late
catches up). A ``Registration`` keeps one actor in it, and a ``Directory`` is a live,
client-side view with one ``Client`` per member for load balancing; a member that leaves
has its in-flight requests failed with ``PeerLost``, so callers re-issue them.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

import zmq

from protocols.messages import Ack, Deregister, Heartbeat, Membership, Message, Query, Register, WorkerInfo
from yatt.errors import Closed, PeerLost, ProtocolError, RemoteError, RequestTimeout, TransportError
from yatt.runtime.actor import Actor, Client, handles
from yatt.runtime.streams import Publisher, Subscriber
from yatt.runtime.transport import Transport

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=Message)

ENDPOINT = re.compile(r"tcp://[^\s:/]+:\d{1,5}|tcp://\[[0-9a-fA-F:]+\]:\d{1,5}|ipc://\S+|inproc://\S+")
"""What a member's endpoint may be (anything else is refused at Register: no socket reaches it)."""



AFFINITY_SLACK = 4
"""Requests in flight a preferred member may have beyond the least busy one and still be
picked (``Directory.pick(prefer=)``): enough to keep an episode's turns on one engine
under an even load, not so many that one engine queues while another idles."""

class Registry(Actor):
    """The membership of a run: answers Register, Deregister and Query; publishes Membership."""

    role = "registry"

    def __init__(
        self, transport: Transport, *, endpoint: str, publish_endpoint: str, actor_id: str | None = None
    ) -> None:
        super().__init__(transport, endpoint=endpoint, actor_id=actor_id)
        self._publish_endpoint = publish_endpoint
        self._publisher: Publisher | None = None
        self._members: dict[str, WorkerInfo] = {}
        self._last_seen: dict[str, float] = {}
        self.epoch = 0
        """Grows by one on every change of the membership."""

    @property
    def publish_endpoint(self) -> str:
        """Where Membership is published (port resolved); only after start."""
        if self._publisher is None:
            raise RuntimeError("the registry publishes only after start()")
        return self._publisher.endpoint

    def members(self) -> list[WorkerInfo]:
        return list(self._members.values())

    def membership(self) -> Membership:
        return Membership(epoch=self.epoch, workers=self.members())

    async def on_start(self) -> None:
        self._publisher = Publisher(self.transport, self._publish_endpoint)
        self.spawn(self._sweep(), name="sweep")

    async def on_stop(self) -> None:
        if self._publisher is not None:
            self._publisher.close()

    def on_heartbeat(self, beat: Heartbeat) -> None:
        if beat.actor_id in self._members:
            self._last_seen[beat.actor_id] = asyncio.get_running_loop().time()

    @handles(Register)
    async def _register(self, msg: Register) -> Ack:
        worker = msg.worker
        if not worker.actor_id or not worker.role or not ENDPOINT.fullmatch(worker.endpoint):
            raise ProtocolError(
                f"Register.worker: actor_id and role must be non-empty and endpoint tcp://HOST:PORT, "
                f"ipc://PATH or inproc://NAME (got {worker.actor_id!r}, {worker.role!r}, {worker.endpoint!r:.100})"
            )
        self._last_seen[worker.actor_id] = asyncio.get_running_loop().time()
        if self._members.get(worker.actor_id) != worker:
            self._members[worker.actor_id] = worker
            logger.info("registry: %s joined as %s at %s", worker.actor_id, worker.role, worker.endpoint)
            await self._changed()
        return Ack(seq=self.epoch)

    @handles(Deregister)
    async def _deregister(self, msg: Deregister) -> Ack:
        if self._members.pop(msg.actor_id, None) is not None:
            self._last_seen.pop(msg.actor_id, None)
            logger.info("registry: %s left", msg.actor_id)
            await self._changed()
        return Ack(seq=self.epoch)

    async def drop_process(self, pid: int) -> list[str]:
        """Drop at once the members served by process ``pid`` (their ``pid`` meta), which
        its launcher saw exit: peers re-issue their work now, not after the heartbeat limit."""
        dead = [a for a, w in self._members.items() if w.meta.get("pid") == str(pid)]
        for actor_id in dead:
            self._last_seen.pop(actor_id, None)
            worker = self._members.pop(actor_id)
            logger.info("registry: %s (%s) left with its process %d", actor_id, worker.role, pid)
        if dead:
            await self._changed()
        return dead

    @handles(Query)
    async def _query(self, msg: Query) -> Message:
        if msg.what == "members":
            return self.membership()
        if msg.what == "publisher":
            return Ack(seq=self.epoch, info={"endpoint": self.publish_endpoint})
        raise ValueError(f"the registry answers Query(what='members' | 'publisher'), not {msg.what!r}")

    async def _changed(self) -> None:
        self.epoch += 1
        assert self._publisher is not None
        await self._publisher.publish(self.membership())

    async def _sweep(self) -> None:
        """Drop members silent past the limit; re-publish the membership every interval."""
        interval = self.transport.config.heartbeat_interval_s
        limit = self.transport.config.peer_silence_limit_s
        loop = asyncio.get_running_loop()
        assert self._publisher is not None
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            silent = [a for a, seen in self._last_seen.items() if now - seen > limit]
            for actor_id in silent:
                del self._last_seen[actor_id]
                worker = self._members.pop(actor_id)
                logger.warning("registry: %s (%s) missed its heartbeats; dropped", actor_id, worker.role)
            if silent:
                await self._changed()
            else:
                await self._publisher.publish(self.membership())


class Registration:
    """Keeps one actor in the registry: Register on start, heartbeats while open (the
    client's own), Register again now and then (in case the registry lost it), and
    Deregister on close."""

    def __init__(self, transport: Transport, registry_endpoint: str, worker: WorkerInfo) -> None:
        self.transport = transport
        self.worker = worker
        self.registry_endpoint = registry_endpoint
        self._client: Client | None = None
        self._watch: asyncio.Task[None] | None = None

    async def start(self, timeout: float | None = None) -> None:
        """Register (waiting for the registry's Ack)."""
        self._client = Client(self.transport, self.registry_endpoint, name=self.worker.actor_id)
        try:
            await self._client.request(Register(worker=self.worker), Ack, timeout=timeout)
        except BaseException:
            await self._client.close()
            raise
        self._watch = asyncio.get_running_loop().create_task(self._reregister(self._client))

    async def _reregister(self, client: Client) -> None:
        """Register again as soon as the registry restarted (its heartbeats carry a new
        actor id), and every ``heartbeat_misses`` beats anyway: Register is idempotent,
        and that brings the actor back if a stall once made the registry drop it."""
        config = self.transport.config
        registry_id = client.peer_id
        beats = 0
        while True:
            await asyncio.sleep(config.heartbeat_interval_s)
            beats += 1
            registry_id = registry_id or client.peer_id  # None until its first heartbeat
            restarted = client.peer_id != registry_id
            if not client.alive or not (restarted or beats >= config.heartbeat_misses):
                continue
            try:
                await client.request(Register(worker=self.worker), Ack, timeout=config.peer_silence_limit_s)
            except (PeerLost, RequestTimeout, RemoteError) as e:
                logger.warning("%s: registering again failed (%s); will retry", self.worker.actor_id, e)
                continue
            if restarted:
                logger.info(
                    "%s: registered with the restarted registry %s", self.worker.actor_id, client.peer_id
                )
            registry_id, beats = client.peer_id, 0

    async def close(self, timeout: float = 2.0) -> None:
        """Deregister (best effort within ``timeout``) and stop heartbeating."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
            self._watch = None
        client, self._client = self._client, None
        if client is None:
            return
        try:
            await client.request(Deregister(actor_id=self.worker.actor_id), Ack, timeout=timeout)
        except (PeerLost, RequestTimeout, RemoteError, Closed) as e:
            logger.warning(
                "%s: could not deregister (%s); the registry drops it when heartbeats stop",
                self.worker.actor_id,
                e,
            )
        finally:
            await client.close()

    async def __aenter__(self) -> Registration:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class Directory:
    """A live view of the registry's membership with one ``Client`` per member."""

    def __init__(self, transport: Transport, registry_endpoint: str, *, name: str = "directory") -> None:
        self.transport = transport
        self.registry_endpoint = registry_endpoint
        self.name = name
        self.epoch = -1
        """Epoch of the membership last applied; -1 before the first."""
        self._members: dict[str, WorkerInfo] = {}
        self._clients: dict[str, Client] = {}
        self._registry: Client | None = None
        self._subscriber: Subscriber | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Condition()
        self._applying = asyncio.Lock()
        self._retired: set[Client] = set()  # dropped from the view, still being closed
        self._turn = 0

    async def start(self, timeout: float | None = None) -> None:
        """Subscribe to the registry's broadcasts and load the current membership."""
        self._registry = Client(self.transport, self.registry_endpoint, name=f"{self.name}->registry")
        try:
            info = await self._registry.request(Query(what="publisher"), Ack, timeout=timeout)
            self._subscriber = Subscriber(self.transport, info.info["endpoint"], [Membership])
            await self._refresh(timeout)
        except BaseException:
            await self.close()
            raise
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._listen()), loop.create_task(self._watch_registry())]

    async def _refresh(self, timeout: float | None = None) -> None:
        assert self._registry is not None
        await self._apply(await self._registry.request(Query(what="members"), Membership, timeout=timeout))

    async def _listen(self) -> None:
        assert self._subscriber is not None
        while True:
            msg = await self._subscriber.recv()
            assert isinstance(msg, Membership)  # the only kind subscribed to
            await self._apply(msg)

    async def _watch_registry(self) -> None:
        """A restarted registry counts epochs from 0 again: when its heartbeats carry a new
        actor id, or it answers again after being lost, forget the epoch and reload."""
        registry = self._registry
        assert registry is not None
        registry_id, was_alive = registry.peer_id, True
        while True:
            await asyncio.sleep(self.transport.config.heartbeat_interval_s)
            alive = registry.alive
            registry_id = registry_id or registry.peer_id  # None until its first heartbeat
            if alive and (not was_alive or registry.peer_id != registry_id):
                logger.info(
                    "%s: registry restarted or back (%s); reloading the membership",
                    self.name,
                    registry.peer_id,
                )
                self.epoch = -1
                try:
                    await self._refresh(self.transport.config.peer_silence_limit_s)
                    registry_id = registry.peer_id
                except (PeerLost, RequestTimeout, RemoteError) as e:
                    logger.warning("%s: reloading the membership failed: %s", self.name, e)
                    alive = False
            was_alive = alive

    async def _apply(self, membership: Membership) -> None:
        async with self._applying:
            if membership.epoch <= self.epoch:
                return  # a re-publication, or older than what we have
            self.epoch = membership.epoch
            new = {w.actor_id: w for w in membership.workers}
            gone = []
            # No await until members and clients agree again: pick() may run at any await.
            for actor_id, old in self._members.items():
                if new.get(actor_id) != old and actor_id in self._clients:
                    client = self._clients.pop(actor_id)
                    client.lose("left the directory" if actor_id not in new else "re-registered")
                    gone.append(client)  # its in-flight requests fail with PeerLost, for re-issue
                    self._retired.add(client)
            for actor_id, worker in list(new.items()):
                if actor_id not in self._clients:
                    try:
                        self._clients[actor_id] = Client(self.transport, worker.endpoint, name=self.name)
                    except (TransportError, zmq.ZMQError, ValueError) as e:  # no socket reaches it: not in the view
                        logger.warning("%s: leaving out %s: cannot connect to %r (%s)", self.name, actor_id, worker.endpoint, e)
                        del new[actor_id]
            self._members = new
            async with self._changed:
                self._changed.notify_all()
            for client in gone:
                await client.close()
                self._retired.discard(client)

    # ------------------------------------------------------------ the view

    def members(self, role: str | None = None) -> list[WorkerInfo]:
        """Members (of ``role``), in registration order."""
        return [w for w in self._members.values() if role is None or w.role == role]

    def client(self, actor_id: str) -> Client:
        """The client of one member; ``KeyError`` naming the members if it is not one."""
        try:
            return self._clients[actor_id]
        except KeyError:
            raise KeyError(
                f"{actor_id!r} is not in the directory (members: {sorted(self._clients)})"
            ) from None

    def pick(self, role: str, *, prefer: str | None = None) -> Client:
        """The live member of ``role`` with the fewest requests in flight (ties rotate); the
        member at endpoint ``prefer`` instead while it is live and has at most
        ``AFFINITY_SLACK`` more requests in flight (an episode's next turn goes where its
        previous turns are cached).

        Raises ``TransportError`` if there is none; ``wait_until`` waits for one.
        """
        live = [self._clients[w.actor_id] for w in self.members(role) if self._clients[w.actor_id].alive]
        if not live:
            roles = sorted({w.role for w in self._members.values()})
            raise TransportError(
                f"no live {role!r} in the directory at epoch {self.epoch} (roles present: {roles})"
            )
        self._turn += 1
        start = self._turn % len(live)
        rotated = live[start:] + live[:start]
        best = min(rotated, key=lambda c: c.in_flight)
        preferred = next((c for c in live if c.endpoint == prefer), None)
        if preferred is not None and preferred.in_flight <= best.in_flight + AFFINITY_SLACK:
            return preferred
        return best

    async def wait_until(self, predicate: Callable[[Directory], bool], timeout: float) -> None:
        """Wait until ``predicate(self)`` holds, e.g. ``lambda d: len(d.members("generator")) >= 2``."""
        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(lambda: predicate(self)), timeout)
        except asyncio.TimeoutError:
            have = {w.actor_id: w.role for w in self._members.values()}
            raise RequestTimeout(
                f"{self.name}: condition not met within {timeout} s; members at epoch {self.epoch}: {have}"
            ) from None

    async def request(self, role: str, msg: Message, expect: type[R], *, timeout: float | None, within: float) -> R:
        """Send an idempotent request to a live member of ``role``; when that member is lost
        (it died, or is being restarted), wait for a live one and send again, for up to
        ``within`` seconds in all. ``timeout``: the deadline of one try (``math.inf`` for a
        long wait that only the member's heartbeats end)."""
        deadline = time.monotonic() + within
        while True:
            try:
                await self.wait_for_live(role, timeout=max(0.0, deadline - time.monotonic()))
                return await self.pick(role).request(msg, expect, timeout=timeout)
            except (PeerLost, RequestTimeout, TransportError) as e:
                if time.monotonic() >= deadline:
                    raise
                logger.warning("%s: %s request to the %s failed (%s); sending it again", self.name, type(msg).__name__, role, e)
                await self.pause_before_retry(e)

    async def wait_for_live(self, role: str, timeout: float) -> None:
        """Until some member of ``role`` is live (at once if one is); ``RequestTimeout`` after ``timeout``."""
        if not any(self._clients[w.actor_id].alive for w in self.members(role)):
            await self.wait_until(lambda d: any(d._clients[w.actor_id].alive for w in d.members(role)), timeout=timeout)

    async def pause_before_retry(self, error: Exception) -> None:
        """Before a failed request is sent again: nothing when its member is gone (``PeerLost``:
        it left the directory or went silent, so the next try picks a live one or waits for
        one, a restarted one included); a heartbeat interval after a timeout or a transport
        error, which could repeat at once."""
        if not isinstance(error, PeerLost):
            await asyncio.sleep(self.transport.config.heartbeat_interval_s)

    async def close(self) -> None:
        """Stop listening and close every member's client and the registry's."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        clients = [*self._clients.values(), *self._retired]
        self._clients.clear()
        self._retired.clear()
        for client in clients:
            await client.close()
        if self._subscriber is not None:
            self._subscriber.close()
        if self._registry is not None:
            await self._registry.close()

    async def __aenter__(self) -> Directory:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
