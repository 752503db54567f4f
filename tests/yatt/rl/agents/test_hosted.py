"""Agent code hosted in the env role (``env.episode`` with ``env.inline: false``): a real
env worker runs the function in an episode process of its own, under the limits; the
controller's ``AgentRunner`` answers and records each of its calls. An unmodified
``openai.AsyncOpenAI()`` reaches the policy through the process's own endpoint and nothing
else; a lost worker's episode is rebuilt on another without a turn generated twice; what the
function raises, returns or overruns ends its episode with the reason."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.workers.test_env import two_workers
from tests.yatt.rl.agents.test_episodes import policy
from workers.env import EnvWorker
from yatt.rl.agents.client import AgentRunner
from yatt.rl.agents.hosted import hosted
from yatt.rl.agents.remote import RemoteEnv
from yatt.rl.agents.render import Renderer
from yatt.rl.config import EnvConfig
from yatt.runtime.registry import Directory, Registration, Registry
from yatt.runtime.transport import Transport, TransportConfig

LOCAL = "tcp://127.0.0.1:*"
OPENAI_AGENT = "tests.workers.env_fixtures:openai_agent"
CHATTY = "tests.workers.env_fixtures:chatty_agent"
CALL = '<tool>calculator("3 * 7")</tool>'


@pytest.fixture
async def transport() -> AsyncIterator[Transport]:
    async with Transport(TransportConfig()) as t:
        yield t


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def runner(tokenizer: Any, config: EnvConfig) -> AgentRunner:
    decode = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))  # noqa: E731
    return AgentRunner(
        config, Renderer(tokenizer, protocol=config.render_protocol), decode=decode, eos_ids={tokenizer.eos_token_id},
        max_new_tokens=64, context=512,
    )  # fmt: skip


async def one_worker(transport: Transport, config: EnvConfig) -> Any:
    """A registry, one registered env worker of ``config`` and a directory that sees it."""
    registry = Registry(transport, endpoint=LOCAL, publish_endpoint=LOCAL)
    worker = EnvWorker(transport, endpoint=LOCAL, config=config)
    await registry.__aenter__()
    await worker.__aenter__()
    directory = Directory(transport, registry.endpoint)
    await directory.__aenter__()
    registration = Registration(transport, registry.endpoint, worker.info())
    await registration.start()
    await directory.wait_until(lambda d: len(d.members("env")) == 1, timeout=30)

    async def close() -> None:
        await registration.close()
        for part in (directory, worker, registry):
            await part.__aexit__(None, None, None)

    return directory, worker, close


async def run_hosted(
    tokenizer: Any, directory: Directory, config: EnvConfig, row: dict[str, Any], generate: Any
) -> tuple[list[int], Any, RemoteEnv]:  # fmt: skip
    env = RemoteEnv(directory, name="g/0", timeout_s=config.episode_timeout_s, wait_s=30.0)
    prompt, out = await runner(tokenizer, config).run(row, generate, episode=hosted(env, seed=0))
    return prompt, out, env


async def test_an_unmodified_openai_client_in_the_env_role_reaches_the_policy_and_nothing_else(
    transport: Transport, tokenizer: Any
) -> None:  # fmt: skip
    """The agent builds ``openai.AsyncOpenAI()`` from the environment variables the episode
    process was given; its two calls are the two turns of one row, the tool message between
    them masked out; it runs in a process of its own with no route to this machine's port."""
    server = socket.create_server(("127.0.0.1", 0))
    config = EnvConfig(episode=OPENAI_AGENT, protocol="tags", max_turns=4)
    directory, worker, close = await one_worker(transport, config)
    try:
        generate = policy(tokenizer, text=CALL)
        row = {"question": "3 * 7", "worker_pid": os.getpid(), "port": server.getsockname()[1]}
        prompt, out, env = await run_hosted(tokenizer, directory, config, row, generate)
    finally:
        await close()
        server.close()
    assert (out.info.ended, out.info.detail, out.info.turns, out.env_reward) == ("done", "", 2, 1.0)
    renderer = Renderer(tokenizer, protocol=config.render_protocol)
    assert prompt == generate.seen[0][0] == renderer.prompt([{"role": "user", "content": "What is 3 * 7?"}], tools=[
        {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}
    ])  # fmt: skip
    turn = [*tokenizer.encode(CALL, add_special_tokens=False), tokenizer.eos_token_id]
    (a0, a1), (b0, b1) = out.turns
    assert out.ids[a0:a1] == turn == out.ids[b0:b1] and all(out.mask[a0:a1]) and not any(out.mask[a1:b0])
    assert generate.seen[1][0] == prompt + out.ids[:b0], "the second call extends the first: one row"
    assert worker.started == 1 and worker.episodes == {}, "one episode process, closed at the end"


async def test_a_lost_worker_s_agent_is_rebuilt_on_another_without_generating_a_turn_twice(
    transport: Transport, tokenizer: Any
) -> None:  # fmt: skip
    """Two env workers; the one holding the agent leaves after its second call was answered
    (as a killed one does): the function runs again on the other from its row, its first
    two calls answered with the replies it had (checked to be the same calls), and goes on."""
    config = EnvConfig(episode=CHATTY, max_turns=4, episode_timeout_s=10.0)
    async with two_workers(transport, config) as (directory, one, two, registrations):
        inner = policy(tokenizer, text="5")
        env = RemoteEnv(directory, name="g/0", timeout_s=10.0, wait_s=30.0)

        async def generate(ids: list[int], budget: int, observed: Any = None, encoded: Any = None) -> Any:
            if len(inner.seen) == 2:  # (the third call: the worker that held the first two is gone)
                holder = one if env.at == one.endpoint else two
                await registrations[holder.endpoint].close()
                await holder.close()
            return await inner(ids, budget)

        _, out = await runner(tokenizer, config).run({"turns": 3}, generate, episode=hosted(env, seed=0))
    assert (out.info.ended, out.info.turns, out.env_reward) == ("done", 3, 1.0)
    assert env.rebuilt == 1 and len(inner.seen) == 3, "rebuilt once; each turn generated once"
    assert one.started + two.started == 2 and one.episodes == two.episodes == {}


async def test_a_hosted_agent_that_rewrites_its_history_forks_a_row(transport: Transport, tokenizer: Any) -> None:
    """Two chat calls, then one whose first message is edited: a new row of the sample,
    its prompt the whole edited conversation rendered."""
    config = EnvConfig(episode=CHATTY, max_turns=4)
    directory, worker, close = await one_worker(transport, config)
    try:
        _, out, _ = await run_hosted(tokenizer, directory, config, {"then": "rewrite"}, policy(tokenizer))
    finally:
        await close()
    assert (out.info.ended, out.info.turns, out.env_reward) == ("done", 3, 1.0) and len(out.forks) == 1
    renderer = Renderer(tokenizer, protocol=config.render_protocol)
    turn = {"role": "assistant", "content": "5"}
    edited = [{"role": "user", "content": "edited"}, turn, {"role": "user", "content": "again 1"}, turn, {"role": "user", "content": "and?"}]
    assert out.forks[0].prompt_ids == renderer.prompt(edited)


@pytest.mark.parametrize(
    ("row", "limits", "ended", "detail"),
    [
        ({"then": "raise"}, {}, "env_error", f"env.episode {CHATTY!r}: RuntimeError: the agent gave up"),
        ({"then": "return"}, {}, "env_error", f"env.episode {CHATTY!r}: returned 'done', not an async function"),
        ({"then": "over"}, {"max_turns": 2}, "max_turns", "env.max_turns=2 calls made"),
        ({"then": "spin"}, {"cpu_limit_s": 1.0}, "env_error", "the episode's process died during step (past its CPU limit"),
        ({"then": "spin"}, {"episode_timeout_s": 2.0}, "timeout", "env.episode took over env.episode_timeout_s=2 s"),
    ],
    ids=["raises", "returns text", "caught its limit", "CPU limit", "hangs"],
)
async def test_what_a_hosted_agent_raises_returns_or_overruns_ends_its_episode_naming_it(
    transport: Transport, tokenizer: Any, row: dict[str, Any], limits: dict[str, Any], ended: str, detail: str
) -> None:  # fmt: skip
    config = EnvConfig(**{"episode": CHATTY, "max_turns": 4, **limits})
    directory, worker, close = await one_worker(transport, config)
    try:
        _, out, _ = await run_hosted(tokenizer, directory, config, row, policy(tokenizer))
        assert (out.info.ended, out.info.turns) == (ended, 2) and detail in out.info.detail, out.info
        assert out.env_reward == (0.5 if ended == "max_turns" else 0.0)
        # The worker goes on: the next episode runs to its end.
        _, again, _ = await run_hosted(tokenizer, directory, config, {}, policy(tokenizer))
        assert (again.info.ended, again.env_reward) == ("done", 1.0)
        assert worker.episodes == {}, "the overrun episode's process is gone"
    finally:
        await close()
