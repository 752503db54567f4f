"""The fake workers of the controllers benchmark (``benchmarks/controllers.py``): real
``yatt.runtime.actor.Actor`` subclasses that do no work, so that what the benchmark measures is
the controllers' routing.

- ``FakeGenerator``: every GenerateRequest answered at once with the same ``n``
  completions (fixed token ids and logprobs, finish reason "length", policy version 0).
- ``FakeReward``: every ScoreRequest answered at once with the same rewards.
- ``FakeBuffer``: plans from a ``KeyWindow`` (an endless supply of fresh keys, a long
  poll answered as soon as a delivered group changed the shard's keys); every
  ScoredGroup acknowledged and counted once.
"""

from __future__ import annotations

import asyncio
import contextlib

import torch

from protocols.messages import (
    Ack,
    Completion,
    Completions,
    DispatchPlan,
    GenerateRequest,
    GroupKey,
    Message,
    Metrics,
    PlanRequest,
    Query,
    ScoredGroup,
    ScoreRequest,
    Scores,
)
from yatt.runtime.actor import Actor, handles
from yatt.runtime.transport import Transport

PROMPTS_PER_SHARD = 64
"""Prompts per shard in the controllers' list (keys cycle through them, epoch by epoch)."""


class KeyWindow:
    """An endless supply of fresh group keys, ``window`` undecided ones per shard.

    Shard s's j-th key is global group g = j * num_shards + s, at ``prompt_index = g mod
    num_prompts`` of epoch ``g // num_prompts`` (so prompt i belongs to shard i mod S, as
    in a run). A delivered key leaves its shard's window for good and a fresh one joins;
    a key delivered again, or never handed out, counts as a duplicate, not as a group.
    """

    def __init__(self, *, num_shards: int, window: int, num_prompts: int) -> None:
        if num_prompts % num_shards:
            raise ValueError(f"num_prompts {num_prompts} is not a multiple of num_shards {num_shards}")
        self.num_shards = num_shards
        self.num_prompts = num_prompts
        self.delivered_groups = 0
        self.delivered_samples = 0
        self.duplicates = 0
        self._next = [0] * num_shards  # j of each shard's next fresh key
        self._seq = [0] * num_shards  # plan_seq of each shard
        self._open: list[dict[GroupKey, None]] = [{} for _ in range(num_shards)]  # insertion-ordered
        for shard in range(num_shards):
            for _ in range(window):
                self._add(shard)

    def _add(self, shard: int) -> None:
        g = self._next[shard] * self.num_shards + shard
        self._next[shard] += 1
        self._open[shard][
            GroupKey(epoch=g // self.num_prompts, shard=shard, prompt_index=g % self.num_prompts)
        ] = None

    def keys(self, shard: int) -> list[GroupKey]:
        """The shard's undecided keys, oldest first."""
        return list(self._open[shard])

    def seq(self, shard: int) -> int:
        """Grows by one whenever the shard's keys change."""
        return self._seq[shard]

    def deliver(self, key: GroupKey, samples: int) -> bool:
        """A scored group arrived; True if it counted (its key was open)."""
        if not 0 <= key.shard < self.num_shards or key not in self._open[key.shard]:
            self.duplicates += 1
            return False
        del self._open[key.shard][key]
        self._add(key.shard)
        self._seq[key.shard] += 1
        self.delivered_groups += 1
        self.delivered_samples += samples
        return True


# ---------------------------------------------------------------- the fake workers


class FakeGenerator(Actor):
    """Answers every GenerateRequest at once with the same precomputed completions."""

    role = "generator"

    def __init__(self, transport: Transport, *, endpoint: str, group_size: int, max_new_tokens: int) -> None:
        super().__init__(transport, endpoint=endpoint)
        token_ids = torch.arange(100, 100 + max_new_tokens, dtype=torch.int32)  # [L]
        logprobs = torch.full((max_new_tokens,), -1.5, dtype=torch.float32)  # [L]
        self._completions = [
            Completion(
                token_ids=token_ids,
                logprobs=logprobs,
                finish_reason="length",
                policy_version_min=0,
                policy_version_max=0,
            )
            for _ in range(group_size)
        ]

    @handles(GenerateRequest)
    async def generate(self, msg: GenerateRequest) -> Completions:
        return Completions(group_key=msg.group_key, completions=self._completions)


class FakeReward(Actor):
    """Answers every ScoreRequest at once with the same precomputed rewards."""

    role = "reward"

    def __init__(self, transport: Transport, *, endpoint: str, group_size: int) -> None:
        super().__init__(transport, endpoint=endpoint)
        self._rewards = torch.linspace(0.0, 1.0, group_size, dtype=torch.float32)  # [n], not all equal
        self._failures = [""] * group_size

    @handles(ScoreRequest)
    async def score(self, msg: ScoreRequest) -> Scores:
        return Scores(
            group_key=msg.group_key,
            rewards=self._rewards,
            components={"fake": self._rewards},
            failures=self._failures,
        )


class FakeBuffer(Actor):
    """Serves plans from a ``KeyWindow`` and counts the groups delivered to it.

    ``Query("reset", {"num_shards": S})`` starts a fresh window for S shards (between
    configurations); ``Query("stats")`` answers the counts.
    """

    role = "buffer"

    def __init__(self, transport: Transport, *, endpoint: str, window: int) -> None:
        super().__init__(transport, endpoint=endpoint)
        self.window = window
        self.keys = KeyWindow(num_shards=1, window=window, num_prompts=PROMPTS_PER_SHARD)
        self._changed = [asyncio.Condition()]
        self.plans = 0  # DispatchPlans answered

    @handles(PlanRequest)
    async def plan(self, msg: PlanRequest) -> DispatchPlan:
        keys = self.keys
        if msg.num_shards != keys.num_shards:
            raise ValueError(
                f"controller of shard {msg.shard} runs with {msg.num_shards} shards, "
                f"the buffer with {keys.num_shards}"
            )
        changed = self._changed[msg.shard]
        if keys.seq(msg.shard) <= msg.after_seq:
            async with changed:
                with contextlib.suppress(asyncio.TimeoutError):  # a long poll: answer the unchanged plan
                    await asyncio.wait_for(
                        changed.wait_for(lambda: keys.seq(msg.shard) > msg.after_seq), msg.wait_s
                    )
        self.plans += 1
        return DispatchPlan(
            plan_seq=keys.seq(msg.shard), keys=keys.keys(msg.shard), min_policy_version=0, step=0
        )

    @handles(ScoredGroup)
    async def offer(self, msg: ScoredGroup) -> Ack:
        counted = self.keys.deliver(msg.group_key, len(msg.completion_ids))
        if counted:
            changed = self._changed[msg.group_key.shard]
            async with changed:
                changed.notify_all()
        return Ack(info={"decision": "accepted" if counted else "duplicate"})

    @handles(Query)
    async def query(self, msg: Query) -> Message:
        if msg.what == "stats":
            k = self.keys
            values = {
                "groups": k.delivered_groups,
                "samples": k.delivered_samples,
                "duplicates": k.duplicates,
                "plans": self.plans,
            }
            return Metrics(values={name: float(v) for name, v in values.items()})
        if msg.what == "reset":
            shards = int(msg.args["num_shards"])
            self.keys = KeyWindow(
                num_shards=shards, window=self.window, num_prompts=PROMPTS_PER_SHARD * shards
            )
            self._changed = [asyncio.Condition() for _ in range(shards)]
            return Ack(seq=shards)
        raise ValueError(f"fake buffer: unknown query {msg.what!r}; known: stats, reset")
