"""One episode's limits and endings, with a scripted policy (``generate``) and small
environments: how it ended, what the row holds, what is cut."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from protocols.messages import Completion
from yatt.errors import PluginError
from yatt.rl.agents.envs import check_env, env_factory
from yatt.rl.agents.episodes import EpisodeRunner, Trajectory
from yatt.rl.agents.games import GuessNumber
from yatt.rl.agents.render import Renderer
from yatt.rl.config import EnvConfig


class Counter:
    """Answers each step with ``obs`` and ``reward``; done after ``turns`` steps."""

    def __init__(self, turns: int = 99, obs: str = "go on", reward: float | None = None) -> None:
        self.turns, self.obs, self.reward, self.seen = turns, obs, reward, 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        return f"count ({seed})", {}

    def step(self, action: str) -> tuple[str, float | None, bool, bool, dict[str, Any]]:
        self.seen += 1
        return self.obs, self.reward, self.seen >= self.turns, False, {}


class Slow(Counter):
    async def step(self, action: str) -> tuple[str, float | None, bool, bool, dict[str, Any]]:  # type: ignore[override]
        await asyncio.sleep(5)
        raise AssertionError("not reached")


class Broken(Counter):
    def step(self, action: str) -> tuple[str, float | None, bool, bool, dict[str, Any]]:
        raise KeyError("the board")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def runner(tokenizer: Any, **env: Any) -> EpisodeRunner:
    config = EnvConfig(**{"class_": "yatt.rl.agents.games:GuessNumber", **env})
    renderer = Renderer(tokenizer, protocol=config.render_protocol)
    decode = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))  # noqa: E731
    return EpisodeRunner(config, renderer, decode=decode, eos_ids={tokenizer.eos_token_id}, max_new_tokens=4, context=512)


def policy(tokenizer: Any, text: str = "5", version: int = 2) -> Any:
    """Every turn says ``text`` then EOS, at ``version``; records the ids it was given."""
    seen: list[tuple[list[int], int]] = []
    images: list[dict[str, Any]] = []

    async def generate(ids: list[int], budget: int, observed: dict[str, Any] | None = None, encoded: Any = None) -> Completion:
        seen.append((list(ids), budget))
        images.append(dict(observed or {}))
        out = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id][:budget]
        return Completion(
            token_ids=torch.tensor(out, dtype=torch.int32), logprobs=torch.full((len(out),), -0.5),
            finish_reason="stop" if len(out) < budget or out[-1] == tokenizer.eos_token_id else "length",
            policy_version_min=version, policy_version_max=version,
        )  # fmt: skip

    generate.seen = seen  # type: ignore[attr-defined]
    generate.images = images  # type: ignore[attr-defined]
    return generate


async def play(run: EpisodeRunner, env: Any, generate: Any, prompt_ids: list[int] | None = None) -> Trajectory:
    ids, _ = await run.start(env, seed=3, row={"prompt": "p"}, prompt_ids=prompt_ids or [1, 2])
    return await run.run(env, ids, generate)


async def test_turns_and_observations_alternate_and_each_turn_sees_all_before_it(tokenizer: Any) -> None:
    run, generate = runner(tokenizer, max_turns=3), policy(tokenizer)
    env = Counter(obs="more", reward=0.5)
    out = await play(run, env, generate)
    assert (out.info.ended, out.info.turns, out.info.turn_rewards) == ("max_turns", 3, [0.5, 0.5, 0.5])
    assert out.env_reward == 1.5
    prompt = run.renderer.prompt([{"role": "user", "content": "count (3)"}])
    turn = [*tokenizer.encode("5", add_special_tokens=False), tokenizer.eos_token_id]
    obs = run.renderer.observation([{"role": "user", "content": "more"}], ended_with_eos=True)
    assert out.ids == turn + obs + turn + obs + turn, "no observation after the last turn"
    assert out.mask == [True] * len(turn) + [False] * len(obs) + [True] * len(turn) + [False] * len(obs) + [True] * len(turn)
    assert out.versions == [2] * len(turn) + [-1] * len(obs) + [2] * len(turn) + [-1] * len(obs) + [2] * len(turn)
    # Each turn is asked with the whole episode so far, prompt first.
    assert [ids for ids, _ in generate.seen] == [prompt, prompt + turn + obs, prompt + (turn + obs) * 2]


async def test_the_context_budget_ends_an_episode(tokenizer: Any) -> None:
    run = runner(tokenizer, max_turns=10, max_total_tokens=40)
    generate = policy(tokenizer, text="12345678")
    out = await play(run, Counter(obs="a long observation " * 3), generate, prompt_ids=[1] * 10)
    assert out.info.ended == "budget"
    assert all(budget <= 4 for _, budget in generate.seen)
    prompt_len = len(generate.seen[0][0])
    assert prompt_len + len(out.ids) <= 40


async def test_a_long_observation_is_cut(tokenizer: Any) -> None:
    for side in ("end", "start"):
        run = runner(tokenizer, max_turns=2, max_obs_tokens=5, obs_truncate=side)
        out = await play(run, Counter(obs="x " * 50), policy(tokenizer))
        assert out.mask.count(False) == 5
        full = run.renderer.observation([{"role": "user", "content": "x " * 50}], ended_with_eos=True)
        hole = [i for i, own in zip(out.ids, out.mask, strict=True) if not own]
        assert hole == (full[:5] if side == "end" else full[-5:])


async def test_a_hanging_or_raising_environment_ends_its_episode_with_the_reason(tokenizer: Any) -> None:
    run = runner(tokenizer, max_turns=3, episode_timeout_s=0.2)
    out = await play(run, Slow(), policy(tokenizer))
    assert out.info.ended == "timeout" and "episode_timeout_s=0.2" in out.info.detail and out.info.turns == 1
    out = await play(runner(tokenizer), Broken(), policy(tokenizer))
    assert out.info.ended == "env_error" and out.info.detail == "Broken.step: KeyError: 'the board'"
    assert out.mask and all(out.mask), "trained on as far as it got: the turn before the error"


async def test_guess_the_number_rewards_the_right_guess() -> None:
    env = GuessNumber(high=8)
    _, _ = env.reset(seed=3)
    secret = env.secret
    assert env.step(str(secret - 1) if secret > 1 else "x")[0] in ("Higher.", "Answer with a number from 1 to 8.")
    obs, reward, done, truncated, _ = env.step(f"it is {secret}")
    assert (obs, reward, done, truncated) == ("Correct.", 1.0, True, False)
    assert not math.isnan(reward)


def test_an_environment_that_does_not_load_is_refused_naming_it() -> None:
    with pytest.raises(PluginError, match=r"env.class: 'yatt.rl.agents.games:Nope': module .* has no attribute 'Nope'"):
        check_env(EnvConfig(class_="yatt.rl.agents.games:Nope"))
    with pytest.raises(PluginError, match=r"no reset or step method"):
        check_env(EnvConfig(class_="yatt.rl.agents.tools:ToolCall"))
    with pytest.raises(PluginError, match=r"cannot be made with env.kwargs=\{'high': 1\} \(ValueError: high must be >= 2"):
        check_env(EnvConfig(class_="yatt.rl.agents.games:GuessNumber", kwargs={"high": 1}))
    with pytest.raises(PluginError, match=r"env.tools"):
        env_factory(EnvConfig(tools=["yatt.rl.agents.tools:nothing_here"]))


class Odd(Counter):
    """Answers its first step with nothing to add, its second with an observation no
    renderer takes (a number)."""

    def step(self, action: str) -> tuple[Any, float | None, bool, bool, dict[str, Any]]:
        self.seen += 1
        return (None if self.seen == 1 else 42), None, False, False, {}


async def test_an_observation_that_cannot_be_rendered_ends_the_episode_not_the_run(tokenizer: Any) -> None:
    out = await play(runner(tokenizer, max_turns=4), Odd(), policy(tokenizer))
    assert out.info.ended == "env_error" and out.info.turns == 2, out.info
    assert "TypeError: an observation is text, a chat message or a list of them (got int)" in out.info.detail
    assert all(out.mask), "None added nothing: the second turn follows the first directly"


def test_a_groups_newest_version_counts_every_token() -> None:
    """An episode that spans a weight update is as new as its newest turn (a rollback to a
    version between its turns must redo it), though its staleness is its oldest token's."""
    from protocols.messages import GroupKey, ScoredGroup
    from yatt.rl.sampling import newest_version

    group = ScoredGroup(
        group_key=GroupKey(epoch=0, shard=0, prompt_index=0), prompt_ids=torch.tensor([1], dtype=torch.int32),
        completion_ids=[torch.tensor([2, 3, 4], dtype=torch.int32)], rollout_logprobs=[torch.zeros(3)],
        rewards=torch.tensor([0.0]), advantages=torch.tensor([0.0]), policy_versions=torch.tensor([3]), finish_reasons=["stop"],
        token_versions=[torch.tensor([3, -1, 5])],
    )  # fmt: skip
    assert newest_version(group) == 5


class Saved(Counter):
    """A Counter whose state is saved and restored (``snapshot``/``restore``); its
    observation says how many steps it has seen, so a wrong restore shows."""

    steps_taken = 0  # every instance's steps (a resume must take none for the recorded turns)
    restored: list[bytes] = []

    def step(self, action: str) -> tuple[str, float | None, bool, bool, dict[str, Any]]:
        Saved.steps_taken += 1
        self.seen += 1
        return f"seen {self.seen}", float(self.seen), self.seen >= self.turns, False, {}

    def snapshot(self) -> bytes:
        return str(self.seen).encode()

    def restore(self, state: bytes) -> None:
        Saved.restored.append(state)
        self.seen = int(state)


async def test_an_environment_with_snapshots_resumes_from_the_last_recorded_state_without_stepping_again(tokenizer: Any) -> None:
    run = runner(tokenizer, max_turns=4)
    recorded: list[Any] = []

    async def record(turn: Any) -> None:
        recorded.append(turn)

    prompt, _ = await run.start(Saved(turns=4), seed=3, row={}, prompt_ids=[1, 2])
    whole = await run.run(Saved(turns=4), prompt, policy(tokenizer), record=record)
    assert [t.env_state for t in recorded] == [b"1", b"2", b"3", b""]  # (none after the last: nothing resumes it)
    Saved.steps_taken, Saved.restored = 0, []
    again = await run.run(Saved(turns=4), prompt, policy(tokenizer), recorded=recorded[:2])
    assert Saved.restored == [b"2"] and Saved.steps_taken == 2  # turns 3 and 4 only
    assert again.ids == whole.ids and again.info == whole.info


async def test_a_restore_that_fails_runs_the_episode_again_from_its_start(tokenizer: Any) -> None:
    from yatt.rl.agents.episodes import Diverged

    class Unrestorable(Saved):
        def restore(self, state: bytes) -> None:
            raise OSError("the save is gone")

    run = runner(tokenizer, max_turns=4)
    recorded: list[Any] = []

    async def record(turn: Any) -> None:
        recorded.append(turn)

    prompt, _ = await run.start(Saved(turns=4), seed=3, row={}, prompt_ids=[1, 2])
    await run.run(Saved(turns=4), prompt, policy(tokenizer), record=record)
    with pytest.raises(Diverged, match=r"Unrestorable.restore failed \(OSError: the save is gone\)"):
        await run.run(Unrestorable(turns=4), prompt, policy(tokenizer), recorded=recorded[:2])
