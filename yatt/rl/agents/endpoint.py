"""An OpenAI-compatible endpoint for agent code written against the ``openai`` SDK.

Each episode process of the env role that runs an ``env.episode`` function (``yatt.rl.agents.hosted``;
with ``env.inline``, each controller, for its episodes) serves, on loopback only, what an
``openai.AsyncOpenAI`` client calls::

    POST /v1/chat/completions   messages, tools, tool_choice, max_tokens / max_completion_tokens,
                                stream (one chunk), return_token_ids (vLLM's: the ids in the reply)
    GET  /v1/models             the run's model

Every episode gets its own key (``client.api_key``; ``client.base_url`` is the endpoint's
``/v1``): a request is answered only with a live episode's key, and it reaches only that
episode's ``EpisodeClient.chat``, the same path as a direct call: the reply's tokens kept,
the call a recorded turn. In the env role, ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` are
set to them, so agent code ports unchanged (``openai.AsyncOpenAI()``), or with one line::

    async def run(client, row):
        llm = client.openai()   # or openai.AsyncOpenAI(base_url=client.base_url, api_key=client.api_key)
        reply = await llm.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...

``client.openai()`` is that ``openai.AsyncOpenAI``, its HTTP connections shared by the
endpoint's episodes: a new ``AsyncOpenAI()`` (like a new ``httpx.AsyncClient``) loads the
CA bundle for TLS, ~20 ms of CPU here, on every episode's start (`benchmarks/endpoint.py`).

Errors have OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``): 401 for a
key that is not a live episode's, 400 for a malformed request (naming the field) or a
spent limit (the episode ends as it would through ``client``); the endpoint keeps serving.
A request whose messages rewrite the history starts a new row of the episode, as a
``client.chat`` call does. ``tool_choice`` ``none`` renders the request without its tools;
``auto`` and ``required`` are the model's to follow (the reply is what it sampled);
``n`` must be 1 (a group's n samples are n episodes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import secrets
import socket
import threading
import time
import uuid
from typing import Any, Protocol

from aiohttp import web

from yatt.rl.agents.client import EpisodeOver

HOST = "127.0.0.1"


class BadRequest(Exception):
    """A request the endpoint refuses: its message names the field and the fix."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


class Chats(Protocol):
    """An episode's client as the endpoint serves it (``EpisodeClient``, or a hosted agent's
    ``HostedClient``): ``chat``, then the reply's tokens and the prompt's length."""

    last_prompt_tokens: int

    @property
    def last_turn(self) -> Any: ...
    async def chat(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, max_tokens: int | None = None
    ) -> dict[str, Any]: ...


class Endpoint:
    """The HTTP server of one controller's episodes (started on first use)."""

    def __init__(self, model: str, *, http: Any = None) -> None:
        """``http``: the ``openai.DefaultAsyncHttpxClient`` its episodes' clients share (made
        here on first use when None; a hosted agent's is its env worker's, made before the
        fork: its TLS set-up is not paid per episode process)."""
        self.model = model
        self._episodes: dict[str, Chats] = {}
        self._runner: web.AppRunner | None = None
        self.base_url = ""
        self._http: Any = http  # the episodes' openai clients' connections (the SDK's own httpx client)
        self._starting = asyncio.Lock()

    async def start(self) -> None:
        """Listen on a free port of loopback, once (episodes starting together wait for it)."""
        async with self._starting:
            if self._runner is not None:
                return
            app = web.Application(client_max_size=64 << 20)
            app.router.add_post("/v1/chat/completions", self._completions)
            app.router.add_get("/v1/models", self._models)
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await runner.setup()
            listening = socket.create_server((HOST, 0))
            await web.SockSite(runner, listening).start()
            self._runner, self.base_url = runner, f"http://{HOST}:{listening.getsockname()[1]}/v1"

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def openai(self, key: str) -> Any:
        """An ``openai.AsyncOpenAI`` for the episode of ``key``, on connections shared by every
        episode (its ``close()`` leaves them open)."""
        import openai

        if self._http is None:
            self._http = openai.DefaultAsyncHttpxClient()
        return _episode_openai()(base_url=self.base_url, api_key=key, http_client=self._http)

    def open(self, client: Chats) -> str:
        """A new key for ``client``'s episode."""
        key = f"yatt-{secrets.token_urlsafe(24)}"
        self._episodes[key] = client
        return key

    def forget(self, key: str) -> None:
        self._episodes.pop(key, None)

    # ------------------------------------------------------------------ handlers

    def _episode(self, request: web.Request) -> Chats:
        auth = request.headers.get("Authorization", "")
        key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        client = self._episodes.get(key)
        if client is None:
            raise BadRequest(
                "the API key is not a live episode's: use the episode's client.api_key (each episode has its own, "
                "valid while it runs)",
                code="invalid_api_key", status=401,
            )  # fmt: skip
        return client

    async def _models(self, request: web.Request) -> web.StreamResponse:
        try:
            self._episode(request)
        except BadRequest as e:
            return _error(e)
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "yatt"}]}
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            client = self._episode(request)
            body = await _body(request)
            messages, tools, max_tokens = _parse(body)
            try:
                reply = await client.chat(messages, tools=tools, max_tokens=max_tokens)
            except EpisodeOver as e:
                raise BadRequest(str(e), param="messages", code=e.ended) from e
        except BadRequest as e:
            return _error(e)
        turn = client.last_turn
        finish = "tool_calls" if reply.get("tool_calls") else ("length" if turn.finish_reason == "length" else "stop")
        completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_tokens = client.last_prompt_tokens
        usage = {
            "prompt_tokens": prompt_tokens, "completion_tokens": len(turn.token_ids),
            "total_tokens": prompt_tokens + len(turn.token_ids),
        }  # fmt: skip
        ids = {"token_ids": turn.token_ids} if body.get("return_token_ids") else {}
        if not body.get("stream"):
            choice = {"index": 0, "message": reply, "finish_reason": finish, "logprobs": None, **ids}
            return web.json_response(
                {"id": completion_id, "object": "chat.completion", "created": created, "model": self.model,
                 "choices": [choice], "usage": usage}
            )  # fmt: skip
        return await _stream(request, completion_id, created, self.model, reply, finish, usage, ids)


@dataclasses.dataclass(frozen=True)
class _CannedTurn:
    token_ids: tuple[int, ...] = ()
    finish_reason: str = "stop"


class _Canned:
    """An episode that answers every chat with one fixed message (``warm_openai``'s)."""

    last_prompt_tokens = 0
    last_turn = _CannedTurn()

    async def chat(
        self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None, max_tokens: int | None = None
    ) -> dict[str, Any]:  # fmt: skip
        return {"role": "assistant", "content": "ok"}


def warm_openai() -> Any:
    """The ``openai.DefaultAsyncHttpxClient`` (its TLS set up) that endpoints made after a
    fork share, after one round trip through an endpoint and the SDK (in a thread of its
    own, on a loop of its own): what they load and build on first use (the SDK's lazy
    modules, anyio's backend, the response models' schemas) is then loaded. An env worker
    calls it once before its episode processes fork: each would pay ~0.1 s of CPU for them.
    None without the ``openai`` package."""
    try:
        import openai
    except ImportError:
        return None

    async def round_trip() -> None:
        endpoint = Endpoint("warm-up")
        await endpoint.start()
        try:
            llm = endpoint.openai(endpoint.open(_Canned()))
            await llm.chat.completions.create(model="warm-up", messages=[{"role": "user", "content": "hi"}])
            _ = [m async for m in llm.models.list()]
        finally:
            await endpoint.close()

    thread = threading.Thread(target=asyncio.run, args=(round_trip(),), name="openai-warm-up")
    thread.start()
    thread.join()
    return openai.DefaultAsyncHttpxClient()


@functools.cache
def _episode_openai() -> Any:
    """``openai.AsyncOpenAI`` whose ``close()`` leaves the shared connections open."""
    import openai

    class EpisodeOpenAI(openai.AsyncOpenAI):
        async def close(self) -> None:
            pass  # (the connections are the endpoint's)

    return EpisodeOpenAI


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise BadRequest(f"the request body is not JSON ({e}); send the chat completion request as a JSON object") from e
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object (got {type(body).__name__})")
    return body


def _parse(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, int | None]:
    """(messages, tools, max_tokens) of a chat completion request; ``BadRequest`` naming the field."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of messages", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", param=f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: the text ones joined
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are served", param=f"messages[{i}].content")
            messages[i] = {**m, "content": "".join(str(p.get("text", "")) for p in content)}
        elif content is not None and not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or text parts", param=f"messages[{i}].content")
    if body.get("n", 1) != 1:
        raise BadRequest(f"n must be 1 (got {body.get('n')!r}): each of a group's samples is an episode of its own", param="n")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or any(not isinstance(t, dict) for t in tools)):
        raise BadRequest("'tools' must be a list of tool objects", param="tools")
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        tools = None
    elif not (choice in ("auto", "required") or isinstance(choice, dict)):
        raise BadRequest(f"tool_choice must be 'none', 'auto', 'required' or a named tool (got {choice!r})", param="tool_choice")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise BadRequest(f"max_tokens must be a positive integer (got {max_tokens!r})", param="max_tokens")
    return messages, tools or None, max_tokens


def _error(e: BadRequest) -> web.Response:
    kind = "authentication_error" if e.status == 401 else "invalid_request_error"
    return web.json_response({"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}}, status=e.status)


async def _stream(
    request: web.Request, completion_id: str, created: int, model: str, reply: dict[str, Any], finish: str,
    usage: dict[str, int], ids: dict[str, Any],
) -> web.StreamResponse:  # fmt: skip
    """The reply as server-sent events: one chunk with the whole message, one with the finish."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    delta: dict[str, Any] = {"role": "assistant", "content": reply.get("content")}
    if reply.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(reply["tool_calls"])]
    head = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}
    for choice in ({"index": 0, "delta": delta, "finish_reason": None, **ids}, {"index": 0, "delta": {}, "finish_reason": finish}):
        await response.write(f"data: {json.dumps({**head, 'choices': [choice]})}\n\n".encode())
    await response.write(f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response
