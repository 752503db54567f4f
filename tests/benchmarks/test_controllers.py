"""The controllers benchmark: its quick form end to end (every figure and ratio present,
finite, positive and consistent; samples delivered; the plot written; no process left),
the fake buffer's key accounting, and refused options."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from benchmarks.controllers import prompts_for
from benchmarks.controllers_fakes import FakeBuffer, KeyWindow
from protocols.messages import (
    Ack,
    DispatchPlan,
    GroupKey,
    Metrics,
    PlanRequest,
    Query,
    ScoredGroup,
)
from yatt.runtime.actor import Client
from yatt.runtime.transport import Transport, TransportConfig

REPO = Path(__file__).resolve().parents[2]
PREFIXES = ("controllers_{n}", "one_process_{n}_shards")
PER_PREFIX = (
    "samples_per_s",
    "cpu_us_per_sample",
    "generator_cpu_us_per_sample",
    "reward_cpu_us_per_sample",
    "buffer_cpu_us_per_sample",
    "main_cpu_us_per_sample",
    "cpu_util_controller",
    "cpu_util_generator",
    "cpu_util_reward",
    "cpu_util_buffer",
    "cpu_cores_total",
    "all_cpu_us_per_sample",
    "plans_per_group",
)


def _tagged(tag: str) -> list[psutil.Process]:
    """Live processes whose environment carries ``BENCH_TEST_TAG=tag`` (inherited by children)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("BENCH_TEST_TAG") == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.mark.slow
def test_quick_run_reports_every_figure_and_leaves_no_process(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "controllers", "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        env={**os.environ, "BENCH_TEST_TAG": tag},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    left = _tagged(tag)
    assert not left, f"the benchmark left processes behind: {[p.cmdline() for p in left]}"
    data: dict[str, Any] = json.loads((tmp_path / "controllers.json").read_text())
    figures, ratios = data["figures"], data["ratios"]
    expected = {f"{p.format(n=n)}_{k}" for n in (1, 2) for p in PREFIXES for k in PER_PREFIX}
    expected |= {"samples_per_s_per_controller_1", "samples_per_s_per_controller_2"}
    assert set(figures) == expected
    assert set(ratios) == {
        "controllers_1_vs_one_process",
        "controllers_2_vs_one_process",
        "scaling_2_vs_1",
        "one_process_scaling_2_vs_1",
    }
    for key, value in {**figures, **ratios}.items():
        # This process (the registry) may use less than one 10 ms clock tick in a window.
        least = 0.0 if key.endswith("_main_cpu_us_per_sample") else math.ulp(0.0)
        assert math.isfinite(value) and value >= least, f"{key} = {value}"
    for n in (1, 2):
        # Samples really arrived: at least a few groups of 8 in a 1.5 s window.
        assert figures[f"controllers_{n}_samples_per_s"] * 1.5 >= 8 * 10
        assert figures[f"one_process_{n}_shards_samples_per_s"] * 1.5 >= 8 * 10
        assert figures[f"samples_per_s_per_controller_{n}"] == pytest.approx(
            figures[f"controllers_{n}_samples_per_s"] / n
        )
        assert ratios[f"controllers_{n}_vs_one_process"] == pytest.approx(
            figures[f"controllers_{n}_samples_per_s"] / figures[f"one_process_{n}_shards_samples_per_s"]
        )
    assert ratios["scaling_2_vs_1"] == pytest.approx(
        figures["controllers_2_samples_per_s"] / figures["controllers_1_samples_per_s"]
    )
    assert ratios["one_process_scaling_2_vs_1"] == pytest.approx(
        figures["one_process_2_shards_samples_per_s"] / figures["one_process_1_shards_samples_per_s"]
    )
    assert not any("duplicate" in note for note in data["notes"]), data["notes"]
    plot = data["plots"]["samples_per_s"]
    assert [s["x"] for s in plot["series"]] == [[1.0, 2.0], [1.0, 2.0]]
    assert (tmp_path / plot["png"]).stat().st_size > 0


def test_key_window_hands_out_each_key_once_and_counts_a_group_once() -> None:
    keys = KeyWindow(num_shards=2, window=3, num_prompts=8)
    first = keys.keys(1)
    assert len(first) == 3 and all(k.shard == 1 and k.prompt_index % 2 == 1 for k in first)
    seen = set(first) | set(keys.keys(0))
    assert len(seen) == 6
    for _ in range(20):  # deliver the oldest key of shard 1, many times over
        key = keys.keys(1)[0]
        seq = keys.seq(1)
        assert keys.deliver(key, samples=8)
        assert keys.seq(1) == seq + 1 and keys.seq(0) == 0
        assert key not in keys.keys(1) and len(keys.keys(1)) == 3
        fresh = keys.keys(1)[-1]
        assert fresh not in seen, f"{fresh} was handed out before"
        seen.add(fresh)
        assert not keys.deliver(key, samples=8), "a second delivery counted"
    assert (keys.delivered_groups, keys.delivered_samples, keys.duplicates) == (20, 160, 20)
    # Keys run through the prompts epoch by epoch: prompt i of shard i mod 2.
    assert {k.epoch for k in seen} == {0, 1, 2, 3, 4, 5}
    assert not keys.deliver(GroupKey(epoch=0, shard=5, prompt_index=5), samples=8)  # no such shard
    assert keys.delivered_groups == 20


def _group(key: GroupKey) -> ScoredGroup:
    n = 2
    return ScoredGroup(
        group_key=key,
        prompt_ids=torch.tensor([1, 2], dtype=torch.int32),
        completion_ids=[torch.tensor([3], dtype=torch.int32)] * n,
        rollout_logprobs=[torch.tensor([-1.0])] * n,
        rewards=torch.zeros(n),
        advantages=torch.zeros(n),
        policy_versions=torch.zeros(n, dtype=torch.int64),
        finish_reasons=["length"] * n,
    )


async def test_fake_buffer_answers_the_long_poll_when_a_group_arrives() -> None:
    async with Transport(TransportConfig()) as transport:
        async with FakeBuffer(transport, endpoint="inproc://fake-buffer", window=2) as buffer:
            async with Client(transport, buffer.endpoint) as client:
                await client.request(Query(what="reset", args={"num_shards": "2"}), Ack)
                plan = await client.request(
                    PlanRequest(shard=0, num_shards=2, after_seq=-1, wait_s=5), DispatchPlan
                )
                assert plan.plan_seq == 0 and len(plan.keys) == 2
                poll = asyncio.ensure_future(
                    client.request(
                        PlanRequest(shard=0, num_shards=2, after_seq=plan.plan_seq, wait_s=30), DispatchPlan
                    )
                )
                await asyncio.sleep(0.05)
                assert not poll.done(), "answered the long poll with an unchanged plan"
                ack = await client.request(_group(plan.keys[0]), Ack)
                assert ack.info["decision"] == "accepted"
                new = await asyncio.wait_for(poll, 5)
                assert new.plan_seq == 1 and new.keys[0] == plan.keys[1] and plan.keys[0] not in new.keys
                again = await client.request(_group(plan.keys[0]), Ack)
                assert again.info["decision"] == "duplicate"
                stats = await client.request(Query(what="stats"), Metrics)
                assert stats.values == {"groups": 1.0, "samples": 2.0, "duplicates": 1.0, "plans": 2.0}


def test_prompts_belong_to_their_shard() -> None:
    prompts = prompts_for(4, prompt_tokens=5)
    assert len(prompts) % 4 == 0 and all(
        p.index == i and len(p.prompt_ids) == 5 for i, p in enumerate(prompts)
    )
