"""yatt.rl.rl_math against hand-computed small cases, plus the invariants the trainer relies on."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from yatt.errors import PluginError
from yatt.rl import rl_math as rm

F64 = torch.float64


def t64(*rows: object) -> torch.Tensor:
    return torch.tensor(rows if len(rows) > 1 else rows[0], dtype=F64)


def close(actual: torch.Tensor, expected: object, tol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


# ----------------------------------------------------------------------------- advantages


def test_grpo_advantages_hand_computed() -> None:
    # mean 0.5; deviations +-0.5; unbiased var = 4 * 0.25 / 3 = 1/3, std 0.57735...
    # A = +-0.5 / 0.57735 = +-0.866025 (eps 0 to compare exactly)
    adv = rm.grpo_advantages(t64([1.0, 0.0, 0.0, 1.0]), eps=0.0)
    s = 0.5 / math.sqrt(1 / 3)
    close(adv, [s, -s, -s, s])
    assert abs(s - 0.8660254) < 1e-7


def test_dr_grpo_and_rloo_and_reinforce_baseline_hand_computed() -> None:
    r = t64([3.0, 0.0, 0.0, 1.0])  # mean 1
    close(rm.grpo_advantages(r, std_normalize=False), [2.0, -1.0, -1.0, 0.0])
    close(rm.reinforce_pp_baseline(r), [2.0, -1.0, -1.0, 0.0])
    # RLOO: r_i - mean of others: 3 - 1/3, 0 - 4/3, 0 - 4/3, 1 - 3/3
    close(rm.rloo_advantages(r), [8 / 3, -4 / 3, -4 / 3, 0.0])


def test_degenerate_groups() -> None:
    close(rm.grpo_advantages(t64([5.0])), [0.0])
    close(rm.rloo_advantages(t64([5.0])), [0.0])
    close(rm.grpo_advantages(t64([2.0, 2.0, 2.0])), [0.0, 0.0, 0.0])
    # integer rewards are accepted and become float
    assert rm.grpo_advantages(torch.tensor([1, 0])).is_floating_point()
    with pytest.raises(ValueError, match=r"rewards .*\[n\].*\(2, 2\)"):
        rm.grpo_advantages(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="empty"):
        rm.rloo_advantages(torch.zeros(0))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-10, 10), min_size=2, max_size=16))
def test_rloo_is_scaled_dr_grpo(rewards: list[float]) -> None:
    r = torch.tensor(rewards, dtype=F64)
    n = len(rewards)
    close(rm.rloo_advantages(r), rm.grpo_advantages(r, std_normalize=False) * n / (n - 1), 1e-9)
    close(rm.grpo_advantages(r).sum(), 0.0, 1e-6)


def test_reinforce_pp_returns_hand_computed() -> None:
    # row 0: prompt at t=0, completion t=1..3, pad t=4; row 1: completion t=1..2
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]], dtype=torch.bool)
    rewards = t64([1.0, 2.0])
    kl = t64([[9.0, 0.1, 0.2, 0.3, 9.0], [9.0, 0.5, 0.5, 9.0, 9.0]])
    out = rm.reinforce_pp_returns(rewards, mask, kl=kl, kl_coef=1.0, gamma=0.5)
    # row 0 token rewards: -0.1, -0.2, 1 - 0.3 = 0.7
    #   G3 = 0.7; G2 = -0.2 + 0.5 * 0.7 = 0.15; G1 = -0.1 + 0.5 * 0.15 = -0.025
    # row 1 token rewards: -0.5, 2 - 0.5 = 1.5; G2 = 1.5; G1 = -0.5 + 0.75 = 0.25
    close(out, [[0.0, -0.025, 0.15, 0.7, 0.0], [0.0, 0.25, 1.5, 0.0, 0.0]])


def test_reinforce_pp_returns_skips_unmasked_gaps_and_empty_rows() -> None:
    # tokens at t=0 and t=2 (t=1 is tool output): the discount steps once, not twice
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]], dtype=torch.bool)
    out = rm.reinforce_pp_returns(t64([4.0, 7.0]), mask, gamma=0.5)
    close(out, [[2.0, 0.0, 4.0], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match=r"rewards has shape \(3,\) but mask has shape \(2, 3\)"):
        rm.reinforce_pp_returns(t64([1.0, 2.0, 3.0]), mask)


def test_masked_whiten_hand_computed_and_global_moments() -> None:
    values = t64([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    # mean 2, unbiased var = (1 + 0 + 1) / 2 = 1 -> (v - 2) / 1; the unmasked 100 is ignored
    close(rm.masked_whiten(values, mask, eps=0.0), [[-1.0, 0.0, 1.0, 0.0]])
    close(rm.masked_whiten(values, mask, eps=0.0, shift_mean=False), [[1.0, 2.0, 3.0, 0.0]])
    # two "ranks" whitening with summed moments equals whitening the concatenation
    a, b = torch.randn(3, 5, dtype=F64), torch.randn(2, 5, dtype=F64)
    ma, mb = torch.rand(3, 5) > 0.3, torch.rand(2, 5) > 0.3
    moments = tuple(x + y for x, y in zip(rm.masked_moments(a, ma), rm.masked_moments(b, mb), strict=True))
    assert len(moments) == 3
    full = rm.masked_whiten(torch.cat([a, b]), torch.cat([ma, mb]))
    close(torch.cat([rm.masked_whiten(a, ma, moments=moments), rm.masked_whiten(b, mb, moments=moments)]), full, 1e-12)
    close(rm.masked_whiten(a, torch.zeros_like(ma)), torch.zeros_like(a))  # empty mask: zeros, not nan


def test_gae_hand_computed() -> None:
    rewards = t64([[0.0, 0.0, 1.0, 0.0]])
    values = t64([[0.5, 0.4, 0.6, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    adv, ret = rm.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # d2 = 1 + 0 - 0.6 = 0.4;  d1 = 0 + 0.9 * 0.6 - 0.4 = 0.14;  d0 = 0 + 0.9 * 0.4 - 0.5 = -0.14
    # A2 = 0.4;  A1 = 0.14 + 0.45 * 0.4 = 0.32;  A0 = -0.14 + 0.45 * 0.32 = 0.004
    close(adv, [[0.004, 0.32, 0.4, 0.0]], 1e-12)
    close(ret, [[0.504, 0.72, 1.0, 0.0]], 1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_gae_lam1_gamma1_zero_values_is_reward_to_go(b: int, t: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, t, generator=g, dtype=F64)
    mask = torch.rand(b, t, generator=g) > 0.3
    adv, ret = rm.gae(rewards, torch.zeros_like(rewards), mask, gamma=1.0, lam=1.0)
    expected = torch.zeros_like(rewards)
    for i in range(b):
        for j in range(t):
            if mask[i, j]:
                expected[i, j] = sum(float(rewards[i, k]) for k in range(j, t) if mask[i, k])
    close(adv, expected, 1e-12)
    close(ret, expected, 1e-12)
    # and REINFORCE++ with gamma 1 gives the same reward-to-go for a last-token reward
    seq = torch.randn(b, generator=g, dtype=F64)
    placed = torch.zeros_like(rewards)
    for i in range(b):
        idx = mask[i].nonzero()
        if len(idx):
            placed[i, int(idx[-1])] = seq[i]
    close(rm.reinforce_pp_returns(seq, mask), rm.gae(placed, torch.zeros_like(placed), mask, gamma=1.0, lam=1.0)[1])


# ----------------------------------------------------------------------------- log-probs


def test_token_logprobs_and_entropy_match_naive_loop() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g, dtype=F64)
    ids = torch.randint(0, 7, (2, 5), generator=g)
    for temperature in (1.0, 0.7):
        lp = rm.token_logprobs(logits, ids, temperature=temperature)
        ent = rm.entropy_from_logits(logits, temperature=temperature)
        assert lp.shape == ent.shape == (2, 5)
        for b in range(2):
            assert lp[b, 0] == 0.0 and ent[b, 0] == 0.0
            for t in range(1, 5):
                logp = torch.log_softmax(logits[b, t - 1] / temperature, dim=-1)
                close(lp[b, t], logp[ids[b, t]], 1e-12)
                close(ent[b, t], -(logp.exp() * logp).sum(), 1e-12)


def test_token_logprobs_hand_computed_chunked_and_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    # uniform logits over 4 tokens: log p = -log 4; logits [0, log 3, 0, 0] -> p(token 1) = 3/6
    logits = torch.zeros(1, 3, 4, dtype=F64)
    logits[0, 1, 1] = math.log(3.0)
    ids = torch.tensor([[2, 0, 1]])
    close(rm.token_logprobs(logits, ids), [[0.0, -math.log(4.0), math.log(0.5)]], 1e-12)
    # entropy: position 1 uniform over 4 = log 4; position 2: p = (1/6, 1/2, 1/6, 1/6)
    h2 = -(3 * (1 / 6) * math.log(1 / 6) + 0.5 * math.log(0.5))
    close(rm.entropy_from_logits(logits), [[0.0, math.log(4.0), h2]], 1e-12)
    # chunking (here 1 token per chunk) and bf16 input change nothing
    big = torch.randn(3, 6, 5, dtype=F64)
    big_ids = torch.randint(0, 5, (3, 6))
    expected = rm.token_logprobs(big, big_ids)
    monkeypatch.setattr(rm, "_CHUNK_ELEMENTS", 5)
    close(rm.token_logprobs(big, big_ids), expected, 1e-12)
    lp16 = rm.token_logprobs(big.to(torch.bfloat16), big_ids)
    assert lp16.dtype == torch.float32
    close(lp16, rm.token_logprobs(big.to(torch.bfloat16).double(), big_ids).float(), 1e-5)


def test_token_logprobs_gradient_matches_log_softmax() -> None:
    logits = torch.randn(2, 4, 6, dtype=F64, requires_grad=True)
    ids = torch.randint(0, 6, (2, 4))
    torch.autograd.backward(rm.token_logprobs(logits, ids, temperature=0.5).sum())
    ref_logits = logits.detach().clone().requires_grad_(True)
    torch.autograd.backward(torch.log_softmax(ref_logits[:, :-1] / 0.5, -1).gather(-1, ids[:, 1:, None]).sum())
    assert logits.grad is not None and ref_logits.grad is not None
    close(logits.grad, ref_logits.grad, 1e-12)


def test_token_logprobs_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"logits has shape \(2, 4, 6\) but input_ids has shape \(2, 3\)"):
        rm.token_logprobs(torch.zeros(2, 4, 6), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 6\).*\[0, 6\]"):
        rm.token_logprobs(torch.zeros(1, 2, 6), torch.tensor([[0, 6]]))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        rm.entropy_from_logits(torch.zeros(1, 2, 6), temperature=0.0)


# ----------------------------------------------------------------------------- losses


def test_ppo_loss_hand_computed() -> None:
    # ratios e^0.5 = 1.6487 (clipped to 1.2 for A > 0), e^-0.5 = 0.6065 (A < 0: clip to 0.8),
    # 1.1 (inside), and a masked token
    lp = t64([[0.5, -0.5, math.log(1.1), 3.0]])
    old = torch.zeros_like(lp)
    adv = t64([[2.0, -1.0, 1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    loss, stats = rm.policy_loss(lp, old, adv, mask)
    # t0: -min(1.6487 * 2, 1.2 * 2) = -2.4;  t1: -min(-0.6065, -0.8) = 0.8;  t2: -1.1
    close(loss, [[-2.4, 0.8, -1.1, 0.0]], 1e-12)
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    assert stats["clip_high_frac"] == pytest.approx(1 / 3) and stats["clip_low_frac"] == pytest.approx(1 / 3)
    assert stats["ratio_mean"] == pytest.approx((math.exp(0.5) + math.exp(-0.5) + 1.1) / 3)
    assert stats["ratio_max"] == pytest.approx(math.exp(0.5))
    # DAPO clip-higher: clip_high 0.28 lets t0 reach 1.28 * 2
    loss_hi, _ = rm.policy_loss(lp, old, adv, mask, clip_high=0.28)
    close(loss_hi[0, 0], -2.56, 1e-12)
    # sequence-level advantages [B] broadcast over tokens
    loss_seq, _ = rm.policy_loss(lp, old, t64([1.0]), mask)
    close(loss_seq, [[-1.2, -math.exp(-0.5), -1.1, 0.0]], 1e-12)


def test_dual_clip_bounds_the_loss() -> None:
    # A = -1, ratio e^2 = 7.389: PPO loss 7.389, dual clip c = 3 caps it at 3 (and kills the gradient)
    lp = t64([[2.0, 0.1]]).requires_grad_(True)
    old = torch.zeros(1, 2, dtype=F64)
    adv = t64([[-1.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    plain, _ = rm.policy_loss(lp, old, adv, mask)
    close(plain.detach(), [[math.exp(2.0), math.exp(0.1)]], 1e-12)
    loss, stats = rm.policy_loss(lp, old, adv, mask, dual_clip=3.0)
    close(loss.detach(), [[3.0, math.exp(0.1)]], 1e-12)
    assert stats["dual_clip_frac"] == pytest.approx(0.5)
    torch.autograd.backward(loss.sum())
    assert lp.grad is not None
    close(lp.grad, [[0.0, math.exp(0.1)]], 1e-12)
    # property: for A < 0 the loss never exceeds -c * A
    g = torch.Generator().manual_seed(1)
    lp2 = torch.randn(4, 6, generator=g, dtype=F64) * 3
    adv2 = torch.randn(4, 6, generator=g, dtype=F64)
    loss2, _ = rm.policy_loss(lp2, torch.zeros_like(lp2), adv2, torch.ones(4, 6, dtype=torch.bool), dual_clip=2.0)
    neg = adv2 < 0
    assert bool((loss2[neg] <= -2.0 * adv2[neg] + 1e-12).all())


def test_gspo_ratio_equals_sequence_ratio_and_token_gradient() -> None:
    lp = t64([[0.3, -0.1, 0.4, 7.0], [0.2, 0.0, 0.0, 0.0]]).requires_grad_(True)
    old = t64([[0.1, 0.1, 0.1, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    adv = t64([1.0, 1.0])
    loss, stats = rm.policy_loss(lp, old, adv, mask, kind="gspo", clip_low=0.5, clip_high=0.5)
    # row 0: mean log ratio (0.2 - 0.2 + 0.3) / 3 = 0.1 -> s = e^0.1 on every token; row 1: e^0.2
    s0, s1 = math.exp(0.1), math.exp(0.2)
    close(loss.detach(), [[-s0, -s0, -s0, 0.0], [-s1, 0.0, 0.0, 0.0]], 1e-12)
    assert stats["ratio_mean"] == pytest.approx((3 * s0 + s1) / 4)
    torch.autograd.backward(loss.sum())
    assert lp.grad is not None
    # GSPO-token gradient: d(-s_i,t A)/d logp_t = -s_i A on masked tokens
    close(lp.grad, [[-s0, -s0, -s0, 0.0], [-s1, 0.0, 0.0, 0.0]], 1e-12)
    # clipped: with clip 0.05 row 0's s = 1.105 > 1.05 is clipped
    clipped, st_ = rm.policy_loss(lp.detach(), old, adv, mask, kind="gspo", clip_low=0.05, clip_high=0.05)
    close(clipped[0, :3], [-1.05] * 3, 1e-12)
    assert st_["clip_frac"] == pytest.approx(1.0)


def test_policy_loss_rejects_bad_input() -> None:
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\) but logprobs has shape \(2, 3\)"):
        rm.policy_loss(z, z, torch.zeros(3), z.bool())
    with pytest.raises(ValueError, match=r"mask has shape \(2, 4\) but logprobs has shape \(2, 3\)"):
        rm.policy_loss(z, z, z, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="kind must be 'ppo' or 'gspo'"):
        rm.policy_loss(z, z, z, z.bool(), kind="grpo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        rm.policy_loss(z, z, z, z.bool(), dual_clip=0.5)


def test_importance_weights_hand_computed() -> None:
    # ratios e^0 = 1, e^1 = 2.718, e^-1 = 0.368, masked e^3
    old = t64([[0.0, 1.0, -1.0, 3.0]])
    rollout = torch.zeros_like(old)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    e, ie = math.e, 1 / math.e
    close(rm.importance_weights(old, rollout, mask, kind="none", cap=2.0), [[1.0, 1.0, 1.0, 0.0]])
    close(rm.importance_weights(old, rollout, mask, kind="tis", cap=2.0), [[1.0, 2.0, ie, 0.0]], 1e-12)
    # MIS zeroes the token above the cap and keeps the others' ratios
    close(rm.importance_weights(old, rollout, mask, kind="mis", cap=2.0), [[1.0, 0.0, ie, 0.0]], 1e-12)
    close(rm.importance_weights(old, rollout, mask, kind="mis", cap=3.0), [[1.0, e, ie, 0.0]], 1e-12)
    w = rm.importance_weights(old.requires_grad_(True), rollout, mask, kind="tis", cap=2.0)
    assert not w.requires_grad


def test_kl_estimators_hand_computed() -> None:
    lp, ref = t64([[0.0, -1.0]]), t64([[-1.0, -1.0]])
    # x = lp - ref = (1, 0): k1 = x, k2 = x^2 / 2, k3 = e^-x + x - 1
    close(rm.kl_penalty(lp, ref, kind="k1"), [[1.0, 0.0]])
    close(rm.kl_penalty(lp, ref, kind="k2"), [[0.5, 0.0]])
    close(rm.kl_penalty(lp, ref, kind="k3"), [[math.exp(-1.0), 0.0]], 1e-12)


def test_value_loss_hand_computed() -> None:
    values = t64([[1.0, 0.0, 0.5]])
    old = t64([[0.5, 0.5, 0.5]])
    returns = t64([[0.0, 0.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # a 0/1 float mask is accepted like a bool one
    # t0: clip(1.0, 0.3, 0.7) = 0.7 -> 0.5 * max(1.0, 0.49) = 0.5
    # t1: clip(0.0, 0.3, 0.7) = 0.3 -> 0.5 * max(0.0, 0.09) = 0.045;  t2 masked
    close(rm.value_loss(values, old, returns, mask, clip=0.2), [[0.5, 0.045, 0.0]], 1e-12)


# ----------------------------------------------------------------------------- aggregation


def test_loss_sum_and_count_hand_computed() -> None:
    per_token = t64([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    # token_mean: (1 + 2 + 4) / 3;  seq_mean_token_mean: (1.5 + 4) / 2;  seq_mean_token_sum: (3 + 4) / 2
    close(rm.loss_sum(per_token, mask, mode="token_mean"), 7.0)
    assert int(rm.loss_count(mask, mode="token_mean")) == 3
    close(rm.loss_sum(per_token, mask, mode="seq_mean_token_mean"), 5.5)
    assert int(rm.loss_count(mask, mode="seq_mean_token_mean")) == 2
    close(rm.loss_sum(per_token, mask, mode="seq_mean_token_sum"), 7.0)
    assert int(rm.loss_count(mask, mode="seq_mean_token_sum")) == 2
    assert int(rm.loss_count(mask.long(), mode="seq_mean_token_sum")) == 2  # 0/1 int mask
    # nan at a masked-out position does not leak
    per_token[2, 2] = float("nan")
    close(rm.loss_sum(per_token, mask, mode="token_mean"), 7.0)


def _full_batch_reference(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The step loss written the naive way, over the whole batch at once."""
    if mode == "token_mean":
        return per_token[mask].mean()
    rows = [per_token[i][mask[i]] for i in range(mask.shape[0]) if mask[i].any()]
    return torch.stack([r.mean() if mode == "seq_mean_token_mean" else r.sum() for r in rows]).mean()


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("n_micro", [1, 2, 4])
def test_streamed_aggregation_equals_full_batch(mode: rm.AggregationMode, n_micro: int) -> None:
    g = torch.Generator().manual_seed(n_micro)
    weight = torch.randn(5, 3, generator=g, dtype=F64).requires_grad_(True)  # a tiny 3-token "policy"
    features = torch.randn(8, 6, 5, generator=g, dtype=F64)  # [B, T, 5]
    mask = torch.rand(8, 6, generator=g) > 0.4
    mask[3] = False  # a fully padded row
    mask[0, 0] = True  # at least one token
    old = torch.randn(8, 6, generator=g, dtype=F64) * 0.1
    adv = torch.randn(8, generator=g, dtype=F64)

    def per_token(rows: slice) -> torch.Tensor:
        lp = torch.log_softmax(features[rows] @ weight, -1)[..., 0]  # [b, T] log-prob of token 0
        return rm.policy_loss(lp, old[rows], adv[rows], mask[rows])[0]

    ref = _full_batch_reference(per_token(slice(None)), mask, mode)
    (ref_grad,) = torch.autograd.grad(ref, weight)

    size = 8 // n_micro
    total, count = torch.zeros((), dtype=F64), torch.zeros((), dtype=torch.int64)
    for k in range(n_micro):
        rows = slice(k * size, (k + 1) * size)
        part = rm.loss_sum(per_token(rows), mask[rows], mode=mode)
        torch.autograd.backward(part)  # streamed: backward before the global count is known
        total += part.detach()
        count += rm.loss_count(mask[rows], mode=mode)
    assert weight.grad is not None
    close(total / count, ref.detach(), 1e-6)
    close(weight.grad / count, ref_grad, 1e-6)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=10))
def test_overlong_penalty_properties(lengths: list[int]) -> None:
    out = rm.overlong_penalty(torch.tensor(lengths), max_new_tokens=32, buffer=8, penalty=0.5)
    for length, p in zip(lengths, out.tolist(), strict=True):
        assert -0.5 <= p <= 0.0
        assert (p == 0.0) == (length <= 24)
        assert (p == -0.5) == (length >= 32)


def test_overlong_penalty_hand_computed() -> None:
    # expected length 32 - 8 = 24: L = 20 -> 0; 26 -> -(2 / 8); 30 -> -(6 / 8); 32, 40 -> -1
    out = rm.overlong_penalty(torch.tensor([20, 24, 26, 30, 32, 40]), max_new_tokens=32, buffer=8)
    close(out, [0.0, 0.0, -0.25, -0.75, -1.0, -1.0])
    close(rm.overlong_penalty(torch.tensor([40]), max_new_tokens=32, buffer=0), [0.0])
    with pytest.raises(ValueError, match="buffer <= max_new_tokens"):
        rm.overlong_penalty(torch.tensor([1]), max_new_tokens=4, buffer=8)


# ----------------------------------------------------------------------------- issue 13 additions


def test_k3_is_clamped_as_verl_does() -> None:
    # x = lp - ref = -90: e^90 overflows float32; verl clamps -x to 20 and k3 to 10.
    lp = torch.tensor([[-90.0, -0.5]], requires_grad=True)
    ref = torch.zeros(1, 2)
    k3 = rm.kl_penalty(lp, ref, kind="k3")
    assert torch.isfinite(k3).all()
    close(k3, [[10.0, math.exp(0.5) - 0.5 - 1.0]], 1e-6)
    torch.autograd.backward(k3.sum())
    assert lp.grad is not None and torch.isfinite(lp.grad).all()
    # Below the value clamp, the log-ratio clamp alone: -x = 20 would give e^20 - 21 > 10.
    close(rm.kl_penalty(t64([[-5.0]]), t64([[0.0]]), kind="k3"), [[10.0]])
    close(rm.kl_penalty(t64([[1.0]]), t64([[0.0]]), kind="k3"), [[math.exp(-1.0)]], 1e-12)


def test_abs_and_straight_through_estimators() -> None:
    lp = t64([[0.5, -1.0]]).requires_grad_(True)
    ref = t64([[0.0, 0.0]])
    close(rm.kl_penalty(lp, ref, kind="abs"), [[0.5, 1.0]])
    for kind, base in (("k1+", "k1"), ("k3+", "k3")):
        value = rm.kl_penalty(lp, ref, kind=kind)  # type: ignore[arg-type]
        close(value.detach(), rm.kl_penalty(lp.detach(), ref, kind=base))  # type: ignore[arg-type]
        (grad,) = torch.autograd.grad(value.sum(), lp)
        close(grad, [[0.5, -1.0]])  # k2's gradient: x
    with pytest.raises(ValueError, match="kind must be one of"):
        rm.kl_penalty(lp, ref, kind="k4")  # type: ignore[arg-type]


def test_adaptive_kl_controller_hand_computed() -> None:
    ctl = rm.AdaptiveKLController(0.1, target=0.1, horizon=100)
    # kl 0.2: error clip(2 - 1) = 0.2; 10 sequences: x (1 + 0.2 * 10 / 100) = 1.02
    assert ctl.update(0.2, 10) == pytest.approx(0.102)
    # kl 0.09: error -0.1 -> x (1 - 0.1 * 50 / 100) = 0.95
    assert ctl.update(0.09, 50) == pytest.approx(0.102 * 0.95)


def test_token_sum_and_dr_grpo_normaliser_hand_computed() -> None:
    per_token = t64([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    close(rm.loss_sum(per_token, mask, mode="token_sum"), 7.0)
    assert int(rm.loss_count(mask, mode="token_sum")) == 0  # the trainer divides by max(0, 1)
    # Dr.GRPO: each sequence's token sum over the constant 10, averaged over 2 sequences
    close(rm.loss_sum(per_token, mask, mode="seq_mean_token_sum_norm", norm=10.0) / 2, (3 + 4) / 10 / 2)
    assert int(rm.loss_count(mask, mode="seq_mean_token_sum_norm")) == 2
    with pytest.raises(ValueError, match="norm > 0"):
        rm.loss_sum(per_token, mask, mode="seq_mean_token_sum_norm")


def test_new_policy_losses_hand_computed() -> None:
    l2 = math.log(2.0)
    lp = t64([[l2, 0.0]]).requires_grad_(True)  # ratios 2 and 1 against old 0
    old = t64([[0.0, 0.0]])
    adv = t64([[1.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    # CISPO: -sg[clip(r, 0.8, 1.28)] A logp; token 0 clipped at 1.28
    loss, stats = rm.cispo_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(loss.detach(), [[-1.28 * l2, 0.0]])
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    close(grad, [[-1.28, 1.0]])  # the clipped token keeps its gradient (scaled), unlike PPO
    assert stats["clip_frac"] == pytest.approx(0.5)
    # SAPO at ratio 1: gate (4 / tau) sigmoid(0) = 2 / tau
    loss, _ = rm.sapo_loss(lp, old, adv, mask, tau_pos=1.0, tau_neg=2.0)
    gate0 = 4.0 * torch.sigmoid(torch.tensor(1.0, dtype=F64))  # tau 1, ratio 2
    close(loss.detach(), [[-float(gate0), 1.0]])
    # GPG / REINFORCE: -A logp
    loss, _ = rm.reinforce_loss(lp, old, adv, mask)
    close(loss.detach(), [[-l2, 0.0]])
    # GMPO: x = (log 2, 0); A > 0 on both -> clip x above at 0.4; seq ratio e^(0.4 / 2); seq adv 0.5
    loss, _ = rm.gmpo_loss(lp, old, t64([[1.0, 0.0]]), mask, clip_low=0.4, clip_high=0.4)
    close(loss.detach(), [[-0.5 * math.exp(0.2)] * 2])


def test_cov_losses_pick_tokens_by_covariance() -> None:
    lp = t64([[-1.0, -2.0, -3.0, -4.0]]).requires_grad_(True)
    old = lp.detach().clone()  # ratio 1: PPO clip leaves every token alone
    adv = t64([[2.0, 1.0, -1.0, -2.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    # cov_t = (A - 0)(lp + 2.5): 3, 0.5, 0.5, 3
    loss, stats = rm.kl_cov_loss(lp, old, adv, mask, ratio=0.25, coef=1.0)
    assert stats["clip_frac"] == pytest.approx(0.25)  # one token (the first of the two 3s)
    close(loss.detach(), -adv)  # |log-ratio| = 0 at ratio 1: the value is PPO's
    loss, stats = rm.clip_cov_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, ratio=0.5, lb=1.0, ub=5.0)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert stats["clip_frac"] == pytest.approx(0.5)  # both tokens with cov 3 in (1, 5) are cut
    close(grad, [[0.0, -1.0, 1.0, 0.0]])


def test_policy_loss_registry_and_a_dotted_path() -> None:
    from yatt.rl.config import POLICY_LOSSES

    assert tuple(rm.POLICY_LOSSES) == POLICY_LOSSES
    assert rm.get_policy_loss("tests.yatt.rl.test_rl_math:my_loss") is my_loss
    with pytest.raises(PluginError, match=r"algorithm\.policy_loss: .*nothing_here.* a built-in loss \(ppo, gspo"):
        rm.get_policy_loss("tests.yatt.rl.test_rl_math:nothing_here")


def my_loss(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, params: rm.LossParams
) -> tuple[torch.Tensor, dict[str, float]]:
    """A user's loss for the registry test."""
    return -adv * lp * mask, {}


def test_sequence_geometric_bounds_and_veto_weights_hand_computed() -> None:
    old = t64([[1.0, -1.0, 0.5], [0.2, 0.2, 9.0]])
    rollout = torch.zeros_like(old)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    # sequence: e^(1 - 1 + 0.5) and e^0.4; geometric: e^(0.5 / 3) and e^0.2
    w = rm.importance_weights(old, rollout, mask, kind="tis", level="sequence", cap=5.0)
    close(w, [[math.exp(0.5)] * 3, [math.exp(0.4)] * 2 + [0.0]], 1e-12)
    w = rm.importance_weights(old, rollout, mask, kind="none", level="geometric", cap=5.0)
    close(w, [[1.0] * 3, [1.0, 1.0, 0.0]])
    w = rm.importance_weights(old, rollout, mask, kind="mis", level="geometric", floor=1.2, cap=5.0)
    close(w, [[0.0] * 3, [math.exp(0.2)] * 2 + [0.0]], 1e-12)  # e^(1/6) = 1.18 < 1.2: row rejected
    # token level, IcePop bounds [0.5, 5]: e^-1 = 0.37 is masked, the rest kept
    w = rm.importance_weights(old, rollout, mask, kind="mis", floor=0.5, cap=5.0)
    close(w, [[math.e, 0.0, math.exp(0.5)], [math.exp(0.2)] * 2 + [0.0]], 1e-12)
    # veto 0.5: row 0 has a token ratio e^-1 < 0.5 and is dropped whole
    w = rm.importance_weights(old, rollout, mask, kind="tis", veto=0.5, cap=5.0)
    close(w, [[0.0] * 3, [math.exp(0.2)] * 2 + [0.0]], 1e-12)


def test_token_advantages_reinforce_pp_gae_and_kl_reward_to_go() -> None:
    field = t64([[0.0, 2.0, 2.0, 0.0], [0.0, -1.0, 0.0, 0.0]])  # rewards on completion tokens
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]], dtype=torch.bool)
    kl = t64([[0.0, 0.5, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    # REINFORCE++, gamma 1, coef 0.1: row 0 rewards (-0.05, 2 - 0.1) -> returns (1.85, 1.9)
    adv, ret = rm.token_advantages("reinforce_pp", field, mask, kl=kl, kl_coef=0.1)
    close(adv, [[0.0, 1.85, 1.9, 0.0], [0.0, -1.2, 0.0, 0.0]])
    assert ret is adv
    # GRPO-like: the field plus the KL reward-to-go
    adv, ret = rm.token_advantages("grpo", field, mask, kl=kl, kl_coef=0.1)
    close(adv, [[0.0, 2.0 - 0.15, 2.0 - 0.1, 0.0], [0.0, -1.2, 0.0, 0.0]])
    assert ret is None
    # GAE with zero values, lam 1: the same returns as REINFORCE++
    adv, ret = rm.token_advantages("gae", field, mask, kl=kl, kl_coef=0.1, values=torch.zeros_like(field))
    close(adv, [[0.0, 1.85, 1.9, 0.0], [0.0, -1.2, 0.0, 0.0]])


def test_turn_advantages_by_hand() -> None:
    """G_it = sum_k>=t gamma^(k-t) r_ik, minus the group's mean G_i0 (over its std)."""
    dr = rm.turn_advantages([[0.0, 1.0], [0.5]], gamma=0.5, std_normalize=False)
    # G: episode 0 [0 + 0.5 * 1, 1] = [0.5, 1]; episode 1 [0.5]; baseline mean(0.5, 0.5) = 0.5
    assert [a.tolist() for a in dr] == [[0.0, 0.5], [0.0]]
    grpo = rm.turn_advantages([[0.0, 1.0], [0.0, 0.0, 0.0]])
    # G: [1, 1] and [0, 0, 0]; mean 0.5, std (n - 1) sqrt(0.5) = 0.7071
    assert torch.allclose(grpo[0], torch.tensor([0.70711, 0.70711]), atol=1e-4)
    assert torch.allclose(grpo[1], torch.tensor([-0.70711] * 3), atol=1e-4)


def test_turn_advantages_with_the_reward_at_the_end_are_the_episodes_grpo_advantage() -> None:
    """Gamma 1, a reward only at an episode's last turn: every turn gets the episode's GRPO
    advantage, however many turns each episode took (the baseline does not depend on them)."""
    final = [1.0, 0.0, 0.5, 0.0]
    turns = [[0.0] * k + [r] for k, r in zip((0, 3, 1, 5), final, strict=True)]
    expected = rm.grpo_advantages(torch.tensor(final))
    for advantages, want, rewards in zip(rm.turn_advantages(turns), expected.tolist(), turns, strict=True):
        assert advantages.shape == (len(rewards),) and torch.allclose(advantages, torch.full_like(advantages, want), atol=1e-6)
