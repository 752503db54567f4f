"""Actors: asyncio objects that serve typed messages on a ROUTER, and the client that calls them.

Why it exists: every yatt role (generator, reward, buffer, trainer rank, registry) is a
server of a few message types, and every controller is a client of many servers. This
module is the one place that turns frames into handler calls and replies back into
awaited results, with the failure modes spelled out: a handler that raises, a frame that
does not decode, a reply that never comes, a peer that dies.

The envelope is the runtime's; the codec frames follow it untouched::

    client DEALER  --[request id: 8 bytes LE][kind][header][tensor...]-->  ROUTER actor
                   <-[request id]            [kind][header][tensor...]---  (reply or Error)

Request id 0 means no reply is due: heartbeats (which the actor answers at once with a
heartbeat of its own, even while handlers run) and one-way ``Client.tell`` messages.
A ``Client`` keeps any number of requests in flight, each with a deadline
(``RequestTimeout``); cancelling the awaiting task forgets the request and a late reply
is dropped. A peer silent for ``heartbeat_misses`` intervals is lost: its in-flight
requests fail with ``PeerLost`` so the caller can re-issue them elsewhere.

Handlers are ``async`` methods marked ``@handles(MessageType)``; they return the reply, or
``None`` for an ``Ack``. Concurrent handlers run as tasks; ``serial=True`` handlers run
one at a time in arrival order (stream receivers, see ``yatt.runtime.streams``). Handlers must not
block the event loop (run engine calls in a thread), or heartbeats stop and peers give up.
"""

from __future__ import annotations

import asyncio
import logging
import math
import traceback
import uuid
from collections.abc import Awaitable, Callable, Collection, Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar, TypeVar, overload

import zmq

from protocols.codec import decode, encode
from protocols.messages import Ack, Error, Heartbeat, Message, Shutdown, WorkerInfo
from yatt.errors import ActorFailed, Closed, PeerLost, ProtocolError, RemoteError, RequestTimeout
from yatt.runtime.transport import Socket, Transport, bound_endpoint

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)
Handler = Callable[[Any], Awaitable[Message | None]]
F = TypeVar("F", bound=Callable[..., Awaitable[Message | None]])
_A = TypeVar("_A", bound="Actor")

NO_REPLY = bytes(8)  # request id 0: nothing is due back
_ACK_FRAMES = encode(Ack())  # the reply of every handler that returns None, encoded once
_MARK = "_yatt_handles"
RECANCEL_S = 1.0
"""How long ``cancel`` waits for a task it cancelled before cancelling it again."""


async def cancel(tasks: Collection[asyncio.Future[Any]]) -> None:
    """Cancel ``tasks`` and wait until each is done, cancelling again those still running
    after ``RECANCEL_S``: Python 3.11's ``asyncio.wait_for`` turns a cancellation that comes
    as the awaitable it waits on completes into that awaitable's outcome (gh-86296, fixed in
    3.12), and a task that retries on that outcome runs on. A controller whose request to
    the buffer failed (``PeerLost``: the buffer stopping too) in the turn its own SIGTERM
    came re-issued it and waited for a buffer that never came back, until the launcher
    killed it after its 15 s grace: the 15 s a run sometimes took to stop after its last step."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    await asyncio.gather(*tasks, return_exceptions=True)  # their errors retrieved (none logged as never retrieved)


def request_id(n: int) -> bytes:
    return n.to_bytes(8, "little")


def handles(msg_type: type[Message], *, serial: bool = False) -> Callable[[F], F]:
    """Mark an ``async def method(self, msg)`` of an ``Actor`` as the handler of ``msg_type``.

    ``serial``: handle one message at a time in arrival order (for stream items);
    otherwise each message is handled in its own task.
    """

    def mark(fn: F) -> F:
        vars(fn)[_MARK] = (msg_type, serial)
        return fn

    return mark


@dataclass
class _Route:
    fn: Handler
    queue: asyncio.Queue[tuple[bytes, bytes, Message]] | None  # set for serial handlers


class Actor:
    """A server of typed messages on one ROUTER socket.

    Subclass, set ``role``, mark handlers with ``@handles``; override ``on_start`` /
    ``on_stop`` for setup and teardown (``spawn`` background tasks there). Then
    ``async with MyActor(transport, endpoint="tcp://127.0.0.1:*") as actor:`` serves until
    the block ends, ``close()`` is called or a ``Shutdown`` message arrives.
    """

    role: ClassVar[str] = "actor"
    _marked: ClassVar[dict[type[Message], tuple[str, bool]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        marked = dict(cls._marked)
        for name, value in vars(cls).items():
            spec = getattr(value, _MARK, None)
            if spec is not None:
                marked[spec[0]] = (name, spec[1])
        cls._marked = marked

    def __init__(self, transport: Transport, *, endpoint: str, actor_id: str | None = None) -> None:
        self.transport = transport
        self.actor_id = actor_id or f"{self.role}-{uuid.uuid4().hex[:8]}"
        self._requested_endpoint = endpoint
        self._endpoint: str | None = None
        self._routes: dict[type[Message], _Route] = {}
        self._sock: Socket | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started = False
        self._closing = False
        self._closed = asyncio.Event()
        self._failure: BaseException | None = None
        self._close_task: asyncio.Task[None] | None = None
        self.add_handler(Shutdown, self._on_shutdown)
        for msg_type, (name, serial) in self._marked.items():
            self.add_handler(msg_type, getattr(self, name), serial=serial)

    # ------------------------------------------------------------ set-up

    def add_handler(
        self, msg_type: type[M], fn: Callable[[M], Awaitable[Message | None]], *, serial: bool = False
    ) -> None:
        """Serve ``msg_type`` with ``fn`` (replacing any handler it had); before ``start``."""
        if self._started:
            raise RuntimeError(f"{self.actor_id}: add handlers before start()")
        self._routes[msg_type] = _Route(fn, asyncio.Queue() if serial else None)

    @property
    def endpoint(self) -> str:
        """Where the ROUTER listens, port resolved; only after ``start``."""
        if self._endpoint is None:
            raise RuntimeError(f"{self.actor_id} has no endpoint before start()")
        return self._endpoint

    def info(self, **meta: str) -> WorkerInfo:
        """This actor as a service-directory entry."""
        return WorkerInfo(actor_id=self.actor_id, role=self.role, endpoint=self.endpoint, meta=meta)

    async def start(self) -> str:
        """Bind, start serving and run ``on_start``; returns the bound endpoint."""
        if self._started:
            raise RuntimeError(f"{self.actor_id} is already started")
        self._started = True
        self._sock = self.transport.socket(zmq.ROUTER, bind=self._requested_endpoint)
        self._endpoint = bound_endpoint(self._sock)
        try:
            await self.on_start()
        except BaseException:
            await self.close()
            raise
        self.spawn(self._serve(self._sock), name="serve")
        for msg_type, route in self._routes.items():
            if route.queue is not None:
                self.spawn(self._serve_serial(route.fn, route.queue), name=f"serial {msg_type.__name__}")
        logger.debug("%s serving on %s", self.actor_id, self._endpoint)
        return self._endpoint

    async def on_start(self) -> None:
        """Subclass hook: runs after the ROUTER is bound, before the first message is served."""

    async def on_stop(self) -> None:
        """Subclass hook: runs at close, before tasks are cancelled and sockets closed."""

    def on_heartbeat(self, beat: Heartbeat) -> None:
        """Subclass hook: a peer's heartbeat arrived (the registry counts them)."""

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str = "") -> asyncio.Task[Any]:
        """Run ``coro`` as a task owned by this actor: cancelled at close; if it crashes,
        the actor closes and ``wait_closed`` raises ``ActorFailed`` with its traceback."""
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.actor_id} {name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not self._closing:
            logger.error("%s: task %r crashed", self.actor_id, task.get_name(), exc_info=exc)
            self._failure = exc
            self._close_soon()

    def _close_soon(self) -> None:
        if self._close_task is None:
            self._close_task = asyncio.get_running_loop().create_task(self.close())

    # ------------------------------------------------------------ serving

    async def _serve(self, sock: Socket) -> None:
        limit = self.transport.config.max_frame_bytes
        routes = self._routes
        tasks = self._tasks
        loop = asyncio.get_running_loop()
        while True:
            frames = await sock.recv_multipart(copy=False)
            # [peer routing id][request id][kind][header][tensor...]
            if len(frames) < 3 or len(frames[1]) != 8:
                logger.warning(
                    "%s: dropped a message with a broken envelope (%d frames)", self.actor_id, len(frames)
                )
                continue
            peer, rid = frames[0].bytes, frames[1].bytes
            try:
                msg = decode(frames[2:], max_frame_bytes=limit)
            except ProtocolError as e:
                logger.warning("%s: undecodable message: %s", self.actor_id, e)
                if rid != NO_REPLY:
                    await self._reply(
                        peer, rid, encode(Error(error_type="ProtocolError", message=str(e), traceback=""))
                    )
                continue
            if type(msg) is Heartbeat:
                self.on_heartbeat(msg)
                beat = encode(Heartbeat(actor_id=self.actor_id, seq=msg.seq))
                await self._reply(peer, NO_REPLY, beat)
                continue
            route = routes.get(type(msg))
            if route is None:
                known = sorted(t.__name__ for t in routes)
                err = f"{self.actor_id} ({self.role}) has no handler for {type(msg).__name__}; it handles {known}"
                logger.warning("%s", err)
                if rid != NO_REPLY:
                    await self._reply(
                        peer, rid, encode(Error(error_type="NoHandler", message=err, traceback=""))
                    )
            elif route.queue is not None:
                route.queue.put_nowait((peer, rid, msg))
            else:
                task = loop.create_task(self._handle(route.fn, peer, rid, msg))
                tasks.add(task)
                task.add_done_callback(tasks.discard)  # _handle never raises but on cancel

    async def _serve_serial(self, fn: Handler, queue: asyncio.Queue[tuple[bytes, bytes, Message]]) -> None:
        while True:
            peer, rid, msg = await queue.get()
            await self._handle(fn, peer, rid, msg)

    async def _handle(self, fn: Handler, peer: bytes, rid: bytes, msg: Message) -> None:
        try:
            reply = await fn(msg)
            frames = _ACK_FRAMES if reply is None else encode(reply)
        except Exception as e:  # a handler's failure goes back to the requester, not up
            if rid == NO_REPLY:
                logger.exception("%s: handler of one-way %s raised", self.actor_id, type(msg).__name__)
                return
            logger.warning(
                "%s: handler of %s raised %s: %s", self.actor_id, type(msg).__name__, type(e).__name__, e
            )
            frames = encode(
                Error(error_type=type(e).__name__, message=str(e), traceback=traceback.format_exc())
            )
        if rid != NO_REPLY:
            await self._reply(peer, rid, frames)

    async def _reply(self, peer: bytes, rid: bytes, frames: list[bytes | memoryview]) -> None:
        sock = self._sock
        if sock is not None and not sock.closed:
            # A ROUTER never blocks: a reply to a peer that is gone or over its HWM is dropped.
            await sock.send_multipart([peer, rid, *frames], copy=False)

    async def _on_shutdown(self, msg: Shutdown) -> None:
        logger.info("%s: shutdown requested%s", self.actor_id, f" ({msg.reason})" if msg.reason else "")
        # The close task starts on the next loop turn; by then this handler's Ack is on the
        # socket (a ROUTER send never suspends), and the socket's linger flushes it.
        self._close_soon()

    # ------------------------------------------------------------ shutdown

    async def close(self) -> None:
        """Run ``on_stop``, cancel every task, close the ROUTER; idempotent."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        try:
            if self._started:
                await self.on_stop()
        finally:
            current = asyncio.current_task()
            await cancel([t for t in self._tasks if t is not current])
            if self._sock is not None:
                self.transport.close_socket(self._sock)
            self._closed.set()

    async def wait_closed(self) -> None:
        """Wait until the actor has closed; raises ``ActorFailed`` if one of its tasks crashed."""
        await self._closed.wait()
        if self._failure is not None:
            tb = "".join(traceback.format_exception(self._failure))
            raise ActorFailed(f"{self.actor_id} failed:\n{tb}") from self._failure

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def __aenter__(self: _A) -> _A:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


def _beat_sent(sent: asyncio.Future[Any]) -> None:
    if sent.cancelled():
        return
    error = sent.exception()
    if error is not None and not isinstance(error, zmq.Again):  # Again: the peer is not reading
        logger.warning("heartbeat not sent: %s", error)


class Client:
    """Requests to one actor over a DEALER: many in flight, deadlines, liveness.

    ``name`` goes into the heartbeats this client sends (the registry uses it to tell
    members apart). The client is usable once made; ``close()`` fails what is in flight.
    """

    def __init__(self, transport: Transport, endpoint: str, *, name: str = "") -> None:
        self.transport = transport
        self.endpoint = endpoint
        self.name = name or f"client-{uuid.uuid4().hex[:8]}"
        self.config = transport.config
        self._sock = transport.socket(zmq.DEALER, connect=endpoint)
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._next_id = 1
        loop = asyncio.get_running_loop()
        self._last_seen = loop.time()
        self._lost: PeerLost | None = None
        self._closed = False
        self.late_replies = 0
        """Replies that came after their request timed out or was cancelled (dropped)."""
        self.peer_id: str | None = None
        """The peer's actor id from its latest heartbeat; a new one means it restarted."""
        self._tasks = [
            loop.create_task(self._receive(), name=f"{self.name} -> {endpoint} receive"),
            loop.create_task(self._heartbeat(), name=f"{self.name} -> {endpoint} heartbeat"),
        ]

    @property
    def in_flight(self) -> int:
        """Requests sent and not yet answered."""
        return len(self._pending)

    @property
    def alive(self) -> bool:
        """False while the peer is considered lost (it is back once it answers again)."""
        return self._lost is None and not self._closed

    # ------------------------------------------------------------ requests

    async def submit(self, msg: Message) -> asyncio.Future[Message]:
        """Send ``msg`` as a request; the future gets the reply, a ``RemoteError`` or
        ``PeerLost``. No deadline: the caller awaits it (``request`` adds one) or cancels it."""
        n, fut = await self._send(msg, None)
        fut.add_done_callback(lambda _: self._pending.pop(n, None))
        return fut

    async def _send(self, msg: Message, timeout: float | None) -> tuple[int, asyncio.Future[Message]]:
        if self._closed:
            raise Closed(f"client of {self.endpoint} is closed")
        if self._lost is not None:
            raise self._lost
        n = self._next_id
        self._next_id += 1
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[n] = fut
        try:
            sent = asyncio.ensure_future(self._sock.send_multipart([request_id(n), *encode(msg)], copy=False))
            if sent.done():
                sent.result()  # the usual case: queued at once
            else:  # the peer's queue is at its high-water mark: wait for room, within the deadline
                await asyncio.wait_for(sent, timeout)
        except asyncio.TimeoutError:
            self._pending.pop(n, None)
            raise RequestTimeout(
                f"{type(msg).__name__} to {self.endpoint}: no room to send within {timeout} s "
                "(the peer is not reading)"
            ) from None
        except BaseException:
            self._pending.pop(n, None)
            raise
        return n, fut

    @overload
    async def request(self, msg: Message, *, timeout: float | None = None) -> Message: ...

    @overload
    async def request(self, msg: Message, expect: type[R], *, timeout: float | None = None) -> R: ...

    async def request(
        self, msg: Message, expect: type[Message] = Message, *, timeout: float | None = None
    ) -> Message:
        """Send ``msg`` and wait for the reply (of type ``expect``).

        Raises ``RequestTimeout`` after ``timeout`` seconds (default: the config's), ``RemoteError``
        if the handler raised, ``PeerLost`` if the peer died meanwhile, ``ProtocolError`` if the
        reply is not an ``expect``.
        """
        deadline = self.config.request_timeout_s if timeout is None else timeout
        wait = None if math.isinf(deadline) else deadline
        loop = asyncio.get_running_loop()
        start = loop.time()
        n, fut = await self._send(msg, wait)
        if wait is not None:
            wait = max(0.0, wait - (loop.time() - start))  # what sending took counts
        try:
            reply = await asyncio.wait_for(fut, wait)
        except asyncio.TimeoutError:
            raise RequestTimeout(
                f"{type(msg).__name__} to {self.endpoint} got no reply within {deadline} s"
            ) from None
        finally:
            self._pending.pop(n, None)  # forget it: a late reply is dropped
        if not isinstance(reply, expect):
            raise ProtocolError(
                f"{type(msg).__name__} to {self.endpoint}: expected a {expect.__name__} reply, got {type(reply).__name__}"
            )
        return reply

    async def tell(self, msg: Message) -> None:
        """Send ``msg`` one-way: no reply is due (a handler error is only logged remotely)."""
        if self._closed:
            raise Closed(f"client of {self.endpoint} is closed")
        await self._sock.send_multipart([NO_REPLY, *encode(msg)], copy=False)

    # ------------------------------------------------------------ receiving and liveness

    async def _receive(self) -> None:
        limit = self.config.max_frame_bytes
        loop = asyncio.get_running_loop()
        pending = self._pending
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            self._last_seen = loop.time()
            if self._lost is not None:
                logger.info("peer %s answers again", self.endpoint)
                self._lost = None
            if len(frames) < 3 or len(frames[0]) != 8:
                logger.warning(
                    "reply from %s with a broken envelope dropped (%d frames)", self.endpoint, len(frames)
                )
                continue
            n = int.from_bytes(frames[0].bytes, "little")
            if n == 0:
                self._heard(frames[1:])  # a heartbeat: being here was most of the point
                continue
            fut = pending.pop(n, None)
            if fut is None or fut.done():
                self.late_replies += 1
                continue
            try:
                msg = decode(frames[1:], max_frame_bytes=limit)
            except ProtocolError as e:
                fut.set_exception(e)
                continue
            if type(msg) is Error:
                fut.set_exception(RemoteError(self.endpoint, msg.error_type, msg.message, msg.traceback))
            else:
                fut.set_result(msg)

    def _heard(self, frames: list[zmq.Frame]) -> None:
        try:
            beat = decode(frames)
        except ProtocolError as e:
            logger.warning("undecodable heartbeat from %s: %s", self.endpoint, e)
            return
        if type(beat) is Heartbeat and beat.actor_id != self.peer_id:
            if self.peer_id is not None:
                logger.info("peer at %s restarted: %s, was %s", self.endpoint, beat.actor_id, self.peer_id)
            self.peer_id = beat.actor_id

    async def _heartbeat(self) -> None:
        interval = self.config.heartbeat_interval_s
        limit = self.config.peer_silence_limit_s
        loop = asyncio.get_running_loop()
        seq = 0
        beat: asyncio.Future[Any] | None = None
        while True:
            # Never wait for a send here (a full queue to a dead peer must not stop the
            # clock), and keep at most one heartbeat waiting for room.
            if beat is None or beat.done():
                frames = [NO_REPLY, *encode(Heartbeat(actor_id=self.name, seq=seq))]
                beat = asyncio.ensure_future(self._sock.send_multipart(frames, flags=zmq.DONTWAIT))
                beat.add_done_callback(_beat_sent)
                seq += 1
            await asyncio.sleep(interval)
            silent = loop.time() - self._last_seen
            if silent > limit and self._lost is None:
                self._fail_all(PeerLost(self.endpoint, f"silent for {silent:.2f} s (limit {limit:.2f} s)"))

    def _fail_all(self, error: PeerLost | Closed) -> None:
        if isinstance(error, PeerLost):
            self._lost = error
            # A peer that leaves with nothing in flight (e.g. at the end of a run) is news, not trouble.
            level = logging.WARNING if self._pending else logging.INFO
            logger.log(level, "%s; failing %d in-flight request(s)", error, len(self._pending))
        pending = list(self._pending.values())
        self._pending.clear()
        for fut in pending:
            if not fut.done():
                fut.set_exception(error)

    def lose(self, reason: str) -> None:
        """Declare the peer lost now (e.g. it left the directory): in-flight requests fail
        with ``PeerLost``, new ones raise it until the peer answers again."""
        self._fail_all(PeerLost(self.endpoint, reason))

    async def close(self) -> None:
        """Fail in-flight requests with ``Closed``, stop the tasks, close the socket."""
        if self._closed:
            return
        self._closed = True
        self._fail_all(Closed(f"client of {self.endpoint} closed"))
        for task in self._tasks:
            task.cancel()
        try:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        finally:  # even if this close is itself cancelled
            # Nothing queued here matters any more: requests are failed, heartbeats moot.
            self.transport.close_socket(self._sock, linger_ms=0)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
