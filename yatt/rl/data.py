"""The prompt sources of the RL loop: every prompt of the run, as token ids, once.

Each controller owns one data shard (prompt ``i`` belongs to shard ``i % S``) and visits
its prompts in the seeded per-epoch order of ``yatt.rl.sampling.epoch_order``, so every
controller loads the same full list, deterministically::

    synthetic      yatt.rl.tasks.TASKS[task].make_prompts(n, seed)  --+
    reasoning_gym  reasoning_gym.create_dataset(task, n, seed)    --+--> (messages, text, metadata)
    jsonl/parquet  datasets.load_dataset(<local files>)           --+            |
                                                     chat template (or plain encode), length check
                                                                                  v
                                                  Prompt(index, prompt_ids, text, metadata)

Prompts are tokenised here and never again: the launcher tokenises and checks them once
and writes them to the run dir (``write_prompt_sets``), each role process reads them back;
the generator gets ``prompt_ids`` and the trainer trains on the same ids (token in, token
out). ``text`` is kept for judges and logs.
transformers, datasets and reasoning_gym are imported inside the functions that need them,
so importing yatt stays light (tests/yatt/test_imports.py).
"""

from __future__ import annotations

import difflib
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeAlias, cast

import numpy as np

from yatt.errors import ConfigError, storage_error
from yatt.rl.config import DataConfig
from yatt.rl.tasks import TASKS

log = logging.getLogger(__name__)

Messages: TypeAlias = list[dict[str, str]]
Json: TypeAlias = "None | bool | int | float | str | list[Json] | dict[str, Json]"

DEFAULT_GENERATED = 1000
"""How many prompts a generated source (synthetic, reasoning_gym) makes when num_prompts is 0."""

_TOKENIZE_CHUNK = 512
"""Prompts rendered and tokenised per tokenizer call (one batched call is much faster than n)."""


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """One prompt of the dataset, ready for the generator."""

    index: int
    """Position in the dataset (0..N-1); the shard is index % num_shards."""
    prompt_ids: list[int]
    """Token ids, chat template applied; never re-tokenised later."""
    text: str
    """The prompt text shown to the model, without the template (for judges and logs)."""
    metadata: dict[str, str]
    """Reference data for the scorers, e.g. {"answer": "42"}; strings only."""


@dataclass(frozen=True)
class _Example:
    """A prompt before tokenisation."""

    messages: Messages
    text: str
    metadata: dict[str, str]


def load_prompts(config: DataConfig, tokenizer_path: str) -> list[Prompt]:
    """Every training prompt of the run, tokenised with the tokenizer at ``tokenizer_path``
    (without those ``data.eval_split`` holds out)."""
    prompts = _load(config, tokenizer_path)
    return _split(config, prompts)[0] if config.eval_split else prompts


def load_prompt_sets(config: DataConfig, tokenizer_path: str) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, held-out prompts of evaluation): those ``data.eval_split`` holds
    out of the data, or ``data.eval_path``'s; no held-out prompts without either."""
    prompts = _load(config, tokenizer_path)
    if config.eval_split:
        return _split(config, prompts)
    return prompts, _load(config.eval_source(), tokenizer_path) if config.eval_path else []


PROMPT_SETS_FILE = "prompts.msgpack"
"""The run's tokenised prompt sets in its run dir, written by the launcher once it has read
and checked them; each role process reads them instead of tokenising again (a cold start
without transformers' tokenizer import: ~4 s less per buffer or controller start here)."""


def write_prompt_sets(path: Path, config: DataConfig, tokenizer_path: str, sets: tuple[list[Prompt], list[Prompt]]) -> None:
    """``sets`` (``load_prompt_sets(config, tokenizer_path)``) to ``path``, atomically, keyed
    by what they were made from. ``StorageError`` (the path, the free space there) when the
    write fails; nothing of it is left behind."""
    import msgpack

    rows = [[[p.index, p.prompt_ids, p.text, p.metadata] for p in prompts] for prompts in sets]
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(msgpack.packb({"key": [repr(config), tokenizer_path], "sets": rows}))
        tmp.replace(path)
    except OSError as e:
        tmp.unlink(missing_ok=True)  # a part written to a full disk is space the user needs back
        raise storage_error(path, e) from e


def read_prompt_sets(path: Path, config: DataConfig, tokenizer_path: str) -> tuple[list[Prompt], list[Prompt]] | None:
    """The prompt sets ``write_prompt_sets`` wrote for this ``config`` and tokenizer; None when
    there are none, or they were made from another."""
    import msgpack

    try:
        saved = msgpack.unpackb(path.read_bytes())
    except (OSError, ValueError, msgpack.UnpackException):
        return None
    if not isinstance(saved, dict) or saved.get("key") != [repr(config), tokenizer_path]:
        return None
    train, held = ([Prompt(index=i, prompt_ids=ids, text=text, metadata=meta) for i, ids, text, meta in rows] for rows in saved["sets"])
    return train, held


def _split(config: DataConfig, prompts: list[Prompt]) -> tuple[list[Prompt], list[Prompt]]:
    """(training, held out): ``data.eval_split`` of the distinct prompts, drawn with
    ``data.seed``; a training row that repeats a held-out prompt (a generated task can) is
    left out, so evaluation never sees a prompt the policy trained on. Both re-indexed."""
    distinct = list({tuple(p.prompt_ids): p for p in reversed(prompts)}.values())[::-1]  # first of each
    count = round(config.eval_split * len(distinct)) if config.eval_split < 1 else int(config.eval_split)
    count = max(count, 1)
    if count >= len(distinct):
        raise ConfigError(
            f"data.eval_split = {config.eval_split} holds out {count} of the {len(distinct)} distinct prompts; "
            "leave some to train on (a smaller share or count)"
        )
    chosen = np.random.default_rng([config.seed, 1]).choice(len(distinct), size=count, replace=False)
    held = [distinct[i] for i in sorted(int(i) for i in chosen)]
    held_ids = {tuple(p.prompt_ids) for p in held}
    train = [p for p in prompts if tuple(p.prompt_ids) not in held_ids]
    return _reindexed(train), _reindexed(held)


def _reindexed(prompts: list[Prompt]) -> list[Prompt]:
    return [replace(p, index=i) for i, p in enumerate(prompts)]


def _load(config: DataConfig, tokenizer_path: str) -> list[Prompt]:
    if config.source == "synthetic":
        examples = _synthetic(config)
    elif config.source == "reasoning_gym":
        examples = _reasoning_gym(config)
    else:
        examples = _table(config)
    if not examples:
        where = f"data.path = {config.path!r}" if config.path else f"data.source = {config.source!r}"
        raise ConfigError(f"{where} yields no prompts; give a dataset with at least one row")
    ids = _tokenize(examples, config, tokenizer_path)
    prompts = []
    for index, (example, prompt_ids) in enumerate(zip(examples, ids, strict=True)):
        if config.max_prompt_tokens and len(prompt_ids) > config.max_prompt_tokens:
            raise ConfigError(
                f"data.max_prompt_tokens = {config.max_prompt_tokens}, but prompt {index} has "
                f"{len(prompt_ids)} tokens ({example.text[:80]!r}...); raise the limit or remove the prompt"
            )
        prompts.append(
            Prompt(index=index, prompt_ids=prompt_ids, text=example.text, metadata=example.metadata)
        )
    return prompts


def _messages(config: DataConfig, user: Messages) -> Messages:
    """The conversation: the configured system prompt (if any) and the prompt's messages."""
    has_system = any(m["role"] == "system" for m in user)
    system = (
        [{"role": "system", "content": config.system_prompt}]
        if config.system_prompt and not has_system
        else []
    )
    return system + user


def _synthetic(config: DataConfig) -> list[_Example]:
    """A built-in task of yatt/rl/tasks.py (the task name was checked by DataConfig)."""
    make_prompts = TASKS[config.task].make_prompts
    return [
        _Example(_messages(config, [{"role": "user", "content": text}]), text, metadata)
        for text, metadata in make_prompts(config.num_prompts or DEFAULT_GENERATED, config.seed)
    ]


def _reasoning_gym(config: DataConfig) -> list[_Example]:
    """Procedurally generated reasoning-gym entries; the whole entry travels in the metadata."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if config.task not in DATASETS:
        close = difflib.get_close_matches(config.task, list(DATASETS), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f" (known: {', '.join(sorted(DATASETS))})"
        raise ConfigError(f"data.task = {config.task!r} is not a reasoning-gym dataset{hint}")
    try:
        dataset = reasoning_gym.create_dataset(
            config.task, size=config.num_prompts or DEFAULT_GENERATED, seed=config.seed, **config.task_args
        )
    except (TypeError, ValueError, AssertionError) as e:
        raise ConfigError(f"data.task_args {config.task_args} do not fit reasoning-gym's {config.task!r}: {e}") from None
    examples = []
    for entry in dataset:
        text = str(entry["question"]) + config.instruction
        metadata = {
            "task": config.task,
            "entry": json.dumps(_json_safe(entry)),
            "answer": str(entry["answer"]),
        }
        examples.append(_Example(_messages(config, [{"role": "user", "content": text}]), text, metadata))
    return examples


def _json_safe(value: object) -> Json:
    """``value`` as plain JSON data (tuples and sets become lists, other objects strings)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        # NaN and infinities are not JSON; keep them readable for a scorer that compares text.
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted((_json_safe(v) for v in value), key=repr)
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    item = getattr(value, "tolist", None)  # numpy scalars and arrays
    if callable(item):
        return _json_safe(item())
    return str(value)


def _data_files(config: DataConfig) -> list[str]:
    """The local files of a jsonl/parquet source: the file itself, or a directory's files."""
    path = Path(config.path)
    suffixes = (".jsonl", ".json") if config.source == "jsonl" else (".parquet",)
    if path.is_file():
        return [str(path)]
    if path.is_dir():
        files = sorted(str(p) for p in path.iterdir() if p.is_file() and p.suffix in suffixes)
        if not files:
            raise ConfigError(f"data.path = {config.path!r} holds no {' or '.join(suffixes)} files")
        return files
    if config.path.count("/") == 1 and not path.suffix and not config.path.startswith((".", "/", "~")):
        raise ConfigError(
            f"data.path = {config.path!r} does not exist here, and runs do not download (it looks like a hub "
            f"dataset id): download it first, e.g. `huggingface-cli download --repo-type dataset {config.path} "
            f"--local-dir data/{path.name}`, then set data.path to its {config.source} file or directory"
        )
    raise ConfigError(
        f"data.path = {config.path!r} does not exist; give a {config.source} file or a directory of them"
    )


def _table(config: DataConfig) -> list[_Example]:
    """Rows of local jsonl/parquet files, read with Hugging Face datasets (no hub)."""
    from datasets import disable_progress_bars, load_dataset
    from datasets.exceptions import DatasetGenerationError

    disable_progress_bars()  # a launcher's output stays its own lines

    files = _data_files(config)
    if all(Path(f).stat().st_size == 0 for f in files):
        raise ConfigError(f"data.path = {config.path!r} yields no prompts (empty); give a dataset with at least one row")
    try:
        table = load_dataset(
            "json" if config.source == "jsonl" else "parquet", data_files=files, split="train"
        )
    except (StopIteration, ValueError) as e:  # datasets on files with no rows ("corresponds to no data")
        if isinstance(e, ValueError) and "no data" not in str(e):
            raise ConfigError(f"data.path = {config.path!r} cannot be read as {config.source}: {e}") from e
        raise ConfigError(f"data.path = {config.path!r} yields no prompts; give a dataset with at least one row") from None
    except DatasetGenerationError as e:
        raise ConfigError(
            f"data.path = {config.path!r} cannot be read as {config.source}: {e.__cause__ or e}"
        ) from e
    columns = list(table.column_names)
    for name, value in (("prompt_field", config.prompt_field), ("answer_field", config.answer_field)):
        if value and value.split(".")[0] not in columns:
            empty = "; set data.answer_field: '' for data without answers" if name == "answer_field" else ""
            raise ConfigError(
                f"data.{name} = {value!r} is not a column of {config.path!r} (columns: {', '.join(columns)}){empty}"
            )
    if config.num_prompts > len(table):
        raise ConfigError(
            f"data.num_prompts = {config.num_prompts}, but {config.path!r} has only {len(table)} rows"
        )
    if config.num_prompts:
        table = table.select(range(config.num_prompts))
    return [_row_example(config, index, row) for index, row in enumerate(table)]


def _row_example(config: DataConfig, index: int, row: Mapping[str, Any]) -> _Example:
    """One table row: the prompt (text or chat messages) and its scalar fields as metadata."""
    prompt = _lookup(row, config.prompt_field, "prompt_field", index)
    if isinstance(prompt, str):
        user = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(_is_message(m) for m in prompt):
        user = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    else:
        raise ConfigError(
            f"data.prompt_field = {config.prompt_field!r}: row {index} holds {type(prompt).__name__}, "
            "not a string or a list of {'role', 'content'} messages"
        )
    metadata = {key: text for key, text in _flat(row).items() if key != config.prompt_field}
    if config.answer_field:
        answer = _lookup(row, config.answer_field, "answer_field", index)
        metadata["answer"] = _scalar_text(answer) or json.dumps(_json_safe(answer))
    return _Example(_messages(config, user), "\n\n".join(m["content"] for m in user), metadata)


def _lookup(row: Mapping[str, Any], path: str, field: str, index: int) -> Any:
    """``row``'s value at a dotted ``path`` (``reward_model.ground_truth``, ``choices.0``)."""
    value: Any = row
    for part in path.split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise ConfigError(f"data.{field} = {path!r}: row {index} has no {part!r} there (got {_json_safe(value)!r:.200})")
    return value


def _flat(row: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Every scalar of ``row`` as text, nested mappings' under dotted keys (``reward_model.style``)."""
    out: dict[str, str] = {}
    for key, value in row.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        elif (text := _scalar_text(value)) is not None:
            out[f"{prefix}{key}"] = text
    return out


def _is_message(value: object) -> bool:
    return isinstance(value, Mapping) and "role" in value and "content" in value


def _scalar_text(value: object) -> str | None:
    """A scalar as text; None for missing values and nested data."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return str(value)
    return None


def _tokenize(examples: Sequence[_Example], config: DataConfig, tokenizer_path: str) -> list[list[int]]:
    """Token ids of every example: chat template with a generation prompt, or plain text."""
    from transformers import AutoTokenizer

    if not Path(tokenizer_path).is_dir():
        raise ConfigError(
            f"the tokenizer directory {tokenizer_path!r} does not exist (a local Hugging Face model directory)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load a tokenizer from {tokenizer_path!r}: {e}") from e
    use_template = config.apply_chat_template and getattr(tokenizer, "chat_template", None) is not None
    if config.apply_chat_template and not use_template:
        log.warning(
            "the tokenizer at %s has no chat template: prompts are encoded as plain text", tokenizer_path
        )
    ids: list[list[int]] = []
    for start in range(0, len(examples), _TOKENIZE_CHUNK):
        chunk = examples[start : start + _TOKENIZE_CHUNK]
        if use_template:
            out = tokenizer.apply_chat_template(
                [e.messages for e in chunk], add_generation_prompt=True, tokenize=True
            )
        else:
            out = tokenizer(
                ["\n\n".join(m["content"] for m in e.messages) for e in chunk], add_special_tokens=True
            )
        # transformers 5 returns a BatchEncoding (a mapping); earlier versions a list of lists.
        rows = cast(list[list[int]], out["input_ids"] if isinstance(out, Mapping) else out)
        ids.extend([int(t) for t in row] for row in rows)
    return ids
