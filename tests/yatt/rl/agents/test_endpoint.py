"""The OpenAI-compatible endpoint, called by the real ``openai`` client from agent code:
a call round-trips with its tokens recorded as the turn, a wrong key and a malformed
request get OpenAI's error shape while the endpoint keeps serving, a rewritten history
starts a new row."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.yatt.rl.agents.test_episodes import policy
from yatt.rl.agents.client import AgentRunner, Episode
from yatt.rl.agents.endpoint import Endpoint
from yatt.rl.agents.render import Renderer
from yatt.rl.config import EnvConfig

CALCULATOR: Any = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def runner(tokenizer: Any, episode: Episode, endpoint: Endpoint, **env: Any) -> AgentRunner:
    config = EnvConfig(**{"episode": "yatt.rl.agents.games:guess_agent", **env})
    renderer = Renderer(tokenizer, protocol=config.render_protocol)
    decode = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))  # noqa: E731
    return AgentRunner(
        config, renderer, decode=decode, eos_ids={tokenizer.eos_token_id}, max_new_tokens=200, context=512,
        episode=episode, endpoint=endpoint,
    )  # fmt: skip


async def test_an_unmodified_openai_client_round_trips_with_its_tokens_recorded(tokenizer: Any) -> None:
    endpoint, seen = Endpoint("tiny"), dict[str, Any]()

    async def agent(client: Any, row: dict[str, Any]) -> float:
        llm = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
        seen["models"] = [m.id async for m in llm.models.list()]
        messages: list[Any] = [{"role": "user", "content": "What is 3 * 7?"}]
        first = await llm.chat.completions.create(
            model="tiny", messages=messages, tools=[CALCULATOR], extra_body={"return_token_ids": True}
        )
        seen["first"] = first
        message = first.choices[0].message
        assert message.tool_calls
        messages += [message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "21"}]
        stream = await llm.chat.completions.create(model="tiny", messages=messages, stream=True)
        seen["streamed"] = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        return 1.0

    run = runner(tokenizer, agent, endpoint, protocol="hermes")
    try:
        generate = policy(tokenizer, text='<tool_call>{"name": "calculator", "arguments": {"expression": "3 * 7"}}</tool_call>')
        prompt, out = await run.run({"index": 0}, generate)
    finally:
        await endpoint.close()
    first = seen["first"]
    assert seen["models"] == ["tiny"] and first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments) == ("calculator", '{"expression": "3 * 7"}')
    turn = generate.seen[0]
    assert prompt == turn[0] == run.renderer.prompt([{"role": "user", "content": "What is 3 * 7?"}], tools=[CALCULATOR])
    sampled = out.ids[: out.turns[0][1]]
    assert first.choices[0].model_extra["token_ids"] == sampled, "the reply's ids are the turn's, as recorded"
    assert first.usage.prompt_tokens == len(prompt) and first.usage.completion_tokens == len(sampled)
    # The second call rendered only the tool message after the kept reply: one row.
    tool = run.renderer.observation([{"role": "tool", "content": "21", "tool_call_id": call.id}], ended_with_eos=True)
    assert generate.seen[1][0] == prompt + sampled + tool
    assert seen["streamed"] == "" and (out.info.ended, out.info.turns, out.env_reward) == ("done", 2, 1.0)


async def test_a_wrong_key_or_a_malformed_request_gets_openais_error_and_the_endpoint_keeps_serving(tokenizer: Any) -> None:
    endpoint, seen = Endpoint("tiny"), dict[str, Any]()

    async def agent(client: Any, row: dict[str, Any]) -> float:
        stranger = openai.AsyncOpenAI(base_url=client.base_url, api_key="yatt-guessed", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            await stranger.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        seen["401"] = refused.value.body
        async with httpx.AsyncClient(base_url=client.base_url, headers={"Authorization": f"Bearer {client.api_key}"}) as raw:
            for body, field in (
                ({"model": "tiny"}, "messages"), ({"model": "tiny", "messages": [{"content": "x"}]}, "messages[0]"),
                ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
                ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": "any"}, "tool_choice"),
            ):  # fmt: skip
                answer = await raw.post("/chat/completions", json=body)
                assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text
            answer = await raw.post("/chat/completions", content=b"{not json")
            assert answer.status_code == 400 and "not JSON" in answer.json()["error"]["message"]
        llm = client.openai()  # (on the shared connections: closing it leaves them open)
        await llm.close()
        reply = await client.openai().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        seen["served"] = reply.choices[0].message.content
        return 0.0

    try:
        _, out = await runner(tokenizer, agent, endpoint).run({"index": 0}, policy(tokenizer))
    finally:
        await endpoint.close()
    assert seen["401"]["type"] == "authentication_error" and seen["401"]["code"] == "invalid_api_key"
    assert "client.api_key" in seen["401"]["message"]
    assert seen["served"] == "5" and out.info.ended == "done"


async def test_a_rewritten_history_through_the_endpoint_starts_a_new_row(tokenizer: Any) -> None:
    """A summary instead of the conversation: answered as any request, its messages
    rendered whole as the prompt of a new row of the episode; the next request, which
    goes on from it, extends that row."""
    endpoint = Endpoint("tiny")

    async def agent(client: Any, row: dict[str, Any]) -> float:
        llm = openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key, max_retries=0)
        first = await llm.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}])
        summary: list[Any] = [{"role": "user", "content": f"summary: a -> {first.choices[0].message.content}"}]
        second = await llm.chat.completions.create(model="tiny", messages=summary)
        summary += [second.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
        await llm.chat.completions.create(model="tiny", messages=summary)
        return 1.0

    run, generate = runner(tokenizer, agent, endpoint), policy(tokenizer)
    try:
        prompt, out = await run.run({"index": 0}, generate)
    finally:
        await endpoint.close()
    assert (out.info.ended, out.info.turns, out.env_reward) == ("done", 3, 1.0)
    turn = [*tokenizer.encode("5", add_special_tokens=False), tokenizer.eos_token_id]
    assert prompt == run.renderer.prompt([{"role": "user", "content": "a"}]) and out.ids == turn
    [fork] = out.forks
    assert fork.prompt_ids == run.renderer.prompt([{"role": "user", "content": "summary: a -> 5"}])
    obs = run.renderer.observation([{"role": "user", "content": "and?"}], ended_with_eos=True)
    assert fork.ids == turn + obs + turn and generate.seen[2][0] == fork.prompt_ids + turn + obs


async def test_episodes_starting_together_share_one_server() -> None:
    import psutil

    def listening() -> int:
        return sum(c.status == psutil.CONN_LISTEN for c in psutil.Process().net_connections(kind="tcp"))

    endpoint, before = Endpoint("tiny"), listening()
    try:
        await asyncio.gather(*(endpoint.start() for _ in range(4)))
        assert listening() == before + 1
        first = endpoint.base_url
        await endpoint.start()
        assert endpoint.base_url == first and first.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient() as http:
            answer = await http.get(f"{first}/models", headers={"Authorization": "Bearer nobody"})
        assert answer.status_code == 401
    finally:
        await endpoint.close()
