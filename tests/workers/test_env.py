"""The env role: a real env worker over loopback, each episode's environment in a process
of its own under the limits; an environment that raises, hangs, burns CPU, grabs memory,
dies or reaches for the network ends its episode with the reason, and the worker goes on.
A controller's ``RemoteEnv`` rebuilds an episode whose worker is lost."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import AsyncIterator

import pytest

from protocols.messages import EnvCall, EnvReply, Metrics, Query
from workers.env import EnvWorker
from yatt.errors import RemoteError
from yatt.rl.agents.envs import EnvFailed
from yatt.rl.agents.remote import RemoteEnv
from yatt.rl.config import EnvConfig
from yatt.runtime.actor import Client
from yatt.runtime.registry import Directory, Registration, Registry
from yatt.runtime.transport import Transport, TransportConfig

LOCAL = "tcp://127.0.0.1:*"
COUNTER = "tests.workers.env_fixtures:Counter"
LIMITS = EnvConfig(class_=COUNTER, kwargs={"show_pid": True}, episode_timeout_s=3.0, cpu_limit_s=1.0, memory_limit_mb=256)


@pytest.fixture
async def transport() -> AsyncIterator[Transport]:
    async with Transport(TransportConfig()) as t:
        yield t


async def call(client: Client, episode: str, method: str, **fields: object) -> EnvReply:
    return await client.request(EnvCall(episode=episode, method=method, **fields), EnvReply, timeout=60)  # type: ignore[arg-type]


async def test_an_episode_is_reset_and_stepped_in_a_process_of_its_own_and_a_step_sent_twice_steps_once(transport: Transport) -> None:
    async with EnvWorker(transport, endpoint=LOCAL, config=LIMITS) as worker, Client(transport, worker.endpoint) as client:
        first = await call(client, "a", "reset", seed=7, row_json='{"prompt": "p"}')
        text = first.messages[0]["content"]
        assert text.startswith("seed 7 row p pid ") and int(text.rsplit(" ", 1)[1]) != os.getpid()
        one = await call(client, "a", "step", turn=0, action="go")
        again = await call(client, "a", "step", turn=0, action="go")  # a re-sent request
        assert one == again and one.messages == [{"role": "user", "content": "step 1 of seed 7: go"}]
        two = await call(client, "a", "step", turn=1, action="on")
        assert two.messages[0]["content"] == "step 2 of seed 7: on" and two.reward is None and not two.terminated
        three = await call(client, "a", "step", turn=2, action="end")
        assert three.terminated and three.reward == 3.0
        await call(client, "a", "close")
        assert worker.episodes == {}
        with pytest.raises(RemoteError) as lost:
            await call(client, "a", "step", turn=3, action="x")
        assert lost.value.error_type == "UnknownEpisode"


@pytest.mark.parametrize(
    ("action", "reason"),
    [
        ("raise", "Counter.step: ValueError: the action was 'raise'"),
        ("hang", "step took over env.episode_timeout_s=3 s; its process was killed"),
        ("spin", "the episode's process died during step (past its CPU limit, env.cpu_limit_s=1)"),
        ("grab", "Counter.step: MemoryError"),
        ("exit", "the episode's process died during step (exit code 3)"),
    ],
)
async def test_an_environment_that_misbehaves_ends_its_episode_with_the_reason_and_the_worker_goes_on(
    transport: Transport, action: str, reason: str
) -> None:
    async with EnvWorker(transport, endpoint=LOCAL, config=LIMITS) as worker, Client(transport, worker.endpoint) as client:
        await call(client, "bad", "reset")
        await call(client, "good", "reset")
        with pytest.raises(RemoteError) as failed:
            await call(client, "bad", "step", turn=0, action=action)
        assert failed.value.error_type == "EnvFailed" and reason in failed.value.remote_message
        assert "bad" not in worker.episodes  # its process is gone
        ok = await call(client, "good", "step", turn=0, action="go")  # the other episode, and the worker, go on
        assert ok.messages[0]["content"] == "step 1 of seed 0: go"
        if action == "spin":  # the CPU its episode processes burnt is the env role's cost (the planner's env_s)
            stats = await client.request(Query(what="stats"), Metrics, timeout=30)
            assert stats.values["env/cpu_s"] >= 0.9 and stats.values["env/failed"] == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's")
async def test_an_environment_reaches_no_network_unless_allowed(transport: Transport) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        async with EnvWorker(transport, endpoint=LOCAL, config=LIMITS) as worker, Client(transport, worker.endpoint) as client:
            await call(client, "a", "reset")
            with pytest.raises(RemoteError) as refused:
                await call(client, "a", "step", turn=0, action=f"connect:{port}")
            assert "OSError" in refused.value.remote_message and "unreachable" in refused.value.remote_message
        allowed = EnvConfig(class_=COUNTER, network=True)
        async with EnvWorker(transport, endpoint=LOCAL, config=allowed) as worker, Client(transport, worker.endpoint) as client:
            await call(client, "a", "reset")
            assert (await call(client, "a", "step", turn=0, action=f"connect:{port}")).messages[0]["content"] == "connected"
    finally:
        server.close()


@contextlib.asynccontextmanager
async def two_workers(
    transport: Transport, config: EnvConfig
) -> AsyncIterator[tuple[Directory, EnvWorker, EnvWorker, dict[str, Registration]]]:
    """A registry, two registered env workers of ``config`` and a directory that sees both;
    the registrations by endpoint (closing one is how a killed worker leaves)."""
    async with (
        Registry(transport, endpoint=LOCAL, publish_endpoint=LOCAL) as registry,
        EnvWorker(transport, endpoint=LOCAL, config=config) as one,
        EnvWorker(transport, endpoint=LOCAL, config=config) as two,
        Directory(transport, registry.endpoint) as directory,
    ):
        registrations = {w.endpoint: Registration(transport, registry.endpoint, w.info()) for w in (one, two)}
        for r in registrations.values():
            await r.start()
        try:
            await directory.wait_until(lambda d: len(d.members("env")) == 2, timeout=30)
            yield directory, one, two, registrations
        finally:
            for r in registrations.values():
                await r.close()


async def test_a_remote_env_whose_worker_is_lost_is_rebuilt_on_another_and_goes_on_where_it_was(transport: Transport) -> None:
    """Two env workers; the episode's worker closes after turn 2 (as a killed one leaves the
    directory): turn 3 goes to the other, after a reset with the same seed and the two
    actions again, and answers as the episode would have."""
    async with two_workers(transport, EnvConfig(class_=COUNTER, kwargs={"turns": 4})) as (directory, one, two, registrations):
        env = RemoteEnv(directory, name="g/0", timeout_s=10.0, wait_s=30.0)
        obs, _ = await env.reset(seed=3, options={"row": {"prompt": "p"}})
        assert obs == [{"role": "user", "content": "seed 3 row p"}]
        for action in ("a", "b"):
            await env.step(action)
        holder = one if env.at == one.endpoint else two
        other = two if holder is one else one
        await registrations[holder.endpoint].close()
        await holder.close()
        obs3, reward, done, _, _ = await env.step("c")
        assert obs3 == [{"role": "user", "content": "step 3 of seed 3: c"}] and reward is None and not done
        assert env.at == other.endpoint and env.rebuilt == 1 and other.started == 1
        assert (await env.step("d"))[1:3] == (4.0, True)
        await env.close()
        assert other.episodes == {}


async def test_a_remote_env_that_answers_otherwise_when_rebuilt_ends_its_episode(transport: Transport) -> None:
    """An environment not deterministic in its seed (its first observation names its
    process) cannot be rebuilt: the step fails as the episode's env_error, naming why."""
    async with (
        Registry(transport, endpoint=LOCAL, publish_endpoint=LOCAL) as registry,
        EnvWorker(transport, endpoint=LOCAL, config=LIMITS) as worker,
        Directory(transport, registry.endpoint) as directory,
    ):
        async with Registration(transport, registry.endpoint, worker.info()):
            await directory.wait_until(lambda d: bool(d.members("env")), timeout=30)
            env = RemoteEnv(directory, name="g/1", timeout_s=10.0, wait_s=30.0)
            await env.reset(seed=1)
            await env.step("a")
            await worker._close(env.episode)  # (its process gone: the worker holds the episode no more)
            with pytest.raises(EnvFailed, match="reset with seed 1 answered otherwise than before: the environment is not deterministic"):
                await env.step("b")


async def test_a_call_while_no_env_worker_lives_waits_for_one(transport: Transport) -> None:
    config = EnvConfig(class_=COUNTER)
    async with (
        Registry(transport, endpoint=LOCAL, publish_endpoint=LOCAL) as registry,
        Directory(transport, registry.endpoint) as directory,
    ):
        env = RemoteEnv(directory, name="g/2", timeout_s=10.0, wait_s=30.0)
        reset = asyncio.create_task(env.reset(seed=2))
        await asyncio.sleep(0.5)
        assert not reset.done()
        async with EnvWorker(transport, endpoint=LOCAL, config=config) as worker, Registration(transport, registry.endpoint, worker.info()):
            obs, _ = await asyncio.wait_for(reset, 30)
            assert obs[0]["content"].startswith("seed 2")
            await env.close()


async def test_a_remote_env_with_snapshots_is_rebuilt_from_its_last_snapshot(transport: Transport) -> None:
    """Snapshot after turn 2, step turn 3, lose the worker: the other one resets, restores
    the snapshot and steps only turn 3 again (a replay from the reset would answer 'step 1'
    to it and fail the check), then turn 4 goes on from there."""
    config = EnvConfig(class_="tests.workers.env_fixtures:SavedCounter", kwargs={"turns": 5})
    async with two_workers(transport, config) as (directory, one, two, registrations):
        env = RemoteEnv(directory, name="g/3", timeout_s=10.0, wait_s=30.0)
        await env.reset(seed=3)
        assert env.supports_snapshots
        await env.step("a")
        await env.step("b")
        assert await env.snapshot() == b"3 2" and env.steps == []
        await env.step("c")
        holder = one if env.at == one.endpoint else two
        await registrations[holder.endpoint].close()
        await holder.close()
        obs, *_ = await env.step("d")
        assert obs == [{"role": "user", "content": "step 4 of seed 3: d"}] and env.rebuilt == 1
        fresh = RemoteEnv(directory, name="g/4", timeout_s=10.0, wait_s=30.0)
        await fresh.reset(seed=9)
        await fresh.restore(b"3 4")  # a resumed episode: restored, not stepped
        assert (await fresh.step("e"))[0] == [{"role": "user", "content": "step 5 of seed 3: e"}]


async def test_an_episode_no_call_touches_is_closed_and_its_process_goes(transport: Transport) -> None:
    """Its controller died: after 3 x env.episode_timeout_s untouched, the worker closes it."""
    config = EnvConfig(class_=COUNTER, episode_timeout_s=0.2)
    async with EnvWorker(transport, endpoint=LOCAL, config=config) as worker, Client(transport, worker.endpoint) as client:
        await call(client, "left", "reset")
        process = worker.episodes["left"].process
        await call(client, "kept", "reset")
        for _ in range(15):
            await asyncio.sleep(0.1)
            await call(client, "kept", "step", turn=worker.episodes["kept"].turn + 1, action="x")
        assert set(worker.episodes) == {"kept"} and not process.is_alive()


async def test_an_episode_process_does_not_pass_for_its_worker(transport: Transport) -> None:
    """Its command line names it (a tool that looks roles up by command line, the kill
    tests', must not take it for the env worker)."""
    import psutil

    async with EnvWorker(transport, endpoint=LOCAL, config=LIMITS) as worker, Client(transport, worker.endpoint) as client:
        await call(client, "a", "reset")
        title = " ".join(psutil.Process(worker.episodes["a"].process.pid).cmdline()).strip()
        assert title == f"yatt env episode process of pid {os.getpid()}"
