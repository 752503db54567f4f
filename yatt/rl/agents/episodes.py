"""One multi-turn episode, driven turn by turn: the controller runs one per sample.

    prompt ids ------------------------------------------------------------+
    for each turn (up to env.max_turns, within the context budget):        |
        generate(ids so far, turn budget) -> the policy's turn (ids kept)  | one row:
        env.step(decode(turn))            -> obs, reward, done             | prompt | turn | obs | turn ...
        renderer.observation(obs)         -> obs ids (cut to max_obs)      |
    -----------------------------------------------------------------------+

Every finished turn can be recorded (``record``: the controller puts it in the buffer's
ledger before the episode goes on); an episode given its recorded turns (``recorded``)
replays them without generating (the environment reset with the same seed and stepped with
the recorded actions, to rebuild its state; or, for an environment with ``snapshot()`` and
``restore(state)``, restored from the state its last recorded turn saved, with no step)
and generates only from the turn after them.
An environment that does not answer the replay as recorded (not deterministic in its seed
and actions) raises ``Diverged``: the caller runs the episode again from its start.

Token in, token out: the policy's ids are appended as sampled, never decoded and encoded
again; only observations are rendered. A row's mask is 1 on the policy's tokens (they carry
the rollout log-prob and the version that sampled them) and 0 on observations (log-prob 0,
version -1): no loss, no KL, no entropy, not in the token mean. An observation's images (a
vision-language model) are expanded by the renderer into their placeholder tokens, never
cut, and ride with the row as the processor's tensors (``Row.mm``): on every later turn's
generation request and in the sample's ``ScoredGroup.sample_mm_inputs``; a turn's record
keeps their encoded bytes. The episode's environment
time is bounded by ``env.episode_timeout_s`` (generation is not: the generators' own
deadlines and re-issues cover it); an environment that raises ends its episode as
``env_error`` with the reason, trained on as far as it got; the run goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocols.messages import Completion, EpisodeInfo
from yatt.rl.agents.envs import (
    EnvFailed,
    Message,
    call,
    images_of,
    messages_of,
    normalized,
    supports_snapshots,
)
from yatt.rl.agents.render import Renderer
from yatt.rl.config import EnvConfig
from yatt.rl.vision import concatenated

Generate = Callable[[list[int], int, dict[str, np.ndarray], list[bytes]], Awaitable[Completion]]
"""(the episode's ids so far, the turn's token budget, the images of its observations so far,
processed ({} for none) and encoded ([] for none)) -> the policy's next turn."""


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One finished turn: what is recorded of it, and what a replay takes back."""

    index: int  # 0-based
    token_ids: list[int]  # the policy's turn as sampled
    logprobs: list[float]
    version: int  # the policy version that sampled it
    finish_reason: str
    obs_ids: list[int]  # the observation appended after it (empty: the episode ended)
    reward: float | None  # the environment's
    tool_errors: int
    ended: str = ""  # how the episode ended at it; "": it goes on
    detail: str = ""
    env_state: bytes = b""  # the environment's snapshot() after its step (b"": none taken)
    obs_images: list[bytes] = field(default_factory=list)  # the observation's images, encoded, in order


Record = Callable[[Turn], Awaitable[None]]


class Diverged(Exception):
    """A replayed turn's observation is not the recorded one: the environment is not
    deterministic in its seed and actions. Its episode must run again from the start."""


@dataclass
class Row:
    """A training row after its prompt: the policy's turns (as sampled) and the
    observations between them."""

    ids: list[int] = field(default_factory=list)  # generated turns and observations
    mask: list[bool] = field(default_factory=list)  # True on the policy's own tokens
    logprobs: list[float] = field(default_factory=list)  # rollout log-probs; 0 on observations
    versions: list[int] = field(default_factory=list)  # the version that sampled each token; -1 on observations
    turns: list[tuple[int, int]] = field(default_factory=list)  # each turn's [start, end) in ``ids``
    images: list[bytes] = field(default_factory=list)  # the observations' images, encoded, in order
    pixels: list[dict[str, np.ndarray]] = field(default_factory=list)  # and processed, one entry per observation with images

    @property
    def mm(self) -> dict[str, np.ndarray]:
        """The row's images after its prompt's, processed: each name's arrays concatenated."""
        return concatenated(self.pixels)

    def add(self, ids: list[int], *, logprobs: list[float] | None = None, version: int = -1) -> None:
        own = logprobs is not None
        if own:
            self.turns.append((len(self.ids), len(self.ids) + len(ids)))
        self.ids += ids
        self.mask += [own] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += [version if own else -1] * len(ids)


@dataclass
class Fork(Row):
    """A row started by agent code's call whose context did not extend the row before it
    (``yatt.rl.agents.client``): that context is its prompt."""

    prompt_ids: list[int] = field(default_factory=list)


@dataclass
class Trajectory(Row):
    """An episode after its prompt: what the ScoredGroup carries for one sample (its first
    row; agent code's rows after a fork in ``forks``, in call order)."""

    finish_reason: str = "stop"  # the last turn's: "stop" or "length"
    info: EpisodeInfo = field(default_factory=lambda: EpisodeInfo(ended="done", turns=0, turn_rewards=[], tool_errors=0))
    forks: list[Fork] = field(default_factory=list)

    @property
    def env_reward(self) -> float:
        """The environment's rewards over the turns (None counted as 0)."""
        return sum(r for r in self.info.turn_rewards if not math.isnan(r))

    @property
    def rows(self) -> list[Row]:
        """Every row of the episode, the first one first."""
        return [self, *self.forks]


class Runner:
    """What runs a controller's episodes: one renderer and one set of limits."""

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


class EpisodeRunner(Runner):
    """Runs episodes against new environments (Gymnasium's reset/step, or the tools')."""

    async def start(
        self, env: Any, *, seed: int, row: dict[str, Any], prompt_ids: list[int]
    ) -> tuple[list[int], list[bytes] | None]:
        """The episode's prompt: ``env.reset``'s observation rendered as the first prompt, and
        its images (encoded); the data row's own ``prompt_ids`` and None (the data prompt's
        images) when the observation is None."""
        obs, info = await call(env.reset, seed=seed, options={"row": row})
        messages = normalized(messages_of(obs))
        if not messages:
            return list(prompt_ids), None
        tools = info.get("tools") if isinstance(info, dict) else None
        return self.renderer.prompt(messages, tools=tools), images_of(messages)

    async def run(
        self, env: Any, prompt_ids: list[int], generate: Generate, *, recorded: list[Turn] | None = None,
        record: Record | None = None,
    ) -> Trajectory:  # fmt: skip
        """The episode from its prompt (``start``) to its end: ``recorded`` turns replayed,
        each new one passed to ``record`` once finished, before the next is generated."""
        out, rewards, errors, env_time = Trajectory(), [], 0, 0.0
        replay = list(recorded or [])
        snapshots = supports_snapshots(env)
        restoring = snapshots and bool(replay) and bool(replay[-1].env_state)  # (else: stepped again)
        ended = ""
        while not ended:
            index = out.info.turns
            if index == self.config.max_turns:
                ended = "max_turns"
                break
            room = self.budget - len(prompt_ids) - len(out.ids)
            if room <= 0:
                ended = "budget"
                break
            if index < len(replay):
                turn = replay[index]
                ids, logprobs, version, finish = turn.token_ids, turn.logprobs, turn.version, turn.finish_reason
            else:
                sampled = await generate(prompt_ids + out.ids, min(self.max_new_tokens, room), out.mm, out.images)
                ids, logprobs = sampled.token_ids.tolist(), sampled.logprobs.tolist()
                version, finish = sampled.policy_version_min, sampled.finish_reason
            out.add(ids, logprobs=logprobs, version=version)
            out.finish_reason = finish
            out.info = dataclasses.replace(out.info, turns=index + 1)
            began, state = time.monotonic(), b""
            reward, obs_ids, obs_images, detail, turn_errors = None, [], list[bytes](), "", 0
            if restoring and index < len(replay):  # its outcome as recorded; the last one's state restored
                kept = replay[index]
                reward, obs_ids, obs_images, detail, turn_errors, ended, state = (
                    kept.reward, kept.obs_ids, kept.obs_images, kept.detail, kept.tool_errors, kept.ended, kept.env_state
                )
                if index == len(replay) - 1 and not ended:
                    await self._restore(env, state)
            else:
                try:
                    obs, reward, terminated, truncated, info = await asyncio.wait_for(
                        call(env.step, self.decode(ids)), timeout=max(self.config.episode_timeout_s - env_time, 1e-3)
                    )
                    reward = None if reward is None else float(reward)
                    turn_errors = int(info.get("tool_errors", 0)) if isinstance(info, dict) else 0
                    if terminated or truncated:
                        ended = "done" if terminated else "truncated"
                    elif index + 1 < self.config.max_turns:  # (no observation after the last turn: nothing reads it)
                        obs_ids, obs_images, detail = self._render(obs, ended_with_eos=bool(ids) and ids[-1] in self.eos_ids)
                        if detail or len(prompt_ids) + len(out.ids) + len(obs_ids) >= self.budget:
                            ended, obs_ids, obs_images = "budget", [], []
                    if snapshots and not ended:
                        state = await _snapshot(env)
                except EnvFailed as e:  # (hosted by the env role: the message names the environment)
                    ended, detail, reward, obs_ids, obs_images = "env_error", str(e), None, [], []
                except TimeoutError:
                    ended, detail = "timeout", f"the environment took over env.episode_timeout_s={self.config.episode_timeout_s:g} s"
                except Exception as e:  # a user's environment may raise or answer anything: the episode ends, the run goes on
                    ended, detail, reward = "env_error", f"{type(env).__name__}.step: {type(e).__name__}: {e}", None
                    obs_ids, obs_images = [], []
                finally:
                    env_time += time.monotonic() - began
            rewards.append(float("nan") if reward is None else float(reward))
            errors += turn_errors
            done = Turn(
                index=index, token_ids=ids, logprobs=logprobs, version=version, finish_reason=finish, obs_ids=obs_ids,
                reward=reward, tool_errors=turn_errors, ended=ended, detail=detail, env_state=state, obs_images=obs_images,
            )  # fmt: skip
            if index < len(replay):
                if not restoring:
                    _check_replay(replay[index], done)
            elif record is not None:
                await record(done)
            out.add(obs_ids)
            if obs_images:
                out.images += obs_images
                out.pixels.append(self.renderer.pixels(obs_images))
            out.info = EpisodeInfo(ended=ended or "max_turns", turns=index + 1, turn_rewards=rewards, tool_errors=errors, detail=detail)
        out.info = dataclasses.replace(out.info, ended=ended)
        return out

    async def _restore(self, env: Any, state: bytes) -> None:
        """The environment as its last recorded turn left it (its ``restore``); ``Diverged``
        when that fails: the episode runs again from its start."""
        try:
            await asyncio.wait_for(call(env.restore, state), timeout=self.config.episode_timeout_s)
        except Exception as e:  # a user's restore: the episode can still be run from its start
            raise Diverged(f"{type(env).__name__}.restore failed ({type(e).__name__}: {e})") from e

    def _render(self, obs: Any, *, ended_with_eos: bool) -> tuple[list[int], list[bytes], str]:
        """An observation's ids, cut to ``env.max_obs_tokens`` at the configured end, and its
        images (encoded). One with images is never cut (an image's placeholder tokens are
        whole or absent): past the limit, its reason instead, and the episode ends there."""
        messages: list[Message] = normalized(messages_of(obs))
        if not messages:  # nothing to add: the policy's next turn follows its last one
            return [], [], ""
        ids = self.renderer.observation(messages, ended_with_eos=ended_with_eos)
        images, limit = images_of(messages), self.config.max_obs_tokens
        if len(ids) <= limit:
            return ids, images, ""
        if images:
            return [], [], (
                f"an observation of {len(ids)} tokens with {len(images)} image(s) is over env.max_obs_tokens={limit} "
                "and is not cut through its images; raise env.max_obs_tokens or send smaller observations"
            )
        return (ids[:limit] if self.config.obs_truncate == "end" else ids[-limit:]), [], ""


async def _snapshot(env: Any) -> bytes:
    """The environment's ``snapshot()``, which must be bytes."""
    state = await call(env.snapshot)
    if not isinstance(state, bytes):
        raise TypeError(f"snapshot() must return bytes (got {type(state).__name__})")
    return state


def _check_replay(recorded: Turn, replayed: Turn) -> None:
    """A replayed turn must end as recorded: the same observation, reward and ending."""
    outcome = ("obs_ids", "obs_images", "ended", "tool_errors", "reward")
    rewards = (recorded.reward, replayed.reward)
    if any(getattr(recorded, name) != getattr(replayed, name) for name in outcome):
        raise Diverged(
            f"turn {recorded.index} replayed to another outcome than recorded (observation of {len(replayed.obs_ids)} "
            f"tokens vs {len(recorded.obs_ids)}, ended {replayed.ended!r} vs {recorded.ended!r}, reward {rewards[1]} vs "
            f"{rewards[0]}): the environment is not deterministic in its reset seed and actions"
        )

