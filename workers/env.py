"""The env role: the environments (or tools, or agent code) of episodes, hosted out of the controllers.

    controller --EnvCall(reset | step | close)--> env worker --pipe--> episode process
                                                                        env = Env(**env.kwargs)
                                                                        RLIMIT_CPU, RLIMIT_AS,
                                                                        a network namespace

Each episode's environment lives in a process of its own, forked from the worker (which
imported the environment's module once: a few ms a fork), under ``env.cpu_limit_s`` CPU
seconds (RLIMIT_CPU), ``env.memory_limit_mb`` more address space than it started with
(RLIMIT_AS) and, unless ``env.network``, a network namespace of its own (no route out;
where the OS refuses one, the worker says so once in its log). An environment with
``snapshot()`` and ``restore(state)`` is saved and restored by the same calls. A call that raises, an
environment process that dies (its CPU limit, a crash) or a call past
``env.episode_timeout_s`` ends that episode: the reply is an ``EnvFailed`` naming the
environment and why, the controller ends the episode as env_error, and the worker goes on
serving. A step of a turn already stepped is answered again with that turn's reply (a
re-sent request steps nothing twice). An episode that no call touched for three times
``env.episode_timeout_s`` (its controller died) is closed (were it only waiting for a slow
generation, its controller rebuilds it here).

Agent code (``env.episode``) is hosted the same way, as an environment whose observations
are its calls and whose actions the policy's replies (``yatt.rl.agents.hosted.AgentEnv``):
its process also serves it an OpenAI-compatible endpoint on its own loopback.

A killed env worker takes its episode processes with it (they die with their parent);
the controllers rebuild each of its episodes on a live worker
(``yatt.rl.agents.remote``): reset with the episode's seed, its actions stepped again.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from setproctitle import getproctitle, setproctitle

from protocols.messages import EnvCall, EnvReply, Message, Metrics, Query
from yatt.rl.agents.envs import (
    EnvFactory,
    EnvFailed,
    call,
    env_factory,
    messages_of,
    normalized,
    supports_snapshots,
    to_wire,
)
from yatt.rl.agents.hosted import agent_factory
from yatt.rl.config import EnvConfig
from yatt.runtime.actor import Actor, handles
from yatt.runtime.lifetime import die_with_parent
from yatt.runtime.transport import Transport

getproctitle()  # (set up in the worker: set up in a child after the environment changed, it cannot move the command line)

logger = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
_START_TIMEOUT_S = 60.0  # an episode process's first answer (its environment made)
IDLE_TIMEOUTS = 3  # an episode untouched for this many env.episode_timeout_s is closed


class UnknownEpisode(Exception):
    """A call on an episode this worker does not hold (it was restarted, or the episode
    closed): the controller rebuilds the episode here (reset, its actions again)."""


# ------------------------------------------------------------------ the episode process


def isolate_network() -> bool:
    """Move this (single-threaded) process into a network namespace of its own: no
    interface but a loopback that is down, so nothing connects anywhere. As root, or
    through a user namespace where unprivileged ones are allowed; False where neither is."""
    if not sys.platform.startswith("linux"):
        return False
    unshare = ctypes.CDLL(None, use_errno=True).unshare
    return bool(unshare(CLONE_NEWNET) == 0 or unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0)


def _vm_size() -> int:
    """This process's address space now, in bytes (0 where /proc does not say)."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        for line in open("/proc/self/status").read().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def limit(config: EnvConfig) -> bool:
    """Put this process under the env limits; whether its network is isolated."""
    if config.cpu_limit_s > 0:
        seconds = max(1, round(config.cpu_limit_s))
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))  # SIGXCPU, then SIGKILL
    if config.memory_limit_mb > 0:
        size = _vm_size() + config.memory_limit_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (size, size))
    return True if config.network else isolate_network()


def episode_main(conn: multiprocessing.connection.Connection, config: EnvConfig, make: EnvFactory, parent: int) -> None:
    """An episode process: make the environment under the limits, say so (``("ready",
    isolated)``), then answer (method, arguments) calls until close or its pipe closes.
    Forked from a worker whose other threads (ZeroMQ's, the event loop's executor) it does
    not have: it touches nothing of theirs, only its pipe and the environment."""
    die_with_parent(parent)
    setproctitle(f"yatt env episode process of pid {parent}")  # (forked, it had its worker's command line: tools took it for the worker)
    signal.set_wakeup_fd(-1)  # (the worker's event loop's: a signal here must not wake it)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)
    isolated = limit(config)
    try:
        env = make()
    except Exception as e:  # a user's constructor: the reset that follows reports it
        conn.send(("error", f"making the environment {config.class_ or config.episode or 'of env.tools'} failed: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", isolated))
    loop = asyncio.new_event_loop()
    name = type(env).__name__
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            break
        try:
            conn.send(("ok", loop.run_until_complete(_answer(env, method, args))))
        except MemoryError as e:
            conn.send(("error", f"{name}.{method}: MemoryError {e}: past its memory limit, env.memory_limit_mb={config.memory_limit_mb}"))
        except BaseException as e:  # anything else the environment raises is its episode's end
            conn.send(("error", f"{name}.{method}: {type(e).__name__}: {e}"))
        if method == "close":
            break


async def _answer(env: Any, method: str, args: dict[str, Any]) -> dict[str, Any]:
    """One call on the environment, its answer in plain values (the reply's fields)."""
    if method == "reset":
        obs, info = await call(env.reset, seed=args["seed"], options={"row": args["row"]})
        tools = info.get("tools") if isinstance(info, dict) else None
        return {**_observation(obs), "tools_json": json.dumps(tools) if tools else "", "snapshots": supports_snapshots(env)}
    if method == "step":
        obs, reward, terminated, truncated, info = await call(env.step, args["action"])
        return {
            **_observation(obs), "reward": None if reward is None else float(reward),
            "terminated": bool(terminated), "truncated": bool(truncated),
            "tool_errors": int(info.get("tool_errors", 0)) if isinstance(info, dict) else 0,
        }  # fmt: skip
    if method == "snapshot":
        state = await call(env.snapshot)
        if not isinstance(state, bytes):
            raise TypeError(f"snapshot() must return bytes (got {type(state).__name__})")
        return {"state": state}
    if method == "restore":
        await call(env.restore, args["state"])
        return {}
    close = getattr(env, "close", None)
    if callable(close):
        await call(close)
    return {}


def _observation(obs: Any) -> dict[str, Any]:
    """An observation as the reply carries it to the controller: chat messages (text, or
    parts as JSON) and their images' bytes (``yatt.rl.agents.envs.to_wire``)."""
    messages, images = to_wire(normalized(messages_of(obs)))
    return {"messages": messages, "images": images}


# ------------------------------------------------------------------ the worker's side


@dataclass
class _Episode:
    """One episode's process, as the worker holds it."""

    process: Any  # multiprocessing's Process of the "fork" context
    conn: multiprocessing.connection.Connection
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    used: float = field(default_factory=time.monotonic)
    turn: int = -1  # the last turn stepped
    last: EnvReply | None = None  # its reply


class EnvWorker(Actor):
    """Serves ``EnvCall``s: each episode's environment in a process of its own."""

    role = "env"

    def __init__(
        self, transport: Transport, *, endpoint: str, config: EnvConfig, actor_id: str | None = None, model: str = "policy"
    ) -> None:  # fmt: skip
        """``model``: the name a hosted agent's endpoint serves (``env.episode``)."""
        super().__init__(transport, endpoint=endpoint, actor_id=actor_id)
        self.config = config
        self.episodes: dict[str, _Episode] = {}
        # (the environment's module imported here once, not in each episode)
        self.make = agent_factory(config, model=model) if config.episode else env_factory(config)
        self.hosts = config.class_ or config.episode or "a tool"  # (what errors name)
        self.context = multiprocessing.get_context("fork")
        self.said_network = False
        self.started = self.failed = self.killed = 0
        self.peak = 0  # the most episodes (processes) held at once

    async def on_start(self) -> None:
        self.spawn(self._sweep(), name="env-sweep")

    async def on_stop(self) -> None:
        for episode in list(self.episodes):
            await self._close(episode)

    @handles(EnvCall)
    async def env_call(self, msg: EnvCall) -> EnvReply:
        if msg.method == "reset":
            await self._close(msg.episode)  # (a reset sent again starts the episode over)
            self.episodes[msg.episode] = await self._start()
            self.peak = max(self.peak, len(self.episodes))
        held = self.episodes.get(msg.episode)
        if held is None:
            if msg.method == "close":
                return EnvReply(episode=msg.episode)
            raise UnknownEpisode(f"env worker {self.actor_id} holds no episode {msg.episode!r}")
        async with held.lock:
            held.used = time.monotonic()
            if msg.method == "step" and msg.turn == held.turn and held.last is not None:
                return held.last  # a re-sent step: answered again, not stepped twice
            if msg.method == "step" and msg.turn != held.turn + 1:
                raise ValueError(f"episode {msg.episode!r}: step of turn {msg.turn} after turn {held.turn}")
            if msg.method == "close":
                await self._close(msg.episode, graceful=True)
                return EnvReply(episode=msg.episode)
            args = {"seed": msg.seed, "row": json.loads(msg.row_json or "{}"), "action": msg.action, "state": msg.state}
            try:
                answer = await self._ask(held, msg.method, args)
            except EnvFailed:
                self.failed += 1
                await self._close(msg.episode)
                raise
            reply = EnvReply(episode=msg.episode, **answer)
            if msg.method == "step":
                held.turn, held.last = msg.turn, reply
            elif msg.method == "restore":  # its state covers the episode up to turn msg.turn
                held.turn, held.last = msg.turn, None
            return reply

    async def _start(self) -> _Episode:
        """A new episode process, its environment made (``EnvFailed`` if that failed)."""
        ours, theirs = self.context.Pipe()
        process = self.context.Process(target=episode_main, args=(theirs, self.config, self.make, os.getpid()), daemon=True)
        process.start()  # (on the loop's thread: the child's PDEATHSIG follows the thread that forked it)
        theirs.close()
        self.started += 1
        held = _Episode(process=process, conn=ours)
        try:
            kind, value = await asyncio.wait_for(_receive(ours), _START_TIMEOUT_S)
        except (TimeoutError, EOFError, OSError) as e:
            await self._kill(held)
            raise EnvFailed(f"an episode process did not start ({self._death(held, e)})") from None
        if kind == "error":
            await self._kill(held)
            raise EnvFailed(value)
        if not value and not self.said_network:
            self.said_network = True
            logger.warning("env: this OS gives an episode process no network namespace of its own; its environment can reach the network")
        return held

    async def _ask(self, held: _Episode, method: str, args: dict[str, Any]) -> dict[str, Any]:
        """One call in the episode's process; ``EnvFailed`` when it raised, died or hung."""
        try:
            held.conn.send((method, args))
            kind, value = await asyncio.wait_for(_receive(held.conn), self.config.episode_timeout_s)
        except TimeoutError:
            self.killed += 1
            raise EnvFailed(
                f"{self.hosts}: {method} took over env.episode_timeout_s={self.config.episode_timeout_s:g} s; its process was killed"
            ) from None
        except (EOFError, OSError) as e:
            raise EnvFailed(f"{self.hosts}: the episode's process died during {method} ({self._death(held, e)})") from None
        if kind == "error":
            raise EnvFailed(str(value))
        return dict(value)

    def _death(self, held: _Episode, error: BaseException) -> str:
        """Why an episode process is gone, from its exit code."""
        held.process.join(1.0)
        code = held.process.exitcode
        if code == -signal.SIGXCPU:
            return f"past its CPU limit, env.cpu_limit_s={self.config.cpu_limit_s:g}"
        if code == -signal.SIGKILL:
            return "killed by SIGKILL: its CPU limit's hard end, the OS's memory killer, or by hand"
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}" if code is not None else f"{type(error).__name__}: {error}"

    async def _close(self, episode: str, *, graceful: bool = False) -> None:
        """End an episode: its environment's close (graceful: asked and answered), its process gone."""
        held = self.episodes.pop(episode, None)
        if held is None:
            return
        if graceful:
            with contextlib.suppress(EnvFailed, EOFError, OSError):
                await asyncio.wait_for(self._ask(held, "close", {}), 5.0)
        await self._kill(held)

    async def _kill(self, held: _Episode) -> None:
        with contextlib.suppress(OSError, ValueError):
            held.process.kill()
        await asyncio.to_thread(held.process.join, 5.0)
        held.conn.close()

    async def _sweep(self) -> None:
        """Close episodes no call touched for ``IDLE_TIMEOUTS`` x ``env.episode_timeout_s`` (their controller is gone)."""
        while True:
            await asyncio.sleep(min(30.0, self.config.episode_timeout_s / 2))
            idle = time.monotonic() - IDLE_TIMEOUTS * self.config.episode_timeout_s
            for episode, held in list(self.episodes.items()):
                if held.used < idle and not held.lock.locked():
                    logger.warning("env: closing episode %s, untouched for %g s", episode, IDLE_TIMEOUTS * self.config.episode_timeout_s)
                    await self._close(episode)

    @handles(Query)
    async def query(self, msg: Query) -> Message:
        if msg.what == "stats":
            children = resource.getrusage(resource.RUSAGE_CHILDREN)  # (every episode process, once reaped)
            return Metrics(
                values={"env/episodes": float(len(self.episodes)), "env/started": float(self.started),
                        "env/peak_episodes": float(self.peak),
                        "env/failed": float(self.failed), "env/killed": float(self.killed),
                        "env/cpu_s": children.ru_utime + children.ru_stime}
            )  # fmt: skip
        raise ValueError(f"env: unknown query {msg.what!r}; known: stats")


async def _receive(conn: multiprocessing.connection.Connection) -> Any:
    """The next object from ``conn`` without blocking the event loop (``EOFError`` when the
    other end is gone)."""
    loop = asyncio.get_running_loop()
    while not conn.poll():
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(conn.fileno(), _settle, readable)
        try:
            await readable
        finally:
            loop.remove_reader(conn.fileno())
    return conn.recv()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)

