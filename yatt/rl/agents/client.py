"""Agent code that drives its own episode (``env.episode: my_agent:run``).

A user with an agent loop of their own writes it as one async function; yatt calls it once
per sample with a client and the data row, and trains on what the calls sampled::

    async def run(client, row) -> float | dict:                # the reward, or {"reward": r, ...}
        messages = [{"role": "user", "content": row["prompt"]}]
        reply = await client.chat(messages, tools=[...])      # an OpenAI-shaped assistant message
        messages.append(reply)                                # (tool calls, if the model made any)
        messages.append({"role": "tool", "content": "21", "tool_call_id": reply["tool_calls"][0]["id"]})
        reply = await client.chat(messages)
        return float(reply["content"].strip() == row["answer"])

``client.generate(ids)`` is token in, token out (a ``Generation``: the ids sampled, their
log-probs, the text); ``client.chat(messages, tools=)`` renders through the run's renderer
(yatt/rl/agents/render.py) and returns the assistant's message, its tokens kept. Each call
is one turn of the episode, recorded in the ledger once the next call (or the end) shows
what followed it.

Rows as the model saw them: a call whose ids extend the previous call's ids and reply joins
its row (what was appended between them are the observation's tokens, masked out of the
loss). Chat calls extend by construction while the conversation only grows: the new
messages are rendered after the kept reply, never re-tokenised. A call that does not (a
rewritten history: a summary, an edited message, a sub-agent with a context of its own)
starts a new row of the same sample (a ``Fork``): its context is that row's prompt, so a
turn it repeats is context there, trained once, in the row that sampled it. Later calls
extend the newest row (or fork again). Every row of a sample is trained with its advantage;
the share of calls that forked is the ``episode/fork_share`` metric.

Limits are the environment's (``env.*``): the call after ``env.max_turns`` calls, or one with
no room left in the context budget, raises ``EpisodeOver`` (the episode ends as
'max_turns' / 'budget'; a function that catches it may still return its reward); the
function's own time between calls is bounded by ``env.episode_timeout_s`` (generation not
counted; past it the episode ends as 'timeout'); a function that raises ends its episode
as 'env_error' with the reason. It runs where environments run: in the env role, each
episode in a process of its own under the env limits, its calls forwarded to the
controller (``yatt.rl.agents.hosted``); with ``env.inline``, in the controller's event loop,
where it must be ``async def`` and must not block (blocking work: ``asyncio.to_thread``).

Resuming: a restarted controller runs the function again with the episode's recorded
turns: each of its calls up to the last recorded one is answered from the record (no
generation), checked to present the recorded tokens; a call that does not, or an end that
differs from the recorded one, raises ``Diverged`` and the episode runs again from its
start. The function must be deterministic in the row and the replies it gets.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from yatt.errors import ConfigError, PluginError
from yatt.rl.agents.episodes import Diverged, Fork, Generate, Record, Row, Runner, Trajectory, Turn
from yatt.rl.agents.render import Renderer
from yatt.rl.agents.tools import ToolCallError, parse_tool_calls
from yatt.rl.config import EnvConfig
from yatt.runtime.plugins import load_plugin

EPISODE = "an async function run(client, row) -> float | dict (the reward, or a dict with a 'reward' key)"
Episode = Callable[[Any, dict[str, Any]], Awaitable[Any]]


@dataclass(frozen=True, kw_only=True)
class Generation:
    """One call's reply, token in, token out."""

    token_ids: list[int]
    logprobs: list[float]
    text: str  # the ids decoded, special tokens skipped
    finish_reason: str  # 'stop' or 'length'


class EpisodeOver(Exception):
    """The episode's limit is reached (``ended``: 'max_turns' or 'budget'): no call after it."""

    def __init__(self, ended: str, message: str) -> None:
        super().__init__(message)
        self.ended = ended


class NoCall(ValueError):
    """The function ended before its first call: no prompt, nothing to train."""


class AgentFailed(Exception):
    """A hosted function (``yatt.rl.agents.hosted``) raised, or returned something that is
    not a reward: the message says which and why (the episode ends as env_error)."""


def load_episode(path: str) -> Episode:
    """The user's episode function (``env.episode``), checked to be ``async def`` taking
    (client, row); ``PluginError`` naming the field and the fix otherwise."""
    fn = load_plugin(path, field="env.episode", expects=EPISODE)
    if not inspect.iscoroutinefunction(fn):
        raise PluginError(f"env.episode: {path!r} is not an async function; it must be {EPISODE}")
    try:
        inspect.signature(fn).bind(None, {})
    except TypeError as e:
        raise PluginError(f"env.episode: {path!r} cannot be called as run(client, row) ({e}); it must be {EPISODE}") from e
    return fn


class Serves(Protocol):
    """What serves episodes over HTTP (``yatt.rl.agents.endpoint.Endpoint``)."""

    base_url: str

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    def open(self, client: EpisodeClient) -> str: ...
    def forget(self, key: str) -> None: ...
    def openai(self, key: str) -> Any: ...


class EpisodeClient:
    """What the user's function calls; one per episode (see the module docstring)."""

    def __init__(
        self, runner: AgentRunner, generate: Generate, *, recorded: list[Turn], record: Record | None
    ) -> None:  # fmt: skip
        self._runner = runner
        self._generate = generate
        self._replay = recorded
        self._record = record
        self.prompt_ids: list[int] | None = None  # the first call's ids
        self.out = Trajectory()
        self._row: Row = self.out  # the row the calls extend: the first, or the newest fork
        self._row_prompt: list[int] = []  # its prompt
        self._pending: Turn | None = None  # the last turn, until what follows it is known
        self._chat: list[dict[str, Any]] | None = None  # the last chat call's messages and reply
        self._tools: list[dict[str, Any]] | None = None  # the last tool schemas a chat call gave
        self.generating_s = 0.0
        self.base_url = ""  # the run's OpenAI-compatible endpoint (its /v1), where it serves one
        self.api_key = ""  # this episode's key there
        self.endpoint: Serves | None = None
        self.last_prompt_tokens = 0  # the last call's context, in tokens
        self._lock = asyncio.Lock()  # (one call at a time: two at once would race for the row)
        self.diverged: Diverged | None = None  # (raised into the user's code, which may catch it)
        self.over: EpisodeOver | None = None  # (likewise)
        self._since: float | None = None  # when the generation under way began

    # ------------------------------------------------------------------ the user's calls

    def openai(self) -> Any:
        """An ``openai.AsyncOpenAI`` client of this episode on the run's endpoint (its
        connections shared with the other episodes: no client start-up per episode)."""
        if self.endpoint is None:
            raise RuntimeError("no OpenAI-compatible endpoint serves this episode")
        return self.endpoint.openai(self.api_key)

    @property
    def last_turn(self) -> Turn:
        """The last call's turn as sampled."""
        assert self._pending is not None
        return self._pending

    async def generate(self, ids: Sequence[int], *, max_tokens: int | None = None) -> Generation:
        """Sample the policy's next turn after ``ids`` (the whole context, prompt included):
        at most ``max_tokens`` (default: controller.max_new_tokens, and the context left)."""
        async with self._lock:
            return await self._generate_after([int(i) for i in ids], max_tokens)

    async def _generate_after(self, ids: list[int], max_tokens: int | None) -> Generation:
        runner = self._runner
        index = self.out.info.turns
        obs = self._observation(ids) if self.prompt_ids is not None else []
        room = runner.budget - len(ids)
        if index >= runner.config.max_turns:  # (the last turn keeps no observation: nothing reads it)
            self.over = EpisodeOver("max_turns", f"env.max_turns={runner.config.max_turns} calls made: the episode is over")
        elif room <= 0:
            self.over = EpisodeOver("budget", f"{len(ids)} tokens fill the episode's context budget ({runner.budget}): the episode is over")
        if self.over is not None:
            raise self.over
        if self.prompt_ids is None:
            self.prompt_ids = self._row_prompt = ids
        elif obs is None:  # a new row: the last turn ends its own with nothing after it
            await self.close_turn([])
            self._row = Fork(prompt_ids=ids)
            self._row_prompt = ids
            self.out.forks.append(self._row)
        else:
            await self.close_turn(obs)
        self.last_prompt_tokens = len(ids)
        budget = min(max_tokens or runner.max_new_tokens, runner.max_new_tokens, room)
        if index < len(self._replay):
            turn = self._replay[index]
            token_ids, logprobs, version, finish = turn.token_ids, turn.logprobs, turn.version, turn.finish_reason
        else:
            self._since = time.monotonic()
            try:
                sampled = await self._generate(ids, budget, {}, [])  # (agent code sends text: no images)
            finally:
                self.generating_s += time.monotonic() - self._since
                self._since = None
            token_ids, logprobs = sampled.token_ids.tolist(), sampled.logprobs.tolist()
            version, finish = sampled.policy_version_min, sampled.finish_reason
        self._row.add(token_ids, logprobs=logprobs, version=version)
        self.out.finish_reason = finish
        self.out.info = replace(self.out.info, turns=index + 1)
        self._pending = Turn(
            index=index, token_ids=token_ids, logprobs=logprobs, version=version, finish_reason=finish, obs_ids=[],
            reward=None, tool_errors=0,
        )  # fmt: skip
        return Generation(token_ids=token_ids, logprobs=logprobs, text=runner.decode(token_ids), finish_reason=finish)

    async def chat(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, max_tokens: int | None = None
    ) -> dict[str, Any]:  # fmt: skip
        """The assistant's reply to ``messages`` (OpenAI's chat shape), rendered by the run's
        renderer: the first call's messages (and ``tools``, JSON schemas as OpenAI's) as a
        prompt; a later call whose messages start with the previous call's and its reply has
        only the messages after them rendered (its row goes on); any other is rendered whole
        (a new row of the sample, see the module docstring). The reply: ``{"role": "assistant",
        "content": text, "tool_calls": [...]}`` (tool calls parsed in ``env.protocol``'s
        format; none when they do not parse: the text is the content)."""
        async with self._lock:
            return await self._chat_after(messages, tools, max_tokens)

    async def _chat_after(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, max_tokens: int | None
    ) -> dict[str, Any]:  # fmt: skip
        runner = self._runner
        pictured = next((i for i, m in enumerate(messages) if _has_images(m)), None)
        if pictured is not None:
            raise ConfigError(
                f"agent code's chat call: message {pictured} holds an image; agent code's calls take text (content "
                "as text or text parts); for observations with images write an environment (env.class)"
            )
        self._tools = tools or self._tools
        kept = len(self._chat or [])
        new = [dict(m) for m in messages[kept:]]
        if self._chat is None or not new or [_comparable(m) for m in messages[:kept]] != self._chat:
            ids = runner.renderer.prompt([dict(m) for m in messages], tools=tools)  # (the first call, or a new row)
        else:  # the conversation goes on: only the new messages rendered, after the kept reply
            row = self._row
            last = row.turns[-1]
            ended_with_eos = last[1] > last[0] and row.ids[last[1] - 1] in runner.eos_ids
            ids = [*self._row_prompt, *row.ids, *runner.renderer.observation(new, ended_with_eos=ended_with_eos)]
        reply = await self._generate_after(ids, max_tokens)
        message = _assistant(reply.text, runner.config, self.out.info.turns - 1, self._tools or [])
        self._chat = [*(_comparable(m) for m in messages), _comparable(message)]
        return message

    # ------------------------------------------------------------------ the runner's side

    def _observation(self, ids: list[int]) -> list[int] | None:
        """What ``ids`` appends to the row so far; None when it does not extend it (a new row)."""
        so_far = [*self._row_prompt, *self._row.ids]
        return ids[len(so_far) :] if ids[: len(so_far)] == so_far else None

    async def close_turn(self, obs_ids: list[int], *, reward: float | None = None, ended: str = "", detail: str = "") -> None:
        """The pending turn is finished: what followed it is known. Recorded, or checked
        against its record when replayed."""
        turn, self._pending = self._pending, None
        if turn is None:
            return
        done = replace(turn, obs_ids=obs_ids, reward=reward, ended=ended, detail=detail)
        rewards = [*self.out.info.turn_rewards, math.nan if reward is None else reward]
        self.out.info = replace(self.out.info, turn_rewards=rewards, ended=ended, detail=detail)
        if done.index < len(self._replay):
            kept = self._replay[done.index]
            if (kept.obs_ids, kept.ended, kept.reward) != (done.obs_ids, done.ended, done.reward):
                self.diverged = Diverged(
                    f"turn {done.index} replayed to another outcome than recorded (observation of {len(done.obs_ids)} "
                    f"tokens vs {len(kept.obs_ids)}, ended {done.ended!r} vs {kept.ended!r}, reward {done.reward} vs "
                    f"{kept.reward}): env.episode is not deterministic in its row and the replies it gets"
                )
                raise self.diverged
        elif self._record is not None:
            await self._record(done)
        self._row.add(obs_ids)

    def user_s(self, began: float) -> float:
        """The function's own time since ``began``: generation not counted."""
        generating = self.generating_s + (time.monotonic() - self._since if self._since is not None else 0.0)
        return time.monotonic() - began - generating


class AgentRunner(Runner):
    """Runs ``env.episode`` functions, one per sample."""

    def __init__(
        self, config: EnvConfig, renderer: Renderer, *, decode: Callable[[list[int]], str], eos_ids: set[int],
        max_new_tokens: int, context: int, episode: Episode | None = None, endpoint: Serves | None = None,
    ) -> None:  # fmt: skip
        """As ``Runner``; ``episode``: the function (default: ``env.episode`` loaded);
        ``endpoint``: the OpenAI-compatible endpoint that serves its episodes, if any."""
        super().__init__(config, renderer, decode=decode, eos_ids=eos_ids, max_new_tokens=max_new_tokens, context=context)
        self.episode = episode if episode is not None else load_episode(config.episode)
        self.endpoint = endpoint

    async def run(
        self, row: dict[str, Any], generate: Generate, *, recorded: list[Turn] | None = None, record: Record | None = None,
        episode: Episode | None = None, environ: bool = False,
    ) -> tuple[list[int], Trajectory]:  # fmt: skip
        """One episode: (its prompt, the first call's ids; its trajectory after the prompt).
        A function that ends before any call leaves nothing to train: ``NoCall``.
        ``episode``: what runs instead of the function here (``yatt.rl.agents.hosted.hosted``:
        the function in the env role, its calls forwarded; it serves its own endpoint).
        ``environ``: set ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` to this episode's while it
        runs (the process's environment: only where one episode runs at a time, as the warm
        start plays its demonstrations), so an ``openai.AsyncOpenAI()`` made without them works."""
        with _openai_environ(environ) as set_environ:
            return await self._run(row, generate, recorded=recorded, record=record, episode=episode, set_environ=set_environ)

    async def _run(
        self, row: dict[str, Any], generate: Generate, *, recorded: list[Turn] | None, record: Record | None,
        episode: Episode | None, set_environ: Callable[[str, str], None],
    ) -> tuple[list[int], Trajectory]:  # fmt: skip
        client = EpisodeClient(self, generate, recorded=list(recorded or []), record=record)
        serving = self.endpoint if episode is None else None
        if serving is not None:
            await serving.start()
            client.base_url, client.api_key = serving.base_url, serving.open(client)
            client.endpoint = serving
            set_environ(client.base_url, client.api_key)
        began, reward, ended, detail = time.monotonic(), None, "done", ""
        task = asyncio.ensure_future((episode or self.episode)(client, dict(row)))
        try:
            while True:
                left = self.config.episode_timeout_s - client.user_s(began)
                done, _ = await asyncio.wait({task}, timeout=max(left, 0.05))  # (not a busy wait while it generates)
                if done:
                    break
                if client.user_s(began) >= self.config.episode_timeout_s:
                    task.cancel()
                    ended, detail = "timeout", f"env.episode took over env.episode_timeout_s={self.config.episode_timeout_s:g} s"
                    break
            if ended == "done":
                reward, ended, detail = self._outcome(task)
                if client.over is not None and ended == "done":  # (caught, and a reward said after it)
                    ended, detail = client.over.ended, str(client.over)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            if serving is not None:
                serving.forget(client.api_key)
        if client.diverged is not None:
            raise client.diverged
        if client.prompt_ids is None:
            raise NoCall(f"env.episode {self.config.episode!r} ended ({ended}: {detail or 'returned'}) before any call")
        await client.close_turn([], reward=reward, ended=ended, detail=detail)
        if client.diverged is not None:
            raise client.diverged
        client.out.info = replace(client.out.info, ended=ended, detail=detail)
        return client.prompt_ids, client.out

    def _outcome(self, task: asyncio.Future[Any]) -> tuple[float | None, str, str]:
        """(reward, how the episode ended, why) from the finished function."""
        error = task.exception()
        if isinstance(error, EpisodeOver):
            return None, error.ended, str(error)
        if isinstance(error, AgentFailed):
            return None, "env_error", f"env.episode {self.config.episode!r}: {error}"
        if error is not None:
            return None, "env_error", f"env.episode {self.config.episode!r}: {type(error).__name__}: {error}"
        try:
            return reward_of(task.result()), "done", ""
        except ValueError as e:
            return None, "env_error", f"env.episode {self.config.episode!r} {e}"


def reward_of(value: Any) -> float | None:
    """The reward an episode function returned: a finite number, a dict's ``"reward"``, or
    None (no reward said); ``ValueError`` saying what it returned otherwise."""
    reward = value.get("reward") if isinstance(value, dict) else value
    if reward is None:
        return None
    if isinstance(reward, bool | int | float) and math.isfinite(float(reward)):
        return float(reward)
    raise ValueError(f"returned {reward!r:.200}, not {EPISODE}")


@contextlib.contextmanager
def _openai_environ(wanted: bool) -> Iterator[Callable[[str, str], None]]:
    """A setter of OPENAI_BASE_URL and OPENAI_API_KEY (a no-op unless ``wanted``); what they
    were is put back on exit."""
    names = ("OPENAI_BASE_URL", "OPENAI_API_KEY")
    before = {name: os.environ.get(name) for name in names}

    def set_environ(base_url: str, api_key: str) -> None:
        if wanted:
            os.environ.update(zip(names, (base_url, api_key), strict=True))

    try:
        yield set_environ
    finally:
        if wanted:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def _assistant(text: str, config: EnvConfig, turn: int, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The reply as OpenAI's assistant message: tool calls parsed in ``env.protocol``'s format
    (a tags call's positional arguments named after the tool's schema, where it has one)."""
    try:
        calls = parse_tool_calls(text, protocol=config.protocol)
    except ToolCallError:
        calls = []
    if not calls:
        return {"role": "assistant", "content": text}
    content = text[: text.find(calls[0].text)].strip()
    return {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [
            {
                "id": f"call_{turn}_{i}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(_arguments(c.name, c.args, c.kwargs, tools))},
            }
            for i, c in enumerate(calls)
        ],
    }


def _arguments(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A call's arguments as one JSON object: positional ones (the tags protocol's) by the
    names of the tool's parameters in its schema, by index where there are none."""
    schema: dict[str, Any] = next((t.get("function", {}) for t in tools if t.get("function", {}).get("name") == name), {})
    names = list(schema.get("parameters", {}).get("properties", {}))
    return {**{names[i] if i < len(names) else str(i): a for i, a in enumerate(args)}, **kwargs}


def _has_images(message: dict[str, Any]) -> bool:
    """Whether a chat message's content holds a part other than text (an image, OpenAI's image_url)."""
    content = message.get("content")
    return isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in content)


def _comparable(message: dict[str, Any]) -> dict[str, Any]:
    """A message as compared between calls: its role, content and tool calls."""
    return {k: message.get(k) for k in ("role", "content", "tool_calls", "tool_call_id") if message.get(k) is not None}

