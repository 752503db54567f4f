"""An episode's environment hosted by the env role (``workers.env``), as the controller sees it.

``RemoteEnv`` has the environment's methods (``reset``, ``step``, ``close``, async), so an
episode runs against it as against an environment in the controller. Its calls go to the
env worker that holds the episode. When that worker is lost (killed, restarted, silent:
``PeerLost``, a timeout, or a restarted worker that does not know the episode), the episode
is rebuilt on a live worker: reset with its seed and row, restored to its last snapshot
where the environment takes them (``snapshot``/``restore``), every action stepped since
sent again (their answers must be the recorded ones: an environment deterministic in its
seed and actions, as the controller's own resume asks), then the call in flight; again
each time a worker is lost, for up to ``wait_s``. Only then does the episode end
(``EnvFailed``), as it does for an environment that raises, dies or hangs in its process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from protocols.messages import EnvCall, EnvReply
from yatt.errors import PeerLost, RemoteError, RequestTimeout, TransportError
from yatt.rl.agents.envs import EnvFailed, Message, from_wire
from yatt.runtime.registry import Directory

logger = logging.getLogger(__name__)

ROLE = "env"
START_S = 60.0  # an episode process's start, on top of a call's own time
LOST_PAUSE_S = 0.2  # before an episode whose worker was lost is rebuilt again


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
    supports_snapshots: bool = field(default=False, init=False)  # (the reset's answer)
    turn: int = field(default=-1, init=False)  # the last turn stepped, counted from the reset
    base: tuple[int, bytes] | None = field(default=None, init=False)  # the last snapshot or restore: (turn it covers, state)
    steps: list[tuple[int, str, EnvReply]] = field(default_factory=list, init=False)  # since ``base``: (turn, action, reply)
    rebuilt: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.episode = f"{self.name}/{uuid.uuid4().hex[:8]}"

    async def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[list[Message], dict[str, Any]]:
        self.seed, self.row = seed or 0, dict((options or {}).get("row", {}))
        self.first = await self._retrying(self._open)
        self.supports_snapshots = self.first.snapshots
        tools = json.loads(self.first.tools_json) if self.first.tools_json else None
        return from_wire(self.first.messages, self.first.images), ({"tools": tools} if tools else {})

    async def step(self, action: str) -> tuple[list[Message], float | None, bool, bool, dict[str, Any]]:
        turn = self.turn + 1
        reply = await self._retrying(lambda: self._call(EnvCall(episode=self.episode, method="step", turn=turn, action=action)))
        self.turn = turn
        self.steps.append((turn, action, reply))
        return from_wire(reply.messages, reply.images), reply.reward, reply.terminated, reply.truncated, {"tool_errors": reply.tool_errors}

    async def snapshot(self) -> bytes:
        reply = await self._retrying(lambda: self._call(EnvCall(episode=self.episode, method="snapshot")))
        self.base, self.steps = (self.turn, reply.state), []
        return reply.state

    async def restore(self, state: bytes) -> None:
        self.base, self.steps = (self.turn, state), []
        await self._retrying(lambda: self._call(EnvCall(episode=self.episode, method="restore", turn=self.turn, state=state)))

    async def close(self) -> None:
        if self.at is not None:
            try:
                await self._send(EnvCall(episode=self.episode, method="close"), 10.0)
            except (_Lost, EnvFailed) as e:  # its process goes with its worker, or the worker's sweep
                logger.info("env: closing %s: %s", self.episode, e)

    async def _call(self, call: EnvCall) -> EnvReply:
        """``call`` on the episode, rebuilt first where its worker was lost."""
        if self.at is None:
            await self._rebuild()
        return await self._send(call, self.timeout_s)

    async def _retrying(self, call: Callable[[], Awaitable[EnvReply]]) -> EnvReply:
        """``call()``, again on a live worker each time its worker is lost (killed, or dropped
        from the directory while too busy to beat), for up to ``wait_s``; then ``EnvFailed``."""
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return await call()
            except _Lost as e:
                if time.monotonic() >= deadline:
                    raise EnvFailed(f"episode {self.name}: no env worker kept it for {self.wait_s:g} s ({e})") from None
                logger.warning("env: %s lost its env worker (%s); rebuilding it on a live one", self.episode, e)
                self.at = None
                await asyncio.sleep(LOST_PAUSE_S)

    async def _open(self) -> EnvReply:
        """The episode's environment made and reset on the least busy live worker."""
        self.at = None
        call = EnvCall(episode=self.episode, method="reset", seed=self.seed, row_json=json.dumps(self.row))
        return await self._send(call, self.timeout_s + START_S)

    async def _rebuild(self) -> None:
        """The episode on a live worker, as it was: reset, restored to its last snapshot (if
        any), then each action since stepped again."""
        self.rebuilt += 1
        first = await self._open()
        _same(first, self.first, f"episode {self.name}: reset with seed {self.seed}")
        if self.base is not None:
            turn, state = self.base
            await self._send(EnvCall(episode=self.episode, method="restore", turn=turn, state=state), self.timeout_s)
        for turn, action, recorded in self.steps:
            again = await self._send(EnvCall(episode=self.episode, method="step", turn=turn, action=action), self.timeout_s)
            _same(again, recorded, f"episode {self.name}: turn {turn} stepped again")
        logger.warning("env: %s rebuilt on %s at turn %d", self.episode, self.at, self.turn)

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
    fields = ("messages", "images", "reward", "terminated", "truncated", "tool_errors")
    if recorded is not None and any(getattr(again, f) != getattr(recorded, f) for f in fields):
        raise EnvFailed(f"{what} answered otherwise than before: the environment is not deterministic in its reset seed and actions")
