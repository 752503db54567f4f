"""Demonstrations: a row's reference episode, played through the run's own episode code,
gives the training row a rollout of those turns gives, token for token (tools and agent
code with the OpenAI endpoint alike); one that does not fit the run is refused by row."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from yatt.errors import ConfigError
from yatt.rl.agents.client import AgentRunner
from yatt.rl.agents.demonstrations import actions_of, play
from yatt.rl.agents.endpoint import Endpoint
from yatt.rl.agents.envs import env_factory
from yatt.rl.agents.episodes import EpisodeRunner
from yatt.rl.agents.render import Renderer
from yatt.rl.config import EnvConfig
from yatt.rl.tasks import answer_reward, calculator_prompts, guess_prompts

CALL, ANSWER = '<tool>calculator("47 + 38")</tool>', "<answer>85</answer>"
ROW: dict[str, Any] = {"index": 7, "prompt": "What is 47 + 38?", "answer": "85"}
ANSWERS = {"answer": "85"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def runner(tokenizer: Any, config: EnvConfig, max_new_tokens: int = 32) -> EpisodeRunner | AgentRunner:
    renderer = Renderer(tokenizer, protocol=config.render_protocol)
    kw: dict[str, Any] = dict(
        decode=lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)), eos_ids={tokenizer.eos_token_id},
        max_new_tokens=max_new_tokens, context=512,
    )  # fmt: skip
    if config.episode:
        return AgentRunner(config, renderer, endpoint=Endpoint("policy"), **kw)
    return EpisodeRunner(config, renderer, **kw)


async def test_a_tool_demonstration_is_the_row_a_rollout_of_its_turns_gives(tokenizer: Any) -> None:
    config = EnvConfig(tools=["yatt.rl.agents.tools:calculator"], protocol="tags", instructions="")
    run = runner(tokenizer, config)
    prompt = run.renderer.prompt([{"role": "user", "content": ROW["prompt"]}])
    [(ids, mask)] = await play(run, ROW, [CALL, ANSWER], prompt_ids=[], new_env=env_factory(config), eos_id=tokenizer.eos_token_id)
    call, result = run.renderer.encode(CALL), run.renderer.encode("<result>85</result>")
    answer = [*run.renderer.encode(ANSWER), tokenizer.eos_token_id]
    # The prompt as the tool environment writes it (no system paragraph: instructions ""), the
    # call ending at its stop string (no EOS), the tool's own result (run, not made up), the answer.
    assert ids == prompt + call + result + answer
    assert mask == [False] * len(prompt) + [True] * len(call) + [False] * len(result) + [True] * len(answer)
    assert answer_reward(ROW["prompt"], str(tokenizer.decode(ids[len(prompt) :], skip_special_tokens=True)), ANSWERS) == 1.0


async def test_agent_code_plays_a_demonstration_through_its_own_openai_client(tokenizer: Any) -> None:
    config = EnvConfig(episode="yatt.rl.agents.games:calculator_agent", protocol="tags")
    run = runner(tokenizer, config)
    assert isinstance(run, AgentRunner) and run.endpoint is not None
    try:
        [(ids, mask)] = await play(run, ROW, [CALL, ANSWER], prompt_ids=[], new_env=None, eos_id=tokenizer.eos_token_id)
    finally:
        await run.endpoint.close()
    prompt = run.renderer.prompt([{"role": "user", "content": ROW["prompt"]}])
    call = [*run.renderer.encode(CALL), tokenizer.eos_token_id]  # (no tags stop string for agent code: EOS ends it)
    tool = run.renderer.observation([{"role": "tool", "content": "85"}], ended_with_eos=True)  # (the agent ran the calculator)
    answer = [*run.renderer.encode(ANSWER), tokenizer.eos_token_id]
    assert ids == prompt + call + tool + answer
    assert mask == [False] * len(prompt) + [True] * len(call) + [False] * len(tool) + [True] * len(answer)


async def test_agent_code_whose_openai_client_reads_the_environment_plays_a_demonstration(tokenizer: Any) -> None:
    """``openai.AsyncOpenAI()`` with no arguments, as the env role runs it: the warm start's
    episodes (played one at a time in the launcher) set OPENAI_BASE_URL and OPENAI_API_KEY."""
    import openai

    async def agent(client: Any, row: dict[str, Any]) -> float:
        llm = openai.AsyncOpenAI(max_retries=0)
        await llm.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        return 1.0

    config = EnvConfig(episode="yatt.rl.agents.games:calculator_agent", protocol="tags")
    run = runner(tokenizer, config)
    assert isinstance(run, AgentRunner) and run.endpoint is not None
    run.episode = agent
    try:
        [(ids, mask)] = await play(run, ROW, [ANSWER], prompt_ids=[], new_env=None, eos_id=tokenizer.eos_token_id)
    finally:
        await run.endpoint.close()
    prompt = run.renderer.prompt([{"role": "user", "content": ROW["prompt"]}])
    assert ids == [*prompt, *run.renderer.encode(ANSWER), tokenizer.eos_token_id] and mask.count(True) == len(ids) - len(prompt)
    assert "OPENAI_BASE_URL" not in os.environ, "put back as it was after the episode"


@pytest.mark.parametrize(
    ("actions", "max_new_tokens", "said"),
    [
        ([CALL, ANSWER, ANSWER], 32, "ended as 'done' after 2 of its 3 turns"),  # more turns than the episode takes
        ([ANSWER, ANSWER], 32, "ended as 'done' after 1 of its 2 turns"),  # an answer ends it
        ([CALL, ANSWER], 8, "turn 1 is 29 tokens, over the turn's 8"),
    ],
)
async def test_a_demonstration_that_does_not_fit_the_run_is_refused_naming_its_row(
    tokenizer: Any, actions: list[str], max_new_tokens: int, said: str
) -> None:
    config = EnvConfig(tools=["yatt.rl.agents.tools:calculator"], protocol="tags", instructions="", max_turns=4)
    run = runner(tokenizer, config, max_new_tokens=max_new_tokens)
    with pytest.raises(ConfigError, match="prompt 7's demonstration") as error:
        await play(run, ROW, actions, prompt_ids=[], new_env=env_factory(config), eos_id=tokenizer.eos_token_id)
    assert said in str(error.value)


def test_the_calculator_task_demonstrates_both_ways_and_its_reward_reads_the_answer_only() -> None:
    rows = calculator_prompts(400, seed=0)
    shown = [actions_of(metadata, index=i) for i, (_, metadata) in enumerate(rows)]
    calls = [a for a in shown if a is not None and len(a) == 2]
    assert 0.15 < len(calls) / len(rows) < 0.35  # (CALCULATOR_SHARE: most answer from memory)
    prompt, metadata = rows[0]
    terms = prompt.removeprefix("What is ").removesuffix("?")
    assert shown[0] in ([f'<tool>calculator("{terms}")</tool>', f"<answer>{metadata['answer']}</answer>"], [f"<answer>{metadata['answer']}</answer>"])
    assert answer_reward("", '<tool>calculator("47 + 38")</tool><result>85</result>', ANSWERS) == 0.0  # (the tool's result is not an answer)
    assert answer_reward("", "<answer>84</answer> <answer> 85 </answer>", ANSWERS) == 1.0
    with pytest.raises(ConfigError, match="prompt 3: metadata 'demonstration' must be a non-empty JSON list"):
        actions_of({"demonstration": json.dumps("<answer>1</answer>")}, index=3)


def test_tool_instructions_are_the_configs_own_or_none_and_only_for_tools() -> None:
    tools = ["yatt.rl.agents.tools:calculator"]
    default, own, none = (
        env_factory(EnvConfig(tools=tools, **kw))().reset(options={"row": ROW})[0]  # type: ignore[arg-type]
        for kw in ({}, {"instructions": "Use <tool>."}, {"instructions": ""})
    )
    assert default[0]["role"] == "system" and "calculator(expression: str)" in default[0]["content"]
    assert own[0] == {"role": "system", "content": "Use <tool>."}
    assert none == [{"role": "user", "content": ROW["prompt"]}]
    with pytest.raises(ConfigError, match="instructions is set without env.tools"):
        EnvConfig(class_="yatt.rl.agents.games:GuessNumber", instructions="")


async def test_the_guess_tasks_demonstrations_play_through_the_game_won_or_run_out_of_turns(tokenizer: Any) -> None:
    """A demonstration of a strategy that fails (counting up, past 4 turns) is played as
    well: the episode runs out of turns with every one of them played."""
    config = EnvConfig(class_="yatt.rl.agents.games:GuessNumber", kwargs={"high": 8}, max_turns=4, inline=True)
    run = runner(tokenizer, config, max_new_tokens=4)
    rows = guess_prompts(60, seed=0)
    halving = 0
    for index, (prompt, metadata) in enumerate(rows):
        actions = actions_of(metadata, index=index)
        assert actions is not None
        [(ids, mask)] = await play(
            run, {**metadata, "prompt": prompt, "index": index}, actions, prompt_ids=[], new_env=env_factory(config),
            eos_id=tokenizer.eos_token_id,
        )  # fmt: skip
        said = str(tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=True))
        assert said == "".join(actions)  # (the guesses trained; the game's answers between them not)
        secret = int(metadata["secret"])
        text = str(tokenizer.decode(ids, skip_special_tokens=True))
        halving += actions[0] == "4"  # (counting up starts at 1)
        assert text.count("Higher.") + text.count("Lower.") == len(actions) - 1  # (none after the last turn)
        assert actions[-1] == str(secret) or (actions == ["1", "2", "3", "4"] and secret > 4)
    assert 8 < halving < 25  # (GUESS_SHARE of 60, about 15)
