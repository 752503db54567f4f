"""The dynamic sampling buffer's decisions, as plain synchronous code (no sockets).

Every epoch visits the prompts in a seeded order; position ``g = epoch * N + p`` is the
p-th prompt of that epoch's order, and it belongs to shard ``prompt_index % S``.
Everything this class decides is a function of the decisions *in that order*, never of
the order in which groups happened to arrive, so a synchronous run is reproducible and a
resumed run makes the same steps as an uninterrupted one::

    offer(group) ----> filter ----> decided[g]      (accepted | filtered; ledger first)
                                        |
    cursor walks g = 0, 1, 2, ... over decided positions (an undecided one blocks it):
        settled        -> skipped, never generated: the prompt's last buffer.settled_after
                          groups were all filtered as all rewards equal, and a seeded coin
                          for g says skip (buffer.settled_keep of the visits are generated).
                          A function of the decisions before g: while the prompt's earlier
                          visits are not all behind the cursor, g is generated if they cannot
                          settle it, else it waits (is not dispatched yet)
        filtered       -> skipped; past a bound on dynamic sampling (max_filtered_batches in a
                          row, or acceptance below min_acceptance over the last
                          acceptance_window groups) the run stops, or trains it (on_stall)
        accepted, stale for the step being assembled -> dropped, re-dispatched (attempt+1)
        accepted       -> joins the current wave; a full wave becomes one balanced
                          micro-batch per trainer rank, served at once (streaming)
    plan(shard)  <---- the undecided positions in [cursor, dispatch_end): over-sampled by
                       1 / acceptance EMA (capped), and in on-policy mode (max_staleness
                       0) closed when a step is full until the trainer publishes the next
                       version; what was dispatched beyond the full step is superseded.

The ledger holds this class's inputs (accepted and filtered groups with their payload,
published versions) in the order they came, so ``replay`` rebuilds the whole state of a
restarted buffer, and a checkpoint is only the ledger's ``mark``. The mark carries a
snapshot of the state (``snapshot``): a replay starts from the newest one that stands and
feeds only the events after it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import math
from collections import Counter, deque
from typing import Any, Literal, cast

import msgpack
import numpy as np
import torch

from protocols.codec import decode, decode_fields, encode
from protocols.messages import ForkedRow, GroupKey, MicroBatch, ScoredGroup, TurnRecord
from yatt.errors import ConfigError, ProtocolError
from yatt.rl.config import CUSTOM_FILTER, BufferConfig
from yatt.rl.ledger import EVENT_STATUSES, GROUP_STATUSES, Ledger, Status
from yatt.runtime.plugins import load_plugin

logger = logging.getLogger(__name__)

ALL_EQUAL = "all rewards equal"
"""The all_equal filter's reason."""


def epoch_order(num_prompts: int, seed: int, epoch: int) -> list[int]:
    """The seeded order in which epoch ``epoch`` visits the prompt indices."""
    return [int(i) for i in np.random.default_rng([seed, epoch]).permutation(num_prompts)]


def _coin(seed: int, g: int) -> float:
    """A uniform draw in [0, 1) that is a function of the run's seed and position g."""
    digest = hashlib.blake2b(f"{seed}:{g}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def validate_group(group: ScoredGroup, group_size: int) -> None:
    """Refuse a group whose fields disagree in length or hold non-finite numbers.

    The wire codec checks types; this checks what would otherwise poison a micro-batch:
    per-sample lengths (token ids vs rollout log-probs), per-group tensors of length n
    (a length-1 tensor would broadcast silently), NaN or inf rewards, advantages or
    log-probs. Raises ``ProtocolError`` naming the field.
    """
    where = f"ScoredGroup {group.group_key.as_str()}"
    n = len(group.completion_ids)
    if n != group_size:
        raise ProtocolError(f"{where}: completion_ids has {n} samples; buffer.group_size is {group_size}")
    if group.prompt_ids.dim() != 1 or group.prompt_ids.numel() == 0:
        raise ProtocolError(f"{where}: prompt_ids must be [P] with P >= 1 (got {tuple(group.prompt_ids.shape)})")
    for name in ("rollout_logprobs", "finish_reasons"):
        if len(getattr(group, name)) != n:
            raise ProtocolError(f"{where}: {name} has {len(getattr(group, name))} entries, completion_ids {n}")
    for name in ("rewards", "advantages", "policy_versions"):
        shape = tuple(getattr(group, name).shape)
        if shape != (n,):
            raise ProtocolError(f"{where}: {name} must have shape ({n},), one per sample (got {shape})")
    for i, (ids, logprobs) in enumerate(zip(group.completion_ids, group.rollout_logprobs, strict=True)):
        if ids.dim() != 1:
            raise ProtocolError(f"{where}: completion_ids[{i}] must be 1-D (got shape {tuple(ids.shape)})")
        if logprobs.shape != ids.shape:
            raise ProtocolError(
                f"{where}: rollout_logprobs[{i}] has shape {tuple(logprobs.shape)}, "
                f"completion_ids[{i}] {tuple(ids.shape)}; one log-prob per token"
            )
        if not bool(torch.isfinite(logprobs).all()):
            raise ProtocolError(f"{where}: rollout_logprobs[{i}] holds NaN or inf")
    for name in ("rewards", "advantages"):
        if not bool(torch.isfinite(getattr(group, name)).all()):
            raise ProtocolError(f"{where}: {name} holds NaN or inf ({getattr(group, name).tolist()})")
    for scorer, scores in group.scores.items():
        if tuple(scores.shape) != (n,) or not bool(torch.isfinite(scores).all()):
            raise ProtocolError(f"{where}: scores[{scorer!r}] must be {n} finite numbers (got {scores.tolist()})")
    if group.failures and len(group.failures) != n:
        raise ProtocolError(f"{where}: failures has {len(group.failures)} entries, completion_ids {n}")
    if group.sample_mm_inputs and len(group.sample_mm_inputs) != n:
        raise ProtocolError(f"{where}: sample_mm_inputs has {len(group.sample_mm_inputs)} entries, completion_ids {n}")
    images = [("mm_inputs", group.mm_inputs)] + [(f"sample_mm_inputs[{i}]", mm) for i, mm in enumerate(group.sample_mm_inputs)]
    for field_name, mm in images:
        for name, tensor in mm.items():
            if tensor.dim() < 1 or tensor.shape[0] < 1 or (tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())):
                raise ProtocolError(
                    f"{where}: {field_name}[{name!r}] must be finite, with a first dimension (images or patches) >= 1 "
                    f"(got shape {tuple(tensor.shape)})"
                )
    _validate_episodes(group, where)


def _validate_episodes(group: ScoredGroup, where: str) -> None:
    """A multi-turn group's masks and per-token versions: one per token of each completion,
    and at least one token of the policy's own in each (else nothing of it trains)."""
    n = len(group.completion_ids)
    for name in ("completion_masks", "token_versions", "episodes", "token_advantages"):
        if getattr(group, name) and len(getattr(group, name)) != n:
            raise ProtocolError(f"{where}: {name} has {len(getattr(group, name))} entries, completion_ids {n}")
    for name in ("completion_masks", "token_versions", "token_advantages"):
        for i, (ids, values) in enumerate(zip(group.completion_ids, getattr(group, name), strict=False)):
            if name == "token_advantages" and not bool(torch.isfinite(values).all()):
                raise ProtocolError(f"{where}: token_advantages[{i}] holds NaN or inf")
            if values.shape != ids.shape:
                raise ProtocolError(
                    f"{where}: {name}[{i}] has shape {tuple(values.shape)}, completion_ids[{i}] {tuple(ids.shape)}; one per token"
                )
    for i, mask in enumerate(group.completion_masks):
        if mask.dtype != torch.bool or (mask.numel() and not bool(mask.any())):
            raise ProtocolError(f"{where}: completion_masks[{i}] must be bool with a policy token in it (got {mask.tolist()[:8]})")
    for j, fork in enumerate(group.forked):
        if not 0 <= fork.sample < n:
            raise ProtocolError(f"{where}: forked[{j}].sample is {fork.sample}; the group has samples 0..{n - 1}")
        if fork.prompt_ids.dim() != 1 or fork.prompt_ids.numel() == 0:
            raise ProtocolError(f"{where}: forked[{j}].prompt_ids must be [P] with P >= 1 (got {tuple(fork.prompt_ids.shape)})")
        for name in ("completion_mask", "rollout_logprobs", "token_versions", "advantages"):
            values = getattr(fork, name)
            if fork.completion_ids.dim() != 1 or values.shape != fork.completion_ids.shape:
                raise ProtocolError(
                    f"{where}: forked[{j}].{name} has shape {tuple(values.shape)}, its completion_ids "
                    f"{tuple(fork.completion_ids.shape)}; one per token"
                )
            if values.is_floating_point() and not bool(torch.isfinite(values).all()):
                raise ProtocolError(f"{where}: forked[{j}].{name} holds NaN or inf")
        if fork.completion_mask.dtype != torch.bool or not bool(fork.completion_mask.any()):
            raise ProtocolError(f"{where}: forked[{j}].completion_mask must be bool with a policy token in it")


EMA_FLOOR = 1e-3
"""The acceptance EMA never falls below this: one accepted group lifts it again."""


def step_report(consumed: list[tuple[ScoredGroup, bool]], *, rollouts: int) -> tuple[dict[str, float], list[ScoredGroup]]:
    """The metrics of one step's groups ``(group, trained)`` (every group the step
    consumed, filtered ones included: what the policy produced) and up to ``rollouts`` of
    them for the rollout log, trained ones first.

    reward/mean, reward/std over samples (the weighted mix, after any overlong penalty);
    reward/<scorer>/mean and /std (raw scores); reward/failed_share (samples where a
    scorer failed); response_length/mean, /max and /clip_ratio (stopped by max_new_tokens),
    as verl names them; groups, groups/trained and groups/filtered_share (generated, then
    thrown away by the filter or dropped: the share of the step's generation spent for nothing)."""
    if not consumed:
        return {"reward/mean": float("nan"), "groups": 0.0, "groups/trained": 0.0}, []
    groups = [g for g, _ in consumed]
    rewards = torch.cat([g.rewards.float() for g in groups])
    lengths = torch.tensor([float(len(ids)) for g in groups for ids in g.completion_ids])
    reasons = [r for g in groups for r in g.finish_reasons]
    values = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "reward/failed_share": sum(bool(f) for g in groups for f in g.failures) / len(rewards),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": sum(r == "length" for r in reasons) / len(reasons),
        "groups": float(len(groups)),
        "groups/trained": float(sum(trained for _, trained in consumed)),
        "groups/filtered_share": sum(not trained for _, trained in consumed) / len(groups),
    }
    for name in sorted({name for g in groups for name in g.scores}):
        scores = torch.cat([g.scores[name].float() for g in groups if name in g.scores])
        values[f"reward/{name}/mean"] = float(scores.mean())
        values[f"reward/{name}/std"] = float(scores.std(unbiased=False))
    values.update(episode_report(groups))
    ordered = [g for g, trained in consumed if trained] + [g for g, trained in consumed if not trained]
    return values, ordered[:rollouts]


def episode_report(groups: list[ScoredGroup]) -> dict[str, float]:
    """Multi-turn groups' metrics (none for single-turn ones): episode/turns/mean,
    episode/tool_errors/mean (per episode), episode/ended/<how> (the share that ended so:
    done, truncated, max_turns, budget, timeout, env_error), episode/obs_share (the
    share of an episode's tokens that are observations: no loss) and episode/fork_share
    (the share of agent code's calls that did not extend their row: each began a row)."""
    episodes = [e for g in groups for e in g.episodes]
    if not episodes:
        return {}
    masks = [m for g in groups for m in g.completion_masks]
    tokens = sum(m.numel() for m in masks)
    values = {
        "episode/turns/mean": sum(e.turns for e in episodes) / len(episodes),
        "episode/tool_errors/mean": sum(e.tool_errors for e in episodes) / len(episodes),
        "episode/obs_share": (tokens - sum(int(m.sum()) for m in masks)) / max(tokens, 1),
        "episode/fork_share": sum(len(g.forked) for g in groups) / max(sum(e.turns for e in episodes), 1),
    }
    for how in sorted({e.ended for e in episodes}):
        values[f"episode/ended/{how}"] = sum(e.ended == how for e in episodes) / len(episodes)
    return values


def pack(msg: ScoredGroup | TurnRecord) -> bytes:
    """A group (or an episode's turn) as the ledger stores it: its wire frames in one msgpack blob."""
    return msgpack.packb([bytes(f) for f in encode(msg)], use_bin_type=True)  # type: ignore[no-any-return]


def unpack_turn(payload: bytes) -> TurnRecord:
    msg = decode(msgpack.unpackb(payload, raw=False))
    if not isinstance(msg, TurnRecord):
        raise ValueError(f"a ledger turn holds a {type(msg).__name__}, not a TurnRecord")
    return msg


def unpack(payload: bytes) -> ScoredGroup:
    msg = decode(msgpack.unpackb(payload, raw=False))
    if not isinstance(msg, ScoredGroup):
        raise ValueError(f"a ledger payload holds a {type(msg).__name__}, not a ScoredGroup")
    return msg


def newest_version(group: ScoredGroup | _Stored) -> int:
    """The newest policy version that sampled any token of ``group`` (an episode's turns
    can span a weight update: its per-sample version is its oldest token's)."""
    newest = int(group.policy_versions.max())
    rows = [*group.token_versions, *(f.token_versions for f in group.forked)]
    return max([newest, *(int(v.max()) for v in rows if v.numel())])


class _Stored:
    """A group as ``replay`` reads it from the ledger: decoded only as far as the buffer's
    decisions look (its key, policy versions and rewards); ``full()`` decodes the rest
    where a group is trained again or reported. Most groups of a long run were trained
    long ago: decoding every tensor of every one (~21 a group) was 70% of a replay."""

    __slots__ = ("forked", "group_key", "payload", "policy_versions", "rewards", "token_versions")
    NEEDED = ("group_key", "policy_versions", "rewards", "token_versions", "forked")

    def __init__(self, payload: bytes) -> None:
        fields = decode_fields(msgpack.unpackb(payload, raw=False), ScoredGroup, self.NEEDED)
        self.payload = payload
        self.group_key: GroupKey = fields["group_key"]
        self.policy_versions: torch.Tensor = fields["policy_versions"]
        self.rewards: torch.Tensor = fields["rewards"]
        self.token_versions: list[torch.Tensor] = fields["token_versions"]
        self.forked: list[ForkedRow] = fields["forked"]

    def full(self) -> ScoredGroup:
        return unpack(self.payload)


def _key(fields: list[int]) -> GroupKey:
    """A key as a snapshot names it (``[epoch, shard, prompt_index, attempt]``)."""
    epoch, shard, prompt_index, attempt = fields
    return GroupKey(epoch=epoch, shard=shard, prompt_index=prompt_index, attempt=attempt)


def _full(group: ScoredGroup) -> ScoredGroup:
    """The whole group (a ``_Stored`` one decoded)."""
    return group.full() if isinstance(group, _Stored) else group


class _Replaying:
    """Stands in for the ledger while ``replay`` re-derives rows the ledger already has."""

    pending = False

    def record(self, *args: object, **kwargs: object) -> None:
        pass

    def version(self, version: int) -> None:
        pass


@dataclasses.dataclass(kw_only=True)
class Stats:
    """Counters the buffer reports in every step's metrics."""

    accepted: int = 0
    filtered: dict[str, int] = dataclasses.field(default_factory=dict)
    stale_dropped: int = 0
    superseded: int = 0
    duplicates: int = 0
    trained_groups: int = 0
    rolled_back: int = 0


class SamplingBuffer:
    """Decides what happens to every group, in the seeded prompt order."""

    def __init__(
        self,
        config: BufferConfig,
        *,
        num_prompts: int,
        num_shards: int,
        world_size: int,
        seed: int,
        ledger: Ledger,
        total_steps: int | None = None,
        keep_groups: bool = False,
    ) -> None:
        """``total_steps``: the run's length; nothing is dispatched or assembled past it.
        ``keep_groups``: a group's rows go to one rank's micro-batch (``trainer.share_prompt``
        computes their prompt once there), where there are as many groups as ranks."""
        if num_prompts < 1:
            raise ConfigError(f"the dataset has no prompts (num_prompts={num_prompts})")
        config.check_world_size(world_size)
        self.config = config
        self.total_steps = total_steps
        self.world_size = world_size
        self.keep_groups = keep_groups
        self.num_prompts = num_prompts
        self.num_shards = num_shards
        self.seed = seed
        self.ledger = ledger
        self._custom = (
            load_plugin(
                config.custom_filter,
                field="buffer.custom_filter",
                expects=CUSTOM_FILTER,
            )
            if config.custom_filter
            else None
        )
        self._orders: dict[int, list[int]] = {}
        self._positions: dict[int, dict[int, int]] = {}
        self.decided: dict[int, tuple[ScoredGroup, bool]] = {}  # g -> (group, accepted)
        self.attempts: dict[int, int] = {}  # g -> current attempt number (absent: 0)
        self.cursor = 0  # first position not yet consumed by an assembled wave
        self.step = 0  # the step being assembled
        self.wave_index = 0  # waves of ``step`` already assembled
        self.wave: list[ScoredGroup] = []  # accepted groups of the wave being filled
        self.version = 0  # newest policy version published by the trainer
        self.ema = 1.0  # acceptance rate, measured in prompt order
        self.dispatch_end = 0  # controllers may generate positions < dispatch_end
        self.plan_seq = 0  # grows whenever the plan may have changed
        self.ready: dict[tuple[int, int], list[MicroBatch]] = {}  # (step, wave) -> one per rank
        self.step_groups: dict[int, list[tuple[ScoredGroup, bool]]] = {}  # step -> (group, trained) it consumed
        self.stats = Stats()
        self._replayed_version = 0  # while replaying: the last version the trainer published
        self.version_ceiling: int | None = None  # after a rewind: newer versions were discarded
        self._reasons: dict[int, str] = {}  # g -> why a decided group was filtered
        self.filtered_run: list[tuple[str, float]] = []  # (reason, mean reward) since the last accepted group
        # (why it was filtered, '' if accepted; mean reward) of the last acceptance_window groups the cursor passed
        self.recent: deque[tuple[str, float]] = deque(maxlen=config.acceptance_window)
        self._recent_accepted = 0  # groups of ``recent`` the filter accepted
        self.stalled = ""  # set at a bound on dynamic sampling (on_stall=error): why the run cannot go on
        self.replayed_from = 0  # the ledger row of the snapshot ``replay`` started from (0: the first row)
        # prompt index -> its groups filtered as all rewards equal in a row (as the cursor passed them)
        self.settled: dict[int, int] = {}
        self.skipped_settled = 0  # positions the cursor skipped as settled (never generated)
        self._update_window()

    # ------------------------------------------------------------ positions and keys

    @property
    def groups_per_wave(self) -> int:
        return self.config.groups_per_step // self.config.micro_batches_per_step

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            self._orders[epoch] = epoch_order(self.num_prompts, self.seed, epoch)
            self._positions[epoch] = {idx: p for p, idx in enumerate(self._orders[epoch])}
            # Epochs before the cursor's previous one are done with (a late duplicate from one
            # computes its order again): kept, they grew the buffer by ~90 KB per epoch of
            # 812 prompts, 65 MB over a 2,000-step run that filters most groups.
            done = self.cursor // self.num_prompts - 1
            for old in [e for e in self._orders if e < done and e != epoch]:
                del self._orders[old], self._positions[old]
        return self._orders[epoch]

    def key_at(self, g: int) -> GroupKey:
        epoch, p = divmod(g, self.num_prompts)
        index = self._order(epoch)[p]
        return GroupKey(epoch=epoch, shard=index % self.num_shards, prompt_index=index, attempt=self.attempts.get(g, 0))

    def position(self, key: GroupKey) -> int:
        self._order(key.epoch)
        p = self._positions[key.epoch].get(key.prompt_index)
        if p is None:
            raise ValueError(f"prompt index {key.prompt_index} is not in the dataset of {self.num_prompts} prompts")
        return key.epoch * self.num_prompts + p

    def in_flight(self, key: GroupKey) -> bool:
        """Whether ``key`` is a group the buffer still waits for: undecided, its attempt the
        current one (an episode's recorded turns are worth keeping only then)."""
        try:
            g = self.position(key)
        except ValueError:
            return False
        return g >= self.cursor and g not in self.decided and key.attempt == self.attempts.get(g, 0)

    # ------------------------------------------------------------ controllers' side

    def offer(self, group: ScoredGroup) -> str:
        """Take one scored group; returns the decision ("accepted", "filtered: ...", ...).

        A malformed group raises ``ProtocolError`` (``validate_group``) before the ledger
        records anything about it.
        """
        validate_group(group, self.config.group_size)
        return self._decide(group)

    def _decide(self, group: ScoredGroup) -> str:
        """``offer`` of a valid group (replay: the ledger holds only groups validated when
        offered, and checking them again was a quarter of a replay's time)."""
        key = group.group_key
        g = self.position(key)
        if g < self.cursor or g in self.decided:
            self.stats.duplicates += 1
            self.ledger.record(key, "duplicate", "already decided")
            return "duplicate"
        if key.attempt != self.attempts.get(g, 0):
            self.stats.superseded += 1
            self.ledger.record(key, "superseded", f"attempt {self.attempts.get(g, 0)} is current")
            return "superseded"
        newest = newest_version(group)
        if self.version_ceiling is not None and newest > self.version_ceiling:
            # Generated with weights of a step the run went back before: redo it.
            self.attempts[g] = key.attempt + 1
            self.stats.rolled_back += 1
            payload = pack(group) if isinstance(self.ledger, Ledger) else None
            self.ledger.record(
                key, "rolled_back", f"policy version {newest} was rolled back to {self.version_ceiling}", payload=payload
            )
            self.plan_seq += 1
            return "rolled_back"
        reason = self._filter_reason(group)
        version = int(group.policy_versions.min())
        status: Status = "filtered" if reason else "accepted"
        payload = pack(group) if isinstance(self.ledger, Ledger) else None
        self.ledger.record(key, status, reason, policy_version=version, payload=payload)
        if reason:
            self.stats.filtered[reason] = self.stats.filtered.get(reason, 0) + 1
        else:
            self.stats.accepted += 1
        self.decided[g] = (group, not reason)
        if reason:
            self._reasons[g] = reason
        self._advance()
        return "accepted" if not reason else f"filtered: {reason}"

    def _filter_reason(self, group: ScoredGroup) -> str:
        if self.config.filter == "all_equal" and bool((group.rewards == group.rewards[0]).all()):
            return ALL_EQUAL
        if self.config.max_completion_tokens and max(len(c) for c in group.completion_ids) > self.config.max_completion_tokens:
            return "too long"
        if self._custom is not None:
            return str(self._custom(group))
        return ""

    def plan(self, shard: int) -> list[GroupKey]:
        """The undecided groups of ``shard`` that should be in flight now, in order (not the
        settled ones the cursor will skip, nor those whose previous visit is undecided)."""
        return [
            key
            for g in range(self.cursor, self.dispatch_end)
            if g not in self.decided and (key := self.key_at(g)).shard == shard and self._settled(g) == "keep"
        ]

    def _settled(self, g: int) -> Literal["keep", "skip", "wait"]:
        """Whether position g is generated (keep) or skipped as settled (skip): a function of
        the prompt's record once its earlier visits are behind the cursor. While some are not
        (pending), keep if they cannot make it settled, else wait: so plan and cursor agree."""
        n = self.num_prompts
        after, keep = self.config.settled_after, self.config.settled_keep
        if self.config.filter != "all_equal" or not after or keep >= 1 or g < n:
            return "keep"
        epoch, p = divmod(g, n)
        prompt = self._order(epoch)[p]
        count, pending = self.settled.get(prompt, 0), 0
        for earlier in range(epoch - 1, -1, -1):
            self._order(earlier)
            if earlier * n + self._positions[earlier][prompt] < self.cursor:
                break
            pending += 1
        if count + pending < after:
            return "keep"  # (settled needs `after` all-equal visits in a row: not by g)
        if pending:
            return "wait"
        return "keep" if _coin(self.seed, g) < keep else "skip"

    @property
    def min_policy_version(self) -> int:
        """The oldest policy version a group generated now may still train with."""
        return max(0, self.step - self.config.max_staleness)

    # ------------------------------------------------------------ trainer's side

    def publish_version(self, version: int) -> None:
        """The trainer published weights of ``version`` (after step version - 1)."""
        if version > self.version:
            self.ledger.version(version)
            self.version = version
            self.version_ceiling = None  # the restarted trainer is past the checkpoint
            for step in [s for s in self.step_groups if s < version - 1]:  # (reported: asked after the version)
                del self.step_groups[step]
            self._advance()

    def rewound(self) -> None:
        """The run went back to a checkpoint (this state): until the trainer publishes a
        newer version, a group from a newer policy was made with discarded weights."""
        self.version_ceiling = self.version

    def take(self, step: int, index: int, rank: int) -> MicroBatch | None:
        """Rank ``rank``'s micro-batch ``index`` of ``step``, or None if not assembled yet."""
        batches = self.ready.get((step, index))
        return None if batches is None else batches[rank]

    def release(self, step: int, index: int) -> None:
        """Every rank has its micro-batch of wave ``index``: forget it."""
        self.ready.pop((step, index), None)

    # ------------------------------------------------------------ assembling

    def _advance(self) -> None:
        changed = False
        while self._may_assemble():
            g = self.cursor
            if g not in self.decided:
                if self._settled(g) != "skip":
                    break
                self.skipped_settled += 1
                self.attempts.pop(g, None)
                self.cursor += 1
                changed = True
                self._update_window()
                continue
            group, accepted = self.decided.pop(g)
            version = int(group.policy_versions.min())
            if accepted and self.step - version > self.config.max_staleness:
                self.attempts[g] = self.attempts.get(g, 0) + 1
                self.stats.stale_dropped += 1
                self.ledger.record(group.group_key, "stale", f"version {version} for step {self.step}")
                changed = True
                continue
            reason = self._reasons.pop(g, "filtered")
            prompt = group.group_key.prompt_index
            if reason == ALL_EQUAL and not accepted:
                self.settled[prompt] = self.settled.get(prompt, 0) + 1
            elif accepted:
                self.settled.pop(prompt, None)
            if accepted:
                self.filtered_run = []
                self._below_the_floor(group, "")
            else:  # (the run of filtered groups first: its report is the one a run stops with)
                past_the_bound = self._past_the_bound(group, reason)
                accepted = self._below_the_floor(group, reason) or past_the_bound
            self.ema = max(EMA_FLOOR, self.config.acceptance_ema * self.ema + (1 - self.config.acceptance_ema) * accepted)
            if self.step >= self._replayed_version - 1:  # (the step trained last: its report may not be asked yet)
                self.step_groups.setdefault(self.step, []).append((_full(group), accepted))
            self.attempts.pop(g, None)  # (no key before the cursor is looked at again)
            self.cursor += 1
            if accepted:
                self.wave.append(group)
                if len(self.wave) == self.groups_per_wave:
                    self._emit_wave()
            changed = True
            self._update_window()
        if self._update_window() or changed:
            self.plan_seq += 1

    def _past_the_bound(self, group: ScoredGroup, reason: str) -> bool:
        """Count a filtered group; True if it is to be trained anyway (on_stall=train)."""
        bound = self.config.max_filtered_batches * self.config.groups_per_step
        if not bound:
            return False  # (nothing to report: the run of filtered groups is not kept)
        self.filtered_run.append((reason, float(group.rewards.float().mean())))
        run = len(self.filtered_run)
        if run < bound // 2:
            return False
        if (run == bound // 2 or run == bound) and isinstance(self.ledger, Ledger):  # (not again in a replay)
            logger.warning("buffer: %s", self.stall_report(bound))
        if run < bound:
            return False
        if self.config.on_stall == "train":
            return True
        self.stalled = self.stalled or self.stall_report(bound)
        return False

    def stall_report(self, bound: int) -> str:
        """Why dynamic sampling accepts nothing, in a user's terms, and what to change."""
        run = self.filtered_run
        reasons: dict[str, int] = {}
        for reason, _ in run:
            reasons[reason] = reasons.get(reason, 0) + 1
        means = torch.tensor([m for _, m in run])
        return (
            f"dynamic sampling accepted none of the last {len(run)} groups (bound: buffer.max_filtered_batches="
            f"{self.config.max_filtered_batches} x groups_per_step={self.config.groups_per_step} = {bound}); "
            f"filtered as {', '.join(f'{r!r}: {n}' for r, n in sorted(reasons.items()))}; group mean rewards: "
            f"min {float(means.min()):.3g}, mean {float(means.mean()):.3g}, max {float(means.max()):.3g}. Every sample of a group gets the same reward, so there is nothing to learn "
            "from: make the task easier (or harder, if every prompt is solved), raise buffer.group_size, use "
            "a reward with partial credit, set buffer.filter=none, or buffer.on_stall=train"
        )

    def _below_the_floor(self, group: ScoredGroup, reason: str) -> bool:
        """Count a group the cursor passed (``reason``: why it was filtered, '' if accepted)
        in the acceptance window; True if it is filtered and to be trained anyway because the
        window's acceptance is below ``buffer.min_acceptance`` (on_stall=train)."""
        if not self.config.min_acceptance:
            return False  # (the window is not kept)
        was_below = self.crawling
        if len(self.recent) == self.recent.maxlen and not self.recent[0][0]:
            self._recent_accepted -= 1
        self.recent.append((reason, float(group.rewards.float().mean())))
        self._recent_accepted += not reason
        if not reason or not self.crawling:
            return False
        if self.config.on_stall == "train":
            if not was_below and isinstance(self.ledger, Ledger):  # (not again in a replay)
                logger.warning("buffer: %s; training on the filtered groups (buffer.on_stall=train)", self.crawl_report())
            return True
        self.stalled = self.stalled or self.crawl_report()
        return False

    @property
    def crawling(self) -> bool:
        """A whole window was decided and accepted less than ``buffer.min_acceptance`` of it."""
        window = self.config.acceptance_window
        return len(self.recent) == window and self._recent_accepted / window < self.config.min_acceptance

    def crawl_report(self) -> str:
        """Why dynamic sampling crawls (accepts a few groups), in a user's terms, and what to change."""
        window, accepted = len(self.recent), self._recent_accepted
        reasons = Counter(reason for reason, _ in self.recent if reason)
        means = torch.tensor([m for _, m in self.recent])
        filtered = torch.tensor([m for reason, m in self.recent if reason])
        return (
            f"dynamic sampling accepted {accepted} of the last {window} groups ({accepted / window:.0%}; floor: "
            f"buffer.min_acceptance={self.config.min_acceptance} over buffer.acceptance_window={window} groups), "
            f"{window / max(accepted, 1):.1f} groups generated per accepted one; filtered as "
            f"{', '.join(f'{r!r}: {n}' for r, n in sorted(reasons.items()))}; group mean rewards: min "
            f"{float(means.min()):.3g}, mean {float(means.mean()):.3g}, max {float(means.max()):.3g} (the filtered "
            f"groups': mean {float(filtered.mean()):.3g}). Too few groups carry a learning signal: use a reward with "
            "partial credit, make the task easier (or harder, if most prompts are solved), raise buffer.group_size, "
            "set buffer.filter=none, lower buffer.min_acceptance (0: no floor), or buffer.on_stall=train"
        )

    def _may_assemble(self) -> bool:
        if self.total_steps is not None and self.step >= self.total_steps:
            return False  # the run is over: nothing more is trained
        # On-policy: step k is assembled only from version-k groups, once version k exists.
        return self.config.max_staleness > 0 or self.version >= self.step

    def _emit_wave(self) -> None:
        for group in self.wave:
            self.ledger.record(group.group_key, "trained", step=self.step, policy_version=int(group.policy_versions.min()))
        self.stats.trained_groups += len(self.wave)
        if self.step >= self._replayed_version:  # (a replay skips the steps trained already)
            self.ready[(self.step, self.wave_index)] = self._split([_full(g) for g in self.wave], self.step, self.wave_index)
        self.wave = []
        self.wave_index += 1
        if self.wave_index == self.config.micro_batches_per_step:
            self.step += 1
            self.wave_index = 0
            if self.config.max_staleness == 0:
                self._supersede_beyond_cursor()

    def _supersede_beyond_cursor(self) -> None:
        """On-policy: what was dispatched past the full step was generated for it; redo it."""
        for g in range(self.cursor, self.dispatch_end):
            key = self.key_at(g)
            self._reasons.pop(g, None)
            if self.decided.pop(g, None) is not None:
                self.ledger.record(key, "superseded", f"step {self.step - 1} was full")
                self.stats.superseded += 1
            self.attempts[g] = key.attempt + 1
        self.dispatch_end = self.cursor

    def _update_window(self) -> bool:
        """Extend the dispatch window; True if it grew."""
        per_step, waves = self.config.groups_per_step, self.config.micro_batches_per_step
        needed = per_step * (waves - self.wave_index) // waves - len(self.wave)  # to finish this step
        if self.config.max_staleness > 0:
            needed += per_step * max(0, self.version + self.config.max_staleness - self.step)
        elif self.version < self.step:
            needed = 0  # on-policy: wait for the weights of this step
        if self.total_steps is not None:  # what the rest of the run can still use
            assembled = self.wave_index * self.groups_per_wave + len(self.wave)
            needed = min(needed, max(0, per_step * (self.total_steps - self.step) - assembled))
        factor = min(self.config.max_oversample, 1.0 / max(self.ema, 1e-6))
        end, wanted = self.cursor, math.ceil(needed * factor)
        while wanted > 0:  # settled positions are not generated: they do not count
            wanted -= self._settled(end) != "skip"
            end += 1
        if end > self.dispatch_end:
            self.dispatch_end = end
            return True
        return False

    # ------------------------------------------------------------ the ledger as the source of truth

    def replay(self) -> int:
        """Rebuild the state from the ledger (a fresh buffer, before any offer): from the
        newest snapshot that stands, if its config is this one's, then every accepted or
        filtered group and published version after it is fed again, in order, through the
        same decisions. Returns the events replayed.

        Raises ``ConfigError`` when a group is decided otherwise than the ledger says (the
        run's config or filter changed since). Micro-batches and rewards of the steps
        before the last published version (trained by every rank) are not rebuilt.
        """
        ledger = self.ledger
        snapshot: dict[str, Any] = {}
        groups: dict[GroupKey, tuple[ScoredGroup, str]] | None = None
        after = 0
        if (found := ledger.snapshot()) is not None:
            snapshot = json.loads(found[1])
            # (another config: the whole replay checks every decision against the new one)
            if snapshot.get("config") == self._fingerprint:
                groups = self._named_groups(snapshot, found[0])
            after = found[0] if groups is not None else 0
        rows = ledger.standing(after=after)
        events = [e for e in rows if e.status in EVENT_STATUSES]
        versions = [e.policy_version or 0 for e in events if e.status == "version"]
        self._replayed_version = max(versions, default=snapshot["version"] if groups is not None else 0)
        self.replayed_from = after
        if groups is not None:
            self._restore(snapshot, groups)
        self.ledger = _Replaying()  # type: ignore[assignment]
        lazy = not self.config.max_completion_tokens and self._custom is None  # (those filters read whole groups)
        try:
            for e in events:
                if e.status == "version":
                    self.publish_version(e.policy_version or 0)
                    continue
                if e.status == "rewind":
                    self.rewound()
                    continue
                assert e.payload is not None
                group = cast(ScoredGroup, _Stored(e.payload)) if lazy else unpack(e.payload)
                if len(group.rewards) != self.config.group_size:
                    raise ConfigError(
                        f"ledger {ledger.path}: group {e.key.as_str()} has {len(group.rewards)} samples and "
                        f"buffer.group_size is {self.config.group_size}; it must not change across a restart"
                    )
                decision = self._decide(group)
                if decision.split(":")[0] != e.status:
                    raise ConfigError(
                        f"ledger {ledger.path}: group {e.key.as_str()} was {e.status}, and is {decision!r} now; "
                        "the buffer's config (filter, group_size, staleness) must not change across a restart"
                    )
        finally:
            self.ledger = ledger
        # (the snapshot's, trained since; the last one trained is kept: rank 0 asks for its
        # report after publishing, maybe after this restart)
        for step in [s for s in self.step_groups if s < self._replayed_version - 1]:
            del self.step_groups[step]
        self._replayed_version = 0
        # What the buffer goes on with is whole: the groups decided beyond the cursor and the wave being filled.
        self.decided = {g: (_full(group), accepted) for g, (group, accepted) in self.decided.items()}
        self.wave = [_full(group) for group in self.wave]
        self.stats = Stats(**snapshot["stats"]) if groups is not None else Stats()
        for e in rows:
            if e.status not in GROUP_STATUSES:
                continue
            if e.status == "filtered":
                self.stats.filtered[e.reason] = self.stats.filtered.get(e.reason, 0) + 1
            else:
                field = {"accepted": "accepted", "stale": "stale_dropped", "superseded": "superseded",
                         "duplicate": "duplicates", "trained": "trained_groups", "rolled_back": "rolled_back"}[e.status]  # fmt: skip
                setattr(self.stats, field, getattr(self.stats, field) + 1)
        return len(events)

    def mark(self) -> int:
        """The ledger's mark for a checkpoint, with a snapshot of this state at it."""
        return self.ledger.mark(snapshot=self.snapshot())

    @functools.cached_property
    def _fingerprint(self) -> str:
        """What the decisions depend on besides the ledger: a snapshot made under another
        value of any of these is not used (the whole replay then checks the decisions). A
        custom filter counts by its source code. (Fixed for the buffer's life: made once.)"""
        custom = None
        if self._custom is not None:
            try:
                custom = hashlib.sha256(inspect.getsource(self._custom).encode()).hexdigest()
            except (OSError, TypeError):
                custom = "source not found"
        return json.dumps(
            [dataclasses.asdict(self.config), self.num_prompts, self.num_shards, self.seed, self.total_steps, custom],
            sort_keys=True,
        )

    def snapshot(self) -> bytes:
        """The state, its groups named by key (their payloads are in the ledger): what
        ``replay`` starts from instead of the ledger's first row. The steps kept are those
        not trained yet (from the published version on): a replay rebuilds their
        micro-batches and reports, as it does from the events."""
        def keys(groups: list[ScoredGroup]) -> list[tuple[int, ...]]:
            return [dataclasses.astuple(group.group_key) for group in groups]

        return json.dumps({
            "config": self._fingerprint,
            "cursor": self.cursor, "step": self.step, "wave_index": self.wave_index, "version": self.version,
            "ema": self.ema, "dispatch_end": self.dispatch_end, "version_ceiling": self.version_ceiling,
            "stalled": self.stalled, "filtered_run": self.filtered_run, "recent": list(self.recent),
            "attempts": sorted(self.attempts.items()),
            "settled": sorted(self.settled.items()), "skipped_settled": self.skipped_settled,
            "decided": [[g, dataclasses.astuple(group.group_key), accepted] for g, (group, accepted) in sorted(self.decided.items())],
            "wave": keys(self.wave),
            "step_groups": [
                [step, keys([g for g, _ in consumed]), [a for _, a in consumed]]
                for step, consumed in sorted(self.step_groups.items()) if step >= self.version - 1
            ],
            "stats": dataclasses.asdict(self.stats),
        }).encode()  # fmt: skip

    def _named_groups(self, snapshot: dict[str, Any], seq: int) -> dict[GroupKey, tuple[ScoredGroup, str]] | None:
        """The groups ``snapshot`` (at ledger row ``seq``) names by key, read back from the
        ledger with the reason each was filtered for; None (a warning, and the whole ledger is
        replayed) if the ledger lacks one."""
        named = [_key(k) for _, k, _ in snapshot["decided"]] + [_key(k) for k in snapshot["wave"]]
        named += [_key(k) for _, keys, _ in snapshot["step_groups"] for k in keys]
        rows = self.ledger.decided(named, seq)
        missing = [k.as_str() for k in named if k not in rows]
        if missing:
            logger.warning("buffer: the snapshot at ledger row %d names groups the ledger lacks (%s); replaying it all", seq, missing[:3])
            return None
        return {k: (unpack(e.payload or b""), e.reason) for k, e in rows.items()}

    def _restore(self, snapshot: dict[str, Any], groups: dict[GroupKey, tuple[ScoredGroup, str]]) -> None:
        """Take the state of ``snapshot``, its ``groups`` read back, the micro-batches of its
        steps not trained yet (``_replayed_version`` on) rebuilt."""
        for name in ("cursor", "step", "wave_index", "version", "ema", "dispatch_end", "version_ceiling", "stalled"):
            setattr(self, name, snapshot[name])
        self.filtered_run = [(reason, mean) for reason, mean in snapshot["filtered_run"]]
        self.recent.extend((reason, mean) for reason, mean in snapshot["recent"])
        self._recent_accepted = sum(not reason for reason, _ in self.recent)
        self.attempts = {g: a for g, a in snapshot["attempts"]}
        self.settled = {p: n for p, n in snapshot["settled"]}
        self.skipped_settled = snapshot["skipped_settled"]
        for g, k, accepted in snapshot["decided"]:
            group, reason = groups[_key(k)]
            self.decided[g] = (group, accepted)
            if not accepted:
                self._reasons[g] = reason
        self.wave = [groups[_key(k)][0] for k in snapshot["wave"]]
        per_wave = self.groups_per_wave
        for step, keys, accepted in snapshot["step_groups"]:
            consumed = [(groups[_key(k)][0], a) for k, a in zip(keys, accepted, strict=True)]
            self.step_groups[step] = consumed
            if step < self._replayed_version:
                continue  # trained since the snapshot: no micro-batches for it
            taken = [group for group, a in consumed if a]
            for index in range(len(taken) // per_wave):
                self.ready[(step, index)] = self._split(taken[index * per_wave : (index + 1) * per_wave], step, index)

    # ------------------------------------------------------------ micro-batches

    def _split(self, groups: list[ScoredGroup], step: int, index: int) -> list[MicroBatch]:
        """One micro-batch per rank, the same number of rows each (one more on some where
        forked rows make the count uneven), balanced by tokens: longest first, each to the
        rank with the fewest tokens so far (LPT). With ``keep_groups`` (and a group a rank at
        least) whole groups are dealt so, each to the rank with the fewest tokens."""
        samples = [(gi, i) for gi, group in enumerate(groups) for i in range(len(group.completion_ids) + len(group.forked))]
        length = {s: sum(len(part) for part in _row(groups[s[0]], s[1])[:2]) for s in samples}
        if self.keep_groups and len(groups) >= self.world_size:
            return self._split_groups(groups, samples, length, step, index)
        per_rank = -(-len(samples) // self.world_size)
        ranks: list[list[tuple[int, int]]] = [[] for _ in range(self.world_size)]
        tokens = [0] * self.world_size
        for s in sorted(samples, key=lambda s: -length[s]):
            r = min((r for r in range(self.world_size) if len(ranks[r]) < per_rank), key=lambda r: tokens[r])
            ranks[r].append(s)
            tokens[r] += length[s]
        return [self._micro_batch(groups, sorted(rows), r, step, index) for r, rows in enumerate(ranks)]

    def _split_groups(
        self,
        groups: list[ScoredGroup],
        samples: list[tuple[int, int]],
        length: dict[tuple[int, int], int],
        step: int,
        index: int,
    ) -> list[MicroBatch]:
        """Whole groups to ranks, the group with the most tokens first, each to the rank with
        the fewest tokens so far (rows per rank may then differ by a group's size)."""
        rows_of: dict[int, list[tuple[int, int]]] = {}
        for s in samples:
            rows_of.setdefault(s[0], []).append(s)
        ranks: list[list[tuple[int, int]]] = [[] for _ in range(self.world_size)]
        tokens = [0] * self.world_size
        for gi in sorted(rows_of, key=lambda gi: -sum(length[s] for s in rows_of[gi])):
            r = min(range(self.world_size), key=lambda r: tokens[r])
            ranks[r] += rows_of[gi]
            tokens[r] += sum(length[s] for s in rows_of[gi])
        return [self._micro_batch(groups, sorted(rows), r, step, index) for r, rows in enumerate(ranks)]

    def _micro_batch(
        self, groups: list[ScoredGroup], rows: list[tuple[int, int]], rank: int, step: int, index: int
    ) -> MicroBatch:
        width = max(sum(len(part) for part in _row(groups[gi], i)[:2]) for gi, i in rows)
        shape = (len(rows), width)
        input_ids = torch.full(shape, self.config.pad_token_id, dtype=torch.int64)
        attention = torch.zeros(shape, dtype=torch.bool)
        loss_mask = torch.zeros(shape, dtype=torch.bool)
        logprobs = torch.zeros(shape, dtype=torch.float32)
        advantages = torch.zeros(shape, dtype=torch.float32)
        versions = torch.zeros(len(rows), dtype=torch.int64)
        for b, (gi, i) in enumerate(rows):
            prompt, completion, own, rollout, per_token, version = _row(groups[gi], i)
            p, c = len(prompt), len(completion)
            input_ids[b, :p] = prompt
            input_ids[b, p : p + c] = completion
            attention[b, : p + c] = True
            # An episode's observations (mask 0) are not the policy's actions: no loss, no KL,
            # not in the token mean, no advantage.
            loss_mask[b, p : p + c] = own
            logprobs[b, p : p + c] = rollout
            advantages[b, p : p + c] = per_token * own
            versions[b] = version
        return MicroBatch(
            step=step,
            rank=rank,
            index=index,
            count=self.config.micro_batches_per_step,
            input_ids=input_ids,
            attention_mask=attention,
            loss_mask=loss_mask,
            rollout_logprobs=logprobs,
            advantages=advantages,
            policy_versions=versions,
            group_keys=[groups[gi].group_key for gi, _ in rows],
            mm_inputs=_mm_inputs([groups[gi] for gi, _ in rows], [i for _, i in rows]),
        )


def _mm_inputs(groups: list[ScoredGroup], rows: list[int]) -> dict[str, torch.Tensor]:
    """The images of a micro-batch's rows in row order (row ``rows[b]`` of ``groups[b]``:
    its prompt's, then its sample's observations'), each name's tensors concatenated along
    their first dimension, as a processor batches them."""
    per_row: list[tuple[ScoredGroup, dict[str, torch.Tensor]]] = []
    for group, i in zip(groups, rows, strict=True):
        spans = [group.mm_inputs]
        if group.sample_mm_inputs and i < len(group.completion_ids):  # (a forked row: its prompt's only)
            spans.append(group.sample_mm_inputs[i])
        per_row.extend((group, span) for span in spans if span)
    names = sorted({name for _, span in per_row for name in span})
    for name in names:
        missing = next((g for g, span in per_row if name not in span), None)
        if missing is not None:
            raise ProtocolError(
                f"ScoredGroup {missing.group_key.as_str()}: its images lack {name!r}, which other images "
                "of the micro-batch carry; every image must be processed by the same processor"
            )
    return {name: torch.cat([span[name] for _, span in per_row]) for name in names}


def _row(group: ScoredGroup, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row ``i`` of a group (its samples', then its forked rows): (prompt ids, completion
    ids, loss mask, rollout log-probs, advantage (per token, or the sample's), policy version)."""
    n = len(group.completion_ids)
    if i >= n:
        fork = group.forked[i - n]
        version = group.policy_versions[fork.sample]
        return fork.prompt_ids, fork.completion_ids, fork.completion_mask, fork.rollout_logprobs, fork.advantages, version
    c = len(group.completion_ids[i])
    own = group.completion_masks[i] if group.completion_masks else torch.ones(c, dtype=torch.bool)
    per_token = group.token_advantages[i] if group.token_advantages else group.advantages[i]
    return group.prompt_ids, group.completion_ids[i], own, group.rollout_logprobs[i], per_token, group.policy_versions[i]
