"""Streams: every item acked once accepted, credit bounds what is in flight, nothing lost
when the sender closes at once (ipc and tcp), loss of the receiver is reported item by
item; and PUB/SUB broadcast by message kind."""

from __future__ import annotations

import asyncio
import pathlib

import pytest
import torch

from protocols.messages import Membership, Message, MicroBatch, MicroBatchRequest, PolicyVersion, WorkerInfo
from tests.yatt.conftest import Until
from yatt.errors import Closed, PeerLost
from yatt.runtime.actor import Actor, handles
from yatt.runtime.streams import Publisher, StreamSender, Subscriber
from yatt.runtime.transport import Transport


class Sink(Actor):
    """Receives PolicyVersion items in order; blocks before ``block_at`` until ``gate`` opens."""

    role = "sink"

    def __init__(self, transport: Transport, endpoint: str, *, block_at: int = -1, reject: int = -1) -> None:
        super().__init__(transport, endpoint=endpoint)
        self.items: list[int] = []
        self.entered: list[int] = []
        self.gate = asyncio.Event()
        self.block_at = block_at
        self.reject = reject

    @handles(PolicyVersion, serial=True)
    async def item(self, msg: PolicyVersion) -> None:
        self.entered.append(msg.version)
        if msg.version == self.block_at:
            await self.gate.wait()
        if msg.version == self.reject:
            raise ValueError(f"item {msg.version} is not wanted")
        self.items.append(msg.version)


async def test_items_are_acked_in_order(transport: Transport) -> None:
    async with Sink(transport, "inproc://sink") as sink:
        async with StreamSender(transport, sink.endpoint, credit=8) as sender:
            seqs = [await sender.send(PolicyVersion(version=i)) for i in range(200)]
            await sender.flush()
            assert seqs == list(range(200))
            assert sender.sent == sender.acked == 200 and sender.in_flight == 0
            assert sender.unacked() == [] and sender.rejected() == []
        assert sink.items == list(range(200))
        with pytest.raises(Closed):
            await sender.send(PolicyVersion(version=0))


async def test_sender_blocks_at_credit_and_resumes_on_ack(transport: Transport, until: Until) -> None:
    async with Sink(transport, "inproc://sink", block_at=0) as sink:
        async with StreamSender(transport, sink.endpoint, credit=4) as sender:
            for i in range(4):
                await sender.send(PolicyVersion(version=i))
            assert sender.in_flight == 4
            fifth = asyncio.ensure_future(sender.send(PolicyVersion(version=4)))
            await until(lambda: sink.entered == [0], what="receiver holds item 0")
            # No ack can come while item 0 is held, so the fifth send must still be waiting.
            done, _ = await asyncio.wait({fifth}, timeout=0.2)
            assert not done and sender.sent == 4 and sender.acked == 0
            sink.gate.set()
            assert await asyncio.wait_for(fifth, 10) == 4
            await sender.flush()
            assert sender.acked == 5
        assert sink.items == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
async def test_nothing_is_lost_when_the_sender_closes_at_once(
    transport: Transport, tmp_path: pathlib.Path, scheme: str
) -> None:
    # The sender has a context of its own, terminated right after close, as a process exit would.
    count = 10_000
    endpoint = f"ipc://{tmp_path}/sink.ipc" if scheme == "ipc" else "tcp://127.0.0.1:*"
    async with Sink(transport, endpoint) as sink:
        async with Transport() as sender_transport:
            sender = StreamSender(sender_transport, sink.endpoint)
            for i in range(count):
                await sender.send(PolicyVersion(version=i))
            await sender.close()
            assert sender.acked == count and sender.unacked() == []
            assert sender_transport.open_sockets() == []
        assert sink.items == list(range(count))  # all, once each, in order


async def test_receiver_loss_reports_the_unacked_items(fast_transport: Transport, until: Until) -> None:
    sink = Sink(fast_transport, "tcp://127.0.0.1:*", block_at=5)
    await sink.start()
    sender = StreamSender(fast_transport, sink.endpoint, credit=10)
    try:
        items = [PolicyVersion(version=i) for i in range(10)]
        for item in items:
            await sender.send(item)
        await until(lambda: sender.acked == 5, what="items 0-4 acked")
        await sink.close()  # dies while holding item 5
        with pytest.raises(PeerLost, match="5 stream item"):
            await asyncio.wait_for(sender.flush(), 30)
        assert sender.unacked() == items[5:]
        assert sink.items == [0, 1, 2, 3, 4]
        with pytest.raises(PeerLost):
            await sender.send(PolicyVersion(version=10))
    finally:
        await sender.close()
    assert sender.unacked() == items[5:]  # still there to resend after close


async def test_rejected_items_are_reported_not_acked(transport: Transport) -> None:
    async with Sink(transport, "inproc://sink", reject=3) as sink:
        async with StreamSender(transport, sink.endpoint, credit=2) as sender:
            for i in range(6):
                await sender.send(PolicyVersion(version=i))
            await sender.flush()
            assert sender.acked == 5 and sender.unacked() == []
            [(item, error)] = sender.rejected()
            assert item == PolicyVersion(version=3)
            assert error.error_type == "ValueError" and "item 3 is not wanted" in error.remote_message
        assert sink.items == [0, 1, 2, 4, 5]


@pytest.mark.parametrize("endpoint", ["inproc://pub", "tcp://127.0.0.1:*"])
async def test_broadcast_reaches_subscribers_of_the_kind(transport: Transport, endpoint: str) -> None:
    publisher = Publisher(transport, endpoint)
    versions = Subscriber(transport, publisher.endpoint, [PolicyVersion])
    members = Subscriber(transport, publisher.endpoint, [Membership])
    try:
        # A subscription takes a moment to reach the publisher: announce until it is heard.
        async def first(sub: Subscriber, announce: PolicyVersion | Membership) -> None:
            while True:
                await publisher.publish(announce)
                try:
                    assert await asyncio.wait_for(sub.recv(), 0.05) == announce
                    return
                except asyncio.TimeoutError:
                    continue

        await asyncio.wait_for(first(versions, PolicyVersion(version=-1)), 10)
        worker = WorkerInfo(actor_id="g0", role="generator", endpoint="tcp://127.0.0.1:1")
        await asyncio.wait_for(first(members, Membership(epoch=-1, workers=[])), 10)
        # Warm-up copies (version -1, epoch -1) may still be queued; they are skipped below.
        await publisher.publish(Membership(epoch=0, workers=[worker]))
        await publisher.publish(MicroBatchRequest(step=0, rank=0, world_size=1, index=0))
        for v in range(20):
            await publisher.publish(PolicyVersion(version=v))
        await publisher.publish(Membership(epoch=1, workers=[]))

        got_versions: list[int] = []
        while len(got_versions) < 20:
            msg = await asyncio.wait_for(versions.recv(), 10)
            assert isinstance(msg, PolicyVersion)
            if msg.version >= 0:
                got_versions.append(msg.version)
        assert got_versions == list(range(20))
        got_members: list[Membership] = []
        while len(got_members) < 2:
            msg = await asyncio.wait_for(members.recv(), 10)
            assert isinstance(msg, Membership)
            if msg.epoch >= 0:
                got_members.append(msg)
        assert got_members == [Membership(epoch=0, workers=[worker]), Membership(epoch=1, workers=[])]
    finally:
        versions.close()
        members.close()
        publisher.close()


async def test_subscriber_matches_kinds_exactly(transport: Transport) -> None:
    # b"mb.req" starts with b"mb" (MicroBatch's kind): the SUB prefix filter lets it
    # through, the subscriber must not hand it out.
    assert MicroBatchRequest.KIND.startswith(MicroBatch.KIND)
    batch = MicroBatch(
        step=0,
        rank=0,
        index=0,
        count=1,
        input_ids=torch.zeros(1, 2, dtype=torch.int64),
        attention_mask=torch.ones(1, 2, dtype=torch.bool),
        loss_mask=torch.ones(1, 2, dtype=torch.bool),
        rollout_logprobs=torch.zeros(1, 2),
        advantages=torch.zeros(1, 2),
        policy_versions=torch.zeros(1, dtype=torch.int64),
        group_keys=[],
    )
    decoy = MicroBatchRequest(step=0, rank=0, world_size=1, index=0)
    publisher = Publisher(transport, "inproc://pub")
    sub = Subscriber(transport, publisher.endpoint, [MicroBatch])
    try:
        received: list[Message] = []
        while not received:  # until the subscription has reached the publisher
            await publisher.publish(decoy)
            await publisher.publish(batch)
            try:
                received.append(await asyncio.wait_for(sub.recv(), 0.05))
            except asyncio.TimeoutError:
                continue
        for _ in range(3):
            await publisher.publish(decoy)
        await publisher.publish(batch)
        received.append(await asyncio.wait_for(sub.recv(), 10))
        assert all(isinstance(m, MicroBatch) for m in received)
        assert sub.undecodable == 0
    finally:
        sub.close()
        publisher.close()
