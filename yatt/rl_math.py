"""The RL math of yatt: advantages, log-probs, losses and their aggregation, in pure torch.

Why a module of its own: the controllers compute per-group advantages (GRPO, RLOO) on CPU
as groups are scored, and the trainer computes log-probs, losses and token-level
advantages on its device. Both must use the same formulas, so they live here, free of
process, socket and model code, and are tested against hand-computed cases.

Formulas (r: rewards of one group of n completions of a prompt; m: completion mask):

- GRPO (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean(r)) / (std(r) + eps), the
  unbiased (n - 1) std; Dr.GRPO (Liu et al. 2025) drops the std: A_i = r_i - mean(r).
- RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j = n / (n - 1) (r_i - mean(r)).
- REINFORCE++ (Hu 2025): per-token reward = sequence reward on the last completion token
  minus kl_coef * KL_t; returns G_t = sum_{s >= t} gamma^(s - t) reward_s over completion
  tokens, whitened over the global batch (``masked_whiten``). REINFORCE++-baseline
  subtracts the group mean first: A_i = r_i - mean(r).
- GAE (Schulman et al. 2016): delta_t = r_t + gamma V_{t+1} - V_t,
  A_t = delta_t + gamma lam A_{t+1}, returns R_t = A_t + V_t; the value after the last
  completion token is 0.
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
- KL estimators (Schulman 2020, "Approximating KL divergence"), x = logp - logp_ref:
  k1 = x, k2 = x^2 / 2, k3 = exp(-x) + x - 1.
- DAPO overlong punishment: a linear penalty from 0 to -penalty over the last ``buffer``
  tokens before max_new_tokens, -penalty at or past the limit.
- PPO value clip: 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2).

Token alignment: every [B, T] tensor is aligned with ``input_ids`` [B, T] (prompt and
completion, right-padded). Position t of a log-prob or entropy tensor belongs to token t:
it comes from the logits at position t - 1, which predict token t; position 0 predicts
nothing and is 0. A ``mask`` [B, T] (bool, or 0/1 of any dtype) is True on the completion
tokens that are trained on; per-token outputs are 0 where it is False.

Aggregation is split into ``loss_sum`` (numerator) and ``loss_count`` (denominator)
because micro-batches are streamed: the first backward runs before the step's global
token count is known. Each micro-batch backpropagates its sum; the trainer all-reduces
the counts over every rank and micro-batch and divides the accumulated gradients by the
total before clipping and the optimizer step. The result equals the full-batch mean
exactly, for any number of ranks and micro-batches (dividing per micro-batch would not).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
AggregationMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]

# Largest logits chunk (elements) upcast at once in token_logprobs / entropy_from_logits:
# 2**26 float32 values are 256 MiB, so a 150k vocabulary is processed ~450 tokens at a time.
_CHUNK_ELEMENTS = 2**26
# Bound on |log ratio| before exp: keeps ratios finite (e**20 ~ 5e8) when one token's
# log-probs disagree wildly, instead of turning the whole step's loss into inf or nan.
_MAX_LOG_RATIO = 20.0
_BAD_MODE = "mode must be token_mean, seq_mean_token_mean or seq_mean_token_sum (got {!r})"


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


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    kind: Literal["ppo", "gspo"] = "ppo",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token clipped policy loss [B, T] (0 where mask is False) and float stats.

    ``advantages`` is [B, T], or [B] for one advantage per sequence (broadcast over tokens).
    Stats (local to this micro-batch, means over its masked tokens): clip_frac,
    clip_low_frac, clip_high_frac, dual_clip_frac, ratio_mean, ratio_max and approx_kl
    (k3 of KL(old || new)).
    """
    _require_ndim("logprobs", logprobs, 2, "token log-probs, [B, T]")
    _require_same("old_logprobs", old_logprobs, "logprobs", logprobs)
    m = _as_mask(mask, "logprobs", logprobs)
    if advantages.dim() == 1 and advantages.shape[0] == logprobs.shape[0]:
        advantages = advantages[:, None].expand_as(logprobs)
    _require_same("advantages", advantages, "logprobs", logprobs)
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0 (got {clip_low}, {clip_high})")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 or None (got {dual_clip})")
    if kind not in ("ppo", "gspo"):
        raise ValueError(f"kind must be 'ppo' or 'gspo' (got {kind!r})")
    adv = advantages.detach()
    # Mask before exp: padding log-probs may be anything, and must not reach exp or the gradient.
    log_ratio = (logprobs - old_logprobs.detach()).masked_fill(~m, 0.0)  # [B, T]
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


def importance_weights(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    *,
    kind: Literal["none", "tis", "mis"],
    cap: float,
) -> Tensor:
    """Detached per-token weights [B, T] correcting for trainer-vs-rollout-engine mismatch."""
    _require_ndim("old_logprobs", old_logprobs, 2, "token log-probs, [B, T]")
    _require_same("rollout_logprobs", rollout_logprobs, "old_logprobs", old_logprobs)
    m = _as_mask(mask, "old_logprobs", old_logprobs)
    if not cap > 0:
        raise ValueError(f"cap must be > 0 (got {cap})")
    with torch.no_grad():
        ratio = torch.exp((old_logprobs - rollout_logprobs).masked_fill(~m, 0.0))  # [B, T]
        if kind == "none":
            weights = torch.ones_like(ratio)
        elif kind == "tis":
            weights = ratio.clamp(max=cap)
        elif kind == "mis":
            weights = ratio.masked_fill(~(ratio <= cap), 0.0)  # a nan ratio is dropped too
        else:
            raise ValueError(f"kind must be 'none', 'tis' or 'mis' (got {kind!r})")
        return weights.masked_fill(~m, 0.0)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, *, kind: Literal["k1", "k2", "k3"]) -> Tensor:
    """Per-token KL(policy || reference) estimate [B, T] from sampled-token log-probs."""
    _require_same("ref_logprobs", ref_logprobs, "logprobs", logprobs)
    x = logprobs - ref_logprobs
    if kind == "k1":
        return x
    if kind == "k2":
        return 0.5 * x * x
    if kind == "k3":
        return torch.exp(-x) + x - 1.0
    raise ValueError(f"kind must be 'k1', 'k2' or 'k3' (got {kind!r})")


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


def loss_sum(per_token: Tensor, mask: Tensor, *, mode: AggregationMode) -> Tensor:
    """This micro-batch's numerator of the step loss (a 0-D tensor); see the module docstring."""
    _require_ndim("per_token", per_token, 2, "a per-token loss, [B, T]")
    m = _as_mask(mask, "per_token", per_token)
    row_sums = per_token.masked_fill(~m, 0.0).sum(-1)  # [B]
    if mode in ("token_mean", "seq_mean_token_sum"):
        return row_sums.sum()
    if mode == "seq_mean_token_mean":
        return (row_sums / m.sum(-1).clamp(min=1)).sum()  # empty rows: 0 / 1
    raise ValueError(_BAD_MODE.format(mode))


def loss_count(mask: Tensor, *, mode: AggregationMode) -> Tensor:
    """This micro-batch's denominator (0-D int64): masked tokens, or rows with any masked token."""
    _require_ndim("mask", mask, 2, "the completion mask, [B, T]")
    m = mask if mask.dtype == torch.bool else mask != 0
    if mode == "token_mean":
        return m.sum()
    if mode in ("seq_mean_token_mean", "seq_mean_token_sum"):
        return m.any(-1).sum()
    raise ValueError(_BAD_MODE.format(mode))


def overlong_penalty(lengths: Tensor, *, max_new_tokens: int, buffer: int, penalty: float = 1.0) -> Tensor:
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
