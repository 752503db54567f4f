"""Environments whose observations hold images (a vision-language policy): the image parts
a user writes, their trip from the env role, the renderer's expansion of each image into
the model's placeholder tokens (the same ids as the processor's rendering of the whole
conversation), and an episode that carries each observation's images to the policy's next
turn, into its turn records and back on a replay."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from transformers import AutoProcessor, AutoTokenizer

from protocols.codec import decode, encode
from protocols.messages import Completion, EnvReply
from workers.models import build_tiny_vlm
from yatt.errors import ConfigError
from yatt.rl.agents.envs import from_wire, images_of, normalized, to_wire
from yatt.rl.agents.episodes import EpisodeRunner, Turn
from yatt.rl.agents.games import CountRed
from yatt.rl.agents.render import Renderer
from yatt.rl.config import EnvConfig
from yatt.rl.tasks import count_red_prompts


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")


def renderer_of(model: Path, protocol: Any = "chat") -> Renderer:
    processor = AutoProcessor.from_pretrained(model)  # type: ignore[no-untyped-call]
    return Renderer(AutoTokenizer.from_pretrained(model), protocol=protocol, name="tiny-vlm", processor=processor)


def picture(colour: str) -> Image.Image:
    image = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(image).rectangle((6, 6, 24, 24), fill=colour)
    return image


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def asking(image: Any, text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


def test_an_observations_image_expands_as_the_processor_renders_the_whole_conversation(vlm: Path) -> None:
    r = renderer_of(vlm)
    first, then = normalized(asking(picture("red"), "How many?")), normalized(asking(picture("blue"), "And now?"))
    row = r.prompt(first) + r.encode("2") + r.observation(then, ended_with_eos=False)
    processor = AutoProcessor.from_pretrained(vlm)  # type: ignore[no-untyped-call]
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And now?"}]},
    ]
    text = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    whole = processor(text=[text], images=[picture("red"), picture("blue")], return_tensors="np")
    assert row == whole["input_ids"][0].tolist()
    assert row.count(processor.image_token_id) == 2 * 64  # each image's placeholder expanded once
    pixels = r.pixels(images_of(first) + images_of(then))
    assert list(pixels) == ["pixel_values"] and np.array_equal(pixels["pixel_values"], whole["pixel_values"])


def test_images_are_refused_by_a_text_model_and_by_the_raw_protocol(vlm: Path, tiny_model_dir: Path) -> None:
    obs = normalized(asking(picture("red"), "How many?"))
    text_model = Renderer(AutoTokenizer.from_pretrained(tiny_model_dir), name="tiny")
    with pytest.raises(ConfigError, match=r"holds 1 image\(s\), but tiny is a text-only model"):
        text_model.observation(obs, ended_with_eos=False)
    with pytest.raises(ConfigError, match="needs env.protocol=chat"):
        renderer_of(vlm, protocol="raw").observation(obs, ended_with_eos=False)


def test_each_form_of_image_part_a_user_writes_carries_the_same_image(tmp_path: Path) -> None:
    image = picture("red")
    data = png(image)
    path = tmp_path / "red.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    forms = [
        {"type": "image", "image": image},  # Hugging Face / TRL: a PIL image
        {"type": "image", "image": data},
        {"type": "image", "image": str(path)},
        {"type": "image", "path": str(path)},
        {"type": "image_url", "image_url": {"url": url}},  # OpenAI's chat completions
    ]
    for form in forms:
        (message,) = normalized([{"role": "user", "content": [form, {"type": "text", "text": "?"}]}])
        assert images_of([message]) == [data], form
        assert message["content"] == [{"type": "image", "image": data}, {"type": "text", "text": "?"}]
    bad = [
        ({"type": "image", "image": "https://example.com/a.png"}, ValueError, "part 0: .* not fetched"),
        ({"type": "image", "image": 3}, TypeError, "part 0: an image is a PIL image"),
        ({"type": "image", "image": str(tmp_path / "none.png")}, ValueError, "part 0: cannot read the image"),
        ({"type": "video"}, TypeError, "part 0: a content is text or a list of parts"),
    ]
    for part, error, match in bad:
        with pytest.raises(error, match=f"observation message 0 {match}"):
            normalized([{"role": "user", "content": [part]}])
    with pytest.raises(TypeError, match="message 0 needs a str 'role'"):
        normalized([{"role": "tool", "content": "4", "name": 3}])


def test_an_observation_with_images_crosses_from_the_env_role_as_bytes_beside_its_messages() -> None:
    messages = normalized([*asking(picture("red"), "How many?"), {"role": "tool", "name": "calc", "content": "4"}])
    wired, images = to_wire(messages)
    assert all(isinstance(v, str) for m in wired for v in m.values()) and images == [png(picture("red"))]
    back = decode([bytes(f) for f in encode(EnvReply(episode="e", messages=wired, images=images))])
    assert isinstance(back, EnvReply)
    assert from_wire(back.messages, back.images) == messages
    with pytest.raises(ValueError, match="0 images for more image parts"):
        from_wire(wired, [])


def scripted(answer: str, tokenizer: Any) -> Any:
    """A policy that always answers ``answer`` (no EOS); records the images it is given."""
    seen: list[dict[str, np.ndarray]] = []
    seen_encoded: list[list[bytes]] = []

    async def generate(ids: list[int], budget: int, observed: dict[str, np.ndarray], encoded: list[bytes]) -> Completion:
        seen.append(observed)
        seen_encoded.append(list(encoded))
        out = tokenizer.encode(answer, add_special_tokens=False)[:budget]
        return Completion(
            token_ids=torch.tensor(out, dtype=torch.int32), logprobs=torch.full((len(out),), -0.5),
            finish_reason="stop", policy_version_min=1, policy_version_max=1,
        )  # fmt: skip

    generate.seen = seen  # type: ignore[attr-defined]
    generate.encoded = seen_encoded  # type: ignore[attr-defined]
    return generate


def runner_of(r: Renderer, **env: Any) -> EpisodeRunner:
    config = EnvConfig(**{"class_": "yatt.rl.agents.games:CountRed", "max_turns": 3, **env})
    eos = {int(r.tokenizer.eos_token_id)}
    return EpisodeRunner(config, r, decode=lambda ids: str(r.tokenizer.decode(ids)), eos_ids=eos, max_new_tokens=4, context=512)


async def test_a_visual_episode_carries_each_observations_images_to_the_next_turn_and_its_record(vlm: Path) -> None:
    r = renderer_of(vlm)
    image_token = r.processor.image_token_id  # type: ignore[union-attr]
    row = count_red_prompts(1, 5)[0][1]
    runner = runner_of(r)
    env = CountRed()
    prompt, images = await runner.start(env, seed=0, row=row, prompt_ids=[1, 2])
    assert images is not None and len(images) == 1 and prompt.count(image_token) == 64  # reset's picture: the prompt's
    records: list[Turn] = []

    async def record(turn: Turn) -> None:
        records.append(turn)

    wrong = scripted("9", r.tokenizer)
    out = await runner.run(env, prompt, wrong, record=record)
    assert (out.info.ended, out.info.turns) == ("max_turns", 3)
    # Each wrong answer is shown the red squares alone; a turn sees every image before it.
    assert [len(seen.get("pixel_values", ())) for seen in wrong.seen] == [0, 1, 2]
    assert [len(t.obs_images) for t in records] == [1, 1, 0] and out.images == records[0].obs_images + records[1].obs_images
    assert out.ids.count(image_token) == 2 * 64 and not any(out.mask[i] for i, t in enumerate(out.ids) if t == image_token)
    assert np.array_equal(out.mm["pixel_values"], r.pixels(out.images)["pixel_values"])
    assert np.array_equal(wrong.seen[2]["pixel_values"], out.mm["pixel_values"])
    assert wrong.encoded == [[], out.images[:1], out.images]  # and encoded, for an engine that processes them (vLLM)
    hint = np.asarray(Image.open(io.BytesIO(out.images[0])).convert("RGB")).astype(int)
    red, blue = (hint[..., 0] - hint[..., 2] > 100), (hint[..., 2] - hint[..., 0] > 100)
    assert red.any() and not blue.any()  # the red squares alone

    # A resumed episode replays its records (the environment stepped again): the same row and images.
    again_env = CountRed()
    again_prompt, _ = await runner.start(again_env, seed=0, row=row, prompt_ids=[1, 2])
    again = await runner.run(again_env, again_prompt, scripted("9", r.tokenizer), recorded=records)
    assert (again.ids, again.images) == (out.ids, out.images)

    right = await runner.run(env, (await runner.start(env, seed=0, row=row, prompt_ids=[1, 2]))[0], scripted(row["answer"], r.tokenizer))
    assert (right.info.ended, right.info.turns, right.env_reward, right.images) == ("done", 1, 1.0, [])


async def test_an_observation_is_never_cut_through_its_images(vlm: Path) -> None:
    r = renderer_of(vlm)
    runner = runner_of(r, max_obs_tokens=32)  # (an image alone is 64 tokens)
    env = CountRed()
    prompt, _ = await runner.start(env, seed=0, row=count_red_prompts(1, 5)[0][1], prompt_ids=[1, 2])
    out = await runner.run(env, prompt, scripted("9", r.tokenizer))
    assert (out.info.ended, out.info.turns, out.images) == ("budget", 1, [])
    assert "not cut through its images" in out.info.detail
    assert r.processor.image_token_id not in out.ids  # type: ignore[union-attr]


async def test_a_tool_environment_shows_a_data_prompts_images(vlm: Path) -> None:
    """The built-in tool environment on VLM data: the row's images (data URLs, as the
    controller puts a prompt's into the row) come before the prompt's text in its first
    message, expanded by the processor as the data's prompt is; without them, text only."""
    from yatt.rl.agents.envs import env_factory
    from yatt.rl.vision import data_url, png

    r = renderer_of(vlm)
    config = EnvConfig(tools=["yatt.rl.agents.tools:calculator"], max_turns=2)
    runner = EpisodeRunner(config, r, decode=lambda ids: str(r.tokenizer.decode(ids)), eos_ids={int(r.tokenizer.eos_token_id)},
                           max_new_tokens=4, context=512)  # fmt: skip
    row = {"prompt": "How many red squares?", "answer": "1", "images": [data_url(png(picture("red")))]}
    prompt, images = await runner.start(env_factory(config)(), seed=0, row=row, prompt_ids=[1, 2])
    image_token = r.processor.image_token_id  # type: ignore[union-attr]
    assert images == [png(picture("red"))] and prompt.count(image_token) == 64
    assert np.array_equal(r.pixels(images)["pixel_values"], r.pixels([png(picture("red"))])["pixel_values"])
    text_only, no_images = await runner.start(env_factory(config)(), seed=0, row={**row, "images": []}, prompt_ids=[1, 2])
    assert no_images == [] and image_token not in text_only  # (its own prompt, without pictures)
