"""A real controller in this process, driving multi-turn episodes through a real registry,
a real generator actor (its engine scripted: the completion of each prompt and turn is
written here), a real reward worker and a real buffer, over loopback. What is checked is
what the buffer serves a trainer rank: masks with holes on the observations, per-token
versions across a weight update between turns, the rows built."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from protocols.codec import decode, encode
from protocols.messages import GenerateRequest, GroupKey, MicroBatch, MicroBatchRequest, ScoredGroup
from workers.engines.base import PromptRequest, Sample
from workers.env import EnvWorker
from workers.generator import Generator
from workers.reward.worker import Reward
from yatt.errors import ActorFailed
from yatt.rl.agents.client import AgentRunner
from yatt.rl.agents.envs import env_factory
from yatt.rl.agents.episodes import EpisodeRunner
from yatt.rl.agents.render import Renderer
from yatt.rl.buffer import Buffer
from yatt.rl.config import (
    AlgorithmConfig,
    BufferConfig,
    ControllerConfig,
    EnvConfig,
    GeneratorConfig,
    RewardConfig,
    ScorerConfig,
)
from yatt.rl.controller import Controller, sampling_seed
from yatt.rl.data import Prompt
from yatt.runtime.actor import Client
from yatt.runtime.registry import Directory, Registration, Registry
from yatt.runtime.transport import Transport

LOCAL = "tcp://127.0.0.1:*"
CALL, ANSWER = '<tool>calculator("3 * 7")</tool>', "Answer: 21"


class ScriptedEngine:
    """An ``Engine`` whose turns are written by ``script(prompt text, sample)``: token ids of
    that text (EOS added unless the text ends on a stop string), log-prob -0.25 each. After
    each call the generator's version goes up by one, as if weights arrived between turns."""

    def __init__(self, tokenizer: Any, script: Any) -> None:
        self.tokenizer, self.script = tokenizer, script
        self.generator: Generator | None = None
        self.calls: list[list[PromptRequest]] = []
        self.lock = threading.Lock()

    def generate(self, requests: Sequence[PromptRequest]) -> list[list[Sample]]:
        with self.lock:
            self.calls.append(list(requests))
        out = []
        for req in requests:
            text = self.tokenizer.decode(req.prompt_ids, skip_special_tokens=False)
            samples = []
            for _ in range(req.n):
                turn = self.script(text, req.sampling.seed)
                ids = self.tokenizer.encode(turn, add_special_tokens=False)
                stopped = any(turn.endswith(s) for s in req.sampling.stop)
                ids = ids if stopped else [*ids, self.tokenizer.eos_token_id]
                samples.append(Sample(token_ids=ids, logprobs=[-0.25] * len(ids), finish_reason="stop"))
            out.append(samples)
        assert self.generator is not None
        self.generator.version += 1
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise AssertionError("no weights are pushed here")

    def sequence_logprobs(
        self, prompt_ids: list[int], completion_ids: list[int], mm_inputs: dict[str, torch.Tensor] | None = None
    ) -> list[float]:
        raise AssertionError("not used")

    def sleep(self) -> None:
        return None

    def wake_up(self) -> None:
        return None

    def close(self) -> None:
        return None


def calculator_script(text: str, seed: int | None) -> str:
    """Turn 1 calls the calculator; after its result, the answer."""
    return ANSWER if "<result>21" in text else CALL


async def run_group(
    transport: Transport, tmp_path: Path, model_dir: Path, env: EnvConfig, script: Any, *, group_size: int = 2,
    first: Any = None, hosted: bool = False, workers: list[EnvWorker] | None = None, metadata: dict[str, Any] | None = None,
) -> tuple[ScoredGroup, MicroBatch, Any, ScriptedEngine]:
    """One group through the controller: the buffer's accepted group and the micro-batch it
    serves rank 0 of a 1-rank trainer. ``first``: the script of a first controller, which
    dies when it raises (its requests fail every try); a second one then follows ``script``
    (the engine's calls are those of the second). ``hosted``: the environments in a real
    env worker (the env role), not in the controller; ``workers`` gets it. ``env.episode``:
    agent code (hosted: in the env role; else ``env.inline`` must say so); ``metadata``:
    more fields of each prompt's row."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = ScriptedEngine(tokenizer, first or script)
    prompts = [Prompt(index=i, prompt_ids=tokenizer.encode(f"<|user|>What is 3 * 7? ({i})\n<|assistant|>"),
                      text=f"What is 3 * 7? ({i})", metadata={"answer": "21", **(metadata or {})}) for i in range(4)]  # fmt: skip
    buffer_config = BufferConfig(groups_per_step=1, group_size=group_size, filter="none", pad_token_id=0)
    async with (
        Registry(transport, endpoint=LOCAL, publish_endpoint=LOCAL) as registry,
        Generator(transport, endpoint=LOCAL, engine=engine, config=GeneratorConfig()) as generator,
        Reward(transport, endpoint=LOCAL, config=RewardConfig(scorers=[ScorerConfig(kind="exact_match")], processes=1),
               tokenizer_path=str(model_dir)) as reward,
        Buffer(transport, endpoint=LOCAL, config=buffer_config, num_prompts=len(prompts), num_shards=1, world_size=1,
               seed=0, ledger_path=tmp_path / "ledger.db") as buffer,
    ):  # fmt: skip
        engine.generator = generator
        async with (
            Registration(transport, registry.endpoint, generator.info()),
            Registration(transport, registry.endpoint, reward.info()),
            Registration(transport, registry.endpoint, buffer.info()),
            Directory(transport, registry.endpoint) as directory,
            contextlib.AsyncExitStack() as stack,
        ):
            roles = ["generator", "reward", "buffer"]
            if hosted:
                worker = await stack.enter_async_context(EnvWorker(transport, endpoint=LOCAL, config=env))
                if workers is not None:
                    workers.append(worker)
                await stack.enter_async_context(Registration(transport, registry.endpoint, worker.info()))
                roles.append("env")
            await directory.wait_until(lambda d: all(d.members(r) for r in roles), timeout=30)
            kind = AgentRunner if env.episode else EpisodeRunner
            runner = kind(
                env, Renderer(tokenizer, protocol="raw"), decode=lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
                eos_ids={tokenizer.eos_token_id}, max_new_tokens=32, context=512,
            )  # fmt: skip
            def controller() -> Controller:
                return Controller(
                    ControllerConfig(num_controllers=1, plan_wait_s=0.2, max_attempts=2), buffer_config_algorithm(),
                    shard=0, group_size=group_size, prompts=prompts, directory=directory, seed=0,
                    episodes=(runner, None if hosted or env.episode else env_factory(env)),
                )  # fmt: skip

            if first is not None:
                with pytest.raises(ActorFailed):
                    await asyncio.wait_for(controller().run(asyncio.Event()), 60)
                engine.script, engine.calls = script, []
            stop = asyncio.Event()
            running = asyncio.create_task(controller().run(stop))
            try:
                async with Client(transport, buffer.endpoint) as client:
                    mb = await client.request(MicroBatchRequest(step=0, rank=0, world_size=1, index=0), MicroBatch, timeout=60)
            finally:
                stop.set()
                await asyncio.wait_for(running, 30)
            (group, _), *_ = buffer.core.step_groups[0]
            return group, mb, tokenizer, engine


def buffer_config_algorithm() -> Any:
    from yatt.rl.config import AlgorithmConfig

    return AlgorithmConfig()


@pytest.fixture
def calculator_env() -> EnvConfig:
    return EnvConfig(tools=["yatt.rl.agents.tools:calculator"], max_turns=4)


@pytest.mark.parametrize("hosted", [False, True], ids=["inline", "env role"])
async def test_a_tool_episode_trains_the_policys_tokens_only(
    transport: Transport, tmp_path: Path, tiny_model_dir: Path, calculator_env: EnvConfig, hosted: bool
) -> None:
    group, mb, tokenizer, engine = await run_group(
        transport, tmp_path, tiny_model_dir, calculator_env, calculator_script, hosted=hosted
    )
    call_ids = tokenizer.encode(CALL, add_special_tokens=False)
    result_ids = tokenizer.encode("<result>21</result>", add_special_tokens=False)
    answer_ids = [*tokenizer.encode(ANSWER, add_special_tokens=False), tokenizer.eos_token_id]
    for i in range(2):
        # Token in, token out: the row is the turns as sampled and the rendered result between them.
        assert group.completion_ids[i].tolist() == call_ids + result_ids + answer_ids
        assert group.completion_masks[i].tolist() == [True] * len(call_ids) + [False] * len(result_ids) + [True] * len(answer_ids)
        assert group.rollout_logprobs[i].tolist() == [-0.25] * len(call_ids) + [0.0] * len(result_ids) + [-0.25] * len(answer_ids)
        # Weights moved on between the turns: each token carries the version that sampled it
        # (the engine's calls: the turns of both episodes in one batch each, or, under load, apart).
        versions = group.token_versions[i].tolist()
        call, result, answer = versions[: len(call_ids)], versions[len(call_ids) : -len(answer_ids)], versions[-len(answer_ids) :]
        assert len(set(call)) == len(set(answer)) == 1 and result == [-1] * len(result_ids), versions
        assert answer[0] > call[0] and int(group.policy_versions[i]) == call[0], versions
        info = group.episodes[i]
        assert (info.ended, info.turns, info.tool_errors) == ("done", 2, 0)
    assert group.rewards.tolist() == [1.0, 1.0] and group.scores["exact_match"].tolist() == [1.0, 1.0]
    # Each turn of each episode went to the generator as a request of its own (n=1): the
    # episodes are tasks of their own, so the generator's batches are whatever arrived
    # together ([2, 2] when idle; [1, 2, 1] or four apart under load, never a barrier).
    assert sum(len(batch) for batch in engine.calls) == 4, [len(batch) for batch in engine.calls]
    assert all(r.sampling.stop == ["</tool>"] and r.n == 1 for batch in engine.calls for r in batch)
    # The row the trainer gets: prompt | call (loss) | result (no loss) | answer (loss).
    p = len(group.prompt_ids)
    row = mb.input_ids[0].tolist()
    assert row[:p] == group.prompt_ids.tolist() and row[p : p + len(group.completion_ids[0])] == group.completion_ids[0].tolist()
    assert mb.loss_mask[0, p : p + len(group.completion_ids[0])].tolist() == group.completion_masks[0].tolist()
    assert not mb.loss_mask[0, :p].any()
    hole = slice(p + len(call_ids), p + len(call_ids) + len(result_ids))
    assert (mb.advantages[0, hole] == 0).all() and (mb.rollout_logprobs[0, hole] == 0).all()


@pytest.mark.parametrize("hosted", [False, True], ids=["inline", "env role"])
async def test_agent_code_that_rewrites_its_history_trains_a_forked_row_through_the_buffer(
    transport: Transport, tmp_path: Path, tiny_model_dir: Path, hosted: bool
) -> None:
    """Agent code (two chat calls, then one with its first message edited) through a real
    controller, generator, reward worker and buffer: each sample's third call starts a
    row of its own, which the ScoredGroup carries (``forked``) and the trainer's
    micro-batch holds beside the samples' rows: 4 rows, each turn trained once."""
    env = EnvConfig(episode="tests.workers.env_fixtures:chatty_agent", max_turns=4, inline=not hosted)
    group, mb, tokenizer, engine = await run_group(
        transport, tmp_path, tiny_model_dir, env, lambda text, seed: ANSWER, hosted=hosted,
        metadata={"then": "rewrite"},
    )  # fmt: skip
    answer = [*tokenizer.encode(ANSWER, add_special_tokens=False), tokenizer.eos_token_id]
    assert [e.turns for e in group.episodes] == [3, 3] and [f.sample for f in group.forked] == [0, 1]
    assert all(ids.tolist()[: len(answer)] == answer == ids.tolist()[-len(answer) :] for ids in group.completion_ids)
    for fork in group.forked:
        assert fork.completion_ids.tolist() == answer and fork.completion_mask.all()
        assert tokenizer.decode(fork.prompt_ids.tolist()).startswith("<|user|>edited")
        assert fork.advantages.tolist() == [float(group.advantages[fork.sample])] * len(answer)
    assert sum(len(batch) for batch in engine.calls) == 6, "three calls an episode, each generated once"
    assert mb.input_ids.shape[0] == 4 and int(mb.loss_mask.sum()) == 6 * len(answer)
    rows = {tuple(mb.input_ids[r][mb.attention_mask[r]].tolist()) for r in range(4)}
    assert {(*fork.prompt_ids.tolist(), *answer) for fork in group.forked} <= rows


@pytest.mark.parametrize("concurrency", [1, 32])
async def test_a_controller_keeps_at_most_env_concurrency_episodes_live_in_the_env_role(
    transport: Transport, tmp_path: Path, tiny_model_dir: Path, calculator_env: EnvConfig, concurrency: int
) -> None:
    """Each live episode is a process in the env role: past ``env.concurrency`` the others
    wait their turn, and every episode still runs to its end."""
    workers: list[EnvWorker] = []
    env = dataclasses.replace(calculator_env, concurrency=concurrency)
    group, _, _, _ = await run_group(
        transport, tmp_path, tiny_model_dir, env, calculator_script, group_size=4, hosted=True, workers=workers
    )
    assert workers[0].peak == min(concurrency, 4) and workers[0].started == 4
    assert group.rewards.tolist() == [1.0] * 4 and all(i.ended == "done" for i in group.episodes)


async def test_a_broken_call_is_an_observation_and_the_episode_goes_on(
    transport: Transport, tmp_path: Path, tiny_model_dir: Path, calculator_env: EnvConfig
) -> None:
    """A call that does not parse gets an error the model reads; a later good call works;
    the limit of turns ends an episode that never answers."""

    def script(text: str, seed: int | None) -> str:
        if "could not parse" not in text:
            return "<tool>calculator(</tool>"
        return CALL

    group, _, tokenizer, _ = await run_group(transport, tmp_path, tiny_model_dir, calculator_env, script)
    info = group.episodes[0]
    assert (info.ended, info.turns, info.tool_errors) == ("max_turns", 4, 1)
    text = tokenizer.decode(group.completion_ids[0].tolist())
    assert "could not parse the tool call" in text and "<result>21</result>" in text
    assert group.rewards.tolist() == [0.0, 0.0]


def guesses(text: str, seed: int | None) -> str:
    """Guess 100, 101, ... one a turn (the feedback so far counts the turns): always too
    high, so every episode runs to its last turn."""
    return str(100 + text.count("Higher.") + text.count("Lower."))


class Crash(RuntimeError):
    pass


async def test_a_controller_that_dies_mid_episode_resumes_each_episode_after_its_recorded_turns(
    transport: Transport, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The first controller dies when its episodes reach their third turn (the engine fails
    every try of it): turns 1 and 2 of each episode are in the ledger. A second controller
    resumes every episode after them: it never asks for those turns again, and the group it
    delivers is the one an undisturbed run delivers."""
    env = EnvConfig(class_="yatt.rl.agents.games:GuessNumber", kwargs={"high": 8}, max_turns=4)

    def dies_at_turn_3(text: str, seed: int | None) -> str:
        if text.count("Higher.") + text.count("Lower.") >= 2:
            raise Crash("the generator died")
        return guesses(text, seed)

    reference, _, tokenizer, _ = await run_group(transport, tmp_path / "reference", tiny_model_dir, env, guesses, group_size=4)
    assert all((info.turns, info.ended) == (4, "max_turns") for info in reference.episodes)
    group, _, _, engine = await run_group(
        transport, tmp_path / "killed", tiny_model_dir, env, guesses, group_size=4, first=dies_at_turn_3
    )
    assert [ids.tolist() for ids in group.completion_ids] == [ids.tolist() for ids in reference.completion_ids]
    assert [m.tolist() for m in group.completion_masks] == [m.tolist() for m in reference.completion_masks]
    assert group.rewards.tolist() == reference.rewards.tolist()
    # The second controller generated only turns 3 and 4: every prompt it sent had 2 observations or more.
    seen = [tokenizer.decode(r.prompt_ids) for batch in engine.calls for r in batch]
    assert seen and all(t.count("Higher.") + t.count("Lower.") >= 2 for t in seen), seen
    # Turns 1 and 2 kept the version that sampled them before the death.
    assert all(v.tolist()[0] == 0 for v in group.token_versions)


def test_credit_per_turn_puts_each_turns_advantage_on_its_tokens() -> None:
    """env.credit: turn: the step rewards (weighted) and the scorer mix at the last turn make
    each turn's return; each turn's tokens carry its advantage, observations 0; the buffer's
    row takes them as they are."""
    from protocols.messages import GroupKey, Scores
    from yatt.rl.agents.episodes import Fork, Trajectory
    from yatt.rl.config import AlgorithmConfig
    from yatt.rl.controller import scored_episodes
    from yatt.rl.sampling import SamplingBuffer, episode_report

    def episode(turns: list[list[int]], rewards: list[float]) -> Trajectory:
        t = Trajectory()
        for i, ids in enumerate(turns):
            t.add(ids, logprobs=[-0.1] * len(ids), version=0)
            if i + 1 < len(turns):
                t.add([99])  # an observation
        t.info = dataclasses.replace(t.info, turns=len(turns), turn_rewards=rewards)
        return t

    key = GroupKey(epoch=0, shard=0, prompt_index=0)
    prompt = Prompt(index=0, prompt_ids=[1, 2], text="p", metadata={})
    trajectories = [episode([[5, 6], [7]], [0.5, float("nan")]), episode([[8]], [0.0])]
    scores = Scores(group_key=key, rewards=torch.tensor([1.0, 0.0]), components={"s": torch.tensor([1.0, 0.0])}, failures=["", ""])
    env = EnvConfig(class_="yatt.rl.agents.games:GuessNumber", credit="turn", gamma=0.5, reward_weight=2.0)
    group = scored_episodes(key, prompt, trajectories, scores, AlgorithmConfig(advantage="dr_grpo", aggregation="seq_mean_token_sum_norm", aggregation_norm=8), env)
    # Returns: episode 0 turn 0: 2 * 0.5 + 0.5 * (0 + 1) = 1.5, turn 1: 1; episode 1: 0; baseline 0.75.
    assert group.token_advantages[0].tolist() == [0.75, 0.75, 0.0, 0.25]
    assert group.token_advantages[1].tolist() == [-0.75]
    assert group.advantages.tolist() == [0.75, -0.75]
    assert group.rewards.tolist() == [2.0, 0.0], "the reward reported: the scorer mix + 2 x the env's"
    buffer = SamplingBuffer(BufferConfig(groups_per_step=1, group_size=2), num_prompts=1, num_shards=1, world_size=1, seed=0, ledger=None)  # type: ignore[arg-type]
    mb = buffer._split([group], 0, 0)[0]
    assert mb.advantages[0, 2:6].tolist() == [0.75, 0.75, 0.0, 0.25], "row 0: episode 0 after its 2 prompt tokens"
    # The same episode 0 whose second turn forked a row (its context 3 4 5 6): that turn's
    # advantage goes on that row's tokens; the version in the forked row counts for staleness.
    fork = Fork(prompt_ids=[3, 4, 5, 6])
    fork.add([7], logprobs=[-0.1], version=4)
    first = Trajectory()
    first.add([5, 6], logprobs=[-0.1, -0.1], version=0)
    first.forks.append(fork)
    first.info = trajectories[0].info
    group = scored_episodes(key, prompt, [first, trajectories[1]], scores, AlgorithmConfig(advantage="dr_grpo", aggregation="seq_mean_token_sum_norm", aggregation_norm=8), env)
    assert group.token_advantages[0].tolist() == [0.75, 0.75] and group.token_advantages[1].tolist() == [-0.75]
    [row] = group.forked
    assert (row.sample, row.prompt_ids.tolist(), row.completion_ids.tolist(), row.advantages.tolist()) == (0, [3, 4, 5, 6], [7], [0.25])
    assert row.token_versions.tolist() == [4] and group.policy_versions.tolist() == [0, 0]
    # Credit per episode: the sample's advantage on the forked row's own tokens.
    group = scored_episodes(key, prompt, [first, trajectories[1]], scores, AlgorithmConfig(), dataclasses.replace(env, credit="episode"))
    assert group.forked[0].advantages.tolist() == [float(group.advantages[0])] and float(group.advantages[0]) > 0
    assert episode_report([group])["episode/fork_share"] == 1 / 3, "1 of the group's 3 calls forked"


def test_a_prompts_attempts_sample_with_one_seed() -> None:
    """The sampling seed is the prompt's (of its epoch), not the attempt's: a group redone
    because the run went back to a checkpoint (its first copy made with discarded weights,
    ``rolled_back``) samples what the undisturbed run sampled (the colocated kill test's
    row-for-row comparison). Another prompt, epoch, sample or turn is another seed."""
    key = GroupKey(epoch=0, shard=1, prompt_index=23, attempt=0)
    assert sampling_seed(7, key) == sampling_seed(7, dataclasses.replace(key, attempt=2))
    assert sampling_seed(7, key, 0, 1) == sampling_seed(7, dataclasses.replace(key, attempt=1), 0, 1)
    others = [
        sampling_seed(8, key), sampling_seed(7, dataclasses.replace(key, prompt_index=24)),
        sampling_seed(7, dataclasses.replace(key, epoch=1)), sampling_seed(7, key, 1, 1), sampling_seed(7, key, 0, 2),
    ]  # fmt: skip
    assert sampling_seed(7, key) not in others and len(set(others)) == len(others)


def test_a_prompts_request_carries_its_images_processed_and_encoded() -> None:
    """The transformers engine reads the pixels, vLLM the images themselves (it runs the
    processor): a request has both, and both cross the wire as they are."""
    pixels = {"pixel_values": np.arange(48, dtype=np.float32).reshape(1, 3, 4, 4)}
    prompts = [
        Prompt(index=i, prompt_ids=[1, 2, 3], text="?", metadata={}, mm_inputs=dict(pixels), images=[b"\x89PNG-%d" % i])
        for i in range(2)
    ]
    controller = Controller(
        ControllerConfig(num_controllers=1), AlgorithmConfig(), shard=0, group_size=2, prompts=prompts,
        directory=cast(Any, None), seed=0,
    )  # fmt: skip
    _, request = controller._request(GroupKey(epoch=0, shard=0, prompt_index=1), 0)
    back = decode(encode(request))
    assert isinstance(back, GenerateRequest) and back.images == [b"\x89PNG-1"]
    assert np.array_equal(back.mm_inputs["pixel_values"].numpy(), pixels["pixel_values"])
