"""What scorers take and give: one sample as text, one scorer's outcome, the mix's verdict.

Its own module so that the rule scorers (``workers.reward.scorers``) and the model scorers
(``workers.reward.model_scorers``) share them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, kw_only=True)
class ScoreInput:
    """One sample to score, as text."""

    prompt: str
    """The decoded prompt."""
    completion: str
    """The decoded completion."""
    metadata: dict[str, str]
    """The prompt's metadata, e.g. {"answer": "42"}; reasoning_gym: {"task": ..., "entry": json}."""
    finish_reason: str
    """"stop" or "length"."""


@dataclass(frozen=True, kw_only=True)
class ScoreResult:
    """The mix's verdict on one sample."""

    reward: float
    """The weighted sum of the components."""
    components: dict[str, float]
    """Scorer name -> raw score before weighting; 0.0 where it failed (a judge: failed verdicts count 0)."""
    failure: str
    """"" if every scorer succeeded, else "name: reason" per failed scorer, joined by "; "."""


class Outcome(NamedTuple):
    """One scorer's result for one sample: the score (0.0 if it failed), why it failed (or
    ""), and the failure's traceback where there is one (a rule's, from its pool process)."""

    score: float
    failure: str = ""
    detail: str = ""
