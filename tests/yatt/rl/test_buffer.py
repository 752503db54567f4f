"""The buffer actor over loopback: long-polled plans, micro-batches served as soon as their
wave exists (before the step's batch is complete), checkpoints and stats."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from protocols.messages import (
    Ack,
    DispatchPlan,
    GroupKey,
    Metrics,
    MicroBatch,
    MicroBatchRequest,
    PlanRequest,
    PolicyVersion,
    Query,
    ScoredGroup,
    StepReport,
    TurnRecord,
    TurnRecords,
    TurnsRequest,
)
from tests.yatt.rl.test_sampling import N_PROMPTS, make_group
from yatt.errors import RemoteError
from yatt.rl.buffer import Buffer
from yatt.rl.config import BufferConfig
from yatt.runtime.actor import Client
from yatt.runtime.transport import Transport


def make(transport: Transport, tmp_path: Path, name: str = "a", resume: Path | None = None) -> Buffer:
    return Buffer(
        transport,
        endpoint="tcp://127.0.0.1:*",
        config=BufferConfig(groups_per_step=4, group_size=2, micro_batches_per_step=2, filter="none"),
        num_prompts=N_PROMPTS,
        num_shards=2,
        world_size=2,
        seed=3,
        ledger_path=tmp_path / f"{name}.db",
        resume_from=resume,
    )


async def test_plans_stream_and_checkpoint(transport: Transport, tmp_path: Path) -> None:
    async with make(transport, tmp_path) as buffer, Client(transport, buffer.endpoint) as client:
        plans = [
            await client.request(PlanRequest(shard=s, num_shards=2, after_seq=-1, wait_s=0.1), DispatchPlan) for s in (0, 1)
        ]
        keys = [k for p in plans for k in p.keys]
        assert len(keys) == 4 and all(p.min_policy_version == 0 for p in plans)
        # A long poll with the current seq waits; a decision wakes it.
        waiting = asyncio.ensure_future(
            client.request(PlanRequest(shard=0, num_shards=2, after_seq=plans[0].plan_seq, wait_s=30), DispatchPlan)
        )
        # Rank 1 asks for its first micro-batch before any group exists: it waits for the wave.
        first = asyncio.ensure_future(client.request(MicroBatchRequest(step=0, rank=1, world_size=2, index=0), MicroBatch))
        order = sorted(keys, key=lambda k: buffer.core.position(k))
        for key in order[:2]:  # the first wave (2 groups) only
            reply = await client.request(make_group(key, 0), Ack)
            assert reply.info["decision"] == "accepted"
        mb = await asyncio.wait_for(first, 30)
        assert (mb.step, mb.index, mb.rank, mb.count) == (0, 0, 1, 2)
        assert not buffer.core.ready.get((0, 1)), "the second wave cannot exist yet"
        plan = await asyncio.wait_for(waiting, 30)
        assert plan.plan_seq != plans[0].plan_seq
        for key in order[2:]:
            await client.request(make_group(key, 0), Ack)
        second = await client.request(MicroBatchRequest(step=0, rank=0, world_size=2, index=1), MicroBatch)
        assert second.index == 1
        # The step is full: on-policy, nothing more is planned until version 1.
        empty = await client.request(PlanRequest(shard=0, num_shards=2, after_seq=-1, wait_s=0.1), DispatchPlan)
        assert empty.keys == []
        await client.request(PolicyVersion(version=1), Ack)
        reopened = await client.request(PlanRequest(shard=0, num_shards=2, after_seq=-1, wait_s=0.1), DispatchPlan)
        assert reopened.keys and reopened.min_policy_version == 1
        ckpt = tmp_path / "checkpoints" / "step_1"
        await client.request(Query(what="checkpoint", args={"dir": str(ckpt)}), Ack)
        # Nothing a message says makes the buffer write outside the run's checkpoints.
        for where in (tmp_path / "elsewhere", tmp_path / "checkpoints" / ".." / "x", Path("/tmp")):
            with pytest.raises(RemoteError, match="is not a checkpoint of this run"):
                await client.request(Query(what="checkpoint", args={"dir": str(where)}), Ack)
        assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "x").exists()
        stats = await client.request(Query(what="stats"), Metrics)
        assert stats.values["buffer/accepted"] == 4 and stats.values["buffer/trained_groups"] == 4
        report = await client.request(Query(what="step_report", args={"step": "0", "rollouts": "3"}), StepReport)
        assert report.values["groups"] == 4 and len(report.groups) == 3
        assert report.groups[0].completion_ids[0].tolist() == make_group(order[0], 0).completion_ids[0].tolist()
        reopened_keys = [k for s in (0, 1) for k in buffer.core.plan(s)]
        for key in reopened_keys[:2]:  # decisions after the checkpoint
            await client.request(make_group(key, 1), Ack)
        after = buffer.ledger.mark()
    async with make(transport, tmp_path, resume=ckpt) as restored:  # the same ledger, rewound
        assert restored.core.step == 1 and restored.core.version == 1
        assert len(restored.ledger.entries("trained")) == 4 and restored.ledger.entries("accepted")[-1].key == order[-1]
        assert len(restored.ledger.history()) == after + 1  # nothing erased: a rewind row added
    async with make(transport, tmp_path) as restarted:  # a restart replays the rewind too
        assert restarted.core.step == 1 and len(restarted.ledger.entries("accepted")) == 4


async def test_forged_requests_get_an_error_and_the_buffer_keeps_serving(transport: Transport, tmp_path: Path) -> None:
    async with make(transport, tmp_path) as buffer, Client(transport, buffer.endpoint) as client:
        for request, field in [
            (MicroBatchRequest(step=10**6, rank=0, world_size=2, index=0), "step=1000000"),
            (MicroBatchRequest(step=0, rank=5, world_size=2, index=0), "rank=5"),
            (MicroBatchRequest(step=0, rank=0, world_size=2, index=7), "index=7"),
        ]:
            with pytest.raises(RemoteError, match=f"MicroBatchRequest.{field}"):
                await asyncio.wait_for(client.request(request, MicroBatch), 10)
        for args, field in [
            ({"step": "0", "rollouts": "-2"}, "rollouts='-2'"),  # would have sliced from the end
            ({"step": "x"}, "step='x'"),
            ({}, "step is missing"),
        ]:
            with pytest.raises(RemoteError, match=f"ProtocolError.*args.{field}"):
                await asyncio.wait_for(client.request(Query(what="step_report", args=args), StepReport), 10)
        with pytest.raises(RemoteError, match="ProtocolError.*args.version='-1'"):
            await asyncio.wait_for(client.request(Query(what="evaluate", args={"version": "-1"}), StepReport), 10)
        plan = await client.request(PlanRequest(shard=0, num_shards=2, after_seq=-1, wait_s=0.1), DispatchPlan)
        assert plan.keys


async def test_mismatched_shards_and_world_size_are_named(transport: Transport, tmp_path: Path) -> None:
    async with make(transport, tmp_path) as buffer, Client(transport, buffer.endpoint) as client:
        try:
            await client.request(PlanRequest(shard=0, num_shards=3, after_seq=-1), DispatchPlan)
        except RemoteError as e:
            assert "runs with 3 shards, the buffer with 2" in str(e)
        else:
            raise AssertionError("a controller with the wrong shard count was served")
        # The buffer keeps serving after the bad request.
        plan = await client.request(PlanRequest(shard=0, num_shards=2, after_seq=-1, wait_s=0.1), DispatchPlan)
        assert plan.keys


async def test_every_ack_comes_after_its_decision_is_on_disk(transport: Transport, tmp_path: Path) -> None:
    """Offers that arrive together share a commit (group commit), and none is acknowledged
    before the ledger file holds it: what another process reads after each Ack."""
    import sqlite3

    def on_disk() -> int:
        db = sqlite3.connect(tmp_path / "a.db")
        try:
            return int(db.execute("SELECT COUNT(*) FROM decisions WHERE status = 'accepted'").fetchone()[0])
        finally:
            db.close()

    async with make(transport, tmp_path) as buffer, Client(transport, buffer.endpoint) as client:
        plans = [
            await client.request(PlanRequest(shard=s, num_shards=2, after_seq=-1, wait_s=0.1), DispatchPlan) for s in (0, 1)
        ]
        keys = [k for p in plans for k in p.keys]
        offers = [asyncio.ensure_future(client.request(make_group(key, 0), Ack)) for key in keys]
        acked = 0
        for done in asyncio.as_completed(offers):
            assert (await done).info["decision"] == "accepted"
            acked += 1
            assert on_disk() >= acked
        assert on_disk() == len(keys) == 4


def _bad(field: str) -> Callable[[ScoredGroup], ScoredGroup]:
    """A corruption of one field of a good group (n = 2, completion lengths >= 1)."""

    def corrupt(g: ScoredGroup) -> ScoredGroup:
        if field == "rollout_logprobs":  # one sample's log-probs one token short
            return dataclasses.replace(g, rollout_logprobs=[g.rollout_logprobs[0][:-1], g.rollout_logprobs[1]])
        if field == "rewards":  # NaN reward
            return dataclasses.replace(g, rewards=torch.tensor([float("nan"), 0.0]))
        if field == "advantages":  # a length-1 tensor that would broadcast over the group
            return dataclasses.replace(g, advantages=torch.tensor([0.5]))
        if field == "advantages inf":
            return dataclasses.replace(g, advantages=torch.tensor([float("inf"), 0.0]))
        if field == "finish_reasons":
            return dataclasses.replace(g, finish_reasons=["stop"])
        if field == "completion_ids":  # one sample too many for buffer.group_size
            return dataclasses.replace(g, completion_ids=[*g.completion_ids, g.completion_ids[0]])
        raise AssertionError(field)

    return corrupt


@pytest.mark.parametrize(
    "field", ["rollout_logprobs", "rewards", "advantages", "advantages inf", "finish_reasons", "completion_ids"]
)
async def test_a_malformed_group_is_refused_by_name_before_the_ledger(
    transport: Transport, tmp_path: Path, field: str
) -> None:
    async with make(transport, tmp_path) as buffer, Client(transport, buffer.endpoint) as client:
        plan = await client.request(PlanRequest(shard=0, num_shards=2, after_seq=-1, wait_s=0.1), DispatchPlan)
        key = plan.keys[0]
        with pytest.raises(RemoteError, match=f"ProtocolError.*{field.split()[0]}"):
            await client.request(_bad(field)(make_group(key, 0)), Ack)
        assert buffer.ledger.entries() == [], "the ledger recorded a refused group"
        # The buffer keeps serving, and the same key is accepted once well formed.
        reply = await client.request(make_group(key, 0, equal=False), Ack)
        assert reply.info["decision"] == "accepted"


async def test_a_full_disk_closes_the_buffer_before_it_runs_ahead_of_its_ledger(transport: Transport, tmp_path: Path) -> None:
    """A commit that fails (SQLite's page limit stands in for a full disk) is not
    acknowledged, and the buffer closes with the reason: a restart replays what the ledger has."""
    from yatt.errors import ActorFailed

    buffer = make(transport, tmp_path)
    await buffer.start()
    async with Client(transport, buffer.endpoint) as client:
        plan = await client.request(PlanRequest(shard=0, num_shards=2, after_seq=-1, wait_s=0.1), DispatchPlan)
        db = buffer.ledger._db
        db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
        with pytest.raises(RemoteError):
            for key in plan.keys * 50:  # payloads fill the last page
                await asyncio.wait_for(client.request(make_group(key, 0), Ack), 10)
    with pytest.raises(ActorFailed, match="no space left on device writing .*a.db"):
        await asyncio.wait_for(buffer.wait_closed(), 10)
    await buffer.close()
    restarted = make(transport, tmp_path)  # what it acknowledged is all the ledger has
    assert restarted.core.stats.accepted + sum(restarted.core.stats.filtered.values()) <= len(plan.keys)
    restarted.ledger.close()


async def test_a_rewind_can_give_the_trainer_group_a_new_size(transport: Transport, tmp_path: Path) -> None:
    """A re-planned run restarts its trainer group at another size: the rewind names it, the
    buffer splits the micro-batches for it and refuses ranks of the old size; a size the
    waves cannot split over is refused, naming the field, and changes nothing."""
    async with make(transport, tmp_path) as buffer, Client(transport, buffer.endpoint) as client:
        with pytest.raises(RemoteError, match=r"args.world_size=3: .*does not split evenly over 3 trainer ranks"):
            await client.request(Query(what="rewind", args={"world_size": "3"}), Ack)
        assert buffer.world_size == buffer.core.world_size == 2
        reply = await client.request(Query(what="rewind", args={"world_size": "1"}), Ack)
        assert buffer.world_size == buffer.core.world_size == 1
        assert reply.info == {"version": "0", "step": "0"}, "back to the start: nothing trained, step 0 assembling"
        keys = [k for s in (0, 1) for k in buffer.core.plan(s)]
        for key in sorted(keys, key=lambda k: buffer.core.position(k))[:2]:  # the first wave
            await client.request(make_group(key, 0), Ack)
        mb = await client.request(MicroBatchRequest(step=0, rank=0, world_size=1, index=0), MicroBatch)
        assert mb.input_ids.shape[0] == 4, "one rank takes the whole wave (2 groups x 2 samples)"
        with pytest.raises(RemoteError, match="runs with world size 2, the buffer with 1"):
            await client.request(MicroBatchRequest(step=0, rank=1, world_size=2, index=0), MicroBatch)


def turn_record(key: GroupKey, sample: int, turn: int, token: int) -> TurnRecord:
    return TurnRecord(
        group_key=key, sample=sample, turn=turn, token_ids=torch.tensor([token], dtype=torch.int32),
        logprobs=torch.tensor([-0.5]), policy_version=0, finish_reason="stop", obs_ids=torch.tensor([9], dtype=torch.int32),
        reward=float("nan"), tool_errors=0,
    )  # fmt: skip


async def test_an_episodes_turns_are_kept_until_its_group_is_decided(transport: Transport, tmp_path: Path) -> None:
    """Turn records survive a buffer restart (they are in the ledger), a re-sent one
    replaces the first, a bad sample index is refused naming it, and the group's decision
    drops them (its episodes are in its payload); a rewind drops every one."""
    async with make(transport, tmp_path) as buffer, Client(transport, buffer.endpoint) as client:
        plan = await client.request(PlanRequest(shard=0, num_shards=2, after_seq=-1, wait_s=0.1), DispatchPlan)
        key, other = plan.keys[0], plan.keys[1]
        for sample, turn, token in ((1, 0, 5), (0, 0, 3), (0, 1, 4), (0, 1, 7), (0, 0, 3)):
            await client.request(turn_record(key, sample, turn, token), Ack)
        await client.request(turn_record(other, 0, 0, 8), Ack)
        with pytest.raises(RemoteError, match=r"sample 2, turn 0: a group has samples 0..1"):
            await client.request(turn_record(key, 2, 0, 1), Ack)
    async with make(transport, tmp_path) as buffer, Client(transport, buffer.endpoint) as client:
        records = (await client.request(TurnsRequest(group_key=key), TurnRecords)).records
        assert [(r.sample, r.turn, r.token_ids.tolist()) for r in records] == [(0, 0, [3]), (0, 1, [7]), (1, 0, [5])]
        # An episode run again from its start (its environment diverged) first forgets its own turns.
        records = (await client.request(TurnsRequest(group_key=key, drop_sample=1), TurnRecords)).records
        assert [(r.sample, r.turn) for r in records] == [(0, 0), (0, 1)]
        await client.request(make_group(key, 0), Ack)
        assert (await client.request(TurnsRequest(group_key=key), TurnRecords)).records == []
        late = await client.request(turn_record(key, 0, 2, 6), Ack)  # a slow controller's, after the decision
        assert late.info["recorded"].startswith("no") and (await client.request(TurnsRequest(group_key=key), TurnRecords)).records == []
        # A step's end supersedes what was dispatched past it: those episodes' turns go at the next version.
        third = (await client.request(PlanRequest(shard=1, num_shards=2, after_seq=-1, wait_s=0.1), DispatchPlan)).keys[0]
        await client.request(turn_record(third, 0, 0, 1), Ack)
        buffer.core.attempts[buffer.core.position(third)] = third.attempt + 1  # (as _supersede_beyond_cursor does)
        await client.request(PolicyVersion(version=1), Ack)
        assert (await client.request(TurnsRequest(group_key=third), TurnRecords)).records == []
        assert len((await client.request(TurnsRequest(group_key=other), TurnRecords)).records) == 1
        await client.request(Query(what="rewind"), Ack)
        assert (await client.request(TurnsRequest(group_key=other), TurnRecords)).records == []
