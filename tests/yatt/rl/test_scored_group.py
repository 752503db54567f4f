"""A controller's finished group, by hand: the overlong penalty goes into the rewards the
advantages are computed from, never into an evaluation's."""

from __future__ import annotations

import torch

from protocols.messages import Completion, Completions, GroupKey, Scores
from yatt.rl.config import AlgorithmConfig
from yatt.rl.controller import scored_group
from yatt.rl.data import Prompt
from yatt.rl.evaluation import eval_key

LENGTHS = [2, 6, 8, 4]  # max_new_tokens 8, overlong_buffer 4: the penalty zone is 5..8 tokens


def _parts(key: GroupKey) -> tuple[Prompt, Completions, Scores]:
    prompt = Prompt(index=0, prompt_ids=[5, 6, 7], text="What is 1 + 1?", metadata={"answer": "2"})
    completions = Completions(group_key=key, completions=[
        Completion(
            token_ids=torch.arange(n, dtype=torch.int32), logprobs=torch.zeros(n), finish_reason="length" if n == 8 else "stop",
            policy_version_min=0, policy_version_max=0,
        )
        for n in LENGTHS
    ])
    ones = torch.ones(len(LENGTHS))
    scores = Scores(group_key=key, rewards=ones, components={"digits": ones}, failures=[""] * len(LENGTHS))
    return prompt, completions, scores


def test_the_overlong_penalty_shapes_training_rewards_and_their_advantages() -> None:
    algorithm = AlgorithmConfig(advantage="grpo", overlong_buffer=4, overlong_penalty=1.0)
    group = scored_group(GroupKey(epoch=0, shard=0, prompt_index=0), *_parts(GroupKey(epoch=0, shard=0, prompt_index=0)), algorithm, 8)
    # excess over 8 - 4 = 4 tokens, in units of the buffer, clamped to [0, 1]: 0, 0.5, 1, 0
    assert group.rewards.tolist() == [1.0, 0.5, 0.0, 1.0]
    # GRPO on the penalised rewards: mean 0.625, sample std 0.4787
    expected = (torch.tensor([1.0, 0.5, 0.0, 1.0]) - 0.625) / (torch.tensor([1.0, 0.5, 0.0, 1.0]).std() + 1e-6)
    assert torch.allclose(group.advantages, expected, atol=1e-5)
    assert group.scores["digits"].tolist() == [1.0] * 4  # the scorer's own figures stay raw
    assert group.finish_reasons == ["stop", "stop", "length", "stop"]


def test_an_evaluation_group_keeps_its_scores_and_has_no_advantages() -> None:
    algorithm = AlgorithmConfig(advantage="grpo", overlong_buffer=4, overlong_penalty=1.0)
    key = eval_key(3, 1, 0, 1)
    group = scored_group(key, *_parts(key), algorithm, 8)
    assert group.rewards.tolist() == [1.0] * 4
    assert group.advantages.tolist() == [0.0] * 4


def test_without_a_buffer_the_rewards_are_the_scores() -> None:
    key = GroupKey(epoch=0, shard=0, prompt_index=0)
    group = scored_group(key, *_parts(key), AlgorithmConfig(advantage="grpo"), 8)
    assert group.rewards.tolist() == [1.0] * 4
    assert group.advantages.tolist() == [0.0] * 4  # equal rewards: nothing to prefer
