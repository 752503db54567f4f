"""Built-in synthetic tasks and their rewards, and the scorer of reasoning-gym entries.

The built-in default job trains the tiny model (workers/models.py) on CPU in about a
minute, warm-started by a few seconds of supervised steps, and CI checks that its
exact-match accuracy on held-out sums rises. A random policy almost never writes the exact
answer, so a binary reward gives GRPO no signal to start from; ``digits`` therefore pays
partial credit along the way a policy can actually climb:

    random text             ~0.06   (about one completion in five starts with a number)
    starts with a number     0.2    (learnt in a few hundred GRPO steps)
    right digits, in place   0.2 + 0.8 x share (always "12" earns 0.42 on average)
    the exact sum            1.0

``TASKS`` maps a name to its prompt maker and reward. Every reward has the signature of the
reward worker's custom scorer, ``(prompt, completion, metadata) -> float``, so a config can
name it by dotted path, e.g. ``yatt.rl.tasks:digits_reward``. Every task also puts the reference
answer in ``metadata["answer"]``, so the generic scorers (exact_match, math_verify) work too.

A visual task (``count_red``) also draws each prompt's images from its metadata
(``Task.images``), so a prompt is still a text and strings, and any process can redraw its
pixels; PIL is imported only there, so importing yatt stays light.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from PIL.Image import Image

Example = tuple[str, dict[str, str]]
"""A prompt text and its metadata (strings only)."""
Reward = Callable[[str, str, Mapping[str, str]], float]
"""(prompt, completion, metadata) -> reward."""


class Task(NamedTuple):
    """A synthetic task: deterministic prompts from a seed, and their reward."""

    make_prompts: Callable[[int, int], list[Example]]
    """(num, seed) -> num prompts with their metadata."""
    reward: Reward
    """Scores one completion of one of those prompts."""
    images: Callable[[Mapping[str, str]], list[Image]] | None = None
    """A visual task: a prompt's images, redrawn from its metadata (shown before its text); None: text only."""


_LEADING_NUMBER = re.compile(r"\s*(-?\d+)")
_NUMBER = re.compile(r"-?\d+")


def _terms(num: int, seed: int, low: int, high: int) -> list[tuple[int, int]]:
    """``num`` pairs (a, b) drawn uniformly from [low, high]."""
    rng = random.Random(seed)
    return [(rng.randint(low, high), rng.randint(low, high)) for _ in range(num)]


def _sums(num: int, seed: int, low: int, high: int) -> list[Example]:
    """``num`` prompts "What is a + b?" with a, b drawn uniformly from [low, high]."""
    return [(f"What is {a} + {b}?", {"answer": str(a + b)}) for a, b in _terms(num, seed, low, high)]


def digits_prompts(num: int, seed: int) -> list[Example]:
    """Sums of two single digits (answers 0..18): small enough for a tiny model to learn."""
    return _sums(num, seed, 0, 9)


def digits_reward(prompt: str, completion: str, metadata: Mapping[str, str]) -> float:
    """0.2 if the completion starts with a number, plus 0.8 x the share of digits right in place.

    The share is the number of positions where the leading number and the answer agree,
    over the longer of the two, so extra digits cost credit: for the answer "12", "12" earns
    1.0, "13" 0.6, "123" 0.733, "7" 0.2, and "the answer is 12" 0.
    """
    match = _LEADING_NUMBER.match(completion)
    if match is None:
        return 0.0
    number: str = match.group(1)
    answer = metadata["answer"]
    right = sum(x == y for x, y in zip(number, answer, strict=False))
    return 0.2 + 0.8 * right / max(len(number), len(answer))


def repeated_prompts(num: int, seed: int) -> list[Example]:
    """"Which digit repeats: 3 7 1 7?": three distinct digits and a second copy of one of
    them, put in at a random place (answers 0..9, 4,320 distinct lists). A rule, not a table
    of facts: a tiny model that learns it on some lists answers lists it never saw."""
    rng = random.Random(seed)
    examples = []
    for _ in range(num):
        digits = rng.sample(range(10), 3)
        repeated = rng.choice(digits)
        digits.insert(rng.randint(0, 3), repeated)
        examples.append((f"Which digit repeats: {' '.join(map(str, digits))}?", {"answer": str(repeated)}))
    return examples


def repeated_reward(prompt: str, completion: str, metadata: Mapping[str, str]) -> float:
    """1 if the completion is the answer and nothing else (spaces aside), else 0.

    No partial credit: credit for naming any digit of the list would pay a guess among its
    three (right a third of the time) nearly as well as the rule. (The default job's
    warm-started model answers with one digit in 3 of 4 samples, one of the list in 3 of 10.)"""
    return 1.0 if completion.strip() == metadata["answer"] else 0.0


def addition_prompts(num: int, seed: int) -> list[Example]:
    """Sums of two two-digit numbers: for small real models (e.g. SmolLM2), not the tiny one."""
    return _sums(num, seed, 10, 99)


def addition_reward(prompt: str, completion: str, metadata: Mapping[str, str]) -> float:
    """1 if the last number in the completion is the answer, else 0.

    The last one, because a chat model tends to restate the question first ("23 + 45 = 68").
    """
    numbers = _NUMBER.findall(completion)
    return 1.0 if numbers and numbers[-1] == metadata["answer"] else 0.0


CALCULATOR_SHARE = 0.25
"""The share of ``calculator`` rows whose demonstration uses the calculator (the rest answer
from memory): the warm-started model then answers most questions itself, and wrongly (a
tiny model cannot add two-digit numbers), so RL has the calculator's worth to find."""

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def calculator_prompts(num: int, seed: int) -> list[Example]:
    """Sums of two two-digit numbers, for a policy with a calculator tool (tag protocol):
    ``examples/agent_calculator.yaml``. Each row's metadata holds the answer and a
    demonstration (``"demonstration"``: the episode's actions as a JSON list), which the
    tiny model's warm start plays through the run's own episode code
    (yatt/rl/agents/demonstrations.py): a ``CALCULATOR_SHARE`` of them call the calculator
    and answer with its result, the rest answer at once."""
    rng = random.Random(f"calculator demonstrations {seed}")
    examples = []
    for a, b in _terms(num, seed, 10, 99):
        answer = f"<answer>{a + b}</answer>"
        actions = [f'<tool>calculator("{a} + {b}")</tool>', answer] if rng.random() < CALCULATOR_SHARE else [answer]
        examples.append((f"What is {a} + {b}?", {"answer": str(a + b), "demonstration": json.dumps(actions)}))
    return examples


def answer_reward(prompt: str, completion: str, metadata: Mapping[str, str]) -> float:
    """1 if the completion's last ``<answer>...</answer>`` holds the answer (spaces aside), or,
    with no answer tags, the completion is the answer and nothing else; else 0. Only the
    policy writes answer tags, so a tool's result in the transcript earns nothing."""
    answers = _ANSWER.findall(completion)
    return 1.0 if (answers[-1] if answers else completion).strip() == metadata["answer"] else 0.0


GUESS_HIGH = 8
"""The ``guess`` task's secrets are 1..GUESS_HIGH (``env.kwargs.high`` of GuessNumber)."""

GUESS_SHARE = 0.25
"""The share of ``guess`` rows demonstrated with a binary search (the rest count up from 1,
which finds a secret above 4 too late): the warm-started policy mostly counts up, and RL
has the halving's worth to find."""


def guess_prompts(num: int, seed: int) -> list[Example]:
    """Guess-the-number games (``examples/agent_guess.yaml``, GuessNumber with high 8, 4
    turns): each row's metadata holds its secret (the game plays it) and a demonstration,
    a ``GUESS_SHARE`` of them a binary search, the rest 1, 2, 3, 4 (right for half the secrets)."""
    rng = random.Random(seed)
    examples = []
    for game in range(num):
        secret = rng.randint(1, GUESS_HIGH)
        if rng.random() < GUESS_SHARE:
            low, high, guesses = 1, GUESS_HIGH, list[int]()
            while not guesses or guesses[-1] != secret:
                guesses.append((low + high) // 2)
                low, high = (guesses[-1] + 1, high) if guesses[-1] < secret else (low, guesses[-1] - 1)
        else:
            guesses = list(range(1, min(secret, 4) + 1))
        metadata = {"answer": str(secret), "secret": str(secret), "demonstration": json.dumps([str(g) for g in guesses])}
        examples.append((f"Game {seed}-{game}: guess the number from 1 to {GUESS_HIGH}.", metadata))  # (the game writes its own prompt)
    return examples


COUNT_SIZE = 56
"""The ``count_red`` images' side in pixels: a 2x2 grid of cells, each empty or holding one square."""

_CELL = COUNT_SIZE // 2
_COLOURS = {"r": (220, 30, 30), "b": (30, 70, 220)}


def count_red_prompts(num: int, seed: int) -> list[Example]:
    """"How many red squares?" about a 56x56 picture (``count_red_images``): each of its
    four cells is empty, red or blue with equal odds (answers 0..4, 1 and 2 the commonest).
    The metadata holds the answer and the picture: ``cells`` ("r.b.": the cells' colours,
    row by row, "." empty) and ``squares`` (JSON [x, y, side] of each cell's square, its
    top-left corner and side in pixels, jittered)."""
    rng = random.Random(seed)
    examples = []
    for _ in range(num):
        cells = "".join(rng.choice(".rb") for _ in range(4))
        squares = []
        for cell in range(4):
            side = rng.randint(16, 20)
            x = (cell % 2) * _CELL + rng.randint(2, _CELL - 2 - side)
            y = (cell // 2) * _CELL + rng.randint(2, _CELL - 2 - side)
            squares.append([x, y, side])
        metadata = {"answer": str(cells.count("r")), "cells": cells, "squares": json.dumps(squares)}
        examples.append(("How many red squares?", metadata))
    return examples


def count_red_images(metadata: Mapping[str, str]) -> list[Image]:
    """The one picture of a ``count_red`` prompt, drawn from its metadata: the squares of
    ``cells`` at ``squares`` on white (the same pixels in every process)."""
    import PIL.Image
    import PIL.ImageDraw

    image = PIL.Image.new("RGB", (COUNT_SIZE, COUNT_SIZE), "white")
    draw = PIL.ImageDraw.Draw(image)
    for colour, (x, y, side) in zip(metadata["cells"], json.loads(metadata["squares"]), strict=True):
        if colour != ".":
            draw.rectangle((x, y, x + side - 1, y + side - 1), fill=_COLOURS[colour])
    return [image]


def count_reward(prompt: str, completion: str, metadata: Mapping[str, str]) -> float:
    """1 if the completion starts with the count (spaces aside: "2 red squares"), else 0."""
    match = _LEADING_NUMBER.match(completion)
    return 1.0 if match is not None and int(match.group(1)) == int(metadata["answer"]) else 0.0


TASKS: dict[str, Task] = {
    "digits": Task(digits_prompts, digits_reward),
    "repeated": Task(repeated_prompts, repeated_reward),
    "addition": Task(addition_prompts, addition_reward),
    "calculator": Task(calculator_prompts, answer_reward),
    "guess": Task(guess_prompts, addition_reward),  # (the last number said; the game's own reward is the one trained)
    "count_red": Task(count_red_prompts, count_reward, count_red_images),
}
"""The built-in synthetic tasks (data.source: synthetic, data.task: <name>)."""


@functools.cache
def _reasoning_gym_scorer(name: str) -> Callable[[str | None, dict[str, Any]], float]:
    """The score_answer of reasoning-gym dataset ``name``, made once per process."""
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)  # type: ignore[no-any-return]


def score_reasoning_gym(answer: str, metadata: Mapping[str, str]) -> float:
    """Score an extracted ``answer`` against the reasoning-gym entry in ``metadata``.

    ``metadata`` is what yatt.rl.data made for the prompt: ``task`` (the dataset name) and
    ``entry`` (the entry as JSON). A composite dataset names the source of each entry in
    ``entry["metadata"]["source_dataset"]``; that dataset's scorer decides.
    """
    entry = json.loads(metadata["entry"])
    name = entry.get("metadata", {}).get("source_dataset") or metadata["task"]
    return float(_reasoning_gym_scorer(name)(answer, entry))


def reasoning_gym_reward(prompt: str, completion: str, metadata: Mapping[str, str]) -> float:
    """A custom-scorer reward: the last <answer>...</answer> of the completion, scored; none: 0."""
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(completion)
    return 0.0 if answer is None else score_reasoning_gym(answer, metadata)
