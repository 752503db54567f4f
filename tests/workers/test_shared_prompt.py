"""A group's prompt computed once in training (``trainer.share_prompt``,
``workers.packing.share_prompts``): the rows that share a prompt run as one row, the prompt
then each row's remainder, and every log-prob, loss term, count and gradient is the padded
computation's (float32, 1e-6): the prompt's gradient is the sum of its rows'.

The model checks run the tiny Llama in this process; the trainer scenarios run in one
spawned gloo rank with tests/workers/test_trainer.py's helpers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.workers.test_packing import assert_the_padded_results
from tests.workers.test_trainer import (
    ADVANTAGES,
    Batch,
    Results,
    assert_grads_close,
    full_grads,
    make_trainer,
    micro_batch,
    spawn,
)
from workers.packing import share_prompts
from yatt.rl import rl_math
from yatt.rl.config import AlgorithmConfig

# Three prompts (5, 3 and 7 tokens) with 3, 1 and 3 rows, and a row whose prompt is the
# first one's but for its last token (it must not share it). Completions of uneven length,
# one of a single token.
PROMPTS = [5, 5, 3, 5, 7, 7, 7, 5]
GROUP = [0, 0, 1, 0, 2, 2, 2, 3]
COMPLETIONS = [6, 1, 4, 3, 5, 2, 7, 4]
SPLITS = [[0, 1, 2, 3], [4, 5, 6, 7]]


def grouped_batch() -> Batch:
    g = torch.Generator().manual_seed(11)
    prompts = {k: torch.randint(3, 500, (p,), generator=g) for k, p in zip(GROUP, PROMPTS, strict=True)}
    prompts[3] = prompts[0].clone()
    prompts[3][-1] = (prompts[3][-1] + 1) % 500  # the first prompt but its last token
    width = max(p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True))
    ids = torch.zeros(8, width, dtype=torch.int64)
    attention = torch.zeros(8, width, dtype=torch.bool)
    loss_mask = torch.zeros(8, width, dtype=torch.bool)
    advantages = torch.zeros(8, width)
    for b, (k, p, c) in enumerate(zip(GROUP, PROMPTS, COMPLETIONS, strict=True)):
        ids[b, :p] = prompts[k]
        ids[b, p : p + c] = torch.randint(3, 500, (c,), generator=g)
        attention[b, : p + c] = True
        loss_mask[b, p : p + c] = True
        advantages[b, p : p + c] = ADVANTAGES[b]
    loss_mask[6, PROMPTS[6] + 2] = False  # a tool output inside a completion: not the prompt's end
    rollout = torch.where(loss_mask, -torch.rand(8, width, generator=g) * 6, torch.zeros(8, width))
    return dict(input_ids=ids, attention_mask=attention, loss_mask=loss_mask, rollout_logprobs=rollout, advantages=advantages)


# ---------------------------------------------------------------- the layout, on the model


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()  # type: ignore[no-any-return,no-untyped-call]


def padded_logprobs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    ids, attention = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    return rl_math.token_logprobs(logits, ids)


def shared_logprobs(model: torch.nn.Module, batch: Batch, *, one_row: bool = False) -> torch.Tensor:
    layout = share_prompts(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], one_row=one_row)
    logits = model(
        input_ids=layout.input_ids, attention_mask=layout.attention_mask, position_ids=layout.position_ids, use_cache=False
    ).logits
    return layout.back(rl_math.token_logprobs(logits, layout.input_ids))


def test_a_group_runs_as_one_row_its_prompt_once() -> None:
    batch = grouped_batch()
    layout = share_prompts(batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
    assert layout.input_ids.shape[0] == 4  # three groups and the row with the other last token
    # Each row of a group of k adds its remainder from the prompt's last token on; the
    # prompt but its last token is there once: (k - 1) (p - 1) tokens saved.
    assert layout.shared == 2 * 4 + 2 * 6
    lengths = batch["attention_mask"].sum(-1)
    assert int(layout.input_ids.ne(0).sum()) <= int(lengths.sum()) - layout.shared
    packed = share_prompts(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], one_row=True)
    assert packed.input_ids.shape[0] == 1 and packed.shared == layout.shared


@pytest.mark.parametrize("one_row", [False, True], ids=["row_per_prompt", "one_row"])
def test_shared_prompt_log_probs_are_the_padded_ones(model: torch.nn.Module, one_row: bool) -> None:
    batch = grouped_batch()
    valid = batch["attention_mask"].clone()
    valid[:, 0] = False
    with torch.no_grad():
        padded, shared = padded_logprobs(model, batch), shared_logprobs(model, batch, one_row=one_row)
    torch.testing.assert_close(shared[valid], padded[valid], rtol=0, atol=1e-6)
    assert not shared[~valid].any()


def test_a_row_sees_its_prompt_and_not_the_other_rows_of_its_group(model: torch.nn.Module) -> None:
    batch = grouped_batch()
    changed = {k: v.clone() for k, v in batch.items()}
    start = PROMPTS[0] + 1
    changed["input_ids"][0, start:] = (batch["input_ids"][0, start:] + 17) % 500  # row 0's completion but its first token
    with torch.no_grad():
        before, after = shared_logprobs(model, batch), shared_logprobs(model, changed)
    real = batch["attention_mask"]
    assert (before[0, start + 1 :] - after[0, start + 1 :]).abs().max() > 0.1
    torch.testing.assert_close(after[1:][real[1:]], before[1:][real[1:]], rtol=0, atol=1e-6)


def test_the_prompts_gradient_is_the_sum_of_its_rows(model: torch.nn.Module) -> None:
    batch = grouped_batch()
    weights = torch.randn(batch["input_ids"].shape, generator=torch.Generator().manual_seed(3)) * batch["loss_mask"]
    grads = []
    for fn in (padded_logprobs, shared_logprobs):
        model.zero_grad()
        torch.autograd.backward((fn(model, batch) * weights).sum())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].norm() > 0
    scale, err = float(grads[0].abs().max()), float((grads[1] - grads[0]).abs().max())
    assert err <= 4e-6 * scale, f"max error {err:.3g} vs scale {scale:.3g}"  # float32 summation order


# ---------------------------------------------------------------- padded vs shared trainers


def shared_vs_padded(rank: int, model_dir: str, out: str) -> None:
    """The same trainers, padded then with shared prompts (a row each, and in one row): a
    streamed step with every loss term (2 micro-batches, KL to the reference, entropy, TIS),
    a PPO step with a critic (its old log-probs, reference and values shared too)."""
    batch, results = grouped_batch(), Results()
    splits = [micro_batch(batch, rows, step=0, rank=rank, index=i, count=2) for i, rows in enumerate(SPLITS)]
    modes: dict[str, dict[str, Any]] = {
        "padded": {"share_prompt": False},
        "shared": {"share_prompt": True},
        "one_row": {"share_prompt": True, "pack": True},
    }
    for mode, options in modes.items():
        r = results[mode] = Results()
        algo = AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01, importance_sampling="tis", importance_cap=2.0)
        trainer = make_trainer(model_dir, algo, activation_checkpointing=mode == "shared", **options)
        for mb in splits:
            trainer.accumulate(mb)
        r["sums"] = trainer.reduce_gradients()
        r["grads"] = full_grads(trainer)
        r["step"] = trainer.finish_step()
        algo = AlgorithmConfig(advantage="gae", kl_coef=0.05, kl_in_reward=True, gamma=1.0, lam=0.95, old_logprobs="recompute")
        critic = make_trainer(model_dir, algo, critic_lr=3e-3, **options)
        r["gae"] = critic.train_step(splits)
    # auto (the default) shares where it saves FLOPs: here, but not for a 2-token prompt
    # with 4 completions of 40 (one row of 165 costs more attention than 4 rows of 42).
    algo = AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01, importance_sampling="tis", importance_cap=2.0)
    trainer = make_trainer(model_dir, algo)
    for mb in splits:
        trainer.accumulate(mb)
    results["auto"] = {"sums": trainer.reduce_gradients(), "grads": full_grads(trainer), "step": trainer.finish_step()}
    g = torch.Generator().manual_seed(5)
    ids = torch.cat([torch.tensor([[7, 9]]).expand(4, 2), torch.randint(3, 500, (4, 40), generator=g)], 1)
    long = dict(
        input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool),
        loss_mask=torch.arange(42).expand(4, 42) >= 2, rollout_logprobs=torch.zeros(4, 42), advantages=torch.ones(4, 42),
    )  # fmt: skip
    trainer.accumulate(micro_batch(long, [0, 1, 2, 3], step=1, rank=rank, index=0, count=1))
    results["auto_long"] = {"step": trainer.finish_step()}
    torch.save(results, out)


@pytest.fixture(scope="module")
def compared(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("shared") / "compared.pt"
    spawn(shared_vs_padded, 1, str(tiny_model_dir), str(out))
    return torch.load(out, weights_only=False)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["shared", "one_row"])
def test_shared_prompt_loss_counts_and_gradients_are_the_padded_ones(compared: Results, mode: str) -> None:
    assert_the_padded_results(compared["padded"], compared[mode])


def test_auto_shares_a_prompt_where_that_saves_flops_only(compared: Results) -> None:
    """The default trainer (share_prompt=auto): the grouped batch shares (the padded
    gradients, 20 tokens saved); one short prompt before long completions does not."""
    assert_grads_close(compared["padded"]["grads"], compared["auto"]["grads"])
    assert compared["auto"]["step"]["prompt_tokens_saved"] == 8 + 12
    assert compared["auto_long"]["step"]["prompt_tokens_saved"] == 0


def test_the_step_reports_the_prompt_tokens_it_did_not_compute_again(compared: Results) -> None:
    assert compared["padded"]["step"]["prompt_tokens_saved"] == 0
    # micro-batch 0 holds rows 0, 1, 3 of the 5-token prompt (8 saved), 1 of another;
    # micro-batch 1 rows 4, 5, 6 of the 7-token one (12) and the 5-token prompt's near twin.
    assert compared["shared"]["step"]["prompt_tokens_saved"] == 8 + 12
    assert compared["one_row"]["step"]["prompt_tokens_saved"] == 8 + 12
