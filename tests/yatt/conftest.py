"""Fixtures of the runtime tests: a fresh Transport per test that must end with no socket
open, and a bounded poll (the only way these tests wait for something to happen)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pytest

from yatt.errors import TransportError
from yatt.runtime.actor import Actor
from yatt.runtime.transport import Transport, TransportConfig

A = TypeVar("A", bound=Actor)

Until = Callable[..., Awaitable[None]]

# Liveness tests use short beats; a silence limit of 0.3 s keeps them quick and still
# tolerates a busy machine's scheduling hiccups.
FAST_BEATS = TransportConfig(heartbeat_interval_s=0.05, heartbeat_misses=6)


async def poll_until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Return once ``condition()`` holds; fail the test after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout} s")
        await asyncio.sleep(0.005)


async def start_again(make: Callable[[], A], timeout: float = 10.0) -> A:
    """Start a new actor on the fixed endpoint of one just closed: libzmq releases a closed
    listener's port in the background, so the first bind may find it still taken."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        actor = make()
        try:
            await actor.start()
            return actor
        except TransportError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.01)


@pytest.fixture
def until() -> Until:
    return poll_until


async def _checked(transport: Transport) -> AsyncIterator[Transport]:
    yield transport
    left = transport.open_sockets()
    transport.close()
    assert left == [], f"sockets left open at the end of the test: {left}"


@pytest.fixture
async def transport() -> AsyncIterator[Transport]:
    """Default config; the test must close everything it opened."""
    async for t in _checked(Transport()):
        yield t


@pytest.fixture
async def fast_transport() -> AsyncIterator[Transport]:
    """Heartbeats every 50 ms, peers lost after 0.3 s of silence."""
    async for t in _checked(Transport(FAST_BEATS)):
        yield t
