"""Plain Python functions as an agent's tools: load them, parse the model's calls, run them.

A user lists tools in the run config (``env.tools: [my_tools:calculator, my_tools:search]``):
ordinary functions, sync or ``async def``, with type hints and a Google-style docstring, the
same contract as transformers' tool use, so one function serves both its chat template's
``tools=`` argument and this trainer. Each is loaded once (``load_tools``) into a ``Tool``
holding its OpenAI-style JSON schema; a function that has none fails at start-up with a
``PluginError`` naming the config field, not in the middle of a run.

The model calls tools in one of two protocols (``ToolProtocol``):

- ``"tags"``: for small models with no tool-calling template. A call is a Python call
  expression in tags, ``<tool>calculator("3 * 7")</tool>``; its result comes back inline as
  ``<result>21</result>``. The call is parsed with ``ast`` and never evaluated: literal
  arguments become their values, any other expression (``calculator(3 * 7)``) its source
  text, which is what a model that forgot the quotes meant.
- ``"hermes"``: the chat template's own format (Hermes, Qwen2.5):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the result comes back as a
  tool message (role "tool").

Everything that goes wrong while calling a tool (an unparsable call, an unknown name, bad
arguments, a tool that raises or hangs) becomes an observation the model reads, one line
that says what to fix, rather than an exception that ends the episode: a policy learns to
call tools by seeing its mistakes answered. ``ToolResult.error`` keeps a short code of what
went wrong for metrics.

``transformers`` is imported inside ``load_tools`` only: yatt's core modules import no heavy
package at import time (tests/yatt/test_imports.py).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from yatt.errors import PluginError
from yatt.runtime.plugins import load_plugin

__all__ = [
    "Tool", "ToolCall", "ToolCallError", "ToolProtocol", "ToolResult", "calculator", "call_tool",
    "format_result", "load_tools", "parse_tool_calls", "tool_instructions",
]  # fmt: skip

ToolProtocol = Literal["tags", "hermes"]
"""How the model writes calls and reads results: ``"tags"`` (``<tool>f(...)</tool>``, results
inline in ``<result></result>``) or ``"hermes"`` (the chat template's ``<tool_call>`` JSON,
results as tool messages)."""

_EXPECTS = "a function with type hints and a docstring (transformers' get_json_schema)"


# ----------------------------------------------------------------------------- loading


@dataclass(frozen=True, kw_only=True)
class Tool:
    """One loaded tool: the user's function and what the model is told about it."""

    name: str
    """What the model calls it by: the function's ``__name__``, unique among the run's tools."""
    function: Callable[..., Any]
    schema: dict[str, Any]
    """OpenAI function schema, ``{"type": "function", "function": {"name", "description",
    "parameters", ...}}``, as ``apply_chat_template(tools=[...])`` takes it."""
    is_async: bool
    """True for ``async def``: awaited on the event loop; otherwise run in a worker thread."""


def load_tools(paths: Sequence[str], *, field: str = "env.tools") -> list[Tool]:
    """The tools named by ``paths`` ('package.module:function'), in order.

    ``field`` is the config field holding the list; an error names the item, e.g.
    ``env.tools[1]``. ``PluginError`` (one line: field, path, what is wrong, the fix) when a
    path does not load, a function has no JSON schema (no docstring, an argument without a
    type hint or without a description in ``Args:``), or two tools share a name: the model
    calls tools by name, so a second one of the same name could never be reached.
    """
    # Lazy: importing transformers takes seconds and the core stays light (module docstring).
    from transformers.utils.chat_template_utils import get_json_schema

    tools: list[Tool] = []
    where: dict[str, str] = {}  # tool name -> "field[i] 'path'" that defined it
    for i, path in enumerate(paths):
        item = f"{field}[{i}]"
        function = load_plugin(path, field=item, expects=_EXPECTS)
        try:
            schema = get_json_schema(function)
        # transformers' own exception types, or whatever evaluating a user's annotations raises
        except Exception as e:
            why = " ".join(str(e).split())
            raise PluginError(
                f"{item}: {path!r} has no tool schema ({type(e).__name__}: {why}); give every argument a "
                "type hint and write a Google-style docstring: a description, then 'Args:' with one "
                f"'name: description' line per argument. {item} must be {_EXPECTS}"
            ) from e
        name = str(schema["function"]["name"])
        if name in where:
            raise PluginError(
                f"{item}: {path!r} is a second tool named {name!r} (the first is {where[name]}); the model "
                "calls tools by name, so rename one of the functions or drop one from the list"
            )
        where[name] = f"{item} {path!r}"
        is_async = inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
            getattr(function, "__call__", None)  # noqa: B004 - an object whose __call__ is async
        )
        tools.append(Tool(name=name, function=function, schema=schema, is_async=is_async))
    return tools


def _signature(tool: Tool, *, returns: bool = True) -> str:
    """``name(arg: type, ...) -> type`` as Python writes it: what the model is told to call,
    and what an error about bad arguments shows. Annotations are resolved so that a module
    with ``from __future__ import annotations`` shows ``str``, not ``'str'``."""
    try:
        signature = inspect.signature(tool.function, eval_str=True)
    except Exception:  # unresolvable annotations: get_json_schema got past them, so fall back to the raw text
        signature = inspect.signature(tool.function)
    if not returns:
        signature = signature.replace(return_annotation=inspect.Signature.empty)
    return f"{tool.name}{signature}"


def tool_instructions(tools: Sequence[Tool], *, protocol: ToolProtocol) -> str:
    """The system-prompt paragraph that teaches the tag protocol, listing each tool.

    For ``"hermes"`` it is "": the chat template writes its own instructions from the
    schemas passed as ``apply_chat_template(tools=[t.schema for t in tools])``. With no tools
    it is "" as well.
    """
    if protocol == "hermes" or not tools:
        return ""
    lines = ["You can call these tools:"]
    for tool in tools:
        description = " ".join(str(tool.schema["function"].get("description", "")).split())
        lines.append(f"- {_signature(tool, returns=False)}" + (f" - {description}" if description else ""))
    lines.append(
        "To call a tool, write <tool>name(arguments)</tool> with the arguments as in Python, strings "
        'in quotes, e.g. <tool>name("text", 3)</tool>. Its result comes back in <result></result>. '
        "Write your final answer in <answer></answer>."
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- parsing


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One call as the model wrote it, parsed (not yet checked against any tool)."""

    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    text: str
    """The whole call block as the model wrote it, tags included."""


class ToolCallError(ValueError):
    """A call block that does not parse. Its ``str()`` is the observation the model reads:
    which block, why, and how to write one."""


_TAGS: dict[str, tuple[str, str, str]] = {  # protocol -> open tag, close tag, how to write a call
    "tags": ("<tool>", "</tool>", "<tool>name(arguments)</tool>"),
    "hermes": (
        "<tool_call>",
        "</tool_call>",
        '<tool_call>{"name": "tool name", "arguments": {"argument": value}}</tool_call>',
    ),
}


def parse_tool_calls(text: str, *, protocol: ToolProtocol) -> list[ToolCall]:
    """Every tool call in one turn's ``text``, in order; [] when there is none.

    A block ends at the first closing tag after which its inside parses, so a closing tag
    written inside a quoted argument does not cut the call short. A last block left open at
    the end of the text is still a call when its inside parses: generation is often stopped
    at the closing tag, which the engine then leaves out. ``ToolCallError`` when a block does
    not parse (tags: not a call ``name(...)``; hermes: bad JSON, no name); no call in a turn
    that has a broken one is run, and the model reads the error.
    """
    opening, closing, usage = _TAGS[protocol]
    parse = _parse_tags_call if protocol == "tags" else _parse_hermes_call
    calls: list[ToolCall] = []
    position = 0
    while (start := text.find(opening, position)) >= 0:
        inner_start = start + len(opening)
        ends = [m.start() for m in re.finditer(re.escape(closing), text[inner_start:])]
        candidates = [(inner_start + e, inner_start + e + len(closing)) for e in ends]
        candidates.append((len(text), len(text)))  # unclosed: the rest of the text
        first_why = ""
        for inner_end, block_end in candidates:
            try:
                name, args, kwargs = parse(text[inner_start:inner_end])
            except ValueError as e:
                first_why = first_why or str(e)
                continue
            calls.append(ToolCall(name=name, args=args, kwargs=kwargs, text=text[start:block_end]))
            position = block_end
            break
        else:
            inner_end, block_end = candidates[0]
            why = first_why if block_end > inner_end else f"{first_why}, and it has no {closing}"
            block = _shorten(" ".join(text[start:block_end].split()))
            raise ToolCallError(f"error: could not parse the tool call {block}: {why}; write {usage}")
    return calls


def _shorten(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters: an error echoes the broken block, not an essay."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _parse_tags_call(inner: str) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """``name(arg, key=arg)`` -> its parts, via ``ast`` and never ``eval``. ValueError (the
    reason, for the model) when it is not a call of a plain name."""
    source = inner.strip()
    if not source:
        raise ValueError("it is empty")
    try:
        node = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:  # ValueError: a NUL byte
        raise ValueError(f"it is not a Python call ({type(e).__name__}: {getattr(e, 'msg', e)})") from None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        raise ValueError("it is not a call of a tool by its name")
    if any(isinstance(arg, ast.Starred) for arg in node.args) or any(k.arg is None for k in node.keywords):
        raise ValueError("*args and **kwargs are not supported")
    args = tuple(_argument(source, arg) for arg in node.args)
    kwargs = {k.arg: _argument(source, k.value) for k in node.keywords if k.arg is not None}
    return node.func.id, args, kwargs


def _argument(source: str, node: ast.expr) -> Any:
    """A literal's value; any other expression as its source text (``3 * 7`` -> "3 * 7")."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # not a literal
        return ast.get_source_segment(source, node) or ""


def _parse_hermes_call(inner: str) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """``{"name": ..., "arguments": {...}}`` -> its parts. ``arguments`` may also be a JSON
    string holding the object (OpenAI's own spelling), or absent for a call without any."""
    try:
        payload = json.loads(inner)
    except json.JSONDecodeError as e:
        raise ValueError(f"it is not valid JSON ({e})") from None
    if not isinstance(payload, dict):
        raise ValueError("it is not a JSON object")
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError('it has no "name"')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f'its "arguments" string is not valid JSON ({e})') from None
    if not isinstance(arguments, dict):
        raise ValueError('its "arguments" is not a JSON object')
    return name, (), arguments


# ----------------------------------------------------------------------------- calling


@dataclass(frozen=True, kw_only=True)
class ToolResult:
    """What came of one call: the text the model reads, and a code for metrics."""

    text: str
    """The result, or one error line naming the tool and what to fix."""
    error: str
    """"" on success, else "unknown_tool", "bad_arguments", "raised", "timeout", or "parse"
    (set by the caller, which turns a ``ToolCallError`` into a result)."""


async def call_tool(tools: Mapping[str, Tool], call: ToolCall, *, timeout_s: float) -> ToolResult:
    """Run ``call`` and turn what happens into the observation the model reads; never raises
    for the tool's sake (cancellation still propagates).

    ``async`` tools are awaited on the event loop; sync ones run in a worker thread
    (``asyncio.to_thread``) so they cannot stall the loop, both under ``asyncio.wait_for``.
    An async tool past ``timeout_s`` is cancelled. A sync tool past it is abandoned, not
    stopped: Python cannot kill a thread, so a hung one keeps running (and holds one of the
    default executor's threads) until it returns. Tools that may hang for good belong in the
    env role's processes, which can be killed; in-process tools should bound their own I/O.
    The result: a ``str`` as is, anything else as JSON (``default=str`` for the rest).
    """
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return ToolResult(
            text=f"error: unknown tool {call.name!r}; the tools are: {known}", error="unknown_tool"
        )
    try:
        inspect.signature(tool.function).bind(*call.args, **call.kwargs)
    except TypeError as e:
        return ToolResult(
            text=f"error: bad arguments for {tool.name} ({e}); call it as {_signature(tool)}",
            error="bad_arguments",
        )
    if tool.is_async:
        outcome = _outcome_async(tool.function, call.args, call.kwargs)
    else:
        outcome = asyncio.to_thread(_outcome_sync, tool.function, call.args, call.kwargs)
    try:
        value, raised = await asyncio.wait_for(outcome, timeout=timeout_s)
    except TimeoutError:  # only wait_for's own: the tool's exceptions are caught inside `outcome`
        return ToolResult(text=f"error: {tool.name} did not answer within {timeout_s:g} s", error="timeout")
    if raised is not None:
        message = " ".join(str(raised).split())
        text = f"error: {tool.name} raised {type(raised).__name__}" + (f": {message}" if message else "")
        return ToolResult(text=text, error="raised")
    return ToolResult(text=_to_text(value), error="")


# A user's tool may raise anything, and every exception is an observation for the model, so
# both wrappers catch Exception (not BaseException: cancellation and exits still propagate).
# Catching inside the awaited call also keeps a TimeoutError the tool raises itself apart
# from wait_for's.
def _outcome_sync(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Exception | None]:
    """(the value, None) or (None, what it raised), run in the worker thread."""
    try:
        return function(*args, **kwargs), None
    except Exception as e:  # see above: the exception is returned, to become an observation
        return None, e


async def _outcome_async(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Exception | None]:
    """(the value, None) or (None, what it raised), awaited."""
    try:
        return await function(*args, **kwargs), None
    except Exception as e:  # see above: the exception is returned, to become an observation
        return None, e


def _to_text(value: Any) -> str:
    """A ``str`` as is; anything else as JSON, or its ``str`` when JSON cannot hold it (a
    dict with non-string keys, a cycle)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError, RecursionError):
        return str(value)


def format_result(result: ToolResult, *, protocol: ToolProtocol, name: str) -> dict[str, str]:
    """The message that carries ``result`` back to the model, for the renderer.

    tags: role "tool" whose content is ``<result>...</result>``, which the renderer appends
    raw, inline after the call. hermes: a tool message the chat template formats itself,
    with the tool's ``name``.
    """
    if protocol == "tags":
        return {"role": "tool", "content": f"<result>{result.text}</result>"}
    return {"role": "tool", "name": name, "content": result.text}


# ----------------------------------------------------------------------------- calculator

# The built-in example tool (`yatt.rl.agents.tools:calculator`). It walks the AST rather than
# calling eval, so a policy probing it can reach nothing but arithmetic; and it bounds the
# work, since a policy will find `9**9**9` sooner or later: exponents up to _MAX_EXPONENT,
# integers up to _MAX_BITS (well under Python's 4300-digit str() limit), finite floats only.
_MAX_EXPONENT = 1000
_MAX_BITS = 4000
_MAX_CHARS = 1000  # bounds the parse tree's depth too
_OPERATORS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_SUPPORTED = "only numbers, + - * / // % ** and parentheses are supported"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The arithmetic expression, for example "(3 + 4) * 2 ** 3".

    Returns:
        The value, for example "56".

    Raises:
        ValueError: anything but arithmetic (names, calls, attributes, strings), or a result
        too large. ZeroDivisionError: division by zero.
    """
    if len(expression) > _MAX_CHARS:
        raise ValueError(f"the expression is longer than {_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        return repr(_arithmetic(tree.body))
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression ({e.msg}); {_SUPPORTED}") from None
    except (RecursionError, MemoryError):  # the parser's or _arithmetic's stack
        raise ValueError("the expression is nested too deeply") from None


def _arithmetic(node: ast.expr) -> int | float:
    """The value of an arithmetic node; ValueError for any other kind of node."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        operand = _arithmetic(node.operand)
        return operand if isinstance(node.op, ast.UAdd) else -operand
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _arithmetic(node.left), _arithmetic(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_OPERATORS[type(node.op)](left, right))
        except OverflowError:
            raise ValueError("the result is too large") from None
    raise ValueError(f"{ast.unparse(node)!r} is not arithmetic; {_SUPPORTED}")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power before computing it when it would be slow or huge."""
    if abs(exponent) > _MAX_EXPONENT:
        raise ValueError(f"the exponent {exponent!r} is larger than {_MAX_EXPONENT}")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if (abs(base).bit_length() - 1) * exponent > _MAX_BITS:
            raise ValueError("the result is too large")


def _bounded(value: Any) -> int | float:
    """``value`` if it is a small enough int or a finite float; ValueError otherwise (also
    for complex, which ``(-8) ** 0.5`` yields)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > _MAX_BITS:
            raise ValueError("the result is too large")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is too large (not a finite number)")
        return value
    raise ValueError(f"the result {value!r} is not a real number")
