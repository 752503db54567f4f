"""Streams: acknowledged one-to-one item flow with credit, and unacknowledged broadcast.

Why it exists: a controller pushing scored groups into the buffer must never lose one,
and must slow down when the buffer does. A bare PUSH socket gives neither: over ipc a
PUSH that closes right after sending silently drops its tail (see ENV-NOTES), and its
queue hides how far behind the receiver is. So a stream item is a request that the
receiver answers with an ``Ack`` once its handler accepted it, and the sender holds at
most ``credit`` unacknowledged items::

    StreamSender (DEALER)  --item seq n-->  Actor, @handles(T, serial=True) (ROUTER)
          credit - 1                         handler(item) returns -> Ack
          credit + 1       <--Ack(seq n)--

``send`` waits for credit (backpressure), ``flush`` waits until every item sent was
acked, ``close`` flushes first. If the receiver dies, the sender's heartbeats notice
(``PeerLost``) and ``unacked()`` lists the items to resend elsewhere; an item the handler
rejected (raised) is listed by ``rejected()`` and logged. Items of one sender are handled
in order when the receiver's handler is ``serial``.

Broadcast (``Publisher`` / ``Subscriber``, PUB/SUB) carries announcements such as
``PolicyVersion`` and ``Membership``: the topic is the message kind, a subscriber that
joins late misses what was published before, and a slow one may miss some; so only
state that is re-published or can be queried again travels this way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from types import TracebackType

import zmq

from protocols.codec import decode, encode
from protocols.messages import Message
from yatt.errors import Closed, PeerLost, ProtocolError, RemoteError, RequestTimeout
from yatt.runtime.actor import Client
from yatt.runtime.transport import Socket, Transport, bound_endpoint

logger = logging.getLogger(__name__)


class StreamSender:
    """Sends items to one receiving actor with at most ``credit`` unacknowledged."""

    def __init__(
        self, transport: Transport, endpoint: str, *, credit: int | None = None, name: str = ""
    ) -> None:
        self.credit = transport.config.stream_credit if credit is None else credit
        if self.credit < 1:
            raise ValueError(f"StreamSender credit must be >= 1 (got {self.credit})")
        self.endpoint = endpoint
        self._client = Client(transport, endpoint, name=name)
        self._credit = asyncio.Semaphore(self.credit)
        self._outstanding: dict[int, Message] = {}  # seq -> item sent, not yet acked
        self._lost: dict[int, Message] = {}  # seq -> item whose receiver died before acking
        self._rejected: list[tuple[Message, RemoteError]] = []
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self.sent = 0
        """Items handed to the socket."""
        self.acked = 0
        """Items the receiver's handler accepted."""

    @property
    def in_flight(self) -> int:
        """Items sent and not yet acked (at most ``credit``)."""
        return len(self._outstanding)

    async def send(self, item: Message) -> int:
        """Send one item once credit allows; returns its sequence number (0, 1, ...).

        Raises ``PeerLost`` once the receiver is lost (see ``unacked``), ``Closed`` after close.
        """
        if self._closed:
            raise Closed(f"stream to {self.endpoint} is closed")
        await self._credit.acquire()
        try:
            fut = await self._client.submit(item)
        except BaseException:
            self._credit.release()
            raise
        seq = self.sent
        self.sent += 1
        self._outstanding[seq] = item
        self._idle.clear()
        fut.add_done_callback(lambda f: self._settle(seq, f))
        return seq

    def _settle(self, seq: int, fut: asyncio.Future[Message]) -> None:
        self._credit.release()
        item = self._outstanding.pop(seq)
        if fut.cancelled():
            self._lost[seq] = item
        else:
            error = fut.exception()
            if error is None:
                self.acked += 1
            elif isinstance(error, RemoteError):
                logger.warning(
                    "stream to %s: item %d (%s) rejected: %s",
                    self.endpoint,
                    seq,
                    type(item).__name__,
                    error.remote_message,
                )
                self._rejected.append((item, error))
            else:  # PeerLost or Closed: it may or may not have been handled; resend it elsewhere
                self._lost[seq] = item
        if not self._outstanding:
            self._idle.set()

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every item sent so far is settled.

        Raises ``PeerLost`` if any went unacknowledged because the receiver was lost (they
        are in ``unacked()``), ``RequestTimeout`` if ``timeout`` passed first.
        """
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            raise RequestTimeout(
                f"stream to {self.endpoint}: {self.in_flight} item(s) still unacked after {timeout} s"
            ) from None
        if self._lost:
            raise PeerLost(self.endpoint, f"{len(self._lost)} stream item(s) unacknowledged; see unacked()")

    def unacked(self) -> list[Message]:
        """Items not known to be accepted, in send order: in flight, or lost with the receiver."""
        items = {**self._lost, **self._outstanding}
        return [items[seq] for seq in sorted(items)]

    def rejected(self) -> list[tuple[Message, RemoteError]]:
        """Items the receiver's handler raised on, with the remote error."""
        return list(self._rejected)

    async def close(self, *, timeout: float | None = None) -> None:
        """Flush (so nothing sent is lost), then close. What could not be delivered stays in
        ``unacked()`` and is logged; close itself does not raise for it."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.flush(timeout)
        except (PeerLost, RequestTimeout) as e:
            logger.warning(
                "stream to %s closed with %d item(s) unacked: %s", self.endpoint, len(self.unacked()), e
            )
        finally:
            await self._client.close()

    async def __aenter__(self) -> StreamSender:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class Publisher:
    """Broadcasts messages on a bound PUB socket; the topic is the message's kind."""

    def __init__(self, transport: Transport, endpoint: str) -> None:
        self.transport = transport
        self._sock = transport.socket(zmq.PUB, bind=endpoint)
        self.endpoint = bound_endpoint(self._sock)
        self.published = 0

    async def publish(self, msg: Message) -> None:
        """Send ``msg`` to every current subscriber of its kind (never waits for them)."""
        await self._sock.send_multipart(encode(msg), copy=False)
        self.published += 1

    def close(self) -> None:
        self.transport.close_socket(self._sock)


class Subscriber:
    """Receives the broadcasts of chosen message types from one publisher."""

    def __init__(self, transport: Transport, endpoint: str, kinds: Sequence[type[Message]]) -> None:
        if not kinds:
            raise ValueError("Subscriber needs at least one message type to subscribe to")
        self.transport = transport
        self._kinds = {k.KIND for k in kinds}
        # SUB filters by prefix (b"mb" would also match b"mb.req"), so recv checks exactly.
        self._sock: Socket = transport.socket(zmq.SUB, connect=endpoint, subscribe=tuple(self._kinds))
        self._limit = transport.config.max_frame_bytes
        self.undecodable = 0
        """Broadcasts dropped because they did not decode (each is logged)."""

    async def recv(self) -> Message:
        """The next broadcast of a subscribed type."""
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            if frames[0].bytes not in self._kinds:
                continue
            try:
                return decode(frames, max_frame_bytes=self._limit)
            except ProtocolError as e:
                self.undecodable += 1
                logger.warning("undecodable broadcast dropped: %s", e)

    async def __aiter__(self) -> AsyncIterator[Message]:
        while True:
            yield await self.recv()

    def close(self) -> None:
        if self._sock.closed:
            return
        self.transport.close_socket(self._sock, linger_ms=0)

    @property
    def closed(self) -> bool:
        return self._sock.closed
