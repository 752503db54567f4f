"""The scorers of the reward worker and their weighted mix, each under a time limit.

The reward actor (``workers/reward/worker.py``) owns one ``RewardMix``. For a batch of decoded
samples it runs every configured scorer and returns, per sample, the weighted sum of the
scores, every raw score, and why any scorer failed (a failed score counts as 0)::

    ScoreInput x B --+-- rules: math_verify, exact_match,  one call per (sample, rule) in a
                     |   format_regex, reasoning_gym,      process pool, each under timeout_s
                     |   custom
                     +-- reward_model                      one thread call per batch, micro-
                     |                                     batched forwards, under timeout_s
                     +-- judge                             one thread call per batch (k sampled
                     |                                     verdicts per sample), under timeout_s
                     v
    ScoreResult x B: reward = sum_i weight_i * score_i, components, failure reasons

Why processes for rules: they are synchronous, and a rule can hang where no signal or
exception reaches it (a regex that backtracks forever, a sympy simplification in C, a
user's function). Only a process can be stopped from outside, so a sample past its limit
kills its pool; a fresh pool is started and warmed up (imports done) before any new
timer starts, and the samples that were in flight on the killed pool are re-submitted with
a fresh limit. Each timed-out sample kills at most one pool, so a batch always ends. A
process that dies by itself (os._exit, a segfault) breaks the pool too: the samples it took
down are re-run alone, one at a time, so only the one that crashes again fails.

A batch goes to the pool as one call per process (a round trip costs ~0.5-1 ms here, about
what the whole batch of a rule costs to score), each call scoring its samples in turn. The
limit is still per sample: before each sample the process writes the sample's start into
memory shared with the reward worker, which kills the pool when the running sample has
run past ``timeout_s`` from its start; a sample that ended past its limit before that was
seen fails the same way. At most ``processes`` calls are in flight, so a sample's timer
runs while it runs, not while it queues. math-verify arms SIGALRM for its own limits,
which only works in a main thread: a pool process runs its calls in its main thread.

Why threads for models: a model forward does not hang the way a rule does, and its
weights cannot be shared with a process pool. One call runs at a time; the batches that
arrive meanwhile go into the next call together (up to ``max_batch`` samples). The time
limit applies to each batch's wait and call; a thread cannot be stopped, so a call past
its limit runs on and its result is dropped, and a waiting batch whose deadline has
already passed is skipped, not run.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import importlib
import inspect
import itertools
import json
import math
import multiprocessing
import numbers
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from workers.reward.score_types import Outcome, ScoreInput, ScoreResult
from yatt.errors import ActorFailed, Closed, ConfigError
from yatt.rl.config import RewardConfig, ScorerConfig
from yatt.runtime import trace
from yatt.runtime.lifetime import die_with_parent
from yatt.runtime.plugins import load_plugin

FAILURE_WINDOW = 64
"""The samples per scorer that reward.max_failure_share is judged over."""
FAILURE_MIN_SAMPLES = 16
"""No scorer stops the run on fewer samples than this."""

if TYPE_CHECKING:
    from multiprocessing.synchronize import Barrier

_STARTUP_TIMEOUT_S = 300.0
"""How long a fresh pool may take to start its processes and import the rules' modules."""


# ---------------------------------------------------------------- rules (run in the pool)


class Rule(Protocol):
    """A synchronous per-sample scorer; picklable, so that the pool processes can run it."""

    def prepare(self) -> None:
        """Import what the rule needs; runs once in each pool process before any call."""
        ...

    def __call__(self, sample: ScoreInput) -> float:
        """The sample's score; raises with a clear message when it cannot score."""
        ...


def final_answer(text: str) -> str:
    r"""The answer a completion ends with, for exact matching, stripped of whitespace.

    In order: the contents of the last ``\boxed{...}`` (braces balanced); else the rest of
    the line after the last "Answer:" (any case); else the whole text.
    """
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, begin = 0, start + len("\\boxed{")
        for pos in range(begin, len(text)):
            if text[pos] == "{":
                depth += 1
            elif text[pos] == "}":
                if depth == 0:
                    return text[begin:pos].strip()
                depth -= 1
    matches = list(re.finditer(r"answer:", text, re.IGNORECASE))
    if matches:
        return text[matches[-1].end() :].split("\n", 1)[0].strip()
    return text.strip()


def _reference(sample: ScoreInput, key: str) -> str:
    if key not in sample.metadata:
        raise KeyError(
            f"metadata has no {key!r} (it has {sorted(sample.metadata)}); "
            "set answer_key to the field holding the reference answer"
        )
    return sample.metadata[key]


@dataclass(frozen=True)
class MathVerify:
    """1.0 if math-verify finds the completion's final answer equal to the reference."""

    answer_key: str

    def prepare(self) -> None:
        importlib.import_module("math_verify")

    def __call__(self, sample: ScoreInput) -> float:
        from math_verify import parse, verify

        reference = _reference(sample, self.answer_key)
        # A bare reference ("0.5", "x+1") parses only as LaTeX math; wrap it in $...$.
        wrapped = reference if "$" in reference or "\\boxed" in reference else f"${reference}$"
        gold = parse(wrapped)
        if not gold:
            raise ValueError(f"math-verify cannot parse the reference answer {reference!r}")
        return 1.0 if verify(gold, parse(sample.completion)) else 0.0


@dataclass(frozen=True)
class ExactMatch:
    """1.0 if the completion's ``final_answer`` equals the stripped reference."""

    answer_key: str

    def prepare(self) -> None:
        return None

    def __call__(self, sample: ScoreInput) -> float:
        return 1.0 if final_answer(sample.completion) == _reference(sample, self.answer_key).strip() else 0.0


@dataclass(frozen=True)
class FormatRegex:
    """1.0 if ``re.search(pattern, completion, re.DOTALL)`` matches."""

    pattern: str

    def prepare(self) -> None:
        return None

    def __call__(self, sample: ScoreInput) -> float:
        return 1.0 if re.search(self.pattern, sample.completion, re.DOTALL) else 0.0


@functools.cache
def _gym_score_fn(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    import reasoning_gym

    # Builds the task's dataset with its default config once per process: only its
    # score_answer is used, which reads everything else from the entry.
    score_answer: Callable[[str | None, dict[str, Any]], float] = reasoning_gym.get_score_answer_fn(task)
    return score_answer


@dataclass(frozen=True)
class ReasoningGym:
    """The task's own ``score_answer`` on the completion's last ``<answer>...</answer>``.

    metadata["entry"] is the dataset entry as JSON; the task is metadata["task"], else the
    entry's ``metadata.source_dataset``. No answer tags: the task scores ``None``.
    """

    def prepare(self) -> None:
        importlib.import_module("reasoning_gym")

    def __call__(self, sample: ScoreInput) -> float:
        from reasoning_gym.utils import extract_answer

        raw = sample.metadata.get("entry")
        if raw is None:
            raise KeyError("metadata has no 'entry' (the reasoning-gym dataset entry as JSON)")
        entry = json.loads(raw)
        task = sample.metadata.get("task") or entry.get("metadata", {}).get("source_dataset")
        if not task:
            raise KeyError("metadata has no 'task' and the entry has no metadata.source_dataset")
        return float(_gym_score_fn(task)(extract_answer(sample.completion), entry))


_CUSTOM_SCORER = (
    "a function f(prompt, completion, metadata) -> float, or TRL's f(prompts, completions, **kwargs) -> "
    "list[float], importable from the reward worker's Python path"
)
"""What ``reward.scorers[i].function`` must name, for ``load_plugin``'s errors."""


@functools.cache
def load_function(path: str) -> Callable[..., object]:
    """A custom scorer's function, imported once per process (it is called per sample).
    ``_rule`` has loaded it before, naming the scorer's field in any error."""
    return load_plugin(path, field="reward.scorers[*].function", expects=_CUSTOM_SCORER)


TRL_ARGUMENTS = ("prompts", "completions")
"""What a TRL-style reward function is given besides the prompt's metadata fields."""


def reward_signature(fn: Callable[..., object]) -> Literal["sample", "trl"]:
    """How a custom reward function is called: yatt's ``f(prompt, completion, metadata) ->
    float`` per sample, or TRL's ``f(prompts, completions, **kwargs) -> list[float]`` (its
    dataset columns, here the prompt's metadata fields, as keyword lists; no completion_ids,
    which scorers do not see). TypeError naming
    both otherwise."""
    params = inspect.signature(fn).parameters
    if "completions" in params:
        return "trl"
    positional = [
        p for p in params.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]  # fmt: skip
    if len(positional) == 3 or (len(positional) < 3 and any(p.kind == p.VAR_POSITIONAL for p in params.values())):
        return "sample"
    raise TypeError(
        f"its signature is ({', '.join(str(p.replace(annotation=p.empty)) for p in params.values())}); a custom scorer is f(prompt, completion, metadata) -> float, "
        "or TRL's f(prompts, completions, **kwargs) -> list[float] (kwargs: the prompt's metadata fields)"
    )


def trl_arguments_missing(fn: Callable[..., object], fields: set[str]) -> list[str]:
    """The parameters a TRL-style function requires that neither TRL's arguments nor the
    metadata ``fields`` provide."""
    return [
        name for name, p in inspect.signature(fn).parameters.items()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and name not in TRL_ARGUMENTS and name not in fields
    ]  # fmt: skip


@dataclass(frozen=True)
class Custom:
    """A user function, sync or async: ``f(prompt, completion, metadata) -> float``, or
    TRL's ``f(prompts, completions, **kwargs) -> list[float]`` called with one sample
    (a None score, TRL's "does not apply", counts 0).

    An async one runs in the pool too (under ``asyncio.run``): a coroutine that blocks its
    event loop would otherwise stall the reward worker.
    """

    function: str
    style: Literal["sample", "trl"] = "sample"

    def prepare(self) -> None:
        load_function(self.function)

    def __call__(self, sample: ScoreInput) -> float:
        fn = load_function(self.function)
        value: object
        if self.style == "trl":
            value = fn(**self._trl_kwargs(fn, sample))
            if asyncio.iscoroutine(value):
                value = asyncio.run(value)
            if not isinstance(value, Sequence) or len(value) != 1:
                raise TypeError(f"{self.function} returned {value!r}; a TRL-style reward returns one score per completion")
            value = 0.0 if value[0] is None else value[0]
        else:
            value = fn(sample.prompt, sample.completion, dict(sample.metadata))
            if asyncio.iscoroutine(value):
                value = asyncio.run(value)
        if not isinstance(value, numbers.Real):
            raise TypeError(f"{self.function} returned {value!r}; a custom scorer must return a float")
        return float(value)

    @staticmethod
    def _trl_kwargs(fn: Callable[..., object], sample: ScoreInput) -> dict[str, object]:
        given: dict[str, object] = {k: [v] for k, v in sample.metadata.items()}
        given.update(prompts=[sample.prompt], completions=[sample.completion])
        accepted = _keyword_names(fn)
        return given if accepted is None else {k: v for k, v in given.items() if k in accepted}


@functools.cache
def _keyword_names(fn: Callable[..., object]) -> frozenset[str] | None:
    """The keywords ``fn`` takes; None when it takes any (``**kwargs``). Once per function,
    not once per scored sample."""
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(params)


def check_custom_scorers(config: RewardConfig, fields: set[str]) -> None:
    """Before anything starts: every custom scorer imports and has a signature it can be
    called with, given the prompts' metadata ``fields``; ConfigError naming the scorer."""
    for i, sc in enumerate(config.scorers):
        if sc.kind == "custom":
            rule = _rule(sc, f"reward.scorers[{i}]")
            assert isinstance(rule, Custom)
            missing = trl_arguments_missing(load_function(sc.function), fields) if rule.style == "trl" else []
            if missing:
                raise ConfigError(
                    f"reward.scorers[{i}].function = {sc.function!r} needs {missing}, which the prompts do not have "
                    f"(their metadata fields: {sorted(fields)}; TRL's arguments: {list(TRL_ARGUMENTS)}); map the "
                    "data column to it (data.answer_field) or give the parameter a default"
                )


_PROGRESS: Any = None
"""In a pool process: the memory shared with its pool's owner, per call slot the start of
the sample being scored (``monotonic``, system-wide on Linux) and its index in the call."""


def _init_process(rules: tuple[Rule, ...], barrier: Barrier, forked: bool, parent: int, progress: Any) -> None:
    global _PROGRESS
    _PROGRESS = progress
    die_with_parent(parent)  # an idle pool process would wait on its queue forever
    if forked:  # it has its reward worker's command line, which tools (ps, the benchmarks) take for the worker
        with contextlib.suppress(ImportError):
            from setproctitle import setproctitle

            setproctitle(f"yatt scorer process of pid {os.getppid()}")
    for rule in rules:
        rule.prepare()
    # Every process of the pool is up and has imported everything before any call runs.
    barrier.wait(_STARTUP_TIMEOUT_S)


def _kill(executor: concurrent.futures.ProcessPoolExecutor, *, wait: bool = False) -> None:
    # A busy ProcessPoolExecutor cannot be stopped through its API before Python 3.14's
    # kill_workers(); its pid -> Process map is the only way to reach the processes.
    for process in list((executor._processes or {}).values()):
        process.kill()
    executor.shutdown(wait=wait, cancel_futures=True)


_Scored = tuple[float, str, str, float]
"""A sample scored in a pool process: its score, failure, traceback and seconds taken."""


def _score_each(rule: Rule, samples: Sequence[ScoreInput], slot: int) -> list[_Scored]:
    """In a pool process: ``rule`` on each sample in turn, the sample's start written to the
    shared slot before it runs (its start first, then its index: the owner reads the start
    to judge the limit, and the index only once the sample has hung in place)."""
    scored: list[_Scored] = []
    for index, sample in enumerate(samples):
        start = time.monotonic()
        _PROGRESS[2 * slot] = start
        _PROGRESS[2 * slot + 1] = index
        try:
            scored.append((float(rule(sample)), "", "", time.monotonic() - start))
        except Exception as e:  # any error of a scorer is this sample's failure, recorded
            failure = f"{type(e).__name__}: {e}"
            scored.append((0.0, failure, "".join(traceback.format_exception(e)), time.monotonic() - start))
    return scored


class _Hung(Exception):
    """A call's sample ``index`` ran past its limit; the call's pool was killed."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


class _Crashed(Exception):
    """A pool process died under a call (not killed by the pool)."""


class ScorerPool:
    """Rule calls in worker processes; a sample past its limit kills and replaces the pool."""

    def __init__(self, rules: tuple[Rule, ...], processes: int) -> None:
        self._rules = rules
        self._processes = processes
        self._executor, self._progress = self._start()
        self._generation = 0
        self._killed: set[int] = set()  # generations killed on purpose (a sample hung)
        self._slots = asyncio.Semaphore(processes)
        self._free = list(range(processes))  # the progress slots of the calls not in flight
        self._restart = asyncio.Lock()
        self._isolated = asyncio.Lock()  # held by a sample re-run alone after a crash

    def _start(self) -> tuple[concurrent.futures.ProcessPoolExecutor, Any]:
        """A new pool with every process started and warm (blocks until then), and the
        memory its calls write their progress into.

        Forked while no Python thread but this one runs (~20 ms here, the rules' modules
        imported once, before the fork), else spawned (~1.8 s: a fresh interpreter imports
        them): a fork copies only the calling thread, and a lock another thread held stays
        held in the child for good. ``launch.role`` makes a reward worker's mix before its
        ZeroMQ context, event loop and tracing start threads. The native thread pools that
        numpy's and torch's imports start are fork-safe (they re-arm in the child).
        """
        method = "fork" if sys.platform == "linux" and threading.active_count() == 1 else "spawn"
        if method == "fork":
            for rule in self._rules:
                rule.prepare()
        context = multiprocessing.get_context(method)
        barrier = context.Barrier(self._processes)
        progress = context.RawArray("d", 2 * self._processes)  # a pool of its own: no write of a killed one lands
        executor = concurrent.futures.ProcessPoolExecutor(
            self._processes, mp_context=context, initializer=_init_process,
            initargs=(self._rules, barrier, method == "fork", os.getpid(), progress),
        )  # fmt: skip
        # No process is idle before all have passed the barrier, so each submit spawns one.
        probes = [executor.submit(time.monotonic) for _ in range(self._processes)]
        try:
            for probe in concurrent.futures.as_completed(probes, timeout=_STARTUP_TIMEOUT_S):
                probe.result()
        except (BrokenProcessPool, concurrent.futures.TimeoutError) as e:
            _kill(executor)
            raise ActorFailed(
                f"the scorer pool did not start ({type(e).__name__}: {e}); its processes import the "
                "rules' modules (math_verify, reasoning_gym, custom functions): check that they import"
            ) from e
        return executor, progress

    async def _replace(self, generation: int, *, killed: bool) -> None:
        """Kill and replace the pool of ``generation``, unless that was done already."""
        async with self._restart:
            if generation != self._generation:
                return
            if killed:
                self._killed.add(generation)
            _kill(self._executor)
            self._executor, self._progress = await asyncio.to_thread(self._start)
            self._generation += 1

    async def score(self, rule: Rule, samples: Sequence[ScoreInput], timeout_s: float) -> list[Outcome]:
        """``rule`` on every sample, each under ``timeout_s``: one call per pool process,
        each taking an equal share of the samples in order."""
        if not samples:
            return []
        calls = min(self._processes, len(samples))
        bounds = [round(i * len(samples) / calls) for i in range(calls + 1)]
        parts = await asyncio.gather(
            *(self._call(rule, samples[lo:hi], timeout_s) for lo, hi in itertools.pairwise(bounds))
        )
        return [outcome for part in parts for outcome in part]

    async def _call(self, rule: Rule, samples: Sequence[ScoreInput], timeout_s: float) -> list[Outcome]:
        if not samples:
            return []
        async with self._slots:
            slot = self._free.pop()
            try:
                scored = await self._attempt(rule, samples, timeout_s, slot)
                return [_outcome(s, timeout_s) for s in scored]
            except _Hung as hung:
                index = hung.index
            except _Crashed:
                index = -1
            except Exception as e:  # the call itself failed (e.g. a sample that does not pickle)
                return [_failed(e)] * len(samples)
            finally:
                self._free.append(slot)
        if index >= 0:  # the rest of the call goes to the fresh pool, with fresh limits
            before, after = await asyncio.gather(
                self._call(rule, samples[:index], timeout_s), self._call(rule, samples[index + 1 :], timeout_s)
            )
            return [*before, Outcome(0.0, f"timed out after {timeout_s}s"), *after]
        # A process died under this call or under one beside it: its samples, alone, tell.
        return [await self._alone(rule, sample, timeout_s) for sample in samples]

    async def _alone(self, rule: Rule, sample: ScoreInput, timeout_s: float) -> Outcome:
        """``sample`` with no other call in flight; ActorFailed if its process dies again."""
        async with self._isolated:
            held = 0
            try:
                for _ in range(self._processes):
                    await self._slots.acquire()
                    held += 1
                [scored] = await self._attempt(rule, [sample], timeout_s, 0)
                return _outcome(scored, timeout_s)
            except _Hung:
                return Outcome(0.0, f"timed out after {timeout_s}s")
            except _Crashed:
                return _failed(ActorFailed("its pool process died running it alone (os._exit, a segfault, out of memory)"))
            except Exception as e:
                return _failed(e)
            finally:
                for _ in range(held):
                    self._slots.release()

    async def _attempt(self, rule: Rule, samples: Sequence[ScoreInput], timeout_s: float, slot: int) -> list[_Scored]:
        """One call, again if another call's hang killed the pool; ``_Hung`` when a sample
        runs past its limit (the pool is replaced), ``_Crashed`` if a process died."""
        while True:
            async with self._restart:  # wait out a restart in progress
                generation, executor, progress = self._generation, self._executor, self._progress
            progress[2 * slot] = time.monotonic()  # the first sample's limit runs from here
            progress[2 * slot + 1] = 0
            try:
                with trace.span("pool_round_trip"):  # the samples pickled out, scored, the scores back
                    future = asyncio.wrap_future(executor.submit(_score_each, rule, samples, slot))
                    while not future.done():
                        left = progress[2 * slot] + timeout_s - time.monotonic()
                        if left > 0:
                            await asyncio.wait({future}, timeout=left)
                            continue
                        index = min(int(progress[2 * slot + 1]), len(samples) - 1)
                        future.cancel()
                        await self._replace(generation, killed=True)
                        raise _Hung(index)
                return future.result()
            except BrokenProcessPool:
                await self._replace(generation, killed=False)
                if generation not in self._killed:
                    raise _Crashed from None

    def close(self) -> None:
        _kill(self._executor, wait=True)


def _outcome(scored: _Scored, timeout_s: float) -> Outcome:
    score, failure, detail, seconds = scored
    if seconds > timeout_s:  # ended past its limit before the pool's owner saw it run on
        return Outcome(0.0, f"timed out after {timeout_s}s")
    return Outcome(0.0, failure, detail) if failure else _checked(score)


def _failed(e: BaseException) -> Outcome:
    return Outcome(0.0, f"{type(e).__name__}: {e}", "".join(traceback.format_exception(e)))


class _PooledRule:
    """Runs one rule on a batch in the shared pool."""

    def __init__(self, rule: Rule, pool: ScorerPool) -> None:
        self._rule = rule
        self._pool = pool

    async def score(self, batch: Sequence[ScoreInput], timeout_s: float) -> list[Outcome]:
        return await self._pool.score(self._rule, batch, timeout_s)

    def close(self) -> None:
        return None


def _checked(score: float) -> Outcome:
    if not math.isfinite(score):
        return Outcome(0.0, f"score is {score}, not a finite number")
    return Outcome(score)


# ---------------------------------------------------------------- models (run in a thread)


class BatchModel(Protocol):
    """A model scorer: scores a whole batch at once, synchronously, in a worker thread."""

    def __call__(self, batch: Sequence[ScoreInput]) -> list[Outcome]: ...

    def close(self) -> None: ...


@dataclass
class _Waiting:
    """A batch waiting for a model scorer's next call."""

    batch: Sequence[ScoreInput]
    deadline: float
    result: asyncio.Future[list[Outcome]]


def _settle(waiting: _Waiting, outcomes: list[Outcome] | None = None, *, error: Exception | None = None) -> None:
    """Hand a batch its outcomes or its error, unless its caller gave up meanwhile (a
    cancelled future takes neither)."""
    if waiting.result.done():
        return
    if error is not None:
        waiting.result.set_exception(error)
    else:
        assert outcomes is not None
        waiting.result.set_result(outcomes)


class _ThreadedModel:
    """Runs a model in a thread, one call at a time, under a time limit. The batches that
    arrive while a call runs (other groups being scored) go into the next call together,
    up to ``max_batch`` samples: one judge or reward-model call scores many groups, as a
    generator batches its requests (a call has a fixed cost: 16 groups of 8 cost 16 calls
    of the tiny judge one at a time, ~0.25 s here)."""

    def __init__(self, model: BatchModel, max_batch: int) -> None:
        self._model = model
        self._max_batch = max_batch
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._calling: list[_Waiting] = []  # in the model call now
        self._runner: asyncio.Task[None] | None = None

    async def score(self, batch: Sequence[ScoreInput], timeout_s: float) -> list[Outcome]:
        waiting = _Waiting(batch, time.monotonic() + timeout_s, asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.ensure_future(self._run_calls())
        try:
            outcomes = await asyncio.wait_for(asyncio.shield(waiting.result), timeout_s)
        except asyncio.TimeoutError:
            waiting.result.cancel()  # skipped if it still waits; its outcomes dropped if its call runs
            return [Outcome(0.0, f"timed out after {timeout_s}s (whole batch)")] * len(batch)
        except Exception as e:  # a failed forward fails this batch only, recorded
            return [Outcome(0.0, f"{type(e).__name__}: {e}", "".join(traceback.format_exception(e)))] * len(batch)
        assert len(outcomes) == len(batch), "a model scorer returns one outcome per sample"
        return [_checked(o.score) if not o.failure else o for o in outcomes]

    async def _run_calls(self) -> None:
        """Call the model on what waits, until nothing does. A call whose caller gave up
        (its deadline passed while it waited) is skipped; a merged call that raises is
        run again batch by batch, so that only the batch it fails on fails."""
        try:
            while self._waiting:
                take = [self._waiting.popleft()]
                samples = len(take[0].batch)
                while self._waiting and samples + len(self._waiting[0].batch) <= self._max_batch:
                    samples += len(self._waiting[0].batch)
                    take.append(self._waiting.popleft())
                now = time.monotonic()
                live = [w for w in take if w.deadline > now and not w.result.done()]
                self._calling = live
                try:
                    outcomes = await asyncio.to_thread(self._model, [s for w in live for s in w.batch]) if live else []
                except Exception as e:
                    if len(live) == 1:
                        _settle(live[0], error=e)
                        continue
                    for w in live:
                        await self._run_alone(w)
                    continue
                start = 0
                for w in live:
                    _settle(w, outcomes[start : start + len(w.batch)])
                    start += len(w.batch)
        finally:  # cancelled with the actor: no caller waits for good, nor to its time limit
            for w in [*self._calling, *self._waiting]:
                if not w.result.done():
                    w.result.set_exception(Closed("the scorer stopped"))
            self._calling = []

    async def _run_alone(self, waiting: _Waiting) -> None:
        if waiting.deadline <= time.monotonic() or waiting.result.done():
            return
        try:
            _settle(waiting, await asyncio.to_thread(self._model, waiting.batch))
        except Exception as e:
            _settle(waiting, error=e)

    def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
        self._model.close()


# ---------------------------------------------------------------- the mix


class _Scorer(Protocol):
    async def score(self, batch: Sequence[ScoreInput], timeout_s: float) -> list[Outcome]: ...

    def close(self) -> None: ...


def _rule(config: ScorerConfig, field: str) -> Rule:
    if config.kind == "math_verify":
        return MathVerify(config.answer_key)
    if config.kind == "exact_match":
        return ExactMatch(config.answer_key)
    if config.kind == "format_regex":
        try:
            re.compile(config.pattern, re.DOTALL)
        except re.error as e:
            raise ConfigError(f"{field}.pattern = {config.pattern!r} is not a valid regex ({e})") from None
        return FormatRegex(config.pattern)
    if config.kind == "reasoning_gym":
        return ReasoningGym()
    assert config.kind == "custom", config.kind
    fn = load_plugin(config.function, field=f"{field}.function", expects=_CUSTOM_SCORER)
    try:
        return Custom(config.function, reward_signature(fn))
    except TypeError as e:
        raise ConfigError(f"{field}.function = {config.function!r}: {e}") from None


class RewardMix:
    """The weighted mix of the configured scorers, each under the per-sample time limit."""

    def __init__(self, config: RewardConfig, *, tokenizer_path: str | None = None) -> None:
        """Import, load and start every scorer, the pool's processes warm.

        A bad field raises ``ConfigError`` naming it. ``tokenizer_path``: the tokenizer for a
        model scorer whose directory holds none (e.g. the policy's).
        """
        self._config = config
        self._closed = False
        self._names: list[str] = []
        self._weights: list[float] = []
        self._recent: dict[str, collections.deque[bool]] = {}  # scorer -> failed?, its last samples
        self._last_error: dict[str, str] = {}  # scorer -> its last failure, with the traceback
        rules: dict[int, Rule] = {}
        for i, sc in enumerate(config.scorers):
            name = sc.name or sc.kind
            if name in self._names:
                raise ConfigError(
                    f"reward.scorers[{i}].name {name!r} is already used by reward.scorers[{self._names.index(name)}]; "
                    "give each scorer a distinct name"
                )
            self._names.append(name)
            self._weights.append(sc.weight)
            self._recent[name] = collections.deque(maxlen=FAILURE_WINDOW)
            if sc.kind not in ("reward_model", "judge"):
                rules[i] = _rule(sc, f"reward.scorers[{i}]")
        self._scorers: list[_Scorer] = []
        self._pool = ScorerPool(tuple(rules.values()), config.processes) if rules else None
        try:
            for i, sc in enumerate(config.scorers):
                if i in rules:
                    assert self._pool is not None
                    self._scorers.append(_PooledRule(rules[i], self._pool))
                else:
                    self._scorers.append(
                        _ThreadedModel(self._model(sc, f"reward.scorers[{i}]", tokenizer_path), config.max_batch)
                    )
        except BaseException:
            self.close()
            raise

    def _model(self, config: ScorerConfig, field: str, tokenizer_path: str | None) -> BatchModel:
        if config.kind == "reward_model":
            from workers.reward.model_scorers import RewardModel

            return RewardModel(
                config.model_path, tokenizer_path=tokenizer_path, batch_size=config.batch_size, field=field
            )
        assert config.kind == "judge", config.kind
        from workers.reward.model_scorers import Judge

        return Judge(config, tokenizer_path=tokenizer_path, field=field)

    async def score(self, batch: Sequence[ScoreInput]) -> list[ScoreResult]:
        """Score every sample by every scorer; at most ``max_batch`` samples per scorer call."""
        if self._closed:
            raise Closed("RewardMix is closed")
        results: list[ScoreResult] = []
        for start in range(0, len(batch), self._config.max_batch):
            results.extend(await self._score_chunk(batch[start : start + self._config.max_batch]))
        return results

    async def _score_chunk(self, batch: Sequence[ScoreInput]) -> list[ScoreResult]:
        timeout_s = self._config.timeout_s
        # [S scorers][B samples]
        columns = await asyncio.gather(*(scorer.score(batch, timeout_s) for scorer in self._scorers))
        results = []
        for row in zip(*columns, strict=True):
            for name, outcome in zip(self._names, row, strict=True):
                self._recent[name].append(bool(outcome.failure))
                if outcome.failure:
                    self._last_error[name] = outcome.detail or outcome.failure
            components = {name: outcome.score for name, outcome in zip(self._names, row, strict=True)}
            failures = [f"{name}: {o.failure}" for name, o in zip(self._names, row, strict=True) if o.failure]
            reward = sum(w * o.score for w, o in zip(self._weights, row, strict=True))
            results.append(ScoreResult(reward=reward, components=components, failure="; ".join(failures)))
        return results

    def failing(self) -> str:
        """Why the run should stop: a scorer failing on more than reward.max_failure_share
        of its last samples (at least FAILURE_MIN_SAMPLES of them), with its last error; ""
        while none is."""
        share = self._config.max_failure_share
        for i, name in enumerate(self._names):
            recent = self._recent[name]
            failed = sum(recent)
            if len(recent) >= FAILURE_MIN_SAMPLES and failed > share * len(recent):
                sc = self._config.scorers[i]
                what = f"{sc.kind} {sc.function}" if sc.kind == "custom" else sc.kind
                return (
                    f"reward scorer {name!r} ({what}) failed on {failed} of its last {len(recent)} samples "
                    f"(reward.max_failure_share = {share}); fix it, or raise reward.max_failure_share to go on "
                    f"scoring failures as 0. Its last error:\n{self._last_error.get(name, '').rstrip()}"
                )
        return ""

    def close(self) -> None:
        """Stop the pool's processes and free the models."""
        self._closed = True
        for scorer in self._scorers:
            scorer.close()
        self._scorers = []
        if self._pool is not None:
            self._pool.close()
            self._pool = None
