"""yatt.rl.rl_math against verl's ``core_algos`` on random float64 inputs (agreement <= 1e-6).

verl is a test-only reference, installed by ``make`` (so CI runs this file):
``verl.trainer.ppo.core_algos`` (verl 0.9) imports ray, omegaconf, tensordict, codetiming
and orjson through ``verl/__init__`` (the ``verl-check`` extra), and verl itself goes in
with ``--no-deps`` because its declared pins (transformers < 5.11) would replace this
environment's. By hand::

    pip install -e '.[verl-check]' && pip install --no-deps verl==0.9.1

Without them every test here is skipped, with the import error as the reason; under CI
(``CI`` set) every test fails with it instead: CI installs verl with ``make``, so a skip
there would hide a broken install (as the SLURM tests do for a missing cluster).
"""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from yatt.rl import rl_math as rm

# The reference, typed Any: checked at run time, its annotations are looser than its use here.
try:
    core_algos: Any = importlib.import_module("verl.trainer.ppo.core_algos")
    ActorConfig: Any = importlib.import_module("verl.workers.config").ActorConfig
    MISSING = ""
except ImportError as e:  # ModuleNotFoundError for verl itself or for one of its imports
    core_algos = ActorConfig = None
    MISSING = f"verl's core_algos is not importable ({e}); see this module's docstring to install it"
    if not os.environ.get("CI"):
        pytest.skip(MISSING, allow_module_level=True)


@pytest.fixture(autouse=True)
def verl_installed() -> None:
    """Under CI, a missing verl or extra fails each test here (locally the module skips)."""
    if MISSING:
        pytest.fail(MISSING + " (CI installs it with make)", pytrace=False)

F64 = torch.float64
TOL = 1e-6
B, T = 8, 7
VERL_MODES = {
    "token_mean": "token-mean",
    "token_sum": "token-sum",
    "seq_mean_token_mean": "seq-mean-token-mean",
    "seq_mean_token_sum": "seq-mean-token-sum",
    "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
}
NORM = 11.0  # seq_mean_token_sum_norm's constant (verl's loss_scale_factor)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.double(), b.double(), atol=TOL, rtol=0)


def inputs(seed: int) -> dict[str, torch.Tensor]:
    """Right-padded responses of 1..T tokens; log-probs whose ratios cross the clip range."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [B, T] bool
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    logp = old + torch.randn(B, T, generator=g, dtype=F64) * 0.3
    adv = torch.randn(B, T, generator=g, dtype=F64) * mask
    logp[1, 0], adv[1, 0] = old[1, 0] + 1.5, -1.0  # ratio 4.5 > 3 with A < 0: the dual clip binds
    return {
        "mask": mask,
        "old": old,
        "logp": logp,
        "adv": adv,
        "ref": old + torch.randn(B, T, generator=g, dtype=F64) * 0.5,
        "scores": torch.randn(B, generator=g, dtype=F64),
        "values": torch.randn(B, T, generator=g, dtype=F64),
    }


def last_token(x: dict[str, torch.Tensor], per_seq: torch.Tensor) -> torch.Tensor:
    """[B] values on each row's last response token, [B, T] (verl's token_level_rewards)."""
    m = x["mask"]
    last = m & (m.cumsum(-1) == m.sum(-1, keepdim=True))
    return per_seq[:, None] * last


def actor_config(**fields: Any) -> Any:
    """A verl ActorConfig with only the fields the losses read (its __init__ needs a whole job)."""
    config = ActorConfig.__new__(ActorConfig)
    values = dict(
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, tau_pos=1.0, tau_neg=1.05,
        global_batch_info={}, loss_scale_factor=None,
        policy_loss=SimpleNamespace(clip_cov_ratio=1.0, clip_cov_lb=-0.05, clip_cov_ub=0.05, kl_cov_ratio=0.2, ppo_kl_coef=1.0),
    )  # fmt: skip
    values.update(fields)
    for k, v in values.items():
        object.__setattr__(config, k, v)
    return config


def yatt_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    count = rm.loss_count(mask, mode=mode)  # type: ignore[arg-type]
    return rm.loss_sum(per_token, mask, mode=mode, norm=NORM) / count.clamp(min=1)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("seed", range(3))
def test_gae_whitened_as_verl(seed: int) -> None:
    x = inputs(seed)
    rewards = torch.randn(B, T, generator=torch.Generator().manual_seed(seed), dtype=F64) * x["mask"]
    ref_adv, ref_ret = core_algos.compute_gae_advantage_return(rewards, x["values"], x["mask"].double(), 0.99, 0.95)
    adv, ret = rm.gae(rewards, x["values"], x["mask"], gamma=0.99, lam=0.95)
    close(rm.masked_whiten(adv, x["mask"]), ref_adv * x["mask"])
    close(ret, ref_ret * x["mask"])


@pytest.mark.parametrize("seed", range(3))
def test_reinforce_pp_with_kl_in_reward_as_verl(seed: int) -> None:
    x = inputs(seed)
    kl = core_algos.kl_penalty(x["old"], x["ref"], "kl") * x["mask"]  # verl's reward KL: k1
    token_rewards = last_token(x, x["scores"]) - 0.1 * kl
    ref_adv, ref_ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        token_rewards, x["mask"].double(), config=SimpleNamespace(gamma=0.9)
    )
    kl_yatt = rm.kl_penalty(x["old"], x["ref"], kind="k1")
    adv, ret = rm.token_advantages(
        "reinforce_pp", last_token(x, x["scores"]), x["mask"], kl=kl_yatt, kl_coef=0.1, gamma=0.9
    )
    assert ret is not None
    close(ret, ref_ret)
    close(rm.masked_whiten(adv, x["mask"]), ref_adv)


@pytest.mark.parametrize("seed", range(3))
def test_group_estimators_as_verl(seed: int) -> None:
    x = inputs(seed)
    index = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    m, levels = x["mask"], last_token(x, x["scores"])
    groups = [x["scores"][:4], x["scores"][4:]]

    def per_token(per_group: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(per_group)[:, None] * m

    ref, _ = core_algos.compute_grpo_outcome_advantage(levels, m.double(), index, epsilon=1e-6)
    close(per_token([rm.grpo_advantages(r, eps=1e-6) for r in groups]), ref)
    ref, _ = core_algos.compute_grpo_outcome_advantage(levels, m.double(), index, norm_adv_by_std_in_grpo=False)
    close(per_token([rm.grpo_advantages(r, std_normalize=False) for r in groups]), ref)
    ref, _ = core_algos.compute_rloo_outcome_advantage(levels, m.double(), index)
    close(per_token([rm.rloo_advantages(r) for r in groups]), ref)
    ref, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(levels, m.double(), index)
    close(rm.masked_whiten(per_token([rm.reinforce_pp_baseline(r) for r in groups]), m), ref)


# ----------------------------------------------------------------------------- KL


@pytest.mark.parametrize("kind,verl_kind", [("k1", "kl"), ("abs", "abs"), ("k2", "mse"), ("k3", "low_var_kl"), ("k1+", "k1+"), ("k3+", "k3+")])
def test_kl_estimators_value_and_gradient_as_verl(kind: str, verl_kind: str) -> None:
    x = inputs(0)
    logp = x["logp"].clone()
    logp[0, :3] = torch.tensor([-40.0, 30.0, -90.0], dtype=F64)  # far apart: the clamps bind
    a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    mine = rm.kl_penalty(a, x["ref"], kind=kind)  # type: ignore[arg-type]
    ref = core_algos.kl_penalty(b, x["ref"], verl_kind)
    close(mine, ref)
    (ga,) = torch.autograd.grad(mine.sum(), a)
    (gb,) = torch.autograd.grad(ref.sum(), b)
    close(ga, gb)


def test_adaptive_kl_controller_as_verl() -> None:
    mine = rm.AdaptiveKLController(0.05, target=0.1, horizon=1000)
    ref = core_algos.AdaptiveKLController(init_kl_coef=0.05, target_kl=0.1, horizon=1000)
    for kl, n in [(0.3, 64), (0.05, 64), (0.11, 128), (0.0, 32)]:
        ref.update(kl, n)
        assert mine.update(kl, n) == pytest.approx(ref.value, abs=1e-12)


# ----------------------------------------------------------------------------- losses


@pytest.mark.parametrize("mode", list(VERL_MODES))
def test_aggregation_modes_as_verl(mode: str) -> None:
    x = inputs(1)
    ref = core_algos.agg_loss(x["adv"], x["mask"].double(), VERL_MODES[mode], loss_scale_factor=NORM)
    close(yatt_loss(x["adv"], x["mask"], mode), ref)


CASES = {
    # yatt loss -> (verl name, aggregation yatt uses with it)
    "ppo": ("vanilla", "token_mean"),
    "gspo": ("gspo", "seq_mean_token_mean"),
    "cispo": ("cispo", "token_mean"),
    "gmpo": ("geo_mean", "seq_mean_token_mean"),
    "sapo": ("sapo", "seq_mean_token_mean"),
    "gpg": ("gpg", "token_mean"),
    "clip_cov": ("clip_cov", "token_mean"),
    "kl_cov": ("kl_cov", "token_mean"),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("seed", range(2))
def test_policy_losses_value_and_gradient_as_verl(name: str, seed: int) -> None:
    x = inputs(seed)
    verl_name, mode = CASES[name]
    params = rm.LossParams(clip_low=0.2, clip_high=0.28, dual_clip=3.0, cov_ratio=1.0 if name == "clip_cov" else 0.2,
                           cov_lb=-0.05, cov_ub=0.05)  # fmt: skip
    if name == "gmpo":
        params = rm.LossParams(clip_low=0.4, clip_high=0.4)
    a, b = x["logp"].clone().requires_grad_(True), x["logp"].clone().requires_grad_(True)
    per_token, _ = rm.get_policy_loss(name)(a, x["old"], x["adv"], x["mask"], params)
    mine = yatt_loss(per_token, x["mask"], mode)
    config = actor_config(clip_ratio_low=params.clip_low, clip_ratio_high=params.clip_high)
    ref, _ = core_algos.get_policy_loss_fn(verl_name)(
        x["old"], b, x["adv"], x["mask"].double(), loss_agg_mode=VERL_MODES[mode], config=config
    )
    close(mine, ref)
    (ga,) = torch.autograd.grad(mine, a)
    (gb,) = torch.autograd.grad(ref, b)
    close(ga, gb)


def test_value_loss_as_verl() -> None:
    x = inputs(2)
    vpreds = x["values"] + torch.randn(B, T, generator=torch.Generator().manual_seed(5), dtype=F64)
    returns = x["values"] * 0.5
    ref, _ = core_algos.compute_value_loss(vpreds, returns, x["values"], x["mask"].double(), cliprange_value=0.5)
    mine = rm.value_loss(vpreds, x["values"], returns, x["mask"], clip=0.5)
    close(yatt_loss(mine, x["mask"], "token_mean"), ref)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", ["2.0", "0.5_5.0"])
def test_rollout_correction_weights_as_verl(level: str, threshold: str) -> None:
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    x = inputs(3)
    rollout = x["old"] + torch.randn(B, T, generator=torch.Generator().manual_seed(9), dtype=F64) * 0.8
    log_ratio = (x["old"] - rollout) * x["mask"]
    ref, _ = compute_rollout_correction_weights(log_ratio, x["mask"].double(), rollout_is=level, rollout_is_threshold=threshold)
    bounds = [float(v) for v in threshold.split("_")]
    kind, floor, cap = ("tis", 0.0, bounds[0]) if len(bounds) == 1 else ("mis", bounds[0], bounds[1])
    mine = rm.importance_weights(x["old"], rollout, x["mask"], kind=kind, level=level, cap=cap, floor=floor)  # type: ignore[arg-type]
    close(mine, ref)
    if kind == "mis":
        assert 0 < int((mine == 0).logical_and(x["mask"]).sum()) < int(x["mask"].sum())  # the bounds bind
