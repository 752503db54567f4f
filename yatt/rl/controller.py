"""A controller: one asyncio process per data shard, holding nothing durable.

The loop, per group (one prompt, n samples)::

    buffer --DispatchPlan(keys of my shard, min version)-->  controller
        for each key not yet in flight:
            GenerateRequest -> generator pool  (waits: a free generator; the generator
                                                waits for min_policy_version)
            ScoreRequest    -> reward pool     (waits: scorers, each time-limited)
            advantages per group (yatt.rl.rl_math), DAPO overlong penalty
            ScoredGroup     -> buffer          (waits: the ledger's fsync; Ack = decided)
        keys that left the plan (superseded) and are still generating are cancelled

An evaluation is more keys in the same plan (``yatt.rl.evaluation``): held-out prompts,
sampled greedily or as ``eval`` says, scored by the same reward pool, with no advantages.

With ``env`` set (``yatt.rl.agents``) each of a group's n samples is an episode, its own
task: every turn one GenerateRequest (the episode's ids so far, n=1), the environment
stepped between turns; the n transcripts are scored together when the last one ends, the
environment's rewards added, and the group goes to the buffer as a single-turn one does.

What unblocks it: a new plan (the buffer's long poll answers when decisions or the
policy version move the dispatch window). Over-sampling, the staleness bound and the
order of prompts are the buffer's (see ``yatt.rl.sampling``), so a controller is stateless:
a restarted one asks for its plan with ``after_seq=-1`` and re-issues every undecided
group of its shard. A group it had already delivered is a duplicate the buffer drops by
key, so a SIGKILL loses and duplicates nothing. A worker that dies (``PeerLost``) or
does not answer in time has its request re-issued to another of the pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from protocols.messages import (
    Ack,
    Completion,
    Completions,
    DispatchPlan,
    ForkedRow,
    GenerateRequest,
    GroupKey,
    Message,
    Metrics,
    PlanRequest,
    Query,
    SamplingParams,
    ScoredGroup,
    ScoreRequest,
    Scores,
    TurnRecord,
    TurnRecords,
    TurnsRequest,
)
from yatt.errors import ActorFailed, PeerLost, RemoteError, RequestTimeout, TransportError
from yatt.rl import rl_math
from yatt.rl.agents.client import AgentRunner, NoCall
from yatt.rl.agents.envs import EnvFactory, call
from yatt.rl.agents.episodes import Diverged, EpisodeRunner, Generate, Trajectory, Turn
from yatt.rl.agents.hosted import hosted
from yatt.rl.agents.remote import RemoteEnv
from yatt.rl.config import AlgorithmConfig, ControllerConfig, EnvConfig, EvalConfig
from yatt.rl.data import Prompt
from yatt.rl.evaluation import GREEDY, eval_version, is_eval
from yatt.rl.vision import concatenated, data_url
from yatt.runtime.actor import Actor, handles
from yatt.runtime.registry import Directory
from yatt.runtime.transport import Transport

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=Message)


def sampling_seed(seed: int, key: GroupKey, *turn: int) -> int:
    """A stable 31-bit seed per prompt of an epoch (and an episode's sample and turn), so a
    re-issued request samples the same. Not per attempt: an attempt is bookkeeping (which
    copy of a group is current), and a group redone because the run went back to a
    checkpoint, its first copy made with discarded weights, then samples what it would have
    sampled undisturbed (another attempt is sampled with other weights anyway)."""
    where = "/".join([key.prompt_str(), *map(str, turn)])
    digest = hashlib.blake2b(f"{seed}/{where}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def advantages(rewards: torch.Tensor, algorithm: AlgorithmConfig) -> torch.Tensor:
    """Per-sequence advantages of one group [n]. GAE and REINFORCE++ ship raw rewards and
    REINFORCE++-baseline r - mean(r); the trainer finishes them (critic values, token
    returns, whitening over the whole batch). Dr.GRPO's normaliser is the trainer's too."""
    kind = algorithm.advantage
    if kind == "grpo":
        return rl_math.grpo_advantages(rewards)
    if kind == "dr_grpo":
        return rl_math.grpo_advantages(rewards, std_normalize=False)
    if kind == "rloo":
        return rl_math.rloo_advantages(rewards)
    if kind == "reinforce_pp_baseline":
        return rl_math.reinforce_pp_baseline(rewards)
    return rewards.clone()  # reinforce_pp, gae


def scored_group(
    key: GroupKey,
    prompt: Prompt,
    completions: Completions,
    scores: Scores,
    algorithm: AlgorithmConfig,
    max_new_tokens: int,
) -> ScoredGroup:
    """The buffer's view of a finished group: rewards (+ overlong penalty) and advantages;
    an eval group's rewards are the scores as they are, and it has no advantages."""
    items = completions.completions
    rewards = scores.rewards.to(torch.float32).clone()  # [n]
    if algorithm.overlong_buffer and not is_eval(key):
        lengths = torch.tensor([len(c.token_ids) for c in items])
        rewards += rl_math.overlong_penalty(
            lengths, max_new_tokens=max_new_tokens, buffer=algorithm.overlong_buffer, penalty=algorithm.overlong_penalty
        )
    advantage = torch.zeros_like(rewards) if is_eval(key) else advantages(rewards, algorithm).to(torch.float32)
    return ScoredGroup(
        group_key=key,
        prompt_ids=torch.tensor(prompt.prompt_ids, dtype=torch.int32),
        completion_ids=[c.token_ids for c in items],
        rollout_logprobs=[c.logprobs for c in items],
        rewards=rewards,
        advantages=advantage,
        policy_versions=torch.tensor([c.policy_version_min for c in items], dtype=torch.int64),
        finish_reasons=[c.finish_reason for c in items],
        scores={name: values.to(torch.float32) for name, values in scores.components.items()},
        failures=list(scores.failures),
        mm_inputs=mm_tensors(prompt),
    )


def mm_tensors(prompt: Prompt) -> dict[str, torch.Tensor]:
    """A prompt's processed images (``Prompt.mm_inputs``) as the messages carry them."""
    return tensors(prompt.mm_inputs)


def tensors(mm_inputs: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Processed images (arrays by name) as the messages carry them."""
    return {name: torch.from_numpy(array.copy()) for name, array in mm_inputs.items()}


def _same_images(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[name], b[name]) for name in a)


def scored_episodes(
    key: GroupKey,
    prompt: Prompt,
    trajectories: list[Trajectory],
    scores: Scores,
    algorithm: AlgorithmConfig,
    env: EnvConfig,
) -> ScoredGroup:
    """A group of episodes for the buffer: the reward is the scorer mix over each transcript
    plus ``env.reward_weight`` x the environment's rewards (reported as the ``env`` score);
    the advantage per episode, spread by the buffer over the policy's tokens only, or with
    ``env.credit: turn`` per turn (``rl_math.turn_advantages``)."""
    env_weight = env.reward_weight
    env_rewards = torch.tensor([t.env_reward for t in trajectories], dtype=torch.float32)  # [n]
    completions = Completions(
        group_key=key,
        completions=[
            Completion(
                token_ids=torch.tensor(t.ids, dtype=torch.int32),
                logprobs=torch.tensor(t.logprobs, dtype=torch.float32),
                finish_reason=t.finish_reason,
                policy_version_min=min((v for row in t.rows for v in row.versions if v >= 0), default=0),
                policy_version_max=max((v for row in t.rows for v in row.versions), default=0),
            )
            for t in trajectories
        ],
    )
    mixed = dataclasses.replace(
        scores, rewards=scores.rewards.to(torch.float32) + env_weight * env_rewards,
        components={**scores.components, "env": env_rewards},
    )  # fmt: skip
    group = scored_group(key, prompt, completions, mixed, algorithm, max_new_tokens=0)
    masks = [torch.tensor(t.mask, dtype=torch.bool) for t in trajectories]
    per_token: list[torch.Tensor] = []
    if env.credit == "turn" and not is_eval(key):
        turn_rewards = [
            [env_weight * (0.0 if math.isnan(r) else r) for r in t.info.turn_rewards] for t in trajectories
        ]  # fmt: skip
        for rewards, final in zip(turn_rewards, scores.rewards.tolist(), strict=True):
            if rewards:  # the scorer mix judges the whole transcript: the last turn's
                rewards[-1] += final
        per_turn = rl_math.turn_advantages(turn_rewards, gamma=env.gamma, std_normalize=algorithm.advantage != "dr_grpo")
        spread = [_spread(advantages, t) for advantages, t in zip(per_turn, trajectories, strict=True)]
        per_token = [rows[0] for rows in spread]
        first = [float(a[0]) if a.numel() else 0.0 for a in per_turn]
        group = dataclasses.replace(group, advantages=torch.tensor(first, dtype=torch.float32))
    forked = [
        ForkedRow(
            sample=i, prompt_ids=torch.tensor(fork.prompt_ids, dtype=torch.int32),
            completion_ids=torch.tensor(fork.ids, dtype=torch.int32), completion_mask=torch.tensor(fork.mask, dtype=torch.bool),
            rollout_logprobs=torch.tensor(fork.logprobs, dtype=torch.float32),
            token_versions=torch.tensor(fork.versions, dtype=torch.int64),
            advantages=spread[i][1 + j] if per_token else float(group.advantages[i]) * torch.tensor(fork.mask, dtype=torch.float32),
        )  # fmt: skip
        for i, t in enumerate(trajectories)
        for j, fork in enumerate(t.forks)
    ]
    return dataclasses.replace(
        group,
        completion_masks=masks,
        token_versions=[torch.tensor(t.versions, dtype=torch.int64) for t in trajectories],
        episodes=[t.info for t in trajectories],
        token_advantages=per_token,
        forked=forked,
        sample_mm_inputs=[tensors(t.mm) for t in trajectories] if any(t.images for t in trajectories) else [],
    )


def _spread(per_turn: torch.Tensor, trajectory: Trajectory) -> list[torch.Tensor]:
    """Turn t's advantage on turn t's tokens, 0 on the observations: [L] per row of the
    episode (its turns in call order: the first row's, then each fork's)."""
    advantages = iter(per_turn.tolist())
    out = []
    for row in trajectory.rows:
        spread = torch.zeros(len(row.ids), dtype=torch.float32)
        for start, end in row.turns:
            spread[start:end] = next(advantages)
        out.append(spread)
    return out


def turn_record(key: GroupKey, sample: int, turn: Turn) -> TurnRecord:
    return TurnRecord(
        group_key=key, sample=sample, turn=turn.index, token_ids=torch.tensor(turn.token_ids, dtype=torch.int32),
        logprobs=torch.tensor(turn.logprobs, dtype=torch.float32), policy_version=turn.version,
        finish_reason=turn.finish_reason, obs_ids=torch.tensor(turn.obs_ids, dtype=torch.int32),
        reward=float("nan") if turn.reward is None else turn.reward, tool_errors=turn.tool_errors, ended=turn.ended,
        detail=turn.detail, env_state=turn.env_state, obs_images=turn.obs_images,
    )  # fmt: skip


def turn_of(record: TurnRecord) -> Turn:
    return Turn(
        index=record.turn, token_ids=record.token_ids.tolist(), logprobs=record.logprobs.tolist(),
        version=record.policy_version, finish_reason=record.finish_reason, obs_ids=record.obs_ids.tolist(),
        reward=None if math.isnan(record.reward) else record.reward, tool_errors=record.tool_errors,
        ended=record.ended, detail=record.detail, env_state=record.env_state, obs_images=list(record.obs_images),
    )  # fmt: skip


class Controller:
    """Drives the prompts of one shard; see the module docstring for the loop."""

    def __init__(
        self,
        config: ControllerConfig,
        algorithm: AlgorithmConfig,
        *,
        shard: int,
        group_size: int,
        prompts: list[Prompt],
        directory: Directory,
        seed: int,
        eval_prompts: list[Prompt] | None = None,
        evaluation: EvalConfig | None = None,
        episodes: tuple[EpisodeRunner | AgentRunner, EnvFactory | None] | None = None,
    ) -> None:
        """``eval_prompts``: the held-out prompts the buffer's eval keys index, sampled as
        ``evaluation`` says. ``episodes``: run each sample as a multi-turn episode with this
        runner, against a new environment from this factory (None: hosted by the env role)."""
        if not 0 <= shard < config.num_controllers:
            raise ValueError(f"shard {shard} is outside 0..{config.num_controllers - 1}")
        self.config = config
        self.algorithm = algorithm
        self.shard = shard
        self.group_size = group_size
        self.prompts = prompts
        self.directory = directory
        self.seed = seed
        self.eval_prompts = eval_prompts or []
        self.evaluation = evaluation or EvalConfig()
        self.episodes = episodes
        self.delivered = 0  # groups this incarnation handed to the buffer
        self.reissued = 0  # requests re-sent after a lost or silent worker
        self._tasks: dict[GroupKey, asyncio.Task[None]] = {}
        self._submitting: set[GroupKey] = set()
        # Episodes live in the env role at once (env.concurrency): each is a process there.
        self._env_slots = asyncio.Semaphore(episodes[0].config.concurrency if episodes is not None else 1)

    @property
    def in_flight(self) -> int:
        return sum(not t.done() for t in self._tasks.values())

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the buffer's plan until ``stop`` is set; a failed group fails the run."""
        plan_seq = -1
        try:
            while not stop.is_set():
                plan = await self._call(
                    "buffer",
                    PlanRequest(
                        shard=self.shard,
                        num_shards=self.config.num_controllers,
                        after_seq=plan_seq,
                        wait_s=self.config.plan_wait_s,
                    ),
                    DispatchPlan,
                    timeout=self.config.plan_wait_s + self.config.request_timeout_s,
                )
                if plan_seq == -1:  # this process's first plan: a restarted controller re-issues it all
                    logger.info(
                        "controller %d: issuing the %d undecided groups of its shard in the buffer's window",
                        self.shard, len(plan.keys),
                    )
                plan_seq = plan.plan_seq
                self._follow(plan)
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def _follow(self, plan: DispatchPlan) -> None:
        for key, task in list(self._tasks.items()):
            if task.done():
                del self._tasks[key]
                if not task.cancelled() and task.exception() is not None:
                    raise ActorFailed(f"controller {self.shard}: group {key.as_str()} failed") from task.exception()
        wanted = set(plan.keys)
        for key, task in list(self._tasks.items()):
            if key not in wanted and key not in self._submitting:
                task.cancel()  # superseded while generating: the buffer no longer wants it
        for key in plan.keys:
            if key not in self._tasks:
                self._tasks[key] = asyncio.get_running_loop().create_task(self._group(key, plan.min_policy_version))

    def _request(self, key: GroupKey, min_version: int) -> tuple[Prompt, GenerateRequest]:
        """The prompt of ``key`` and what to ask a generator for it: the rollout sampling, or
        an eval key's (greedy: one completion at temperature 0; sampled: eval.n at
        eval.temperature, with the version the key evaluates)."""
        c, seed = self.config, sampling_seed(self.seed, key)
        if not is_eval(key):
            sampling = SamplingParams(
                temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, max_new_tokens=c.max_new_tokens, seed=seed
            )
            prompt, n = self.prompts[key.prompt_index], self.group_size
        else:
            e = self.evaluation
            max_new_tokens = e.max_new_tokens or c.max_new_tokens
            if key.attempt == GREEDY:
                sampling, n = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, seed=seed), 1
            else:
                sampling = SamplingParams(
                    temperature=e.temperature, top_p=c.top_p, top_k=c.top_k, max_new_tokens=max_new_tokens, seed=seed
                )
                n = e.n
            prompt, min_version = self.eval_prompts[key.prompt_index], eval_version(key)
        prompt_ids = torch.tensor(prompt.prompt_ids, dtype=torch.int32)
        request = GenerateRequest(
            group_key=key, prompt_ids=prompt_ids, n=n, sampling=sampling, min_policy_version=min_version,
            mm_inputs=mm_tensors(prompt), images=prompt.images,
        )  # fmt: skip
        return prompt, request

    async def _group(self, key: GroupKey, min_version: int) -> None:
        prompt, request = self._request(key, min_version)
        if self.episodes is not None:
            group = await self._episode_group(key, prompt, request)
        else:
            completions = await self._call("generator", request, Completions)
            items = completions.completions
            scores = await self._score(key, prompt, request.prompt_ids, [c.token_ids for c in items], [c.finish_reason for c in items])
            group = scored_group(key, prompt, completions, scores, self.algorithm, self.config.max_new_tokens)
        self._submitting.add(key)
        try:
            await self._call("buffer", group, Ack)
            self.delivered += 1
        finally:
            self._submitting.discard(key)

    async def _score(
        self, key: GroupKey, prompt: Prompt, prompt_ids: torch.Tensor, completion_ids: list[torch.Tensor], finish_reasons: list[str]
    ) -> Scores:
        request = ScoreRequest(
            group_key=key, prompt_ids=prompt_ids, completion_ids=completion_ids, finish_reasons=finish_reasons,
            metadata=prompt.metadata,
        )  # fmt: skip
        return await self._call("reward", request, Scores)

    async def _episode_group(self, key: GroupKey, prompt: Prompt, request: GenerateRequest) -> ScoredGroup:
        """The group's n episodes, each its own task (no barrier between their turns), then
        scored together. Every episode of a group resets its environment with the group's
        seed: n attempts at one task, as GRPO compares them."""
        assert self.episodes is not None
        runner = self.episodes[0]
        row: dict[str, Any] = {**prompt.metadata, "prompt": prompt.text, "index": prompt.index}
        if prompt.images:  # (a row crosses to the env role as JSON: the images as data URLs)
            row["images"] = [data_url(image) for image in prompt.images]

        # A restarted controller (or a re-issued group) resumes each episode after its last
        # recorded turn; an evaluation's episodes are not recorded (they are not trained).
        recorded: dict[int, list[Turn]] = {}
        if not is_eval(key):
            for r in (await self._call("buffer", TurnsRequest(group_key=key), TurnRecords)).records:
                recorded.setdefault(r.sample, []).append(turn_of(r))

        async def record(sample: int, turn: Turn) -> None:
            if not is_eval(key):
                await self._call("buffer", turn_record(key, sample, turn), Ack)

        async def episode(sample: int) -> tuple[list[int], dict[str, np.ndarray], Trajectory]:
            turns = recorded.get(sample, [])
            if turns:
                logger.info("controller %d: group %s sample %d resumes after turn %d (recorded)", self.shard, key.as_str(), sample, len(turns) - 1)
            try:
                return await self._episode(key, sample, request, row, recorded=turns, record=record)
            except Diverged as e:
                logger.warning("controller %d: group %s sample %d runs again from its start: %s", self.shard, key.as_str(), sample, e)
                await self._call("buffer", TurnsRequest(group_key=key, drop_sample=sample), TurnRecords)  # (no old turn outlives it)
                return await self._episode(key, sample, request, row, recorded=[], record=record)

        async with asyncio.TaskGroup() as tasks:  # (one that fails cancels the others)
            running = [tasks.create_task(episode(i)) for i in range(request.n)]
        episodes = [task.result() for task in running]
        prompt_ids, prompt_mm = episodes[0][0], episodes[0][1]
        if any(ids != prompt_ids or not _same_images(mm, prompt_mm) for ids, mm, _ in episodes):
            raise ActorFailed(
                f"controller {self.shard}: group {key.as_str()}: " + (
                    "env.episode's first calls gave the group's episodes different prompts; a group is n attempts at "
                    "one task: make the first call depend on the row only"
                    if isinstance(runner, AgentRunner) else
                    "the environment's reset gave its episodes different first observations for one seed; a group is "
                    "n attempts at one task: make reset follow its seed"
                )
            )
        trajectories = [t for _, _, t in episodes]
        ids = torch.tensor(prompt_ids, dtype=torch.int32)
        transcripts = [torch.tensor(t.ids, dtype=torch.int32) for t in trajectories]
        scores = await self._score(key, prompt, ids, transcripts, [t.finish_reason for t in trajectories])
        episode_prompt = dataclasses.replace(prompt, prompt_ids=prompt_ids, mm_inputs=prompt_mm)
        return scored_episodes(key, episode_prompt, trajectories, scores, self.algorithm, runner.config)

    async def _episode(
        self, key: GroupKey, sample: int, request: GenerateRequest, row: dict[str, Any], *, recorded: list[Turn],
        record: Callable[[int, Turn], Awaitable[None]],
    ) -> tuple[list[int], dict[str, np.ndarray], Trajectory]:  # fmt: skip
        """One episode of ``key``: a new environment reset with the group's seed, its
        recorded turns replayed, each new turn generated (sampled with a seed of its key,
        sample and turn: a re-issue samples the same) and recorded. Returns its prompt, the
        prompt's images (processed) and the episode after the prompt."""
        assert self.episodes is not None
        runner, new_env = self.episodes
        turns, affinity = len(recorded), list[str]()
        # The prompt's images: the data prompt's, until a reset renders a prompt of its own.
        prompt_mm = {name: tensor.numpy() for name, tensor in request.mm_inputs.items()}
        prompt_images = list(request.images)  # (and encoded)

        async def generate(ids: list[int], budget: int, observed: dict[str, np.ndarray], encoded: list[bytes]) -> Completion:
            nonlocal turns
            sampling = dataclasses.replace(
                request.sampling, max_new_tokens=budget, stop=runner.config.stop_strings,
                seed=sampling_seed(self.seed, key, sample, turns),
            )  # fmt: skip
            turns += 1
            turn = GenerateRequest(
                group_key=key, prompt_ids=torch.tensor(ids, dtype=torch.int32), n=1, sampling=sampling,
                min_policy_version=request.min_policy_version,
                mm_inputs=tensors(concatenated([prompt_mm, observed])),  # the prompt's images, then the observations'
                images=[*prompt_images, *encoded],
            )  # fmt: skip
            return (await self._call("generator", turn, Completions, affinity=affinity)).completions[0]

        if isinstance(runner, AgentRunner):  # the user's code drives the episode
            prompt_mm.clear()  # (its calls are text: it renders its own prompt, without the data prompt's images)
            prompt_images.clear()
            try:
                if runner.config.inline:
                    ids, trajectory = await runner.run(row, generate, recorded=recorded, record=lambda turn: record(sample, turn))
                    return ids, prompt_mm, trajectory
                async with self._env_slots:  # (in the env role, as an environment: yatt.rl.agents.hosted)
                    env = RemoteEnv(
                        self.directory, name=f"{key.as_str()}/{sample}", timeout_s=runner.config.episode_timeout_s,
                        wait_s=self.config.request_timeout_s,
                    )  # fmt: skip
                    ids, trajectory = await runner.run(
                        row, generate, recorded=recorded, record=lambda turn: record(sample, turn),
                        episode=hosted(env, seed=sampling_seed(self.seed, key)),
                    )  # fmt: skip
                    return ids, prompt_mm, trajectory
            except NoCall as e:
                raise ActorFailed(f"controller {self.shard}: group {key.as_str()}: {e}") from e
        if new_env is None:  # (in the env role: a process there while it lives; the others wait their turn)
            async with self._env_slots:
                return await self._env_episode(key, sample, request, row, runner, new_env, generate, recorded, record, (prompt_mm, prompt_images))
        return await self._env_episode(key, sample, request, row, runner, new_env, generate, recorded, record, (prompt_mm, prompt_images))

    async def _env_episode(
        self, key: GroupKey, sample: int, request: GenerateRequest, row: dict[str, Any], runner: EpisodeRunner,
        new_env: EnvFactory | None, generate: Generate, recorded: list[Turn], record: Callable[[int, Turn], Awaitable[None]],
        prompt_images: tuple[dict[str, np.ndarray], list[bytes]],
    ) -> tuple[list[int], dict[str, np.ndarray], Trajectory]:  # fmt: skip
        """``_episode`` against an environment: made here (``new_env``) or in the env role.
        ``prompt_images``: the data prompt's images, processed and encoded, replaced (in place:
        ``generate`` reads them) by the reset's own when it renders the prompt."""
        prompt_mm, encoded = prompt_images
        try:
            env = new_env() if new_env is not None else RemoteEnv(
                self.directory, name=f"{key.as_str()}/{sample}", timeout_s=runner.config.episode_timeout_s,
                wait_s=self.config.request_timeout_s,
            )  # fmt: skip
            prompt_ids, images = await runner.start(env, seed=sampling_seed(self.seed, key), row=row, prompt_ids=request.prompt_ids.tolist())
            if images is not None:
                prompt_mm.clear()
                prompt_mm.update(runner.renderer.pixels(images))
                encoded[:] = images
        except Exception as e:  # a user's environment: without its first observation the group cannot start
            raise ActorFailed(
                f"controller {self.shard}: group {key.as_str()}: making or resetting the environment failed "
                f"({type(e).__name__}: {e}); fix env.class / env.kwargs"
            ) from e
        try:
            trajectory = await runner.run(
                env, prompt_ids, generate, recorded=recorded, record=lambda turn: record(sample, turn)
            )
            return prompt_ids, prompt_mm, trajectory
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    await call(close)
                except Exception as e:  # a user's close: its episode is over either way
                    logger.warning("controller %d: %s.close raised %s: %s", self.shard, type(env).__name__, type(e).__name__, e)

    async def _call(
        self, role: str, msg: Message, expect: type[R], *, timeout: float | None = None, affinity: list[str] | None = None
    ) -> R:
        """Send ``msg`` to the least-busy live member of ``role``; re-issue it elsewhere when
        that member is lost or silent. Every message here is idempotent by group key.
        ``affinity``: [endpoint] of the member to prefer (an episode's previous turn's),
        updated to the one that answered."""
        deadline = timeout or self.config.request_timeout_s
        last: Exception | None = None
        for _ in range(self.config.max_attempts):
            try:
                await self.directory.wait_for_live(role, timeout=self.config.request_timeout_s)
                client = self.directory.pick(role, prefer=affinity[0] if affinity else None)
                reply = await client.request(msg, expect, timeout=deadline)
                if affinity is not None:
                    affinity[:] = [client.endpoint]
                return reply
            except (PeerLost, RequestTimeout, TransportError) as e:
                last = e
                if affinity:
                    affinity.clear()  # (a silent member's turn goes elsewhere)
                self.reissued += 1
                logger.warning("controller %d: %s request failed (%s); re-issuing", self.shard, role, e)
                await self.directory.pause_before_retry(e)
            except RemoteError as e:
                last = e
                if affinity:
                    affinity.clear()
                logger.warning("controller %d: %s raised %s; re-issuing", self.shard, role, e.error_type)
        raise ActorFailed(
            f"controller {self.shard}: {type(msg).__name__} failed {self.config.max_attempts} times on the {role} pool"
        ) from last


class ControllerActor(Actor):
    """The controller's own endpoint: it registers the controller (READY) and answers
    ``Query("stats")``; the controller's work is the loop in ``Controller.run``."""

    role = "controller"

    def __init__(self, transport: Transport, *, endpoint: str, controller: Controller) -> None:
        super().__init__(transport, endpoint=endpoint, actor_id=f"controller-{controller.shard}-{uuid.uuid4().hex[:6]}")
        self.controller = controller

    @handles(Query)
    async def query(self, msg: Query) -> Message:
        if msg.what == "stats":
            c = self.controller
            return Metrics(
                values={"controller/delivered": float(c.delivered), "controller/reissued": float(c.reissued), "controller/in_flight": float(c.in_flight)}
            )
        raise ValueError(f"controller: unknown query {msg.what!r}; known: stats")
