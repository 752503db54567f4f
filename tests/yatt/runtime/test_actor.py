"""Actors and clients: request/reply with correlation ids, many in flight, deadlines,
cancellation, remote errors, garbage on the wire, peer loss and clean shutdown."""

from __future__ import annotations

import asyncio
import logging

import msgpack
import pytest
import torch
import zmq

from protocols.codec import decode, encode
from protocols.messages import (
    Ack,
    Error,
    GroupKey,
    Heartbeat,
    Message,
    PolicyVersion,
    Query,
    Register,
    ScoreRequest,
    Scores,
    Shutdown,
)
from tests.yatt.conftest import Until, start_again
from yatt.errors import ActorFailed, Closed, PeerLost, ProtocolError, RemoteError, RequestTimeout
from yatt.runtime.actor import Actor, Client, handles, request_id
from yatt.runtime.transport import Transport, TransportConfig

ENDPOINTS = ["inproc://echo", "tcp://127.0.0.1:*"]


class Echo(Actor):
    """Answers Query by ``what``: echo, fail, block (until ``gate`` opens)."""

    role = "echo"

    def __init__(self, transport: Transport, endpoint: str = "inproc://echo") -> None:
        super().__init__(transport, endpoint=endpoint)
        self.gate = asyncio.Event()
        self.calls = 0
        self.blocked = 0

    @handles(Query)
    async def query(self, msg: Query) -> Message:
        self.calls += 1
        if msg.what == "echo":
            return Ack(seq=int(msg.args.get("n", "0")), info=dict(msg.args))
        if msg.what == "fail":
            raise ValueError(f"bad request {msg.args}")
        if msg.what == "block":
            self.blocked += 1
            try:
                await self.gate.wait()
            finally:
                self.blocked -= 1
            return Ack(seq=int(msg.args.get("n", "0")))
        raise KeyError(msg.what)

    @handles(ScoreRequest)
    async def score(self, msg: ScoreRequest) -> Scores:
        lengths = torch.tensor([len(c) for c in msg.completion_ids], dtype=torch.float32)
        return Scores(
            group_key=msg.group_key,
            rewards=lengths,
            components={"len": lengths},
            failures=[""] * len(lengths),
        )


def echo(n: int = 0, **args: str) -> Query:
    return Query(what="echo", args={"n": str(n), **args})


@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_round_trip(transport: Transport, endpoint: str) -> None:
    async with Echo(transport, endpoint) as actor, Client(transport, actor.endpoint) as client:
        reply = await client.request(echo(7, word="hi"), Ack)
        assert reply == Ack(seq=7, info={"n": "7", "word": "hi"})
        assert client.in_flight == 0


async def test_tensors_travel_both_ways(transport: Transport) -> None:
    async with Echo(transport, "tcp://127.0.0.1:*") as actor, Client(transport, actor.endpoint) as client:
        completions = [torch.arange(n, dtype=torch.int32) for n in (3, 5, 0)]
        request = ScoreRequest(
            group_key=GroupKey(epoch=0, shard=0, prompt_index=4),
            prompt_ids=torch.arange(10, dtype=torch.int32),
            completion_ids=completions,
            finish_reasons=["stop", "length", "stop"],
        )
        scores = await client.request(request, Scores)
        assert scores.rewards.tolist() == [3.0, 5.0, 0.0]
        assert scores.components["len"].dtype == torch.float32


async def test_64_requests_in_flight_to_one_peer(transport: Transport, until: Until) -> None:
    async with Echo(transport) as actor, Client(transport, actor.endpoint) as client:
        calls = [
            asyncio.ensure_future(client.request(Query(what="block", args={"n": str(i)}), Ack))
            for i in range(64)
        ]
        # All 64 are inside the handler at once: served concurrently, not one by one.
        await until(lambda: actor.blocked == 64, what="64 handlers blocked")
        assert client.in_flight == 64
        actor.gate.set()
        replies = await asyncio.gather(*calls)
        assert [r.seq for r in replies] == list(range(64))  # each reply found its request
        assert client.in_flight == 0


async def test_timeout_forgets_the_request_and_drops_the_late_reply(
    transport: Transport, until: Until
) -> None:
    async with Echo(transport) as actor, Client(transport, actor.endpoint) as client:
        with pytest.raises(RequestTimeout, match="Query to inproc://echo got no reply within 0.2 s"):
            await client.request(Query(what="block"), timeout=0.2)
        assert client.in_flight == 0
        actor.gate.set()
        await until(lambda: client.late_replies == 1, what="late reply dropped")
        assert (await client.request(echo(1), Ack)).seq == 1


async def test_cancelling_the_caller_forgets_the_request(transport: Transport, until: Until) -> None:
    async with Echo(transport) as actor, Client(transport, actor.endpoint) as client:
        call = asyncio.ensure_future(client.request(Query(what="block")))
        await until(lambda: actor.blocked == 1, what="handler entered")
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert client.in_flight == 0
        actor.gate.set()
        await until(lambda: client.late_replies == 1, what="late reply dropped")
        assert (await client.request(echo(2), Ack)).seq == 2


async def test_remote_error_carries_the_traceback_and_the_actor_keeps_serving(transport: Transport) -> None:
    async with Echo(transport) as actor, Client(transport, actor.endpoint) as client:
        with pytest.raises(RemoteError) as info:
            await client.request(Query(what="fail", args={"x": "1"}))
        err = info.value
        assert err.error_type == "ValueError"
        assert err.remote_message == "bad request {'x': '1'}"
        assert "in query" in err.remote_traceback and 'raise ValueError(f"bad request' in err.remote_traceback
        assert err.peer == "inproc://echo"
        assert (await client.request(echo(3), Ack)).seq == 3
        assert actor.calls == 2


async def test_unhandled_type_and_wrong_reply_type(transport: Transport) -> None:
    async with Echo(transport) as actor, Client(transport, actor.endpoint) as client:
        with pytest.raises(RemoteError, match="has no handler for PolicyVersion") as info:
            await client.request(PolicyVersion(version=1))
        assert info.value.error_type == "NoHandler"
        assert "Query" in info.value.remote_message  # names what it does handle
        with pytest.raises(ProtocolError, match="expected a Scores reply, got Ack"):
            await client.request(echo(), Scores)


async def test_garbage_frames_get_errors_and_the_actor_keeps_serving(
    transport: Transport, caplog: pytest.LogCaptureFixture
) -> None:
    async with Echo(transport) as actor:
        raw = transport.socket(zmq.DEALER, connect=actor.endpoint)
        try:

            async def reply_to(frames: list[bytes]) -> tuple[bytes, Error]:
                await raw.send_multipart(frames)
                got = await asyncio.wait_for(raw.recv_multipart(), 10)
                error = decode(got[1:])
                assert isinstance(error, Error)
                return got[0], error

            with caplog.at_level(logging.WARNING, logger="yatt.runtime.actor"):
                await raw.send_multipart([b"just one frame"])  # broken envelope: no reply possible
                rid, err = await reply_to([request_id(11), b"no.such.kind", b"\x80"])
                assert rid == request_id(11)
                assert (
                    err.error_type == "ProtocolError"
                    and "unknown message kind b'no.such.kind'" in err.message
                )
                rid, err = await reply_to([request_id(12), Query.KIND, b"\xc1\xc1 not msgpack"])
                assert rid == request_id(12) and "header is not valid msgpack" in err.message
                bad_field = msgpack.packb({"v": 1, "f": {"what": 5, "args": {}}})
                rid, err = await reply_to([request_id(13), Query.KIND, bad_field])
                assert "Query.what: expected str, got int" in err.message
                # A one-way message that does not decode is only logged.
                await raw.send_multipart([bytes(8), Query.KIND, b"junk"])
            assert "broken envelope" in caplog.text and "undecodable message" in caplog.text
            # Still serving, on the same connection.
            await raw.send_multipart([request_id(14), *encode(echo(14))])
            got = await asyncio.wait_for(raw.recv_multipart(), 10)
            assert got[0] == request_id(14) and got[1] == Ack.KIND
        finally:
            transport.close_socket(raw)
        assert actor.calls == 1


async def test_oversized_frame_is_a_protocol_error() -> None:
    async with Transport(TransportConfig(max_frame_bytes=1024)) as transport:
        async with Echo(transport) as actor, Client(transport, actor.endpoint) as client:
            with pytest.raises(RemoteError, match="over the limit of 1024") as info:
                await client.request(echo(big="x" * 5000))
            assert info.value.error_type == "ProtocolError"
            assert (await client.request(echo(5), Ack)).seq == 5
            assert actor.calls == 1


async def test_one_way_messages(transport: Transport, until: Until, caplog: pytest.LogCaptureFixture) -> None:
    async with Echo(transport) as actor, Client(transport, actor.endpoint) as client:
        with caplog.at_level(logging.ERROR, logger="yatt.runtime.actor"):
            await client.tell(Query(what="fail"))
            await client.tell(echo())
            await until(lambda: actor.calls == 2, what="both one-way messages handled")
        assert "handler of one-way Query raised" in caplog.text
        assert client.in_flight == 0 and client.late_replies == 0


async def test_heartbeats_are_answered_while_handlers_block(fast_transport: Transport, until: Until) -> None:
    beats: list[Heartbeat] = []

    class Watching(Echo):
        def on_heartbeat(self, beat: Heartbeat) -> None:
            beats.append(beat)

    async with (
        Watching(fast_transport) as actor,
        Client(fast_transport, actor.endpoint, name="watcher") as client,
    ):
        call = asyncio.ensure_future(client.request(Query(what="block")))
        await until(lambda: len(beats) >= 10, what="10 heartbeats")  # past the 0.3 s silence limit
        assert client.alive and not call.done()
        assert {b.actor_id for b in beats} == {"watcher"}
        assert [b.seq for b in beats] == list(range(len(beats)))
        actor.gate.set()
        assert isinstance(await call, Ack)


async def test_peer_lost_fails_in_flight_requests(fast_transport: Transport, until: Until) -> None:
    actor = Echo(fast_transport, "tcp://127.0.0.1:*")
    endpoint = await actor.start()
    async with Client(fast_transport, endpoint) as client:
        calls = [asyncio.ensure_future(client.request(Query(what="block"), timeout=60)) for _ in range(3)]
        await until(lambda: actor.blocked == 3, what="3 requests in flight")
        await actor.close()  # the peer goes away: no reply, no heartbeats
        for call in calls:
            with pytest.raises(PeerLost, match=f"peer '{endpoint}' lost: silent for"):
                await asyncio.wait_for(call, 30)  # generous: only liveness ends them
        assert not client.alive and client.in_flight == 0
        with pytest.raises(PeerLost):
            await client.request(echo())  # fails at once while the peer is lost

        # The same endpoint comes back: the client notices from its heartbeats.
        again = await start_again(lambda: Echo(fast_transport, endpoint))
        try:
            await until(lambda: client.alive, what="peer back")
            assert (await client.request(echo(9), Ack)).seq == 9
        finally:
            await again.close()


async def test_peer_that_never_answers_is_lost(fast_transport: Transport) -> None:
    async with Client(fast_transport, "tcp://127.0.0.1:1") as client:  # nothing listens there
        with pytest.raises(PeerLost):
            await asyncio.wait_for(client.request(echo(), timeout=60), 30)


async def test_serial_handler_runs_in_arrival_order(transport: Transport, until: Until) -> None:
    seen: list[int] = []
    running = 0

    class Ordered(Actor):
        @handles(PolicyVersion, serial=True)
        async def item(self, msg: PolicyVersion) -> None:
            nonlocal running
            running += 1
            assert running == 1, "serial handlers never overlap"
            await asyncio.sleep(0)
            seen.append(msg.version)
            running -= 1

    async with (
        Ordered(transport, endpoint="inproc://ordered") as actor,
        Client(transport, actor.endpoint) as client,
    ):
        replies = await asyncio.gather(*(client.request(PolicyVersion(version=i)) for i in range(50)))
        assert all(isinstance(r, Ack) for r in replies)
        assert seen == list(range(50))


async def test_shutdown_message_closes_the_actor(transport: Transport) -> None:
    async with Echo(transport) as actor, Client(transport, actor.endpoint) as client:
        assert await client.request(Shutdown(reason="test"), Ack) == Ack()
        await asyncio.wait_for(actor.wait_closed(), 10)
        assert actor.closed
        assert transport.open_sockets() == ["DEALER connect inproc://echo"]


async def test_close_cancels_handlers_and_closes_sockets(transport: Transport, until: Until) -> None:
    actor = Echo(transport)
    await actor.start()
    client = Client(transport, actor.endpoint)
    call = asyncio.ensure_future(client.request(Query(what="block")))
    await until(lambda: actor.blocked == 1, what="handler entered")
    await actor.close()
    assert actor.blocked == 0  # the handler was cancelled, its finally ran
    await client.close()
    with pytest.raises(Closed, match="closed"):
        await call
    with pytest.raises(Closed):
        await client.request(echo())
    await actor.close()  # idempotent
    assert transport.open_sockets() == []


async def test_a_crashing_task_fails_the_actor_with_its_traceback(transport: Transport) -> None:
    class Crashing(Actor):
        async def on_start(self) -> None:
            self.spawn(self.boom(), name="boom")

        async def boom(self) -> None:
            raise RuntimeError("engine died")

    actor = Crashing(transport, endpoint="inproc://crash")
    await actor.start()
    with pytest.raises(ActorFailed, match="engine died") as info:
        await asyncio.wait_for(actor.wait_closed(), 10)
    assert "in boom" in str(info.value)
    assert transport.open_sockets() == []


async def test_handlers_are_added_before_start_only(transport: Transport) -> None:
    async def handler(msg: Register) -> None:
        return None

    async with Echo(transport) as actor:
        with pytest.raises(RuntimeError, match="add handlers before start"):
            actor.add_handler(Register, handler)


async def test_a_peer_that_stops_reading_cannot_stall_the_client(until: Until) -> None:
    # A tiny high-water mark and a ROUTER that never reads: the client's queue fills up.
    config = TransportConfig(hwm=1, heartbeat_interval_s=0.05, heartbeat_misses=6)
    async with Transport(config) as transport:
        deaf = transport.socket(zmq.ROUTER, bind="inproc://deaf")
        client = Client(transport, "inproc://deaf")
        try:
            errors = []
            for _ in range(20):
                with pytest.raises(RequestTimeout) as info:
                    await client.request(echo(), timeout=0.1)
                errors.append(str(info.value))
                if "no room to send" in errors[-1]:
                    break
            assert "Query to inproc://deaf: no room to send within 0.1 s (the peer is not reading)" in errors
            assert client.in_flight == 0
            # Heartbeats cannot get through either, yet the clock still runs: the peer is lost.
            await until(lambda: not client.alive, what="deaf peer declared lost")
        finally:
            await client.close()
            transport.close_socket(deaf)
