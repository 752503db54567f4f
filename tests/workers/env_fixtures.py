"""Environments for the env role's tests (imported by its episode processes, by name)."""

from __future__ import annotations

import os
import socket
import time
from typing import Any


class Counter:
    """Counts its steps (the observation says how many); ends after ``turns``; ``show_pid``:
    its first observation names its process. Its action
    picks a misbehaviour: 'raise', 'hang', 'spin' (burns CPU), 'grab' (allocates 1 GiB
    and keeps it), 'connect:PORT' (opens a TCP connection to this machine's PORT), 'exit' (the process dies)."""

    def __init__(self, turns: int = 3, show_pid: bool = False) -> None:
        self.turns, self.steps, self.seed, self.show_pid = turns, 0, 0, show_pid
        self.kept: list[bytes] = []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.seed = seed or 0
        row = (options or {}).get("row", {})
        pid = f" pid {os.getpid()}" if self.show_pid else ""  # (not deterministic: a rebuilt episode differs)
        return f"seed {self.seed} row {row.get('prompt', '')}{pid}", {}

    def step(self, action: str) -> tuple[str, float | None, bool, bool, dict[str, Any]]:
        if action == "raise":
            raise ValueError("the action was 'raise'")
        if action == "hang":
            time.sleep(3600)
        if action == "spin":
            while True:
                pass
        if action == "grab":
            self.kept.append(bytearray(1 << 30))  # type: ignore[arg-type]
        if action.startswith("connect:"):  # connect:PORT, on this machine
            socket.create_connection(("127.0.0.1", int(action.partition(":")[2])), timeout=2).close()
            return "connected", None, False, False, {}
        if action == "exit":
            os._exit(3)
        self.steps += 1
        done = self.steps >= self.turns
        return f"step {self.steps} of seed {self.seed}: {action}", float(self.steps) if done else None, done, False, {}


class SavedCounter(Counter):
    """A Counter with ``snapshot()``/``restore(state)``: its step count saved as text."""

    def snapshot(self) -> bytes:
        return f"{self.seed} {self.steps}".encode()

    def restore(self, state: bytes) -> None:
        seed, steps = state.decode().split()
        self.seed, self.steps = int(seed), int(steps)


# ------------------------------------------------------------------ agent code hosted in the env role


async def openai_agent(client: Any, row: dict[str, Any]) -> dict[str, Any]:
    """An agent written against the ``openai`` SDK as it ships: ``AsyncOpenAI()`` built from
    the environment (OPENAI_BASE_URL, OPENAI_API_KEY), a tool call, its result, an answer.
    It checks where it runs: not in its worker's process (``row["worker_pid"]``), on the
    endpoint of its own process, with no route to this machine's ``row["port"]`` (unless
    the row says the network is allowed)."""
    import openai

    assert os.getpid() != row["worker_pid"], "the agent runs in its worker's process"
    assert os.environ["OPENAI_BASE_URL"] == client.base_url and os.environ["OPENAI_API_KEY"] == client.api_key
    if not row.get("network"):
        try:
            socket.create_connection(("127.0.0.1", row["port"]), timeout=2).close()
        except OSError:
            pass
        else:
            raise AssertionError("the agent reached this machine's network")
    llm = openai.AsyncOpenAI(max_retries=0)
    messages: list[Any] = [{"role": "user", "content": f"What is {row['question']}?"}]
    tools: Any = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
    first = await llm.chat.completions.create(model="policy", messages=messages, tools=tools, extra_body={"return_token_ids": True})
    message = first.choices[0].message
    assert message.tool_calls, message
    messages += [message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "21"}]
    assert (first.choices[0].model_extra or {}).get("token_ids"), "the reply carries the turn's token ids"
    second = await llm.chat.completions.create(model="policy", messages=messages)
    return {"reward": 1.0, "answer": second.choices[0].message.content}


async def chatty_agent(client: Any, row: dict[str, Any]) -> float:
    """``row["turns"]`` chat calls through the client, each after the last reply and a user
    message; then, by ``row["then"]``: 'raise' (a RuntimeError), 'rewrite' (a call that
    edits the first message: a new row), 'spin' (burns CPU), 'return' (returns a text), 'over' (one
    call more than env.max_turns allows, caught: the reward still said); else the reward 1."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "count"}]
    for i in range(row.get("turns", 2)):
        if i:
            messages.append({"role": "user", "content": f"again {i}"})
        messages.append(await client.chat(messages))
    then = row.get("then", "")
    if then == "raise":
        raise RuntimeError("the agent gave up")
    if then == "rewrite":
        await client.chat([{"role": "user", "content": "edited"}, *messages[1:], {"role": "user", "content": "and?"}])
    if then == "spin":
        while True:
            pass
    if then == "return":
        return "done"  # type: ignore[return-value]
    if then == "over":
        try:
            await client.chat([*messages, {"role": "user", "content": "one more"}])
        except Exception as e:
            assert type(e).__name__ == "EpisodeOver", e
            return 0.5
    return 1.0
