"""An episode's environment hosted by the env role (``workers.env``), as the controller sees it.

``RemoteEnv`` has the environment's methods (``reset``, ``step``, ``close``, async), so an
episode runs against it as against an environment in the controller. Its calls go to the
env worker that holds the episode. When that worker is lost (killed, restarted, silent:
``PeerLost``, a timeout, or a restarted worker that does not know the episode), the episode
is rebuilt on a live worker: reset with its seed and row, every action it was stepped with
sent again (their answers must be the recorded ones: an environment deterministic in its
seed and actions, as the controller's own resume asks), then the call in flight. Only a
worker lost twice within one call ends the episode (``EnvFailed``), as an environment that
raises, dies or hangs in its process does.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from protocols.messages import EnvCall, EnvReply
from yatt.errors import PeerLost, RemoteError, RequestTimeout, TransportError
from yatt.rl.agents.envs import EnvFailed
from yatt.runtime.registry import Directory

logger = logging.getLogger(__name__)

ROLE = "env"
START_S = 60.0  # an episode process's start, on top of a call's own time


class _Lost(Exception):
    """The env worker holding the episode is gone (or holds it no more)."""


@dataclass
class RemoteEnv:
    """One episode's environment in the env role; ``name``: the episode, for logs and ids."""

    directory: Directory
    name: str
    timeout_s: float  # env.episode_timeout_s: a call's longest
    wait_s: float  # how long to wait for a live env worker
    episode: str = field(init=False)
    at: str | None = field(default=None, init=False)  # the endpoint of the worker holding it
    seed: int = field(default=0, init=False)
    row: dict[str, Any] = field(default_factory=dict, init=False)
    first: EnvReply | None = field(default=None, init=False)
    steps: list[tuple[str, EnvReply]] = field(default_factory=list, init=False)  # (action, its reply)
    rebuilt: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.episode = f"{self.name}/{uuid.uuid4().hex[:8]}"

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[list[dict[str, str]], dict[str, Any]]:
        self.seed, self.row = seed or 0, dict((options or {}).get("row", {}))
        self.first = await self._retrying(self._open)
        tools = json.loads(self.first.tools_json) if self.first.tools_json else None
        return self.first.messages, ({"tools": tools} if tools else {})

    async def step(self, action: str) -> tuple[list[dict[str, str]], float | None, bool, bool, dict[str, Any]]:
        turn = len(self.steps)

        async def once() -> EnvReply:
            if self.at is None:
                await self._rebuild()
            return await self._send(EnvCall(episode=self.episode, method="step", turn=turn, action=action), self.timeout_s)

        reply = await self._retrying(once)
        self.steps.append((action, reply))
        return reply.messages, reply.reward, reply.terminated, reply.truncated, {"tool_errors": reply.tool_errors}

    async def close(self) -> None:
        if self.at is not None:
            try:
                await self._send(EnvCall(episode=self.episode, method="close"), 10.0)
            except (_Lost, EnvFailed) as e:  # its process goes with its worker, or the worker's sweep
                logger.info("env: closing %s: %s", self.episode, e)

    async def _retrying(self, call: Any) -> EnvReply:
        """``call()``, once more on a live worker when its worker is lost; ``EnvFailed`` the second time."""
        try:
            return await call()  # type: ignore[no-any-return]
        except _Lost as e:
            logger.warning("env: %s lost its env worker (%s); rebuilding it on a live one", self.episode, e)
            self.at = None
        try:
            return await call()  # type: ignore[no-any-return]
        except _Lost as e:
            raise EnvFailed(f"episode {self.name}: its env worker was lost twice within one call ({e})") from None

    async def _open(self) -> EnvReply:
        """The episode's environment made and reset on the least busy live worker."""
        self.at = None
        call = EnvCall(episode=self.episode, method="reset", seed=self.seed, row_json=json.dumps(self.row))
        return await self._send(call, self.timeout_s + START_S)

    async def _rebuild(self) -> None:
        """The episode on a live worker, as it was: reset, then each recorded action again."""
        self.rebuilt += 1
        first = await self._open()
        _same(first, self.first, f"episode {self.name}: reset with seed {self.seed}")
        for turn, (action, recorded) in enumerate(self.steps):
            again = await self._send(EnvCall(episode=self.episode, method="step", turn=turn, action=action), self.timeout_s)
            _same(again, recorded, f"episode {self.name}: turn {turn} stepped again")
        logger.warning("env: %s rebuilt on %s after %d turns", self.episode, self.at, len(self.steps))

    async def _send(self, call: EnvCall, timeout: float) -> EnvReply:
        """``call`` to the worker holding the episode (the least busy live one before it has one)."""
        try:
            if self.at is None:
                await self.directory.wait_for_live(ROLE, timeout=self.wait_s)
                client = self.directory.pick(ROLE)
            else:
                live = (self.directory.client(w.actor_id) for w in self.directory.members(ROLE))
                found = next((c for c in live if c.alive and c.endpoint == self.at), None)
                if found is None:
                    raise _Lost(f"the env worker at {self.at} left the directory")
                client = found
            reply = await client.request(call, EnvReply, timeout=timeout)
            self.at = client.endpoint
            return reply
        except (PeerLost, RequestTimeout, TransportError) as e:
            raise _Lost(f"{type(e).__name__}: {e}") from None
        except RemoteError as e:
            if e.error_type == "UnknownEpisode":
                raise _Lost(e.remote_message) from None
            raise EnvFailed(e.remote_message if e.error_type == "EnvFailed" else f"{e.error_type}: {e.remote_message}") from None


def _same(again: EnvReply, recorded: EnvReply | None, what: str) -> None:
    """A rebuilt episode must answer as it did; ``EnvFailed`` otherwise (not deterministic)."""
    fields = ("messages", "reward", "terminated", "truncated", "tool_errors")
    if recorded is not None and any(getattr(again, f) != getattr(recorded, f) for f in fields):
        raise EnvFailed(f"{what} answered otherwise than before: the environment is not deterministic in its reset seed and actions")
