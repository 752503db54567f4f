"""Prompts with images, made into token ids and pixel tensors by the model's own processor.

A vision-language model's processor expands each image placeholder of the chat template
into the model's count of image tokens and turns the images into the tensors the model
takes beside the ids (``pixel_values``, ``image_grid_thw``, ...)::

    messages (image parts) --chat template--> text with placeholders --+
    images (PIL, RGB) -------------------------------------------------+--> processor
        --> prompt_ids (placeholders expanded), mm_inputs (Prompt.mm_inputs)

Each prompt is processed alone: a batched call concatenates the images' outputs, and some
(Qwen2-VL's patches) cannot be split back per prompt without model-specific logic.
Only yatt.rl.data calls this, and only for a dataset with images, so the processor's
transformers import stays out of ``import yatt`` (tests/yatt/test_imports.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from yatt.errors import ConfigError

if TYPE_CHECKING:
    from PIL.Image import Image

Messages = Sequence[Mapping[str, Any]]
"""Chat messages, a content being text or parts (yatt.rl.data.Messages)."""

_TEXT_OUTPUTS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})
"""Processor outputs that describe the text, not the images (the ids are re-made per batch)."""


def image_outputs(out: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A processor's outputs for the images (not the text's: ``_TEXT_OUTPUTS``), by name."""
    return {name: np.ascontiguousarray(value) for name, value in out.items() if name not in _TEXT_OUTPUTS}


def concatenated(parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Processed images of consecutive spans (a prompt's, then observations'), as one span's:
    each name's arrays concatenated along their first dimension, in order; {} for none."""
    present = [p for p in parts if p]
    return {name: np.concatenate([p[name] for p in present]) for name in present[0]} if present else {}


def png(image: Image) -> bytes:
    """``image`` encoded as PNG (lossless: decoded again, the same pixels): how a prompt's or
    an observation's images travel to an engine that processes them itself (vLLM)."""
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def decoded(images: Sequence[bytes]) -> list[Image]:
    """Encoded images (PNG, JPEG, ...) as RGB PIL images: the processor's input, the renderer's
    and vLLM's. ``ValueError`` naming the image (its index and size) for one that does not decode."""
    import io

    import PIL.Image

    out = []
    for i, data in enumerate(images):
        try:
            with PIL.Image.open(io.BytesIO(data)) as image:
                out.append(image.convert("RGB"))
        except (OSError, ValueError, PIL.Image.DecompressionBombError) as e:
            raise ValueError(f"image {i} ({len(data)} bytes) does not decode: {e}") from e
    return out


def data_url(encoded: bytes) -> str:
    """A PNG image (``png``) as a data URL, the way an image crosses JSON (an environment's
    row: ``row["images"]``; OpenAI's ``image_url`` parts take the same)."""
    import base64

    return "data:image/png;base64," + base64.b64encode(encoded).decode()


class Encoded(NamedTuple):
    """One prompt with images, processed."""

    prompt_ids: list[int]
    """Token ids, each image's placeholder expanded."""
    mm_inputs: dict[str, np.ndarray]
    """Every image output of the processor, by name, first dimension kept (images or patches)."""
    image_tokens: int
    """How many of ``prompt_ids`` are image placeholders."""


def encode(
    rows: Sequence[tuple[int, Messages, Sequence[Image]]], model_dir: str, field: str
) -> list[Encoded]:
    """``rows`` (row index, chat messages, images) processed by the processor of ``model_dir``,
    chat template applied with a generation prompt. ``ConfigError`` naming ``field`` (the
    config field the images came from) and the row when the model is text-only or the
    processor refuses a row."""
    from transformers import AutoProcessor

    first = rows[0][0]
    text_only = (
        f"{field}: row {first} has images, but the model at {model_dir!r} is text-only (no image processor); "
        "use a vision-language model with its processor, or data without images"
    )
    try:
        processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)  # type: ignore[no-untyped-call]
    except (OSError, ValueError) as e:  # no processor files at all
        raise ConfigError(text_only) from e
    if getattr(processor, "image_processor", None) is None:
        raise ConfigError(text_only)
    if getattr(processor, "chat_template", None) is None:
        raise ConfigError(
            f"{field}: row {first} has images, but the processor at {model_dir!r} has no chat template to place "
            "them with; give the model directory its processor's chat_template.jinja"
        )
    image_token = getattr(processor, "image_token_id", None)
    encoded = []
    for index, messages, images in rows:
        try:
            rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            out = processor(text=[rendered], images=list(images), return_tensors="np")
        except (ValueError, TypeError) as e:
            reason = " ".join(str(e).split())  # one line
            raise ConfigError(f"{field}: row {index}: the processor at {model_dir!r} refused it: {reason}") from e
        ids = [int(t) for t in out["input_ids"][0]]
        mm_inputs = image_outputs(out)
        encoded.append(Encoded(ids, mm_inputs, ids.count(image_token) if image_token is not None else 0))
    return encoded
