"""``python -m benchmarks transport``: yatt's runtime against raw pyzmq, side by side.

Patterns (the receiving end in a child process for both columns):

- small messages: 100-byte payloads one way. yatt: an acknowledged, credit-controlled
  stream of typed messages (``StreamSender`` -> a serial handler); raw: asyncio PUSH/PULL
  of 100-byte frames, no acks.
- RPC: round trips with 1 and with 64 requests in flight. yatt: ``Client.request`` to an
  ``Actor`` handler; raw: asyncio DEALER -> ROUTER echo.
- rollout batches of 1 MiB and 16 MiB as tensors. yatt: a ``WeightUpdate`` carrying one
  tensor through a stream (zero-copy frames, acked); raw: PUSH of a header frame plus the
  payload frame with ``copy=False``.
- the memcpy ceiling of this machine; Ray actor calls when ``ray`` is installed.
- authentication: the yatt patterns again with CURVE on both ends (as every launched run
  has by default: ``run.authenticate``), and their ratio to the plain ones.
"""

from __future__ import annotations

import asyncio
import importlib.util
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import transport_raw as raw
from benchmarks.harness import Result
from protocols.messages import Ack, Message, Query, WeightUpdate
from yatt.runtime.actor import Actor, Client, handles
from yatt.runtime.streams import StreamSender
from yatt.runtime.transport import Transport, TransportConfig, make_curve_keys

SMALL_TEXT = "x" * 84  # the encoded Query header is then 100 bytes


class _Sink(Actor):
    """Counts stream items and answers queries with an Ack."""

    role = "bench"

    def __init__(self, transport: Transport, *, endpoint: str) -> None:
        super().__init__(transport, endpoint=endpoint)
        self.items = 0

    @handles(WeightUpdate, serial=True)
    async def item(self, msg: WeightUpdate) -> None:
        self.items += 1

    @handles(Query)
    async def query(self, msg: Query) -> Ack:
        return Ack(seq=len(msg.what))


def _config(keys: str) -> TransportConfig:
    """Plain, or CURVE with the keys in ``keys``."""
    return TransportConfig(hwm=0, curve=bool(keys), curve_keys_dir=keys)


def _serve(endpoint: str, ready: mp.Queue, keys: str) -> None:  # type: ignore[type-arg]
    async def main() -> None:
        async with Transport(_config(keys)) as transport:
            actor = _Sink(transport, endpoint=endpoint)
            ready.put(await actor.start())
            await actor.wait_closed()

    asyncio.run(main())


class _Server:
    """A ``_Sink`` actor in a child process, for the lifetime of a ``with`` block."""

    def __init__(self, keys: str = "") -> None:
        self.keys = keys

    def __enter__(self) -> str:
        ctx = mp.get_context("spawn")
        ready: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
        self.proc = ctx.Process(target=_serve, args=("tcp://127.0.0.1:*", ready, self.keys), daemon=True)
        self.proc.start()
        self.endpoint = str(ready.get(timeout=60))
        return self.endpoint

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.join(10)


def _small_message() -> Query:
    return Query(what=SMALL_TEXT)


async def _yatt_rpc(endpoint: str, in_flight: int, count: int, keys: str = "") -> float:
    async with Transport(_config(keys)) as transport:
        async with Client(transport, endpoint) as client:
            msg = _small_message()
            await client.request(msg, Ack)
            start = time.perf_counter()

            async def worker(n: int) -> None:
                for _ in range(n):
                    await client.request(msg, Ack)

            await asyncio.gather(*(worker(count // in_flight) for _ in range(in_flight)))
            return (count // in_flight) * in_flight / (time.perf_counter() - start)


async def _yatt_stream(endpoint: str, item: Message, count: int, keys: str = "") -> float:
    """Seconds to stream ``count`` items and have every one acknowledged."""
    async with Transport(_config(keys)) as transport:
        sender = StreamSender(transport, endpoint, credit=64)
        await sender.send(item)
        await sender.flush()
        start = time.perf_counter()
        for _ in range(count):
            await sender.send(item)
        await sender.flush()
        elapsed = time.perf_counter() - start
        await sender.close()
        return elapsed


def _tensor_item(nbytes: int) -> WeightUpdate:
    return WeightUpdate(version=0, bucket_index=0, num_buckets=1, names=["batch"], tensors=[torch.ones(nbytes // 4)])


def _ray_rpc(count: int) -> float | None:
    if importlib.util.find_spec("ray") is None:
        return None
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote
        class Echo:
            def ping(self, x: bytes) -> bytes:
                return x

        echo = Echo.remote()  # type: ignore[attr-defined]
        ray.get(echo.ping.remote(b"x"))
        start = time.perf_counter()
        for _ in range(count):
            ray.get(echo.ping.remote(raw.SMALL))
        return count / (time.perf_counter() - start)
    finally:
        ray.shutdown()


def run(*, quick: bool = False) -> Result:
    scale = 10 if quick else 1
    small_n, rpc_n, mib_n, big_n = 20_000 // scale, 5_000 // scale, 200 // scale, 30 // scale
    result = Result()
    f, r = result.figures, result.ratios
    with tempfile.TemporaryDirectory() as tmp:
        keys = str(make_curve_keys(Path(tmp) / "keys"))
        for suffix, key_dir in (("", ""), ("_curve", keys)):  # plain, then authenticated + encrypted
            with _Server(key_dir) as endpoint:
                small = _small_message()
                seconds = asyncio.run(_yatt_stream(endpoint, small, small_n, key_dir))
                f[f"small_msgs_per_s_yatt{suffix}"] = small_n / seconds
                f[f"rpc_round_trips_per_s_yatt{suffix}_1_in_flight"] = asyncio.run(_yatt_rpc(endpoint, 1, rpc_n, key_dir))
                f[f"rpc_round_trips_per_s_yatt{suffix}_64_in_flight"] = asyncio.run(
                    _yatt_rpc(endpoint, 64, rpc_n * 4, key_dir)
                )
                for label, nbytes, n in (("1MiB", 1 << 20, mib_n), ("16MiB", 16 << 20, big_n)):
                    seconds = asyncio.run(_yatt_stream(endpoint, _tensor_item(nbytes), n, key_dir))
                    f[f"batch_{label}_MB_per_s_yatt{suffix}"] = nbytes * n / seconds / 1e6
    for name in ("small_msgs_per_s", "rpc_round_trips_per_s_yatt_1_in_flight", "rpc_round_trips_per_s_yatt_64_in_flight",
                 "batch_1MiB_MB_per_s", "batch_16MiB_MB_per_s"):  # fmt: skip
        plain = name if name.startswith("rpc") else f"{name}_yatt"
        curve = plain.replace("_yatt", "_yatt_curve")
        r[f"curve_vs_plain_{plain.removesuffix('_yatt').replace('_per_s', '')}"] = f[curve] / f[plain]
    f["small_msgs_per_s_raw_zmq"] = small_n / raw.push_throughput(raw.endpoint(), raw.endpoint(), [raw.SMALL], small_n)
    f["rpc_round_trips_per_s_raw_zmq_1_in_flight"] = raw.rpc_round_trips(raw.endpoint(), 1, rpc_n)
    f["rpc_round_trips_per_s_raw_zmq_64_in_flight"] = raw.rpc_round_trips(raw.endpoint(), 64, rpc_n * 4)
    for label, nbytes, n in (("1MiB", 1 << 20, mib_n), ("16MiB", 16 << 20, big_n)):
        payload = memoryview(bytearray(nbytes))
        seconds = raw.push_throughput(raw.endpoint(), raw.endpoint(), [b"hdr", payload], n)
        f[f"batch_{label}_MB_per_s_raw_zmq"] = nbytes * n / seconds / 1e6
    f["memcpy_MB_per_s"] = raw.memcpy_ceiling()
    r["small_msgs_vs_raw_zmq"] = f["small_msgs_per_s_yatt"] / f["small_msgs_per_s_raw_zmq"]
    r["rpc_vs_raw_zmq"] = f["rpc_round_trips_per_s_yatt_1_in_flight"] / f["rpc_round_trips_per_s_raw_zmq_1_in_flight"]
    r["rpc_64_in_flight_vs_raw_zmq"] = (
        f["rpc_round_trips_per_s_yatt_64_in_flight"] / f["rpc_round_trips_per_s_raw_zmq_64_in_flight"]
    )
    r["batch_1MiB_vs_raw_zmq"] = f["batch_1MiB_MB_per_s_yatt"] / f["batch_1MiB_MB_per_s_raw_zmq"]
    r["batch_16MiB_vs_raw_zmq"] = f["batch_16MiB_MB_per_s_yatt"] / f["batch_16MiB_MB_per_s_raw_zmq"]
    r["batch_16MiB_vs_memcpy"] = f["batch_16MiB_MB_per_s_yatt"] / f["memcpy_MB_per_s"]
    ray_rps = _ray_rpc(rpc_n // 5)
    if ray_rps is None:
        result.notes.append("ray is not installed: no Ray column (pip install ray)")
    else:
        f["rpc_round_trips_per_s_ray"] = ray_rps
        r["ray_rpc_vs_yatt"] = ray_rps / f["rpc_round_trips_per_s_yatt_1_in_flight"]
    result.notes.append(
        "yatt's small messages and batches are acknowledged (credit 64); raw zmq's are not; "
        "both sides pay msgpack/typing (yatt) or nothing (raw)"
    )
    return result
