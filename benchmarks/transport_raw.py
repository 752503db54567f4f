"""Raw pyzmq (asyncio) doing the same patterns as yatt's runtime: the baseline column.

Each pattern runs its receiving end in a child process, as yatt's do, so both columns pay
the same process boundary and the same two cores.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
import time

import numpy as np
import zmq
import zmq.asyncio

SMALL = b"x" * 100


def endpoint() -> str:
    """A loopback tcp endpoint on a port that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _sink(endpoint: str, done: str, expected: int) -> None:
    """PULL one warm-up message (say "ready"), then ``expected`` more (say "done")."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind(endpoint)
        ack = ctx.socket(zmq.PUSH)
        ack.connect(done)
        await pull.recv_multipart(copy=False)
        await ack.send(b"ready")
        for _ in range(expected):
            await pull.recv_multipart(copy=False)
        await ack.send(b"done")
        ack.close(linger=1000)
        pull.close(0)
        ctx.term()

    asyncio.run(main())


def _echo(endpoint: str) -> None:
    """ROUTER that echoes every request until it gets b"stop"."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(endpoint)
        while True:
            frames = await sock.recv_multipart(copy=False)
            await sock.send_multipart(frames, copy=False)
            if frames[-1].bytes == b"stop":
                break
        sock.close(linger=1000)
        ctx.term()

    asyncio.run(main())


def push_throughput(endpoint: str, done: str, frames: list[bytes | memoryview], count: int) -> float:
    """Seconds to PUSH ``count`` multipart messages and have the child confirm them all."""
    proc = mp.get_context("spawn").Process(target=_sink, args=(endpoint, done, count))
    proc.start()

    async def main() -> float:
        ctx = zmq.asyncio.Context()
        done_sock = ctx.socket(zmq.PULL)
        done_sock.bind(done)
        push = ctx.socket(zmq.PUSH)
        push.connect(endpoint)
        await push.send_multipart(frames, copy=False)  # warm-up: connection is up
        await done_sock.recv()  # "ready"
        start = time.perf_counter()
        for _ in range(count):
            await push.send_multipart(frames, copy=False)
        await done_sock.recv()  # "done"
        elapsed = time.perf_counter() - start
        push.close(0)
        done_sock.close(0)
        ctx.term()
        return elapsed

    try:
        return asyncio.run(main())
    finally:
        proc.join(30)


def rpc_round_trips(endpoint: str, in_flight: int, count: int) -> float:
    """Round trips per second with ``in_flight`` DEALER requests outstanding."""
    proc = mp.get_context("spawn").Process(target=_echo, args=(endpoint,))
    proc.start()

    async def main() -> float:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        await sock.send_multipart([b"warm", SMALL])
        await sock.recv_multipart()
        start = time.perf_counter()
        sent = received = 0
        while sent < min(in_flight, count):
            await sock.send_multipart([sent.to_bytes(8, "little"), SMALL])
            sent += 1
        while received < count:
            await sock.recv_multipart(copy=False)
            received += 1
            if sent < count:
                await sock.send_multipart([sent.to_bytes(8, "little"), SMALL])
                sent += 1
        elapsed = time.perf_counter() - start
        await sock.send_multipart([b"stop", b"stop"])
        await sock.recv_multipart()
        sock.close(0)
        ctx.term()
        return count / elapsed

    try:
        return asyncio.run(main())
    finally:
        proc.join(30)


def memcpy_ceiling(size: int = 64 << 20, repeats: int = 10) -> float:
    """This machine's memcpy bandwidth in MB/s: the ceiling for any in-memory transport."""
    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    start = time.perf_counter()
    for _ in range(repeats):
        np.copyto(dst, src)
    return size * repeats / (time.perf_counter() - start) / 1e6
