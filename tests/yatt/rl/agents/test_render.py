"""The observation renderer: turn-by-turn ids equal the chat template's own rendering of the
whole conversation for prefix-stable templates, and the start-up self-check refuses the
templates where they would not (history rewrites, separators that drift, tool merges).

Tokenizers are made in-process (``workers.models.build_tokenizer``, a byte-level BPE): the
repo's tiny template as it is, and a ChatML variant with ``<|im_start|>``/``<|im_end|>`` as
special tokens and ``<|im_end|>`` as EOS, under several chat templates."""

from __future__ import annotations

import ast
import random
import re
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from workers.models import CHAT_TEMPLATE as TINY_TEMPLATE
from workers.models import build_tokenizer
from yatt.errors import ConfigError
from yatt.rl.agents.render import Renderer, self_check

# SmolLM2-Instruct's template: plain ChatML, a default system message, any role as is.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2.5-Instruct's template (tool calls in assistant messages left out): tools in the
# system message, tool results wrapped in <tool_response> inside a user turn, consecutive
# tool messages merged into one user turn.
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
    {%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# The newline after <|im_end|> is written before whatever follows (a message or the
# generation prompt) rather than after each message: the last message has none, but every
# prefix's rendering is still a prefix of the whole's. Not a drift.
NEWLINE_BEFORE_NEXT = (
    "{% for m in messages %}{% if not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\n<|im_start|>assistant\n' }}{% endif %}"
)

# ---- templates the self-check must refuse ---------------------------------------------

# Qwen3's rule, simplified: reasoning (up to </think>) is dropped from the assistant turns
# before the last user message. The turn-by-turn row keeps what was sampled.
DROPS_EARLIER_THINKING = """{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
    {%- set content = m.content %}
    {%- if m.role == 'assistant' and loop.index0 < ns.last_query and '</think>' in content %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# The newline after <|im_end|> is written between messages only: the generation prompt
# follows <|im_end|> directly, so the prompt the policy saw lacks the newline that the
# template writes there once the assistant's message exists.
NEWLINE_BETWEEN_MESSAGES_ONLY = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' }}"
    "{% if not loop.last %}{{ '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Turns separated by a blank line in history, by one newline before the generation prompt.
BLANK_LINE_IN_HISTORY = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' }}"
    "{% if not loop.last %}{{ '\n\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\n<|im_start|>assistant\n' }}{% endif %}"
)

# Consecutive tool messages merged into one user turn that is closed by the next message,
# not by the generation prompt: the prompt after a tool result leaves the turn open.
TOOL_TURN_CLOSED_BY_NEXT = """{%- for m in messages %}
    {%- if m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
    {%- else %}
        {%- if not loop.first and messages[loop.index0 - 1].role == 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
        {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Tool results merged across assistant turns: each tool turn repeats every result since the
# last user message, which a renderer that sees only the new messages cannot reproduce.
TOOL_RESULTS_ACCUMULATE = """{%- set ns = namespace(results='') %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{%- set ns.results = '' %}{%- endif %}
    {%- if m.role == 'tool' %}
        {%- set ns.results = ns.results + '<tool_response>' + m.content + '</tool_response>\\n' %}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_start|>user\\n' + ns.results + '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Other unsupported templates (refused with their own messages).
NO_TOOL_ROLE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role here') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXT_BEFORE_EOS = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '\n<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ACCEPTED = {
    "smollm2": SMOLLM2,
    "qwen2.5": QWEN25,
    "newline-before-next": NEWLINE_BEFORE_NEXT,
    "tiny": TINY_TEMPLATE,
}


def chatml_tokenizer(template: str) -> PreTrainedTokenizerBase:
    """The repo's byte-level BPE with ChatML's special tokens, <|im_end|> as EOS."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "eos_token": "<|im_end|>"}
    )
    tokenizer.chat_template = template
    return tokenizer


def tokenizer_for(key: str) -> PreTrainedTokenizerBase:
    """The tiny template on the repo's tokenizer as it is, every other on the ChatML one."""
    return build_tokenizer() if key == "tiny" else chatml_tokenizer(ACCEPTED[key])


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def template_ids(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], **kwargs: Any
) -> list[int]:
    out: Any = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"])  # transformers 5: a BatchEncoding


def refusal(template: str, name: str) -> str:
    """The self-check's message for ``template`` (which must refuse it)."""
    renderer = Renderer(chatml_tokenizer(template), name=name)
    with pytest.raises(ConfigError) as caught:
        self_check(renderer)
    message = str(caught.value)
    assert name in message and "env.protocol=raw" in message and "\n" not in message
    assert "the chat template rewrites history or merges tokens across a turn boundary" in message
    return message


def contexts(message: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """The decoded (before, after) of the template's ids and of the turn-by-turn ids at the
    first difference, as the message shows them."""
    found = re.search(r"template ('.*?')\|('.*?'), turn by turn ('.*?')\|('.*?');", message)
    assert found, message
    before, after, row_before, row_after = (ast.literal_eval(group) for group in found.groups())
    return (before, after), (row_before, row_after)


# ---- the pieces, exactly ------------------------------------------------------------------


def test_chatml_observation_is_the_rest_of_the_turn_the_messages_and_the_generation_prompt() -> None:
    tokenizer = chatml_tokenizer(SMOLLM2)
    renderer = Renderer(tokenizer, name="smollm2")
    assert renderer.end_of_turn == "<|im_end|>\n" and renderer.eos_in_template
    tool = [{"role": "tool", "content": '{"result": 42}'}]
    after = '<|im_start|>tool\n{"result": 42}<|im_end|>\n<|im_start|>assistant\n'
    # the sampled <|im_end|> is already in the row: only the newline after it is added
    assert renderer.observation(tool, ended_with_eos=True) == encode(tokenizer, "\n" + after)
    # stopped on a stop string: the whole end-of-turn is added
    assert renderer.observation(tool, ended_with_eos=False) == encode(tokenizer, "<|im_end|>\n" + after)
    ids = renderer.observation(tool, ended_with_eos=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_end|>")  # a special token is one id


def test_qwen25_merges_the_tool_messages_of_one_observation_into_one_user_turn() -> None:
    tokenizer = chatml_tokenizer(QWEN25)
    renderer = Renderer(tokenizer, name="qwen2.5")
    ids = renderer.observation(
        [{"role": "tool", "content": "A"}, {"role": "tool", "content": "B"}], ended_with_eos=True
    )
    text = (
        "\n<|im_start|>user\n<tool_response>\nA\n</tool_response>\n<tool_response>\nB\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert ids == encode(tokenizer, text)


def test_tiny_template_keeps_the_sampled_eos_and_appends_all_of_the_end_of_turn() -> None:
    tokenizer = build_tokenizer()
    renderer = Renderer(tokenizer, name="tiny")
    assert renderer.end_of_turn == "\n" and not renderer.eos_in_template
    expected = encode(tokenizer, "\n<|tool|>42\n<|assistant|>")
    assert renderer.observation([{"role": "tool", "content": "42"}], ended_with_eos=True) == expected
    assert renderer.observation([{"role": "tool", "content": "42"}], ended_with_eos=False) == expected


def test_prompt_is_the_templates_own_tokenization_with_tools() -> None:
    tokenizer = chatml_tokenizer(QWEN25)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    ids = Renderer(tokenizer).prompt(messages, tools=tools)
    assert ids == template_ids(tokenizer, messages, tools=tools, add_generation_prompt=True)
    assert '"name": "add"' in tokenizer.decode(ids)


def test_raw_protocol_encodes_the_contents_and_nothing_else() -> None:
    tokenizer = chatml_tokenizer(SMOLLM2)
    renderer = Renderer(tokenizer, protocol="raw", name="smollm2")
    messages = [{"role": "tool", "content": "<result>42</result>"}, {"role": "user", "content": "\nmore"}]
    assert renderer.observation(messages, ended_with_eos=True) == encode(
        tokenizer, "<result>42</result>\nmore"
    )
    self_check(renderer)


def test_without_a_chat_template_raw_prompts_are_plain_text_and_chat_is_refused() -> None:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    renderer = Renderer(tokenizer, protocol="raw")
    assert renderer.prompt(messages) == list(tokenizer("Be brief.\n\n2 + 2?")["input_ids"])
    self_check(renderer)
    with pytest.raises(ConfigError, match="no chat template.*env.protocol=raw"):
        Renderer(tokenizer, name="plain-model")
    with pytest.raises(ConfigError, match="env.protocol must be one of"):
        Renderer(tokenizer, protocol="json")  # type: ignore[arg-type]


def test_a_role_the_template_cannot_render_is_refused_and_the_check_uses_user_messages() -> None:
    renderer = Renderer(chatml_tokenizer(NO_TOOL_ROLE), name="no-tool-role")
    assert renderer.roles == {"user", "system"}
    with pytest.raises(ConfigError, match=r"no-tool-role does not render a 'tool' message"):
        renderer.observation([{"role": "tool", "content": "42"}], ended_with_eos=True)
    self_check(renderer)  # tool results become user messages: the template is prefix-stable


def test_text_between_the_content_and_the_eos_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"text-before-eos writes '\\n' between an assistant's content"):
        Renderer(chatml_tokenizer(TEXT_BEFORE_EOS), name="text-before-eos")


def test_an_observation_needs_a_message_with_a_role_and_content() -> None:
    renderer = Renderer(chatml_tokenizer(SMOLLM2))
    with pytest.raises(ConfigError, match="at least one message"):
        renderer.observation([], ended_with_eos=True)
    with pytest.raises(ConfigError, match="'role' and a 'content'"):
        renderer.observation([{"role": "tool"}], ended_with_eos=True)


# ---- turn by turn == the template's whole conversation --------------------------------------

_WORDS = "the sum is answer let me check first then result number tool call ok so".split()


def _text(rng: random.Random, *, assistant: bool) -> str:
    """Random content with words, digits, punctuation and newlines. An assistant's begins
    with a letter and ends without whitespace: it is where sampled ids meet the template's
    text, and a BPE merge across that seam concerns the sampled side, not the renderer."""
    parts = []
    for _ in range(rng.randint(1, 8)):
        kind = rng.random()
        if kind < 0.5:
            parts.append(rng.choice(_WORDS))
        elif kind < 0.7:
            parts.append(str(rng.randint(0, 10_000)))
        elif kind < 0.85:
            parts.append(
                rng.choice(["+", "=", "?", ".", ",", ":", "(", ")", '{"a": 1}', "<think>", "</think>"])
            )
        else:
            parts.append(rng.choice(["\n", "\n\n", "  "]))
    text = " ".join(parts)
    if assistant:
        text = (rng.choice(_WORDS) + " " + text).strip()
    return text


def _episode(rng: random.Random) -> tuple[list[dict[str, str]], list[bool]]:
    """A random conversation (system?, user, then assistant turns each followed by 1-3 tool
    or user messages, ending with an assistant turn) and whether each assistant turn ended
    with EOS (else on the stop string </tool>, which its content then ends with)."""
    messages = [{"role": "system", "content": _text(rng, assistant=False)}] if rng.random() < 0.5 else []
    messages.append({"role": "user", "content": _text(rng, assistant=False)})
    endings = []
    turns = rng.randint(1, 4)
    for turn in range(turns):
        ended_with_eos = rng.random() < 0.5
        content = _text(rng, assistant=True)
        if not ended_with_eos:
            content += f'\n<tool>{{"name": "f", "arguments": {{"x": {rng.randint(0, 99)}}}}}</tool>'
        messages.append({"role": "assistant", "content": content})
        endings.append(ended_with_eos)
        if turn < turns - 1:
            for _ in range(rng.randint(1, 3)):
                role = rng.choice(["tool", "tool", "user"])
                messages.append({"role": role, "content": _text(rng, assistant=False)})
    return messages, endings


def _turn_by_turn(
    renderer: Renderer, messages: list[dict[str, str]], endings: list[bool]
) -> tuple[list[int], list[int]]:
    """(the trained row built as the controller does, the positions of sampled EOS ids)."""
    tokenizer = renderer.tokenizer
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    row = renderer.prompt(messages[:first])
    eos_positions = []
    groups: list[list[dict[str, str]]] = []
    for message in messages[first:]:
        if message["role"] == "assistant":
            groups.append([message])
        else:
            groups[-1].append(message)
    for (assistant, *observation), ended_with_eos in zip(groups, endings, strict=True):
        row += encode(tokenizer, assistant["content"])  # stands in for the sampled ids
        if ended_with_eos:
            eos_positions.append(len(row))
            row.append(tokenizer.eos_token_id)
        if observation:
            row += renderer.observation(observation, ended_with_eos=ended_with_eos)
    return row, eos_positions


@pytest.mark.parametrize("key", sorted(ACCEPTED))
def test_turn_by_turn_ids_equal_the_templates_rendering_of_the_whole_conversation(key: str) -> None:
    tokenizer = tokenizer_for(key)
    renderer = Renderer(tokenizer, name=key)
    self_check(renderer)
    for seed in range(60):
        messages, endings = _episode(random.Random(seed))
        row, eos_positions = _turn_by_turn(renderer, messages, endings)
        if not renderer.eos_in_template:  # the sampled EOS the template never writes
            assert [row[i] for i in eos_positions] == [tokenizer.eos_token_id] * len(eos_positions)
            row = [t for i, t in enumerate(row) if i not in set(eos_positions)]
        whole = template_ids(tokenizer, messages)
        assert len(row) <= len(whole) and row == whole[: len(row)], (key, seed, tokenizer.decode(row))
        # what the template adds after the last turn is its end-of-turn, nothing else
        last_ended_with_eos = endings[-1] and renderer.eos_in_template
        trailing = (
            renderer.end_of_turn[len(tokenizer.eos_token) :] if last_ended_with_eos else renderer.end_of_turn
        )
        assert tokenizer.decode(whole[len(row) :]) == trailing, (key, seed)


# ---- refusals, each for its reason ------------------------------------------------------------


def test_refuses_a_template_that_drops_earlier_reasoning() -> None:
    template, turn_by_turn = contexts(refusal(DROPS_EARLIER_THINKING, "thinking-dropper"))
    # the first assistant turn: the template wrote it without what came before </think>
    assert template[0].endswith("assistant\n") and template[0] == turn_by_turn[0]
    assert template[1].startswith("I will add first.") and turn_by_turn[1].startswith("Let me think. <think")


def test_refuses_a_template_whose_prompt_lacks_the_separator_history_has() -> None:
    for template_text, name in (
        (NEWLINE_BETWEEN_MESSAGES_ONLY, "newline-between"),
        (BLANK_LINE_IN_HISTORY, "blank"),
    ):
        template, turn_by_turn = contexts(refusal(template_text, name))
        # at the end of the first prompt: history writes a newline that the generation prompt does not
        assert template[0] == turn_by_turn[0] and "number.<|im_end|>" in template[0], name
        assert template[1].startswith("\n<|im_start|>") and turn_by_turn[1].startswith("<|im_start|>assist")


def test_accepts_a_newline_written_before_the_next_message_or_the_generation_prompt() -> None:
    self_check(Renderer(chatml_tokenizer(NEWLINE_BEFORE_NEXT), name="newline-before-next"))


def test_refuses_a_tool_turn_left_open_for_more_tool_messages() -> None:
    template, turn_by_turn = contexts(refusal(TOOL_TURN_CLOSED_BY_NEXT, "open-tool-turn"))
    # after the first tool result: history closes the turn, the generation prompt did not
    assert template[0].endswith("tool_response>") and template[0] == turn_by_turn[0]
    assert template[1].startswith("<|im_end|>\n<|im") and turn_by_turn[1].startswith("<|im_start|>assist")


def test_refuses_tool_results_merged_across_assistant_turns() -> None:
    template, turn_by_turn = contexts(refusal(TOOL_RESULTS_ACCUMULATE, "accumulating-tools"))
    # the second tool turn: the template repeats the first result; turn by turn it is not there
    assert template[0].endswith('{"result":') and template[0] == turn_by_turn[0]
    assert template[1].startswith(" 42}") and turn_by_turn[1].startswith(" 126}")


@pytest.mark.parametrize("key", sorted(ACCEPTED))
def test_accepts_the_prefix_stable_templates(key: str) -> None:
    self_check(Renderer(tokenizer_for(key), name=key))
    self_check(Renderer(tokenizer_for(key), protocol="raw", name=key))


def test_raw_check_refuses_a_tokenizer_that_adds_a_prefix_space_to_each_piece() -> None:
    """A SentencePiece-style tokenizer (Metaspace, a space prepended to every encoding)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Metaspace(prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "</s>"],
        initial_alphabet=[chr(c) for c in range(32, 127)] + ["\n", "▁"],
        show_progress=False,
    )
    tok.train_from_iterator(["What is 12 + 30? The answer is 42. Let me think about it."], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, unk_token="<unk>", eos_token="</s>"
    )
    with pytest.raises(
        ConfigError, match=r"^the tokenizer of sentencepiece-like fails the raw check.*prefix space"
    ):
        self_check(Renderer(tokenizer, protocol="raw", name="sentencepiece-like"))
    with pytest.raises(ConfigError) as caught:
        self_check(Renderer(tokenizer, protocol="raw", name="sentencepiece-like"))
    assert "written 'wer with one number.Let me" in str(caught.value)  # the piece's added space
    assert "decoded 'wer with one number. Let me" in str(caught.value)
