"""The default job's warm start: supervised steps on reference answers, in place."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from launch.config import load_run_config
from workers.models import WARM_START_FILE, warm_start
from yatt.rl.data import load_prompt_sets


def _greedy_answers(model_dir: Path, prompts: list[list[int]]) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir)  # (transformers' generate is typed for mixins)
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            generated = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, pad_token_id=0)
            out.append(str(tokenizer.decode(generated[0, len(ids):], skip_special_tokens=True)).strip())
    return out


def test_warm_start_teaches_the_answers_and_records_itself(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    train, _ = load_prompt_sets(load_run_config(None).data, str(model_dir))
    examples = [(p.prompt_ids, p.metadata["answer"]) for p in train[:8]]  # 8 sums, learnt by heart
    before = _greedy_answers(model_dir, [ids for ids, _ in examples])
    done = warm_start(model_dir, examples, steps=60, lr=3e-3, seed=0, batch=8)
    after = _greedy_answers(model_dir, [ids for ids, _ in examples])
    answers = [answer for _, answer in examples]
    assert sum(a == b for a, b in zip(before, answers, strict=True)) <= 1  # the random model
    assert sum(a == b for a, b in zip(after, answers, strict=True)) >= 6, (after, answers)
    assert done["loss_last"] < done["loss_first"] / 4
    assert json.loads((model_dir / WARM_START_FILE).read_text())["steps"] == 60
    with pytest.raises(ValueError, match="steps >= 1"):
        warm_start(model_dir, examples, steps=0, lr=3e-3, seed=0)
