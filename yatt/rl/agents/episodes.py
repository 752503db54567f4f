"""One multi-turn episode, driven turn by turn: the controller runs one per sample.

    prompt ids ------------------------------------------------------------+
    for each turn (up to env.max_turns, within the context budget):        |
        generate(ids so far, turn budget) -> the policy's turn (ids kept)  | one row:
        env.step(decode(turn))            -> obs, reward, done             | prompt | turn | obs | turn ...
        renderer.observation(obs)         -> obs ids (cut to max_obs)      |
    -----------------------------------------------------------------------+

Token in, token out: the policy's ids are appended as sampled, never decoded and encoded
again; only observations are rendered. A row's mask is 1 on the policy's tokens (they carry
the rollout log-prob and the version that sampled them) and 0 on observations (log-prob 0,
version -1): no loss, no KL, no entropy, not in the token mean. The episode's environment
time is bounded by ``env.episode_timeout_s`` (generation is not: the generators' own
deadlines and re-issues cover it); an environment that raises ends its episode as
``env_error`` with the reason, trained on as far as it got; the run goes on.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from protocols.messages import Completion, EpisodeInfo
from yatt.rl.agents.envs import Observation, call, messages_of
from yatt.rl.agents.render import Renderer
from yatt.rl.config import EnvConfig

Generate = Callable[[list[int], int], Awaitable[Completion]]
"""(the episode's ids so far, the turn's token budget) -> the policy's next turn."""


@dataclass
class Trajectory:
    """An episode after its prompt: what the ScoredGroup carries for one sample."""

    ids: list[int] = field(default_factory=list)  # generated turns and observations
    mask: list[bool] = field(default_factory=list)  # True on the policy's own tokens
    logprobs: list[float] = field(default_factory=list)  # rollout log-probs; 0 on observations
    versions: list[int] = field(default_factory=list)  # the version that sampled each token; -1 on observations
    finish_reason: str = "stop"  # the last turn's: "stop" or "length"
    info: EpisodeInfo = field(default_factory=lambda: EpisodeInfo(ended="done", turns=0, turn_rewards=[], tool_errors=0))

    def add(self, ids: list[int], *, logprobs: list[float] | None = None, version: int = -1) -> None:
        own = logprobs is not None
        self.ids += ids
        self.mask += [own] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += [version if own else -1] * len(ids)

    @property
    def env_reward(self) -> float:
        """The environment's rewards over the turns (None counted as 0)."""
        return sum(r for r in self.info.turn_rewards if not math.isnan(r))


class EpisodeRunner:
    """Runs episodes against new environments with one renderer and one set of limits."""

    def __init__(
        self, config: EnvConfig, renderer: Renderer, *, decode: Callable[[list[int]], str], eos_ids: set[int],
        max_new_tokens: int, context: int,
    ) -> None:  # fmt: skip
        """``decode``: token ids -> text (the action the environment reads); ``eos_ids``: the
        ids that end a turn as the chat template's end-of-turn; ``max_new_tokens``: a turn's
        limit; ``context``: the model's positions (``env.max_total_tokens`` may lower it)."""
        self.config = config
        self.renderer = renderer
        self.decode = decode
        self.eos_ids = eos_ids
        self.max_new_tokens = max_new_tokens
        self.budget = min(config.max_total_tokens or context, context)

    async def start(self, env: Any, *, seed: int, row: dict[str, Any], prompt_ids: list[int]) -> list[int]:
        """The episode's prompt: ``env.reset``'s observation rendered as the first prompt (the
        data row's own ``prompt_ids`` when it is None)."""
        obs, info = await call(env.reset, seed=seed, options={"row": row})
        messages = messages_of(obs)
        if not messages:
            return list(prompt_ids)
        tools = info.get("tools") if isinstance(info, dict) else None
        return self.renderer.prompt(messages, tools=tools)

    async def run(self, env: Any, prompt_ids: list[int], generate: Generate) -> Trajectory:
        """The episode from its prompt (``start``) to its end."""
        out, rewards, errors = Trajectory(), [], 0
        ended, detail, turns = "max_turns", "", 0
        env_time = 0.0
        while turns < self.config.max_turns:
            room = self.budget - len(prompt_ids) - len(out.ids)
            if room <= 0:
                ended = "budget"
                break
            turn = await generate(prompt_ids + out.ids, min(self.max_new_tokens, room))
            ids = turn.token_ids.tolist()
            out.add(ids, logprobs=turn.logprobs.tolist(), version=turn.policy_version_min)
            out.finish_reason, turns = turn.finish_reason, turns + 1
            began = time.monotonic()
            try:
                step = await asyncio.wait_for(
                    call(env.step, self.decode(ids)), timeout=max(self.config.episode_timeout_s - env_time, 1e-3)
                )
            except TimeoutError:
                ended, detail = "timeout", f"the environment took over env.episode_timeout_s={self.config.episode_timeout_s:g} s"
                break
            except Exception as e:  # a user's environment may raise anything: the episode ends, the run goes on
                ended, detail = "env_error", f"{type(env).__name__}.step raised {type(e).__name__}: {e}"
                break
            finally:
                env_time += time.monotonic() - began
            obs, reward, terminated, truncated, info = step
            rewards.append(float("nan") if reward is None else float(reward))
            errors += int(info.get("tool_errors", 0)) if isinstance(info, dict) else 0
            if terminated or truncated:
                ended = "done" if terminated else "truncated"
                break
            if turns == self.config.max_turns:
                break  # (no observation after the last turn: nothing would read it)
            obs_ids = self._render(obs, ended_with_eos=bool(ids) and ids[-1] in self.eos_ids)
            if len(prompt_ids) + len(out.ids) + len(obs_ids) >= self.budget:
                ended = "budget"
                break
            out.add(obs_ids)
        out.info = EpisodeInfo(ended=ended, turns=turns, turn_rewards=rewards, tool_errors=errors, detail=detail)
        return out

    def _render(self, obs: Observation, *, ended_with_eos: bool) -> list[int]:
        """An observation's ids, cut to ``env.max_obs_tokens`` at the configured end (the
        template's framing stays whole: only the content's tokens are cut)."""
        ids = self.renderer.observation(messages_of(obs), ended_with_eos=ended_with_eos)
        limit = self.config.max_obs_tokens
        if len(ids) <= limit:
            return ids
        return ids[:limit] if self.config.obs_truncate == "end" else ids[-limit:]
