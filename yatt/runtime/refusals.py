"""Refused handshakes, in the log: who tried which socket without the run's keys, and why.

Why it exists: ZeroMQ refuses a client without CURVE keys, or with another run's keys,
inside its handshake. The refused client sees only silence (its requests time out), so the
run's log is the one place that can say what happened. Two witnesses see refusals, each
only a part of them::

    client without keys (NULL mechanism)  -> mechanism mismatch, or -+
                                             it leaves mid-handshake   |
    client with another run's server key  -> cryptographic error     -+-> watch_refusals (monitor
                                                                         of each bound CURVE socket)
    client whose public key is not admitted -> ZAP handler says 400  ---> Transport._serve_zap

- the ZAP handler (``transport.py``) sees CURVE clients whose key is not admitted, with
  their address, and through the ZAP domain each bound socket sets, which socket they tried;
- a monitor on each bound CURVE socket sees the handshakes that fail before ZAP is asked.
  libzmq 4.3's monitor events carry no peer address (only its draft API's version-2 events
  do, and pyzmq's wheels leave that API out), so the address is read from the descriptor
  that EVENT_ACCEPTED names. A client that fails fast has often been closed by the time the
  event is read (a keyless pyzmq client fails within a round trip): then the line says the
  address is unknown rather than guess. Client and server each see the mechanism mismatch
  of a keyless client; the one that sees it first hangs up, so the server sees either the
  mismatch or a client that left mid-handshake (about one in five keyless attempts over
  loopback tcp, one in three over ipc).

``RefusalLog`` writes at most one WARNING per (socket, peer, reason) a minute (the two
ways a keyless client fails are one reason; a line of an unknown address stands for every
peer of its socket and reason); the next line of the same key counts those it held back.
Nothing here runs per message: a monitor sees only connection events.
"""

from __future__ import annotations

import errno
import logging
import re
import socket
import struct
import time
from collections import deque
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger(__name__)

REFUSAL_LOG_INTERVAL_S = 60.0
"""The same refusal (socket, peer, reason) is logged at most once per this many seconds."""

MONITORED_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_MONITOR_STOPPED
)
"""What a bound CURVE socket's monitor reports: a handshake's failure is followed by the
disconnection of its descriptor, which names the connection (and so the peer) it was."""

MAX_REMEMBERED = 4096
"""Refusal keys kept for their counts; past this, those quiet for a minute are forgotten."""

UNKNOWN_PEER = "an unknown address (the connection closed before it could be read)"


class RefusalLog:
    """One WARNING per refused (socket, peer, reason) a minute, shared by a process's ZAP
    handler and socket monitors (all on its event loop)."""

    def __init__(self, keys_dir: str) -> None:
        self.keys_dir = keys_dir
        # (socket, peer, kind of refusal) -> (when its line was logged, refusals held back since)
        self._last: dict[tuple[str, str | None, str], tuple[float, int]] = {}

    def unknown_key(self, sock: str, peer: str | None) -> None:
        authorized = Path(self.keys_dir) / "authorized"
        self._refused(
            sock, peer, "unknown key", f"unknown CURVE key (its public key is not in {authorized}/)"
        )

    def failed_handshake(self, sock: str, peer: str | None, event: int, value: int) -> None:
        """A handshake that failed before ZAP: ``event`` HANDSHAKE_FAILED_PROTOCOL with a
        protocol error in ``value``, or HANDSHAKE_FAILED_NO_DETAIL with an errno."""
        fix = f"the run's sockets are authenticated; give your client the run's keys from {self.keys_dir}"
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            left = f"it left during the handshake ({errno.errorcode.get(value, value)})"
            also = "as a client without CURVE keys does (so do a port scan and a client that died)"
            self._refused(sock, peer, "no keys", f"{left}, {also}; {fix}")
        elif value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            self._refused(sock, peer, "no keys", f"no CURVE keys: {fix}")
        elif value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            server_key = Path(self.keys_dir) / "server.key"
            self._refused(
                sock,
                peer,
                "wrong server key",
                f"wrong CURVE server key: give your client the run's {server_key}",
            )
        else:
            reason = f"the handshake broke the ZeroMQ protocol ({_protocol_error(value)})"
            self._refused(sock, peer, reason, reason)

    def _refused(self, sock: str, peer: str | None, kind: str, reason: str) -> None:
        """Log ``reason`` unless a line of the same ``kind`` of refusal covers it."""
        now = time.monotonic()
        covering = self._covering(sock, peer, kind, now)
        if covering is not None:
            logged_at, held = self._last[covering]
            self._last[covering] = (logged_at, held + 1)
            return
        key = (sock, peer, kind)
        held = self._last.get(key, (0.0, 0))[1]
        if len(self._last) >= MAX_REMEMBERED:  # a scan from many addresses: forget the quiet ones
            self._last = {k: v for k, v in self._last.items() if now - v[0] < REFUSAL_LOG_INTERVAL_S}
        self._last[key] = (now, 0)
        since = f"; {held} more since the last such line" if held else ""
        logger.warning(
            "refused a connection to %s from %s: %s [logged at most once a minute per socket, peer and reason%s]",
            sock,
            peer or UNKNOWN_PEER,
            reason,
            since,
        )

    def _covering(
        self, sock: str, peer: str | None, kind: str, now: float
    ) -> tuple[str, str | None, str] | None:
        """The key of a line of the last minute that already tells of this refusal: same
        socket and kind, same peer, where an unknown peer may be any (so a peer whose
        address is read only now and then gets one line, not one per way it was seen)."""
        if peer is None:
            keys = [k for k in self._last if k[0] == sock and k[2] == kind]
        else:
            keys = [(sock, peer, kind), (sock, None, kind)]
        return next(
            (k for k in keys if k in self._last and now - self._last[k][0] < REFUSAL_LOG_INTERVAL_S), None
        )


async def watch_refusals(monitor: zmq.asyncio.Socket, sock: str, log: RefusalLog) -> None:
    """Read a bound socket's monitor (made with ``MONITORED_EVENTS``) until the socket
    closes, logging each handshake that failed before ZAP; closes ``monitor``.

    Events of one socket come in order from libzmq's one I/O thread: ACCEPTED(fd), the
    handshake's failure (no fd), then DISCONNECTED(fd) of the same connection.
    """
    peers: dict[int, str | None] = {}  # fd -> address of the connection it is
    failed: tuple[int, int] | None = None  # (event, value) of the handshake whose DISCONNECTED is next
    pending: deque[tuple[int, int]] = deque()  # events read ahead, not yet handled
    try:
        while True:
            event, value = pending.popleft() if pending else _event(await monitor.recv_multipart())
            if event == zmq.EVENT_ACCEPTED:
                failed = None  # a failure is followed by its DISCONNECTED at once, not by this
                peer = _peer_of_fd(value)
                # libzmq emits DISCONNECTED(fd) before it closes fd: if none is queued after
                # the read, fd was still this connection's when it was read, not a reused one.
                while True:
                    try:
                        pending.append(_event(await monitor.recv_multipart(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
                peers[value] = None if (zmq.EVENT_DISCONNECTED, value) in pending else peer
            elif event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                failed = (event, value)
            elif event == zmq.EVENT_DISCONNECTED:
                peer = peers.pop(value, None)
                if failed is not None:
                    log.failed_handshake(sock, peer, *failed)
                    failed = None
            elif event == zmq.EVENT_MONITOR_STOPPED:
                return
    finally:
        monitor.close(linger=0)


def zap_peer(address: bytes) -> str:
    """A ZAP request's address as a log names it: the IP of a tcp peer, the process of an
    ipc one (libzmq sends ``host:uid:gid:pid`` for those)."""
    text = address.decode(errors="replace")
    ipc = re.fullmatch(r"[^:]*:(\d+):(\d+):(\d+)", text)
    return _process(pid=int(ipc[3]), uid=int(ipc[1])) if ipc else text


def _event(frames: list[bytes]) -> tuple[int, int]:
    message = parse_monitor_message(frames)
    return message["event"], message["value"]


def _peer_of_fd(fd: int) -> str | None:
    """The peer of a connection libzmq accepted on descriptor ``fd``; None once it is closed."""
    try:
        conn = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if conn.family == socket.AF_UNIX:
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            return _process(pid=pid, uid=uid)
        return str(conn.getpeername()[0])
    except OSError:
        return None
    finally:
        conn.detach()  # the descriptor stays libzmq's


def _process(*, pid: int, uid: int) -> str:
    return f"process {pid} (uid {uid})"


def _protocol_error(code: int) -> str:
    name = zmq.Event(code).name  # an IntFlag: an unknown code reads as several flags
    return name if name and "|" not in name else f"protocol error {code:#x}"
