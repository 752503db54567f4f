"""Live-socket fuzzing: random and mutated frames into every port a running job listens on.

``role_ports(run_dir)`` finds each role process of a run (``launch.role ... --run-dir``) and
the TCP ports it listens on, ``launcher_ports`` the registry's; ``fuzz`` sends ``count`` multipart messages spread over them
from DEALER sockets that either hold the run's CURVE keys (the frames reach the decoder and
the handlers) or a key of their own (the frames must reach nothing). A message is one of:
random bytes in 1-5 frames; a valid message of a protocol type with its header or kind
mutated (bytes flipped, cut, extended), an extra or a missing frame, or a broken request
id. Replies are drained and counted. What is never sent: ``Shutdown`` (a peer with the
run's keys may ask an actor to stop; that is not a fault).
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import zmq
import zmq.auth

from protocols.codec import encode
from protocols.messages import (
    GenerateRequest,
    GroupKey,
    Heartbeat,
    Message,
    MicroBatchRequest,
    PlanRequest,
    PolicyVersion,
    Query,
    Register,
    SamplingParams,
    ScoredGroup,
    ScoreRequest,
    WeightUpdate,
    WorkerInfo,
)
from yatt.runtime import run_dir as names


@dataclass(kw_only=True)
class FuzzStats:
    sent: int = 0
    refused: int = 0  # not queued: no connected peer (a keyless client's handshake fails)
    replies: int = 0
    ports: int = 0


def role_processes(run_dir: Path) -> dict[str, int]:
    """``role-index`` -> pid of every role process of the run (``launch.role ... --run-dir``);
    a process forked by a role (a scorer or an environment's process that kept its command
    line) is not the role."""
    out = subprocess.run(["ps", "-eww", "-o", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    found: dict[int, tuple[str, int]] = {}  # pid -> (role-index, parent pid)
    for line in out.splitlines():
        if "launch.role " not in line or f"--run-dir {run_dir} " not in line:
            continue
        args = line.split()
        found[int(args[0])] = (f"{args[args.index('launch.role') + 1]}-{args[args.index('--index') + 1]}", int(args[1]))
    return {name: pid for pid, (name, parent) in found.items() if found.get(parent, ("", 0))[0] != name}


def role_ports(run_dir: Path) -> dict[str, list[int]]:
    """``role-index`` -> the TCP ports its process listens on, for every role of the run."""
    import psutil

    ports: dict[str, list[int]] = {}
    for name, pid in role_processes(run_dir).items():
        try:
            conns = psutil.Process(pid).net_connections("tcp")
        except psutil.Error:
            continue
        ports[name] = sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN})
    return ports


def launcher_ports(launcher_pid: int, run_dir: Path) -> list[int]:
    """The launcher's ZeroMQ ports (the registry's requests and its membership feed): every
    port it listens on but the trainer ranks' torch.distributed store (not ZeroMQ; its port
    is in ``<run_dir>/launcher.json``)."""
    import psutil

    store = {int(json.loads((run_dir / names.LAUNCHER).read_text())["store_port"])}
    conns = psutil.Process(launcher_pid).net_connections("tcp")
    return sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN} - store)


def dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, keys: Path | None, *, authorised: bool) -> zmq.Socket[bytes]:
    """A DEALER connected to ``endpoint``: without CURVE (keys None), or a CURVE client of
    the run's server key with the run's client key (authorised) or a key of its own."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndhwm = sock.rcvhwm = 0
    if keys is not None:
        sock.curve_serverkey = zmq.auth.load_certificate(keys / "server.key")[0]
        if authorised:
            sock.curve_publickey, sock.curve_secretkey = zmq.auth.load_certificate(keys / "client.key_secret")
        else:
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(endpoint)
    return sock


def _seeds() -> list[Message]:
    key = GroupKey(epoch=0, shard=0, prompt_index=1)
    ids = torch.tensor([5, 6, 7], dtype=torch.int32)
    return [
        Query(what="stats"),
        PlanRequest(shard=0, num_shards=2, after_seq=3, wait_s=0.01),
        MicroBatchRequest(step=0, rank=0, world_size=2, index=0),
        PolicyVersion(version=1),
        Heartbeat(actor_id="fuzz", seq=1),
        Register(worker=WorkerInfo(actor_id="fuzz", role="generator", endpoint="tcp://127.0.0.1:1")),
        GenerateRequest(group_key=key, prompt_ids=ids, n=2, sampling=SamplingParams(max_new_tokens=2)),
        ScoreRequest(group_key=key, prompt_ids=ids, completion_ids=[ids, ids], finish_reasons=["stop", "stop"]),
        ScoredGroup(
            group_key=key, prompt_ids=ids, completion_ids=[ids, ids], rollout_logprobs=[ids.float(), ids.float()],
            rewards=torch.zeros(2), advantages=torch.zeros(2), policy_versions=torch.zeros(2, dtype=torch.int64),
            finish_reasons=["stop", "stop"],
        ),  # fmt: skip
        WeightUpdate(version=1, bucket_index=0, num_buckets=1, names=["x"], tensors=[torch.zeros(4)]),
    ]


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    i = rng.randrange(len(frames))
    data = bytearray(frames[i])
    what = rng.randrange(6)
    if what == 0 and data:  # flip bytes
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif what == 1:  # cut
        data = data[: rng.randrange(len(data) + 1)]
    elif what == 2:  # extend
        data += rng.randbytes(rng.randint(1, 64))
    elif what == 3:  # an extra frame
        frames.append(rng.randbytes(rng.randint(0, 32)))
    elif what == 4 and len(frames) > 1:  # a missing frame
        frames.pop(rng.randrange(len(frames)))
        return frames
    frames[i] = bytes(data)
    return frames


def _message(rng: random.Random, seeds: list[list[bytes]]) -> list[bytes]:
    rid = rng.randrange(1, 1 << 30).to_bytes(8, "little")
    if rng.random() < 0.2:
        body = [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 5))]
    else:
        body = _mutate(rng, rng.choice(seeds))
    if rng.random() < 0.05:
        rid = rng.randbytes(rng.choice([0, 3, 9]))  # a broken envelope
    return [rid, *body]


def fuzz(ports: list[int], count: int, *, keys: Path | None, authorised: bool, seed: int = 0) -> FuzzStats:
    """Send ``count`` fuzzed messages round-robin to ``ports`` on 127.0.0.1."""
    rng = random.Random(seed)
    seeds = [[bytes(f) for f in encode(m)] for m in _seeds()]
    ctx = zmq.Context()
    socks = [dealer(ctx, f"tcp://127.0.0.1:{port}", keys, authorised=authorised) for port in ports]
    stats = FuzzStats(ports=len(ports))
    try:
        for n in range(count):
            sock = socks[n % len(socks)]
            try:
                sock.send_multipart(_message(rng, seeds), flags=zmq.NOBLOCK)
                stats.sent += 1
            except zmq.Again:
                stats.refused += 1
            if n % 200 == 0:  # drain replies, and let the roles breathe
                for s in socks:
                    while s.poll(0):
                        s.recv_multipart()
                        stats.replies += 1
                time.sleep(0.002)
        time.sleep(1.0)
        for s in socks:
            while s.poll(0):
                s.recv_multipart()
                stats.replies += 1
    finally:
        for s in socks:
            s.close()
        ctx.term()
    return stats
