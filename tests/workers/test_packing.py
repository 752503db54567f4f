"""Packed micro-batches (``trainer.pack``, ``workers.packing``): one row of real tokens gives
the padded computation's log-probs, loss, counts and gradients, and no sequence sees another.

The trainer scenarios run in one spawned gloo rank with tests/workers/test_trainer.py's
helpers, on the tiny float32 Llama (sdpa attention: transformers builds the block-diagonal
causal mask from the restarting position ids).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.workers.test_trainer import (
    SPLITS_1,
    Batch,
    Results,
    assert_grads_close,
    full_grads,
    make_batch,
    make_trainer,
    rank_batches,
    spawn,
)
from workers.packing import pack, plan, unpack
from yatt.errors import ProtocolError
from yatt.rl.config import AlgorithmConfig

# ---------------------------------------------------------------- pack and unpack


def test_pack_then_unpack_gives_the_batch_back_with_zeros_at_the_pads() -> None:
    lengths = torch.tensor([3, 5, 1, 0, 2])  # a full row, a one-token row, an empty row
    attention = torch.arange(5)[None] < lengths[:, None]  # [B, T] right-padded
    x = torch.randn(5, 5, 3, requires_grad=True)  # [B, T, C]
    packing = plan(attention)
    packed = pack(x, packing)
    assert packed.shape == (1, 11, 3)
    assert packing.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 0, 1]]
    torch.testing.assert_close(packed[0, 3:8], x[1].detach())
    back = unpack(packed, packing)
    torch.testing.assert_close(back, x.detach() * attention[..., None], rtol=0, atol=0)
    torch.autograd.backward(back.sum())
    assert x.grad is not None and torch.equal(x.grad, attention[..., None].float().expand_as(x))
    # Aligned like log-probs: each sequence's first entry read the previous sequence.
    shifted = unpack(packed, packing, shifted=True)
    torch.testing.assert_close(shifted[:, 1:], back[:, 1:], rtol=0, atol=0)
    assert not shifted[:, 0].any()


def test_a_row_that_is_not_right_padded_is_refused() -> None:
    attention = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    with pytest.raises(ProtocolError, match="row 1 is not right-padded"):
        plan(attention)


# ---------------------------------------------------------------- packed vs padded trainers


def uneven_batch() -> Batch:
    """make_batch's 8 rows (rows 0 and 7 fill the width: no padding) with row 1 cut to a
    one-token completion and row 5 to its first token alone (no completion)."""
    batch = {k: v.clone() for k, v in make_batch().items()}
    for row, keep in ((1, 6), (5, 1)):  # row 1: prompt 5 + completion 1
        for key in ("attention_mask", "loss_mask"):
            batch[key][row, keep:] = False
        for key in ("input_ids", "rollout_logprobs", "advantages"):
            batch[key][row, keep:] = 0
    return batch


def packed_vs_padded(rank: int, model_dir: str, out: str) -> None:
    """The same trainers, padded then packed: log-probs, a streamed step with every loss term
    (4 micro-batches, KL to the reference, entropy, TIS), a PPO step with a critic."""
    batch, results = uneven_batch(), Results()
    ids, attention = batch["input_ids"], batch["attention_mask"]
    for mode in ("padded", "packed"):
        packed, r = mode == "packed", Results()
        results[mode] = r
        algo = AlgorithmConfig(kl_coef=0.1, entropy_coef=0.01, importance_sampling="tis", importance_cap=2.0)
        trainer = make_trainer(model_dir, algo, pack=packed, activation_checkpointing=packed)
        r["logprobs"] = trainer.logprobs(ids, attention)
        changed = ids.clone()
        changed[0] = (ids[0] + 17) % 500  # another first sequence, the same others
        r["logprobs_changed"] = trainer.logprobs(changed, attention)
        for mb in rank_batches(batch, SPLITS_1["four"], 0, rank):
            trainer.accumulate(mb)
        r["sums"] = trainer.reduce_gradients()
        r["grads"] = full_grads(trainer)
        r["step"] = trainer.finish_step()
        if packed:  # refused on every rank, at the step's first micro-batch, before any forward
            left = rank_batches(batch, SPLITS_1["one"], 1, rank)[0]
            left.attention_mask[2] = left.attention_mask[2].roll(3)  # row 2 is 10 of 12 long
            with pytest.raises(ProtocolError, match="row 2 is not right-padded"):
                trainer.accumulate(left)
        # gae is batch-wide: no-grad policy, reference and critic forwards prepare the batch.
        algo = AlgorithmConfig(advantage="gae", kl_coef=0.05, kl_in_reward=True, gamma=1.0, lam=0.95)
        critic = make_trainer(model_dir, algo, pack=packed, critic_lr=3e-3)
        r["gae"] = critic.train_step(rank_batches(batch, SPLITS_1["four"], 0, rank))
    torch.save(results, out)


@pytest.fixture(scope="module")
def compared(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = tmp_path_factory.mktemp("packing") / "compared.pt"
    spawn(packed_vs_padded, 1, str(tiny_model_dir), str(out))
    return torch.load(out, weights_only=False)  # type: ignore[no-any-return]


def test_packed_log_probs_are_the_padded_ones(compared: Results) -> None:
    valid = uneven_batch()["attention_mask"]
    padded, packed = compared["padded"]["logprobs"], compared["packed"]["logprobs"]
    torch.testing.assert_close(packed[valid], padded[valid], rtol=0, atol=1e-6)
    assert not packed[~valid].any() and not packed[:, 0].any()


def assert_the_padded_results(padded: Results, other: Results) -> None:
    """``other`` (another layout's streamed step and gae step) is the padded one's: the
    gradients, the counts exactly, every loss term and metric to 1e-6."""
    assert_grads_close(padded["grads"], other["grads"])
    for key in ("count", "tokens", "sequences", "padding", "positions"):
        assert other["sums"][key] == padded["sums"][key], key
    for key in ("loss", "entropy", "kl", "is_weight", "logprob_diff"):
        assert other["sums"][key] == pytest.approx(padded["sums"][key], rel=1e-6, abs=1e-6), key
    for key in ("loss", "grad_norm", "entropy", "kl", "pad_share"):
        assert other["step"][key] == pytest.approx(padded["step"][key], rel=1e-6, abs=1e-6), key
    for key in ("loss", "value_loss", "value_mean", "kl", "grad_norm", "critic_grad_norm", "tokens"):
        assert other["gae"][key] == pytest.approx(padded["gae"][key], rel=1e-6, abs=1e-6), key
    assert other["gae"]["value_loss"] > 0


def test_packed_loss_counts_and_gradients_are_the_padded_ones(compared: Results) -> None:
    assert_the_padded_results(compared["padded"], compared["packed"])
    assert compared["packed"]["step"]["kl"] == 0.0  # the reference is the policy


def test_a_packed_sequence_does_not_see_the_one_before_it(compared: Results) -> None:
    before, after = compared["packed"]["logprobs"], compared["packed"]["logprobs_changed"]
    valid = uneven_batch()["attention_mask"]
    assert (before[0] - after[0]).abs().max() > 0.1  # the changed sequence's own log-probs move
    torch.testing.assert_close(after[1:][valid[1:]], before[1:][valid[1:]], rtol=0, atol=1e-6)


def test_pad_share_is_the_share_of_padding_in_the_step_micro_batches(compared: Results) -> None:
    micro_batches = rank_batches(uneven_batch(), SPLITS_1["four"], 0, 0)
    pads = sum(int((~mb.attention_mask).sum()) for mb in micro_batches)
    positions = sum(mb.attention_mask.numel() for mb in micro_batches)
    assert pads > 0
    for mode in ("padded", "packed"):
        assert compared[mode]["step"]["pad_share"] == pytest.approx(pads / positions)
        assert compared[mode]["gae"]["pad_share"] == pytest.approx(pads / positions)
