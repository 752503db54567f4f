"""Agent code hosted in the env role: ``env.episode`` run in an episode process of its own.

With ``env.inline: false`` (the default) the user's function does not run in a controller:
it runs in one of the env role's episode processes (``workers.env``), under the same limits
as an environment there (``env.cpu_limit_s``, ``env.memory_limit_mb``, a network namespace
of its own unless ``env.network``), where a hang, a crash or a memory blow-up ends that
episode only. Seen from the env role it is an environment in Gymnasium's convention whose
observations are the agent's calls and whose actions are the policy's replies::

    controller (AgentRunner, EpisodeClient)          env role: the episode's process
    hosted(env)(client, row)                         AgentEnv: run(client, row) as a task
      env.reset(row)  ------------------------->       runs to its first call
                      <-------------------------       the call (JSON): chat or generate
      client.chat / client.generate (a turn,
      sampled and recorded as inline)
      env.step(the reply, JSON) -------------->        the call returns; runs to its next call
                      <-------------------------       ... or its end: the reward, or its error
                                                        (terminated)

So every turn is recorded by the controller exactly as an inline agent's, and the env
role's machinery carries over: a lost env worker's episode is rebuilt on a live one (the
function run again from its row, each recorded reply given again, its calls checked to be
the same); a controller that restarts runs the function again with its recorded turns.

In the episode process the function gets a ``HostedClient`` (``generate``, ``chat``,
``openai()``, ``base_url``, ``api_key``) and an OpenAI-compatible endpoint of its own
(``yatt.rl.agents.endpoint``), listening on the process's loopback (brought up inside its
network namespace: the endpoint is the only thing it can reach) with one key;
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` are set to them, so an unmodified
``openai.AsyncOpenAI()`` in the user's code talks to the policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

from yatt.rl.agents.client import AgentFailed, Episode, EpisodeOver, Generation, load_episode, reward_of
from yatt.rl.config import EnvConfig

if TYPE_CHECKING:
    from yatt.rl.agents.endpoint import Endpoint

CALL_ROLE = "agent"  # the role of the message that carries a call (or the end) to the controller


# ------------------------------------------------------------------ the episode process's side


@dataclass(frozen=True)
class Replied:
    """The tokens of the last call's reply (what the endpoint reports of it)."""

    token_ids: list[int]
    finish_reason: str


class HostedClient:
    """What the hosted function calls (as ``EpisodeClient``, whose calls it forwards to the
    controller one at a time: each call is a turn)."""

    def __init__(self, env: AgentEnv) -> None:
        self._env = env
        self._lock = asyncio.Lock()  # (one call at a time, as EpisodeClient)
        self.base_url = ""
        self.api_key = ""
        self.endpoint: Endpoint | None = None
        self.last_turn = Replied(token_ids=[], finish_reason="")
        self.last_prompt_tokens = 0

    def openai(self) -> Any:
        """An ``openai.AsyncOpenAI`` on this process's endpoint (``OPENAI_BASE_URL``)."""
        if self.endpoint is None:
            raise RuntimeError("no OpenAI-compatible endpoint serves this episode")
        return self.endpoint.openai(self.api_key)

    async def generate(self, ids: Sequence[int], *, max_tokens: int | None = None) -> Generation:
        answer = await self._ask({"call": "generate", "ids": [int(i) for i in ids], "max_tokens": max_tokens})
        return Generation(**answer["generation"])

    async def chat(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, max_tokens: int | None = None
    ) -> dict[str, Any]:  # fmt: skip
        answer = await self._ask({"call": "chat", "messages": messages, "tools": tools, "max_tokens": max_tokens})
        return dict(answer["message"])

    async def _ask(self, call: dict[str, Any]) -> dict[str, Any]:
        async with self._lock:
            answer = await self._env.call(call)
        if "error" in answer:  # (EpisodeOver: the only refusal)
            raise EpisodeOver(answer["ended"], answer["message"])
        self.last_turn = Replied(token_ids=answer["token_ids"], finish_reason=answer["finish_reason"])
        self.last_prompt_tokens = answer["prompt_tokens"]
        return answer


class AgentEnv:
    """The user's function as an environment of the env role (see the module docstring):
    ``reset`` starts it and answers its first call, ``step(reply)`` returns that call and
    answers the next one, or the end (terminated, with the reward)."""

    def __init__(self, episode: Episode, *, name: str, model: str, http: Any = None) -> None:
        """``http``: the endpoint's shared connections (``Endpoint``'s), None: its own."""
        self.episode, self.name, self.model, self.http = episode, name, model, http
        self._task: asyncio.Future[Any] | None = None
        self._calls: asyncio.Queue[tuple[dict[str, Any], asyncio.Future[dict[str, Any]]]] = asyncio.Queue()
        self._waiting: asyncio.Future[dict[str, Any]] | None = None  # the call under way's reply
        self._endpoint: Endpoint | None = None

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, str], dict[str, Any]]:  # fmt: skip
        from yatt.rl.agents.endpoint import Endpoint  # (aiohttp: in the episode process, not the controller)

        row = dict((options or {}).get("row", {}))
        loopback_up()
        client = HostedClient(self)
        self._endpoint = Endpoint(self.model, http=self.http)
        await self._endpoint.start()
        client.endpoint, client.base_url, client.api_key = self._endpoint, self._endpoint.base_url, self._endpoint.open(client)
        os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"] = client.base_url, client.api_key
        self._task = asyncio.ensure_future(self.episode(client, row))
        return await self._next(), {}

    async def step(self, action: str) -> tuple[dict[str, str], float | None, bool, bool, dict[str, Any]]:
        if self._waiting is None:
            raise RuntimeError(f"{self.name}: a reply came with no call waiting for it")
        self._waiting.set_result(json.loads(action))
        self._waiting = None
        obs = await self._next()
        end = json.loads(obs["content"]).get("end")
        if end is None:
            return obs, None, False, False, {}
        reward = end.get("reward")
        return obs, None if reward is None else float(reward), True, False, {}

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._endpoint is not None:
            await self._endpoint.close()

    async def call(self, call: dict[str, Any]) -> dict[str, Any]:
        """A call of the function's client: handed to the controller (the observation),
        its reply awaited (the next action)."""
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        await self._calls.put((call, reply))
        return await reply

    async def _next(self) -> dict[str, str]:
        """The function's next call or its end, as the observation: one message, its JSON."""
        assert self._task is not None
        if not self._task.done():
            calling = asyncio.ensure_future(self._calls.get())
            await asyncio.wait({calling, self._task}, return_when=asyncio.FIRST_COMPLETED)
            if calling.done():
                call, self._waiting = calling.result()
                return {"role": CALL_ROLE, "content": json.dumps(call)}
            calling.cancel()
        return {"role": CALL_ROLE, "content": json.dumps({"end": self._end(self._task)})}

    def _end(self, task: asyncio.Future[Any]) -> dict[str, Any]:
        """How the function ended: its reward, or the error it raised."""
        if task.cancelled():
            return {"error": "CancelledError", "message": "the function was cancelled"}
        error = task.exception()
        if isinstance(error, EpisodeOver):
            return {"error": "EpisodeOver", "ended": error.ended, "message": str(error)}
        if error is not None:
            return {"error": type(error).__name__, "message": f"{type(error).__name__}: {error}"}
        try:
            return {"reward": reward_of(task.result())}
        except ValueError as e:
            return {"error": "TypeError", "message": str(e)}


def agent_factory(config: EnvConfig, *, model: str) -> Callable[[], AgentEnv]:
    """What makes an ``AgentEnv`` of ``env.episode`` per episode (``model``: the name its
    endpoint serves), in the env worker, which warms the openai SDK once before its
    episode processes fork (``endpoint.warm_openai``)."""
    from yatt.rl.agents.endpoint import warm_openai

    episode = load_episode(config.episode)
    http = warm_openai()
    return lambda: AgentEnv(episode, name=config.episode, model=model, http=http)


def loopback_up() -> None:
    """Bring up the loopback of this process's (new) network namespace, where it starts
    down: the endpoint listens there, the only address the agent can reach."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, siocgifflags, struct.pack("16sH14x", b"lo", 0)))[1]
        if not flags & iff_up:
            fcntl.ioctl(s, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


# ------------------------------------------------------------------ the controller's side


class Client(Protocol):
    """What ``hosted`` forwards calls to (``EpisodeClient``)."""

    last_prompt_tokens: int

    @property
    def last_turn(self) -> Any: ...
    async def generate(self, ids: Sequence[int], *, max_tokens: int | None = None) -> Generation: ...
    async def chat(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, max_tokens: int | None = None
    ) -> dict[str, Any]: ...


class HostingEnv(Protocol):
    """The episode's environment in the env role (``yatt.rl.agents.remote.RemoteEnv``)."""

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[list[dict[str, str]], dict[str, Any]]: ...
    async def step(self, action: str) -> tuple[list[dict[str, str]], float | None, bool, bool, dict[str, Any]]: ...
    async def close(self) -> None: ...


def hosted(env: HostingEnv, *, seed: int) -> Episode:
    """The episode function a controller runs for a hosted agent: each call that ``env``'s
    process makes is answered through the controller's client (a recorded turn), until the
    function ends there; its reward is this function's, its error raised here."""

    async def run(client: Client, row: dict[str, Any]) -> float | None:
        try:
            messages, _ = await env.reset(seed=seed, options={"row": row})
            while "end" not in (call := _call_of(messages)):
                messages, *_ = await env.step(json.dumps(await _answer(client, call)))
            end = call["end"]
            if "error" not in end:
                return None if end["reward"] is None else float(end["reward"])
            if end["error"] == "EpisodeOver":
                raise EpisodeOver(end["ended"], end["message"])
            raise AgentFailed(end["message"])
        finally:
            await env.close()

    return run


def _call_of(messages: list[dict[str, str]]) -> dict[str, Any]:
    if len(messages) != 1 or messages[0].get("role") != CALL_ROLE:
        raise AgentFailed(f"the env role answered {messages!r:.200}, not a hosted agent's call: is the env role's env.episode the controllers'?")
    return dict(json.loads(messages[0]["content"]))


async def _answer(client: Client, call: dict[str, Any]) -> dict[str, Any]:
    """The controller's reply to one call: the turn sampled (and recorded), or the limit that
    refused it (raised into the function as it would be inline)."""
    try:
        if call["call"] == "generate":
            generation = await client.generate(call["ids"], max_tokens=call.get("max_tokens"))
            out: dict[str, Any] = {"generation": asdict(generation)}
        elif call["call"] == "chat":
            out = {"message": await client.chat(call["messages"], tools=call.get("tools"), max_tokens=call.get("max_tokens"))}
        else:
            raise AgentFailed(f"a hosted agent's call {call['call']!r} is neither chat nor generate")
    except EpisodeOver as e:
        return {"error": "EpisodeOver", "ended": e.ended, "message": str(e)}
    turn = client.last_turn
    return {**out, "token_ids": turn.token_ids, "finish_reason": turn.finish_reason, "prompt_tokens": client.last_prompt_tokens}
