"""Tools for agent episodes: user functions load with their JSON schema (or fail at start-up
with a PluginError naming the field), the model's calls parse from tags or Hermes JSON
without ever being evaluated, and every way a call can go wrong comes back as an
observation the model reads, timeouts included. The helper tools below are loaded by their
real path, ``tests.yatt.rl.agents.test_tools:<name>``, as a user's config would name them."""

from __future__ import annotations

import asyncio
import datetime
import time

import pytest

from yatt.errors import PluginError
from yatt.rl.agents.tools import (
    Tool,
    ToolCall,
    ToolCallError,
    ToolResult,
    calculator,
    call_tool,
    format_result,
    load_tools,
    parse_tool_calls,
    tool_instructions,
)

HERE = "tests.yatt.rl.agents.test_tools"

# ----------------------------------------------------------------------------- helper tools


def lookup(word: str, limit: int = 3) -> list[str]:
    """Look a word up in the dictionary.

    Args:
        word: The word to look up.
        limit: How many senses to return.
    """
    return [f"{word} sense {i}" for i in range(limit)]


async def search(query: str) -> str:
    """Search the web.

    Args:
        query: What to search for.
    """
    await asyncio.sleep(0)
    return f"results for {query}"


def no_docstring(x: int) -> int:
    return x


def untyped(x):  # type: ignore[no-untyped-def]
    """Echo.

    Args:
        x: Anything.
    """
    return x


def record() -> dict[str, object]:
    """A record that is not a string."""
    return {"a": 1, "b": [1.5, None], "when": datetime.date(2024, 5, 17)}


def odd_keys() -> dict[tuple[int, int], int]:
    """A dict JSON cannot hold (tuple keys)."""
    return {(1, 2): 3}


def own_timeout() -> str:
    """A tool that raises TimeoutError itself: that is 'raised', not the call's timeout."""
    raise TimeoutError("upstream did not answer")


async def slow_async() -> str:
    """Sleep longer than the tests' timeout."""
    await asyncio.sleep(0.5)
    return "too late"


def slow_sync() -> str:
    """Block a worker thread longer than the tests' timeout."""
    time.sleep(0.3)
    return "too late"


TOOL_NAMES = ["lookup", "search", "record", "odd_keys", "own_timeout", "slow_async", "slow_sync"]


@pytest.fixture(scope="module")
def tools() -> dict[str, Tool]:
    paths = [f"{HERE}:{name}" for name in TOOL_NAMES] + ["yatt.rl.agents.tools:calculator"]
    return {tool.name: tool for tool in load_tools(paths)}


def call(name: str, *args: object, **kwargs: object) -> ToolCall:
    return ToolCall(name=name, args=args, kwargs=kwargs, text=f"<tool>{name}(...)</tool>")


# ----------------------------------------------------------------------------- load_tools


def test_sync_and_async_functions_load_with_their_schema() -> None:
    sync, asynchronous = load_tools([f"{HERE}:lookup", f"{HERE}.search"])
    assert sync == Tool(
        name="lookup",
        function=lookup,
        is_async=False,
        schema={
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Look a word up in the dictionary.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "word": {"type": "string", "description": "The word to look up."},
                        "limit": {"type": "integer", "description": "How many senses to return."},
                    },
                    "required": ["word"],
                },
                "return": {"type": "array", "items": {"type": "string"}},
            },
        },
    )
    assert asynchronous.name == "search" and asynchronous.function is search and asynchronous.is_async
    assert asynchronous.schema["function"]["parameters"] == {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "What to search for."}},
        "required": ["query"],
    }


def test_the_builtin_calculator_loads_as_a_tool() -> None:
    (tool,) = load_tools(["yatt.rl.agents.tools:calculator"])
    assert tool.function is calculator and not tool.is_async
    assert tool.schema["function"]["parameters"]["required"] == ["expression"]


@pytest.mark.parametrize(
    ("name", "why"),
    [("no_docstring", "no docstring"), ("untyped", "missing a type hint")],
)
def test_a_function_without_a_schema_is_refused_naming_field_and_path(name: str, why: str) -> None:
    path = f"{HERE}:{name}"
    with pytest.raises(PluginError) as caught:
        load_tools([f"{HERE}:lookup", path], field="agent.tools")
    message = str(caught.value)
    assert message.startswith(f"agent.tools[1]: {path!r} has no tool schema")
    assert why in message and "Args:" in message and "\n" not in message


def test_duplicate_tool_names_are_refused() -> None:
    with pytest.raises(PluginError, match=r"env\.tools\[2\]: .* second tool named 'lookup'.*env\.tools\[0\]"):
        load_tools([f"{HERE}:lookup", f"{HERE}:search", f"{HERE}.lookup"])


@pytest.mark.parametrize("path", ["no_such_package_xyz.tools:calc", f"{HERE}:no_such_function", "not a path"])
def test_a_path_that_does_not_load_is_refused(path: str) -> None:
    with pytest.raises(PluginError, match=r"^env\.tools\[0\]: "):
        load_tools([path])


# ----------------------------------------------------------------------------- parse_tool_calls


def tags(text: str) -> list[ToolCall]:
    return parse_tool_calls(text, protocol="tags")


def hermes(text: str) -> list[ToolCall]:
    return parse_tool_calls(text, protocol="hermes")


def test_tags_literal_arguments_and_keywords() -> None:
    (only,) = tags('Let me check. <tool>lookup("cat", 2, extra=[1, {"k": -0.5}], flag=None)</tool>')
    assert only == ToolCall(
        name="lookup",
        args=("cat", 2),
        kwargs={"extra": [1, {"k": -0.5}], "flag": None},
        text='<tool>lookup("cat", 2, extra=[1, {"k": -0.5}], flag=None)</tool>',
    )


def test_tags_a_non_literal_argument_is_its_source_text_never_evaluated() -> None:
    (arithmetic,) = tags("<tool>calculator(3 * 7)</tool>")
    assert arithmetic.args == ("3 * 7",) and arithmetic.kwargs == {}
    (sneaky,) = tags("<tool>f(__import__('os').getcwd(), key=a.b)</tool>")
    assert sneaky.args == ("__import__('os').getcwd()",) and sneaky.kwargs == {"key": "a.b"}


def test_tags_several_calls_in_order() -> None:
    text = '<tool>lookup("a")</tool> then\n<tool> search(query="b") </tool>, finally <tool>calculator("1+1")</tool>'
    assert [(c.name, c.args, c.kwargs) for c in tags(text)] == [
        ("lookup", ("a",), {}),
        ("search", (), {"query": "b"}),
        ("calculator", ("1+1",), {}),
    ]


def test_tags_nested_parentheses_and_closing_text_inside_quotes() -> None:
    text = """<tool>calculator("(1 + (2 * 3)) )")</tool> <tool>f("</tool>", ')(', "<tool>")</tool> <tool>g(1)</tool>"""
    first, second, third = tags(text)
    assert first.args == ("(1 + (2 * 3)) )",)
    assert second.args == ("</tool>", ")(", "<tool>")
    assert second.text == """<tool>f("</tool>", ')(', "<tool>")</tool>"""
    assert (third.name, third.args) == ("g", (1,))


def test_a_last_call_left_open_still_parses() -> None:
    """Generation stopped at the stop string </tool>, which the engine leaves out."""
    (only,) = tags('Computing: <tool>calculator("2 ** 10")')
    assert only.args == ("2 ** 10",) and only.text == '<tool>calculator("2 ** 10")'


def test_no_call_is_an_empty_list() -> None:
    assert tags("The answer is <answer>21</answer>; no tool needed (really).") == []
    assert hermes('{"name": "calculator"} but not in tool_call tags') == []
    assert tags("") == [] and hermes("") == []


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('<tool>calculator("3 * 7)</tool>', "unterminated string literal"),
        ("<tool>3 + 4</tool>", "not a call of a tool by its name"),
        ('<tool>os.system("ls")</tool>', "not a call of a tool by its name"),
        ("<tool></tool>", "it is empty"),
        ("<tool>f(*xs)</tool>", "*args and **kwargs are not supported"),
        ("<tool>calculator(3 * 7", "no </tool>"),
    ],
)
def test_tags_a_malformed_call_is_a_readable_error(text: str, why: str) -> None:
    with pytest.raises(ToolCallError) as caught:
        tags(f'<tool>lookup("fine")</tool> {text} after')
    message = str(caught.value)
    assert message.startswith(f"error: could not parse the tool call {text}")
    assert why in message and message.endswith("; write <tool>name(arguments)</tool>")
    assert "\n" not in message


def test_hermes_calls_parse_as_the_chat_template_writes_them() -> None:
    text = (
        "I'll compute it.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * 7"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}\n</tool_call>\n'
        '<tool_call>{"name": "record"}</tool_call>'
    )
    first, second, third = hermes(text)
    assert first == ToolCall(
        name="calculator",
        args=(),
        kwargs={"expression": "3 * 7"},
        text='<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * 7"}}\n</tool_call>',
    )
    assert (second.name, second.kwargs) == ("search", {"query": "x"})
    assert (third.name, third.kwargs) == ("record", {})


@pytest.mark.parametrize(
    ("block", "why"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": }}</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {"expression": "1"}}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": "", "arguments": {}}</tool_call>', 'no "name"'),
        ('<tool_call>["calculator"]</tool_call>', "not a JSON object"),
        (
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>',
            '"arguments" is not a JSON object',
        ),
    ],
)
def test_hermes_a_malformed_call_is_a_readable_error(block: str, why: str) -> None:
    with pytest.raises(ToolCallError) as caught:
        hermes(f"Calling.\n{block}")
    message = str(caught.value)
    assert message.startswith(f"error: could not parse the tool call {block}: ")
    assert why in message and message.endswith('"arguments": {"argument": value}}</tool_call>')


# ----------------------------------------------------------------------------- call_tool


async def test_sync_and_async_tools_answer(tools: dict[str, Tool]) -> None:
    assert await call_tool(tools, call("calculator", "3 * 7"), timeout_s=2) == ToolResult(text="21", error="")
    assert await call_tool(tools, call("search", query="cats"), timeout_s=2) == ToolResult(
        text="results for cats", error=""
    )
    listed = await call_tool(tools, call("lookup", "cat", limit=2), timeout_s=2)
    assert listed == ToolResult(text='["cat sense 0", "cat sense 1"]', error="")


async def test_a_result_that_is_not_a_string_is_json(tools: dict[str, Tool]) -> None:
    result = await call_tool(tools, call("record"), timeout_s=2)
    assert result == ToolResult(text='{"a": 1, "b": [1.5, null], "when": "2024-05-17"}', error="")
    assert await call_tool(tools, call("odd_keys"), timeout_s=2) == ToolResult(text="{(1, 2): 3}", error="")


async def test_an_unknown_tool_lists_the_known_ones(tools: dict[str, Tool]) -> None:
    result = await call_tool(tools, call("calc", "1"), timeout_s=2)
    assert result.error == "unknown_tool"
    assert result.text == f"error: unknown tool 'calc'; the tools are: {', '.join(sorted(tools))}"


@pytest.mark.parametrize(
    ("args", "kwargs", "why"),
    [
        ((), {}, "missing a required argument: 'word'"),
        (("cat",), {"size": 2}, "got an unexpected keyword argument 'size'"),
        (("cat", 1, 2), {}, "too many positional arguments"),
    ],
)
async def test_bad_arguments_name_the_tool_and_its_signature(
    tools: dict[str, Tool], args: tuple[object, ...], kwargs: dict[str, object], why: str
) -> None:
    result = await call_tool(tools, call("lookup", *args, **kwargs), timeout_s=2)
    assert result == ToolResult(
        text=f"error: bad arguments for lookup ({why}); call it as lookup(word: str, limit: int = 3) -> list[str]",
        error="bad_arguments",
    )


async def test_a_tool_that_raises_is_an_observation(tools: dict[str, Tool]) -> None:
    result = await call_tool(tools, call("calculator", "1 / 0"), timeout_s=2)
    assert result == ToolResult(
        text="error: calculator raised ZeroDivisionError: division by zero", error="raised"
    )
    own = await call_tool(tools, call("own_timeout"), timeout_s=2)
    assert own == ToolResult(
        text="error: own_timeout raised TimeoutError: upstream did not answer", error="raised"
    )


@pytest.mark.parametrize("name", ["slow_async", "slow_sync"])
async def test_a_tool_past_its_timeout_is_an_observation(tools: dict[str, Tool], name: str) -> None:
    started = time.monotonic()
    result = await call_tool(tools, call(name), timeout_s=0.05)
    assert result == ToolResult(text=f"error: {name} did not answer within 0.05 s", error="timeout")
    assert time.monotonic() - started < 0.25  # answered at the timeout, not when the tool finished


# ----------------------------------------------------------------------------- rendering


def test_format_result_per_protocol() -> None:
    result = ToolResult(text="21", error="")
    assert format_result(result, protocol="tags", name="calculator") == {
        "role": "tool",
        "content": "<result>21</result>",
    }
    assert format_result(result, protocol="hermes", name="calculator") == {
        "role": "tool",
        "name": "calculator",
        "content": "21",
    }


def test_tool_instructions_list_every_tool_for_tags_only(tools: dict[str, Tool]) -> None:
    chosen = [tools["lookup"], tools["search"], tools["calculator"]]
    text = tool_instructions(chosen, protocol="tags")
    assert "- lookup(word: str, limit: int = 3) - Look a word up in the dictionary.\n" in text
    assert "- search(query: str) - Search the web.\n" in text
    assert "- calculator(expression: str) - Evaluate an arithmetic expression" in text
    assert (
        "<tool>name(arguments)</tool>" in text and "<result></result>" in text and "<answer></answer>" in text
    )
    assert tool_instructions(chosen, protocol="hermes") == ""


# ----------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("3 * 7", "21"),
        (" (3 + 4) * 2 ** 3 ", "56"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** -2", "0.25"),
        ("1.5e3 - +0.5", "1499.5"),
        ("2 ** 10 ** 2 // 2 ** 99", "2"),
    ],
)
def test_calculator_values(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os')", "is not arithmetic"),
        ("().__class__", "is not arithmetic"),
        ("abs(-1)", "is not arithmetic"),
        ("x + 1", "is not arithmetic"),
        ("'a' * 3", "is not arithmetic"),
        ("True + 1", "is not arithmetic"),
        ("1 < 2", "is not arithmetic"),
        ("3 *", "not an arithmetic expression"),
        ("9 ** 9 ** 9", "exponent 387420489 is larger than 1000"),
        ("2 ** 1001", "exponent 1001 is larger than 1000"),
        ("12345 ** 1000", "too large"),
        ("10 ** 999 * 10 ** 999 * 10 ** 999 * 10 ** 999 * 10 ** 999", "too large"),
        ("1e300 * 1e300", "too large"),
        ("10 ** 400 / 1e-300", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1" + "+1" * 600, "longer than 1000 characters"),
    ],
)
def test_calculator_rejects_all_but_small_arithmetic(expression: str, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace("*", r"\*")):
        calculator(expression)


@pytest.mark.parametrize(
    ("expression", "outcome"),
    [
        ("(" * 150 + "1" + ")" * 150, "1"),
        ("1" + "+1" * 499, "500"),
        ("(" * 300 + "1" + ")" * 300, "not an arithmetic expression (too many nested parentheses)"),
        ("-" * 999 + "1", "the expression is nested too deeply"),
    ],
)
def test_calculator_deep_nesting_is_a_value_or_a_value_error(expression: str, outcome: str) -> None:
    """Never a RecursionError escaping into the caller."""
    try:
        value = calculator(expression)
    except ValueError as e:
        value = str(e)
    assert value.startswith(outcome)


def test_calculator_division_by_zero_raises_as_python_does() -> None:
    with pytest.raises(ZeroDivisionError):
        calculator("1 / (2 - 2)")
