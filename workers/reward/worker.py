"""The reward role: scores groups of completions with the configured mix of scorers.

Token ids arrive (token in, token out); the worker decodes them with the policy's
tokenizer only to hand text to the scorers, which see prompt, completion, the prompt's
metadata (e.g. the reference answer) and the finish reason. The mix runs each scorer
under a per-sample time limit (``workers.reward.scorers``), so a scorer that hangs or raises
scores that sample as failed, with the reason in ``Scores.failures``, and the worker
goes on serving, until one scorer fails on more than ``reward.max_failure_share`` of its
last samples: then it stops the run with the scorer's error and traceback (a reward that
always fails would otherwise train on zeros and look like a model that does not learn).

``reward/busy_s`` (its ``stats``) is the time the worker had at least one group to score:
the launcher's re-planning reads the pool's busy time from it each step. ``YATT_SLOW_REWARD``
injects a workload shift for tests and benchmarks (``yatt.runtime.trace.reward_slowdown``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from protocols.messages import Message, Metrics, Query, ScoreRequest, Scores
from workers.reward.score_types import ScoreInput
from workers.reward.scorers import RewardMix
from yatt.errors import ProtocolError, RunStopped
from yatt.rl.config import RewardConfig
from yatt.runtime import trace
from yatt.runtime.actor import Actor, handles
from yatt.runtime.transport import Transport

SLOW_ENV = trace.SLOW_REWARD_ENV


def load_decoder(tokenizer_path: str) -> Callable[[list[int]], str]:
    """The text of token ids as the policy's tokenizer decodes them (special tokens skipped).
    The ``tokenizers`` library on the directory's ``tokenizer.json``: what transformers' fast
    tokenizer calls, without importing transformers (~5 s of a reward worker's start here);
    transformers' ``AutoTokenizer`` where there is no ``tokenizer.json`` or its config asks
    transformers to clean up spaces after decoding."""
    path = Path(tokenizer_path)
    settings = json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").is_file() else {}
    if (path / "tokenizer.json").is_file() and not settings.get("clean_up_tokenization_spaces", False):
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(path / "tokenizer.json"))
        return lambda ids: fast.decode(ids, skip_special_tokens=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))


class Reward(Actor):
    """Serves ScoreRequests with a ``RewardMix``."""

    role = "reward"

    def __init__(
        self,
        transport: Transport,
        *,
        endpoint: str,
        config: RewardConfig,
        tokenizer_path: str,
        actor_id: str | None = None,
        slow: trace.SlowDown | None = None,
        mix: RewardMix | None = None,
    ) -> None:
        """``mix``: the scorers, made already (``launch.role`` makes them before its first
        thread starts, so that the pool forks); made here from ``config`` by default."""
        super().__init__(transport, endpoint=endpoint, actor_id=actor_id)
        self.decode = load_decoder(tokenizer_path)
        self.mix = mix if mix is not None else RewardMix(config, tokenizer_path=tokenizer_path)
        self.score_s = 0.0
        self.samples = 0
        self.failures = 0
        self.groups = 0
        self.busy_s = 0.0  # time with at least one group being scored (not summed over overlaps)
        self._active = 0
        self._busy_since = 0.0
        self._slow = slow
        self._slow_lock = asyncio.Lock()
        self._stopping = False

    async def _stop_with(self, error: BaseException) -> None:
        """Fail the worker with ``error`` (a task that raises closes the actor; its process
        exits with RUN_STOPPED_EXIT and the launcher stops the run with the message)."""
        raise error

    @handles(ScoreRequest)
    async def score(self, msg: ScoreRequest) -> Scores:
        if len(msg.finish_reasons) != len(msg.completion_ids):
            raise ProtocolError(
                f"ScoreRequest has {len(msg.completion_ids)} completions but {len(msg.finish_reasons)} finish reasons"
            )
        prompt, completions = await asyncio.to_thread(self._decode, msg)
        inputs = [
            ScoreInput(prompt=prompt, completion=text, metadata=msg.metadata, finish_reason=reason)
            for text, reason in zip(completions, msg.finish_reasons, strict=True)
        ]
        start = time.perf_counter()
        if not self._active:
            self._busy_since = start
        self._active += 1
        try:
            with trace.span("score"):
                results = await self.mix.score(inputs)
                if self._slow is not None and self._slow.active(self.groups):
                    async with self._slow_lock:
                        await asyncio.sleep(self._slow.seconds)
        finally:
            self._active -= 1
            if not self._active:
                self.busy_s += time.perf_counter() - self._busy_since
        self.score_s += time.perf_counter() - start
        self.groups += 1
        self.samples += len(results)
        self.failures += sum(bool(r.failure) for r in results)
        failing = self.mix.failing()
        if failing and not self._stopping:  # a broken scorer must not look like a model that does not learn
            self._stopping = True
            self.spawn(self._stop_with(RunStopped(failing)), name="failing scorer")
        names = list(results[0].components) if results else []
        return Scores(
            group_key=msg.group_key,
            rewards=torch.tensor([r.reward for r in results], dtype=torch.float32),
            components={n: torch.tensor([r.components[n] for r in results], dtype=torch.float32) for n in names},
            failures=[r.failure for r in results],
        )

    def _decode(self, msg: ScoreRequest) -> tuple[str, list[str]]:
        prompt = self.decode(msg.prompt_ids.tolist())
        texts = [self.decode(ids.tolist()) for ids in msg.completion_ids]
        return prompt, texts

    @handles(Query)
    async def query(self, msg: Query) -> Message:
        if msg.what == "stats":
            return Metrics(
                values={
                    "reward/score_s": self.score_s,
                    "reward/busy_s": self.busy_s + (time.perf_counter() - self._busy_since if self._active else 0.0),
                    "reward/samples": float(self.samples),
                    "reward/failed_samples": float(self.failures),
                }
            )
        raise ValueError(f"reward: unknown query {msg.what!r}; known: stats")

    async def on_stop(self) -> None:
        self.mix.close()
