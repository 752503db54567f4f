"""``python -m benchmarks controllers``: how fast yatt's controllers route groups.

What is measured: the routing cost of the real ``yatt.rl.controller.Controller`` (its ``run``
loop, ``_call``, the directory's ``pick``, the Client/Actor runtime and the codec), with
every worker that would do real work replaced by a fake that answers at once::

    registry (this process) <--Register/heartbeats-- every process below
    controller(s) --PlanRequest (long poll)--> fake buffer   keys of the shard, W at a time
                  --GenerateRequest---------> fake generator  precomputed Completions
                  --ScoreRequest------------> fake reward     precomputed Scores
                  --ScoredGroup-------------> fake buffer     Ack; counts the group once,
                                                              hands out a fresh key

Each fake (``benchmarks/controllers_fakes.py``) is a real ``yatt.runtime.actor.Actor`` in a
spawned process of its own, registered in a ``Registry`` as ``launch/role.py`` does, so
the controllers find them through their ``Directory`` as in a run. The fake generator
answers a GenerateRequest with ``n = group_size`` completions of ``max_new_tokens``
fixed token ids and logprobs (finish reason "length", policy version 0); the fake reward
answers with fixed rewards; the fake buffer (``KeyWindow``) keeps ``in_flight``
undecided keys per shard in the plan, answers a long poll as soon as a delivered group
changed its shard's plan, and replaces every delivered key by a fresh one (it never
filters, so every group counts). The fakes pay yatt's runtime and codec like any
worker, so they cost CPU too: about as much, together, as the controller they serve.

Two modes at each N in ``controllers``:

- ``controllers_N``: N controller processes, one shard each (``num_controllers = N``),
  each set up as ``launch/role.py`` sets a controller up (Directory, Controller,
  ControllerActor, Registration).
- ``one_process_N_shards``: one process running N ``Controller`` instances (shards
  0..N-1, ``num_controllers = N``) in one event loop, sharing one Directory (one
  Client per worker), each with its ControllerActor registered.

The fakes stay up for the whole benchmark; the controller processes are started afresh
for each (N, mode), mode A and B alternating. Once all have registered, ``warmup_s`` of
warm-up, then a window of ``window_s``: samples/s is what reached the fake buffer in it
(its own count, asked before and after); CPU time is user + system of each process
(psutil, every thread of the process, ZeroMQ's I/O thread included) over the same window.

Figures (PREFIX = ``controllers_N`` or ``one_process_N_shards``):

- ``PREFIX_samples_per_s``; ``samples_per_s_per_controller_N`` (mode A / N).
- ``PREFIX_cpu_us_per_sample``: CPU of the controller process(es) per delivered sample.
- ``PREFIX_{generator,reward,buffer}_cpu_us_per_sample``: the same for the fakes, so a
  reader sees what the fakes cost next to the controllers; ``PREFIX_main_cpu_us_per_sample``
  is this process (registry and the benchmark's own polling; it can read 0 in a short
  window, the clock counting CPU time in 10 ms ticks).
- ``PREFIX_cpu_util_{controller,generator,reward,buffer}``: mean CPU utilisation of one
  process of that role during the window (1.0 = one core busy); ``PREFIX_cpu_cores_total``:
  cores used by all the benchmark's processes together, and ``PREFIX_all_cpu_us_per_sample``
  their CPU per sample: ``cpus * 1e6 / PREFIX_all_cpu_us_per_sample`` is what this
  configuration could deliver on idle cores (samples/s itself drops when other work
  shares the machine; CPU per sample much less so).
- ``PREFIX_plans_per_group``: DispatchPlans the fake buffer answered per delivered group
  (each plan carries the shard's ``in_flight`` keys; a plan answers every group delivered
  since the controller's previous plan request).

Ratios: ``controllers_N_vs_one_process`` (mode A / mode B samples/s at the same N),
``scaling_N_vs_1`` (mode A at N / mode A at 1) and ``one_process_scaling_N_vs_1``.
Plot ``samples_per_s``: samples/s against N, both modes.

Options (``--set KEY=VALUE``, values in YAML): ``controllers`` (default ``[1, 2, 4, 8]``,
quick ``[1, 2]``), ``warmup_s`` (1.0; quick 0.5), ``window_s`` (5.0; quick 1.5),
``in_flight`` (keys per shard in the plan, i.e. groups in flight per controller; 32),
``group_size`` (8) and ``max_new_tokens`` (8), as in ``launch/default.yaml``,
``prompt_tokens`` (32), ``generators`` and ``rewards`` (fake processes of each, 1).

What a reader should know: on the project's 2-core machine every process (N
controllers, 3+ fakes, this one) shares the same 2 cores, so mode A cannot scale past
what 2 cores give (``cpus * 1e6 / PREFIX_all_cpu_us_per_sample``), and from N = 4 on it
measures how well many processes share 2 cores; the controllers of mode B, in one event
loop, use at most about one core (plus ZeroMQ's I/O thread). The ``cpu_util`` figures show where the cores went:
a fake near 1.0 is the bottleneck (raise ``generators`` or ``rewards``). The machine is
shared: a note gives the cores that processes outside the benchmark used during each
window, and samples/s falls with them while CPU per sample mostly does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

import psutil

from benchmarks.controllers_fakes import PROMPTS_PER_SHARD, FakeBuffer, FakeGenerator, FakeReward
from benchmarks.harness import LinePlot, Result, Series
from protocols.messages import Ack, Metrics, Query
from yatt.rl.config import AlgorithmConfig, ControllerConfig
from yatt.rl.controller import Controller, ControllerActor
from yatt.rl.data import Prompt
from yatt.runtime.actor import Actor, Client
from yatt.runtime.configtools import build, require
from yatt.runtime.registry import Directory, Registration, Registry
from yatt.runtime.transport import Transport, TransportConfig

QUICK: dict[str, object] = {"controllers": [1, 2], "warmup_s": 0.5, "window_s": 1.5}
HOST = "127.0.0.1"
FAKE_ROLES = ("generator", "reward", "buffer")
START_TIMEOUT_S = 120.0
"""How long the processes of one configuration may take to register (spawn + imports)."""


@dataclass(frozen=True, kw_only=True)
class Options:
    """What to measure (``--set KEY=VALUE``; ``--quick`` shortens the windows)."""

    controllers: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """Numbers of controllers (= shards) to measure, in order."""
    warmup_s: float = 1.0
    """Seconds of routing before each measuring window."""
    window_s: float = 5.0
    """Seconds of each measuring window."""
    in_flight: int = 32
    """Undecided keys per shard in the fake buffer's plan (groups in flight per controller)."""
    group_size: int = 8
    """Samples per group (GenerateRequest.n)."""
    max_new_tokens: int = 8
    """Tokens of each fake completion."""
    prompt_tokens: int = 32
    """Tokens of each prompt."""
    generators: int = 1
    """Fake generator processes."""
    rewards: int = 1
    """Fake reward processes."""

    def __post_init__(self) -> None:
        require(bool(self.controllers), "controllers", "must list at least one number of controllers")
        for i, n in enumerate(self.controllers):
            require(n >= 1, f"controllers[{i}]", f"must be >= 1 (got {n})")
        require(
            len(set(self.controllers)) == len(self.controllers),
            "controllers",
            f"has repeats ({self.controllers})",
        )
        require(self.warmup_s >= 0, "warmup_s", f"must be >= 0 (got {self.warmup_s})")
        require(self.window_s > 0, "window_s", f"must be > 0 (got {self.window_s})")
        for name in ("in_flight", "group_size", "max_new_tokens", "prompt_tokens", "generators", "rewards"):
            value = getattr(self, name)
            require(value >= 1, name, f"must be >= 1 (got {value})")


# ---------------------------------------------------------------- child processes


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)


def _log_as(name: str) -> None:
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s bench {name} %(levelname)s %(name)s: %(message)s"
    )


async def _until_stopped(stop: asyncio.Event, work: Sequence[asyncio.Future[Any]]) -> None:
    """Wait for ``stop`` or the first of ``work`` to end; cancel the rest; re-raise a failure."""
    done, pending = await asyncio.wait(
        [asyncio.ensure_future(stop.wait()), *work], return_when=asyncio.FIRST_COMPLETED
    )
    # From here on the processes of this configuration leave together: the runtime's
    # warnings about peers that left the directory are expected, not news.
    logging.getLogger("yatt.runtime.actor").setLevel(logging.ERROR)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()


def _fake_main(role: str, registry: str, opts: Options) -> None:
    """Child process: one fake worker, registered, until SIGTERM."""
    _log_as(role)

    async def main() -> None:
        stop = asyncio.Event()
        _stop_on_signals(stop)
        async with Transport(TransportConfig()) as transport:
            endpoint = f"tcp://{HOST}:*"
            actor: Actor
            if role == "generator":
                actor = FakeGenerator(
                    transport,
                    endpoint=endpoint,
                    group_size=opts.group_size,
                    max_new_tokens=opts.max_new_tokens,
                )
            elif role == "reward":
                actor = FakeReward(transport, endpoint=endpoint, group_size=opts.group_size)
            else:
                actor = FakeBuffer(transport, endpoint=endpoint, window=opts.in_flight)
            async with actor, Registration(transport, registry, actor.info(pid=str(os.getpid()))):
                await _until_stopped(stop, [asyncio.ensure_future(actor.wait_closed())])

    asyncio.run(main())


def prompts_for(num_shards: int, prompt_tokens: int) -> list[Prompt]:
    """The controllers' prompt list: fixed token ids, ``PROMPTS_PER_SHARD`` per shard."""
    return [
        Prompt(
            index=i,
            prompt_ids=[32 + (i * 7 + t) % 400 for t in range(prompt_tokens)],
            text=f"prompt {i}",
            metadata={"answer": str(i % 10)},
        )
        for i in range(PROMPTS_PER_SHARD * num_shards)
    ]


def _controllers_main(shards: list[int], num_shards: int, registry: str, opts: Options) -> None:
    """Child process: ``Controller``s of ``shards`` in one event loop, sharing one Directory,
    each with its ControllerActor registered (as ``launch/role.py`` sets one up), until SIGTERM."""
    _log_as(f"controller {shards}")
    config = ControllerConfig(num_controllers=num_shards, max_new_tokens=opts.max_new_tokens)
    prompts = prompts_for(num_shards, opts.prompt_tokens)

    async def main() -> None:
        stop = asyncio.Event()
        _stop_on_signals(stop)
        async with Transport(TransportConfig()) as transport:
            async with Directory(transport, registry, name=f"controller-{shards[0]}") as directory:
                controllers = [
                    Controller(
                        config,
                        AlgorithmConfig(),
                        shard=s,
                        group_size=opts.group_size,
                        prompts=prompts,
                        directory=directory,
                        seed=0,
                    )
                    for s in shards
                ]
                async with contextlib.AsyncExitStack() as stack:
                    for c in controllers:
                        actor = await stack.enter_async_context(
                            ControllerActor(transport, endpoint=f"tcp://{HOST}:*", controller=c)
                        )
                        await stack.enter_async_context(
                            Registration(transport, registry, actor.info(pid=str(os.getpid())))
                        )
                    await _until_stopped(stop, [asyncio.ensure_future(c.run(stop)) for c in controllers])

    asyncio.run(main())


# ---------------------------------------------------------------- this process


@dataclass
class Proc:
    """One child process of the benchmark and the role it plays."""

    role: str
    process: BaseProcess
    ps: psutil.Process | None = None


def _spawn(role: str, target: Any, *args: object) -> Proc:
    proc = mp.get_context("spawn").Process(target=target, args=args, name=f"bench-{role}")
    proc.start()
    assert proc.pid is not None
    return Proc(role=role, process=proc, ps=psutil.Process(proc.pid))


async def _stop(procs: Iterable[Proc]) -> list[str]:
    """SIGTERM each, wait for all to end; returns what had to be killed."""
    procs = list(procs)
    for p in procs:
        if p.process.is_alive():
            p.process.terminate()
    killed = []
    deadline = time.monotonic() + 15.0
    for p in procs:
        await asyncio.to_thread(p.process.join, max(0.1, deadline - time.monotonic()))
        if p.process.is_alive():
            killed.append(f"{p.role} (pid {p.process.pid})")
            p.process.kill()
            await asyncio.to_thread(p.process.join, 5.0)
    return killed


async def _wait_registered(registry: Registry, expected: Mapping[str, int], procs: Sequence[Proc]) -> None:
    """The READY handshake: wait until ``expected`` members of each role are registered."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        have: dict[str, int] = {}
        for w in registry.members():
            have[w.role] = have.get(w.role, 0) + 1
        if all(have.get(role, 0) >= n for role, n in expected.items()):
            return
        dead = [f"{p.role} (exit code {p.process.exitcode})" for p in procs if not p.process.is_alive()]
        if dead:
            raise RuntimeError(f"benchmark process(es) died while starting: {dead}")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"not every role registered within {START_TIMEOUT_S} s: have {have}, want {dict(expected)}"
            )
        await asyncio.sleep(0.05)


@dataclass(kw_only=True)
class Snapshot:
    """What the counters said at one moment."""

    t: float
    counts: dict[str, float]  # the fake buffer's: groups, samples, duplicates, plans
    cpu: dict[int, float]  # pid -> user + system seconds
    machine_busy: float  # every process of the machine, seconds


def _cpu_s(ps: psutil.Process) -> float:
    times = ps.cpu_times()
    return float(times.user + times.system)


def _machine_busy_s() -> float:
    t = psutil.cpu_times()
    return float(
        t.user
        + t.nice
        + t.system
        + getattr(t, "irq", 0.0)
        + getattr(t, "softirq", 0.0)
        + getattr(t, "steal", 0.0)
    )


async def _snapshot(buffer: Client, procs: Sequence[Proc], me: psutil.Process) -> Snapshot:
    stats = await buffer.request(Query(what="stats"), Metrics)
    cpu = {p.process.pid or 0: _cpu_s(p.ps) for p in procs if p.ps is not None}
    cpu[me.pid] = _cpu_s(me)
    return Snapshot(
        t=time.perf_counter(),
        counts=stats.values,
        cpu=cpu,
        machine_busy=_machine_busy_s(),
    )


@dataclass(kw_only=True)
class Measurement:
    """One (N, mode) over its window."""

    samples_per_s: float
    samples: float
    groups: float
    plans: float
    duplicates: float
    cpu_s: dict[str, float]  # role -> CPU seconds of all its processes in the window
    processes: dict[str, int]  # role -> number of processes
    seconds: float
    other_cores: float  # cores used by processes outside the benchmark


async def _measure(
    registry: Registry,
    buffer: Client,
    fakes: Sequence[Proc],
    shards_per_process: list[list[int]],
    opts: Options,
) -> Measurement:
    """Start the controller processes of one configuration, measure one window, stop them."""
    num_shards = sum(len(s) for s in shards_per_process)
    await buffer.request(Query(what="reset", args={"num_shards": str(num_shards)}), Ack)
    controllers = [
        _spawn("controller", _controllers_main, shards, num_shards, registry.endpoint, opts)
        for shards in shards_per_process
    ]
    me = psutil.Process()
    try:
        expected = {role: 1 for role in FAKE_ROLES} | {"controller": num_shards}
        await _wait_registered(registry, expected, [*fakes, *controllers])
        await asyncio.sleep(opts.warmup_s)
        procs = [*fakes, *controllers]
        first = await _snapshot(buffer, procs, me)
        await asyncio.sleep(opts.window_s)
        last = await _snapshot(buffer, procs, me)
    finally:
        killed = await _stop(controllers)
    if killed:
        raise RuntimeError(f"controller process(es) did not stop on SIGTERM and were killed: {killed}")
    seconds = last.t - first.t
    cpu_s: dict[str, float] = {}
    processes: dict[str, int] = {}
    for p in procs:
        pid = p.process.pid or 0
        cpu_s[p.role] = cpu_s.get(p.role, 0.0) + last.cpu[pid] - first.cpu[pid]
        processes[p.role] = processes.get(p.role, 0) + 1
    cpu_s["main"] = last.cpu[me.pid] - first.cpu[me.pid]
    processes["main"] = 1
    ours = sum(cpu_s.values())
    return Measurement(
        samples_per_s=(last.counts["samples"] - first.counts["samples"]) / seconds,
        samples=last.counts["samples"] - first.counts["samples"],
        groups=last.counts["groups"] - first.counts["groups"],
        plans=last.counts["plans"] - first.counts["plans"],
        duplicates=last.counts["duplicates"] - first.counts["duplicates"],
        cpu_s=cpu_s,
        processes=processes,
        seconds=seconds,
        other_cores=max(0.0, (last.machine_busy - first.machine_busy - ours) / seconds),
    )


def _record(f: dict[str, float], prefix: str, m: Measurement) -> None:
    if m.samples <= 0:
        raise RuntimeError(f"{prefix}: no sample reached the fake buffer in {m.seconds:.1f} s")
    f[f"{prefix}_samples_per_s"] = m.samples_per_s
    f[f"{prefix}_cpu_us_per_sample"] = m.cpu_s["controller"] / m.samples * 1e6
    for role in (*FAKE_ROLES, "main"):
        f[f"{prefix}_{role}_cpu_us_per_sample"] = m.cpu_s[role] / m.samples * 1e6
    for role in ("controller", *FAKE_ROLES):
        f[f"{prefix}_cpu_util_{role}"] = m.cpu_s[role] / m.processes[role] / m.seconds
    f[f"{prefix}_cpu_cores_total"] = sum(m.cpu_s.values()) / m.seconds
    f[f"{prefix}_all_cpu_us_per_sample"] = sum(m.cpu_s.values()) / m.samples * 1e6
    f[f"{prefix}_plans_per_group"] = m.plans / m.groups


@contextlib.asynccontextmanager
async def _fakes(registry: Registry, opts: Options) -> AsyncIterator[tuple[list[Proc], Client]]:
    """The fake workers, registered, and a client of the fake buffer; all stopped at the end."""
    counts = {"generator": opts.generators, "reward": opts.rewards, "buffer": 1}
    procs = [
        _spawn(role, _fake_main, role, registry.endpoint, opts)
        for role, n in counts.items()
        for _ in range(n)
    ]
    try:
        await _wait_registered(registry, counts, procs)
        (buffer_info,) = [w for w in registry.members() if w.role == "buffer"]
        async with Client(registry.transport, buffer_info.endpoint, name="bench") as buffer:
            yield procs, buffer
    finally:
        killed = await _stop(procs)
        if killed:
            raise RuntimeError(f"fake worker(s) did not stop on SIGTERM and were killed: {killed}")


async def _run(opts: Options) -> Result:
    result = Result()
    f, r = result.figures, result.ratios
    other: list[str] = []
    duplicates = 0.0
    async with Transport(TransportConfig()) as transport:
        registry = Registry(transport, endpoint=f"tcp://{HOST}:*", publish_endpoint=f"tcp://{HOST}:*")
        await registry.start()
        try:
            async with _fakes(registry, opts) as (fakes, buffer):
                for n in opts.controllers:
                    for prefix, layout in (
                        (f"controllers_{n}", [[s] for s in range(n)]),
                        (f"one_process_{n}_shards", [list(range(n))]),
                    ):
                        m = await _measure(registry, buffer, fakes, layout, opts)
                        _record(f, prefix, m)
                        other.append(f"{prefix} {m.other_cores:.2f}")
                        duplicates += m.duplicates
        finally:
            await registry.close()
    for n in opts.controllers:
        f[f"samples_per_s_per_controller_{n}"] = f[f"controllers_{n}_samples_per_s"] / n
    for n in opts.controllers:
        r[f"controllers_{n}_vs_one_process"] = (
            f[f"controllers_{n}_samples_per_s"] / f[f"one_process_{n}_shards_samples_per_s"]
        )
    if 1 in opts.controllers:
        for n in opts.controllers:
            if n != 1:
                r[f"scaling_{n}_vs_1"] = (
                    f[f"controllers_{n}_samples_per_s"] / f["controllers_1_samples_per_s"]
                )
                r[f"one_process_scaling_{n}_vs_1"] = (
                    f[f"one_process_{n}_shards_samples_per_s"] / f["one_process_1_shards_samples_per_s"]
                )
    xs = [float(n) for n in opts.controllers]
    result.plots["samples_per_s"] = LinePlot(
        title="controller routing throughput, fake workers",
        xlabel="controllers (shards)",
        ylabel="samples/s delivered",
        series=[
            Series(
                label="N controller processes",
                x=xs,
                y=[f[f"controllers_{n}_samples_per_s"] for n in opts.controllers],
            ),
            Series(
                label="one process, N shards",
                x=xs,
                y=[f[f"one_process_{n}_shards_samples_per_s"] for n in opts.controllers],
            ),
        ],
        logx=True,
    )
    result.notes.append(
        f"groups of {opts.group_size} x {opts.max_new_tokens} tokens, {opts.prompt_tokens}-token prompts, "
        f"{opts.in_flight} keys in flight per shard; {opts.generators} fake generator / {opts.rewards} fake "
        f"reward process(es) and 1 fake buffer; {opts.warmup_s} s warm-up, {opts.window_s} s window; "
        f"{os.cpu_count()} CPUs"
    )
    result.notes.append(
        "cores used by processes outside the benchmark during each window (the machine is shared): "
        + ", ".join(other)
    )
    if duplicates:
        result.notes.append(
            f"the fake buffer saw {duplicates:.0f} duplicate or unknown group(s) (not counted)"
        )
    return result


def run(*, quick: bool = False, options: Mapping[str, Any] | None = None) -> Result:
    opts = build(Options, {**(QUICK if quick else {}), **(options or {})})
    env = {"OMP_NUM_THREADS": "1"}  # as the launcher: many processes share the cores
    old = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        return asyncio.run(_run(opts))
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
