"""The generator actor over loopback: concurrent clients batched into engine calls, the
on-policy wait for a version, and a weight update from a real (1-rank, gloo) FSDP2
trainer after which the generator's logprobs match the trainer's own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from protocols.messages import (
    Ack,
    Completions,
    GenerateRequest,
    GroupKey,
    MicroBatch,
    Query,
    SamplingParams,
    WeightUpdate,
)
from workers.engines import make_engine
from workers.generator import Generator
from yatt.actor import Client
from yatt.config import AlgorithmConfig, GeneratorConfig, ModelConfig, TrainerConfig
from yatt.transport import Transport


@pytest.fixture
async def transport() -> AsyncIterator[Transport]:
    """A fresh transport that must end the test with no socket open."""
    t = Transport()
    yield t
    left = t.open_sockets()
    t.close()
    assert left == [], f"sockets left open: {left}"

PROMPT = torch.tensor([1, 17, 42, 99, 250], dtype=torch.int32)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def request(i: int, *, n: int = 2, min_version: int = 0) -> GenerateRequest:
    return GenerateRequest(
        group_key=GroupKey(epoch=0, shard=i % 2, prompt_index=i),
        prompt_ids=PROMPT,
        n=n,
        sampling=SamplingParams(max_new_tokens=6, seed=i, top_k=-1),
        min_policy_version=min_version,
    )


@pytest.mark.parametrize("backend", ["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
async def test_two_clients_at_once_are_batched(transport: Transport, tiny_model_dir: Path, backend: str) -> None:
    config = GeneratorConfig(backend=backend, batch_wait_ms=50, vllm_max_model_len=256)
    engine = await asyncio.to_thread(make_engine, str(tiny_model_dir), config)
    async with Generator(transport, endpoint="tcp://127.0.0.1:*", engine=engine, config=config) as gen:
        async with Client(transport, gen.endpoint) as a, Client(transport, gen.endpoint) as b:
            replies = await asyncio.gather(
                *(c.request(request(i), Completions, timeout=300) for i, c in enumerate([a, b] * 4))
            )
    assert [r.group_key.prompt_index for r in replies] == list(range(8))
    for reply in replies:
        assert len(reply.completions) == 2
        for c in reply.completions:
            assert 1 <= len(c.token_ids) <= 6 and c.logprobs.shape == c.token_ids.shape
            assert c.policy_version_min == c.policy_version_max == 0
    assert gen.batches < 8, "concurrent requests from two clients were not batched"


async def test_a_slow_engine_waits_longer_for_company(transport: Transport, tiny_model_dir: Path) -> None:
    """After a 1 s engine call, a request 100 ms behind another still joins its call
    (batch_wait_share 0.2 of the last call: 200 ms), though batch_wait_ms is 5."""
    from workers.engines.hf import HFEngine

    class SlowEngine(HFEngine):  # the real engine, one second slower per call
        def generate(self, requests):  # type: ignore[no-untyped-def]
            time.sleep(1.0)
            return super().generate(requests)

    config = GeneratorConfig(batch_wait_ms=5, batch_wait_share=0.2)
    engine = await asyncio.to_thread(SlowEngine, str(tiny_model_dir), config)
    async with Generator(transport, endpoint="tcp://127.0.0.1:*", engine=engine, config=config) as gen:
        async with Client(transport, gen.endpoint) as client:
            await client.request(request(0), Completions, timeout=300)  # the 1 s call it learns from
            assert gen.batches == 1
            first = asyncio.ensure_future(client.request(request(1), Completions, timeout=300))
            await asyncio.sleep(0.1)
            second = asyncio.ensure_future(client.request(request(2), Completions, timeout=300))
            await asyncio.gather(first, second)
            assert gen.batches == 2, "the late request got an engine call of its own"


async def test_on_policy_request_waits_for_its_version(transport: Transport, tiny_model_dir: Path) -> None:
    config = GeneratorConfig()
    engine = await asyncio.to_thread(make_engine, str(tiny_model_dir), config)
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    async with Generator(transport, endpoint="tcp://127.0.0.1:*", engine=engine, config=config) as gen:
        async with Client(transport, gen.endpoint) as client:
            waiting = asyncio.ensure_future(client.request(request(0, min_version=1), Completions, timeout=300))
            await asyncio.sleep(0.3)
            assert not waiting.done(), "a version-1 request was served by version 0"
            names = list(state)
            half = len(names) // 2
            for i, chunk in enumerate((names[:half], names[half:])):
                ack = await client.request(
                    WeightUpdate(version=1, bucket_index=i, num_buckets=2, names=chunk, tensors=[state[n] for n in chunk]),
                    Ack,
                )
                assert ack.seq == 1
            reply = await asyncio.wait_for(waiting, 300)
            assert all(c.policy_version_min == 1 for c in reply.completions)
            assert (await client.request(Query(what="version"), Ack)).seq == 1


def _one_rank_trainer(tiny_model_dir: Path, tmp_path: Path) -> tuple[object, list[WeightUpdate], torch.Tensor]:
    """Train one step on a 1-rank gloo group; return the trainer, its version-1 buckets and
    its logprobs of a fixed sequence."""
    from workers.trainer import Trainer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    trainer = Trainer(
        ModelConfig(), TrainerConfig(lr=1e-2, world_size=1), AlgorithmConfig(), model_path=str(tiny_model_dir)
    )
    ids = torch.tensor([[1, 17, 42, 99, 250, 7, 8, 9]])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 5:] = True
    mb = MicroBatch(
        step=0,
        rank=0,
        index=0,
        count=1,
        input_ids=ids,
        attention_mask=torch.ones_like(mask),
        loss_mask=mask,
        rollout_logprobs=torch.zeros(ids.shape),
        advantages=mask.float(),
        policy_versions=torch.zeros(1, dtype=torch.int64),
        group_keys=[GroupKey(epoch=0, shard=0, prompt_index=0)],
    )
    trainer.train_step([mb])
    buckets = list(trainer.weight_buckets(1, 1 << 16))
    logprobs = trainer.logprobs(ids, torch.ones_like(mask))[0, 5:]
    return trainer, buckets, logprobs


async def test_logprobs_match_the_trainer_after_a_weight_update(
    transport: Transport, tiny_model_dir: Path, tmp_path: Path
) -> None:
    try:
        _, buckets, trainer_logprobs = await asyncio.to_thread(_one_rank_trainer, tiny_model_dir, tmp_path)
        assert len(buckets) > 1, "the update should travel in several buckets"
        config = GeneratorConfig()
        engine = await asyncio.to_thread(make_engine, str(tiny_model_dir), config)
        before = engine.sequence_logprobs([1, 17, 42, 99, 250], [7, 8, 9])
        async with Generator(transport, endpoint="tcp://127.0.0.1:*", engine=engine, config=config) as gen:
            async with Client(transport, gen.endpoint) as client:
                for bucket in buckets:
                    await client.request(bucket, Ack)
            after = engine.sequence_logprobs([1, 17, 42, 99, 250], [7, 8, 9])
        assert gen.version == 1
        assert torch.allclose(torch.tensor(after), trainer_logprobs.float(), atol=1e-5)
        assert not torch.allclose(torch.tensor(before), trainer_logprobs.float(), atol=1e-3), "the step changed nothing"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
