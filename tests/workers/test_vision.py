"""Prompts with images through the engine, the wire, the buffer and the trainer.

A tiny LLaVA (``workers.models.build_tiny_vlm``) and its processor make two prompts with
an image each; the transformers engine samples them, the buffer puts the groups into a
micro-batch, and a trainer rank (a real gloo process group of one) recomputes the
log-probs the engine reported and takes a step with the vision tower frozen.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from PIL import Image, ImageDraw
from transformers import AutoProcessor, AutoTokenizer

from protocols.codec import decode, encode
from protocols.messages import GenerateRequest, GroupKey, MicroBatch, SamplingParams, ScoredGroup
from tests.workers.test_trainer import spawn
from workers.engines.base import PromptRequest
from workers.engines.hf import HFEngine
from workers.lora import is_adapter, with_lora
from workers.models import build_tiny_vlm, build_tokenizer, load_model
from workers.trainer import Trainer
from yatt.errors import ProtocolError
from yatt.rl.agents.envs import images_of, normalized
from yatt.rl.agents.render import Renderer
from yatt.rl.config import (
    AlgorithmConfig,
    BufferConfig,
    GeneratorConfig,
    LoRAConfig,
    ModelConfig,
    TrainerConfig,
)
from yatt.rl.controller import tensors
from yatt.rl.ledger import Ledger
from yatt.rl.sampling import SamplingBuffer
from yatt.rl.vision import png

Prompt = tuple[list[int], dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")


def image_prompt(model_dir: Path, colour: str, question: str = "How many red squares?") -> Prompt:
    """A chat prompt with one image (a square of ``colour``), through the model's processor."""
    processor = AutoProcessor.from_pretrained(model_dir)  # type: ignore[no-untyped-call]
    image = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(image).rectangle((6, 6, 24, 24), fill=colour)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=[text], images=[image], return_tensors="pt")
    return out["input_ids"][0].tolist(), {"pixel_values": out["pixel_values"]}


def sampled(model_dir: Path, prompts: list[Prompt], n: int) -> list[list[Any]]:
    engine = HFEngine(str(model_dir), GeneratorConfig(), dtype="float32")
    requests = [
        PromptRequest(prompt_ids=ids, n=n, sampling=SamplingParams(max_new_tokens=6, seed=i), mm_inputs=mm)
        for i, (ids, mm) in enumerate(prompts)
    ]
    return engine.generate(requests)


def scored_group(index: int, prompt: Prompt, samples: list[Any]) -> ScoredGroup:
    ids, mm = prompt
    n = len(samples)
    return ScoredGroup(
        group_key=GroupKey(epoch=0, shard=0, prompt_index=index),
        prompt_ids=torch.tensor(ids, dtype=torch.int32),
        completion_ids=[torch.tensor(s.token_ids, dtype=torch.int32) for s in samples],
        rollout_logprobs=[torch.tensor(s.logprobs, dtype=torch.float32) for s in samples],
        rewards=torch.arange(n, dtype=torch.float32),
        advantages=torch.linspace(-1, 1, n),
        policy_versions=torch.zeros(n, dtype=torch.int64),
        finish_reasons=[s.finish_reason for s in samples],
        mm_inputs=mm,
    )


def test_the_image_changes_what_the_engine_samples_and_its_log_probs(vlm_dir: Path) -> None:
    red, blue = image_prompt(vlm_dir, "red"), image_prompt(vlm_dir, "blue")
    assert red[0] == blue[0]  # the same tokens: only the pixels differ
    engine = HFEngine(str(vlm_dir), GeneratorConfig(), dtype="float32")
    sample = sampled(vlm_dir, [red], 1)[0][0]
    on_red = engine.sequence_logprobs(red[0], sample.token_ids, red[1])
    assert on_red == pytest.approx(sample.logprobs, abs=1e-5)
    on_blue = engine.sequence_logprobs(red[0], sample.token_ids, blue[1])
    assert max(abs(a - b) for a, b in zip(on_red, on_blue, strict=True)) > 1e-4


def test_the_engine_never_samples_an_image_placeholder_even_where_it_is_likeliest(vlm_dir: Path) -> None:
    red = image_prompt(vlm_dir, "red")
    engine = HFEngine(str(vlm_dir), GeneratorConfig(), dtype="float32")
    image_token = engine._model.config.image_token_id
    # The raw logits favour the placeholder by far at every position.
    engine._model.lm_head.register_forward_hook(lambda module, args, out: out.index_add(-1, torch.tensor([image_token]), torch.full((*out.shape[:-1], 1), 50.0)))
    for greedy in (False, True):
        sampling = SamplingParams(max_new_tokens=6, seed=3, temperature=0.0 if greedy else 1.0)
        (samples,) = engine.generate([PromptRequest(prompt_ids=red[0], n=4, sampling=sampling, mm_inputs=red[1])])
        assert all(image_token not in s.token_ids for s in samples)
        for s in samples:  # the log-probs are those of the distribution sampled, which the trainer recomputes
            assert s.logprobs == pytest.approx(engine.sequence_logprobs(red[0], s.token_ids, red[1]), abs=1e-5)
            assert all(lp > -20 for lp in s.logprobs)


def encoded_square(colour: str) -> bytes:
    """``image_prompt``'s picture of ``colour``, encoded as the controller sends it to vLLM."""
    image = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(image).rectangle((6, 6, 24, 24), fill=colour)
    return png(image)


@pytest.mark.gpu
@pytest.mark.vllm
def test_vllm_samples_images_as_the_transformers_engine_does(vlm_dir: Path) -> None:
    """vLLM given the images themselves (it runs the processor; the ids' placeholders
    collapsed to one per image) reports the log-probs the transformers engine computes from
    the processed pixels, its own prompt log-probs agree with what it sampled, the picture
    changes them, and it never samples a placeholder. CPU: tests/workers/engines/test_vllm_images.py."""
    from workers.engines.vllm_engine import VLLMEngine

    red, blue = image_prompt(vlm_dir, "red"), image_prompt(vlm_dir, "blue")
    config = GeneratorConfig(backend="vllm", vllm_max_model_len=256, vllm_gpu_memory_utilization=0.3, seed=0)
    engine = VLLMEngine(str(vlm_dir), config, device="cuda", dtype="float32")
    try:
        sampling = SamplingParams(max_new_tokens=6, seed=3)
        request = PromptRequest(prompt_ids=red[0], n=4, sampling=sampling, mm_inputs=red[1], images=[encoded_square("red")])
        (samples,) = engine.generate([request])
        image_token = int(AutoProcessor.from_pretrained(vlm_dir).image_token_id)  # type: ignore[no-untyped-call]
        reference = HFEngine(str(vlm_dir), GeneratorConfig(), device="cuda", dtype="float32")
        for s in samples:
            assert image_token not in s.token_ids
            own = engine.sequence_logprobs(red[0], s.token_ids, red[1], images=[encoded_square("red")])
            assert s.logprobs == pytest.approx(own, abs=1e-3)
            assert s.logprobs == pytest.approx(reference.sequence_logprobs(red[0], s.token_ids, red[1]), abs=1e-3)
        on_blue = engine.sequence_logprobs(red[0], samples[0].token_ids, blue[1], images=[encoded_square("blue")])
        assert max(abs(a - b) for a, b in zip(on_blue, samples[0].logprobs, strict=True)) > 1e-4
    finally:
        engine.close()


def test_a_text_engine_refuses_images_by_name(tiny_model_dir: Path, vlm_dir: Path) -> None:
    ids, mm = image_prompt(vlm_dir, "red")
    engine = HFEngine(str(tiny_model_dir), GeneratorConfig(), dtype="float32")
    with pytest.raises(ProtocolError, match=r"requests\[0\] carries images .* text model"):
        engine.generate([PromptRequest(prompt_ids=[1, 2, 3], n=1, sampling=SamplingParams(max_new_tokens=2), mm_inputs=mm)])


def test_pixel_values_cross_the_wire_as_their_own_frame_without_pickle(vlm_dir: Path) -> None:
    ids, mm = image_prompt(vlm_dir, "red")
    msg = GenerateRequest(
        group_key=GroupKey(epoch=0, shard=0, prompt_index=0), prompt_ids=torch.tensor(ids, dtype=torch.int32), n=2,
        sampling=SamplingParams(), mm_inputs=mm,
    )  # fmt: skip
    frames = encode(msg)
    pixels = mm["pixel_values"]
    # Zero-copy: one frame is a view of the pixel tensor's own memory.
    views = [f for f in frames[2:] if isinstance(f, memoryview) and f.nbytes == pixels.numel() * 4]
    assert len(views) == 1 and bytes(views[0]) == pixels.numpy().tobytes()
    assert b"pickle" not in bytes(frames[1]) and b"\x80\x04" not in bytes(frames[1])  # the header: plain msgpack
    back = decode([bytes(f) for f in frames])
    assert isinstance(back, GenerateRequest)
    assert torch.equal(back.mm_inputs["pixel_values"], pixels) and back.mm_inputs["pixel_values"].shape == (1, 3, 56, 56)


def test_a_micro_batch_carries_each_rows_images_in_row_order(vlm_dir: Path) -> None:
    red, blue = image_prompt(vlm_dir, "red"), image_prompt(vlm_dir, "blue")
    samples = sampled(vlm_dir, [red, blue], 2)
    (mb,) = one_micro_batch([scored_group(0, red, samples[0]), scored_group(1, blue, samples[1])])
    pixels = mb.mm_inputs["pixel_values"]
    assert pixels.shape == (4, 3, 56, 56)
    for row, key in enumerate(mb.group_keys):
        assert torch.equal(pixels[row], (red if key.prompt_index == 0 else blue)[1]["pixel_values"][0])


def one_micro_batch(groups: list[ScoredGroup]) -> list[MicroBatch]:
    """The buffer's micro-batches of ``groups`` for one rank (its own assembly, no ledger needed)."""
    with tempfile.TemporaryDirectory() as tmp:
        buffer = SamplingBuffer(
            BufferConfig(filter="none"), num_prompts=len(groups), num_shards=1, world_size=1, seed=0,
            ledger=Ledger(Path(tmp) / "ledger.db"),
        )  # fmt: skip
        return buffer._split(groups, step=0, index=0)


def _train_with_images(rank: int, model_dir: str, out: str, train_vision: bool) -> None:
    red, blue = image_prompt(Path(model_dir), "red"), image_prompt(Path(model_dir), "blue")
    samples = sampled(Path(model_dir), [red, blue], 2)
    (mb,) = one_micro_batch([scored_group(0, red, samples[0]), scored_group(1, blue, samples[1])])
    model = ModelConfig(dtype="float32", train_vision=train_vision)
    trainer = Trainer(model, TrainerConfig(lr=1e-3, grad_clip=0.0), AlgorithmConfig(), model_path=model_dir)
    before = {n: p.detach().full_tensor().clone() for n, p in trainer.policy.named_parameters()}  # type: ignore[attr-defined]
    logprobs = trainer.logprobs(mb.input_ids, mb.attention_mask, mb.mm_inputs)
    no_images = trainer.logprobs(mb.input_ids, mb.attention_mask)
    metrics = trainer.train_step([mb])
    after = {n: p.detach().full_tensor() for n, p in trainer.policy.named_parameters()}  # type: ignore[attr-defined]
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    torch.save({"mb": mb, "logprobs": logprobs, "no_images": no_images, "metrics": metrics, "moved": moved}, out)


def train_with_images(model_dir: Path, *, train_vision: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.pt")
        spawn(_train_with_images, 1, str(model_dir), out, train_vision)
        result: dict[str, Any] = torch.load(out, weights_only=False)
        return result


def test_the_trainer_recomputes_the_engines_log_probs_with_the_images(vlm_dir: Path) -> None:
    r = train_with_images(vlm_dir, train_vision=False)
    mb, logprobs = r["mb"], r["logprobs"]
    mask = mb.loss_mask
    torch.testing.assert_close(logprobs[mask], mb.rollout_logprobs[mask], rtol=1e-5, atol=1e-5)
    assert (r["no_images"][mask] - logprobs[mask]).abs().max() > 1e-4  # the images were read
    assert r["metrics"]["grad_norm"] > 0
    # The vision tower stays frozen; the projector and the language model train.
    assert r["moved"] and not any(".vision_tower." in n for n in r["moved"])
    assert any(".multi_modal_projector." in n for n in r["moved"]) and "lm_head.weight" in r["moved"]


def test_train_vision_trains_the_vision_tower_too(vlm_dir: Path) -> None:
    r = train_with_images(vlm_dir, train_vision=True)
    assert any(".vision_tower." in n for n in r["moved"])


# ---------------------------------------------------------------- images in observations


def episode_group(model_dir: Path) -> ScoredGroup:
    """Two episodes of one prompt (a red square), each shown a picture of its own after its
    first turn (blue, green), both turns sampled by the engine with every image before them."""
    processor = AutoProcessor.from_pretrained(model_dir)  # type: ignore[no-untyped-call]
    r = Renderer(AutoTokenizer.from_pretrained(model_dir), processor=processor, name="tiny-vlm")
    first = normalized([{"role": "user", "content": [{"type": "image", "image": square("red")}, {"type": "text", "text": "Count."}]}])
    prompt_ids, prompt_mm = r.prompt(first), tensors(r.pixels(images_of(first)))
    engine = HFEngine(str(model_dir), GeneratorConfig(), dtype="float32")

    def turn(ids: list[int], mm: dict[str, torch.Tensor], seed: int) -> Any:
        sampling = SamplingParams(max_new_tokens=4, seed=seed)
        return engine.generate([PromptRequest(prompt_ids=ids, n=1, sampling=sampling, mm_inputs=mm)])[0][0]

    completions, masks, logprobs, observed = [], [], [], []
    for i, colour in enumerate(("blue", "green")):
        one = turn(prompt_ids, prompt_mm, seed=i)
        obs = normalized([{"role": "user", "content": [{"type": "image", "image": square(colour)}, {"type": "text", "text": "Now?"}]}])
        obs_ids, obs_mm = r.observation(obs, ended_with_eos=False), tensors(r.pixels(images_of(obs)))
        assert obs_ids.count(processor.image_token_id) == 64
        both = {"pixel_values": torch.cat([prompt_mm["pixel_values"], obs_mm["pixel_values"]])}
        two = turn(prompt_ids + one.token_ids + obs_ids, both, seed=10 + i)
        completions.append(one.token_ids + obs_ids + two.token_ids)
        masks.append([True] * len(one.token_ids) + [False] * len(obs_ids) + [True] * len(two.token_ids))
        logprobs.append(one.logprobs + [0.0] * len(obs_ids) + two.logprobs)
        observed.append(obs_mm)
    return ScoredGroup(
        group_key=GroupKey(epoch=0, shard=0, prompt_index=0), prompt_ids=torch.tensor(prompt_ids, dtype=torch.int32),
        completion_ids=[torch.tensor(c, dtype=torch.int32) for c in completions],
        rollout_logprobs=[torch.tensor(lp, dtype=torch.float32) for lp in logprobs],
        rewards=torch.tensor([0.0, 1.0]), advantages=torch.tensor([-1.0, 1.0]), policy_versions=torch.zeros(2, dtype=torch.int64),
        finish_reasons=["stop", "stop"], completion_masks=[torch.tensor(m) for m in masks],
        token_versions=[torch.zeros(len(c), dtype=torch.int64) for c in completions],
        mm_inputs=prompt_mm, sample_mm_inputs=observed,
    )  # fmt: skip


def square(colour: str) -> Image.Image:
    image = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(image).rectangle((6, 6, 24, 24), fill=colour)
    return image


def _train_episodes(rank: int, model_dir: str, out: str) -> None:
    group = episode_group(Path(model_dir))
    (mb,) = one_micro_batch([group])
    trainer = Trainer(ModelConfig(dtype="float32"), TrainerConfig(lr=1e-3, grad_clip=0.0), AlgorithmConfig(), model_path=model_dir)
    logprobs = trainer.logprobs(mb.input_ids, mb.attention_mask, mb.mm_inputs)
    swapped = {"pixel_values": mb.mm_inputs["pixel_values"][[0, 2, 1, 3]]}  # (each row's prompt image after its observation's)
    torch.save({"group": group, "mb": mb, "logprobs": logprobs, "swapped": trainer.logprobs(mb.input_ids, mb.attention_mask, swapped)}, out)


def test_an_episodes_observation_images_reach_the_trainer_after_its_prompts_in_row_order(vlm_dir: Path, tmp_path: Path) -> None:
    """The trainer recomputes both turns' log-probs of each episode (the second sampled with
    the prompt's picture and the episode's own observation picture) from the micro-batch."""
    out = str(tmp_path / "out.pt")
    spawn(_train_episodes, 1, str(vlm_dir), out)
    r = torch.load(out, weights_only=False)
    mb, group = r["mb"], r["group"]
    pixels = mb.mm_inputs["pixel_values"]
    assert pixels.shape == (4, 3, 56, 56)
    for row, sample in enumerate(mb_samples(mb, group)):  # each row: the prompt's picture, then its sample's
        assert torch.equal(pixels[2 * row], group.mm_inputs["pixel_values"][0])
        assert torch.equal(pixels[2 * row + 1], group.sample_mm_inputs[sample]["pixel_values"][0])
    mask = mb.loss_mask
    torch.testing.assert_close(r["logprobs"][mask], mb.rollout_logprobs[mask], rtol=1e-5, atol=1e-5)
    assert (r["swapped"][mask] - r["logprobs"][mask]).abs().max() > 1e-4  # the order is read


def mb_samples(mb: MicroBatch, group: ScoredGroup) -> list[int]:
    """Which sample of ``group`` each micro-batch row holds (by its ids)."""
    p, ends = len(group.prompt_ids), mb.attention_mask.sum(dim=1).tolist()
    samples = [i for row, end in enumerate(ends) for i, c in enumerate(group.completion_ids) if torch.equal(mb.input_ids[row, p:end], c.long())]
    assert sorted(samples) == [0, 1]
    return samples


# ---------------------------------------------------------------- a second family: Qwen2-VL

QWEN_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_tiny_qwen2_vl(out: Path) -> Path:
    """A tiny Qwen2-VL (its processor needs torchvision, absent here: prompts are made by
    ``qwen_prompt`` from its PIL image processor, as Qwen2VLProcessor would make them)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL})
    start, end, image, video = cast(list[int], tokenizer.convert_tokens_to_ids(QWEN_SPECIAL))
    special = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    text = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, **special,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},  # 3D rope: 16 = head_dim / 2
    )  # fmt: skip
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen2VLConfig(
        text_config=text, vision_config=vision, vision_start_token_id=start, vision_end_token_id=end,
        image_token_id=image, video_token_id=video, tie_word_embeddings=False,
    )  # fmt: skip
    for name, value in special.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(out)  # type: ignore[no-untyped-call]
    tokenizer.save_pretrained(out)
    return out


def qwen_prompt(model_dir: Path, colour: str, question: str) -> Prompt:
    """A prompt with one 56x56 image: Qwen2-VL's patches [16, 1176], its grid [1, 3], and
    its 4 merged placeholder tokens between the vision start and end tokens."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    start, end, image_token, _ = cast(list[int], tokenizer.convert_tokens_to_ids(QWEN_SPECIAL))
    image = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(image).rectangle((6, 6, 24, 24), fill=colour)
    out = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56)(images=[image], return_tensors="pt")
    placeholders = int(out["image_grid_thw"].prod()) // 4  # merge 2 x 2
    ids = [
        *tokenizer("<|user|>", add_special_tokens=False)["input_ids"], start, *[image_token] * placeholders, end,
        *tokenizer(question + "\n<|assistant|>", add_special_tokens=False)["input_ids"],
    ]  # fmt: skip
    return ids, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def _qwen_logprobs(rank: int, model_dir: str, out: str) -> None:
    red, blue = qwen_prompt(Path(model_dir), "red", "How many?"), qwen_prompt(Path(model_dir), "blue", "How many red squares are there?")
    samples = sampled(Path(model_dir), [red, blue], 2)
    (mb,) = one_micro_batch([scored_group(0, red, samples[0]), scored_group(1, blue, samples[1])])
    trainer = Trainer(ModelConfig(dtype="float32"), TrainerConfig(lr=1e-3, grad_clip=0.0), AlgorithmConfig(), model_path=model_dir)
    torch.save({"mb": mb, "logprobs": trainer.logprobs(mb.input_ids, mb.attention_mask, mb.mm_inputs),
                "metrics": trainer.train_step([mb])}, out)  # fmt: skip


def test_qwen2_vl_patches_and_grids_agree_between_engine_and_trainer(tmp_path: Path) -> None:
    """Two mm_inputs per prompt (patches, grid), prompts of different lengths (left-padded in
    the engine, right-padded in the trainer), 3D rope positions from mm_token_type_ids."""
    model_dir = build_tiny_qwen2_vl(tmp_path / "qwen2-vl")
    out = str(tmp_path / "out.pt")
    spawn(_qwen_logprobs, 1, str(model_dir), out)
    r = torch.load(out, weights_only=False)
    mb = r["mb"]
    assert mb.mm_inputs["pixel_values"].shape == (4 * 16, 1176) and mb.mm_inputs["image_grid_thw"].tolist() == [[1, 4, 4]] * 4
    mask = mb.loss_mask
    torch.testing.assert_close(r["logprobs"][mask], mb.rollout_logprobs[mask], rtol=1e-5, atol=1e-5)
    assert r["metrics"]["grad_norm"] > 0


def test_lora_adapts_the_language_model_and_leaves_the_vision_tower_alone(vlm_dir: Path) -> None:
    wrapped = with_lora(load_model(vlm_dir), LoRAConfig(rank=4))
    adapters = [name for name, _ in wrapped.named_parameters() if is_adapter(name)]
    assert len(adapters) == 2 * 2 * 4  # 2 layers x q, k, v, o x (A, B)
    assert all(".language_model." in name for name in adapters), adapters
