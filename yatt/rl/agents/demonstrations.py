"""Demonstrations: a data row's reference episode, played through the run's own episode code.

A row whose metadata has ``"demonstration"`` (a JSON list of the policy's turns, as text)
shows what a good episode does, e.g. for a calculator task::

    ["<tool>calculator(\\"47 + 38\\")</tool>", "<answer>85</answer>"]

``play`` runs the row's episode as a rollout runs it (the environment's reset and steps,
the tools, or the user's ``env.episode`` function through its client and endpoint), with
each turn's tokens taken from the demonstration instead of sampled. What comes back is
the training row a rollout of those turns would give: the prompt, the turns (trained) and
the observations between them (not trained), token for token. The tiny model's warm start
(``model.warm_start_steps``) trains on these rows, as an SFT stage on multi-turn data
trains a policy before RL, so that its first RL steps see episodes that use the tools.

A turn ends where a rollout's would: at a stop string it ends with (``env.stop``, a tag
call's ``</tool>``), else with EOS. A demonstration that does not fit the run's limits (a
turn over ``controller.max_new_tokens``, more or fewer turns than the episode plays, an
episode that ends in an error, a timeout or the context budget) is a ``ConfigError``
naming the row.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from protocols.messages import Completion
from yatt.errors import ConfigError
from yatt.rl.agents.client import AgentRunner
from yatt.rl.agents.envs import call
from yatt.rl.agents.episodes import EpisodeRunner, Generate

DEMONSTRATION = "demonstration"
"""The metadata key of a row's demonstration."""

PLAYED = ("done", "max_turns", "truncated")
"""How a demonstrated episode may end: by itself, every turn played (a demonstration of
a strategy that fails, one that runs out of turns, is a demonstration too)."""


def actions_of(metadata: dict[str, Any], *, index: int) -> list[str] | None:
    """The row's demonstrated turns, or None where it has none."""
    raw = metadata.get(DEMONSTRATION)
    if raw is None:
        return None
    actions = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(actions, list) or not actions or not all(isinstance(a, str) for a in actions):
        raise ConfigError(
            f"prompt {index}: metadata {DEMONSTRATION!r} must be a non-empty JSON list of the policy's turns as "
            f"text (got {raw!r})"
        )
    return actions


async def play(
    runner: EpisodeRunner | AgentRunner, row: dict[str, Any], actions: list[str], *, prompt_ids: list[int],
    new_env: Callable[[], Any] | None, eos_id: int,
) -> list[tuple[list[int], list[bool]]]:  # fmt: skip
    """The training rows of ``row``'s episode with ``actions`` as the policy's turns (one;
    agent code whose calls fork: one more per fork): each its ids and, for each, whether
    it is the policy's (trained)."""
    where = f"prompt {row.get('index', '?')}'s {DEMONSTRATION}"
    generate, left = _scripted(runner, actions, eos_id=eos_id, where=where)
    if isinstance(runner, AgentRunner):
        prompt, trajectory = await runner.run(row, generate, environ=True)  # (one at a time: an AsyncOpenAI() finds its endpoint)
    else:
        assert new_env is not None
        env = new_env()
        try:
            prompt, images = await runner.start(env, seed=0, row=row, prompt_ids=prompt_ids)
            trajectory = await runner.run(env, prompt, generate)
            if images or trajectory.images:
                raise ConfigError(
                    f"{where}: its episode's observations hold images, and a warm start from demonstrations "
                    f"takes text episodes only; drop the rows' {DEMONSTRATION!r} or the images"
                )
        finally:
            if callable(close := getattr(env, "close", None)):
                await call(close)
    info = trajectory.info
    if info.ended not in PLAYED or left():
        raise ConfigError(
            f"{where} did not play as an episode: it ended as {info.ended!r} after {info.turns} of its "
            f"{len(actions)} turns{f' ({info.detail})' if info.detail else ''}; fix the demonstration or the env.* limits"
        )
    forks = [(f.prompt_ids + f.ids, [False] * len(f.prompt_ids) + f.mask) for f in trajectory.forks]
    return [(prompt + trajectory.ids, [False] * len(prompt) + trajectory.mask), *forks]


def _scripted(
    runner: EpisodeRunner | AgentRunner, actions: list[str], *, eos_id: int, where: str
) -> tuple[Generate, Callable[[], int]]:
    """A ``generate`` that answers each turn with the next action's tokens, and how many
    actions are left unplayed."""
    stops = runner.config.stop_strings
    queue = list(actions)

    async def generate(ids: list[int], budget: int, _pixels: dict[str, np.ndarray], _images: list[bytes]) -> Completion:
        if not queue:
            raise ConfigError(f"{where} has {len(actions)} turns, and its episode asked for another")
        text = queue.pop(0)
        tokens = runner.renderer.encode(text)
        if not any(text.endswith(stop) for stop in stops):
            tokens.append(eos_id)
        if len(tokens) > budget:
            raise ConfigError(
                f"{where}: turn {len(actions) - len(queue)} is {len(tokens)} tokens, over the turn's {budget} "
                "(controller.max_new_tokens or the context left); shorten it or raise the limit"
            )
        return Completion(
            token_ids=torch.tensor(tokens, dtype=torch.int32), logprobs=torch.zeros(len(tokens)),
            finish_reason="stop", policy_version_min=0, policy_version_max=0,
        )  # fmt: skip

    return generate, lambda: len(queue)
