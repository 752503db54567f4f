"""Environments in Gymnasium's convention, text in and text out, and the tool environment.

A user's environment is a class named by ``env.class`` ('module:Class'), made once per
episode with ``env.kwargs``; yatt calls, as Gymnasium does (sync or ``async def``)::

    obs, info = env.reset(seed=seed, options={"row": row})   # row: the data row's fields
    obs, reward, terminated, truncated, info = env.step(action_text)

An observation is text (a user message), one chat message ``{"role", "content"}``, a list
of them, or None (reset: the data row's own prompt; step: nothing to add). A message's
content is text or a list of parts, as Hugging Face processors and OpenAI take them:
``{"type": "text", "text": ...}`` and, for a vision-language model, an image:
``{"type": "image", "image": PIL image | bytes | path}`` or OpenAI's ``{"type":
"image_url", "image_url": {"url": "data:image/png;base64,..."}}`` (no fetching: a data URL
or a local path). Images are carried as their encoded bytes (``normalized``). ``reward`` may
be None until the end. A ``gymnasium.Env`` with text observations and actions works as it
is. ``info["tools"]`` from reset (OpenAI function schemas) goes to the chat template with
the first prompt; ``info["tool_errors"]`` from a step counts in the episode's metrics.

``ToolEnv`` is the environment of ``env.tools``: the prompt with the tools described, then
each turn's tool calls run and their results returned, until a turn calls no tool (its
answer). Every environment is checked before any process starts (``check_env``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import inspect
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from yatt.errors import PluginError
from yatt.rl.agents.tools import (
    Tool,
    ToolCallError,
    ToolProtocol,
    call_tool,
    format_result,
    load_tools,
    parse_tool_calls,
    tool_instructions,
)
from yatt.rl.config import EnvConfig
from yatt.rl.vision import png
from yatt.runtime.plugins import load_plugin

Message = dict[str, Any]
"""A chat message: ``role`` and ``content`` (text, or a list of text and image parts)."""
Observation = str | Message | list[Message] | None

_PARTS = "a content is text or a list of parts: {'type': 'text', 'text': ...} or {'type': 'image', 'image': ...}"

ENV_CLASS = (
    "a class in Gymnasium's convention: reset(seed=, options=) -> (obs, info) and "
    "step(action: str) -> (obs, reward, terminated, truncated, info), sync or async"
)


class EnvFailed(Exception):
    """An environment hosted by the env role failed: it raised, its process died or hung.
    The message names the environment (or tool) and why; its episode ends as env_error."""


async def call(method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A user's ``reset``/``step``: awaited when ``async def``, else run in a worker thread
    (a slow synchronous environment does not stall the controller's other episodes, and
    its time limit can fire)."""
    if inspect.iscoroutinefunction(method):
        return await method(*args, **kwargs)
    result = await asyncio.to_thread(method, *args, **kwargs)
    return await result if inspect.isawaitable(result) else result


def supports_snapshots(env: Any) -> bool:
    """Whether an environment can be saved after a step and restored in a new instance
    (``snapshot() -> bytes`` and ``restore(state)``, both optional): a resumed episode is
    then restored from its last recorded turn's state instead of stepped again through its
    recorded actions. ``supports_snapshots``, where set, says it (an environment hosted in
    the env role)."""
    said = getattr(env, "supports_snapshots", None)
    if isinstance(said, bool):
        return said
    return callable(getattr(env, "snapshot", None)) and callable(getattr(env, "restore", None))


def messages_of(obs: Observation, *, role: str = "user") -> list[Message]:
    """An observation as chat messages (text: one message of ``role``)."""
    if obs is None:
        return []
    if isinstance(obs, str):
        return [{"role": role, "content": obs}]
    if isinstance(obs, dict):
        return [obs]
    if isinstance(obs, list) and all(isinstance(m, dict) for m in obs):
        return list(obs)
    raise TypeError(f"an observation is text, a chat message or a list of them (got {type(obs).__name__})")


def normalized(messages: list[Message]) -> list[Message]:
    """``messages`` checked (a str ``role``; a ``content`` of text or parts) with each image
    part made ``{"type": "image", "image": <its encoded bytes>}`` (a PIL image as PNG; a
    path, bytes or a data URL as they are). ``TypeError``/``ValueError`` naming the message
    and part otherwise."""
    out: list[Message] = []
    for m, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        rest = {k: v for k, v in message.items() if k != "content"}  # role, name, tool_call_id, ...
        bad = {k: type(v).__name__ for k, v in rest.items() if not isinstance(v, str)}
        if not isinstance(role, str) or bad:
            raise TypeError(f"observation message {m} needs a str 'role', its fields but 'content' text (got {message!r:.200})")
        if isinstance(content, str):
            out.append({**rest, "content": content})
            continue
        if not isinstance(content, list):
            raise TypeError(f"observation message {m}: {_PARTS} (got {type(content).__name__})")
        parts: list[dict[str, Any]] = []
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind in ("image", "image_url"):
                parts.append({"type": "image", "image": _image_bytes(part, f"observation message {m} part {p}")})
            else:
                raise TypeError(f"observation message {m} part {p}: {_PARTS} (got {part!r:.200})")
        out.append({**rest, "content": parts})
    return out


def _image_bytes(part: dict[str, Any], where: str) -> bytes:
    """An image part's encoded image: PIL (saved as PNG), bytes, a local path, or a data URL."""
    value = part["image_url"].get("url") if isinstance(part.get("image_url"), dict) else next(
        (part[k] for k in ("image", "path", "url") if part.get(k) is not None), None
    )
    if isinstance(value, bytes):
        return value
    if isinstance(value, str) and value.startswith("data:"):
        try:
            return base64.b64decode(value.split(",", 1)[1], validate=True)
        except (IndexError, binascii.Error) as e:
            raise ValueError(f"{where}: a data URL of an image must be 'data:<type>;base64,<data>' ({e})") from e
    if isinstance(value, (str, Path)):
        if "://" in str(value):
            raise ValueError(f"{where}: {str(value)!r:.100}: images are not fetched; give bytes, a PIL image, a path or a data URL")
        try:
            return Path(value).read_bytes()
        except OSError as e:
            raise ValueError(f"{where}: cannot read the image {str(value)!r:.100} ({e})") from e
    if callable(getattr(value, "save", None)):  # a PIL image
        return png(cast(Any, value))
    raise TypeError(f"{where}: an image is a PIL image, bytes, a path or a data URL (got {type(value).__name__})")


def images_of(messages: Sequence[Message]) -> list[bytes]:
    """The images of ``normalized`` messages, in order."""
    return [
        part["image"] for m in messages if isinstance(m["content"], list) for part in m["content"] if part["type"] == "image"
    ]  # fmt: skip


def to_wire(messages: list[Message]) -> tuple[list[dict[str, str]], list[bytes]]:
    """``normalized`` messages as ``EnvReply`` carries them: text messages as they are; a
    message with parts as ``{"role", "content": "", "parts": <the parts as JSON, each image
    part without its image>}``; the images, in order, beside them."""
    wired = [
        m if isinstance(m["content"], str) else {
            **m, "content": "", "parts": json.dumps([{"type": "image"} if p["type"] == "image" else p for p in m["content"]]),
        }
        for m in messages
    ]  # fmt: skip
    return wired, images_of(messages)


def from_wire(messages: list[dict[str, str]], images: list[bytes]) -> list[Message]:
    """``to_wire``'s inverse."""
    out: list[Message] = []
    used = 0
    for m in messages:
        if "parts" not in m:
            out.append(dict(m))
            continue
        rest = {k: v for k, v in m.items() if k not in ("content", "parts")}
        parts = json.loads(m["parts"])
        for p, part in enumerate(parts):
            if part["type"] == "image":
                if used == len(images):
                    raise ValueError(f"EnvReply.images: {len(images)} images for more image parts in its messages")
                parts[p] = {"type": "image", "image": images[used]}
                used += 1
        out.append({**rest, "content": parts})
    if used != len(images):
        raise ValueError(f"EnvReply.images: {len(images)} images for {used} image parts in its messages")
    return out


class ToolEnv:
    """The environment of ``env.tools``: a turn that calls tools gets their results (or an
    error the model can read: a call that does not parse, an unknown tool, bad arguments,
    a raise, a timeout); a turn that calls none ends the episode (its answer is scored)."""

    def __init__(
        self, tools: Sequence[Tool], *, protocol: ToolProtocol, timeout_s: float, instructions: str | None = None
    ) -> None:  # fmt: skip
        """``instructions``: the system message (tags; None: ``tool_instructions``'s, "": none)."""
        self.tools = {tool.name: tool for tool in tools}
        self.protocol = protocol
        self.timeout_s = timeout_s
        self.instructions = instructions

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Observation, dict[str, Any]]:
        """The data row's prompt, after a system message saying how to call the tools (tags)
        or with the tools' schemas for the chat template (hermes); a prompt with images
        (``row["images"]``, data URLs) shows them before its text, as the data's prompts do."""
        row = (options or {}).get("row", {})
        instructions = (
            tool_instructions(list(self.tools.values()), protocol=self.protocol)
            if self.instructions is None or self.protocol == "hermes" else self.instructions
        )  # fmt: skip
        messages = [{"role": "system", "content": instructions}] if instructions else []
        info = {"tools": [tool.schema for tool in self.tools.values()]} if self.protocol == "hermes" else {}
        text, images = str(row.get("prompt", "")), row.get("images") or []
        content = [*({"type": "image", "image": image} for image in images), {"type": "text", "text": text}] if images else text
        return [*messages, {"role": "user", "content": content}], info

    async def step(self, action: str) -> tuple[Observation, float | None, bool, bool, dict[str, Any]]:
        try:
            calls = parse_tool_calls(action, protocol=self.protocol)
        except ToolCallError as e:
            return [{"role": "tool", "content": _inline(str(e), self.protocol)}], None, False, False, {"tool_errors": 1}
        if not calls:
            return None, None, True, False, {}
        results = [await call_tool(self.tools, c, timeout_s=self.timeout_s) for c in calls]
        messages = [format_result(r, protocol=self.protocol, name=c.name) for c, r in zip(calls, results, strict=True)]
        return messages, None, False, False, {"tool_errors": sum(bool(r.error) for r in results)}


def _inline(text: str, protocol: ToolProtocol) -> str:
    """An error about the call itself, as the protocol returns results."""
    return f"<result>{text}</result>" if protocol == "tags" else text


EnvFactory = Callable[[], Any]


def env_factory(config: EnvConfig) -> EnvFactory:
    """What makes one environment per episode: the user's class with ``env.kwargs``, or the
    tool environment. (``env.episode``'s agent code, hosted in the env role, is made by
    ``yatt.rl.agents.hosted.agent_factory``.)
    Loading errors are ``PluginError`` naming the field and the fix."""
    if config.tools:
        tools = load_tools(config.tools)
        return lambda: ToolEnv(
            tools, protocol=config.protocol, timeout_s=config.tool_timeout_s, instructions=config.instructions
        )  # fmt: skip
    cls = load_plugin(config.class_, field="env.class", expects=ENV_CLASS)
    missing = [name for name in ("reset", "step") if not callable(getattr(cls, name, None))]
    if missing:
        raise PluginError(f"env.class: {config.class_!r} has no {' or '.join(missing)} method; it must be {ENV_CLASS}")
    kwargs = dict(config.kwargs)
    return lambda: cls(**kwargs)


def check_env(config: EnvConfig) -> None:
    """Before any process starts: the environment (or every tool) loads, and the class
    takes ``env.kwargs``; one line naming it and the fix otherwise."""
    make = env_factory(config)
    try:
        env = make()
    except Exception as e:  # a user's constructor may raise anything: it is reported, not run with
        raise PluginError(
            f"env.class: {config.class_!r} cannot be made with env.kwargs={dict(config.kwargs)} "
            f"({type(e).__name__}: {e}); fix the class or env.kwargs"
        ) from e
    close = getattr(env, "close", None)
    if callable(close):
        cast(Callable[[], None], close)()
