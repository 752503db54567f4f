"""Built-in environments, small enough to learn on a CPU and written as a user writes one.

``GuessNumber`` (``env.class: yatt.rl.agents.games:GuessNumber``): guess a number with
higher/lower feedback, over several turns. It follows Gymnasium's text convention exactly
(``reset(seed=, options=)``, ``step(action)``), so it also shows what yatt expects of a
user's environment.

``CountRed`` (``env.class: yatt.rl.agents.games:CountRed``): a vision-language game. The
first observation is a picture and a question (how many red squares?); a wrong count is
answered with a second picture, the same one with only its red squares left. Images ride in
observations as a user's environment sends them: chat content parts with PIL images.

``guess_agent`` (``env.episode: yatt.rl.agents.games:guess_agent``): the same game written
as agent code that drives its own episode (yatt/rl/agents/client.py): it keeps the
conversation, asks the policy through ``client.chat`` and returns the reward.

``calculator_agent`` (``env.episode: yatt.rl.agents.games:calculator_agent``): an agent
written against the ``openai`` SDK, as one is written for any OpenAI-compatible server:
tool calling with a calculator it runs itself, through the run's endpoint
(yatt/rl/agents/endpoint.py); only its client (``client.openai()``, an
``openai.AsyncOpenAI`` with the episode's base URL and key) is yatt's.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from yatt.rl.agents.tools import calculator
from yatt.rl.tasks import answer_reward, count_red_images, count_red_prompts


class GuessNumber:
    """Guess a secret whole number in [1, ``high``] (the data row's ``secret`` where it has
    one, as the ``guess`` task's rows do, else chosen by the reset seed); each wrong
    guess is answered "higher" or "lower". Reward 1 for the right guess (the episode ends),
    0 otherwise; a turn without a number is told how to answer."""

    def __init__(self, high: int = 8) -> None:
        if high < 2:
            raise ValueError(f"high must be >= 2 (got {high})")
        self.high = high
        self.secret = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        row = (options or {}).get("row") or {}
        self.secret = int(row["secret"]) if "secret" in row else random.Random(seed).randint(1, self.high)
        return f"I am thinking of a number from 1 to {self.high}. Guess it: answer with the number only.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        found = re.search(r"-?\d+", action)
        if found is None:
            return f"Answer with a number from 1 to {self.high}.", 0.0, False, False, {}
        guess = int(found.group())
        if guess == self.secret:
            return "Correct.", 1.0, True, False, {}
        return ("Higher." if guess < self.secret else "Lower."), 0.0, False, False, {}


class CountRed:
    """Count the red squares of a ``count_red`` picture (the data row's, from its ``cells``
    and ``squares`` where it has them, as the count_red task's rows do, else drawn from the
    reset seed). Reward 1 for the right count (the episode ends); a wrong or missing one is
    shown the picture again with the blue squares removed, reward 0."""

    QUESTION = "How many red squares? Answer with the number only."

    def __init__(self) -> None:
        self.picture: dict[str, str] = {}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        row = (options or {}).get("row") or {}
        keys = ("cells", "squares", "answer")
        self.picture = (
            {k: str(row[k]) for k in keys} if all(k in row for k in keys)
            else count_red_prompts(1, seed or 0)[0][1]
        )  # fmt: skip
        image = count_red_images(self.picture)[0]
        return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": self.QUESTION}]}], {}

    def step(self, action: str) -> tuple[list[dict[str, Any]] | None, float, bool, bool, dict[str, Any]]:
        found = re.match(r"\s*(\d+)", action)
        if found is not None and int(found.group(1)) == int(self.picture["answer"]):
            return None, 1.0, True, False, {}
        red_only = {**self.picture, "cells": self.picture["cells"].replace("b", ".")}
        hint = [{"type": "image", "image": count_red_images(red_only)[0]}, {"type": "text", "text": "Not quite. Here are the red ones alone. How many?"}]
        return [{"role": "user", "content": hint}], 0.0, False, False, {}


async def guess_agent(client: Any, row: dict[str, Any], high: int = 8, turns: int = 4) -> float:
    """Guess the number as an agent loop of one's own: the secret follows the row (a
    group's episodes play one game), the game's answers are user messages, the reward is 1
    for the right guess within ``turns``, else 0."""
    game = GuessNumber(high)
    prompt, _ = game.reset(seed=int(row["index"]), options={"row": row})
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    for _ in range(turns):
        reply = await client.chat(messages)
        answer, reward, done, _, _ = game.step(reply["content"] or "")
        if done:
            return reward
        messages += [reply, {"role": "user", "content": answer}]
    return 0.0


CALCULATOR: Any = {  # (OpenAI's tool schema; typed as the SDK's TypedDict it is)
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": 'The expression, e.g. "3 + 4".'}},
            "required": ["expression"],
        },
    },
}


async def calculator_agent(client: Any, row: dict[str, Any], turns: int = 3) -> float:
    """Answer the row's question with a calculator tool, through the OpenAI chat API: each
    tool call the model makes is run and answered as a tool message; the first reply without
    one is the answer, scored by ``answer_reward`` (its ``<answer></answer>`` holds the row's
    answer; 0 when no answer comes within ``turns``)."""
    llm = client.openai()  # openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key), its connections shared
    messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
    for _ in range(turns):
        reply = (await llm.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return answer_reward(row["prompt"], reply.content or "", row)
        for call in reply.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as e:  # the model's arguments: its error is the tool's answer
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
