"""Built-in environments, small enough to learn on a CPU and written as a user writes one.

``GuessNumber`` (``env.class: yatt.rl.agents.games:GuessNumber``): guess a number with
higher/lower feedback, over several turns. It follows Gymnasium's text convention exactly
(``reset(seed=, options=)``, ``step(action)``), so it also shows what yatt expects of a
user's environment.
"""

from __future__ import annotations

import random
import re
from typing import Any


class GuessNumber:
    """Guess a secret whole number in [1, ``high``] (chosen by the reset seed); each wrong
    guess is answered "higher" or "lower". Reward 1 for the right guess (the episode ends),
    0 otherwise; a turn without a number is told how to answer."""

    def __init__(self, high: int = 8) -> None:
        if high < 2:
            raise ValueError(f"high must be >= 2 (got {high})")
        self.high = high
        self.secret = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.secret = random.Random(seed).randint(1, self.high)
        return f"I am thinking of a number from 1 to {self.high}. Guess it: answer with the number only.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        found = re.search(r"-?\d+", action)
        if found is None:
            return f"Answer with a number from 1 to {self.high}.", 0.0, False, False, {}
        guess = int(found.group())
        if guess == self.secret:
            return "Correct.", 1.0, True, False, {}
        return ("Higher." if guess < self.secret else "Lower."), 0.0, False, False, {}
