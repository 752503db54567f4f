"""Agent code that drives its own episode (``env.episode``): its calls become the row,
token for token; a rewritten history starts a new row of the sample; its limits and
errors end the episode with the reason; a recorded episode replays without generating."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.yatt.rl.agents.test_episodes import policy
from yatt.errors import PluginError
from yatt.rl.agents.client import AgentRunner, Episode, load_episode
from yatt.rl.agents.episodes import Diverged, Trajectory, Turn
from yatt.rl.agents.games import guess_agent
from yatt.rl.agents.render import Renderer
from yatt.rl.config import EnvConfig


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def runner(tokenizer: Any, episode: Episode, **env: Any) -> AgentRunner:
    config = EnvConfig(**{"episode": "yatt.rl.agents.games:guess_agent", **env})
    renderer = Renderer(tokenizer, protocol=config.render_protocol)
    decode = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))  # noqa: E731
    return AgentRunner(
        config, renderer, decode=decode, eos_ids={tokenizer.eos_token_id}, max_new_tokens=4, context=512, episode=episode
    )  # fmt: skip


async def play(run: AgentRunner, generate: Any, row: dict[str, Any] | None = None, **kw: Any) -> tuple[list[int], Trajectory]:
    return await run.run(row or {"index": 3, "prompt": "p"}, generate, **kw)


async def test_chat_calls_make_one_row_the_replies_kept_the_new_messages_rendered(tokenizer: Any) -> None:
    replies: list[dict[str, Any]] = []

    async def agent(client: Any, row: dict[str, Any]) -> dict[str, Any]:
        messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
        for answer in ("no", "still no"):
            replies.append(await client.chat(messages))
            messages += [replies[-1], {"role": "user", "content": answer}]
        replies.append(await client.chat(messages))
        return {"reward": 0.75, "note": "info is the user's"}

    run, generate = runner(tokenizer, agent), policy(tokenizer)
    prompt, out = await play(run, generate)
    assert prompt == run.renderer.prompt([{"role": "user", "content": "p"}])
    turn = [*tokenizer.encode("5", add_special_tokens=False), tokenizer.eos_token_id]
    no, still = (run.renderer.observation([{"role": "user", "content": t}], ended_with_eos=True) for t in ("no", "still no"))
    assert out.ids == turn + no + turn + still + turn, "the replies as sampled, the answers rendered after them"
    assert out.mask == [True] * len(turn) + [False] * len(no) + [True] * len(turn) + [False] * len(still) + [True] * len(turn)
    assert out.versions.count(-1) == len(no) + len(still) and set(out.versions) == {2, -1}
    assert [ids for ids, _ in generate.seen] == [prompt, prompt + turn + no, prompt + turn + no + turn + still]
    assert (out.info.ended, out.info.turns, out.env_reward) == ("done", 3, 0.75)
    assert replies[0] == {"role": "assistant", "content": "5"}


async def test_token_in_token_out_and_a_rewritten_history_forks_a_row_whose_shared_turn_is_context(tokenizer: Any) -> None:
    """Calls 0 and 1 extend one row; call 2 (a summary that repeats turn 0 after another
    prompt) does not: it starts a new row, its context that row's prompt (turn 0 in it is
    context, not trained again); call 3 extends the new row."""
    turn = [*tokenizer.encode("5", add_special_tokens=False), tokenizer.eos_token_id]

    async def agent(client: Any, row: dict[str, Any]) -> float:
        first = await client.generate([1, 2, 3])
        assert first.token_ids == turn and first.text == "5" and len(first.logprobs) == len(first.token_ids)
        await client.generate([1, 2, 3, *turn, 7, 7])  # extends: 7 7 is the observation
        await client.generate([1, 9, *turn])  # a summary: a new row
        await client.generate([1, 9, *turn, *turn, 8])  # extends the new row: 8 is its observation
        return 1.0

    run, generate = runner(tokenizer, agent), policy(tokenizer)
    prompt, out = await play(run, generate)
    assert prompt == [1, 2, 3] and len(generate.seen) == 4
    assert (out.info.ended, out.info.turns, out.env_reward) == ("done", 4, 1.0)
    assert out.ids == turn + [7, 7] + turn and out.mask == [True] * len(turn) + [False, False] + [True] * len(turn)
    [fork] = out.forks
    assert fork.prompt_ids == [1, 9, *turn], "the forking call's context, no loss"
    assert fork.ids == turn + [8] + turn and fork.mask == [True] * len(turn) + [False] + [True] * len(turn)
    assert fork.versions == [2] * len(turn) + [-1] + [2] * len(turn)
    assert generate.seen[3][0] == fork.prompt_ids + fork.ids[: len(turn) + 1]
    # Four turns sampled, four trained: turn 0 is in the fork's prompt as context only.
    assert sum(out.mask) + sum(fork.mask) == 4 * len(turn)


async def test_limits_end_the_episode_and_a_function_may_still_say_its_reward(tokenizer: Any) -> None:
    async def chatty(client: Any, row: dict[str, Any]) -> float:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
        try:
            while True:
                messages += [await client.chat(messages), {"role": "user", "content": "again"}]
        except Exception:
            return 0.5

    run = runner(tokenizer, chatty, max_turns=3)
    _, out = await play(run, policy(tokenizer))
    assert (out.info.ended, out.info.turns, out.env_reward) == ("max_turns", 3, 0.5)
    assert out.mask[-1], "no observation after the last turn"
    run = runner(tokenizer, chatty, max_turns=50, max_total_tokens=60)
    prompt, out = await play(run, generate := policy(tokenizer))
    assert out.info.ended == "budget" and len(prompt) + len(out.ids) <= 60
    assert all(budget <= 60 - len(ids) for ids, budget in generate.seen)


async def test_a_hanging_or_raising_function_ends_its_episode_and_generation_is_not_its_time(tokenizer: Any) -> None:
    async def hangs(client: Any, row: dict[str, Any]) -> float:
        await client.generate([1, 2])
        await asyncio.sleep(30)
        return 1.0

    run = runner(tokenizer, hangs, episode_timeout_s=0.3)
    _, out = await play(run, policy(tokenizer))
    assert out.info.ended == "timeout" and "episode_timeout_s=0.3" in out.info.detail and out.info.turns == 1

    fast = policy(tokenizer)

    async def slow_policy(ids: list[int], budget: int, observed: Any = None, encoded: Any = None) -> Any:
        await asyncio.sleep(0.5)  # longer than the timeout: the policy's time, not the function's
        return await fast(ids, budget)

    async def twice(client: Any, row: dict[str, Any]) -> float:
        await client.generate([1, 2])
        return 1.0

    _, out = await play(runner(tokenizer, twice, episode_timeout_s=0.3), slow_policy)
    assert (out.info.ended, out.env_reward) == ("done", 1.0)

    async def raises(client: Any, row: dict[str, Any]) -> float:
        await client.generate([1, 2])
        raise KeyError("the board")

    _, out = await play(runner(tokenizer, raises), policy(tokenizer))
    assert out.info.ended == "env_error" and out.info.detail.endswith("KeyError: 'the board'") and out.mask and all(out.mask)

    async def says_nothing(client: Any, row: dict[str, Any]) -> str:
        await client.generate([1, 2])
        return "yes"

    _, out = await play(runner(tokenizer, says_nothing), policy(tokenizer))
    assert out.info.ended == "env_error" and "returned 'yes'" in out.info.detail


async def test_agent_code_that_sends_an_image_ends_its_episode_saying_so(tokenizer: Any) -> None:
    async def shows(client: Any, row: dict[str, Any]) -> float:
        await client.chat([{"role": "user", "content": "hi"}])
        url = {"url": "data:image/png;base64,iVBORw0KGgo="}
        await client.chat([{"role": "user", "content": [{"type": "image_url", "image_url": url}, {"type": "text", "text": "?"}]}])
        return 1.0

    _, out = await play(runner(tokenizer, shows), policy(tokenizer))
    assert (out.info.ended, out.info.turns) == ("env_error", 1)
    assert "message 0 holds an image" in out.info.detail and "env.class" in out.info.detail


async def test_a_recorded_episode_replays_its_turns_without_generating(tokenizer: Any) -> None:
    run = runner(tokenizer, lambda client, row: guess_agent(client, row, turns=3), max_turns=3)
    records: list[Turn] = []

    async def record(turn: Turn) -> None:
        records.append(turn)

    prompt, whole = await play(run, generate := policy(tokenizer, text="1"), record=record)
    assert [t.index for t in records] == [0, 1, 2] and len(generate.seen) == 3
    assert records[0].obs_ids and records[-1].obs_ids == [] and records[-1].ended == "done"
    # Killed after two recorded turns: the function runs again, its first two calls answered from the record.
    again, resumed = await play(run, generate := policy(tokenizer, text="1"), recorded=records[:2], record=record)
    assert len(generate.seen) == 1 and (again, resumed.ids, resumed.mask) == (prompt, whole.ids, whole.mask)
    assert [t.index for t in records] == [0, 1, 2, 2], "only the new turn recorded"
    # A function that answers otherwise than recorded: its episode must run again from the start.
    other = [records[0], records[1], *records[2:3]]
    other[0] = Turn(**{**other[0].__dict__, "obs_ids": [9, 9]})
    with pytest.raises(Diverged, match="turn 0 replayed to another outcome"):
        await play(run, policy(tokenizer, text="1"), recorded=other)


async def test_a_recorded_episode_that_forked_replays_into_the_same_rows(tokenizer: Any) -> None:
    """Killed after the forking call's turn was recorded: the function runs again, its calls
    answered from the record (the fork found again from its calls), only the last generated."""

    async def agent(client: Any, row: dict[str, Any]) -> float:
        first = await client.chat([{"role": "user", "content": "a"}])
        summary = [{"role": "user", "content": f"summary {first['content']}"}]
        second = await client.chat(summary)
        await client.chat([*summary, second, {"role": "user", "content": "go on"}])
        return 1.0

    run, records = runner(tokenizer, agent), list[Turn]()

    async def record(turn: Turn) -> None:
        records.append(turn)

    prompt, whole = await play(run, policy(tokenizer), record=record)
    assert len(whole.forks) == 1 and [t.obs_ids == [] for t in records] == [True, False, True], "nothing follows turn 0 in its row"
    again, resumed = await play(run, generate := policy(tokenizer), recorded=records[:2], record=record)
    assert len(generate.seen) == 1 and (again, resumed.ids, resumed.mask) == (prompt, whole.ids, whole.mask)
    assert [(f.prompt_ids, f.ids, f.mask, f.versions) for f in resumed.forks] == [(f.prompt_ids, f.ids, f.mask, f.versions) for f in whole.forks]


async def test_chat_replies_carry_the_tool_calls_in_openais_shape(tokenizer: Any) -> None:
    add = {"type": "function", "function": {"name": "add", "parameters": {"properties": {"a": {}, "b": {}}}}}

    async def agent(client: Any, row: dict[str, Any]) -> float:
        agent.replies = [await client.chat([{"role": "user", "content": "add"}], tools=row["tools"])]  # type: ignore[attr-defined]
        return 0.0

    run = runner(tokenizer, agent)
    run.max_new_tokens = 64
    for tools, a in ((None, "0"), ([add], "a")):  # (positional arguments named by the tool's schema)
        await play(run, policy(tokenizer, text='sure <tool>add(2, b=3)</tool>'), row={"index": 0, "tools": tools})
        assert agent.replies[0] == {  # type: ignore[attr-defined]
            "role": "assistant", "content": "sure",
            "tool_calls": [
                {"id": "call_0_0", "type": "function", "function": {"name": "add", "arguments": f'{{"{a}": 2, "b": 3}}'}}
            ],
        }  # fmt: skip


def test_agent_code_that_cannot_drive_an_episode_is_refused_naming_it() -> None:
    with pytest.raises(PluginError, match=r"env.episode: 'yatt.rl.agents.games:GuessNumber' is not an async function"):
        load_episode("yatt.rl.agents.games:GuessNumber")
    with pytest.raises(PluginError, match=r"env.episode: '.*:takes_one' cannot be called as run\(client, row\)"):
        load_episode(f"{__name__}:takes_one")
    assert load_episode("yatt.rl.agents.games:guess_agent") is guess_agent


async def takes_one(client: Any) -> float:
    return 0.0
