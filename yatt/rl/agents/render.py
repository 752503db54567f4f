"""Observation messages -> the token ids that continue a policy's sampled turn.

"Tokens trained are tokens sampled": an episode's row is prompt | generated | observation |
generated | ..., where every generated span is the policy's own ids, never decoded and
re-encoded. Only what the environment says (tool results, user messages) is rendered here,
and it is rendered so that the row reads as the chat template's rendering of the whole
conversation. The boundary rules:

- ``chat`` protocol (each observation is new messages in the chat template's format). An
  observation's ids are exactly the text the template writes between the end of the policy's
  sampled content and the start of the next assistant content: the rest of the assistant's
  end-of-turn text E, the new messages, the next assistant turn's generation prompt. The
  renderer learns that text from the template itself (``apply_chat_template(tokenize=False)``
  on synthetic conversations whose contents are distinctive placeholders, and string
  differences), so it works for any template whose rendering of a conversation extends its
  rendering of each prefix; ``self_check`` refuses the others at start-up.
- The EOS. E is what the template writes after an assistant's content (ChatML:
  ``<|im_end|>\\n``). Three cases, decided once from the template:

  * E begins with the tokenizer's EOS text (ChatML, whose EOS is ``<|im_end|>``): a turn
    that ended by sampling EOS already holds it, so only the rest of E is appended; a turn
    that stopped on a stop string (``</tool>``, no EOS) gets all of E.
  * E does not contain the EOS text at all (the repo's tiny template ``<|role|>content\\n``
    never writes its ``<|eos|>``): the sampled EOS stays in the row, since it was sampled
    and is trained, and all of E follows it. The row then holds one id per EOS-ended turn
    that the template's own rendering lacks; nothing else differs.
  * E holds the EOS text after other text: a turn that ended with EOS lacks that text and
    cannot be continued as the template renders it; refused (``ConfigError``).

- ``raw`` protocol (a tag protocol inline in one assistant turn, ``<tool>..</tool>`` then
  ``<result>..</result>``): an observation is its messages' contents concatenated and encoded
  with ``add_special_tokens=False``, nothing else; the environment writes the tags.
- The first prompt is the template's own tokenization of the messages with a generation
  prompt, the same ids as a single-turn prompt; without a chat template (raw protocol only),
  the messages' contents joined by a blank line and encoded with the tokenizer's special
  tokens, as ``yatt.rl.data`` encodes plain-text prompts.

- Images (a vision-language model; ``chat`` only): an observation's image parts are written
  by the template as its image placeholder, and the model's processor expands each into the
  model's count of image tokens (``observation``; the first prompt too); ``pixels`` gives
  the images' tensors (``pixel_values``, ...) that go beside the ids, made from the same
  encoded images on a replay. An image's placeholder tokens are never cut.

This module needs only a tokenizer (and, for images, the model's processor) and is pure: no
model, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

import jinja2  # transformers renders chat templates with it (a requirement of torch)
import numpy as np

from yatt.errors import ConfigError
from yatt.rl.agents.envs import Message, images_of
from yatt.rl.vision import decoded, image_outputs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

__all__ = ["Protocol", "Renderer", "self_check"]

Protocol = Literal["chat", "raw"]
"""chat: observations are chat-template messages; raw: observations are inline text."""

_PROTOCOLS: tuple[Protocol, ...] = ("chat", "raw")
_OBSERVATION_ROLES = ("tool", "user", "system")
"""Roles probed after an assistant turn; an environment answers with tool or user messages."""

# Distinctive placeholder contents: letters and digits only, so no template trims or
# escapes them, and no real content contains them.
_SYSTEM, _USER, _ASSISTANT, _NEW = "yattSYSq7z", "yattUSERq7z", "yattASSTq7z", "yattNEWq7z"

_TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError)
"""What rendering a chat template raises: its own raise_exception, a bad variable, a missing template."""

_FIX = (
    "the chat template rewrites history or merges tokens across a turn boundary; use env.protocol=raw, "
    "or a template whose rendering of a conversation extends its rendering of each prefix"
)


class Renderer:
    """Renders a conversation's first prompt and each observation into token ids.

    The chat pieces are derived once here from the template (see the module docstring);
    ``observation`` then costs one template rendering of a short synthetic conversation and
    one encoding. Raises ``ConfigError`` naming the template for what it cannot support."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, *, protocol: Protocol = "chat", name: str = "",
        processor: ProcessorMixin | None = None,
    ) -> None:  # fmt: skip
        """``processor``: a vision-language model's (its image processor expands observations'
        images); None: observations with images are refused."""
        if protocol not in _PROTOCOLS:
            raise ConfigError(f"env.protocol must be one of {', '.join(_PROTOCOLS)} (got {protocol!r})")
        self.tokenizer = tokenizer
        self.processor = processor
        self._last: tuple[tuple[bytes, ...], dict[str, np.ndarray]] | None = None  # the last images expanded, processed
        self.protocol: Protocol = protocol
        self.name = name or str(getattr(tokenizer, "name_or_path", "") or "") or "the tokenizer"
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        eos = getattr(tokenizer, "eos_token", None)
        self.eos_text: str = eos if isinstance(eos, str) else ""
        eos_id = getattr(tokenizer, "eos_token_id", None)
        self.eos_id: int | None = eos_id if isinstance(eos_id, int) else None
        self._prefix: list[dict[str, str]] = []
        self._head = ""  # the prefix's rendering up to the end of its assistant's content
        self._end_of_turn = ""
        self._eos_starts_end_of_turn = False
        self.roles: frozenset[str] = frozenset()
        if protocol == "chat":
            if not self.has_template:
                raise ConfigError(
                    f"the tokenizer of {self.name} has no chat template, and env.protocol=chat renders "
                    "observations with it; use env.protocol=raw, or a model with a chat template"
                )
            self._derive_chat_pieces()

    @property
    def end_of_turn(self) -> str:
        """E: what the template writes right after an assistant's content before anything else
        (the common start of what follows it when the conversation ends there and when a user
        message follows). ChatML: ``<|im_end|>\\n``; the tiny template: ``\\n``. Empty for raw."""
        return self._end_of_turn

    @property
    def eos_in_template(self) -> bool:
        """Whether E begins with the EOS text: then an EOS-ended turn's sampled EOS is the
        template's, and the row equals the template's rendering; else the sampled EOS is an
        id the template's rendering lacks (see the module docstring)."""
        return self._eos_starts_end_of_turn

    def _derive_chat_pieces(self) -> None:
        """Finds a synthetic prefix the template renders an observation after, E, the EOS
        case and the roles an observation may have (see the module docstring)."""
        self._prefix, after_user = self._find_prefix()
        reference = self._render(self._prefix, generation=False)
        content_end = reference.index(_ASSISTANT) + len(_ASSISTANT)
        self._head = reference[:content_end]
        if not after_user.startswith(self._head):
            raise ConfigError(
                f"the chat template of {self.name} renders an assistant's turn differently once a message "
                f"follows it; {_FIX}"
            )
        final_tail, before_user = reference[content_end:], after_user[content_end:].split(_NEW)[0]
        length = 0
        while length < min(len(final_tail), len(before_user)) and final_tail[length] == before_user[length]:
            length += 1
        self._end_of_turn = final_tail[:length]
        if self.eos_text and before_user.startswith(self.eos_text):
            self._eos_starts_end_of_turn = True
        elif self.eos_text and self.eos_text in before_user:
            raise ConfigError(
                f"the chat template of {self.name} writes {before_user.split(self.eos_text)[0]!r} between an "
                f"assistant's content and its end-of-turn {self.eos_text!r}, so a turn the policy ended with EOS "
                "cannot be continued as the template renders it; use env.protocol=raw"
            )
        roles = []
        for role in _OBSERVATION_ROLES:
            try:
                text = self._render([*self._prefix, {"role": role, "content": _NEW}], generation=True)
            except ConfigError:
                continue
            if text.startswith(self._head) and _NEW in text[len(self._head) :]:
                roles.append(role)
        self.roles = frozenset(roles)

    def _find_prefix(self) -> tuple[list[dict[str, str]], str]:
        """The shortest synthetic conversation ending with an assistant message after which
        the template renders a user message: (user, assistant), or (system, user, assistant)
        for templates that need a system message first. Returns it and that rendering."""
        user, assistant = {"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}
        candidates = [[user, assistant], [{"role": "system", "content": _SYSTEM}, user, assistant]]
        problem = ""
        for prefix in candidates:
            try:
                text = self._render([*prefix, {"role": "user", "content": _NEW}], generation=True)
            except ConfigError as e:
                problem = str(e)
                continue
            if _ASSISTANT in text and _NEW in text.split(_ASSISTANT, 1)[1]:
                return prefix, text
            problem = "the rendering does not hold the messages' contents"
        raise ConfigError(
            f"the chat template of {self.name} cannot render a user message after an assistant's turn, with or "
            f"without a system message first ({problem}); use env.protocol=raw"
        )

    def prompt(
        self, messages: list[Message], *, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The first prompt's ids: the template's own tokenization with a generation prompt
        (the same ids as a single-turn prompt). Without a chat template (raw protocol only):
        the contents joined by a blank line, encoded with the tokenizer's special tokens, as
        ``yatt.rl.data`` encodes plain-text prompts; ``tools`` is then ignored (the
        environment's instructions say how to call them)."""
        _check_parts(messages)
        images = images_of(messages)
        self._takes(images)
        if not self.has_template:
            if images:
                raise ConfigError(f"a first observation with images needs a chat template; {self.name} has none")
            encoded = self.tokenizer("\n\n".join(m["content"] for m in messages), add_special_tokens=True)
            return _input_ids(encoded)
        schemas: list[dict[Any, Any] | Callable[..., Any]] | None = None if tools is None else [*tools]
        try:
            out = self.tokenizer.apply_chat_template(
                messages, tools=schemas, add_generation_prompt=True, tokenize=not images
            )
        except _TEMPLATE_ERRORS as e:
            raise ConfigError(f"the chat template of {self.name} cannot render the prompt: {e}") from e
        # (with images: the processor's tokenization, as yatt.rl.vision makes a data prompt's)
        return self._expanded(cast(str, out), images, special=True) if images else _input_ids(out)

    def observation(self, messages: list[Message], *, ended_with_eos: bool) -> list[int]:
        """The ids to append after a policy turn (see the module docstring for the rules).

        chat: the rest of the assistant's end-of-turn (all of it when the turn did not end
        with EOS, or when the template never writes EOS), the messages as the template renders
        them after an assistant's turn, the next assistant's generation prompt. raw: the
        contents concatenated; ``ended_with_eos`` is not used. Rendered without the prompt's
        tool schemas: the templates seen write those into the system part only."""
        for message in messages:
            if not isinstance(message.get("content"), (str, list)) or not isinstance(message.get("role"), str):
                raise ConfigError(
                    f"an observation message needs a str 'role' and a 'content' of text or parts (got {message!r:.200})"
                )
        _check_parts(messages)
        images = images_of(messages)
        self._takes(images)
        if self.protocol == "raw":
            if images:
                raise ConfigError("an observation with images needs env.protocol=chat (its chat template places them)")
            return self.encode("".join(m["content"] for m in messages))
        if not messages:
            raise ConfigError(f"an observation in env.protocol=chat needs at least one message ({self.name})")
        unsupported = sorted({m["role"] for m in messages} - self.roles)
        if unsupported:
            raise ConfigError(
                f"the chat template of {self.name} does not render a {unsupported[0]!r} message after an "
                f"assistant's turn (it renders {', '.join(sorted(self.roles)) or 'none'}); answer with a "
                "supported role, or use env.protocol=raw"
            )
        text = self._render([*self._prefix, *messages], generation=True)
        if not text.startswith(self._head):
            raise ConfigError(
                f"the chat template of {self.name} renders an assistant's turn differently once messages follow "
                f"it; {_FIX}"
            )
        continuation = text[len(self._head) :]
        if ended_with_eos and self._eos_starts_end_of_turn:
            if not continuation.startswith(self.eos_text):
                raise ConfigError(
                    f"the chat template of {self.name} does not end an assistant's turn with {self.eos_text!r} "
                    f"before a {messages[0]['role']!r} message, so a turn the policy ended with EOS cannot be "
                    "continued as the template renders it; use env.protocol=raw"
                )
            continuation = continuation[len(self.eos_text) :]
        return self._expanded(continuation, images, special=False) if images else self.encode(continuation)

    def _expanded(self, text: str, images: list[bytes], *, special: bool) -> list[int]:
        """``text`` (the template's, one placeholder per image) encoded by the processor, each
        image's placeholder expanded to the model's count of image tokens for it."""
        self._takes(images)
        assert self.processor is not None  # (``_takes`` refused images without one)
        try:
            out = self.processor(
                text=[text], images=_decoded(images), add_special_tokens=special, return_tensors="np"
            )  # fmt: skip
        except (ValueError, TypeError) as e:
            raise ConfigError(f"the processor of {self.name} refused an observation's {len(images)} image(s): {' '.join(str(e).split())}") from e
        self._last = (tuple(images), image_outputs(out))  # (``pixels`` of the same images next: not processed again)
        return [int(t) for t in out["input_ids"][0]]

    def _takes(self, images: list[bytes]) -> None:
        """Refuses images where there is no image processor to expand them."""
        if images and (self.processor is None or getattr(self.processor, "image_processor", None) is None):
            raise ConfigError(
                f"an observation holds {len(images)} image(s), but {self.name} is a text-only model (no image "
                "processor); use a vision-language model, or observations without images"
            )

    def pixels(self, images: Sequence[bytes]) -> dict[str, np.ndarray]:
        """The processor's tensors for ``images`` (encoded), by name, first dimension per image
        or patch: what the model takes beside the ids that ``observation`` expanded; {} for none."""
        if not images:
            return {}
        if self._last is not None and self._last[0] == tuple(images):
            return self._last[1]
        assert self.processor is not None  # (``observation`` refused images without one)
        token = getattr(self.processor, "image_token", None)
        return image_outputs(self.processor(text=[str(token) * len(images)], images=_decoded(images), return_tensors="np"))

    def encode(self, text: str) -> list[int]:
        """Text -> ids without the tokenizer's added BOS/EOS; special tokens written in the
        text (``<|im_start|>``) become their single ids, as in the template's tokenization."""
        return _input_ids(self.tokenizer(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text with special tokens kept and no space clean-up (for checks and errors)."""
        return str(
            self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )

    def template_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The template's own tokenization of a whole conversation, no generation prompt:
        what ``self_check`` compares the turn-by-turn ids with."""
        try:
            out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
        except _TEMPLATE_ERRORS as e:
            raise ConfigError(f"the chat template of {self.name} cannot render a conversation: {e}") from e
        return _input_ids(out)

    def _render(self, messages: list[Message], *, generation: bool) -> str:
        """The template's text for ``messages``; its errors as ``ConfigError`` naming it."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation, tokenize=False
            )
        except _TEMPLATE_ERRORS as e:
            roles = ", ".join(m["role"] for m in messages)
            raise ConfigError(f"the chat template of {self.name} cannot render roles ({roles}): {e}") from e
        if not isinstance(text, str):
            raise ConfigError(f"the chat template of {self.name} rendered {type(text).__name__}, not text")
        return text


def _check_parts(messages: list[Message]) -> None:
    """A content of parts holds text parts and images as ``normalized`` makes them (bytes)."""
    for m, message in enumerate(messages):
        content = message.get("content")
        for p, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if not (kind == "text" and isinstance(part.get("text"), str)) and not (kind == "image" and isinstance(part.get("image"), bytes)):
                raise ConfigError(
                    f"message {m} part {p} is neither {{'type': 'text', 'text': str}} nor an image as "
                    f"yatt.rl.agents.envs.normalized makes it (got {part!r:.120})"
                )


def _decoded(images: Sequence[bytes]) -> list[Any]:
    """An observation's encoded images as RGB PIL images; ``ConfigError`` for one that does not decode."""
    try:
        return decoded(images)
    except ValueError as e:
        raise ConfigError(f"an observation's {e}") from e


def _input_ids(out: object) -> list[int]:
    """The ids of one encoding: transformers 5 returns a BatchEncoding (a mapping), earlier
    versions a list."""
    ids = out["input_ids"] if isinstance(out, Mapping) else out
    return [int(t) for t in cast(Sequence[int], ids)]


# The self-check's conversation: plausible contents with digits, newlines, a reasoning span
# (a template that drops earlier reasoning rewrites history) and tool calls. Assistant
# contents begin with a letter and end without whitespace: a turn's sampled ids meet the
# template's text there, and a tokenizer merging across that seam would only make the
# check's stand-in encoding of the content differ, not the rendered observations.
_CALL_1 = '<tool>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool>'
_CALL_2 = '<tool>{"name": "mul", "arguments": {"a": 42, "b": 3}}</tool>'
_CHECK_SYSTEM = "You are a careful assistant.\nUse the tools when a sum or product is needed."
_CHECK_CONVERSATION: list[tuple[str, str]] = [
    ("user", "What is (12 + 30) * 3?\nAnswer with one number."),
    ("assistant", f"Let me think. <think>12 + 30 first, then times 3.</think>\nI will add first.\n{_CALL_1}"),
    ("tool", '{"result": 42}'),
    ("assistant", f"The sum is 42.\nNow the product.\n{_CALL_2}"),
    ("tool", '{"result": 126}'),
    ("tool", "note: 2 calls used, 8 left"),
    ("assistant", "So (12 + 30) * 3 = 126.\nThe answer is 126."),
    ("user", "And 126 - 6?"),
    ("assistant", "Sure. <think>126 - 6 = 120</think>\n120"),
]


def self_check(renderer: Renderer) -> None:
    """Refuses to start (``ConfigError``, one line) where rendering turn by turn would not
    give the row the template gives the whole conversation.

    chat: a synthetic conversation (system when the template takes one, user, assistant,
    tool, assistant, tool, tool, assistant, user, assistant) is built both ways, once with
    every turn ending with EOS and once with every turn ending on a stop string: (1) the
    template's ``apply_chat_template(whole conversation, tokenize=True)``; (2) ``prompt`` +
    the encoded assistant content [+ EOS] + ``observation`` + ... The ids must be equal over
    the turn-by-turn length (the template may add a trailing end-of-turn), with the sampled
    EOS ids removed where the template never writes EOS. raw: see ``_check_raw``."""
    if renderer.protocol == "raw":
        _check_raw(renderer)
        return
    conversation = _chat_check_conversation(renderer)
    for ended_with_eos in (True, False):
        row, template = _both_ways(renderer, conversation, ended_with_eos)
        at = _first_difference(template, row)
        if at is not None:
            ending = "with EOS" if ended_with_eos else "on a stop string"
            raise ConfigError(
                f"the chat template of {renderer.name} fails the multi-turn check (env.protocol=chat, turns ending "
                f"{ending}): the ids built turn by turn differ from the template's rendering of the whole "
                f"conversation at token {at}: template {_context(renderer, template, at)}, turn by turn "
                f"{_context(renderer, row, at)}; {_FIX}"
            )


def _chat_check_conversation(renderer: Renderer) -> list[dict[str, str]]:
    """The check's conversation in the roles the template takes: a system message when it
    renders one first, tool results as one user message where it has no tool role (an
    environment then answers with user messages, and ``observation`` refuses tool ones)."""
    messages: list[dict[str, str]] = []
    for role, content in _CHECK_CONVERSATION:
        if role == "tool" and "tool" not in renderer.roles:
            if messages[-1]["role"] == "user":
                messages[-1] = {"role": "user", "content": messages[-1]["content"] + "\n" + content}
                continue
            role = "user"
        messages.append({"role": role, "content": content})
    with_system = [{"role": "system", "content": _CHECK_SYSTEM}, *messages]
    try:
        renderer.template_ids(with_system)
    except ConfigError:
        return messages
    return with_system


def _both_ways(
    renderer: Renderer, conversation: list[dict[str, str]], ended_with_eos: bool
) -> tuple[list[int], list[int]]:
    """(turn-by-turn ids, template ids) of a conversation whose assistant turns all end with
    EOS or all on a stop string; sampled EOS ids the template never writes are left out of
    the first, so both compare position by position."""
    first = next(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    row = renderer.prompt(conversation[:first])
    index = first
    while index < len(conversation):
        row += renderer.encode(conversation[index]["content"])
        if ended_with_eos and renderer.eos_id is not None and renderer.eos_in_template:
            row.append(renderer.eos_id)
        # (a sampled EOS the template never writes stays in the trained row; left out here)
        following = index + 1
        while following < len(conversation) and conversation[following]["role"] != "assistant":
            following += 1
        if following > index + 1:
            row += renderer.observation(conversation[index + 1 : following], ended_with_eos=ended_with_eos)
        index = following
    return row, renderer.template_ids(conversation)


def _first_difference(reference: Sequence[int], row: Sequence[int]) -> int | None:
    """The first position where ``row`` differs from ``reference``, ``row`` running past it
    included; None where ``row`` is a prefix of ``reference``."""
    for position, (a, b) in enumerate(zip(reference, row, strict=False)):
        if a != b:
            return position
    return None if len(row) <= len(reference) else len(reference)


def _context(renderer: Renderer, ids: Sequence[int], at: int) -> str:
    """About 40 characters of decoded text around position ``at``: before|after, as reprs."""
    before = renderer.decode(ids[max(0, at - 12) : at])[-20:]
    after = renderer.decode(ids[at : at + 12])[:20]
    return f"{before!r}|{after!r}"


_RAW_PIECES = (
    ("assistant", f"Let me think. <think>12 + 30 first.</think>\nI will add.\n{_CALL_1}"),
    ("observation", '\n<result>{"result": 42}</result>\n'),
    ("assistant", f"Now the product.\n{_CALL_2}"),
    ("observation", "<result>126</result> (2 calls used)"),
    ("assistant", "\nThe answer is 126."),
)


def _check_raw(renderer: Renderer) -> None:
    """raw: the row must read as the text the policy and the environment wrote. The pieces
    (assistant turns standing in for sampled ids, observations) are encoded separately and
    the decoded row must equal the decoded prompt followed by their text: a tokenizer that
    adds a prefix space to each piece (SentencePiece's) or normalizes text would corrupt
    every observation, and so would one that adds BOS/EOS to an encoding made without special
    tokens, or maps characters to an unknown token (decoded with special tokens kept).

    Not checked, on purpose: that the separate encodings equal the encoding of the joined
    text. Byte-level BPE merges across a seam (``</tool><result>``) differently in context,
    but the sampler saw the very ids that are trained, so the row is consistent either way.
    Nor the prompt against its text: it is the template's own tokenization."""
    row = renderer.prompt([{"role": "user", "content": _CHECK_CONVERSATION[0][1]}])
    head = renderer.decode(row)
    written = ""
    for kind, text in _RAW_PIECES:
        if kind == "assistant":
            row += renderer.encode(text)
        else:
            row += renderer.observation([{"role": "tool", "content": text}], ended_with_eos=False)
        written += text
    decoded = renderer.decode(row)
    expected = head + written
    if decoded != expected:
        at = next((i for i, (a, b) in enumerate(zip(expected, decoded, strict=False)) if a != b), None)
        at = min(len(expected), len(decoded)) if at is None else at
        raise ConfigError(
            f"the tokenizer of {renderer.name} fails the raw check (env.protocol=raw): pieces encoded separately "
            f"do not decode to the text written, at character {at}: written {expected[max(0, at - 20) : at + 20]!r}, "
            f"decoded {decoded[max(0, at - 20) : at + 20]!r}; the tokenizer changes text at a piece's start "
            "(a prefix space) or normalizes it; use env.protocol=chat with a prefix-stable chat template"
        )
