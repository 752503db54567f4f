"""Where a run's per-step records go: rank 0 of the trainer writes them, once per step.

- ``metrics.jsonl``: one JSON line of scalars per step (``step`` first), and the same
  scalars as TensorBoard scalars in ``tensorboard/``.
- ``rollouts.jsonl``: a sample of the step's groups (``run.rollouts_per_step``), one line
  per completion: the prompt and the completion as text, the reward and each scorer's
  raw score, the advantage, the length, the finish reason and any scorer's failure; the
  same sample as a TensorBoard text table (``rollouts``). A broken reward shows here as
  what it is: text that reads right, scored 0, with the scorer's error beside it.
- ``eval.jsonl`` and ``eval_rollouts.jsonl``: the same for every evaluation (run.eval_every),
  ``step`` being the steps trained before it; eval/* scalars in TensorBoard and wandb.
- wandb (``run.report_to: [tensorboard, wandb]``, the ``wandb`` extra): the same scalars
  and the rollouts as a table, one wandb run per run dir (its id follows from the run
  dir, so a resumed run goes on in the same wandb run); ``WANDB_MODE=offline`` writes it
  under ``<run_dir>/wandb`` without a network, for ``wandb sync`` later.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from protocols.messages import ScoredGroup
from yatt.runtime import run_dir as names

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

TEXT_CHARS = 500
"""Prompt and completion text beyond this many characters is cut in the TensorBoard table."""


class RunLog:
    """Rank 0's sinks: metrics and rollouts of every step."""

    def __init__(
        self, run_dir: Path, tokenizer_path: str, *, report_to: Sequence[str] = ("tensorboard",),
        wandb_project: str = "yatt",
    ) -> None:
        self.run_dir = run_dir
        self._tokenizer_path = tokenizer_path
        self._tokenizer: Any = None
        self._report_to = set(report_to)
        self._wandb_project = wandb_project
        self._writer: SummaryWriter | None = None
        self._wandb: Any = None  # the wandb run, started at the first record

    def _wandb_run(self) -> Any:
        if self._wandb is None:
            import wandb

            config = self.run_dir / names.CONFIG
            self._wandb = wandb.init(
                project=self._wandb_project,
                name=self.run_dir.name,
                id=hashlib.sha1(str(self.run_dir.resolve()).encode()).hexdigest()[:16],
                resume="allow",
                dir=str(self.run_dir),
                config=yaml.safe_load(config.read_text()) if config.exists() else {},
            )
        return self._wandb

    def _tensorboard(self) -> SummaryWriter:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter as Writer

            self._writer = Writer(str(self.run_dir / names.TENSORBOARD))
        return self._writer

    def metrics(self, line: dict[str, float], *, kind: str = "metrics") -> None:
        """One step's scalars; ``line["step"]`` is the step; ``kind`` "eval" writes eval.jsonl."""
        with (self.run_dir / {"metrics": names.METRICS, "eval": names.EVAL}[kind]).open("a") as f:
            f.write(json.dumps(line) + "\n")
        step = int(line["step"])
        if "tensorboard" in self._report_to:
            writer = self._tensorboard()
            for key, value in line.items():
                if key != "step":
                    writer.add_scalar(key, value, step)
            writer.flush()
        if "wandb" in self._report_to:
            self._wandb_run().log({k: v for k, v in line.items() if k != "step"}, step=step)

    def rollouts(self, step: int, groups: list[ScoredGroup], *, kind: str = "") -> list[dict[str, Any]]:
        """Write one line per completion of ``groups`` and the TensorBoard table; returns the
        rows. ``kind`` "eval": an evaluation's, to eval_rollouts.jsonl and its own table."""
        name = f"{kind}_rollouts" if kind else "rollouts"
        if not groups:
            return []
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
        rows = [row for group in groups for row in self._rows(step, group)]
        with (self.run_dir / (names.EVAL_ROLLOUTS if kind else names.ROLLOUTS)).open("a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        if "tensorboard" in self._report_to:
            writer = self._tensorboard()
            writer.add_text(name, _table(rows), step)
            writer.flush()
        if "wandb" in self._report_to:
            import wandb

            fields = [c for c in rows[0] if c != "scores"]
            columns: list[str | int] = [*fields, *(f"score/{n}" for n in rows[0]["scores"])]
            # (an episode's turns as JSON text: a table cell holds one value)
            data = [[json.dumps(r[c]) if isinstance(r[c], list) else r[c] for c in fields] + list(r["scores"].values()) for r in rows]
            self._wandb_run().log({name: wandb.Table(columns=columns, data=data)}, step=step)
        return rows

    def _rows(self, step: int, group: ScoredGroup) -> list[dict[str, Any]]:
        decode = self._tokenizer.decode
        prompt = str(decode(group.prompt_ids.tolist(), skip_special_tokens=True))
        rows = []
        for i, ids in enumerate(group.completion_ids):
            rows.append({
                "step": step,
                "group": group.group_key.as_str(),
                "sample": i,
                "prompt": prompt,
                "completion": str(decode(ids.tolist(), skip_special_tokens=True)),
                "reward": float(group.rewards[i]),
                "scores": {name: float(values[i]) for name, values in group.scores.items()},
                "advantage": float(group.advantages[i]),
                "length": len(ids),
                "finish_reason": group.finish_reasons[i],
                "failure": group.failures[i] if group.failures else "",
                "policy_version": int(group.policy_versions[i]),
            })  # fmt: skip
            if group.episodes:
                rows[-1].update(self._episode(group, i))
        return rows

    def _episode(self, group: ScoredGroup, i: int) -> dict[str, Any]:
        """An episode's turns (each its action, the observation after it, the environment's
        reward; ``row``: which of the sample's rows, 0 the first, k its k-th fork) and how it
        ended, from each row's spans: the policy's (mask 1) and the observations (mask 0)."""
        info = group.episodes[i]
        rows = [(group.completion_ids[i], group.completion_masks[i])]
        rows += [(f.completion_ids, f.completion_mask) for f in group.forked if f.sample == i]
        turns: list[dict[str, Any]] = []
        for r, (ids, mask) in enumerate(rows):
            turns += [{**turn, "row": r} for turn in self._turns(ids.tolist(), mask.tolist())]
        for turn, reward in zip(turns, info.turn_rewards, strict=False):
            turn["reward"] = None if math.isnan(reward) else reward
        return {"turns": turns, "rows": len(rows), "ended": info.ended, "tool_errors": info.tool_errors, "ended_detail": info.detail}

    def _turns(self, ids: list[int], mask: list[bool]) -> list[dict[str, Any]]:
        """One row's turns: each its action and the observation after it."""
        spans: list[tuple[bool, list[int]]] = []
        for token, own in zip(ids, mask, strict=True):
            if spans and spans[-1][0] == own:
                spans[-1][1].append(token)
            else:
                spans.append((own, [token]))
        turns: list[dict[str, Any]] = []
        for own, span in spans:
            text = str(self._tokenizer.decode(span, skip_special_tokens=not own))
            if own:
                turns.append({"action": text, "observation": ""})
            elif turns:
                turns[-1]["observation"] = text
        return turns

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            self._wandb = None
            # finish() only informs wandb's service that the run is done; its record log
            # (run-*.wandb) is flushed when the service closes the run's stream, so wait for
            # the service here: what close() returns after is on disk for `wandb sync`.
            wandb.teardown()


def _table(rows: list[dict[str, Any]]) -> str:
    """A markdown table (TensorBoard renders it) of the rows' text and scores."""
    def cell(text: object) -> str:
        value = str(text)
        value = value if len(value) <= TEXT_CHARS else value[:TEXT_CHARS] + "..."
        return value.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| prompt | completion | reward | scores | advantage | length | finish | failure |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        scores = ", ".join(f"{k}={v:.3g}" for k, v in r["scores"].items())
        completion = r["completion"]
        if "turns" in r:  # an episode: each turn's action, observation and reward, and how it ended
            completion = "\n".join(
                f"[turn {i + 1}] {t['action']} -> {t['observation'].strip()} (reward {t.get('reward')})"
                for i, t in enumerate(r["turns"])
            ) + f"\n[ended: {r['ended']}{': ' + r['ended_detail'] if r['ended_detail'] else ''}]"
        lines.append(
            f"| {cell(r['prompt'])} | {cell(completion)} | {r['reward']:.3g} | {cell(scores)} | "
            f"{r['advantage']:.3g} | {r['length']} | {r['finish_reason']} | {cell(r['failure'])} |"
        )
    return "\n".join(lines)
