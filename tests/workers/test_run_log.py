"""Rank 0's sinks: metrics.jsonl, rollouts.jsonl as text, TensorBoard scalars and text,
and wandb (offline) with the same scalars and the rollouts as a table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoTokenizer

from protocols.messages import GroupKey, ScoredGroup
from workers.run_log import RunLog


def group(tokenizer_dir: Path) -> ScoredGroup:
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = [torch.tensor(tok.encode(text, add_special_tokens=False), dtype=torch.int32) for text in ("12", "7 | x\ny")]
    return ScoredGroup(
        group_key=GroupKey(epoch=0, shard=1, prompt_index=5),
        prompt_ids=torch.tensor(tok.encode("What is 5 + 7?", add_special_tokens=False), dtype=torch.int32),
        completion_ids=ids,
        rollout_logprobs=[torch.zeros(len(i)) for i in ids],
        rewards=torch.tensor([1.0, 0.0]),
        advantages=torch.tensor([0.7, -0.7]),
        policy_versions=torch.tensor([3, 3]),
        finish_reasons=["stop", "length"],
        scores={"digits": torch.tensor([1.0, 0.0])},
        failures=["", "digits: ValueError: boom"],
    )


def test_metrics_and_rollouts_reach_every_sink(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "config.yaml").write_text("run:\n  steps: 4\n")
    log = RunLog(tmp_path, str(tiny_model_dir), report_to=["tensorboard", "wandb"])
    try:
        log.metrics({"step": 3.0, "reward/mean": 0.5, "response_length/mean": 2.5})
        rows = log.rollouts(3, [group(tiny_model_dir)])
    finally:
        log.close()

    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 3.0, "reward/mean": 0.5, "response_length/mean": 2.5}
    ]
    written = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert written == rows and len(rows) == 2
    assert rows[0]["prompt"] == "What is 5 + 7?" and rows[0]["completion"] == "12"
    assert rows[1] == {
        "step": 3, "group": "e0/s1/p5/a0", "sample": 1, "prompt": "What is 5 + 7?", "completion": "7 | x\ny",
        "reward": 0.0, "scores": {"digits": 0.0}, "advantage": pytest.approx(-0.7), "length": rows[1]["length"],
        "finish_reason": "length", "failure": "digits: ValueError: boom", "policy_version": 3,
    }

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(3, 0.5)]
    [text] = events.Tensors("rollouts/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert "What is 5 + 7?" in table and "7 \\| x<br>y" in table and "digits: ValueError: boom" in table

    [run] = (tmp_path / "wandb").glob("offline-run-*")
    [media] = (run / "files" / "media" / "table").glob("rollouts_3_*.table.json")
    logged = json.loads(media.read_text())
    assert logged["columns"][-1] == "score/digits" and logged["data"][1][logged["columns"].index("completion")] == "7 | x\ny"
    history = next(run.glob("run-*.wandb")).read_bytes()  # wandb's record log: the scalars are in it
    assert b"reward/mean" in history and b"response_length/mean" in history


def test_an_episodes_turns_are_in_the_rollouts_and_the_text_tab(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A multi-turn group: each row shows every turn (action, observation, reward, which of
    the sample's rows it is in) and how the episode ended, in rollouts.jsonl and in
    TensorBoard's text tab; sample 1's third turn forked a row."""
    import dataclasses

    from protocols.messages import EpisodeInfo, ForkedRow

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = group(tiny_model_dir)
    parts = [tok.encode(t, add_special_tokens=False) for t in ("3", "\n<|user|>Higher.\n<|assistant|>", "5")]
    ids = torch.tensor([t for p in parts for t in p], dtype=torch.int32)
    mask = torch.tensor([True] * len(parts[0]) + [False] * len(parts[1]) + [True] * len(parts[2]))
    episode = dataclasses.replace(
        base, completion_ids=[ids, ids], rollout_logprobs=[torch.zeros(len(ids))] * 2, completion_masks=[mask, mask],
        token_versions=[torch.zeros(len(ids), dtype=torch.int64)] * 2,
        episodes=[EpisodeInfo(ended="done", turns=2, turn_rewards=[0.0, 1.0], tool_errors=0),
                  EpisodeInfo(ended="done", turns=3, turn_rewards=[0.0, 0.0, 1.0], tool_errors=0)],
        forked=[ForkedRow(sample=1, prompt_ids=ids, completion_ids=ids[:1], completion_mask=mask[:1],
                          rollout_logprobs=torch.zeros(1), token_versions=torch.zeros(1, dtype=torch.int64),
                          advantages=torch.zeros(1))],
    )  # fmt: skip
    log = RunLog(tmp_path, str(tiny_model_dir), report_to=["tensorboard"])
    try:
        rows = log.rollouts(0, [episode])
    finally:
        log.close()
    assert rows[0]["turns"] == [
        {"action": "3", "observation": "\n<|user|>Higher.\n<|assistant|>", "reward": 0.0, "row": 0},
        {"action": "5", "observation": "", "reward": 1.0, "row": 0},
    ]
    assert rows[0]["ended"] == "done" and rows[0]["tool_errors"] == 0 and rows[0]["rows"] == 1
    assert [(t["action"], t["row"], t["reward"]) for t in rows[1]["turns"]] == [("3", 0, 0.0), ("5", 0, 0.0), ("3", 1, 1.0)]
    assert rows[1]["rows"] == 2
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    [text] = events.Tensors("rollouts/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert "[turn 1] 3 -> " in table and "Higher." in table and "[turn 2] 5 -> " in table, table
    assert "[ended: done]" in table

