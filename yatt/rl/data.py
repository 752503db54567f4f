"""The prompt sources of the RL loop: every prompt of the run, as token ids, once.

Each controller owns one data shard (prompt ``i`` belongs to shard ``i % S``) and visits
its prompts in the seeded per-epoch order of ``yatt.rl.sampling.epoch_order``, so every
controller loads the same full list, deterministically::

    synthetic      yatt.rl.tasks.TASKS[task].make_prompts(n, seed)  --+
    reasoning_gym  reasoning_gym.create_dataset(task, n, seed)    --+--> (messages, text, metadata, images)
    jsonl/parquet  datasets.load_dataset(<local files>)           --+            |
                                   text: chat template (or plain encode); images: the model's
                                   processor (yatt/rl/vision.py); length check
                                                                                  v
                                          Prompt(index, prompt_ids, text, metadata, mm_inputs)

Prompts are tokenised here and never again: the launcher tokenises and checks them once
and writes them to the run dir (``write_prompt_sets``), each role process reads them back;
the generator gets ``prompt_ids`` and the trainer trains on the same ids (token in, token
out). ``text`` is kept for judges and logs.
A prompt with images (a table's ``data.image_field``, a visual task's) is chat messages whose
content may be parts, ``{"type": "image"}`` and ``{"type": "text", "text": ...}``; its images
are loaded and checked against its image parts here, before the run starts.
transformers, datasets, reasoning_gym and PIL are imported inside the functions that need
them, so importing yatt stays light (tests/yatt/test_imports.py).
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import io
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypedDict, cast

import numpy as np

from yatt.errors import ConfigError, storage_error
from yatt.rl.config import DataConfig
from yatt.rl.tasks import TASKS

if TYPE_CHECKING:
    from PIL.Image import Image

    from yatt.rl.vision import Encoded

log = logging.getLogger(__name__)

Part: TypeAlias = dict[str, str]
"""A part of a message's content: ``{"type": "image"}`` or ``{"type": "text", "text": ...}``."""


class Message(TypedDict):
    """A chat message: text, or parts (a prompt with images)."""

    role: str
    content: str | list[Part]


Messages: TypeAlias = list[Message]
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
    mm_inputs: dict[str, np.ndarray] = field(default_factory=dict)
    """A prompt with images: what the model's processor made of them beside ``prompt_ids``
    (which hold the images' expanded placeholder tokens), by the model's argument name:
    ``pixel_values`` (LLaVA: [images, 3, H, W]; Qwen2-VL: [patches, D]), ``image_grid_thw``
    (Qwen2-VL: [images, 3]), ... Every tensor's first dimension counts images or patches,
    so a batch concatenates them (as the processors do). Empty for a text prompt."""
    images: list[bytes] = field(default_factory=list)
    """The same images encoded (PNG), in order, for an engine that runs the processor itself
    (vLLM takes the images, not ``mm_inputs``). Empty for a text prompt."""


@dataclass(frozen=True)
class _Example:
    """A prompt before tokenisation."""

    messages: Messages
    text: str
    metadata: dict[str, str]
    images: list[Image] = field(default_factory=list)
    """One per image part of ``messages``, in order (RGB)."""


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

    rows = [
        [[p.index, p.prompt_ids, p.text, p.metadata, _packed(p.mm_inputs), p.images] for p in prompts] for prompts in sets
    ]
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
    train, held = (
        [
            Prompt(index=i, prompt_ids=ids, text=text, metadata=meta, mm_inputs=_unpacked(mm), images=images)
            for i, ids, text, meta, mm, images in rows
        ]
        for rows in saved["sets"]
    )
    return train, held


def _packed(mm_inputs: Mapping[str, np.ndarray]) -> dict[str, list[object]]:
    """Each array as [dtype, shape, raw bytes] (msgpack, no pickle): ``_unpacked`` makes it again."""
    return {name: [a.dtype.str, list(a.shape), a.tobytes()] for name, a in mm_inputs.items()}


def _unpacked(packed: Mapping[str, list[Any]]) -> dict[str, np.ndarray]:
    return {
        name: np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
        for name, (dtype, shape, raw) in packed.items()
    }


def _split(config: DataConfig, prompts: list[Prompt]) -> tuple[list[Prompt], list[Prompt]]:
    """(training, held out): ``data.eval_split`` of the distinct prompts, drawn with
    ``data.seed``; a training row that repeats a held-out prompt (a generated task can) is
    left out, so evaluation never sees a prompt the policy trained on. Both re-indexed."""
    distinct = list({_identity(p): p for p in reversed(prompts)}.values())[::-1]  # first of each
    count = round(config.eval_split * len(distinct)) if config.eval_split < 1 else int(config.eval_split)
    count = max(count, 1)
    if count >= len(distinct):
        raise ConfigError(
            f"data.eval_split = {config.eval_split} holds out {count} of the {len(distinct)} distinct prompts; "
            "leave some to train on (a smaller share or count)"
        )
    chosen = np.random.default_rng([config.seed, 1]).choice(len(distinct), size=count, replace=False)
    held = [distinct[i] for i in sorted(int(i) for i in chosen)]
    held_ids = {_identity(p) for p in held}
    train = [p for p in prompts if _identity(p) not in held_ids]
    return _reindexed(train), _reindexed(held)


def _identity(prompt: Prompt) -> tuple[tuple[int, ...], str]:
    """What makes two prompts the same: their ids and a hash of their images' tensors (one
    question may be asked of many images, e.g. the count_red task's)."""
    digest = hashlib.sha256()
    for name, array in sorted(prompt.mm_inputs.items()):
        digest.update(f"{name} {array.dtype.str} {array.shape}".encode())
        digest.update(array.tobytes())
    return tuple(prompt.prompt_ids), digest.hexdigest() if prompt.mm_inputs else ""


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
    if not Path(tokenizer_path).is_dir():
        raise ConfigError(
            f"the tokenizer directory {tokenizer_path!r} does not exist (a local Hugging Face model directory)"
        )
    texts = [e for e in examples if not e.images]
    text_ids = iter(_tokenize(texts, config, tokenizer_path) if texts else [])
    with_images = iter(_encode_images(config, examples, tokenizer_path))
    from yatt.rl.vision import png
    prompts = []
    for index, example in enumerate(examples):
        prompt_ids, mm_inputs, image_tokens = next(with_images) if example.images else (next(text_ids), {}, 0)
        if config.max_prompt_tokens and len(prompt_ids) > config.max_prompt_tokens:
            images, fix = (
                (f", {image_tokens} of them image placeholders", "use fewer or smaller images (none is ever cut)")
                if example.images
                else ("", "remove the prompt")
            )
            raise ConfigError(
                f"data.max_prompt_tokens = {config.max_prompt_tokens}, but prompt {index} has "
                f"{len(prompt_ids)} tokens{images} ({example.text[:80]!r}...); raise the limit or {fix}"
            )
        prompts.append(
            Prompt(
                index=index, prompt_ids=prompt_ids, text=example.text, metadata=example.metadata, mm_inputs=mm_inputs,
                images=[png(image) for image in example.images],
            )
        )
    return prompts


def _encode_images(config: DataConfig, examples: Sequence[_Example], model_dir: str) -> list[Encoded]:
    """The examples with images, processed by the model's processor (yatt/rl/vision.py)."""
    rows = [(index, e.messages, e.images) for index, e in enumerate(examples) if e.images]
    if not rows:
        return []
    from yatt.rl import vision

    synthetic = config.source == "synthetic"
    field = f"data.task = {config.task!r}" if synthetic else f"data.image_field = {config.image_field!r}"
    if not config.apply_chat_template:
        raise ConfigError(
            f"data.apply_chat_template is false, but {field}: row {rows[0][0]} has images, which only the "
            "processor's chat template places; set data.apply_chat_template: true"
        )
    return vision.encode(rows, model_dir, field)


def _messages(config: DataConfig, user: Messages) -> Messages:
    """The conversation: the configured system prompt (if any) and the prompt's messages."""
    has_system = any(m["role"] == "system" for m in user)
    system: Messages = (
        [{"role": "system", "content": config.system_prompt}]
        if config.system_prompt and not has_system
        else []
    )
    return system + user


def _synthetic(config: DataConfig) -> list[_Example]:
    """A built-in task of yatt/rl/tasks.py (the task name was checked by DataConfig); a
    visual task's prompt shows its images, then its text."""
    task = TASKS[config.task]
    examples = []
    for text, metadata in task.make_prompts(config.num_prompts or DEFAULT_GENERATED, config.seed):
        images = task.images(metadata) if task.images else []
        parts: list[Part] = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
        user: Messages = [{"role": "user", "content": parts if images else text}]
        examples.append(_Example(_messages(config, user), text, metadata, images))
    return examples


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
    from datasets import Image, disable_progress_bars, load_dataset
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
    images = table.features.get(config.image_field)
    if isinstance(getattr(images, "feature", images), Image):
        # datasets decodes an Image column as it reads each row, failing on a bad image with
        # an error that names neither; read the {bytes, path} values and load them here.
        undecoded = copy.deepcopy(images)
        getattr(undecoded, "feature", undecoded).decode = False
        table = table.cast_column(config.image_field, undecoded)
    return [_row_example(config, index, row) for index, row in enumerate(table)]


def _row_example(config: DataConfig, index: int, row: Mapping[str, Any]) -> _Example:
    """One table row: the prompt (text or chat messages), its images, and its scalar fields
    as metadata."""
    prompt = _lookup(row, config.prompt_field, "prompt_field", index)
    user: Messages
    if isinstance(prompt, str):
        user = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt and all(_is_message(m) for m in prompt):
        user = [{"role": str(m["role"]), "content": _content(config, index, m["content"])} for m in prompt]
    else:
        raise ConfigError(
            f"data.prompt_field = {config.prompt_field!r}: row {index} holds {type(prompt).__name__}, "
            "not a string or a list of {'role', 'content'} messages"
        )
    images = _row_images(config, index, row)
    user = _with_image_parts(config, index, user, len(images))
    image_column = config.image_field + "."
    metadata = {
        key: text
        for key, text in _flat(row).items()
        if key != config.prompt_field and key != config.image_field and not key.startswith(image_column)
    }
    if config.answer_field:
        answer = _lookup(row, config.answer_field, "answer_field", index)
        metadata["answer"] = _scalar_text(answer) or json.dumps(_json_safe(answer))
    texts = [text for m in user for text in _texts(m["content"])]
    return _Example(_messages(config, user), "\n\n".join(texts), metadata, images)


def _content(config: DataConfig, index: int, content: object) -> str | list[Part]:
    """A row's message content: text, or a list of image and text parts."""
    if not isinstance(content, list):
        return str(content)
    parts: list[Part] = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "image":
            parts.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise ConfigError(
                f"data.prompt_field = {config.prompt_field!r}: row {index} has a content part "
                f"{_json_safe(part)!r:.120}; a part is {{'type': 'image'}} or {{'type': 'text', 'text': ...}}"
            )
    return parts


def _texts(content: str | list[Part]) -> list[str]:
    return [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]


def _with_image_parts(config: DataConfig, index: int, user: Messages, count: int) -> Messages:
    """``user`` with one image part per image: where the row put them, or, when it put none,
    at the start of its first user message with text content (TRL's
    prepare_multimodal_messages). Without images, parts become text again, so a text prompt
    is tokenised as ever."""
    placed = sum(p["type"] == "image" for m in user if isinstance(m["content"], list) for p in m["content"])
    if count and not placed:
        texts = (i for i, m in enumerate(user) if m["role"] == "user" and isinstance(m["content"], str))
        first = next(texts, None)
        if first is not None:
            text = cast(str, user[first]["content"])
            parts: list[Part] = [*({"type": "image"} for _ in range(count)), {"type": "text", "text": text}]
            user = [*user[:first], {"role": "user", "content": parts}, *user[first + 1 :]]
            placed = count
    if placed != count:
        raise ConfigError(
            f"data.image_field = {config.image_field!r}: row {index} has {count} images, but its messages "
            f"(data.prompt_field = {config.prompt_field!r}) have {placed} image parts; give one image per "
            "{'type': 'image'} part, or no parts and the images go before the first user message's text"
        )
    if count:
        return user
    return [{"role": m["role"], "content": "\n\n".join(_texts(m["content"]))} for m in user]


def _row_images(config: DataConfig, index: int, row: Mapping[str, Any]) -> list[Image]:
    """The row's images (``data.image_field``), loaded as RGB; file paths are read relative
    to the data's directory."""
    value = row.get(config.image_field)
    items = [] if value is None else value if isinstance(value, list) else [value]
    if not items:
        return []
    import PIL.Image

    base = Path(config.path) if Path(config.path).is_dir() else Path(config.path).parent
    images = []
    for number, item in enumerate(items):
        where = f"data.image_field = {config.image_field!r}: row {index}'s image {number}"
        # A datasets Image value: {"bytes": ..., "path": ...}, either may be None.
        source = item.get("bytes") or item.get("path") if isinstance(item, Mapping) else item
        if isinstance(source, str):
            path = base / source
            if not path.is_file():
                raise ConfigError(
                    f"{where}, {str(path)!r}, does not exist; give a file path (relative: to {str(base)!r})"
                )
            what, source = repr(str(path)), path
        elif isinstance(source, (bytes, bytearray)):
            what, source = f"{len(source)} bytes", io.BytesIO(source)
        else:
            raise ConfigError(
                f"{where} is a {type(item).__name__}, not a file path, bytes or a {{'bytes', 'path'}} "
                "image value; give one of those"
            )
        try:
            with PIL.Image.open(source) as image:
                images.append(image.convert("RGB"))
        except (OSError, ValueError, PIL.Image.DecompressionBombError) as e:
            raise ConfigError(f"{where} ({what}) cannot be read as an image: {e}; replace or remove it") from e
    return images


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
    """Token ids of every example: chat template with a generation prompt, or plain text
    (text examples: every message's content is a string)."""
    from transformers import AutoTokenizer

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
                [cast(list[dict[str, str]], e.messages) for e in chunk], add_generation_prompt=True, tokenize=True
            )
        else:
            out = tokenizer(
                ["\n\n".join(cast(str, m["content"]) for m in e.messages) for e in chunk], add_special_tokens=True
            )
        # transformers 5 returns a BatchEncoding (a mapping); earlier versions a list of lists.
        rows = cast(list[list[int]], out["input_ids"] if isinstance(out, Mapping) else out)
        ids.extend([int(t) for t in row] for row in rows)
    return ids
