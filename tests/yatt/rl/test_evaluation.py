"""Evaluation rounds: eval/* by hand on a small case, and a round run by the buffer actor
beside training (its keys in the plans, its results outside the ledger)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from protocols.messages import Ack, DispatchPlan, PlanRequest, Query, ScoredGroup, StepReport
from tests.yatt.rl.test_buffer import make
from tests.yatt.rl.test_sampling import make_group
from yatt.errors import ProtocolError, RemoteError
from yatt.rl.config import EvalConfig
from yatt.rl.evaluation import GREEDY, SAMPLED, EvalRound, eval_key, eval_metrics, eval_version, is_eval
from yatt.runtime.actor import Client
from yatt.runtime.transport import Transport


def result(key_prompt: int, mode: int, rewards: list[float], exact: list[float], *, version: int = 3) -> ScoredGroup:
    key = eval_key(version, mode, key_prompt, num_shards=2)
    group = make_group(key, version, n=len(rewards))
    reasons = ["length" if r == 0 else "stop" for r in rewards]
    return dataclasses.replace(
        group, rewards=torch.tensor(rewards), scores={"exact": torch.tensor(exact)}, finish_reasons=reasons,
        advantages=torch.zeros(len(rewards)),
    )


def test_eval_metrics_by_hand() -> None:
    # 3 prompts. greedy rewards 1, 0, 0.5; sampled (n=2): [1, 0], [0, 0], [0.5, 1].
    greedy = [result(0, GREEDY, [1.0], [1.0]), result(1, GREEDY, [0.0], [0.0]), result(2, GREEDY, [0.5], [0.0])]
    sampled = [
        result(0, SAMPLED, [1.0, 0.0], [1.0, 0.0]),
        result(1, SAMPLED, [0.0, 0.0], [0.0, 0.0]),
        result(2, SAMPLED, [0.5, 1.0], [0.0, 1.0]),
    ]
    m = eval_metrics(greedy, sampled, n=2, threshold=1.0)
    assert m["eval/prompts"] == 3
    assert m["eval/reward/greedy"] == pytest.approx(0.5)
    assert m["eval/exact/greedy"] == pytest.approx(1 / 3)
    assert m["eval/reward/accuracy"] == pytest.approx(1 / 3)  # 0.5 does not reach the threshold
    assert m["eval/reward/mean@2"] == pytest.approx(2.5 / 6)
    assert m["eval/exact/mean@2"] == pytest.approx(2 / 6)
    assert m["eval/exact/pass@2"] == pytest.approx(2 / 3)  # prompts 0 and 2 have a passing sample
    assert m["eval/reward/pass@2"] == pytest.approx(2 / 3)
    assert m["eval/response_length/clip_ratio"] == pytest.approx(1 / 3)  # greedy of prompt 1 hit the limit
    assert m["eval/policy_version"] == 3
    assert eval_metrics(greedy, sampled, n=2, threshold=0.0)["eval/reward/pass@2"] == 1.0  # every sample passes 0


def test_eval_keys_name_their_version_and_a_round_keeps_only_its_own() -> None:
    key = eval_key(7, SAMPLED, 5, num_shards=2)
    assert is_eval(key) and eval_version(key) == 7 and key.shard == 1
    round_ = EvalRound(EvalConfig(n=2), version=3, num_prompts=3, num_shards=2)
    assert len(round_.keys) == 6 and [k.prompt_index for k in round_.plan(1)] == [1, 1]
    assert round_.offer(result(1, GREEDY, [1.0], [1.0])) == "evaluated"
    assert round_.offer(result(1, GREEDY, [1.0], [1.0])) == "duplicate"
    with pytest.raises(ProtocolError, match="not a key"):
        round_.offer(result(1, GREEDY, [1.0], [1.0], version=4))
    with pytest.raises(ProtocolError, match="2 samples"):
        round_.offer(result(1, SAMPLED, [1.0], [1.0]))  # a sampled group of 1
    with pytest.raises(ProtocolError, match="finite"):
        round_.offer(result(2, GREEDY, [float("nan")], [1.0]))
    assert [k.prompt_index for k in round_.plan(1)] == [1] and not round_.done


async def test_the_buffer_runs_an_evaluation_beside_training(transport: Transport, tmp_path: Path) -> None:
    buffer = make(transport, tmp_path)
    buffer.num_eval_prompts, buffer.eval_config = 3, EvalConfig(n=2)
    async with buffer, Client(transport, buffer.endpoint) as client:
        async def plan(shard: int) -> DispatchPlan:
            return await client.request(PlanRequest(shard=shard, num_shards=2, after_seq=-1, wait_s=0.1), DispatchPlan)

        training = [k for s in (0, 1) for k in (await plan(s)).keys]
        assert training and not any(is_eval(k) for k in training)
        asked = asyncio.ensure_future(
            client.request(Query(what="evaluate", args={"version": "0", "rollouts": "2"}), StepReport, timeout=30)
        )
        await asyncio.sleep(0.2)
        keys = {s: (await plan(s)).keys for s in (0, 1)}
        evals = [k for s in (0, 1) for k in keys[s] if is_eval(k)]
        assert len(evals) == 6 and all(k.shard == s for s in (0, 1) for k in keys[s])
        assert all(is_eval(k) for k in keys[0][:4]), "eval keys come first in the plan"
        exact = {0: 1.0, 1: 0.0, 2: 1.0}
        for key in evals:
            n = 1 if key.attempt == GREEDY else 2
            group = result(key.prompt_index, key.attempt, [exact[key.prompt_index]] * n, [exact[key.prompt_index]] * n, version=0)
            reply = await client.request(group, Ack)
            assert reply.info["decision"] == "evaluated"
            assert not asked.done() or key == evals[-1]
        report = await asyncio.wait_for(asked, 30)
        assert report.step == 0 and report.values["eval/exact/greedy"] == pytest.approx(2 / 3)
        assert report.values["eval/exact/pass@2"] == pytest.approx(2 / 3) and len(report.groups) == 2
        # Done: no eval key is planned any more; a late result is ignored; the ledger has none.
        after = [k for s in (0, 1) for k in (await plan(s)).keys]
        assert after and not any(is_eval(k) for k in after)
        late = await client.request(result(0, GREEDY, [1.0], [1.0], version=0), Ack)
        assert late.info["decision"] == "duplicate"
        stale = await client.request(result(0, GREEDY, [1.0], [1.0], version=5), Ack)
        assert stale.info["decision"] == "not evaluating this version"
        assert not [e for e in buffer.ledger.entries() if e.key.epoch < 0]
        again = await client.request(Query(what="evaluate", args={"version": "0"}), StepReport, timeout=5)
        assert again.values == report.values  # asked again (a lost reply): the same round answers
        # Training goes on as before: its groups are still accepted.
        reply = await client.request(make_group(training[0], 0), Ack)
        assert reply.info["decision"] in ("accepted", "filtered: all rewards equal")


async def test_a_run_without_held_out_prompts_refuses_to_evaluate(transport: Transport, tmp_path: Path) -> None:
    async with make(transport, tmp_path) as buffer, Client(transport, buffer.endpoint) as client:
        with pytest.raises(RemoteError, match="eval_split"):
            await client.request(Query(what="evaluate", args={"version": "0"}), StepReport, timeout=5)
        buffer.num_eval_prompts = 3
        with pytest.raises(RemoteError, match="once it is published"):  # a version no generator can have
            await client.request(Query(what="evaluate", args={"version": "10"}), StepReport, timeout=5)
