"""The service directory: members join and leave at run time with a growing epoch, a
killed member is dropped after its missed heartbeats and its in-flight requests fail
with PeerLost, the directory balances by requests in flight, and a restarted registry
is re-populated."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest

from protocols.messages import Ack, Membership, Message, Query, Register, WorkerInfo
from tests.yatt.conftest import FAST_BEATS, Until, _checked, start_again
from yatt.errors import PeerLost, RemoteError, TransportError
from yatt.runtime.actor import Actor, Client, handles
from yatt.runtime.registry import Directory, Registration, Registry
from yatt.runtime.transport import Transport, TransportConfig

ROOT = pathlib.Path(__file__).resolve().parents[3]
LOCAL = "tcp://127.0.0.1:*"


class Member(Actor):
    """A worker stand-in: Query("who") names it, Query("block") waits for ``gate``."""

    role = "generator"

    def __init__(self, transport: Transport, actor_id: str) -> None:
        super().__init__(transport, endpoint=LOCAL, actor_id=actor_id)
        self.gate = asyncio.Event()
        self.blocked = 0

    @handles(Query)
    async def query(self, msg: Query) -> Message:
        if msg.what == "block":
            self.blocked += 1
            await self.gate.wait()
        return Ack(info={"who": self.actor_id})


class Scorer(Member):
    role = "reward"


# A member in a process of its own, so that it can really be killed.
CHILD = f"""
import asyncio, sys
from protocols.messages import Ack, Query
from yatt.runtime.actor import Actor, handles
from yatt.runtime.registry import Registration
from yatt.runtime.transport import Transport, TransportConfig

class Doomed(Actor):
    role = "generator"

    @handles(Query)
    async def query(self, msg):
        if msg.what == "block":
            await asyncio.Event().wait()
        return Ack(info={{"who": self.actor_id}})

async def main():
    config = TransportConfig(heartbeat_interval_s={FAST_BEATS.heartbeat_interval_s},
                             heartbeat_misses={FAST_BEATS.heartbeat_misses})
    async with Transport(config) as t:
        async with Doomed(t, endpoint="{LOCAL}", actor_id="doomed") as actor:
            async with Registration(t, sys.argv[1], actor.info()):
                print(actor.endpoint, flush=True)
                await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.fixture
async def registry(fast_transport: Transport) -> AsyncIterator[Registry]:
    async with Registry(fast_transport, endpoint=LOCAL, publish_endpoint=LOCAL) as reg:
        yield reg


async def test_membership_grows_and_shrinks_with_epochs(
    fast_transport: Transport, registry: Registry
) -> None:
    async with Directory(fast_transport, registry.endpoint) as directory:
        assert directory.epoch == 0 and directory.members() == []
        a, b = Member(fast_transport, "gen-a"), Member(fast_transport, "gen-b")
        async with a, b, Registration(fast_transport, registry.endpoint, a.info()):
            await directory.wait_until(lambda d: len(d.members("generator")) == 1, timeout=10)
            assert directory.epoch == registry.epoch == 1
            reg_b = Registration(fast_transport, registry.endpoint, b.info())
            await reg_b.start()
            await directory.wait_until(lambda d: len(d.members("generator")) == 2, timeout=10)
            assert directory.epoch == 2
            assert [w.actor_id for w in directory.members("generator")] == ["gen-a", "gen-b"]
            assert directory.members("reward") == []
            # Both clients work.
            for actor_id in ("gen-a", "gen-b"):
                reply = await directory.client(actor_id).request(Query(what="who"), Ack)
                assert reply.info == {"who": actor_id}
            await reg_b.close()  # Deregister
            await directory.wait_until(lambda d: d.epoch == 3, timeout=10)
            assert [w.actor_id for w in directory.members()] == ["gen-a"]
            with pytest.raises(KeyError, match="'gen-b' is not in the directory"):
                directory.client("gen-b")
        await directory.wait_until(lambda d: d.members() == [], timeout=10)
        assert registry.epoch == directory.epoch == 4


async def test_killed_member_is_dropped_and_its_requests_fail(
    fast_transport: Transport, registry: Registry, until: Until
) -> None:
    async with Directory(fast_transport, registry.endpoint) as directory:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, registry.endpoint],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            await directory.wait_until(lambda d: [w.actor_id for w in d.members()] == ["doomed"], timeout=120)
            epoch = directory.epoch
            doomed = directory.pick("generator")
            assert (await doomed.request(Query(what="who"), Ack)).info == {"who": "doomed"}
            calls = [asyncio.ensure_future(doomed.request(Query(what="block"), timeout=60)) for _ in range(4)]
            await until(lambda: doomed.in_flight == 4, what="4 requests in flight")
            child.send_signal(signal.SIGKILL)
            for call in calls:
                with pytest.raises(PeerLost):
                    await asyncio.wait_for(call, 30)
            await directory.wait_until(lambda d: d.members() == [], timeout=30)
            assert directory.epoch == epoch + 1 and registry.members() == []
        finally:
            child.kill()
            child.wait(30)
            assert child.stdout is not None
            child.stdout.close()


async def test_pick_prefers_the_least_loaded_member(
    fast_transport: Transport, registry: Registry, until: Until
) -> None:
    a, b = Member(fast_transport, "gen-a"), Member(fast_transport, "gen-b")
    scorer = Scorer(fast_transport, "rew-0")
    async with a, b, scorer, Directory(fast_transport, registry.endpoint) as directory:
        async with (
            Registration(fast_transport, registry.endpoint, a.info()),
            Registration(fast_transport, registry.endpoint, b.info()),
            Registration(fast_transport, registry.endpoint, scorer.info()),
        ):
            await directory.wait_until(lambda d: len(d.members()) == 3, timeout=10)
            # Idle members take turns.
            picked = {directory.pick("generator").endpoint for _ in range(2)}
            assert picked == {a.endpoint, b.endpoint}
            assert directory.pick("reward").endpoint == scorer.endpoint
            busy = directory.client("gen-a")
            calls = [asyncio.ensure_future(busy.request(Query(what="block"))) for _ in range(2)]
            await until(lambda: a.blocked == 2, what="gen-a busy")
            assert all(directory.pick("generator").endpoint == b.endpoint for _ in range(5))
            with pytest.raises(
                TransportError, match=r"no live 'trainer' .*roles present: \['generator', 'reward'\]"
            ):
                directory.pick("trainer")
            a.gate.set()
            await asyncio.gather(*calls)


async def test_member_leaving_fails_its_in_flight_requests(
    fast_transport: Transport, registry: Registry, until: Until
) -> None:
    member = Member(fast_transport, "gen-a")
    async with member, Directory(fast_transport, registry.endpoint) as directory:
        registration = Registration(fast_transport, registry.endpoint, member.info())
        await registration.start()
        await directory.wait_until(lambda d: len(d.members()) == 1, timeout=10)
        call = asyncio.ensure_future(directory.pick("generator").request(Query(what="block"), timeout=60))
        await until(lambda: member.blocked == 1, what="request in flight")
        await registration.close()  # it leaves on purpose while still serving
        with pytest.raises(PeerLost, match="left the directory"):
            await asyncio.wait_for(call, 30)


async def test_a_process_seen_to_exit_is_dropped_at_once(
    fast_transport: Transport, registry: Registry, until: Until
) -> None:
    """The launcher saw the process exit: its members leave now (their in-flight requests
    fail for re-issue), not after the heartbeat limit; other processes' members stay."""
    a, b = Member(fast_transport, "gen-a"), Member(fast_transport, "gen-b")
    async with a, b, Directory(fast_transport, registry.endpoint) as directory:
        async with (
            Registration(fast_transport, registry.endpoint, a.info(pid="4242")),
            Registration(fast_transport, registry.endpoint, b.info(pid="7")),
        ):
            await directory.wait_until(lambda d: len(d.members()) == 2, timeout=10)
            call = asyncio.ensure_future(directory.client("gen-a").request(Query(what="block"), timeout=60))
            await until(lambda: a.blocked == 1, what="request in flight")
            assert await registry.drop_process(4242) == ["gen-a"]
            assert [w.actor_id for w in registry.members()] == ["gen-b"]
            with pytest.raises(PeerLost, match="left the directory"):
                await asyncio.wait_for(call, 10)  # alive and beating: only the drop fails it
            assert await registry.drop_process(4242) == []


@pytest.fixture
async def slow_transport() -> AsyncIterator[Transport]:
    """Heartbeats every 30 s."""
    async for t in _checked(Transport(TransportConfig(heartbeat_interval_s=30.0))):
        yield t


async def test_a_request_whose_member_left_goes_to_a_live_one_without_backing_off(
    slow_transport: Transport, until: Until
) -> None:
    """The member a request went to is dropped (the launcher saw its process exit) while a
    second one, started since (a restart), is live: the request goes to the second at once.
    Backing off a heartbeat interval, which is for timeouts and transport errors, would take
    30 s here, past the 10 s the test gives it."""
    transport = slow_transport
    async with Registry(transport, endpoint=LOCAL, publish_endpoint=LOCAL) as registry:
        dead, restarted = Member(transport, "gen-a"), Member(transport, "gen-b")
        restarted.gate.set()
        async with dead, restarted, Directory(transport, registry.endpoint) as directory:
            async with Registration(transport, registry.endpoint, dead.info(pid="4242")):
                await directory.wait_until(lambda d: len(d.members()) == 1, timeout=10)
                call = asyncio.ensure_future(directory.request("generator", Query(what="block"), Ack, timeout=60, within=60))
                await until(lambda: dead.blocked == 1, what="request in flight on gen-a")
                async with Registration(transport, registry.endpoint, restarted.info(pid="7")):
                    await directory.wait_until(lambda d: len(d.members()) == 2, timeout=10)
                    await registry.drop_process(4242)
                    reply = await asyncio.wait_for(call, 10)
                    assert reply.info == {"who": "gen-b"}
                    dead.gate.set()


async def test_forged_members_are_refused_or_left_out(fast_transport: Transport, registry: Registry) -> None:
    """Found by fuzzing the registry: a Register with an endpoint no socket can connect to
    broke every directory's view (a member without a client: KeyError in pick), and the
    controllers with it. The registry refuses it; a directory leaves out what it cannot reach."""
    member = Member(fast_transport, "gen-a")
    async with member, Directory(fast_transport, registry.endpoint) as directory:
        async with Registration(fast_transport, registry.endpoint, member.info()):
            await directory.wait_until(lambda d: len(d.members()) == 1, timeout=10)
            client = Client(fast_transport, registry.endpoint)
            try:
                for endpoint in ("tcp://no such host:5", "garbage", "", "http://x:1", "tcp://host"):
                    forged = Register(worker=WorkerInfo(actor_id="fuzz", role="generator", endpoint=endpoint))
                    with pytest.raises(RemoteError, match="endpoint tcp://HOST:PORT"):
                        await client.request(forged, Ack)
                with pytest.raises(RemoteError, match="actor_id and role must be non-empty"):
                    await client.request(Register(worker=WorkerInfo(actor_id="", role="generator", endpoint="tcp://h:1")), Ack)
            finally:
                await client.close()
            assert [w.actor_id for w in registry.members()] == ["gen-a"]
            unreachable = WorkerInfo(actor_id="fuzz", role="generator", endpoint="tcp://no such host:5")
            await directory._apply(Membership(epoch=directory.epoch + 1, workers=[*directory.members(), unreachable]))
            assert [w.actor_id for w in directory.members()] == ["gen-a"]
            assert directory.pick("generator").endpoint == member.endpoint


async def test_registry_answers_queries(fast_transport: Transport, registry: Registry) -> None:
    member = Member(fast_transport, "gen-a")
    async with member, Registration(fast_transport, registry.endpoint, member.info()):
        async with Client(fast_transport, registry.endpoint) as client:
            members = await client.request(Query(what="members"), Membership)
            assert members == Membership(epoch=1, workers=[member.info()])
            publisher = await client.request(Query(what="publisher"), Ack)
            assert publisher.info == {"endpoint": registry.publish_endpoint}
            with pytest.raises(
                RemoteError, match="answers Query\\(what='members' \\| 'publisher'\\), not 'nope'"
            ):
                await client.request(Query(what="nope"))


async def test_restarted_registry_is_repopulated(fast_transport: Transport, until: Until) -> None:
    first = Registry(fast_transport, endpoint=LOCAL, publish_endpoint=LOCAL)
    await first.start()
    endpoint, publish = first.endpoint, first.publish_endpoint
    a, b = Member(fast_transport, "gen-a"), Member(fast_transport, "gen-b")
    async with a, b, Directory(fast_transport, endpoint) as directory:
        async with (
            Registration(fast_transport, endpoint, a.info()),
            Registration(fast_transport, endpoint, b.info()),
        ):
            await directory.wait_until(lambda d: len(d.members()) == 2, timeout=10)
            await first.close()
            # A new incarnation on the same endpoints starts empty, at epoch 0.
            second = await start_again(
                lambda: Registry(fast_transport, endpoint=endpoint, publish_endpoint=publish)
            )
            try:
                await until(lambda: len(second.members()) == 2, timeout=30, what="members registered again")
                await directory.wait_until(
                    lambda d: (
                        d.epoch == second.epoch and {w.actor_id for w in d.members()} == {"gen-a", "gen-b"}
                    ),
                    timeout=30,
                )
                assert (await directory.pick("generator").request(Query(what="who"), Ack)).info["who"] in (
                    "gen-a",
                    "gen-b",
                )
            finally:
                await second.close()


async def test_a_preferred_member_is_picked_until_it_is_much_busier_than_the_least_busy(
    fast_transport: Transport, registry: Registry, until: Until
) -> None:
    """An episode's next turn goes to the generator that served its previous one (its cache)
    while that one is not more than AFFINITY_SLACK requests busier than the least busy."""
    from yatt.runtime.registry import AFFINITY_SLACK

    a, b = Member(fast_transport, "gen-a"), Member(fast_transport, "gen-b")
    async with a, b, Directory(fast_transport, registry.endpoint) as directory:
        async with Registration(fast_transport, registry.endpoint, a.info()), Registration(fast_transport, registry.endpoint, b.info()):
            await directory.wait_until(lambda d: len(d.members()) == 2, timeout=10)
            picks = {directory.pick("generator", prefer=b.endpoint).endpoint for _ in range(6)}
            assert picks == {b.endpoint}, "idle: always the preferred one"
            assert {directory.pick("generator").endpoint for _ in range(6)} == {a.endpoint, b.endpoint}, "no preference: rotate"
            calls = [
                asyncio.ensure_future(directory.client("gen-b").request(Query(what="block"), timeout=60))
                for _ in range(AFFINITY_SLACK + 1)
            ]
            await until(lambda: b.blocked == AFFINITY_SLACK + 1, what="requests in flight")
            assert directory.pick("generator", prefer=b.endpoint).endpoint == a.endpoint, "too busy: the least busy one"
            b.gate.set()
            await asyncio.gather(*calls)
            assert directory.pick("generator", prefer=b.endpoint).endpoint == b.endpoint
