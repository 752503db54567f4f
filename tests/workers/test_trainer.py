"""The FSDP2 trainer on CPU over gloo, in real spawned process groups of 1 and 2 ranks.

Each module fixture spawns one process group that runs several scenarios (process start
and imports dominate the runtime) and saves what rank 0 saw; the tests assert on it.
"""

from __future__ import annotations

import json
import math
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.multiprocessing.spawn import spawn as mp_spawn
from transformers import AutoModelForCausalLM, AutoTokenizer

from protocols.messages import GroupKey, MicroBatch
from workers.engines.hf import HFEngine
from workers.trainer import Trainer, _plan_buckets
from yatt.errors import ConfigError, ProtocolError
from yatt.rl.config import AlgorithmConfig, GeneratorConfig, LoRAConfig, ModelConfig, TrainerConfig

Results = dict[str, Any]
Batch = dict[str, torch.Tensor]
BUCKET_BYTES = 64 * 1024  # tiny model: embed/lm_head 128 KiB (alone), layer matrices 16-32 KiB
ADVANTAGES = [1.0, -0.5, 2.0, 0.25, -1.5, 0.75, 1.25, -0.25]  # one per row of the batch
SPLITS_1 = {"one": [[0, 1, 2, 3, 4, 5, 6, 7]], "four": [[0, 1], [2, 3], [4, 5], [6, 7]]}
SPLITS_2 = [[[0, 5], [1, 2]], [[3, 6], [4, 7]]]  # rank -> its 2 micro-batches


# ---------------------------------------------------------------- data and process helpers


def make_batch() -> Batch:
    """8 right-padded rows with uneven prompt and completion lengths (so splits differ in tokens)."""
    g = torch.Generator().manual_seed(7)
    prompts, completions = [3, 5, 4, 3, 6, 2, 4, 5], [9, 2, 6, 4, 3, 8, 5, 7]
    width = max(p + c for p, c in zip(prompts, completions, strict=True))
    ids = torch.zeros(8, width, dtype=torch.int64)
    attention = torch.zeros(8, width, dtype=torch.bool)
    loss_mask = torch.zeros(8, width, dtype=torch.bool)
    advantages = torch.zeros(8, width)
    for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[b, : p + c] = torch.randint(3, 500, (p + c,), generator=g)
        attention[b, : p + c] = True
        loss_mask[b, p : p + c] = True
        advantages[b, p : p + c] = ADVANTAGES[b]
    rollout = torch.where(loss_mask, -torch.rand(8, width, generator=g) * 6, torch.zeros(8, width))
    return dict(
        input_ids=ids,
        attention_mask=attention,
        loss_mask=loss_mask,
        rollout_logprobs=rollout,
        advantages=advantages,
    )


def micro_batch(batch: Batch, rows: list[int], *, step: int, rank: int, index: int, count: int) -> MicroBatch:
    """Rows of the batch as one micro-batch, cut to its own longest sequence."""
    width = int(batch["attention_mask"][rows].sum(-1).max())
    part: dict[str, Any] = {k: v[rows, :width].clone() for k, v in batch.items()}
    return MicroBatch(
        step=step, rank=rank, index=index, count=count, **part,
        policy_versions=torch.full((len(rows),), step, dtype=torch.int64),
        group_keys=[GroupKey(epoch=0, shard=0, prompt_index=r) for r in rows],
    )  # fmt: skip


def rank_batches(batch: Batch, splits: list[list[int]], step: int, rank: int) -> list[MicroBatch]:
    return [
        micro_batch(batch, rows, step=step, rank=rank, index=i, count=len(splits))
        for i, rows in enumerate(splits)
    ]


def _entry(
    rank: int, fn: Callable[..., None], world_size: int, init_file: str, args: tuple[object, ...]
) -> None:
    torch.set_num_threads(1)
    backend = "nccl" if fn is on_gpu else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., None], world_size: int, *args: object) -> None:
    """Run ``fn(rank, *args)`` in ``world_size`` fresh processes joined by a gloo group."""
    with tempfile.TemporaryDirectory() as tmp:
        mp_spawn(_entry, args=(fn, world_size, str(Path(tmp) / "init"), args), nprocs=world_size, join=True)  # type: ignore[no-untyped-call]


def make_trainer(
    model_dir: str, algorithm: AlgorithmConfig | None = None, *, temperature: float = 1.0,
    lora: LoRAConfig | None = None, dtype: str = "float32", **trainer: Any,
) -> Trainer:
    config = TrainerConfig(**{"lr": 1e-3, "grad_clip": 0.0, **trainer})
    algorithm = algorithm or AlgorithmConfig()
    # float32: the math is checked exactly; bf16 agreement is tests/workers/test_generator.py's
    model = ModelConfig(dtype=dtype, lora=lora or LoRAConfig())  # type: ignore[arg-type]
    return Trainer(model, config, algorithm, model_path=model_dir, temperature=temperature)


def full_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """HF name -> full gradient; activation checkpointing's wrapper adds a name part."""
    named = trainer.policy.named_parameters()
    return {
        n.replace("_checkpoint_wrapped_module.", ""): cast(DTensor, p.grad).full_tensor() for n, p in named
    }


def full_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets it, others {}
    return get_model_state_dict(trainer.policy, options=options)  # type: ignore[return-value]


def batch_nll(trainer: Trainer, batch: Batch) -> float:
    logprobs = trainer.logprobs(batch["input_ids"], batch["attention_mask"])
    return -float(logprobs[batch["loss_mask"]].mean())


def supervised(batch: Batch) -> Batch:
    """Every completion token advantage 1: the policy should raise the batch's log-probs."""
    return dict(batch, advantages=batch["loss_mask"].float())


# ---------------------------------------------------------------- scenarios (run in spawned ranks)


def one_rank(rank: int, model_dir: str, out: str) -> None:
    """Reference gradients (1 and 4 micro-batches), and the TIS + entropy + KL loss path."""
    batch, results = make_batch(), Results()
    for mode in ("token_mean", "seq_mean_token_mean"):
        for name, splits in SPLITS_1.items():
            trainer = make_trainer(model_dir, AlgorithmConfig(aggregation=mode))
            for mb in rank_batches(batch, splits, 0, rank):
                trainer.accumulate(mb)
            trainer.reduce_gradients()
            results[f"grads/{mode}/{name}"] = full_grads(trainer)
    algo = AlgorithmConfig(importance_sampling="tis", importance_cap=2.0, entropy_coef=0.01, kl_coef=0.1)
    trainer = make_trainer(model_dir, algo)
    current = trainer.logprobs(batch["input_ids"], batch["attention_mask"])
    shifted = dict(
        batch, rollout_logprobs=torch.where(batch["loss_mask"], current - 0.1, torch.zeros_like(current))
    )
    results["tis_step"] = trainer.train_step(rank_batches(shifted, SPLITS_1["one"], 0, rank))
    with pytest.raises(ProtocolError, match="index/count"):
        trainer.accumulate(micro_batch(batch, [0], step=1, rank=rank, index=1, count=1))
    hot = make_trainer(model_dir, temperature=0.5)
    results["logprobs_t0.5"] = hot.logprobs(batch["input_ids"], batch["attention_mask"])
    torch.save(results, out)


def two_ranks(rank: int, model_dir: str, out: str, ckpt: str, export: str) -> None:
    """2-rank gradients, then 10 training steps with a checkpoint at 5, export and buckets."""
    batch, results = make_batch(), Results()
    for mode in ("token_mean", "seq_mean_token_mean"):
        trainer = make_trainer(model_dir, AlgorithmConfig(aggregation=mode), activation_checkpointing=True)
        for mb in rank_batches(batch, SPLITS_2[rank], 0, rank):
            trainer.accumulate(mb)
        trainer.reduce_gradients()
        results[f"grads/{mode}"] = full_grads(trainer)

    # Activation checkpointing here, none in the resumed run: checkpoints use the HF names.
    schedule: dict[str, Any] = dict(warmup_steps=2, schedule="cosine", total_steps=12, grad_clip=1.0)
    trainer = make_trainer(model_dir, activation_checkpointing=True, **schedule)
    nll, steps = [batch_nll(trainer, batch)], []
    for step in range(10):
        if step == 5:  # written in the background while steps 5 and 6 train
            writing = trainer.save_checkpoint(ckpt, background=True)
        if step == 7:
            writing.result()
        steps.append(trainer.train_step(rank_batches(supervised(batch), SPLITS_2[rank], step, rank)))
        if step == 5:
            results["after_resume_step"] = {
                "params": full_params(trainer),
                "rng": (torch.rand(3), random.random()),
            }
        nll.append(batch_nll(trainer, batch))
    results["steps"], results["nll"] = steps, nll

    trainer.export_hf(export)
    with torch.no_grad():
        results["logits"] = trainer.policy(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
    results["logprobs"] = trainer.logprobs(batch["input_ids"], batch["attention_mask"])
    results["buckets"] = list(trainer.weight_buckets(version=10, bucket_bytes=BUCKET_BYTES))
    results["params"] = full_params(trainer)
    if rank == 0:
        torch.save(results, out)
    else:
        assert results["buckets"] == []  # documented: only rank 0 receives buckets


def resumed(rank: int, model_dir: str, out: str, ckpt: str) -> None:
    """Fresh processes: load the step-5 checkpoint and take step 5; then GAE + KL; count mismatch."""
    batch, results = make_batch(), Results()
    trainer = make_trainer(model_dir, warmup_steps=2, schedule="cosine", total_steps=12, grad_clip=1.0)
    trainer.load_checkpoint(ckpt)
    results["loaded_step"] = trainer.step
    results["step"] = trainer.train_step(rank_batches(supervised(batch), SPLITS_2[rank], 5, rank))
    results["params"] = full_params(trainer)
    results["rng"] = (torch.rand(3), random.random())

    # PPO with a critic: the advantages field carries each row's reward on its completion tokens.
    algo = AlgorithmConfig(advantage="gae", kl_coef=0.05, kl_in_reward=True, gamma=1.0, lam=0.95)
    critic = make_trainer(model_dir, algo, critic_lr=3e-3)
    results["gae"] = [critic.train_step(rank_batches(batch, SPLITS_2[rank], s, rank)) for s in range(6)]

    with pytest.raises(ProtocolError, match="disagree on MicroBatch.count"):
        critic.train_step([micro_batch(batch, [rank], step=6, rank=rank, index=0, count=1 + rank)])
    if rank == 0:
        torch.save(results, out)


def resharded(rank: int, model_dir: str, out: str, ckpt: str) -> None:
    """One process loads the 2-rank step-5 checkpoint (DCP reshards) and takes step 5 on
    the whole batch: what a trainer group restarted with another world size does."""
    batch, results = make_batch(), Results()
    trainer = make_trainer(model_dir, warmup_steps=2, schedule="cosine", total_steps=12, grad_clip=1.0)
    trainer.load_checkpoint(ckpt)
    results["loaded_step"] = trainer.step
    both = [SPLITS_2[0][0] + SPLITS_2[1][0], SPLITS_2[0][1] + SPLITS_2[1][1]]  # the two ranks' rows
    results["step"] = trainer.train_step(rank_batches(supervised(batch), both, 5, rank))
    results["params"] = full_params(trainer)
    torch.save(results, out)


def several_updates(rank: int, model_dir: str, out: str) -> None:
    """2 ranks: mini-batches and epochs, batch-wide whitening, the rollout-log-prob mode."""
    batch, results = make_batch(), Results()
    # PPO, 2 mini-batches x 2 epochs per batch (each rank has 2 micro-batches): 4 updates,
    # the later ones off-policy against the batch's starting log-probs, so the clip binds.
    algo = AlgorithmConfig(ppo_epochs=2, clip_low=0.2, clip_high=0.28)
    trainer = make_trainer(model_dir, algo, lr=2e-2, mini_batches=2, warmup_steps=2, schedule="linear", total_steps=4)
    nll = [batch_nll(trainer, batch)]
    results["ppo"] = []
    for step in range(3):
        results["ppo"].append(trainer.train_step(rank_batches(supervised(batch), SPLITS_2[rank], step, rank)))
        nll.append(batch_nll(trainer, batch))
    results["ppo_nll"], results["ppo_versions"] = nll, (trainer.step, trainer.optimizer_steps)

    # REINFORCE++: the batch's advantages after whitening, gathered from both ranks.
    rpp = make_trainer(model_dir, AlgorithmConfig(advantage="reinforce_pp", gamma=0.9))
    prepared = [rpp._inputs(mb) for mb in rank_batches(batch, SPLITS_2[rank], 0, rank)]
    for b in prepared:
        rpp._prepare(b)
    raw = [b.advantages.clone() for b in prepared]
    rpp._whiten(prepared)
    mine = {
        "raw": torch.cat([a[b.mask] for a, b in zip(raw, prepared, strict=True)]),
        "whitened": torch.cat([b.advantages[b.mask] for b in prepared]),
    }
    gathered: list[Any] = [None, None]
    dist.all_gather_object(gathered, mine)
    results["rpp"] = gathered
    results["rpp_step"] = rpp.train_step(rank_batches(batch, SPLITS_2[rank], 0, rank))

    # verl's bypass: PPO against the rollout log-probs, deliberately stale (random), IcePop-masked.
    stale = AlgorithmConfig(old_logprobs="rollout", importance_sampling="mis", importance_floor=0.5, importance_cap=5.0)
    bypass = make_trainer(model_dir, stale, mini_batches=2)
    results["stale"] = bypass.train_step(rank_batches(batch, SPLITS_2[rank], 0, rank))
    streaming = make_trainer(model_dir, stale)  # one update per batch: streamed, same old log-probs
    results["stale_streaming"] = streaming.train_step(rank_batches(batch, SPLITS_2[rank], 0, rank))
    with pytest.raises(ConfigError, match="trainer.mini_batches=4 must divide"):
        make_trainer(model_dir, algo, mini_batches=4).train_step(rank_batches(batch, SPLITS_2[rank], 0, rank))

    # Adaptive KL in the reward: the reference equals the policy at first (KL ~ 0 < target),
    # so the coefficient first shrinks by (1 - 0.2 * sequences / horizon), then follows the KL.
    adaptive = AlgorithmConfig(kl_coef=0.05, kl_in_reward=True, kl_controller="adaptive", kl_horizon=100)
    kl_trainer = make_trainer(model_dir, adaptive)
    results["adaptive"] = [kl_trainer.train_step(rank_batches(batch, SPLITS_2[rank], s, rank)) for s in range(2)]
    # A user's loss by dotted path; a bad path is a ConfigError naming the field.
    custom = make_trainer(model_dir, AlgorithmConfig(policy_loss="tests.yatt.rl.test_rl_math:my_loss"))
    results["custom_nll"] = batch_nll(custom, batch)
    results["custom"] = custom.train_step(rank_batches(supervised(batch), SPLITS_2[rank], 0, rank))
    with pytest.raises(ConfigError, match="algorithm.policy_loss: 'no_such.module:fn'"):
        make_trainer(model_dir, AlgorithmConfig(policy_loss="no_such.module:fn"))
    if rank == 0:
        torch.save(results, out)


def on_gpu(rank: int, model_dir: str, out: str, export: str) -> None:
    """NCCL and bf16 mixed precision (dtype auto on CUDA): train, export, buckets."""
    batch, results = make_batch(), Results()
    trainer = make_trainer(model_dir, AlgorithmConfig(kl_coef=0.05), dtype="auto", lr=3e-3, grad_clip=1.0)
    nll, steps = [batch_nll(trainer, batch)], []
    for step in range(5):
        steps.append(
            trainer.train_step(rank_batches(supervised(batch), [[0, 1, 2, 3], [4, 5, 6, 7]], step, rank))
        )
        nll.append(batch_nll(trainer, batch))
    results["nll"], results["steps"] = nll, steps
    trainer.export_hf(export)
    results["buckets"] = list(trainer.weight_buckets(version=5, bucket_bytes=BUCKET_BYTES))
    torch.save(results, out)


# ---------------------------------------------------------------- fixtures


LORA = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])


def lora_ranks(rank: int, model_dir: str, out: str, export: str) -> None:
    """2 ranks train LoRA adapters for 4 steps; the buckets, the export, the state."""
    batch, results = make_batch(), Results()
    trainer = make_trainer(model_dir, lr=2e-2, lora=LORA)
    results["before"] = full_params(trainer)
    nll = [batch_nll(trainer, batch)]
    for step in range(4):
        trainer.train_step(rank_batches(supervised(batch), SPLITS_2[rank], step, rank))
        nll.append(batch_nll(trainer, batch))
    results["nll"], results["after"] = nll, full_params(trainer)
    optimizer = trainer._trained["policy"][1]
    results["optimized"] = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    results["trainable"] = [n for n, p in trainer.policy.named_parameters() if p.requires_grad]
    results["buckets"] = list(trainer.weight_buckets(version=4, bucket_bytes=BUCKET_BYTES))
    results["logprobs"] = trainer.logprobs(batch["input_ids"], batch["attention_mask"])
    trainer.export_hf(export)
    if rank == 0:
        torch.save(results, out)


@pytest.fixture(scope="module")
def lora(tiny_model_dir: Path, work_dir: Path) -> Results:
    spawn(lora_ranks, 2, str(tiny_model_dir), str(work_dir / "lora.pt"), str(work_dir / "lora_export"))
    return torch.load(work_dir / "lora.pt", weights_only=False)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trainer")


@pytest.fixture(scope="module")
def one(tiny_model_dir: Path, work_dir: Path) -> Results:
    spawn(one_rank, 1, str(tiny_model_dir), str(work_dir / "one.pt"))
    return torch.load(work_dir / "one.pt", weights_only=False)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def two(tiny_model_dir: Path, work_dir: Path) -> Results:
    paths = [str(work_dir / name) for name in ("two.pt", "ckpt", "export")]
    spawn(two_ranks, 2, str(tiny_model_dir), *paths)
    return torch.load(work_dir / "two.pt", weights_only=False)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def resume(two: Results, tiny_model_dir: Path, work_dir: Path) -> Results:
    spawn(resumed, 2, str(tiny_model_dir), str(work_dir / "resumed.pt"), str(work_dir / "ckpt"))
    return torch.load(work_dir / "resumed.pt", weights_only=False)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def reshard(two: Results, tiny_model_dir: Path, work_dir: Path) -> Results:
    spawn(resharded, 1, str(tiny_model_dir), str(work_dir / "resharded.pt"), str(work_dir / "ckpt"))
    return torch.load(work_dir / "resharded.pt", weights_only=False)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def several(tiny_model_dir: Path, work_dir: Path) -> Results:
    spawn(several_updates, 2, str(tiny_model_dir), str(work_dir / "several.pt"))
    return torch.load(work_dir / "several.pt", weights_only=False)  # type: ignore[no-any-return]


# ---------------------------------------------------------------- tests


def assert_grads_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Equal up to float32 summation order: max error <= 4e-6 of the tensor's largest entry
    (~30 float32 epsilons; 1e-6 held on an AMD EPYC, an Intel Xeon with AMX's kernels gave
    1.05e-6 for packed rows: another order; a broken mask or sum is off by the entry's size)."""
    assert a.keys() == b.keys()
    for name in a:
        scale = float(a[name].abs().max())
        assert scale > 0, f"{name} has an all-zero gradient"
        err = float((a[name] - b[name]).abs().max())
        assert err <= 4e-6 * scale, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_gradient_is_the_full_batch_mean_for_any_split(one: Results, two: Results, mode: str) -> None:
    reference = one[f"grads/{mode}/one"]
    assert_grads_close(reference, one[f"grads/{mode}/four"])  # 4 micro-batches on 1 rank
    assert_grads_close(reference, two[f"grads/{mode}"])  # 2 ranks x 2, activation checkpointing


def test_splits_are_uneven_so_a_per_micro_batch_mean_would_differ() -> None:
    tokens = make_batch()["loss_mask"].sum(-1)  # [8] completion tokens per row
    four = [int(tokens[rows].sum()) for rows in SPLITS_1["four"]]
    two = [int(tokens[rows].sum()) for split in SPLITS_2 for rows in split]
    assert len(set(four)) > 1 and len(set(two)) > 1, (four, two)


def test_tis_entropy_and_kl_terms_match_a_hand_computed_loss(one: Results) -> None:
    m, batch = one["tis_step"], make_batch()
    # On-policy ratio 1; TIS weight exp(0.1) < cap on every token; KL to the (equal) reference 0.
    assert m["kl"] == 0.0 and m["clip_frac"] == 0.0
    assert m["is_weight"] == pytest.approx(math.exp(0.1), rel=1e-5)
    assert m["logprob_diff"] == pytest.approx(0.1, rel=1e-4)
    advantage_mean = float(batch["advantages"][batch["loss_mask"]].mean())
    assert m["loss"] == pytest.approx(-advantage_mean * math.exp(0.1) - 0.01 * m["entropy"], rel=1e-5)
    assert m["tokens"] == float(batch["loss_mask"].sum()) and m["step"] == 1.0


def test_logprobs_match_transformers_at_the_rollout_temperature(one: Results, tiny_model_dir: Path) -> None:
    batch = make_batch()
    _, expected = hf_logprobs(tiny_model_dir, batch, 0.5)
    valid = batch["attention_mask"]
    torch.testing.assert_close(one["logprobs_t0.5"][valid], expected[valid], rtol=1e-5, atol=1e-5)


def test_two_rank_training_raises_the_batch_log_probs(two: Results) -> None:
    steps, nll = two["steps"], two["nll"]
    assert nll[-1] < nll[0] - 0.5, nll
    assert all(b < a for a, b in zip(nll, nll[1:], strict=False)), nll
    for m in steps:
        assert m["loss"] == pytest.approx(-1.0, abs=1e-6)  # on-policy: -mean(A) * ratio 1
        assert m["grad_norm"] > 0 and m["tokens"] == float(make_batch()["loss_mask"].sum())
    # Warmup 2 then cosine to step 12: factors 0.5, 1, then 0.5 (1 + cos(pi (s - 2) / 10)).
    expected = [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * (s - 2) / 10)) for s in range(2, 10)]
    assert [m["lr"] for m in steps] == pytest.approx([1e-3 * f for f in expected])
    assert [m["step"] for m in steps] == [float(s) for s in range(1, 11)]


def test_resumed_checkpoint_takes_the_same_next_step(two: Results, resume: Results) -> None:
    assert resume["loaded_step"] == 5
    uninterrupted, resumed_step = two["steps"][5], resume["step"]
    for key in ("loss", "grad_norm", "lr", "tokens", "step"):
        assert resumed_step[key] == uninterrupted[key], key
    expected = two["after_resume_step"]
    assert expected["params"].keys() == resume["params"].keys()
    for name, value in expected["params"].items():
        assert torch.equal(value, resume["params"][name]), name
    assert torch.equal(expected["rng"][0], resume["rng"][0]) and expected["rng"][1] == resume["rng"][1]


def test_a_two_rank_checkpoint_resumes_on_one_rank_with_the_same_next_step(two: Results, reshard: Results) -> None:
    """DCP reshards the weights and the optimizer state: one rank takes the step two would
    (equal up to float32 summation order: token sums all-reduced vs summed in one process)."""
    assert reshard["loaded_step"] == 5
    uninterrupted, step = two["steps"][5], reshard["step"]
    for key in ("lr", "tokens", "step"):
        assert step[key] == uninterrupted[key], key
    for key in ("loss", "grad_norm"):
        assert step[key] == pytest.approx(uninterrupted[key], rel=1e-5), key
    expected = two["after_resume_step"]["params"]
    assert expected.keys() == reshard["params"].keys()
    for name, value in expected.items():
        torch.testing.assert_close(reshard["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def hf_logprobs(model_dir: Path, batch: Batch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [B, T, V] of a plain transformers model and log p(token t | < t) [B, T] (0 at t = 0)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    logp = logp.gather(2, batch["input_ids"][:, 1:, None])[..., 0]  # [B, T - 1]
    return logits, torch.nn.functional.pad(logp, (1, 0))


def test_export_reloads_in_transformers_with_equal_logits(two: Results, work_dir: Path) -> None:
    batch = make_batch()
    logits, logprobs = hf_logprobs(work_dir / "export", batch, 1.0)
    valid = batch["attention_mask"]
    torch.testing.assert_close(logits[valid], two["logits"][valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logprobs[valid], two["logprobs"][valid], rtol=1e-5, atol=1e-5)
    assert AutoTokenizer.from_pretrained(work_dir / "export").pad_token == "<|pad|>"


def test_weight_buckets_reassemble_the_exported_state_dict(two: Results, work_dir: Path) -> None:
    buckets, exported = two["buckets"], load_file(work_dir / "export" / "model.safetensors")
    assert [b.bucket_index for b in buckets] == list(range(len(buckets)))
    assert {(b.num_buckets, b.version) for b in buckets} == {(len(buckets), 10)}
    gathered: dict[str, torch.Tensor] = {}
    for b in buckets:
        size = sum(t.numel() * t.element_size() for t in b.tensors)
        assert size <= BUCKET_BYTES or len(b.tensors) == 1, (b.names, size)
        gathered.update(zip(b.names, b.tensors, strict=True))
    assert any(len(b.names) > 1 for b in buckets) and any(len(b.names) == 1 for b in buckets)
    assert gathered.keys() == exported.keys() == two["params"].keys()
    for name, tensor in gathered.items():
        assert torch.equal(tensor, exported[name]) and torch.equal(tensor, two["params"][name]), name


def test_ppo_critic_learns_and_kl_starts_at_zero(resume: Results) -> None:
    steps = resume["gae"]
    # The metric is the reward's estimator (k1, kl_in_reward): 0 at first, then either sign.
    assert steps[0]["kl"] == 0.0 and abs(steps[-1]["kl"]) > 1e-4
    losses = [m["value_loss"] for m in steps]
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(m["critic_grad_norm"] > 0 for m in steps)


def test_bucket_plan_packs_in_order_and_isolates_large_tensors() -> None:
    sizes = [("a", 40), ("b", 50), ("c", 10), ("d", 150), ("e", 30), ("f", 70)]
    assert _plan_buckets(sizes, 100) == [["a", "b", "c"], ["d"], ["e", "f"]]
    assert _plan_buckets([("x", 5)], 1) == [["x"]]


def test_lora_trains_only_the_adapters_and_sends_only_them(lora: Results, tiny_model_dir: Path, work_dir: Path) -> None:
    assert lora["nll"][-1] < lora["nll"][0] - 0.05, lora["nll"]  # the adapters learn
    before, after = lora["before"], lora["after"]
    adapters = {n for n in after if ".lora_A." in n or ".lora_B." in n}
    assert len(adapters) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    assert sorted(lora["trainable"]) == sorted(adapters)
    for name in after:  # the base model never moves; every adapter does (B starts at zero)
        assert torch.equal(before[name], after[name]) == (name not in adapters), name
    base = sum(t.numel() for n, t in after.items() if n not in adapters)
    assert lora["optimized"] == sum(after[n].numel() for n in adapters) < base / 50  # AdamW state: adapters only
    # The generators get the adapters, nothing else, and apply them: the engine's log-probs are the trainer's.
    sent = {n: t for b in lora["buckets"] for n, t in zip(b.names, b.tensors, strict=True)}
    assert sent.keys() == adapters
    engine = HFEngine(str(tiny_model_dir), GeneratorConfig(), dtype="float32", lora=LORA)
    batch = make_batch()
    row = 0
    prompt = batch["input_ids"][row][~batch["loss_mask"][row] & batch["attention_mask"][row]].tolist()
    completion = batch["input_ids"][row][batch["loss_mask"][row]].tolist()
    expected = lora["logprobs"][row][batch["loss_mask"][row]]
    assert not torch.allclose(torch.tensor(engine.sequence_logprobs(prompt, completion)), expected, atol=1e-3)
    with pytest.raises(ProtocolError, match="lacks"):
        engine.update_weights(list(sent.items())[1:])  # all or nothing: one adapter short
    with pytest.raises(ProtocolError, match="does not have"):
        engine.update_weights([*sent.items(), ("base_model.model.lm_head.weight", after["base_model.model.lm_head.weight"])])
    engine.update_weights(sent.items())
    torch.testing.assert_close(torch.tensor(engine.sequence_logprobs(prompt, completion)), expected, rtol=1e-4, atol=1e-4)
    # The export: the merged model loads in plain transformers with the same log-probs; the adapter beside it.
    _, merged = hf_logprobs(work_dir / "lora_export", batch, 1.0)
    valid = batch["loss_mask"]
    torch.testing.assert_close(merged[valid], lora["logprobs"][valid], rtol=1e-4, atol=1e-4)
    from peft import PeftModel

    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), work_dir / "lora_export" / "adapter")
    with torch.no_grad():
        logits = adapter(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    reloaded = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, batch["input_ids"][:, 1:, None])[..., 0]
    torch.testing.assert_close(reloaded[valid[:, 1:]], lora["logprobs"][:, 1:][valid[:, 1:]], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_cuda_bf16_training_export_and_buckets(tiny_model_dir: Path, tmp_path: Path) -> None:
    spawn(on_gpu, 1, str(tiny_model_dir), str(tmp_path / "gpu.pt"), str(tmp_path / "export"))
    results = torch.load(tmp_path / "gpu.pt", weights_only=False)
    nll = results["nll"]
    assert nll[-1] < nll[0] - 0.1, nll
    assert all(math.isfinite(m["loss"]) and m["kl"] >= 0 for m in results["steps"])
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    gathered = {n: t for b in results["buckets"] for n, t in zip(b.names, b.tensors, strict=True)}
    assert gathered.keys() == exported.keys()
    assert all(torch.equal(gathered[n], exported[n]) for n in gathered)


def test_mini_batches_and_epochs_take_several_updates_and_the_clip_binds(several: Results) -> None:
    steps = several["ppo"]
    assert several["ppo_versions"] == (3, 12)  # 3 run steps (versions), 2 x 2 updates each
    assert [m["step"] for m in steps] == [1.0, 2.0, 3.0]
    assert [m["optimizer_steps"] for m in steps] == [4.0, 8.0, 12.0]
    # The schedule advances per run step: warmup 2 then linear decay to step 4.
    assert [m["lr"] for m in steps] == pytest.approx([1e-2, 2e-2, 2e-2])
    # Old log-probs are the batch's starting ones: the later updates see ratios != 1.
    assert all(m["approx_kl"] > 0 for m in steps)
    assert max(m["clip_frac_last"] for m in steps) > 0.0
    assert several["ppo_nll"][-1] < several["ppo_nll"][0]  # supervised advantages: it learns


def test_reinforce_pp_advantages_are_whitened_over_both_ranks(several: Results) -> None:
    raw = torch.cat([g["raw"] for g in several["rpp"]]).double()
    whitened = torch.cat([g["whitened"] for g in several["rpp"]]).double()
    expected = (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8)  # verl's masked_whiten, global
    torch.testing.assert_close(whitened, expected, atol=1e-5, rtol=0)
    assert abs(float(whitened.mean())) < 1e-5 and float(whitened.std()) == pytest.approx(1.0, abs=1e-4)
    # Each rank alone is not centred: only the all-reduced moments make the global mean 0.
    assert abs(float(several["rpp"][0]["whitened"].mean())) > 1e-3
    assert math.isfinite(several["rpp_step"]["loss"])


def test_rollout_log_prob_mode_masks_a_stale_batch(several: Results) -> None:
    m = several["stale"]
    # Random rollout log-probs are far from the policy's: IcePop [0.5, 5] masks some tokens.
    assert 0.0 < m["is_masked_frac"] < 1.0
    assert m["is_weight_std"] > 0.0 and m["optimizer_steps"] == 2.0
    # Streamed (one update), the ratio is against the rollout log-probs too: far from 1.
    streamed = several["stale_streaming"]
    assert streamed["optimizer_steps"] == 1.0 and streamed["approx_kl"] > 0.01
    assert 0.0 < streamed["is_masked_frac"] < 1.0


def test_adaptive_kl_and_a_custom_loss_in_the_trainer(several: Results) -> None:
    first, second = several["adaptive"]
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)
    assert first["kl_coef"] == pytest.approx(0.05 * (1 - 0.2 * 8 / 100))  # 8 sequences, 2 ranks
    error = min(max(second["kl"] / 0.1 - 1, -0.2), 0.2)  # verl's update with the step's KL
    assert second["kl"] != 0.0
    assert second["kl_coef"] == pytest.approx(first["kl_coef"] * (1 + error * 8 / 100))
    # my_loss is -A logp: with advantages 1 the step loss is the batch's mean NLL (~ log V at init).
    assert several["custom"]["loss"] == pytest.approx(several["custom_nll"], rel=1e-4)
    assert several["custom"]["clip_frac"] == 0.0


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    from workers.trainer_rank import prune_checkpoints

    for step, done in ((2, True), (4, True), (6, False), (8, True), (10, True), (12, False)):
        (tmp_path / f"step_{step}" / "trainer").mkdir(parents=True)
        if done:
            (tmp_path / f"step_{step}" / "done").write_text("{}")
    gone = prune_checkpoints(tmp_path, 2)
    # step_6 was left half-written by a dead group; step_12 is being written now.
    assert sorted(d.name for d in gone) == ["step_2", "step_4", "step_6"]
    assert sorted(d.name for d in tmp_path.iterdir()) == ["step_10", "step_12", "step_8"]
    assert prune_checkpoints(tmp_path / "none", 1) == []


def test_the_consumed_record_keeps_the_last_training_of_each_step(tmp_path: Path) -> None:
    """Each rank appends what it trained per step; a restarted group (incarnation 1) and then
    a resumed run (incarnation 0 again) train steps again: the last line of a step stands."""
    from workers.trainer_rank import read_consumed, record_consumed

    assert read_consumed(tmp_path) == {}
    for rank in (0, 1):
        for step in range(3):
            record_consumed(tmp_path, rank, step=step, incarnation=0, keys=[f"e0/s{rank}/p{step}/a0"] * 2)
        record_consumed(tmp_path, rank, step=1, incarnation=1, keys=[f"e0/s{rank}/p1/a1"])  # the group restarted from step 1
    record_consumed(tmp_path, 0, step=2, incarnation=1, keys=["e0/s0/p2/a1"])
    record_consumed(tmp_path, 0, step=2, incarnation=0, keys=["e0/s0/p2/a2"])  # resumed from step 2
    assert read_consumed(tmp_path) == {
        0: {0: ["e0/s0/p0/a0"] * 2, 1: ["e0/s1/p0/a0"] * 2},
        1: {0: ["e0/s0/p1/a1"], 1: ["e0/s1/p1/a1"]},
        2: {0: ["e0/s0/p2/a2"], 1: ["e0/s1/p2/a0"] * 2},
    }
    lines = (tmp_path / "consumed" / "trainer-0.jsonl").read_text().splitlines()
    assert len(lines) == 6 and json.loads(lines[3]) == {"step": 1, "incarnation": 1, "keys": ["e0/s0/p1/a1"]}
