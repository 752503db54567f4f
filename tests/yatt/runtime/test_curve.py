"""CURVE through the socket factory: an authorised client gets through, a client with an
unknown key or without CURVE never reaches a handler."""

from __future__ import annotations

import asyncio
import logging
import pathlib
import shutil

import pytest
import zmq

from protocols.messages import Ack, Message, PolicyVersion, Query
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
        with caplog.at_level(logging.WARNING, logger="yatt.runtime.transport"):
            async with (
                Transport(curve(intruder_keys)) as intruder,
                Client(intruder, actor.endpoint) as client,
            ):
                with pytest.raises(RequestTimeout):
                    await client.request(Query(what="intruder"), timeout=0.5)
            async with Transport() as plain, Client(plain, actor.endpoint) as client:
                with pytest.raises(RequestTimeout):
                    await client.request(Query(what="plain"), timeout=0.5)
        assert "refused a CURVE connection" in caplog.text
        assert actor.calls == 0

        async with Transport(curve(keys)) as friend, Client(friend, actor.endpoint) as client:
            reply = await client.request(Query(what="friend"), Ack)
            assert reply.info == {"what": "friend"}
            assert client.peer_id == actor.actor_id  # heartbeats get through too
        assert actor.calls == 1
        assert server_side.open_sockets() == [f"ROUTER bind {bind}"]


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
