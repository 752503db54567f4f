"""The generator actor over loopback: concurrent clients batched into engine calls, the
on-policy wait for a version, and a weight update from a real (1-rank, gloo) FSDP2
trainer after which the generator's logprobs match the trainer's own."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Literal

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from protocols.messages import (
    Ack,
    Completions,
    GenerateRequest,
    GroupKey,
    Metrics,
    MicroBatch,
    Query,
    SamplingParams,
    WeightUpdate,
)
from workers.engines import make_engine
from workers.generator import Generator
from yatt.errors import ProtocolError, RemoteError
from yatt.rl.config import AlgorithmConfig, GeneratorConfig, LoRAConfig, ModelConfig, TrainerConfig
from yatt.runtime.actor import Client
from yatt.runtime.registry import Directory, Registration, Registry
from yatt.runtime.transport import Transport


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
async def test_two_clients_at_once_are_batched(transport: Transport, tiny_model_dir: Path, backend: Literal["transformers", "vllm"]) -> None:
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


async def test_a_bad_request_does_not_fail_its_batch_mates(transport: Transport, tiny_model_dir: Path) -> None:
    """A prompt token past the vocabulary (what a fuzzer or a broken peer sends) fails its
    own request only; the good requests batched with it are served."""
    config = GeneratorConfig(batch_wait_ms=200)
    engine = await asyncio.to_thread(make_engine, str(tiny_model_dir), config)
    bad = dataclasses.replace(request(9), prompt_ids=torch.tensor([1, 10**6], dtype=torch.int32))
    async with Generator(transport, endpoint="tcp://127.0.0.1:*", engine=engine, config=config) as gen:
        async with Client(transport, gen.endpoint) as client:
            replies = await asyncio.gather(
                client.request(request(0), Completions, timeout=300),
                client.request(bad, Completions, timeout=300),
                client.request(request(1), Completions, timeout=300),
                return_exceptions=True,
            )
    assert isinstance(replies[1], RemoteError)
    assert all(isinstance(r, Completions) for r in (replies[0], replies[2])), replies


async def test_a_restarted_trainer_groups_weights_replace_a_dead_ones(transport: Transport, tiny_model_dir: Path) -> None:
    """After the trainer group went back to a checkpoint (incarnation 1, version 1), the
    generator takes its weights over the dead group's version 3, and refuses the dead
    group's late updates."""
    config = GeneratorConfig()
    engine = await asyncio.to_thread(make_engine, str(tiny_model_dir), config)
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    names = list(state)

    def update(version: int, incarnation: int) -> WeightUpdate:
        return WeightUpdate(
            version=version, incarnation=incarnation, bucket_index=0, num_buckets=1,
            names=names, tensors=[state[n] for n in names],
        )  # fmt: skip

    async with Generator(transport, endpoint="tcp://127.0.0.1:*", engine=engine, config=config) as gen:
        async with Client(transport, gen.endpoint) as client:
            assert (await client.request(update(3, 0), Ack)).info["status"] == "applied"
            assert (await client.request(update(1, 0), Ack)).info["status"] == "already applied"
            assert (await client.request(update(1, 1), Ack)).info["status"] == "applied"
            assert gen.version == 1 and gen.incarnation == 1
            with pytest.raises(RemoteError, match="incarnation=0: the trainer group of incarnation 1 replaced it"):
                await client.request(update(4, 0), Ack)
            assert gen.version == 1
            reply = await client.request(request(0), Completions, timeout=300)
            assert all(c.policy_version_min == 1 for c in reply.completions)


@pytest.mark.parametrize("engine_on", ["transformers-cpu", pytest.param("vllm-cuda", marks=[pytest.mark.gpu, pytest.mark.vllm])])
async def test_a_parked_generator_leaves_the_pool_fails_what_it_holds_and_comes_back(
    transport: Transport, tiny_model_dir: Path, engine_on: str
) -> None:
    """``Query("park")`` (a re-planned partial run): the generator leaves the directory,
    fails the requests it holds (queued or waiting for a version: their callers re-issue
    them) and those that still reach it, and sleeps (on GPU, vLLM's sleep mode gives the
    memory back to training); ``Query("unpark")`` registers it again, and the next weight
    update wakes it to serve."""
    gpu = engine_on == "vllm-cuda"
    config = GeneratorConfig(backend="vllm", vllm_max_model_len=256, vllm_gpu_memory_utilization=0.3, seed=0) if gpu else GeneratorConfig()
    engine = await asyncio.to_thread(make_engine, str(tiny_model_dir), config, device="cuda" if gpu else "cpu")
    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    update = WeightUpdate(version=1, bucket_index=0, num_buckets=1, names=list(state), tensors=list(state.values()))
    async with (
        Registry(transport, endpoint="tcp://127.0.0.1:*", publish_endpoint="tcp://127.0.0.1:*") as registry,
        Directory(transport, registry.endpoint) as directory,
        Generator(transport, endpoint="tcp://127.0.0.1:*", engine=engine, config=config) as gen,
        Registration(transport, registry.endpoint, gen.info()) as registration,
        Client(transport, gen.endpoint) as client,
    ):
        with pytest.raises(RemoteError, match="not registered by its own process"):
            await client.request(Query(what="park"), Ack)  # (a colocated engine's case)
        gen.registration = registration
        await directory.wait_until(lambda d: len(d.members("generator")) == 1, timeout=10)
        free_awake = torch.cuda.mem_get_info()[0] if gpu else 0
        await client.request(Query(what="sleep"), Ack)  # as between two partial steps
        held = asyncio.ensure_future(client.request(request(0), Completions, timeout=300))  # waits for a wake
        waiting = asyncio.ensure_future(client.request(request(3, min_version=1), Completions, timeout=300))
        await asyncio.sleep(0.3)
        assert not held.done() and not waiting.done()
        assert (await client.request(Query(what="park"), Ack)).info["status"] == "parked"
        await directory.wait_until(lambda d: not d.members("generator"), timeout=10)
        for failed in (held, waiting):
            with pytest.raises(RemoteError, match="was parked"):
                await asyncio.wait_for(failed, 10)
        with pytest.raises(RemoteError, match="was parked"):
            await client.request(request(1), Completions, timeout=10)
        stats = await client.request(Query(what="stats"), Metrics)
        assert stats.values["generator/parks"] == 1 and stats.values["generator/sleeps"] == 2
        if gpu:  # parked, it holds neither KV cache nor weights on the GPU
            assert torch.cuda.mem_get_info()[0] - free_awake > 100 << 20, "parked, it freed less than 100 MiB"
        assert (await client.request(Query(what="unpark"), Ack)).info["status"] == "in the pool"
        await directory.wait_until(lambda d: len(d.members("generator")) == 1, timeout=10)
        sleeping = asyncio.ensure_future(client.request(request(2), Completions, timeout=300))
        await asyncio.sleep(0.2)
        assert not sleeping.done(), "served before a weight update woke it"
        assert (await client.request(update, Ack)).info["status"] == "applied"
        reply = await asyncio.wait_for(sleeping, 300)
        assert all(c.policy_version_min == 1 for c in reply.completions)


SEQ_PROMPT = [1, 17, 42, 99, 250]
COMPLETION = [(7 * i + 3) % 500 + 3 for i in range(32)]
BOUNDS = {
    ("float32", "transformers"): 1e-5,
    ("bfloat16", "transformers"): 1e-5,
    ("float32", "vllm"): 1e-4,
    ("bfloat16", "vllm"): 0.02,
}
"""Max abs log-prob difference, trainer vs generator on the same weights, per model.dtype
and engine. Measured here (tiny model, 32 completion tokens, AMX CPU): float32 5e-7
(transformers) and 1e-6 (vLLM); bfloat16 5e-7 for transformers (the same bf16 module code
on both sides) and 4e-3 for vLLM (its own CPU kernels round to bf16 in other places);
the bounds keep a 5-20x margin."""


def _one_rank_trainer(
    tiny_model_dir: Path, tmp_path: Path, dtype: str, lora: LoRAConfig | None = None
) -> tuple[torch.dtype, list[WeightUpdate], torch.Tensor]:
    """Train one step on a 1-rank gloo group (``lora``: its adapters only); return its
    compute dtype, its version-1 buckets and its logprobs of the fixed completion."""
    from workers.trainer import Trainer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    trainer = Trainer(
        ModelConfig(dtype=dtype, lora=lora or LoRAConfig()),  # type: ignore[arg-type]
        TrainerConfig(lr=1e-2, world_size=1),
        AlgorithmConfig(),
        model_path=str(tiny_model_dir),
    )
    ids = torch.tensor([SEQ_PROMPT + COMPLETION])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, len(SEQ_PROMPT) :] = True
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
    logprobs = trainer.logprobs(ids, torch.ones_like(mask))[0, len(SEQ_PROMPT) :]
    return trainer.compute_dtype, buckets, logprobs


@pytest.mark.parametrize("backend", ["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_logprobs_match_the_trainer_after_a_weight_update(
    transport: Transport, tiny_model_dir: Path, tmp_path: Path, dtype: str, backend: str
) -> None:
    try:
        compute, buckets, trainer_logprobs = await asyncio.to_thread(_one_rank_trainer, tiny_model_dir, tmp_path, dtype)
        assert compute == getattr(torch, dtype)
        assert len(buckets) > 1, "the update should travel in several buckets"
        assert {t.dtype for b in buckets for t in b.tensors} == {compute}
        config = GeneratorConfig(backend=backend, vllm_enforce_eager=True, vllm_max_model_len=256)  # type: ignore[arg-type]
        engine = await asyncio.to_thread(make_engine, str(tiny_model_dir), config, dtype=dtype)  # type: ignore[arg-type]
        before = torch.tensor(engine.sequence_logprobs(SEQ_PROMPT, COMPLETION))
        async with Generator(transport, endpoint="tcp://127.0.0.1:*", engine=engine, config=config) as gen:
            async with Client(transport, gen.endpoint) as client:
                for bucket in buckets:
                    await client.request(bucket, Ack)
            after = torch.tensor(engine.sequence_logprobs(SEQ_PROMPT, COMPLETION))
        assert gen.version == 1
        diff = (after - trainer_logprobs.float()).abs().max().item()
        print(f"{dtype} {backend}: max |trainer - engine| log-prob = {diff:.2e}")
        assert diff <= BOUNDS[(dtype, backend)]
        changed = (before - trainer_logprobs.float()).abs().max().item()
        assert changed > 10 * BOUNDS[(dtype, backend)], f"the step changed the log-probs by only {changed:.2e}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
async def test_lora_adapters_reach_the_engine_and_match_the_trainer(
    transport: Transport, tiny_model_dir: Path, tmp_path: Path, backend: str
) -> None:
    """LoRA: the trainer's update carries the adapters only; the engine (vLLM: a peft adapter
    directory loaded under a new adapter id) then samples with the trainer's log-probs. A
    full-weight update or a NaN adapter is refused and the engine keeps its adapter."""
    lora = LoRAConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"])
    try:
        _, buckets, trainer_logprobs = await asyncio.to_thread(_one_rank_trainer, tiny_model_dir, tmp_path, "float32", lora)
        sent = [(n, t) for b in buckets for n, t in zip(b.names, b.tensors, strict=True)]
        assert sent and all(".lora_A." in n or ".lora_B." in n for n, _ in sent)
        config = GeneratorConfig(backend=backend, vllm_enforce_eager=True, vllm_max_model_len=256)  # type: ignore[arg-type]
        engine = await asyncio.to_thread(make_engine, str(tiny_model_dir), config, dtype="float32", lora=lora)
        before = torch.tensor(engine.sequence_logprobs(SEQ_PROMPT, COMPLETION))
        bound = BOUNDS[("float32", backend)]
        async with Generator(transport, endpoint="tcp://127.0.0.1:*", engine=engine, config=config) as gen:
            async with Client(transport, gen.endpoint) as client:
                for bucket in buckets:
                    await client.request(bucket, Ack)
                reply = await client.request(request(0, min_version=1), Completions, timeout=300)
            after = torch.tensor(engine.sequence_logprobs(SEQ_PROMPT, COMPLETION))
            diff = (after - trainer_logprobs.float()).abs().max().item()
            print(f"LoRA {backend}: max |trainer - engine| log-prob = {diff:.2e}")
            assert gen.version == 1 and diff <= bound
            assert (before - trainer_logprobs.float()).abs().max().item() > 10 * bound, "the step changed nothing"
            assert all(c.policy_version_min == 1 for c in reply.completions)
            for c in reply.completions:  # sampled with the adapter too (temperature 1)
                rescored = engine.sequence_logprobs(PROMPT.tolist(), c.token_ids.tolist())
                assert (c.logprobs - torch.tensor(rescored)).abs().max().item() <= bound

            full = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
            with pytest.raises(ProtocolError, match="does not have"):
                engine.update_weights(full.items())
            with pytest.raises(ProtocolError, match="NaN"):
                engine.update_weights((n, torch.full_like(t, float("nan"))) for n, t in sent)
            kept = torch.tensor(engine.sequence_logprobs(SEQ_PROMPT, COMPLETION))
            assert torch.equal(kept, after), "a refused update changed the adapter"
            # Zero lora_B: the adapter adds nothing, the base model's log-probs come back.
            engine.update_weights((n, torch.zeros_like(t) if ".lora_B." in n else t) for n, t in sent)
            base = torch.tensor(engine.sequence_logprobs(SEQ_PROMPT, COMPLETION))
            assert (base - before).abs().max().item() <= bound
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``state`` moved by seeded noise: weights that differ from the engine's, so a test can
    see whether they were applied."""
    noise = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=noise, dtype=t.dtype) for n, t in state.items()}


def push(state: dict[str, torch.Tensor], *, version: int, incarnation: int, buckets: int) -> list[WeightUpdate]:
    """``state`` as trainer rank 0 sends it: ``buckets`` WeightUpdates in order."""
    names = list(state)
    cuts = [len(names) * i // buckets for i in range(buckets + 1)]
    return [
        WeightUpdate(
            version=version, incarnation=incarnation, bucket_index=i, num_buckets=buckets,
            names=names[cuts[i] : cuts[i + 1]], tensors=[state[n] for n in names[cuts[i] : cuts[i + 1]]],
        )
        for i in range(buckets)
    ]  # fmt: skip


async def test_a_push_cut_off_halfway_changes_nothing_and_the_restarted_groups_push_applies(
    transport: Transport, tiny_model_dir: Path
) -> None:
    """Trainer rank 0 dies halfway through a weight push (README, "What survives what"): the
    generator got 2 of the 4 buckets of new weights and applies none of them; it serves on
    with its weights (the same completions, log-probs and all) and its version. The
    restarted group (incarnation 1) then pushes its own weights, at the same version: a push
    with a bucket that does not check out (NaN) changes nothing either, a good one is
    applied whole."""
    config = GeneratorConfig()
    engine = await asyncio.to_thread(make_engine, str(tiny_model_dir), config)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    dead_group, restarted_group = perturbed(base, 1), perturbed(base, 2)
    reference = await asyncio.to_thread(make_engine, str(tiny_model_dir), config)
    reference.update_weights(restarted_group.items())
    expected = torch.tensor(reference.sequence_logprobs(SEQ_PROMPT, COMPLETION))
    reference.close()
    async with Generator(transport, endpoint="tcp://127.0.0.1:*", engine=engine, config=config) as gen:
        async with Client(transport, gen.endpoint) as client:
            served = await client.request(request(0), Completions, timeout=300)
        held = torch.tensor(engine.sequence_logprobs(SEQ_PROMPT, COMPLETION))
        async with Client(transport, gen.endpoint) as rank0:  # dies after 2 of its 4 buckets
            for bucket in push(dead_group, version=1, incarnation=0, buckets=4)[:2]:
                assert (await rank0.request(bucket, Ack)).info["status"] == f"bucket {bucket.bucket_index + 1}/4"
        async with Client(transport, gen.endpoint) as client:
            assert (await client.request(Query(what="version"), Ack)).seq == 0
            again = await client.request(request(0), Completions, timeout=300)
            assert torch.equal(torch.tensor(engine.sequence_logprobs(SEQ_PROMPT, COMPLETION)), held), "half an update was applied"
            for old, new in zip(served.completions, again.completions, strict=True):
                assert new.policy_version_min == new.policy_version_max == 0
                assert torch.equal(old.token_ids, new.token_ids) and torch.equal(old.logprobs, new.logprobs)

            corrupt = push(restarted_group, version=1, incarnation=1, buckets=2)
            last = corrupt[-1]
            corrupt[-1] = dataclasses.replace(last, tensors=[torch.full_like(t, float("nan")) for t in last.tensors])
            for bucket in corrupt[:-1]:
                await client.request(bucket, Ack)
            with pytest.raises(RemoteError, match="NaN"):  # every bucket arrived, one does not check out
                await client.request(corrupt[-1], Ack)
            assert gen.version == 0 and torch.equal(torch.tensor(engine.sequence_logprobs(SEQ_PROMPT, COMPLETION)), held)

            for bucket in push(restarted_group, version=1, incarnation=1, buckets=2):  # not mixed with the dead group's
                ack = await client.request(bucket, Ack)
            assert ack.info["status"] == "applied" and gen.version == 1 and gen.incarnation == 1
            applied = torch.tensor(engine.sequence_logprobs(SEQ_PROMPT, COMPLETION))
            assert (applied - held).abs().max().item() > 0.01, "the restarted group's weights changed nothing"
            assert (applied - expected).abs().max().item() <= 1e-6, "the engine holds other weights than the restarted group's"
            reply = await client.request(request(0, min_version=1), Completions, timeout=300)
            assert all(c.policy_version_min == c.policy_version_max == 1 for c in reply.completions)
