"""CURVE through the socket factory: an authorised client gets through, a client with an
unknown key or without CURVE never reaches a handler, and each refusal is logged once per
socket, peer and reason."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pathlib
import shutil

import pytest
import zmq
import zmq.asyncio
import zmq.auth

from protocols.messages import Ack, Message, PolicyVersion, Query
from tests.yatt.conftest import Until
from yatt.errors import ConfigError, RequestTimeout, TransportError
from yatt.runtime.actor import Actor, Client, handles
from yatt.runtime.streams import Publisher, Subscriber
from yatt.runtime.transport import Transport, TransportConfig, make_curve_keys


class Counter(Actor):
    role = "counter"

    def __init__(self, transport: Transport, endpoint: str) -> None:
        super().__init__(transport, endpoint=endpoint)
        self.calls = 0

    @handles(Query)
    async def query(self, msg: Query) -> Message:
        self.calls += 1
        return Ack(info={"what": msg.what})


def curve(keys: pathlib.Path) -> TransportConfig:
    return TransportConfig(curve=True, curve_keys_dir=str(keys))


@pytest.fixture
def keys(tmp_path: pathlib.Path) -> pathlib.Path:
    return make_curve_keys(tmp_path / "cluster")


@pytest.fixture
def intruder_keys(tmp_path: pathlib.Path, keys: pathlib.Path) -> pathlib.Path:
    """Its own client key pair (not admitted), and the cluster's public server key (public)."""
    root = make_curve_keys(tmp_path / "intruder")
    shutil.copy(keys / "server.key", root / "server.key")
    (root / "server.key_secret").unlink()
    return root


@pytest.mark.parametrize("scheme", ["tcp", "ipc"])
async def test_only_authorised_clients_reach_handlers(
    keys: pathlib.Path,
    intruder_keys: pathlib.Path,
    tmp_path: pathlib.Path,
    scheme: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bind = "tcp://127.0.0.1:*" if scheme == "tcp" else f"ipc://{tmp_path}/counter.ipc"
    async with Transport(curve(keys)) as server_side, Counter(server_side, bind) as actor:
        with caplog.at_level(logging.WARNING, logger="yatt.runtime.refusals"):
            async with (
                Transport(curve(intruder_keys)) as intruder,
                Client(intruder, actor.endpoint) as client,
            ):
                with pytest.raises(RequestTimeout):
                    await client.request(Query(what="intruder"), timeout=0.5)
            async with Transport() as plain, Client(plain, actor.endpoint) as client:
                with pytest.raises(RequestTimeout):
                    await client.request(Query(what="plain"), timeout=0.5)
        assert f"refused a connection to ROUTER {actor.endpoint} from" in caplog.text
        assert actor.calls == 0

        async with Transport(curve(keys)) as friend, Client(friend, actor.endpoint) as client:
            reply = await client.request(Query(what="friend"), Ack)
            assert reply.info == {"what": "friend"}
            assert client.peer_id == actor.actor_id  # heartbeats get through too
        assert actor.calls == 1
        assert server_side.open_sockets() == [f"ROUTER bind {bind}"]


# What a ZeroMQ client without keys sends first (ZMTP 3.0): the signature, version 3.0, the
# NULL mechanism, as-server 0, filler.
NULL_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31)

HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


async def refused_attempt(ctx: zmq.asyncio.Context, endpoint: str, keys: pathlib.Path | None) -> None:
    """One connection of a user's own pyzmq client, back once the server refused it. With
    ``keys``: its CURVE client pair and the server key it trusts, from that directory."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        public, secret = zmq.auth.load_certificate(keys / "client.key_secret")
        assert secret is not None
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.setsockopt(zmq.CURVE_SERVERKEY, zmq.auth.load_certificate(keys / "server.key")[0])
    monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
    try:
        sock.connect(endpoint)
        await asyncio.wait_for(monitor.recv_multipart(), 10)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


async def slow_keyless_attempt(endpoint: str, *, hang_up: bool) -> None:
    """A client without keys behind a real network's round trip: it answers a while after
    the connection, so the server has read its address before the handshake fails. It
    sends its greeting (the server sees the mechanism mismatch), or with ``hang_up`` leaves
    first (as a keyless client does when it sees the mismatch before the server)."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        await reader.readexactly(10)  # the server's signature: it has accepted the connection
        await asyncio.sleep(0.5)
        if hang_up:
            return
        writer.write(NULL_GREETING)
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await reader.read()  # until the server hangs up: refused
    finally:
        writer.close()


def refusals(caplog: pytest.LogCaptureFixture, endpoint: str = "", reason: str = "") -> list[str]:
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    return [line for line in lines if f"refused a connection to ROUTER {endpoint}" in line and reason in line]


def watching() -> list[asyncio.Task[object]]:
    """The tasks that read a socket's monitor for refused handshakes."""
    return [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__name__", "") == "watch_refusals"]


@pytest.mark.parametrize("hang_up", [False, True], ids=["mismatch-first", "hang-up-first"])
async def test_a_client_without_keys_is_logged_once_with_its_address(
    keys: pathlib.Path, tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture, until: Until, hang_up: bool
) -> None:
    """Both ways a keyless client fails tell of one refusal: one line, worded as the first."""
    other_run = make_curve_keys(tmp_path / "other-run")
    ctx = zmq.asyncio.Context()
    try:
        async with Transport(curve(keys)) as server_side:
            async with Counter(server_side, "tcp://127.0.0.1:*") as actor:
                with caplog.at_level(logging.WARNING, logger="yatt.runtime.refusals"):
                    for leaves in (hang_up, not hang_up, hang_up):
                        await slow_keyless_attempt(actor.endpoint, hang_up=leaves)
                    # A refusal of another reason on the same socket: once its line is out, the
                    # monitor has handled every event before it.
                    await refused_attempt(ctx, actor.endpoint, other_run)
                    await until(lambda: refusals(caplog, actor.endpoint, "wrong CURVE server key"))
                [line] = refusals(caplog, actor.endpoint, f"give your client the run's keys from {keys}")
                reason = "it left during the handshake" if hang_up else "no CURVE keys: the run's sockets"
                assert f"to ROUTER {actor.endpoint} from 127.0.0.1: {reason}" in line
                assert "at most once a minute" in line

                async with Transport(curve(keys)) as friend, Client(friend, actor.endpoint) as client:
                    assert await client.request(Query(what="friend"), Ack) == Ack(info={"what": "friend"})
                assert actor.calls == 1
                assert len(refusals(caplog)) == 2  # the friend is not refused
                assert len(watching()) == 1
            await until(lambda: not watching(), what="the monitor closed with its socket")
    finally:
        ctx.term()


@pytest.mark.parametrize("scheme", ["tcp", "ipc"])
async def test_each_refused_peer_is_logged_once_per_socket_and_reason(
    keys: pathlib.Path,
    intruder_keys: pathlib.Path,
    tmp_path: pathlib.Path,
    scheme: str,
    caplog: pytest.LogCaptureFixture,
    until: Until,
) -> None:
    bind = "tcp://127.0.0.1:*" if scheme == "tcp" else f"ipc://{tmp_path}/counter.ipc"
    other_run = make_curve_keys(tmp_path / "other-run")
    ctx = zmq.asyncio.Context()
    try:
        async with Transport(curve(keys)) as server_side, Counter(server_side, bind) as actor:
            with caplog.at_level(logging.WARNING, logger="yatt.runtime.refusals"):
                for _ in range(3):
                    await refused_attempt(ctx, actor.endpoint, None)
                    await refused_attempt(ctx, actor.endpoint, intruder_keys)
                await refused_attempt(ctx, actor.endpoint, other_run)  # see the test above
                await until(lambda: refusals(caplog, actor.endpoint, "wrong CURVE server key"))

                async with Transport(curve(keys)) as friend, Client(friend, actor.endpoint) as client:
                    assert await client.request(Query(what="friend"), Ack) == Ack(info={"what": "friend"})

            # A keyless pyzmq client fails within a round trip, before its address can be
            # read here, and either side may see the mismatch first: its line may name no
            # address, in either wording, but it is one line all the same.
            [_] = refusals(caplog, actor.endpoint, f"give your client the run's keys from {keys}")
            [unknown_key] = refusals(caplog, actor.endpoint, "unknown CURVE key")
            peer = "127.0.0.1" if scheme == "tcp" else f"process {os.getpid()} (uid {os.getuid()})"
            assert (
                f"from {peer}: unknown CURVE key (its public key is not in {keys}/authorized/)" in unknown_key
            )
            assert len(refusals(caplog)) == 3
            assert actor.calls == 1
    finally:
        ctx.term()


async def test_broadcast_is_authenticated_too(keys: pathlib.Path, intruder_keys: pathlib.Path) -> None:
    async with Transport(curve(keys)) as server_side, Transport(curve(keys)) as friend_side:
        async with Transport(curve(intruder_keys)) as intruder_side:
            publisher = Publisher(server_side, "tcp://127.0.0.1:*")
            friend = Subscriber(friend_side, publisher.endpoint, [PolicyVersion])
            intruder = Subscriber(intruder_side, publisher.endpoint, [PolicyVersion])
            try:
                # Publish until the friend hears one; by then the intruder's handshake was refused.
                while True:
                    await publisher.publish(PolicyVersion(version=1))
                    try:
                        assert await asyncio.wait_for(friend.recv(), 0.05) == PolicyVersion(version=1)
                        break
                    except asyncio.TimeoutError:
                        continue
                for _ in range(5):
                    await publisher.publish(PolicyVersion(version=2))
                assert await asyncio.wait_for(friend.recv(), 10) in (
                    PolicyVersion(version=1),
                    PolicyVersion(version=2),
                )
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(intruder.recv(), 0.3)
            finally:
                friend.close()
                intruder.close()
                publisher.close()


async def test_curve_needs_a_complete_key_directory(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="curve_keys_dir is required when curve is on"):
        TransportConfig(curve=True)
    async with Transport(curve(tmp_path / "missing")) as transport:
        with pytest.raises(
            TransportError, match="is not a directory; create it with yatt.runtime.transport.make_curve_keys"
        ):
            transport.socket(zmq.ROUTER, bind="tcp://127.0.0.1:*")
    keys = make_curve_keys(tmp_path / "k")
    (keys / "client.key_secret").unlink()
    async with Transport(curve(keys)) as transport:
        with pytest.raises(TransportError, match="cannot load CURVE key .*client.key_secret"):
            Client(transport, "tcp://127.0.0.1:1")
        assert transport.open_sockets() == []


async def test_factory_makes_bound_sockets_servers_and_connecting_ones_clients(keys: pathlib.Path) -> None:
    async with Transport(curve(keys)) as transport:
        server = transport.socket(zmq.ROUTER, bind="tcp://127.0.0.1:*")
        client = transport.socket(zmq.DEALER, connect="tcp://127.0.0.1:1")
        local = transport.socket(zmq.PAIR, bind="inproc://local")  # in-process: no handshake
        assert server.getsockopt(zmq.MECHANISM) == zmq.CURVE and server.getsockopt(zmq.CURVE_SERVER) == 1
        assert client.getsockopt(zmq.MECHANISM) == zmq.CURVE and client.getsockopt(zmq.CURVE_SERVER) == 0
        assert local.getsockopt(zmq.MECHANISM) == zmq.NULL
        for sock in (server, client, local):
            transport.close_socket(sock)
