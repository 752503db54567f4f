"""Prompt sources: every source gives the right prompts as token ids, with their metadata;
the built-in rewards give hand-computed values; bad configs name the dotted field."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import reasoning_gym
from transformers import AutoTokenizer

from workers.models import build_tokenizer
from yatt.errors import ConfigError
from yatt.rl.config import DataConfig
from yatt.rl.data import (
    PROMPT_SETS_FILE,
    Prompt,
    _json_safe,
    load_prompt_sets,
    load_prompts,
    read_prompt_sets,
    write_prompt_sets,
)
from yatt.rl.tasks import (
    TASKS,
    addition_reward,
    digits_prompts,
    digits_reward,
    reasoning_gym_reward,
    repeated_prompts,
    repeated_reward,
    score_reasoning_gym,
)
from yatt.runtime.configtools import build


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_model_dir: Path) -> str:
    """The tiny model's tokenizer (byte-level BPE with a chat template)."""
    return str(tiny_model_dir)


@pytest.fixture(scope="module")
def plain_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same tokenizer without a chat template."""
    out = tmp_path_factory.mktemp("plain_tokenizer")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(out)
    return str(out)


def decode(tokenizer_dir: str, prompt: Prompt) -> str:
    return str(AutoTokenizer.from_pretrained(tokenizer_dir).decode(prompt.prompt_ids))


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


ROWS: list[dict[str, object]] = [
    {"prompt": f"What is {i} + 1?", "answer": i + 1, "level": i % 3, "source": "unit", "tags": ["a", "b"]}
    for i in range(5)
]


# --- synthetic -----------------------------------------------------------------------------


def test_synthetic_prompts_are_templated_token_ids(tokenizer_dir: str) -> None:
    prompts = load_prompts(DataConfig(num_prompts=20, seed=3), tokenizer_dir)
    assert [p.index for p in prompts] == list(range(20))
    for p in prompts:
        a, b = map(int, re.fullmatch(r"What is (\d) \+ (\d)\?", p.text).groups())  # type: ignore[union-attr]
        assert p.metadata == {"answer": str(a + b)}
        assert decode(tokenizer_dir, p) == f"<|user|>{p.text}\n<|assistant|>"


def test_synthetic_prompts_follow_the_seed(tokenizer_dir: str) -> None:
    assert digits_prompts(50, 1) == digits_prompts(50, 1)
    assert digits_prompts(50, 1) != digits_prompts(50, 2)
    first = load_prompts(DataConfig(num_prompts=8, seed=1), tokenizer_dir)
    assert first == load_prompts(DataConfig(num_prompts=8, seed=1), tokenizer_dir)


def test_a_held_out_split_never_shares_a_prompt_with_training(tokenizer_dir: str) -> None:
    config = DataConfig(num_prompts=300, seed=2, eval_split=20)  # 300 sums of digits: ~100 distinct
    train, held = load_prompt_sets(config, tokenizer_dir)
    assert len(held) == 20 and len({p.text for p in held}) == 20
    assert not {p.text for p in held} & {p.text for p in train}, "a held-out prompt is trained on"
    everything = load_prompts(DataConfig(num_prompts=300, seed=2), tokenizer_dir)
    assert len(train) == sum(p.text not in {h.text for h in held} for p in everything) < 300
    assert [p.index for p in train] == list(range(len(train))) and [p.index for p in held] == list(range(20))
    assert load_prompts(config, tokenizer_dir) == train and load_prompt_sets(config, tokenizer_dir) == (train, held)
    assert len(load_prompt_sets(dataclasses.replace(config, eval_split=0.1), tokenizer_dir)[1]) == 10  # of ~100 distinct
    with pytest.raises(ConfigError, match="leave some to train on"):
        load_prompt_sets(dataclasses.replace(config, eval_split=500), tokenizer_dir)


def test_the_launchers_prompt_sets_are_what_the_roles_read(tokenizer_dir: str, tmp_path: Path) -> None:
    """The launcher writes the tokenised sets once; a role reads them back equal, and only
    for the data config and tokenizer they were made from."""
    from launch.config import load_run_config
    from launch.role import _prompt_sets

    config = DataConfig(num_prompts=50, seed=2, eval_split=5)
    sets = load_prompt_sets(config, tokenizer_dir)
    path = tmp_path / PROMPT_SETS_FILE
    write_prompt_sets(path, config, tokenizer_dir, sets)
    assert read_prompt_sets(path, config, tokenizer_dir) == sets
    assert read_prompt_sets(path, dataclasses.replace(config, seed=3), tokenizer_dir) is None
    assert read_prompt_sets(path, config, tokenizer_dir + "/") is None
    assert read_prompt_sets(tmp_path / "missing", config, tokenizer_dir) is None
    # A role takes the file's prompts as they are (it does not tokenise again)...
    run = dataclasses.replace(load_run_config(None), data=config)
    marked = ([dataclasses.replace(p, text="from the file") for p in sets[0]], sets[1])
    write_prompt_sets(path, config, tokenizer_dir, marked)
    assert _prompt_sets(run, tmp_path, Path(tokenizer_dir)) == marked
    # ...and tokenises them itself without one.
    path.unlink()
    assert _prompt_sets(run, tmp_path, Path(tokenizer_dir)) == sets


def test_eval_prompts_from_a_file_use_the_data_fields(tokenizer_dir: str, tmp_path: Path) -> None:
    path = tmp_path / "held.jsonl"
    path.write_text("".join(json.dumps({"q": f"What is {i} + 1?", "a": str(i + 1)}) + "\n" for i in range(3)))
    config = DataConfig(num_prompts=10, prompt_field="q", answer_field="a", eval_path=str(path))
    train, held = load_prompt_sets(config, tokenizer_dir)
    assert len(train) == 10 and [p.metadata["answer"] for p in held] == ["1", "2", "3"]
    with pytest.raises(ConfigError, match="eval_split"):
        DataConfig(eval_split=0.5, eval_path=str(path))
    with pytest.raises(ConfigError, match="eval_split"):
        DataConfig(eval_split=2.5)


def test_every_task_makes_answers_its_reward_accepts() -> None:
    for name, task in TASKS.items():
        examples = task.make_prompts(10, 0)
        assert len(examples) == 10, name
        for text, metadata in examples:
            assert task.reward(text, metadata["answer"], metadata) == 1.0, name
            assert task.reward(text, "no idea", metadata) == 0.0, name


def test_default_count_and_system_prompt(tokenizer_dir: str) -> None:
    prompts = load_prompts(DataConfig(task="addition", system_prompt="Be brief."), tokenizer_dir)
    assert len(prompts) == 1000
    assert (
        decode(tokenizer_dir, prompts[0]) == f"<|system|>Be brief.\n<|user|>{prompts[0].text}\n<|assistant|>"
    )


def test_plain_encoding_without_template(tokenizer_dir: str, plain_tokenizer_dir: str) -> None:
    off = load_prompts(DataConfig(num_prompts=3, apply_chat_template=False), tokenizer_dir)
    assert [decode(tokenizer_dir, p) for p in off] == [p.text for p in off]
    # A tokenizer without a template falls back to plain text too.
    none = load_prompts(DataConfig(num_prompts=3, system_prompt="S"), plain_tokenizer_dir)
    assert [decode(plain_tokenizer_dir, p) for p in none] == [f"S\n\n{p.text}" for p in none]


# --- jsonl and parquet -------------------------------------------------------------------------


def test_jsonl_rows_and_metadata(tmp_path: Path, tokenizer_dir: str) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    prompts = load_prompts(DataConfig(source="jsonl", path=str(path)), tokenizer_dir)
    assert len(prompts) == 5
    for i, p in enumerate(prompts):
        assert p.text == f"What is {i} + 1?"
        assert decode(tokenizer_dir, p) == f"<|user|>What is {i} + 1?\n<|assistant|>"
        # Scalars become strings; the list field is left out.
        assert p.metadata == {"answer": str(i + 1), "level": str(i % 3), "source": "unit"}
    first = load_prompts(DataConfig(source="jsonl", path=str(path), num_prompts=2), tokenizer_dir)
    assert first == prompts[:2]


def test_jsonl_directory_is_read_in_name_order(tmp_path: Path, tokenizer_dir: str) -> None:
    write_jsonl(tmp_path / "b.jsonl", ROWS[3:])
    write_jsonl(tmp_path / "a.jsonl", ROWS[:3])
    (tmp_path / "notes.txt").write_text("not data")
    prompts = load_prompts(DataConfig(source="jsonl", path=str(tmp_path)), tokenizer_dir)
    assert [p.text for p in prompts] == [str(r["prompt"]) for r in ROWS]


def test_jsonl_chat_messages_prompt(tmp_path: Path, tokenizer_dir: str) -> None:
    messages = [{"role": "system", "content": "Answer in digits."}, {"role": "user", "content": "2 + 2?"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": messages, "answer": "4"}])
    config = DataConfig(source="jsonl", path=str(path), system_prompt="ignored: the row has its own")
    [p] = load_prompts(config, tokenizer_dir)
    assert decode(tokenizer_dir, p) == "<|system|>Answer in digits.\n<|user|>2 + 2?\n<|assistant|>"
    assert p.text == "Answer in digits.\n\n2 + 2?"
    assert p.metadata == {"answer": "4"}


def test_parquet_with_custom_fields(tmp_path: Path, tokenizer_dir: str) -> None:
    table = pa.table(
        {"question": ["Spell cat.", "Spell dog."], "solution": ["c a t", "d o g"], "score": [0.5, 1.0]}
    )
    pq.write_table(table, tmp_path / "data.parquet")
    config = DataConfig(
        source="parquet",
        path=str(tmp_path / "data.parquet"),
        prompt_field="question",
        answer_field="solution",
    )
    prompts = load_prompts(config, tokenizer_dir)
    assert [p.text for p in prompts] == ["Spell cat.", "Spell dog."]
    assert decode(tokenizer_dir, prompts[1]) == "<|user|>Spell dog.\n<|assistant|>"
    assert prompts[0].metadata == {"answer": "c a t", "solution": "c a t", "score": "0.5"}


def test_verl_style_parquet_with_nested_fields_by_dotted_path(tmp_path: Path, tokenizer_dir: str) -> None:
    """verl's gsm8k parquet layout: chat messages, the answer under reward_model.ground_truth."""
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "2 + 70?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "72"},
            "extra_info": {"index": 0, "split": "train"},
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    config = DataConfig(path=str(tmp_path / "train.parquet"), answer_field="reward_model.ground_truth")
    [p] = load_prompts(config, tokenizer_dir)
    assert p.text == "2 + 70?"
    assert p.metadata == {
        "answer": "72", "data_source": "openai/gsm8k", "ability": "math", "reward_model.style": "rule",
        "reward_model.ground_truth": "72", "extra_info.index": "0", "extra_info.split": "train",
    }
    wrong = DataConfig(path=str(tmp_path / "train.parquet"), answer_field="reward_model.truth")
    with pytest.raises(ConfigError, match=r"data\.answer_field = 'reward_model\.truth': row 0 has no 'truth' there"):
        load_prompts(wrong, tokenizer_dir)


def test_data_without_answers(tmp_path: Path, tokenizer_dir: str) -> None:
    path = write_jsonl(tmp_path / "open.jsonl", [{"prompt": "Write a haiku."}])
    [p] = load_prompts(DataConfig(source="jsonl", path=str(path), answer_field=""), tokenizer_dir)
    assert p.metadata == {}


# --- reasoning-gym ----------------------------------------------------------------------------


def test_reasoning_gym_entries_round_trip(tokenizer_dir: str) -> None:
    config = DataConfig(source="reasoning_gym", task="basic_arithmetic", num_prompts=4, seed=7)
    prompts = load_prompts(config, tokenizer_dir)
    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=4, seed=7))
    assert len(prompts) == 4
    for p, entry in zip(prompts, entries, strict=True):
        assert p.text == entry["question"] + config.instruction
        assert decode(tokenizer_dir, p) == f"<|user|>{p.text}\n<|assistant|>"
        assert p.metadata["task"] == "basic_arithmetic"
        assert p.metadata["answer"] == str(entry["answer"])
        # The entry survives JSON (its tuples come back as lists).
        assert json.loads(p.metadata["entry"]) == json.loads(json.dumps(entry))
        assert score_reasoning_gym(p.metadata["answer"], p.metadata) == 1.0
        assert score_reasoning_gym("not a number", p.metadata) == 0.0
        answer = p.metadata["answer"]
        assert reasoning_gym_reward(p.text, f"Let me think.\n<answer>{answer}</answer>", p.metadata) == 1.0
        assert reasoning_gym_reward(p.text, answer, p.metadata) == 0.0  # no tags: nothing to score


def test_json_safe_makes_plain_data() -> None:
    value = {"t": (1, 2), "s": {3}, 4: np.int64(5), "a": np.array([1.5]), "f": math.inf, "o": Path("x")}
    assert _json_safe(value) == {"t": [1, 2], "s": [3], "4": 5, "a": [1.5], "f": "inf", "o": "x"}


# --- rewards ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("12", "12", 1.0),
        (" 12 and more text", "12", 1.0),
        ("13", "12", 0.2 + 0.8 * 1 / 2),
        ("123", "12", 0.2 + 0.8 * 2 / 3),
        ("7", "12", 0.2),
        ("1", "12", 0.2 + 0.8 * 1 / 2),
        ("77", "7", 0.2 + 0.8 * 1 / 2),
        ("the answer is 12", "12", 0.0),
        ("", "12", 0.0),
    ],
)
def test_digits_reward(completion: str, answer: str, expected: float) -> None:
    assert digits_reward("What is 5 + 7?", completion, {"answer": answer}) == pytest.approx(expected)


def test_the_repeated_digit_task_is_a_rule_with_one_answer() -> None:
    """Four digits, three distinct, the fourth a copy of one of them: the answer is that
    one; thousands of distinct lists (a held-out 100 are lists never trained on)."""
    examples = repeated_prompts(2000, 0)
    assert examples == repeated_prompts(2000, 0) != repeated_prompts(2000, 1)
    for text, metadata in examples:
        digits = re.fullmatch(r"Which digit repeats: (\d) (\d) (\d) (\d)\?", text).groups()  # type: ignore[union-attr]
        assert len(set(digits)) == 3
        assert [d for d in set(digits) if digits.count(d) == 2] == [metadata["answer"]]
    assert len({text for text, _ in examples}) > 1500
    assert {metadata["answer"] for _, metadata in examples} == set("0123456789")


@pytest.mark.parametrize(("completion", "expected"), [("7", 1.0), (" 7 ", 1.0), ("3", 0.0), ("77", 0.0), ("7.", 0.0), ("", 0.0)])
def test_repeated_reward_is_exact_match(completion: str, expected: float) -> None:
    assert repeated_reward("Which digit repeats: 3 7 1 7?", completion, {"answer": "7"}) == expected


@pytest.mark.parametrize(
    ("completion", "expected"),
    [("23 + 45 = 68", 1.0), ("68", 1.0), ("68 or 69", 0.0), ("sixty-eight", 0.0), ("168", 0.0)],
)
def test_addition_reward(completion: str, expected: float) -> None:
    assert addition_reward("What is 23 + 45?", completion, {"answer": "68"}) == expected


# --- bad configs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"source": "jsonl"}, r"^data\.path is required for source jsonl"),
        ({"task": "sums"}, r"^data\.task must be a built-in task: one of addition, calculator, count_red, digits, guess, repeated \(got 'sums'\)"),
        ({"source": "reasoning_gym", "task": ""}, r"^data\.task is required for source reasoning_gym"),
        ({"num_prompts": -1}, r"^data\.num_prompts must be >= 0 \(got -1\)"),
        ({"max_prompt_tokens": -2}, r"^data\.max_prompt_tokens must be >= 0"),
        ({"source": "csv"}, r"^data\.source must be one of"),
    ],
)
def test_bad_config_values(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(DataConfig, data, "data")


def test_bad_data_names_the_field(tmp_path: Path, tokenizer_dir: str) -> None:
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    cases: list[tuple[DataConfig, str]] = [
        (
            DataConfig(source="jsonl", path=str(tmp_path / "missing.jsonl")),
            r"data\.path = '.*missing\.jsonl' does not exist",
        ),
        (DataConfig(source="parquet", path=str(tmp_path)), r"data\.path = '.*' holds no \.parquet files"),
        (
            DataConfig(source="jsonl", path=str(path), prompt_field="question"),
            r"data\.prompt_field = 'question' is not a column of .* \(columns: prompt, answer, level, source, tags\)",
        ),
        (
            DataConfig(source="jsonl", path=str(path), answer_field="label"),
            r"data\.answer_field = 'label' is not a column .* set data\.answer_field: '' for data without answers",
        ),
        (
            DataConfig(source="jsonl", path=str(path), num_prompts=6),
            r"data\.num_prompts = 6, but .* has only 5 rows",
        ),
        (
            DataConfig(source="jsonl", path=str(path), max_prompt_tokens=5),
            r"data\.max_prompt_tokens = 5, but prompt 0 has \d+ tokens",
        ),
        (
            DataConfig(source="reasoning_gym", task="basic_arithmetc", num_prompts=2),
            r"data\.task = 'basic_arithmetc' is not a reasoning-gym dataset; did you mean basic_arithmetic",
        ),
    ]
    for config, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_prompts(config, tokenizer_dir)


def test_bad_rows_name_the_field(tmp_path: Path, tokenizer_dir: str) -> None:
    numbers = write_jsonl(tmp_path / "numbers.jsonl", [{"prompt": 3, "answer": 1}])
    with pytest.raises(ConfigError, match=r"data\.prompt_field = 'prompt': row 0 holds int"):
        load_prompts(DataConfig(source="jsonl", path=str(numbers)), tokenizer_dir)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "ok", "answer": 1}\n{"prompt": \n')
    with pytest.raises(ConfigError, match=r"data\.path = '.*broken\.jsonl' cannot be read as jsonl"):
        load_prompts(DataConfig(source="jsonl", path=str(broken)), tokenizer_dir)


def test_missing_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"the tokenizer directory '.*nowhere' does not exist"):
        load_prompts(DataConfig(num_prompts=1), str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match=r"cannot load a tokenizer from '.*'"):
        load_prompts(DataConfig(num_prompts=1), str(tmp_path))


def test_a_path_implies_a_file_source_and_a_hub_id_is_refused_with_what_to_do(tmp_path: Path) -> None:
    from launch.config import load_run_config

    assert load_run_config(None, [f"data.path={tmp_path / 'd.jsonl'}"]).data.source == "jsonl"
    assert load_run_config(None, [f"data.path={tmp_path / 'd.parquet'}"]).data.source == "parquet"
    with pytest.raises(ConfigError, match=r"data\.source.*is synthetic, but data\.path = .* is set"):
        load_run_config(None, [f"data.path={tmp_path}"])
    with pytest.raises(ConfigError, match="runs do not download .*huggingface-cli download --repo-type dataset openai/gsm8k"):
        load_prompts(DataConfig(source="jsonl", path="openai/gsm8k"), str(tmp_path))
