"""The RL math of yatt: advantages, log-probs, losses and their aggregation, in pure torch.

Why a module of its own: the controllers compute per-group advantages (GRPO, RLOO) on CPU
as groups are scored, and the trainer computes log-probs, losses and token-level
advantages on its device. Both must use the same formulas, so they live here, free of
process, socket and model code, and are tested against hand-computed cases.

Formulas (r: rewards of one group of n completions of a prompt; m: completion mask):

- GRPO (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean(r)) / (std(r) + eps), the
  unbiased (n - 1) std; Dr.GRPO (Liu et al. 2025) drops the std: A_i = r_i - mean(r), and
  aggregates with a constant normaliser (``seq_mean_token_sum_norm``) instead of lengths.
- RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j = n / (n - 1) (r_i - mean(r)).
- REINFORCE++ (Hu 2025): per-token reward = sequence reward on the last completion token
  minus kl_coef * KL_t; returns G_t = sum_{s >= t} gamma^(s - t) reward_s over completion
  tokens, whitened over the global batch (``masked_whiten``). REINFORCE++-baseline
  subtracts the group mean first: A_i = r_i - mean(r).
- GAE (Schulman et al. 2016): delta_t = r_t + gamma V_{t+1} - V_t,
  A_t = delta_t + gamma lam A_{t+1}, returns R_t = A_t + V_t; the value after the last
  completion token is 0. The advantages (not the returns) are whitened over the global
  batch, as verl does; ``token_advantages`` builds the token rewards of each estimator.
- PPO clip (Schulman et al. 2017): rho_t = exp(logp_t - logp_old_t),
  loss_t = -min(rho_t A_t, clip(rho_t, 1 - clip_low, 1 + clip_high) A_t). DAPO
  clip-higher (Yu et al. 2025) is clip_high > clip_low. Dual clip (Ye et al. 2020): for
  A_t < 0 the loss is also bounded above by -c A_t.
- GSPO (Zheng et al. 2025): the sequence ratio s_i = exp(mean_t (logp_t - logp_old_t))
  replaces rho_t, in its token form s_i,t = sg[s_i] * exp(logp_t - sg[logp_t]) (value s_i,
  gradient s_i * grad logp_t), clipped like PPO.
- TIS (truncated importance sampling, Yao et al. 2025) and MIS (masked, Liu et al. 2025):
  the rollout engine's log-probs differ from the trainer's; w_t = exp(logp_old_t -
  logp_rollout_t), truncated at the cap (TIS) or zeroed above it (MIS), weights the loss.
- CISPO (MiniMax 2025): loss_t = -sg[clip(rho_t, 1 - clip_low, 1 + clip_high)] A_t logp_t.
- GMPO (Zhao et al. 2025): the geometric mean of the sign-aware clipped token ratios,
  loss_i = -A_i exp(mean_t min(sgn(A) x_t, sgn(A) clip(x_t, -clip_low, clip_high)) sgn(A)),
  x_t = logp_t - logp_old_t; one value per sequence, put on each of its tokens (so it
  needs ``seq_mean_token_mean``, which then averages it over sequences, as verl does).
- SAPO (Qwen 2025): loss_t = -A_t (4 / tau) sigmoid(tau (rho_t - 1)), tau = tau_pos for
  A_t > 0, else tau_neg: a soft gate instead of the hard clip.
- Clip-Cov / KL-Cov (Cui et al. 2025): per-token cov_t = (A_t - mean A)(logp_t - mean logp)
  over the micro-batch. Clip-Cov zeroes the gradient of a random ``ratio`` share of the
  unclipped tokens whose cov lies in (lb, ub); KL-Cov adds coef |x_t| to the top ``ratio``
  share by cov. Both are plain PPO clip otherwise.
- GPG (Chu et al. 2025) and plain REINFORCE: loss_t = -A_t logp_t (no ratio, no clip).
- Off-policy correction from the rollout engine's log-probs, per token, per sequence
  (product of the token ratios) or geometric (their geometric mean): truncated (TIS,
  w = min(w, cap)) or masked (MIS/IcePop: w = 0 outside [floor, cap]); a sequence with a
  token ratio below the veto threshold is dropped whole.
- KL estimators (Schulman 2020, "Approximating KL divergence"), x = logp - logp_ref:
  k1 = x, abs = |x|, k2 = x^2 / 2, k3 = exp(-x) + x - 1 computed as verl and OpenRLHF do,
  with -x clamped to [-20, 20] and k3 to [-10, 10] (unclamped, x = -90 overflows float32).
  ``k1+`` and ``k3+`` are straight-through: the value of k1 / k3, the gradient of k2.
- DAPO overlong punishment: a linear penalty from 0 to -penalty over the last ``buffer``
  tokens before max_new_tokens, -penalty at or past the limit.
- PPO value clip: 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).

Token alignment: every [B, T] tensor is aligned with ``input_ids`` [B, T] (prompt and
completion, right-padded). Position t of a log-prob or entropy tensor belongs to token t:
it comes from the logits at position t - 1, which predict token t; position 0 predicts
nothing and is 0. A ``mask`` [B, T] (bool, or 0/1 of any dtype) is True on the completion
tokens that are trained on; per-token outputs are 0 where it is False.

Aggregation modes (verl's names with underscores): token_mean (sum over tokens / tokens),
token_sum (no division), seq_mean_token_mean (mean over sequences of their token means),
seq_mean_token_sum (mean over sequences of their token sums), seq_mean_token_sum_norm
(seq_mean_token_sum / a constant, Dr.GRPO's length-unbiased normaliser).

Aggregation is split into ``loss_sum`` (numerator) and ``loss_count`` (denominator)
because micro-batches are streamed: the first backward runs before the step's global
token count is known. Each micro-batch backpropagates its sum; the trainer all-reduces
the counts over every rank and micro-batch and divides the accumulated gradients by the
total before clipping and the optimizer step. The result equals the full-batch mean
exactly, for any number of ranks and micro-batches (dividing per micro-batch would not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast, get_args

import torch
import torch.nn.functional as F

from yatt.rl.config import AggregationMode as AggregationMode  # re-exported: the modes of loss_sum
from yatt.rl.config import AlgorithmConfig, ImportanceKind, ImportanceLevel, KLEstimator
from yatt.runtime.plugins import load_plugin

Tensor = torch.Tensor
_KL_ESTIMATORS = get_args(KLEstimator)

# Largest logits chunk (elements) upcast at once in token_logprobs / entropy_from_logits:
# 2**26 float32 values are 256 MiB, so a 150k vocabulary is processed ~450 tokens at a time.
_CHUNK_ELEMENTS = 2**26
# Bound on |log ratio| before exp: keeps ratios finite (e**20 ~ 5e8) when one token's
# log-probs disagree wildly, instead of turning the whole step's loss into inf or nan.
_MAX_LOG_RATIO = 20.0
_BAD_MODE = (
    "mode must be token_mean, token_sum, seq_mean_token_mean, seq_mean_token_sum or "
    "seq_mean_token_sum_norm (got {!r})"
)
# verl's and OpenRLHF's bounds on k3: its log-ratio to +-20, its value to [-10, 10].
_K3_LOG_RATIO = 20.0
_K3_MAX = 10.0


def _require_ndim(name: str, t: Tensor, ndim: int, what: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {what} (a {ndim}-D tensor), got shape {tuple(t.shape)}")


def _require_same(name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    if t.shape != ref.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but {ref_name} has shape {tuple(ref.shape)}")


def _as_mask(mask: Tensor, ref_name: str, ref: Tensor) -> Tensor:
    _require_same("mask", mask, ref_name, ref)
    return mask if mask.dtype == torch.bool else mask != 0


def _as_float(t: Tensor) -> Tensor:
    return t if t.is_floating_point() else t.to(torch.get_default_dtype())


def _group_rewards(rewards: Tensor) -> Tensor:
    _require_ndim("rewards", rewards, 1, "one reward per completion of the group, [n]")
    if rewards.numel() == 0:
        raise ValueError("rewards is empty; a group needs at least one completion")
    return _as_float(rewards)


# ----------------------------------------------------------------------------- advantages


def grpo_advantages(rewards: Tensor, *, std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages of one group, [n] -> [n]; ``std_normalize=False`` is Dr.GRPO."""
    r = _group_rewards(rewards)  # [n]
    centered = r - r.mean()
    if not std_normalize:
        return centered
    # A single completion has no spread: its advantage is 0, not 0/0.
    std = r.std() if r.numel() > 1 else torch.zeros_like(r[0])
    return centered / (std + eps)


def turn_advantages(
    turn_rewards: list[list[float]], *, gamma: float = 1.0, std_normalize: bool = True, eps: float = 1e-6
) -> list[Tensor]:
    """Per-turn advantages of one group of episodes (``env.credit: turn``): episode i's
    turn t gets its discounted return from that turn, G_it = sum_k>=t gamma^(k-t) r_ik,
    minus the group's mean episode return G_i0 (over the group's std with
    ``std_normalize``). The baseline is one number per group: it depends neither on the
    turn nor on how many turns an episode took (a per-turn-index mean over the episodes
    that reached turn t would: it conditions on the episode's length, which the actions
    decide). With the reward at the last turn only and gamma 1, every turn gets the
    episode's GRPO advantage. ``turn_rewards``: n lists, one reward per turn. Returns n
    tensors [T_i]."""
    returns = []
    for rewards in turn_rewards:
        g, out = 0.0, []
        for r in reversed(rewards):
            g = r + gamma * g
            out.append(g)
        returns.append(torch.tensor(out[::-1], dtype=torch.float32))  # [T_i]
    first = torch.stack([g[0] if g.numel() else torch.tensor(0.0) for g in returns])  # [n]
    baseline = first.mean()
    if not std_normalize:
        return [g - baseline for g in returns]
    std = first.std() if first.numel() > 1 else torch.zeros_like(baseline)
    return [(g - baseline) / (std + eps) for g in returns]


def rloo_advantages(rewards: Tensor) -> Tensor:
    """RLOO advantages of one group: r_i minus the mean of the other rewards, [n] -> [n]."""
    r = _group_rewards(rewards)  # [n]
    n = r.numel()
    return r - (r.sum() - r) / (n - 1) if n > 1 else torch.zeros_like(r)


def reinforce_pp_baseline(rewards: Tensor) -> Tensor:
    """REINFORCE++-baseline: r minus the group mean, [n] -> [n] (whitened later, globally)."""
    r = _group_rewards(rewards)
    return r - r.mean()


def reinforce_pp_returns(
    rewards: Tensor, mask: Tensor, *, kl: Tensor | None = None, kl_coef: float = 0.0, gamma: float = 1.0
) -> Tensor:
    """REINFORCE++ token returns [B, T] from sequence rewards [B] and an optional KL [B, T].

    Discounting steps over completion tokens only: unmasked positions between them (e.g.
    tool output in a multi-turn sample) pass the running return through unchanged.
    """
    _require_ndim("mask", mask, 2, "the completion mask, [B, T]")
    _require_ndim("rewards", rewards, 1, "one reward per sequence, [B]")
    if rewards.shape[0] != mask.shape[0]:
        shapes = f"rewards has shape {tuple(rewards.shape)} but mask has shape {tuple(mask.shape)}"
        raise ValueError(f"{shapes}; need [B] and [B, T]")
    m = mask if mask.dtype == torch.bool else mask != 0
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1] (got {gamma})")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0 (got {kl_coef})")
    r = _as_float(rewards)
    # The last completion token of each row: where the running count reaches the row total.
    last = m & (m.cumsum(-1) == m.sum(-1, keepdim=True))  # [B, T] bool
    token_rewards = r[:, None].expand(m.shape).masked_fill(~last, 0.0)  # [B, T]
    if kl is not None:
        _require_same("kl", kl, "mask", mask)
        token_rewards = token_rewards - kl_coef * kl.masked_fill(~m, 0.0)
    returns = torch.zeros_like(token_rewards)  # [B, T]
    running = torch.zeros_like(token_rewards[:, 0])  # [B]
    for t in reversed(range(m.shape[1])):
        running = torch.where(m[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running.masked_fill(~m[:, t], 0.0)
    return returns


def token_advantages(
    kind: str,
    field: Tensor,
    mask: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor | None]:
    """Token advantages [B, T] (before any batch whitening) and returns [B, T] or None.

    ``field`` [B, T] is what the controller put on each completion token: the sequence's
    reward for ``gae`` and ``reinforce_pp``, its final advantage otherwise. ``kl`` [B, T]
    (detached, the KL-in-reward estimate) enters as a per-token reward -kl_coef * kl:
    GAE's token rewards, REINFORCE++'s returns, or a reward-to-go added to the others.
    ``values`` [B, T] are the critic's, needed by ``gae``.
    """
    _require_ndim("field", field, 2, "the micro-batch's advantages field, [B, T]")
    m = _as_mask(mask, "field", field)
    f = _as_float(field).masked_fill(~m, 0.0)
    last = m & (m.cumsum(-1) == m.sum(-1, keepdim=True))  # [B, T] last completion token
    if kl is not None:
        _require_same("kl", kl, "field", field)
        kl = kl.detach()
    if kind == "gae":
        if values is None:
            raise ValueError("advantage gae needs the critic's values")
        rewards = f.masked_fill(~last, 0.0)
        if kl is not None:
            rewards = rewards - kl_coef * kl.masked_fill(~m, 0.0)
        return gae(rewards, values, m, gamma=gamma, lam=lam)
    if kind == "reinforce_pp":
        returns = reinforce_pp_returns(f.masked_fill(~last, 0.0).sum(-1), m, kl=kl, kl_coef=kl_coef, gamma=gamma)
        return returns, returns
    if kl is not None:
        no_reward = torch.zeros(f.shape[0], dtype=f.dtype, device=f.device)
        f = f + reinforce_pp_returns(no_reward, m, kl=kl, kl_coef=kl_coef, gamma=gamma)
    return f, None


def masked_moments(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(sum, sum of squares, count) of ``values`` over ``mask``, as 0-D float64 tensors.

    float64 because the variance is later taken as sumsq / n - mean^2, which cancels
    badly in float32; the caller may all-reduce the three across ranks before whitening.
    """
    m = _as_mask(mask, "values", values)
    v = values.to(torch.float64).masked_fill(~m, 0.0)
    return v.sum(), (v * v).sum(), m.sum().to(torch.float64)


def masked_whiten(
    values: Tensor,
    mask: Tensor,
    *,
    moments: tuple[Tensor, Tensor, Tensor] | None = None,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> Tensor:
    """(values - mean) / sqrt(var + eps) over ``mask`` (unbiased var), 0 where mask is False.

    ``moments`` are ``masked_moments`` results, typically all-reduced over ranks so that
    every rank whitens with the global statistics; without them the local ones are used.
    ``shift_mean=False`` adds the mean back (scales without centering).
    """
    m, values = _as_mask(mask, "values", values), _as_float(values)
    if moments is None:
        moments = masked_moments(values, m)
    if len(moments) != 3:
        raise ValueError(f"moments must be masked_moments' (sum, sumsq, count), got {len(moments)} items")
    total, total_sq, count = moments
    mean = total / count.clamp(min=1.0)
    # Bessel's correction; clamps keep an empty or single-token mask at variance 0, not nan.
    var = ((total_sq - total * mean) / (count - 1.0).clamp(min=1.0)).clamp(min=0.0)
    whitened = (values - mean.to(values.dtype)) * torch.rsqrt(var + eps).to(values.dtype)
    if not shift_mean:
        whitened = whitened + mean.to(values.dtype)
    return whitened.masked_fill(~m, 0.0)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns, both [B, T], from token rewards and values [B, T].

    Rewards and values at unmasked positions are ignored; the recursion steps from one
    completion token to the next, and the value after a row's last one is 0.
    """
    _require_ndim("rewards", rewards, 2, "token rewards, [B, T]")
    _require_same("values", values, "rewards", rewards)
    m = _as_mask(mask, "rewards", rewards)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1] (got gamma={gamma}, lam={lam})")
    r, v = _as_float(rewards), _as_float(values).detach()
    advantages = torch.zeros_like(r)  # [B, T]
    next_value = torch.zeros_like(r[:, 0])  # [B] value of the next completion token
    next_adv = torch.zeros_like(r[:, 0])  # [B]
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv = delta + gamma * lam * next_adv
        next_adv = torch.where(m[:, t], adv, next_adv)
        next_value = torch.where(m[:, t], v[:, t], next_value)
        advantages[:, t] = adv.masked_fill(~m[:, t], 0.0)
    returns = (advantages + v).masked_fill(~m, 0.0)
    return advantages, returns


# ----------------------------------------------------------------------------- log-probs


def _per_position(logits: Tensor, temperature: float, fn: Callable[[Tensor, slice], Tensor]) -> Tensor:
    """Apply ``fn`` to the float logits / temperature in token chunks; realign to token t.

    ``fn(x, rows)`` gets x [N, V] (rows of the flattened [B*T, V] logits) and returns [N].
    Chunking bounds the upcast copy and the softmax temporaries to one chunk at a time;
    what autograd keeps is at most one float copy of the logits in all.
    """
    _require_ndim("logits", logits, 3, "causal LM logits, [B, T, V]")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    b, t, vocab = logits.shape
    if t == 0:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; need at least one position")
    flat = logits.reshape(b * t, vocab)  # a view for contiguous logits
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    pieces = []
    for start in range(0, b * t, step):
        rows = slice(start, min(start + step, b * t))
        x = flat[rows]
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()  # bf16 / fp16 softmax loses too much precision
        if temperature != 1.0:
            x = x / temperature
        pieces.append(fn(x, rows))
    per_logit_pos = torch.cat(pieces).view(b, t)  # [B, T]: position t predicts token t + 1
    return F.pad(per_logit_pos[:, :-1], (1, 0))  # [B, T]: position t holds token t, 0 at t = 0


def token_logprobs(logits: Tensor, input_ids: Tensor, *, temperature: float = 1.0) -> Tensor:
    """[B, T] log p(input_ids[:, t] | input_ids[:, :t]) under softmax(logits / temperature); 0 at t = 0."""
    _require_ndim("input_ids", input_ids, 2, "token ids, [B, T]")
    if logits.dim() != 3 or logits.shape[:2] != input_ids.shape:
        shapes = f"logits has shape {tuple(logits.shape)} but input_ids has shape {tuple(input_ids.shape)}"
        raise ValueError(f"{shapes}; need [B, T, V] and [B, T]")
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor (got {input_ids.dtype})")
    lo, hi = torch.stack([input_ids.min(), input_ids.max()]).tolist() if input_ids.numel() else (0, 0)
    if lo < 0 or hi >= logits.shape[2]:
        raise ValueError(f"input_ids must lie in [0, {logits.shape[2]}) (the vocabulary), got [{lo}, {hi}]")
    # targets[:, t] is the token predicted at position t; the last column predicts nothing.
    targets = F.pad(input_ids[:, 1:], (0, 1)).reshape(-1).long()  # [B*T]

    def logprob(x: Tensor, rows: slice) -> Tensor:
        # gather - logsumexp instead of log_softmax: autograd keeps no [N, V] output.
        return x.gather(1, targets[rows, None]).squeeze(1) - torch.logsumexp(x, dim=-1)

    return _per_position(logits, temperature, logprob)


def entropy_from_logits(logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """[B, T] entropy of softmax(logits / temperature) that predicts token t; 0 at t = 0."""

    def entropy(x: Tensor, rows: slice) -> Tensor:
        logp = torch.log_softmax(x, dim=-1)  # [N, V]
        return -(logp.exp() * logp).sum(-1)

    return _per_position(logits, temperature, entropy)


# ----------------------------------------------------------------------------- losses


def _masked_mean(x: Tensor, m: Tensor, n: Tensor) -> Tensor:
    return x.masked_fill(~m, 0.0).sum() / n


def _loss_inputs(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Checked (mask, detached advantages [B, T], masked log-ratio [B, T]) of a policy loss.

    ``advantages`` is [B, T], or [B] for one advantage per sequence (broadcast over tokens).
    """
    _require_ndim("logprobs", logprobs, 2, "token log-probs, [B, T]")
    _require_same("old_logprobs", old_logprobs, "logprobs", logprobs)
    m = _as_mask(mask, "logprobs", logprobs)
    if advantages.dim() == 1 and advantages.shape[0] == logprobs.shape[0]:
        advantages = advantages[:, None].expand_as(logprobs)
    _require_same("advantages", advantages, "logprobs", logprobs)
    # Mask before exp: padding log-probs may be anything, and must not reach exp or the gradient.
    log_ratio = (logprobs - old_logprobs.detach()).masked_fill(~m, 0.0)
    return m, advantages.detach(), log_ratio


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0 (got {clip_low}, {clip_high})")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    kind: Literal["ppo", "gspo"] = "ppo",
    clip_low: float = AlgorithmConfig.clip_low,
    clip_high: float = AlgorithmConfig.clip_high,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token clipped policy loss [B, T] (0 where mask is False) and float stats.

    ``advantages`` is [B, T], or [B] for one advantage per sequence (broadcast over tokens).
    Stats (local to this micro-batch, means over its masked tokens): clip_frac,
    clip_low_frac, clip_high_frac, dual_clip_frac, ratio_mean, ratio_max and approx_kl
    (k3 of KL(old || new)).
    """
    m, adv, log_ratio = _loss_inputs(logprobs, old_logprobs, advantages, mask)
    _check_clip(clip_low, clip_high)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 or None (got {dual_clip})")
    if kind not in ("ppo", "gspo"):
        raise ValueError(f"kind must be 'ppo' or 'gspo' (got {kind!r})")
    if kind == "gspo":
        seq_log_ratio = log_ratio.sum(-1) / m.sum(-1).clamp(min=1)  # [B] log s_i
        # Value log s_i, gradient d logp_t: the GSPO-token form.
        log_ratio = (logprobs - logprobs.detach() + seq_log_ratio.detach()[:, None]).masked_fill(~m, 0.0)
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # [B, T]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(m)
    if dual_clip is not None:
        bound = -dual_clip * adv
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    loss = loss.masked_fill(~m, 0.0)

    with torch.no_grad():
        n = m.sum().clamp(min=1).to(ratio.dtype)
        r = ratio.detach()
        low = (r < 1.0 - clip_low) & (adv < 0)
        high = (r > 1.0 + clip_high) & (adv > 0)
        values = torch.stack(
            [
                _masked_mean((low | high).to(r.dtype), m, n),
                _masked_mean(low.to(r.dtype), m, n),
                _masked_mean(high.to(r.dtype), m, n),
                _masked_mean(dual.to(r.dtype), m, n),
                _masked_mean(r, m, n),
                r.masked_fill(~m, 0.0).max() if r.numel() else torch.zeros_like(n),  # ratios > 0: max of masked
                _masked_mean(r - 1.0 - log_ratio.detach(), m, n),
            ]
        ).tolist()  # one device sync for all stats
    names = ("clip_frac", "clip_low_frac", "clip_high_frac", "dual_clip_frac", "ratio_mean", "ratio_max")
    return loss, dict(zip((*names, "approx_kl"), values, strict=True))


def _stats(m: Tensor, log_ratio: Tensor, **fractions: Tensor) -> dict[str, float]:
    """Masked means of boolean ``fractions`` and approx_kl (k3 of KL(old || new)), one sync."""
    with torch.no_grad():
        n = m.sum().clamp(min=1).double()
        x = log_ratio.detach().double().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        values = [f.double().masked_fill(~m, 0.0).sum() / n for f in fractions.values()]
        values.append((torch.exp(x) - 1.0 - x).masked_fill(~m, 0.0).sum() / n)
        return dict(zip((*fractions, "approx_kl"), torch.stack(values).tolist(), strict=True))


def cispo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float, clip_high: float
) -> tuple[Tensor, dict[str, float]]:
    """CISPO per-token loss [B, T]: -sg[clip(rho)] A logp; every token keeps a gradient."""
    m, adv, log_ratio = _loss_inputs(logprobs, old_logprobs, advantages, mask)
    _check_clip(clip_low, clip_high)
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)).detach()
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = (-clipped * adv * logprobs).masked_fill(~m, 0.0)
    return loss, _stats(m, log_ratio, clip_frac=clipped != ratio)


def gmpo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, clip_low: float, clip_high: float
) -> tuple[Tensor, dict[str, float]]:
    """GMPO: each sequence's loss [B] put on each of its tokens, [B, T] (use seq_mean_token_mean).

    The clip acts on the log-ratio: x_t clipped to [-clip_low, clip_high] on the side the
    advantage's sign makes pessimistic, as verl's ``geo_mean`` (whose paper default is 0.4).
    """
    m, adv, log_ratio = _loss_inputs(logprobs, old_logprobs, advantages, mask)
    if not (clip_low >= 0.0 and clip_high >= 0.0):
        raise ValueError(f"need clip_low >= 0 and clip_high >= 0 (got {clip_low}, {clip_high})")
    sign = torch.sign(adv)
    clamped = log_ratio.clamp(-clip_low, clip_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)  # [B, T]
    lengths = m.sum(-1).clamp(min=1)  # [B]
    seq_ratio = torch.exp((pessimistic.masked_fill(~m, 0.0).sum(-1) / lengths).clamp(max=_MAX_LOG_RATIO))
    seq_adv = adv.masked_fill(~m, 0.0).sum(-1) / lengths  # [B]
    loss = (-seq_adv * seq_ratio)[:, None].expand_as(logprobs).masked_fill(~m, 0.0)
    clipped = clamped != log_ratio
    return loss, _stats(m, log_ratio, clip_frac=clipped, clip_high_frac=clipped & (adv > 0))


def sapo_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, tau_pos: float, tau_neg: float
) -> tuple[Tensor, dict[str, float]]:
    """SAPO per-token loss [B, T]: -A (4 / tau) sigmoid(tau (rho - 1)), a soft trust region."""
    m, adv, log_ratio = _loss_inputs(logprobs, old_logprobs, advantages, mask)
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"need tau_pos > 0 and tau_neg > 0 (got {tau_pos}, {tau_neg})")
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    loss = (-adv * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)).masked_fill(~m, 0.0)
    return loss, _stats(m, log_ratio)


def _covariance(logprobs: Tensor, adv: Tensor, m: Tensor) -> Tensor:
    """cov_t = (A_t - mean A)(logp_t - mean logp) over the masked tokens, [B, T] detached."""
    n = m.sum().clamp(min=1)
    lp = logprobs.detach()
    mean_adv = adv.masked_fill(~m, 0.0).sum() / n
    mean_lp = lp.masked_fill(~m, 0.0).sum() / n
    return (adv - mean_adv) * (lp - mean_lp)


def clip_cov_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    ratio: float,
    lb: float,
    ub: float,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clip-Cov: PPO clip, plus the gradient of a random ``ratio`` share of the masked
    tokens (at least one) that the clip left alone and whose cov lies in (lb, ub) is cut."""
    m, adv, log_ratio = _loss_inputs(logprobs, old_logprobs, advantages, mask)
    _check_clip(clip_low, clip_high)
    if not (ratio > 0 and lb < ub):
        raise ValueError(f"need ratio > 0 and lb < ub (got ratio={ratio}, lb={lb}, ub={ub})")
    rho = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    unclipped, clipped = -adv * rho, -adv * rho.clamp(1.0 - clip_low, 1.0 + clip_high)
    by_clip = (clipped > unclipped) & m
    cov = _covariance(logprobs, adv, m)
    candidates = torch.nonzero((cov > lb) & (cov < ub) & m & ~by_clip)  # [K, 2]
    count = max(int(ratio * int(m.sum())), 1)
    keep = torch.ones_like(adv)
    if len(candidates):
        chosen = candidates[torch.randperm(len(candidates), generator=generator)[:count].to(candidates.device)]
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
    loss = (torch.maximum(unclipped, clipped) * keep).masked_fill(~m, 0.0)
    return loss, _stats(m, log_ratio, clip_frac=keep == 0)


def kl_cov_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, ratio: float, coef: float
) -> tuple[Tensor, dict[str, float]]:
    """KL-Cov: -A rho per token, plus coef |logp - logp_old| on the top ``ratio`` share
    (at least one) of the masked tokens by cov."""
    m, adv, log_ratio = _loss_inputs(logprobs, old_logprobs, advantages, mask)
    if not (ratio > 0 and coef >= 0):
        raise ValueError(f"need ratio > 0 and coef >= 0 (got ratio={ratio}, coef={coef})")
    rho = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    loss = -adv * rho
    penalised = torch.zeros_like(m)
    flat = torch.nonzero(m.reshape(-1)).squeeze(1)  # [N] masked positions
    if len(flat):
        cov = _covariance(logprobs, adv, m).reshape(-1)[flat]
        top = flat[torch.topk(cov, max(1, int(len(flat) * ratio))).indices]
        penalised.view(-1)[top] = True
        loss = torch.where(penalised, loss + coef * log_ratio.abs(), loss)
    return loss.masked_fill(~m, 0.0), _stats(m, log_ratio, clip_frac=penalised)


def reinforce_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """Plain REINFORCE (and GPG's loss): -A logp per token [B, T], no ratio and no clip."""
    m, adv, log_ratio = _loss_inputs(logprobs, old_logprobs, advantages, mask)
    return (-adv * logprobs).masked_fill(~m, 0.0), _stats(m, log_ratio)


@dataclass(frozen=True, kw_only=True)
class LossParams:
    """The knobs of the built-in policy losses: ``algorithm.*`` of the same names, whose
    meaning and defaults ``AlgorithmConfig`` holds."""

    clip_low: float = AlgorithmConfig.clip_low
    clip_high: float = AlgorithmConfig.clip_high
    dual_clip: float | None = AlgorithmConfig.dual_clip
    tau_pos: float = AlgorithmConfig.tau_pos
    tau_neg: float = AlgorithmConfig.tau_neg
    cov_ratio: float = AlgorithmConfig.cov_ratio
    cov_lb: float = AlgorithmConfig.cov_lb
    cov_ub: float = AlgorithmConfig.cov_ub
    kl_cov_coef: float = AlgorithmConfig.kl_cov_coef


PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor, LossParams], tuple[Tensor, dict[str, float]]]
"""(logprobs, old_logprobs, advantages, mask, params) -> (per-token loss [B, T], float stats)."""

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo": lambda lp, old, a, m, p: policy_loss(
        lp, old, a, m, kind="ppo", clip_low=p.clip_low, clip_high=p.clip_high, dual_clip=p.dual_clip
    ),
    "gspo": lambda lp, old, a, m, p: policy_loss(
        lp, old, a, m, kind="gspo", clip_low=p.clip_low, clip_high=p.clip_high, dual_clip=None
    ),
    "cispo": lambda lp, old, a, m, p: cispo_loss(lp, old, a, m, clip_low=p.clip_low, clip_high=p.clip_high),
    "gmpo": lambda lp, old, a, m, p: gmpo_loss(lp, old, a, m, clip_low=p.clip_low, clip_high=p.clip_high),
    "sapo": lambda lp, old, a, m, p: sapo_loss(lp, old, a, m, tau_pos=p.tau_pos, tau_neg=p.tau_neg),
    "clip_cov": lambda lp, old, a, m, p: clip_cov_loss(
        lp, old, a, m, clip_low=p.clip_low, clip_high=p.clip_high, ratio=p.cov_ratio, lb=p.cov_lb, ub=p.cov_ub
    ),
    "kl_cov": lambda lp, old, a, m, p: kl_cov_loss(lp, old, a, m, ratio=p.cov_ratio, coef=p.kl_cov_coef),
    "gpg": lambda lp, old, a, m, p: reinforce_loss(lp, old, a, m),
    "reinforce": lambda lp, old, a, m, p: reinforce_loss(lp, old, a, m),
}
"""The built-in policy losses by ``algorithm.policy_loss`` name."""


def get_policy_loss(name: str) -> PolicyLossFn:
    """A built-in loss by name, or a user's ``package.module:function`` with PolicyLossFn's
    signature; ``PluginError`` naming ``algorithm.policy_loss`` when that does not load."""
    if name in POLICY_LOSSES:
        return POLICY_LOSSES[name]
    expects = (
        f"a built-in loss ({', '.join(POLICY_LOSSES)}) or a function f(logprobs, old_logprobs, "
        "advantages, mask, params: LossParams) -> (per-token loss [B, T], stats: dict[str, float])"
    )
    return cast(PolicyLossFn, load_plugin(name, field="algorithm.policy_loss", expects=expects))


def importance_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    kind: ImportanceKind,
    cap: float,
    level: ImportanceLevel = "token",
    floor: float = 0.0,
    veto: float = 0.0,
) -> Tensor:
    """Detached weights [B, T] correcting for the trainer-vs-rollout-engine mismatch.

    The ratio is exp(old - rollout) per token (``level`` token), the product of a
    sequence's token ratios (sequence) or their geometric mean (geometric), put on every
    token of the sequence. ``tis`` truncates it at ``cap``; ``mis`` zeroes it outside
    [``floor``, ``cap``] (at sequence level that rejects the whole sequence). ``veto`` > 0
    zeroes every sequence with a token ratio below it. 0 where mask is False.
    """
    _require_ndim("old_logprobs", old_logprobs, 2, "token log-probs, [B, T]")
    _require_same("rollout_logprobs", rollout_logprobs, "old_logprobs", old_logprobs)
    m = _as_mask(mask, "old_logprobs", old_logprobs)
    if not cap > 0 or not 0 <= floor < cap:
        raise ValueError(f"need cap > 0 and 0 <= floor < cap (got cap={cap}, floor={floor})")
    if not veto >= 0:
        raise ValueError(f"veto must be >= 0, 0 for none (got {veto})")
    if kind not in ("none", "tis", "mis"):
        raise ValueError(f"kind must be 'none', 'tis' or 'mis' (got {kind!r})")
    if level not in ("token", "sequence", "geometric"):
        raise ValueError(f"level must be 'token', 'sequence' or 'geometric' (got {level!r})")
    with torch.no_grad():
        log_ratio = (old_logprobs.double() - rollout_logprobs.double()).masked_fill(~m, 0.0)  # [B, T]
        if level == "sequence":
            log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
        elif level == "geometric":
            log_ratio = (log_ratio.sum(-1) / m.sum(-1).clamp(min=1))[:, None].expand_as(log_ratio)
        ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # [B, T]
        if kind == "none":
            weights = torch.ones_like(ratio)
        elif kind == "tis":
            weights = ratio.clamp(max=cap)
        else:  # a nan ratio is dropped too
            weights = ratio.masked_fill(~((ratio >= floor) & (ratio <= cap)), 0.0)
        if veto > 0:
            token_ratio = torch.exp((old_logprobs.double() - rollout_logprobs.double()).masked_fill(~m, 0.0))
            vetoed = ((token_ratio < veto) & m).any(-1, keepdim=True)  # [B, 1]
            weights = weights.masked_fill(vetoed, 0.0)
        return weights.to(old_logprobs.dtype).masked_fill(~m, 0.0)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, *, kind: KLEstimator) -> Tensor:
    """Per-token KL(policy || reference) estimate [B, T] from sampled-token log-probs.

    k3 is clamped as verl and OpenRLHF do (see the module docstring); ``k1+`` and ``k3+``
    have the value of k1 / k3 and the gradient of k2.
    """
    _require_same("ref_logprobs", ref_logprobs, "logprobs", logprobs)
    if kind not in _KL_ESTIMATORS:
        raise ValueError(f"kind must be one of {', '.join(_KL_ESTIMATORS)} (got {kind!r})")
    x = logprobs - ref_logprobs
    base = kind.rstrip("+")
    if base == "k1":
        value = x
    elif base == "abs":
        value = x.abs()
    elif base == "k2":
        value = 0.5 * x * x
    else:
        neg = (-x).clamp(-_K3_LOG_RATIO, _K3_LOG_RATIO)
        value = (torch.exp(neg) - neg - 1.0).clamp(-_K3_MAX, _K3_MAX)
    if not kind.endswith("+"):
        return value
    k2 = 0.5 * x * x
    return k2 - k2.detach() + value.detach()


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019), as verl's: after each batch,
    coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon, n the batch's sequences."""

    def __init__(self, coef: float, *, target: float, horizon: int) -> None:
        if not (coef >= 0 and target > 0 and horizon >= 1):
            raise ValueError(f"need coef >= 0, target > 0, horizon >= 1 (got {coef}, {target}, {horizon})")
        self.value, self.target, self.horizon = coef, target, horizon

    def update(self, kl: float, n: int) -> float:
        """Move the coefficient towards the target given the batch's mean KL; returns it."""
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n / self.horizon
        return self.value


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float) -> Tensor:
    """Per-token clipped value loss [B, T], 0 where mask is False."""
    _require_ndim("values", values, 2, "token values, [B, T]")
    _require_same("old_values", old_values, "values", values)
    _require_same("returns", returns, "values", values)
    m = _as_mask(mask, "values", values)
    if not clip >= 0:
        raise ValueError(f"clip must be >= 0 (got {clip})")
    old, target = old_values.detach(), returns.detach()
    clipped = old + (values - old).clamp(-clip, clip)
    loss = 0.5 * torch.maximum((values - target) ** 2, (clipped - target) ** 2)
    return loss.masked_fill(~m, 0.0)


# ----------------------------------------------------------------------------- aggregation


def loss_sum(per_token: Tensor, mask: Tensor, *, mode: AggregationMode, norm: float = 0.0) -> Tensor:
    """This micro-batch's numerator of the step loss (a 0-D tensor); see the module docstring.

    ``norm``: seq_mean_token_sum_norm's constant divisor of each sequence's token sum
    (Dr.GRPO: the generation budget), which keeps the loss unbiased in length.
    """
    _require_ndim("per_token", per_token, 2, "a per-token loss, [B, T]")
    m = _as_mask(mask, "per_token", per_token)
    row_sums = per_token.masked_fill(~m, 0.0).sum(-1)  # [B]
    if mode in ("token_mean", "token_sum", "seq_mean_token_sum"):
        return row_sums.sum()
    if mode == "seq_mean_token_mean":
        return (row_sums / m.sum(-1).clamp(min=1)).sum()  # empty rows: 0 / 1
    if mode == "seq_mean_token_sum_norm":
        if not norm > 0:
            raise ValueError(f"seq_mean_token_sum_norm needs norm > 0 (got {norm})")
        return row_sums.sum() / norm
    raise ValueError(_BAD_MODE.format(mode))


def loss_count(mask: Tensor, *, mode: AggregationMode) -> Tensor:
    """This micro-batch's denominator (0-D int64): masked tokens, rows with any masked
    token, or 0 for token_sum (the trainer divides by max(global count, 1))."""
    _require_ndim("mask", mask, 2, "the completion mask, [B, T]")
    m = mask if mask.dtype == torch.bool else mask != 0
    if mode == "token_mean":
        return m.sum()
    if mode == "token_sum":
        return torch.zeros((), dtype=torch.int64, device=m.device)
    if mode in ("seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        return m.any(-1).sum()
    raise ValueError(_BAD_MODE.format(mode))


def overlong_penalty(
    lengths: Tensor, *, max_new_tokens: int, buffer: int, penalty: float = AlgorithmConfig.overlong_penalty
) -> Tensor:
    """DAPO soft overlong punishment [n] float from completion lengths [n]; buffer 0: zeros."""
    _require_ndim("lengths", lengths, 1, "one completion length per sample, [n]")
    if max_new_tokens < 1 or not 0 <= buffer <= max_new_tokens:
        got = f"max_new_tokens={max_new_tokens}, buffer={buffer}"
        raise ValueError(f"need max_new_tokens >= 1 and 0 <= buffer <= max_new_tokens (got {got})")
    out_dtype = lengths.dtype if lengths.is_floating_point() else torch.get_default_dtype()
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=out_dtype, device=lengths.device)
    excess = (lengths.to(out_dtype) - (max_new_tokens - buffer)) / buffer
    return -penalty * excess.clamp(0.0, 1.0)
