"""Validation of the RL options of issue 13: every nonsense value is refused by its dotted name."""

from __future__ import annotations

import pytest

from yatt.errors import ConfigError
from yatt.rl.config import AlgorithmConfig, TrainerConfig
from yatt.runtime.configtools import build


@pytest.mark.parametrize(
    "data,message",
    [
        ({"policy_loss": "nonsense"}, r"policy_loss must be one of ppo, gspo, .* or 'package.module:function'"),
        ({"advantage": "dr_grpo"}, r"aggregation must be seq_mean_token_sum_norm for advantage dr_grpo"),
        ({"aggregation": "seq_mean_token_sum_norm"}, r"aggregation_norm must be > 0 exactly when"),
        ({"aggregation_norm": 8.0}, r"aggregation_norm must be > 0 exactly when"),
        ({"policy_loss": "gmpo"}, r"aggregation must be seq_mean_token_mean for policy_loss gmpo"),
        ({"ppo_epochs": 0}, r"ppo_epochs must be >= 1"),
        ({"kl_controller": "adaptive"}, r"kl_coef must be > 0 for kl_controller adaptive"),
        ({"kl_target": 0.0}, r"kl_target must be > 0"),
        ({"kl_horizon": 0}, r"kl_horizon must be >= 1"),
        ({"kl_estimator": "k4"}, r"kl_estimator"),
        ({"importance_floor": 0.5, "importance_sampling": "tis"}, r"importance_floor only masks"),
        ({"importance_floor": 3.0, "importance_sampling": "mis"}, r"importance_floor must be in \[0, importance_cap"),
        ({"importance_veto": 1.5}, r"importance_veto must be in \[0, 1\)"),
        ({"entropy_coef": -0.1}, r"entropy_coef must be >= 0"),
        ({"value_clip": -1.0}, r"value_clip must be >= 0"),
        ({"gamma": 1.5}, r"gamma must be in \[0, 1\]"),
        ({"tau_neg": 0.0}, r"tau_neg must be > 0"),
        ({"cov_ratio": 0.0}, r"cov_ratio must be in \(0, 1\]"),
        ({"cov_lb": 5.0, "cov_ub": 1.0}, r"cov_ub must exceed cov_lb"),
        ({"old_logprobs": "stale"}, r"old_logprobs"),
    ],
)
def test_nonsense_algorithm_options_are_named(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(AlgorithmConfig, data, "algorithm")


def test_sensible_combinations_load_with_verl_defaults() -> None:
    dr = build(AlgorithmConfig, {"advantage": "dr_grpo", "aggregation": "seq_mean_token_sum_norm", "aggregation_norm": 8})
    assert dr.aggregation_norm == 8.0 and not dr.batch_wide
    icepop = build(AlgorithmConfig, {"importance_sampling": "mis", "importance_floor": 0.5, "importance_cap": 5.0})
    assert icepop.importance_floor == 0.5
    assert build(AlgorithmConfig, {"policy_loss": "my_pkg.losses:mine"}).policy_loss == "my_pkg.losses:mine"
    assert build(AlgorithmConfig, {"advantage": "reinforce_pp"}).batch_wide
    default = AlgorithmConfig()
    assert (default.dual_clip, default.value_clip, default.kl_estimator, default.kl_in_reward_estimator) == (
        3.0, 0.5, "k3", "k1",
    )  # fmt: skip


def test_mini_batches_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"trainer.mini_batches must be >= 1 \(got 0\)"):
        build(TrainerConfig, {"mini_batches": 0}, "trainer")
