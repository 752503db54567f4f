"""The TRL side of the agents benchmark: TRL's own ``GRPOTrainer`` runs the benchmark's
guess-the-number episodes through its ``environment_factory`` loop, one optimizer step (one
generation batch of episodes) each time ``TrlEpisodes.batch`` is called, so
``benchmarks/agents.py`` interleaves TRL's batches with yatt's modes in one process.

Which TRL path (TRL 1.16, ``trl/trainer/grpo_trainer.py``):

- ``environment_factory=``: TRL's own multi-turn loop. One environment instance per rollout
  (pooled across batches, ``reset`` per rollout, its public methods the tools, ``get_reward``
  its reward); ``_tool_call_loop`` runs each turn's tool calls and generates the next turn.
  This is the path used here.
- ``tools=``: the same loop and the same requirements, with stateless functions: a game's
  state would have to live outside them. ``environment_factory`` is its stateful form.
- ``rollout_func=``: TRL calls it once per generation batch and takes back ids and
  log-probs; the turn loop and its scheduling are the caller's code, not TRL's (written
  here, it would be one of the benchmark's own modes inside TRL's trainer).

What it takes to run the tiny model there. ``GRPOTrainer.__init__`` refuses a chat template
that cannot render a tool-calling conversation (``supports_tool_calling``, line ~650), and
TRL's loop goes on only for a turn that ``parse_response`` reads as a tool call (the
tokenizer's ``response_template``); an untrained model writes no tool-call syntax at all.
So the tokenizer gets ``TOOL_TEMPLATE`` (the tiny template, plus a rendering of tool calls;
a tool result renders exactly as yatt renders the observation after a turn, a user
message) and ``EVERY_TURN_A_CALL`` (a response template that reads a turn's whole text as a
call of the environment's ``guess(action=<the text>)``): every turn is the action, as in
yatt's ``EpisodeRunner``. The first prompt renders as yatt's (``<|user|>`` + the reset text).

What TRL's loop does per turn (``_generate`` and ``_tool_call_loop``, lines ~1945-2190): one
``model.generate`` over every episode still going (left-padded, ``max_new_tokens`` from
``generation_kwargs``), then the turn's tool calls one episode after another in the
trainer's thread (an ``async def`` tool is awaited per episode too: ``asyncio.gather``
spans one episode's calls only), then the next turn's generate. A turn so waits for the sum
of the batch's steps, not their maximum. The loop stops after ``max_tool_calling_iterations``
tool rounds: ``max_turns - 1`` here, so an episode is ``max_turns`` generated turns and
``max_turns - 1`` environment steps (yatt's episode steps after its last turn too: one wait
fewer for TRL). Training does not run in between: the whole generation batch is rolled out
in ``_generate``, then scored, then trained on.

Timing: ``wall_s`` is ``_generate`` (the rollout: generation and environment steps only,
no scoring, no training), ``engine_s`` the time in ``_generate_single_turn`` (TRL's
generate calls), ``step_s`` the whole optimizer step (``on_step_begin`` to
``on_step_end``: rollout, rewards, forward, backward, AdamW). TRL's start-up (trainer
construction, model load) happens in ``TrlEpisodes.__init__``, before any batch is timed.
The trainer's settings are the e2e benchmark's (``benchmarks.trl_grpo.grpo_config``), one
group of ``episodes`` rollouts per step, one torch thread as the yatt modes. ``train()`` runs
in a thread of its own, held at the start of each step until ``batch`` lets it go, so
nothing of TRL runs while the caller measures yatt's modes.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.trl_grpo import TrlSpec, grpo_config
from yatt.rl.agents.games import GuessNumber

TOOL_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ '\n<|user|>' + m['content'] + '\n' }}"
    "{% elif m['tool_calls'] is defined and m['tool_calls'] %}{{ '<|assistant|>' + m['content'] }}"
    "{% for c in m['tool_calls'] %}{{ c['function']['name'] + ' ' + (c['function']['arguments'] | tojson) }}{% endfor %}"
    "{% else %}{{ '<|' + m['role'] + '|>' + m['content'] + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""The tiny model's chat template (``workers.models.CHAT_TEMPLATE``: ``<|role|>content\\n``)
plus tool calls and tool results. A tool result renders as ``\\n<|user|>result\\n``, so the
ids TRL appends after a turn (its ``_get_tool_suffix_ids``: ``\\n<|user|>Higher.\\n<|assistant|>``)
are the observation yatt's renderer appends."""

EVERY_TURN_A_CALL = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {
            "content": "text",
            "content_args": {"strip": False},
            "repeats": True,
            "transform": {"type": "function", "function": {"name": "guess", "arguments": {"action": "{content}"}}},
        },
    },
}
"""A transformers ``response_template`` whose only field is implicit (no opening marker):
a turn's whole text is one call of ``guess`` with the text as its ``action``."""


class GuessEnv:
    """Guess the number as TRL's ``environment_factory`` wants it: ``reset`` per rollout (its
    text appended to the prompt), ``guess`` the tool every turn calls, waiting the step's
    drawn latency as ``benchmarks.agents.SlowGuess`` does, and ``get_reward`` the reward."""

    def __init__(self, index: int, latency: list[float]) -> None:
        self.index = index  # the episode it plays in every batch: its secret and its latencies
        self.latency = latency
        self.game = GuessNumber(8)
        self.steps = 0
        self.reward = 0.0

    def reset(self, **row: Any) -> str:
        self.steps, self.reward = 0, 0.0
        obs, _ = self.game.reset(seed=self.index)
        return obs

    def guess(self, action: str) -> str:
        """Guess the secret number.

        Args:
            action: The turn's text; its first number is the guess.

        Returns:
            Whether the number is higher, lower or the guess is correct.
        """
        time.sleep(self.latency[self.steps])
        obs, reward, *_ = self.game.step(action)
        self.steps += 1
        self.reward += reward
        return obs

    def get_reward(self) -> float:
        return self.reward


class _Stopped(Exception):
    """Raised in TRL's thread to end its training loop early (``TrlEpisodes.close``)."""


class TrlEpisodes:
    """TRL's GRPOTrainer in a thread of its own, held before each optimizer step until
    ``batch`` lets one run; ``steps`` batches in all, then ``close``."""

    def __init__(
        self, model_dir: Path, out_dir: Path, *, episodes: int, max_turns: int, max_new_tokens: int,
        latencies: Callable[[int], list[float]], steps: int,
    ) -> None:  # fmt: skip
        """``latencies(i)``: the step latencies (seconds) of episode ``i``, the i-th rollout of
        every batch (environment instances are made, and pooled, in rollout order)."""
        import torch
        from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
        from trl.trainer.grpo_trainer import GRPOTrainer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokenizer.chat_template = TOOL_TEMPLATE
        tokenizer.response_template = EVERY_TURN_A_CALL
        spec = TrlSpec(
            model_dir=str(model_dir), prompts=[], answers=[], prompts_per_step=1, group_size=episodes, micro_batches=1,
            max_new_tokens=max_turns * (max_new_tokens + 32),  # the whole episode's budget; a turn's is below
            lr=1e-6, betas=[0.9, 0.999], weight_decay=0.0, clip_low=0.2, clip_high=0.28, grad_clip=1.0,
            temperature=1.0, top_p=1.0, steps=steps, seed=0, threads=1,
        )  # fmt: skip
        config = grpo_config(spec, out_dir)
        config.generation_kwargs = {"max_new_tokens": max_new_tokens}
        config.max_tool_calling_iterations = max_turns - 1
        self.gate = threading.Semaphore(0)
        self.results: queue.Queue[dict[str, float] | BaseException] = queue.Queue()
        self.stopping = False
        timed = {"rollout_s": 0.0, "engine_s": 0.0, "turns": 0.0, "began": 0.0}
        owner = self

        class TimedGRPOTrainer(GRPOTrainer):
            """GRPOTrainer that times its rollout and its generate calls and counts the turns."""

            def _generate(self, prompts: Any) -> Any:
                began = time.perf_counter()
                out = super()._generate(prompts)
                timed["rollout_s"] = time.perf_counter() - began
                environments: list[GuessEnv] = self.environments or []
                timed["turns"] = float(sum(env.steps + 1 for env in environments))  # a turn, then one after each step
                return out

            def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
                began = time.perf_counter()
                out = super()._generate_single_turn(*args, **kwargs)  # type: ignore[no-untyped-call]
                timed["engine_s"] += time.perf_counter() - began
                return out

        class Gate(TrainerCallback):
            """Holds each step until ``batch`` releases it. A step's times are reported once
            the Trainer is back at the gate (or done), so none of its work overlaps what the
            caller runs next."""

            def __init__(self) -> None:
                self.done: dict[str, float] | None = None

            def report(self) -> None:
                if self.done is not None:
                    owner.results.put(self.done)
                    self.done = None

            def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.report()
                owner.gate.acquire()
                if owner.stopping:
                    raise _Stopped
                timed.update(rollout_s=0.0, engine_s=0.0, turns=0.0, began=time.perf_counter())

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                step_s = time.perf_counter() - timed["began"]
                self.done = {"wall_s": timed["rollout_s"], "engine_s": timed["engine_s"], "turns": timed["turns"], "step_s": step_s}

            def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                self.report()

        counter = itertools.count()
        self.trainer = TimedGRPOTrainer(
            model=str(model_dir),
            args=config,
            processing_class=tokenizer,
            callbacks=[Gate()],
            environment_factory=lambda: GuessEnv(i := next(counter), latencies(i)),
        )
        self.trainer.remove_callback(PrinterCallback)

        def train() -> None:
            torch.set_num_threads(1)
            try:
                self.trainer.train()
            except _Stopped:
                pass
            except BaseException as e:  # reported to whoever waits in ``batch``
                self.results.put(e)

        self.thread = threading.Thread(target=train, name="trl-grpo", daemon=True)
        self.thread.start()

    def batch(self) -> dict[str, float]:
        """Run one optimizer step (one batch of episodes) and return its times and turns."""
        self.gate.release()
        result = self.results.get()
        if isinstance(result, BaseException):
            raise RuntimeError("TRL's GRPOTrainer failed") from result
        return result

    def close(self) -> None:
        """End the training loop (at once if steps are left) and wait for its thread."""
        self.stopping = True
        self.gate.release()
        self.thread.join()
