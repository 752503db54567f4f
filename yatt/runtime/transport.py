"""The one ZeroMQ context of a process and the one function that makes its sockets.

Why it exists: sockets that nobody closes keep a process from exiting, hide messages in
their queues and make tests flaky. So every socket in yatt is made by
``Transport.socket`` (bind or connect, linger, identity, high-water marks and, by config,
CURVE), which remembers it; ``Transport.close`` closes whatever is still open, and tests
assert that ``open_sockets()`` is empty after each actor has shut down.

A process makes one ``Transport`` (one ``zmq.asyncio.Context``, never the global
``Context.instance()``) and passes it to every actor, client and stream it runs.

CURVE, when ``TransportConfig.curve`` is on, encrypts and authenticates every tcp and ipc
connection: a bound socket is a CURVE server with the cluster's server key, a connecting
socket is a CURVE client with its own client key, and a ZAP handler (a ROUTER on
``inproc://zeromq.zap.01``, made by the same factory) admits only clients whose public
key lies in the key directory's ``authorized/`` folder. ``make_curve_keys`` lays that
directory out::

    keys/server.key  keys/server.key_secret     the key every bound socket serves with
    keys/client.key  keys/client.key_secret     this process's client identity
    keys/authorized/*.key                        public keys of admitted clients

A refused handshake (no keys, another run's keys, a key not admitted) is logged, at most
once a minute per socket, peer address and reason (``yatt/runtime/refusals.py``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
import zmq.auth
from zmq.utils import z85

from protocols.codec import DEFAULT_MAX_FRAME_BYTES
from yatt.errors import Closed, TransportError
from yatt.runtime.configtools import require
from yatt.runtime.refusals import MONITORED_EVENTS, RefusalLog, watch_refusals, zap_peer

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP protocol (RFC 27)

Socket = zmq.asyncio.Socket


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """Sockets, framing and liveness of every actor in a process."""

    curve: bool = False
    """Encrypt and authenticate every tcp/ipc connection with CURVE (needs curve_keys_dir)."""
    curve_keys_dir: str = ""
    """Directory made by yatt.runtime.transport.make_curve_keys: server, client and authorized/ keys."""
    hwm: int = 1000
    """Send and receive high-water mark of every socket, in messages."""
    linger_ms: int = 200
    """How long a closing socket may keep flushing queued messages (ms); -1: forever."""
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """Largest frame a receiver decodes; bigger ones are rejected with a ProtocolError."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats to each peer."""
    heartbeat_misses: int = 5
    """A peer silent for this many heartbeat intervals is declared lost."""
    request_timeout_s: float = 120.0
    """Default deadline of a request; a call may pass its own."""
    stream_credit: int = 64
    """Default number of unacknowledged items a stream sender may have in flight."""

    def __post_init__(self) -> None:
        require(
            not self.curve or bool(self.curve_keys_dir),
            "curve_keys_dir",
            "is required when curve is on (make one with yatt.runtime.transport.make_curve_keys)",
        )
        require(self.hwm >= 0, "hwm", f"must be >= 0, 0 for no limit (got {self.hwm})")
        require(self.linger_ms >= -1, "linger_ms", f"must be >= -1 (got {self.linger_ms})")
        require(self.max_frame_bytes > 0, "max_frame_bytes", f"must be > 0 (got {self.max_frame_bytes})")
        require(
            self.heartbeat_interval_s > 0,
            "heartbeat_interval_s",
            f"must be > 0 (got {self.heartbeat_interval_s})",
        )
        require(self.heartbeat_misses >= 1, "heartbeat_misses", f"must be >= 1 (got {self.heartbeat_misses})")
        require(
            self.request_timeout_s > 0, "request_timeout_s", f"must be > 0 (got {self.request_timeout_s})"
        )
        require(self.stream_credit >= 1, "stream_credit", f"must be >= 1 (got {self.stream_credit})")

    @property
    def peer_silence_limit_s(self) -> float:
        """Seconds of silence after which a peer is declared lost."""
        return self.heartbeat_interval_s * self.heartbeat_misses


KEY_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret", "authorized")
"""What ``make_curve_keys`` lays out in a key directory."""


def make_curve_keys(directory: str | Path, *, authorize_client: bool = True) -> Path:
    """Create a CURVE key directory (server and client key pairs, ``authorized/``).

    With ``authorize_client`` the new client's public key is admitted by servers that use
    this directory. Copy the directory to every host of the run; it holds secrets.
    """
    root = Path(directory)
    (root / "authorized").mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)  # only this user may read the secrets
    _, server_secret = zmq.auth.create_certificates(root, "server")
    public, client_secret = zmq.auth.create_certificates(root, "client")
    for secret in (server_secret, client_secret):
        Path(secret).chmod(0o600)
    if authorize_client:
        shutil.copy(public, root / "authorized" / "client.key")
    return root


def bound_endpoint(sock: Socket) -> str:
    """The endpoint a bound socket listens on, with the port resolved (``tcp://...:*``)."""
    value = sock.last_endpoint
    return value.decode() if isinstance(value, bytes) else str(value)


class Transport:
    """A process's ZeroMQ context and the factory (and registry) of all its sockets.

    Use as ``async with Transport(config) as transport:`` or call ``close()``.
    """

    def __init__(self, config: TransportConfig | None = None) -> None:
        self.config = config or TransportConfig()
        self.ctx = zmq.asyncio.Context()
        self._open: dict[int, tuple[Socket, str]] = {}
        self._closed = False
        self._zap: Socket | None = None  # the transport's own; not in open_sockets()
        self._zap_task: asyncio.Task[None] | None = None
        self._authorized: set[bytes] = set()
        self._warned_plain = False
        self._refusals = RefusalLog(self.config.curve_keys_dir)
        # Per bound CURVE socket (by id): the task that watches its monitor, and the monitor.
        self._monitors: dict[int, tuple[asyncio.Task[None], Socket]] = {}
        self._zap_domains: dict[bytes, str] = {}  # a bound socket's ZAP domain -> what it is, for logs

    # ------------------------------------------------------------ the socket factory

    def socket(
        self,
        socket_type: int,
        *,
        bind: str | None = None,
        connect: str | None = None,
        identity: bytes | None = None,
        hwm: int | None = None,
        linger_ms: int | None = None,
        subscribe: tuple[bytes, ...] = (),
        curve: bool | None = None,
    ) -> Socket:
        """Make, configure and bind or connect one socket; it is tracked until closed.

        Exactly one of ``bind`` / ``connect``. ``hwm`` and ``linger_ms`` default to the
        config. ``curve`` defaults to the config (tcp and ipc only); a bound socket is a
        CURVE server, a connecting one a client. ``subscribe`` lists SUB topic prefixes.
        """
        if self._closed:
            raise Closed("the transport is closed; make a new Transport for new sockets")
        if (bind is None) == (connect is None):
            raise ValueError("Transport.socket needs exactly one of bind= or connect=")
        endpoint = bind if bind is not None else connect
        assert endpoint is not None
        use_curve = self.config.curve if curve is None else curve
        use_curve = use_curve and endpoint.split("://", 1)[0] in ("tcp", "ipc")
        sock = self.ctx.socket(socket_type)
        monitor: Socket | None = None
        try:
            hwm = self.config.hwm if hwm is None else hwm
            sock.setsockopt(zmq.SNDHWM, hwm)
            sock.setsockopt(zmq.RCVHWM, hwm)
            sock.setsockopt(zmq.LINGER, self.config.linger_ms if linger_ms is None else linger_ms)
            if identity is not None:
                sock.setsockopt(zmq.IDENTITY, identity)
            for topic in subscribe:
                sock.setsockopt(zmq.SUBSCRIBE, topic)
            if use_curve:
                self._apply_curve(sock, server=bind is not None)
            if bind is not None:
                if use_curve:  # before bind, so that no refused handshake goes unseen
                    monitor = sock.get_monitor_socket(MONITORED_EVENTS)
                else:
                    self._warn_if_exposed(bind)
                sock.bind(bind)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as e:
            if monitor is not None:
                monitor.close(linger=0)
            sock.close(linger=0)
            verb = "bind" if bind is not None else "connect"
            raise TransportError(f"cannot {verb} {socket_type_name(socket_type)} to {endpoint!r}: {e}") from e
        except BaseException:
            if monitor is not None:
                monitor.close(linger=0)
            sock.close(linger=0)
            raise
        described = f"{socket_type_name(socket_type)} {'bind' if bind else 'connect'} {endpoint}"
        self._open[id(sock)] = (sock, described)
        if monitor is not None:
            self._watch_refusals(sock, monitor, f"{socket_type_name(socket_type)} {bound_endpoint(sock)}")
        return sock

    def close_socket(self, sock: Socket, *, linger_ms: int | None = None) -> None:
        """Close one socket made here (idempotent); ``linger_ms`` overrides its linger."""
        self._open.pop(id(sock), None)
        if not sock.closed:
            sock.close(linger=linger_ms)
        self._stop_watching(sock)

    def open_sockets(self) -> list[str]:
        """What every still-open socket is, e.g. ``['DEALER connect tcp://127.0.0.1:5555']``
        (the transport's own ZAP handler, closed by ``close``, is not listed)."""
        for key, (sock, _) in list(self._open.items()):
            if sock.closed:
                del self._open[key]
        return [described for _, described in self._open.values()]

    # ------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Close every socket still open (saying which) and terminate the context."""
        if self._closed:
            return
        if self._zap_task is not None:
            self._zap_task.cancel()
            self._zap_task = None
        left = self.open_sockets()
        if left:
            logger.warning("closing %d socket(s) still open at transport close: %s", len(left), left)
        for sock, _ in list(self._open.values()):
            sock.close(linger=0)
        self._open.clear()
        for task, monitor in self._monitors.values():
            task.cancel()
            monitor.close(linger=0)
        self._monitors.clear()
        if self._zap is not None:
            self._zap.close(linger=0)
        self._closed = True
        self.ctx.term()

    @property
    def closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> Transport:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------ CURVE

    def _keys_dir(self) -> Path:
        root = Path(self.config.curve_keys_dir)
        if not root.is_dir():
            raise TransportError(
                f"transport.curve_keys_dir {str(root)!r} is not a directory; "
                "create it with yatt.runtime.transport.make_curve_keys"
            )
        return root

    def _load_pair(self, name: str) -> tuple[bytes, bytes]:
        path = self._keys_dir() / f"{name}.key_secret"
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as e:
            raise TransportError(f"cannot load CURVE key {str(path)!r}: {e}") from e
        if secret is None:
            raise TransportError(f"CURVE key file {str(path)!r} holds no secret key")
        return public, secret

    def _apply_curve(self, sock: Socket, *, server: bool) -> None:
        if server:
            self._start_zap()
            public, secret = self._load_pair("server")
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.ZAP_DOMAIN, _zap_domain(sock))
        else:
            public, secret = self._load_pair("client")
            path = self._keys_dir() / "server.key"
            try:
                server_public, _ = zmq.auth.load_certificate(path)
            except (OSError, ValueError) as e:
                raise TransportError(f"cannot load the CURVE server key {str(path)!r}: {e}") from e
            sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)

    def _start_zap(self) -> None:
        """Bind the ZAP handler before any CURVE server binds (libzmq admits every client
        key when no handler is bound)."""
        if self._zap_task is not None:
            return
        authorized = self._keys_dir() / "authorized"
        if not authorized.is_dir():
            raise TransportError(
                f"{str(authorized)!r} is missing: it holds the public keys of admitted clients "
                "(yatt.runtime.transport.make_curve_keys creates it)"
            )
        # load_certificates gives {z85 public key: True} for every *.key file in the folder.
        self._authorized = {bytes(k) for k in zmq.auth.load_certificates(authorized)}
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise TransportError("CURVE server sockets must be made inside a running asyncio loop") from None
        self._zap = self.socket(zmq.ROUTER, bind=ZAP_ENDPOINT, curve=False, linger_ms=0)
        self._open.pop(id(self._zap))  # closed by close(), after every socket it serves
        self._zap_task = loop.create_task(self._serve_zap(self._zap))

    async def _serve_zap(self, zap: Socket) -> None:
        try:
            while True:
                frames = await zap.recv_multipart()
                # [routing id, b"", version, request id, domain, address, identity, mechanism, creds...]
                if len(frames) < 8:
                    logger.warning("malformed ZAP request with %d frames dropped", len(frames))
                    continue
                route, _, version, request_id, domain, address, _, mechanism = frames[:8]
                creds = frames[8:]
                ok = mechanism == b"CURVE" and len(creds) == 1 and z85.encode(creds[0]) in self._authorized
                if not ok:
                    sock = self._zap_domains.get(domain, f"a socket of ZAP domain {domain!r}")
                    self._refusals.unknown_key(sock, zap_peer(address))
                status, text = (b"200", b"OK") if ok else (b"400", b"client key not authorized")
                await zap.send_multipart([route, b"", version, request_id, status, text, b"", b""])
        finally:
            zap.close(linger=0)

    def _watch_refusals(self, sock: Socket, monitor: Socket, described: str) -> None:
        """Log the handshakes a bound CURVE socket refuses (``refusals.py``) until it closes."""
        self._zap_domains[_zap_domain(sock)] = described
        task = asyncio.get_running_loop().create_task(watch_refusals(monitor, described, self._refusals))
        self._monitors[id(sock)] = (task, monitor)

    def _stop_watching(self, sock: Socket) -> None:
        watched = self._monitors.pop(id(sock), None)
        if watched is not None:
            task, monitor = watched
            task.cancel()
            monitor.close(linger=0)
            self._zap_domains.pop(_zap_domain(sock), None)

    def _warn_if_exposed(self, endpoint: str) -> None:
        """CURVE is off by default on loopback; binding beyond it in plain text earns a warning."""
        if self._warned_plain or not endpoint.startswith("tcp://"):
            return
        host = urlsplit(endpoint).hostname or ""
        try:
            loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False  # "*", an interface name or a host name: may be reachable
        if not loopback:
            self._warned_plain = True
            logger.warning(
                "binding %s without encryption; set transport.curve=true and curve_keys_dir "
                "for traffic beyond this host",
                endpoint,
            )


def _zap_domain(sock: Socket) -> bytes:
    """The ZAP domain a bound CURVE socket sets: tells the ZAP handler which socket asks."""
    return f"yatt.{id(sock):x}".encode()


def socket_type_name(socket_type: int) -> str:
    try:
        return zmq.SocketType(socket_type).name
    except ValueError:
        return f"socket type {socket_type}"
