"""Evaluation on held-out prompts, through the run's own controllers, generators and rewards.

An evaluation of policy version ``v`` is a round of groups the buffer adds to every
controller's plan, beside the training groups, and collects outside the training ledger::

    trainer 0 --Query("evaluate", version=v)--> buffer: starts round v (or finds it)
    buffer --DispatchPlan(eval keys first)--> controllers
        greedy key  (attempt 0): 1 completion, temperature 0   } generator waits for
        sampled key (attempt 1): eval.n completions, eval.temperature } version v
        -> reward pool -> ScoredGroup(eval key) --> buffer: round v keeps it (no ledger)
    round complete --> StepReport(step=v, eval/* metrics, some greedy groups) --> trainer 0

An eval key is a ``GroupKey`` with a negative epoch, ``-(v + 1)``: it names the version
it evaluates, so a result that comes late (a controller restarted, a round re-asked after
a buffer restart) is kept when it is of the round being run, and ignored otherwise; the
sampling seed follows from the key, so a re-issued request samples the same completions.
Nothing of a round is durable: a buffer restarted mid-round runs it again when trainer
rank 0 asks again (its request is re-sent to the new buffer).

Metrics (``eval_metrics``), for the reward mix (``reward``) and each scorer by name:
``eval/<name>/greedy`` (mean over prompts of the greedy completion's score),
``eval/<name>/accuracy`` (share of prompts whose greedy completion scores at least
``eval.pass_threshold``),
``eval/<name>/mean@n`` (mean over prompts and samples) and ``eval/<name>/pass@n`` (share of
prompts with a sample scoring at least ``eval.pass_threshold``), as verl reports
``mean@N`` and ``best@N``; and the greedy completions' length and clipped share.
"""

from __future__ import annotations

import torch

from protocols.messages import GroupKey, ScoredGroup
from yatt.errors import ProtocolError
from yatt.rl.config import EvalConfig

GREEDY, SAMPLED = 0, 1
"""``GroupKey.attempt`` of an eval key: its one greedy completion, or its eval.n sampled ones."""


def eval_key(version: int, mode: int, prompt_index: int, num_shards: int) -> GroupKey:
    """The key of held-out prompt ``prompt_index`` in the evaluation of ``version``."""
    return GroupKey(epoch=-(version + 1), shard=prompt_index % num_shards, prompt_index=prompt_index, attempt=mode)


def is_eval(key: GroupKey) -> bool:
    return key.epoch < 0


def eval_version(key: GroupKey) -> int:
    """The policy version an eval key evaluates."""
    return -key.epoch - 1


class EvalRound:
    """The groups of one evaluation (of policy ``version``) and the results so far."""

    def __init__(self, config: EvalConfig, *, version: int, num_prompts: int, num_shards: int) -> None:
        self.config = config
        self.version = version
        modes = ([GREEDY] if config.greedy else []) + ([SAMPLED] if config.n else [])
        self.keys = [eval_key(version, mode, i, num_shards) for mode in modes for i in range(num_prompts)]
        self._wanted = set(self.keys)
        self.results: dict[GroupKey, ScoredGroup] = {}

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.keys)

    def plan(self, shard: int) -> list[GroupKey]:
        """The keys of ``shard`` still without a result."""
        return [k for k in self.keys if k.shard == shard and k not in self.results]

    def offer(self, group: ScoredGroup) -> str:
        """Keep one result of this round: "evaluated", or "duplicate" for one it has; a
        group that is not of this round, or malformed, raises ``ProtocolError``."""
        key = group.group_key
        where = f"ScoredGroup {key.as_str()}"
        if key not in self._wanted:
            raise ProtocolError(f"{where}: not a key of the evaluation of version {self.version}")
        if key in self.results:
            return "duplicate"
        n = 1 if key.attempt == GREEDY else self.config.n
        if len(group.completion_ids) != n or tuple(group.rewards.shape) != (n,) or len(group.finish_reasons) != n:
            raise ProtocolError(f"{where}: an eval group of this kind has {n} samples, with a reward and a finish reason each")
        for name, values in [("rewards", group.rewards), *((f"scores[{s!r}]", v) for s, v in group.scores.items())]:
            if tuple(values.shape) != (n,) or not bool(torch.isfinite(values).all()):
                raise ProtocolError(f"{where}: {name} must be {n} finite numbers (got {values.tolist()})")
        self.results[key] = group
        return "evaluated"

    def report(self) -> tuple[dict[str, float], list[ScoredGroup]]:
        """The round's metrics and its greedy groups (sampled ones without greedy), by prompt."""
        ordered = sorted(self.results.items(), key=lambda kv: kv[0].prompt_index)
        greedy = [g for k, g in ordered if k.attempt == GREEDY]
        sampled = [g for k, g in ordered if k.attempt == SAMPLED]
        values = eval_metrics(greedy, sampled, n=self.config.n, threshold=self.config.pass_threshold)
        return values, greedy or sampled


def _named(group: ScoredGroup) -> dict[str, torch.Tensor]:
    """The reward mix and each scorer's raw scores of one group, by name ([n] each)."""
    return {"reward": group.rewards.float(), **{name: s.float() for name, s in sorted(group.scores.items())}}


def eval_metrics(greedy: list[ScoredGroup], sampled: list[ScoredGroup], *, n: int, threshold: float) -> dict[str, float]:
    """``eval/*`` of one round (see the module docstring): ``greedy`` holds one group of 1
    completion per prompt, ``sampled`` one group of ``n`` per prompt."""
    values: dict[str, float] = {"eval/prompts": float(len(greedy) or len(sampled))}
    if greedy:
        for name in _named(greedy[0]):
            scores = torch.stack([_named(g)[name][0] for g in greedy])  # [prompts]
            values[f"eval/{name}/greedy"] = float(scores.mean())
            values[f"eval/{name}/accuracy"] = float((scores >= threshold).float().mean())
        lengths = torch.tensor([float(len(g.completion_ids[0])) for g in greedy])
        values["eval/response_length/mean"] = float(lengths.mean())
        values["eval/response_length/clip_ratio"] = sum(g.finish_reasons[0] == "length" for g in greedy) / len(greedy)
    if sampled:
        for name in _named(sampled[0]):
            scores = torch.stack([_named(g)[name] for g in sampled])  # [prompts, n]
            values[f"eval/{name}/mean@{n}"] = float(scores.mean())
            values[f"eval/{name}/pass@{n}"] = float((scores >= threshold).any(dim=1).float().mean())
    groups = greedy + sampled
    samples = sum(len(g.completion_ids) for g in groups)
    values["eval/reward/failed_share"] = sum(bool(f) for g in groups for f in g.failures) / max(samples, 1)
    values["eval/policy_version"] = float(min(int(g.policy_versions.min()) for g in groups)) if groups else float("nan")
    return values
