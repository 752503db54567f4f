"""Prompts with images: table rows' images (paths, bytes, datasets Image values) reach the
tiny VLM's processor as the model's own tokens and pixels; bad images are refused before the
run, naming the row and the field; the run dir's prompt file keeps the pixels exactly; the
count_red task draws the same pictures from the same seed or metadata."""

from __future__ import annotations

import collections
import dataclasses
import io
import json
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageDraw
from transformers import AutoProcessor, AutoTokenizer

from workers.models import IMAGE, build_tiny_vlm
from yatt.errors import ConfigError
from yatt.rl.config import DataConfig
from yatt.rl.data import (
    PROMPT_SETS_FILE,
    Prompt,
    load_prompt_sets,
    load_prompts,
    read_prompt_sets,
    write_prompt_sets,
)
from yatt.rl.tasks import TASKS, count_red_images, count_red_prompts, count_reward

IMAGE_TOKENS = 64
"""The tiny VLM's tokens per image: (56 / 7)^2 patches."""


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm") / "vlm"))


@pytest.fixture(scope="module")
def image_token(vlm_dir: str) -> int:
    token = AutoTokenizer.from_pretrained(vlm_dir).convert_tokens_to_ids(IMAGE)
    assert isinstance(token, int)
    return token


def picture(colour: str, size: tuple[int, int] = (56, 56)) -> Image.Image:
    """A plain picture with a black square in one corner (so no two colours look alike)."""
    image = Image.new("RGB", size, colour)
    ImageDraw.Draw(image).rectangle((0, 0, 9, 9), fill="black")
    return image


def png(path: Path, colour: str, size: tuple[int, int] = (56, 56)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    picture(colour, size).save(path)
    return path


def png_bytes(colour: str) -> bytes:
    out = io.BytesIO()
    picture(colour).save(out, format="PNG")
    return out.getvalue()


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def pixels(vlm_dir: str, *images: Image.Image) -> np.ndarray:
    """What the processor itself makes of ``images``: [images, 3, 56, 56]."""
    processor = AutoProcessor.from_pretrained(vlm_dir)  # type: ignore[no-untyped-call]
    text = IMAGE * len(images)
    return np.asarray(processor(text=[text], images=list(images), return_tensors="np")["pixel_values"])


def asks(*parts: str) -> list[dict[str, object]]:
    """A user message of image parts ("<image>") and text parts."""
    content = [{"type": "image"} if p == IMAGE else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


def decode(vlm_dir: str, prompt: Prompt) -> str:
    return str(AutoTokenizer.from_pretrained(vlm_dir).decode(prompt.prompt_ids))


# --- table rows --------------------------------------------------------------------------------


def test_jsonl_rows_with_image_paths(tmp_path: Path, vlm_dir: str, image_token: int) -> None:
    red = png(tmp_path / "pics" / "red.png", "red", (80, 60))  # any size: the processor resizes
    png(tmp_path / "pics" / "blue.png", "blue")
    green = png(tmp_path / "elsewhere" / "green.png", "green")
    rows: list[dict[str, object]] = [
        {"prompt": "What colour?", "images": ["pics/red.png"], "answer": "red"},
        {"prompt": "Just text.", "answer": "none"},
        # Parts place the images; an absolute path is read as it is.
        {
            "prompt": asks("Left:", IMAGE, "right:", IMAGE),
            "images": ["pics/blue.png", str(green)],
            "answer": "blue,green",
        },
        {"prompt": "Empty list.", "images": [], "answer": "none"},
        {
            "prompt": [{"role": "user", "content": "One image, one value."}],
            "images": "pics/red.png",
            "answer": "red",
        },
    ]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    prompts = load_prompts(DataConfig(source="jsonl", path=str(path)), vlm_dir)

    assert [p.prompt_ids.count(image_token) for p in prompts] == [IMAGE_TOKENS, 0, 2 * IMAGE_TOKENS, 0, IMAGE_TOKENS]
    assert [p.text for p in prompts] == [
        "What colour?",
        "Just text.",
        "Left:\n\nright:",
        "Empty list.",
        "One image, one value.",
    ]
    assert [p.metadata["answer"] for p in prompts] == ["red", "none", "blue,green", "none", "red"]
    assert all("images" not in p.metadata for p in prompts)
    # A string prompt gets its image before its text; given parts keep their places.
    assert decode(vlm_dir, prompts[0]) == f"<|user|>{IMAGE * IMAGE_TOKENS}What colour?\n<|assistant|>"
    assert (
        decode(vlm_dir, prompts[2])
        == f"<|user|>Left:{IMAGE * IMAGE_TOKENS}right:{IMAGE * IMAGE_TOKENS}\n<|assistant|>"
    )
    assert (
        decode(vlm_dir, prompts[1]) == "<|user|>Just text.\n<|assistant|>"
    )  # text rows: the tokenizer's way
    assert prompts[1].mm_inputs == {} and prompts[3].mm_inputs == {}
    assert set(prompts[0].mm_inputs) == {"pixel_values"}
    assert prompts[0].mm_inputs["pixel_values"].shape == (1, 3, 56, 56)
    assert prompts[2].mm_inputs["pixel_values"].shape == (2, 3, 56, 56)
    np.testing.assert_array_equal(
        prompts[0].mm_inputs["pixel_values"], pixels(vlm_dir, Image.open(red).convert("RGB"))
    )
    np.testing.assert_array_equal(prompts[0].mm_inputs["pixel_values"], prompts[4].mm_inputs["pixel_values"])
    expected = pixels(vlm_dir, picture("blue"), picture("green"))
    np.testing.assert_array_equal(prompts[2].mm_inputs["pixel_values"], expected)
    # The images themselves ride along, encoded, for an engine that processes them (vLLM): the same pixels.
    assert [len(p.images) for p in prompts] == [1, 0, 2, 0, 1]
    decoded = [Image.open(io.BytesIO(data)) for data in prompts[2].images]
    np.testing.assert_array_equal(pixels(vlm_dir, *decoded), expected)
    assert [d.getpixel((40, 40)) for d in decoded] == [picture("blue").getpixel((40, 40)), picture("green").getpixel((40, 40))]


def test_parquet_with_datasets_image_values_and_bytes(tmp_path: Path, vlm_dir: str, image_token: int) -> None:
    # Written by datasets with an Image feature: read back decoded (PIL images).
    features = datasets.Features(
        {
            "prompt": datasets.Value("string"),
            "images": datasets.Sequence(datasets.Image()),
            "answer": datasets.Value("string"),
        }
    )
    table: dict[str, list[object]] = {
        "prompt": ["Which?", "And these?"],
        "images": [[picture("red")], [picture("blue"), picture("green")]],
        "answer": ["a", "b"],
    }
    datasets.Dataset.from_dict(table, features=features).to_parquet(str(tmp_path / "hf" / "train.parquet"))
    # Written by pyarrow: {bytes, path} structs as they are, and raw bytes.
    image_type = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    struct_images = pa.array([[{"bytes": png_bytes("blue"), "path": None}]], image_type)
    pq.write_table(pa.table({"prompt": ["Struct?"], "images": struct_images}), tmp_path / "structs.parquet")
    byte_images = pa.array([[png_bytes("green")]], pa.list_(pa.binary()))
    pq.write_table(pa.table({"prompt": ["Bytes?"], "images": byte_images}), tmp_path / "bytes.parquet")

    decoded = load_prompts(DataConfig(source="parquet", path=str(tmp_path / "hf")), vlm_dir)
    [structs] = load_prompts(
        DataConfig(source="parquet", path=str(tmp_path / "structs.parquet"), answer_field=""), vlm_dir
    )
    [plain] = load_prompts(
        DataConfig(source="parquet", path=str(tmp_path / "bytes.parquet"), answer_field=""), vlm_dir
    )

    assert [p.prompt_ids.count(image_token) for p in decoded] == [IMAGE_TOKENS, 2 * IMAGE_TOKENS]
    np.testing.assert_array_equal(decoded[0].mm_inputs["pixel_values"], pixels(vlm_dir, picture("red")))
    np.testing.assert_array_equal(
        decoded[1].mm_inputs["pixel_values"], pixels(vlm_dir, picture("blue"), picture("green"))
    )
    np.testing.assert_array_equal(structs.mm_inputs["pixel_values"], pixels(vlm_dir, picture("blue")))
    np.testing.assert_array_equal(plain.mm_inputs["pixel_values"], pixels(vlm_dir, picture("green")))
    assert not any(key.startswith("images") for p in (*decoded, structs, plain) for key in p.metadata)
    # A bad image in an Image column is refused like a bad file.
    table["images"][1] = [picture("blue"), {"bytes": b"not a png", "path": None}]
    datasets.Dataset.from_dict(table, features=features).to_parquet(str(tmp_path / "bad" / "train.parquet"))
    with pytest.raises(
        ConfigError, match=r"^data\.image_field = 'images': row 1's image 1 \(9 bytes\) cannot be read"
    ):
        load_prompts(DataConfig(source="parquet", path=str(tmp_path / "bad")), vlm_dir)


BAD_ROWS: list[tuple[dict[str, object], str]] = [
    ({"prompt": "Missing?", "images": ["nowhere.png"]}, r"row 1's image 0, '.*nowhere\.png', does not exist"),
    ({"prompt": "Corrupt?", "images": ["corrupt.png"]}, r"row 1's image 0 \('.*corrupt\.png'\) cannot be read as an image"),
    ({"prompt": "A number?", "images": [7]}, r"row 1's image 0 is a int, not a file path, bytes or"),
    ({"prompt": "A url?", "images": [{"url": "http://x/y.png"}]}, r"row 1's image 0 is a dict, not a file path"),
    (
        {"prompt": asks(IMAGE, "Two?"), "images": ["ok.png", "ok.png"]},
        r"row 1 has 2 images, but its messages \(data\.prompt_field = 'prompt'\) have 1 image parts",
    ),
    (
        {"prompt": asks(IMAGE, IMAGE, "One?"), "images": ["ok.png"]},
        r"row 1 has 1 images, but its messages \(data\.prompt_field = 'prompt'\) have 2 image parts",
    ),
    ({"prompt": asks(IMAGE, "None?")}, r"row 1 has 0 images, but its messages .* have 1 image parts"),
]  # fmt: skip


@pytest.mark.parametrize(("row", "message"), BAD_ROWS)
def test_bad_images_are_refused_naming_row_and_field(
    tmp_path: Path, vlm_dir: str, row: dict[str, object], message: str
) -> None:
    png(tmp_path / "ok.png", "red")
    (tmp_path / "corrupt.png").write_bytes(png_bytes("red")[:40])  # a PNG cut short
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "Fine.", "images": ["ok.png"]}, row])
    with pytest.raises(ConfigError, match=r"^data\.image_field = 'images': " + message) as caught:
        load_prompts(DataConfig(source="jsonl", path=str(path), answer_field=""), vlm_dir)
    assert "\n" not in str(caught.value)


def test_images_for_a_text_only_model_are_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    png(tmp_path / "ok.png", "red")
    path = write_jsonl(
        tmp_path / "train.jsonl", [{"prompt": "Text."}, {"prompt": "Look.", "images": ["ok.png"]}]
    )
    with pytest.raises(
        ConfigError,
        match=rf"^data\.image_field = 'images': row 1 has images, but the model at '{tiny_model_dir}' is text-only",
    ):
        load_prompts(DataConfig(source="jsonl", path=str(path), answer_field=""), str(tiny_model_dir))
    with pytest.raises(
        ConfigError, match=r"^data\.task = 'count_red': row 0 has images, but the model .* is text-only"
    ):
        load_prompts(DataConfig(task="count_red", num_prompts=2), str(tiny_model_dir))


def test_too_long_a_prompt_with_images_says_how_much_is_image(tmp_path: Path, vlm_dir: str) -> None:
    png(tmp_path / "ok.png", "red")
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "Look.", "images": ["ok.png", "ok.png"]}])
    config = DataConfig(source="jsonl", path=str(path), answer_field="", max_prompt_tokens=2 * IMAGE_TOKENS)
    with pytest.raises(
        ConfigError,
        match=rf"prompt 0 has \d+ tokens, {2 * IMAGE_TOKENS} of them image placeholders .* fewer or smaller images",
    ):
        load_prompts(config, vlm_dir)
    assert len(load_prompts(dataclasses.replace(config, max_prompt_tokens=3 * IMAGE_TOKENS), vlm_dir)[0].prompt_ids) <= 3 * IMAGE_TOKENS


# --- the run dir's prompt file, and held-out splits ------------------------------------------------


def test_prompt_sets_file_keeps_the_images_exactly(tmp_path: Path, vlm_dir: str) -> None:
    config = DataConfig(task="count_red", num_prompts=40, seed=1, eval_split=5)
    sets = load_prompt_sets(config, vlm_dir)
    path = tmp_path / PROMPT_SETS_FILE
    write_prompt_sets(path, config, vlm_dir, sets)
    read = read_prompt_sets(path, config, vlm_dir)
    assert read is not None
    for prompts, again in zip(sets, read, strict=True):
        assert len(again) == len(prompts)
        for p, q in zip(prompts, again, strict=True):
            assert (q.index, q.prompt_ids, q.text, q.metadata, q.images) == (p.index, p.prompt_ids, p.text, p.metadata, p.images)
            assert len(q.images) == 1
            assert set(q.mm_inputs) == set(p.mm_inputs) == {"pixel_values"}
            for name, array in p.mm_inputs.items():
                assert (q.mm_inputs[name].dtype, q.mm_inputs[name].shape) == (array.dtype, array.shape)
                assert q.mm_inputs[name].tobytes() == array.tobytes()


def test_a_held_out_split_tells_images_apart(vlm_dir: str) -> None:
    """Every count_red prompt has the same text (so the same ids): its image makes it distinct."""
    train, held = load_prompt_sets(
        DataConfig(task="count_red", num_prompts=60, seed=4, eval_split=10), vlm_dir
    )
    assert len(held) == 10 and len({p.prompt_ids.__repr__() for p in held}) == 1
    cells = [p.metadata["cells"] + p.metadata["squares"] for p in held]
    assert len(set(cells)) == 10
    held_pixels = {p.mm_inputs["pixel_values"].tobytes() for p in held}
    assert not any(p.mm_inputs["pixel_values"].tobytes() in held_pixels for p in train)
    assert len(train) == 50


# --- the count_red task --------------------------------------------------------------------------


def test_count_red_prompts_follow_the_seed_and_redraw_from_metadata(vlm_dir: str) -> None:
    examples = count_red_prompts(200, seed=5)
    assert examples == count_red_prompts(200, seed=5) and examples != count_red_prompts(200, seed=6)
    for text, metadata in examples:
        assert text == "How many red squares?"
        [image] = count_red_images(metadata)
        assert image.size == (56, 56) and image.mode == "RGB"
        again = np.asarray(count_red_images(dict(metadata))[0])
        np.testing.assert_array_equal(np.asarray(image), again)
        # What is drawn is what the metadata says: one square of its colour per cell.
        for cell, colour in enumerate(metadata["cells"]):
            block = again[(cell // 2) * 28 : (cell // 2 + 1) * 28, (cell % 2) * 28 : (cell % 2 + 1) * 28]
            red = ((block[..., 0] > 150) & (block[..., 2] < 100)).sum()
            blue = ((block[..., 2] > 150) & (block[..., 0] < 100)).sum()
            assert (red >= 16 * 16, blue >= 16 * 16) == (colour == "r", colour == "b"), (metadata, cell)
        assert metadata["answer"] == str(metadata["cells"].count("r"))
    # The loaded prompts hold those pictures, processed.
    prompts = load_prompts(DataConfig(task="count_red", num_prompts=3, seed=5), vlm_dir)
    for prompt, (_, metadata) in zip(prompts, examples, strict=False):
        assert prompt.metadata == metadata and prompt.text == "How many red squares?"
        assert (
            decode(vlm_dir, prompt) == f"<|user|>{IMAGE * IMAGE_TOKENS}How many red squares?\n<|assistant|>"
        )
        np.testing.assert_array_equal(
            prompt.mm_inputs["pixel_values"], pixels(vlm_dir, *count_red_images(metadata))
        )


def test_count_red_answers_cover_every_count() -> None:
    answers = collections.Counter(metadata["answer"] for _, metadata in count_red_prompts(2000, seed=0))
    assert set(answers) == {"0", "1", "2", "3", "4"}
    # Each cell red with odds 1/3: counts 0..4 are binomial(4, 1/3), 20/40/30/10/1 %.
    for count, share in {"0": 0.198, "1": 0.395, "2": 0.296, "3": 0.099}.items():
        assert abs(answers[count] / 2000 - share) < 0.04, answers


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("2", 1.0),
        (" 2 red squares", 1.0),
        ("2.", 1.0),
        ("02", 1.0),
        ("3", 0.0),
        ("two", 0.0),
        ("12", 0.0),
        ("", 0.0),
    ],
)
def test_count_reward(completion: str, expected: float) -> None:
    assert count_reward("How many red squares?", completion, {"answer": "2"}) == expected


def test_count_red_is_a_registered_visual_task() -> None:
    task = TASKS["count_red"]
    assert task.reward is count_reward and task.images is count_red_images
    assert all(t.images is None for name, t in TASKS.items() if name != "count_red")
