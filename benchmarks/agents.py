"""``python -m benchmarks agents``: multi-turn episodes with environment latency, yatt's
episode scheduling against lock-step turns and against TRL's GRPOTrainer, side by side,
interleaved.

The workload: ``episodes`` episodes of the built-in guess-the-number environment on the
tiny model (``max_turns`` turns each: the untrained model never guesses right, so every
episode runs them all), through a real generator actor (its batching, the transformers
engine) over loopback. Every environment step waits a heavy-tailed latency, as a tool
call does: lognormal around ``latency_ms``, clipped to [``min_ms``, ``max_ms``], seeded
per episode and turn (the same draws in every mode).

- ``yatt``: each episode is its own task (``yatt.rl.agents.episodes``): a turn is
  generated as soon as its episode's previous step returned, batched with whatever other
  turns are waiting at the generator.
- ``lockstep``: every episode's turn k is generated in one batch once every episode still
  running has finished turn k - 1 (the batch waits for its slowest step): the same runner,
  its ``generate`` held at a barrier. The best a turn-synchronous loop can do.
- ``env_role``: yatt's mode with each episode's environment hosted by the env role
  (``workers.env``: a worker process, each episode's environment in a process of its own
  forked from it) through the controller's ``RemoteEnv``: what isolation costs a turn.
- ``record``: yatt's mode with every finished turn recorded in a real buffer's ledger
  (``TurnRecord``: one fsync'd commit, shared by the records that arrive together) before
  its episode goes on: what exactly-once mid-episode costs a turn.
- ``trl``: TRL's own GRPOTrainer (``benchmarks/trl_agents.py``): its ``environment_factory``
  loop runs the same episodes (the same secrets and step latencies, its own HF generate on
  the same model, one torch thread), one optimizer step per run. Its loop is lock-step and
  more: a turn's steps run one episode after another, so a turn waits for the sum of the
  batch's steps. Timed over its rollout (``_generate``: generation and environment steps;
  no scoring, no training, which come after the whole rollout), its start-up and a warm-up
  step before the timing. It steps ``max_turns - 1`` times an episode (no step after the
  last turn), one latency wait fewer than the other modes: in TRL's favour.

Figures: episodes/s of each mode (median of ``repeats``, interleaved), the generator's busy
share (engine time / wall), the turn time, the time a turn record adds, and TRL's whole
optimizer step (``trl_step_s``). Ratios: ``yatt_vs_lockstep`` and ``yatt_vs_trl``
(samples/s), ``record_cost_share`` (the record's added time per turn over the turn's time).

With ``live`` below ``episodes`` (say 128 episodes, 32 live: a step's groups under
``env.concurrency``), yatt's modes keep ``live`` episodes going, the next starting as one
ends, and lock-step runs waves of ``live``, each to its end: a step's episodes as a
synchronous loop runs them, batch after batch. TRL runs batches of ``live`` (its rate per episode is one batch's).

Options (``--set``): episodes, live, max_turns, max_new_tokens, latency_ms, min_ms, max_ms, repeats.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import random
import statistics
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import Result
from protocols.messages import (
    Ack,
    Completion,
    Completions,
    GenerateRequest,
    GroupKey,
    SamplingParams,
)
from yatt.errors import ConfigError
from yatt.rl.agents.episodes import EpisodeRunner, Turn
from yatt.rl.agents.games import GuessNumber
from yatt.rl.config import BufferConfig, EnvConfig, GeneratorConfig
from yatt.rl.controller import turn_record
from yatt.runtime.configtools import build


@dataclass(frozen=True, kw_only=True)
class Options:
    episodes: int = 32
    """Episodes run (one batch for TRL)."""
    live: int = 0
    """Episodes live at once (0: all of them): yatt's modes start the next episode as soon
    as one ends (as a controller keeps ``env.concurrency`` episodes live), lock-step runs
    the episodes in waves of ``live`` (a batch after the batch, as a synchronous loop does)."""
    max_turns: int = 4
    """Turns per episode."""
    max_new_tokens: int = 8
    """A turn's tokens."""
    latency_ms: float = 80.0
    """Median environment latency of a step."""
    min_ms: float = 20.0
    """Shortest step."""
    max_ms: float = 500.0
    """Longest step (the tail is clipped here)."""
    repeats: int = 3
    """Runs of each mode, interleaved."""

    def __post_init__(self) -> None:
        if self.episodes < 2:  # TRL's GRPO wants a group of 2 or more rollouts
            raise ConfigError(f"agents.episodes must be >= 2 (got {self.episodes})")
        if self.max_turns < 1:
            raise ConfigError(f"agents.max_turns must be >= 1 (got {self.max_turns})")
        if not 0 <= self.live <= self.episodes:
            raise ConfigError(f"agents.live must be in 0..episodes={self.episodes}, 0 for all at once (got {self.live})")


QUICK = {"episodes": 8, "max_turns": 2, "max_new_tokens": 4, "latency_ms": 20.0, "min_ms": 5.0, "max_ms": 60.0, "repeats": 1}


class SlowGuess(GuessNumber):
    """Guess the number, each step waiting a drawn latency (a tool call's): ``latency``, or
    the ``latencies`` of ``Options(**draws)`` for the episode its reset seed names (made from
    a config by the env role: ``draws`` are latency_ms, min_ms, max_ms and max_turns)."""

    def __init__(self, high: int, latency: list[float] | None = None, **draws: float) -> None:
        super().__init__(high)
        self.latency = latency or []
        self.draws = draws
        self.turn = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        if self.draws:
            self.latency = latencies(build(Options, self.draws), seed or 0)
        return super().reset(seed=seed, options=options)

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:  # type: ignore[override]
        await asyncio.sleep(self.latency[self.turn])
        self.turn += 1
        return super().step(action)


def latencies(opts: Options, episode: int) -> list[float]:
    """The step latencies of one episode, in seconds (the same in every mode)."""
    rng = random.Random(episode)
    sigma = 1.0  # heavy tail: the 95th percentile ~5x the median
    return [min(max(math.exp(rng.gauss(math.log(opts.latency_ms), sigma)), opts.min_ms), opts.max_ms) / 1000 for _ in range(opts.max_turns)]


class LockStep:
    """Holds each turn's generation until every episode still running asks for that turn."""

    def __init__(self, episodes: int) -> None:
        self.running = episodes
        self.waiting = 0
        self.turn = asyncio.Condition()
        self.round = 0

    async def wait(self) -> None:
        async with self.turn:
            self.waiting += 1
            mine = self.round
            if self.waiting >= self.running:
                self.round, self.waiting = self.round + 1, 0
                self.turn.notify_all()
            else:
                await self.turn.wait_for(lambda: self.round != mine)

    async def leave(self) -> None:
        async with self.turn:
            self.running -= 1
            if self.running and self.waiting >= self.running:
                self.round, self.waiting = self.round + 1, 0
                self.turn.notify_all()


async def one_mode(
    mode: str, opts: Options, *, runner: EpisodeRunner, generator: Any, buffer: Any, transport: Any, directory: Any
) -> dict[str, float]:
    """Run the episodes once in ``mode``; its wall time, engine time, turns and record time.
    ``env_role``: each episode's environment in the env role's worker (``directory``'s), in
    a process of its own, as a run without ``env.inline`` has it."""
    from yatt.rl.agents.remote import RemoteEnv
    from yatt.runtime.actor import Client

    record_s: list[float] = []
    engine_before = generator.generate_s
    async with Client(transport, generator.endpoint) as gen, Client(transport, buffer.endpoint) as buf:

        async def episode(i: int, barrier: LockStep | None) -> int:
            key = GroupKey(epoch=0, shard=0, prompt_index=i)
            env: Any = SlowGuess(8, latencies(opts, i))
            if mode == "env_role":
                env = RemoteEnv(directory, name=key.as_str(), timeout_s=60.0, wait_s=60.0)
            prompt, _ = await runner.start(env, seed=i, row={}, prompt_ids=[])
            turns = 0

            async def generate(ids: list[int], budget: int, _pixels: object = None, _images: object = None) -> Completion:
                nonlocal turns
                if barrier is not None:
                    await barrier.wait()
                sampling = SamplingParams(temperature=1.0, max_new_tokens=budget, seed=1000 * i + turns)
                turns += 1
                request = GenerateRequest(group_key=key, prompt_ids=torch.tensor(ids, dtype=torch.int32), n=1, sampling=sampling)
                return (await gen.request(request, Completions)).completions[0]

            async def record(turn: Turn) -> None:
                began = time.perf_counter()
                await buf.request(turn_record(key, 0, turn), Ack)
                record_s.append(time.perf_counter() - began)

            try:
                out = await runner.run(env, prompt, generate, record=record if mode == "record" else None)
            finally:
                if barrier is not None:
                    await barrier.leave()
                if mode == "env_role":
                    await env.close()
            return out.info.turns

        live = opts.live or opts.episodes
        slots = asyncio.Semaphore(live)

        async def in_turn(i: int) -> int:
            async with slots:  # (the next episode starts as soon as one ends)
                return await episode(i, None)

        began = time.perf_counter()
        if mode == "lockstep":  # waves of ``live``, each waiting for its slowest step every turn
            turns = []
            for first in range(0, opts.episodes, live):
                wave = range(first, min(first + live, opts.episodes))
                barrier = LockStep(len(wave))
                turns += await asyncio.gather(*(episode(i, barrier) for i in wave))
        else:
            turns = await asyncio.gather(*(in_turn(i) for i in range(opts.episodes)))
        wall = time.perf_counter() - began
    return {
        "wall_s": wall, "engine_s": generator.generate_s - engine_before, "turns": float(sum(turns)),
        "record_s": sum(record_s), "records": float(len(record_s)),
    }  # fmt: skip


def serve_env_worker(registry: str, config: EnvConfig) -> None:
    """The env role's worker, registered with ``registry``, until this process is killed."""
    from workers.env import EnvWorker
    from yatt.runtime.registry import Registration
    from yatt.runtime.transport import Transport, TransportConfig

    async def serve() -> None:
        async with (
            Transport(TransportConfig(hwm=0)) as transport,
            EnvWorker(transport, endpoint="tcp://127.0.0.1:*", config=config) as worker,
            Registration(transport, registry, worker.info()),
        ):
            await asyncio.Event().wait()

    asyncio.run(serve())


async def measure(opts: Options, model_dir: Path, scratch: Path) -> dict[str, list[dict[str, float]]]:
    from transformers import AutoTokenizer

    from benchmarks.trl_agents import TrlEpisodes
    from workers.engines import make_engine
    from workers.generator import Generator
    from yatt.rl.agents.render import Renderer
    from yatt.rl.buffer import Buffer
    from yatt.runtime.registry import Directory, Registry
    from yatt.runtime.transport import Transport, TransportConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    env = EnvConfig(class_="yatt.rl.agents.games:GuessNumber", max_turns=opts.max_turns)
    runner = EpisodeRunner(
        env, Renderer(tokenizer), decode=lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
        eos_ids={tokenizer.eos_token_id}, max_new_tokens=opts.max_new_tokens, context=512,
    )  # fmt: skip
    engine = await asyncio.to_thread(make_engine, str(model_dir), GeneratorConfig())
    trl = await asyncio.to_thread(  # TRL's start-up, before anything is timed
        TrlEpisodes, model_dir, scratch, episodes=opts.live or opts.episodes, max_turns=opts.max_turns,
        max_new_tokens=opts.max_new_tokens, latencies=lambda i: latencies(opts, i), steps=1 + opts.repeats,
    )  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {"yatt": [], "lockstep": [], "record": [], "env_role": [], "trl": []}
    draws = {"latency_ms": opts.latency_ms, "min_ms": opts.min_ms, "max_ms": opts.max_ms, "max_turns": opts.max_turns}
    hosted = EnvConfig(class_="benchmarks.agents:SlowGuess", kwargs={"high": 8, **draws})
    buffer_config = BufferConfig(groups_per_step=1, group_size=1, filter="none")
    try:
        async with (
            Transport(TransportConfig(hwm=0)) as transport,
            Generator(transport, endpoint="tcp://127.0.0.1:*", engine=engine, config=GeneratorConfig()) as generator,
            Buffer(transport, endpoint="tcp://127.0.0.1:*", config=buffer_config, num_prompts=opts.episodes, num_shards=1,
                   world_size=1, seed=0, ledger_path=scratch / "ledger.db") as buffer,
            Registry(transport, endpoint="tcp://127.0.0.1:*", publish_endpoint="tcp://127.0.0.1:*") as registry,
            Directory(transport, registry.endpoint) as directory,
        ):  # fmt: skip

            async def once(mode: str) -> dict[str, float]:
                if mode == "trl":  # (a batch of ``live``, as it would run batch after batch)
                    return {**await asyncio.to_thread(trl.batch), "episodes": float(opts.live or opts.episodes)}
                return await one_mode(
                    mode, opts, runner=runner, generator=generator, buffer=buffer, transport=transport, directory=directory
                )

            # The env role's worker: a process of its own, as in a run (episodes forked from
            # this process would copy TRL's and the model's pages).
            worker = multiprocessing.get_context("spawn").Process(target=serve_env_worker, args=(registry.endpoint, hosted))
            worker.start()
            try:
                await directory.wait_until(lambda d: bool(d.members("env")), timeout=120)
                for mode in ("yatt", "trl", "env_role"):
                    await once(mode)  # warm-up
                for _ in range(opts.repeats):
                    for mode in runs:  # interleaved: a drift of the machine hits every mode alike
                        runs[mode].append(await once(mode))
            finally:
                worker.kill()
                worker.join()
    finally:
        await asyncio.to_thread(trl.close)
    return runs


def run(*, quick: bool = False, options: Mapping[str, object] | None = None) -> Result:
    opts = build(Options, {**(QUICK if quick else {}), **(options or {})})
    torch.set_num_threads(1)
    from workers.models import build_tiny_model

    result = Result()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        runs = asyncio.run(measure(opts, build_tiny_model(scratch / "tiny", seed=0), scratch))
    live = opts.live or opts.episodes  # episodes at once: a turn's time is the wall over the turns each of them took

    def count(r: dict[str, float]) -> float:
        return r.get("episodes", opts.episodes)

    for mode, rows in runs.items():
        result.figures[f"{mode}_episodes_per_s"] = statistics.median(count(r) / r["wall_s"] for r in rows)
        result.figures[f"{mode}_generator_busy_share"] = statistics.median(r["engine_s"] / r["wall_s"] for r in rows)
        result.figures[f"{mode}_turn_s"] = statistics.median(r["wall_s"] * live / r["turns"] for r in rows)
    records = runs["record"]
    per_record = statistics.median(r["record_s"] / max(r["records"], 1) for r in records)
    result.figures["record_s_per_turn"] = per_record
    added = statistics.median((r["wall_s"] - y["wall_s"]) / r["turns"] * live for r, y in zip(records, runs["yatt"], strict=True))
    result.figures["record_added_s_per_turn"] = added
    result.figures["trl_step_s"] = statistics.median(r["step_s"] for r in runs["trl"])
    result.ratios["yatt_vs_lockstep"] = result.figures["yatt_episodes_per_s"] / result.figures["lockstep_episodes_per_s"]
    result.ratios["yatt_vs_trl"] = result.figures["yatt_episodes_per_s"] / result.figures["trl_episodes_per_s"]
    result.ratios["env_role_vs_inline"] = result.figures["env_role_episodes_per_s"] / result.figures["yatt_episodes_per_s"]
    result.ratios["record_cost_share"] = max(per_record, 1e-9) / result.figures["yatt_turn_s"]
    result.notes.append(
        f"{opts.episodes} episodes ({opts.live or opts.episodes} live at once) x {opts.max_turns} turns, "
        f"{opts.max_new_tokens} new tokens a turn, step latency lognormal "
        f"median {opts.latency_ms:g} ms in [{opts.min_ms:g}, {opts.max_ms:g}] ms; {opts.repeats} interleaved repeats, medians"
    )
    result.notes.append(
        "env_role: yatt's mode with each episode's environment in an env worker (workers.env), a process of its own per "
        "episode, through the controller's RemoteEnv: what isolating user environments costs (env_role_vs_inline)"
    )
    result.notes.append(
        "record_cost_share: one TurnRecord's round trip to the buffer (its ledger commit) over the time an episode's turn "
        "takes (wall x live episodes / turns); record_added_s_per_turn: what recording added to that turn time, measured"
    )
    result.notes.append(
        "trl: TRL's GRPOTrainer (environment_factory, its own loop and HF generate), episodes/s from its rollout "
        "(_generate: generation and environment steps; scoring and training excluded, start-up and a warm-up batch "
        f"before timing); {opts.max_turns} turns but {opts.max_turns - 1} steps an episode (its loop does not step after "
        "the last turn); each turn's steps run one episode after another; trl_step_s: its whole optimizer step"
    )
    return result
