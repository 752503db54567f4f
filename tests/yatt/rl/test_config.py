"""Config loading: unknown keys and bad values are rejected by dotted name, with the fix."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from yatt.errors import ConfigError
from yatt.rl.config import (
    AlgorithmConfig,
    BufferConfig,
    GeneratorConfig,
    RewardConfig,
    ScorerConfig,
    TrainerConfig,
)
from yatt.runtime.configtools import apply_overrides, build, require, to_dict


@dataclass(frozen=True, kw_only=True)
class Inner:
    max_staleness: int = 0
    mode: Literal["a", "b"] = "a"

    def __post_init__(self) -> None:
        require(self.max_staleness >= 0, "max_staleness", f"must be >= 0 (got {self.max_staleness})")


@dataclass(frozen=True, kw_only=True)
class Outer:
    buffer: Inner = field(default_factory=Inner)
    items: list[Inner] = field(default_factory=list)
    rate: float = 1.0
    name: str | None = None


def test_builds_nested_and_defaults() -> None:
    cfg = build(Outer, {"buffer": {"max_staleness": 2}, "rate": 3, "items": [{"mode": "b"}]})
    assert cfg == Outer(buffer=Inner(max_staleness=2), rate=3.0, items=[Inner(mode="b")])
    assert build(Outer, to_dict(cfg)) == cfg


def test_relation_check_names_the_dotted_field() -> None:
    with pytest.raises(ConfigError, match=r"^buffer\.max_staleness must be >= 0 \(got -1\)$"):
        build(Outer, {"buffer": {"max_staleness": -1}})


def test_unknown_key_suggests_the_close_one() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key buffer\.max_stalenes; did you mean buffer\.max_staleness\?"):
        build(Outer, {"buffer": {"max_stalenes": 1}})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"rate": "fast"}, r"rate must be a number \(got 'fast'\)"),
        ({"buffer": {"max_staleness": 1.5}}, r"buffer\.max_staleness must be an integer \(got 1\.5\)"),
        ({"buffer": {"max_staleness": True}}, r"buffer\.max_staleness must be an integer \(got True\)"),
        ({"buffer": {"mode": "c"}}, r"buffer\.mode must be one of 'a', 'b' \(got 'c'\)"),
        ({"items": [{}, {"mode": "z"}]}, r"items\[1\]\.mode must be one of"),
        ({"buffer": 3}, r"buffer must be a mapping \(got int\)"),
        ({"name": 5}, r"name must be a string \(got 5\)"),
    ],
)
def test_bad_values(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(Outer, data)


def test_overrides_parse_yaml_scalars() -> None:
    data = apply_overrides({}, ["buffer.max_staleness=2", "rate=0.5", "name=run1"])
    assert build(Outer, data) == Outer(buffer=Inner(max_staleness=2), rate=0.5, name="run1")
    assert build(Outer, apply_overrides({}, ["rate=3e-3"])).rate == 0.003  # YAML 1.1 reads it as a string
    with pytest.raises(ConfigError, match="must look like dotted.key=value"):
        apply_overrides({}, ["rate"])
    with pytest.raises(ConfigError, match=r"override trainer\.betas: '\[0\.9,' is not a YAML value .*close its brackets"):
        apply_overrides({}, ["trainer.betas=[0.9,"])


def test_component_configs_validate() -> None:
    with pytest.raises(ConfigError, match=r"dual_clip must be > 1 or null \(got 0\.5\)"):
        build(AlgorithmConfig, {"dual_clip": 0.5})
    with pytest.raises(ConfigError, match=r"scorers\[0\]\.pattern is required for kind format_regex"):
        build(RewardConfig, {"scorers": [{"kind": "format_regex"}]})
    with pytest.raises(ConfigError, match=r"lr must be > 0"):
        build(TrainerConfig, {"lr": 0.0})
    assert build(GeneratorConfig, {"backend": "vllm"}).backend == "vllm"
    assert build(ScorerConfig, {"kind": "math_verify", "weight": 2}).weight == 2.0


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"min_acceptance": 2}, r"^buffer\.min_acceptance must be in \[0, 1\), 0 for no floor \(got 2\.0\)$"),
        ({"min_acceptance": 1}, r"^buffer\.min_acceptance must be in \[0, 1\), 0 for no floor \(got 1\.0\)$"),
        ({"min_acceptance": -0.1}, r"^buffer\.min_acceptance must be in \[0, 1\), 0 for no floor \(got -0\.1\)$"),
        ({"acceptance_window": 0}, r"^buffer\.acceptance_window must be >= 1 \(got 0\)$"),
    ],
)
def test_the_acceptance_floor_is_validated(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(BufferConfig, data, "buffer")
    assert build(BufferConfig, {"min_acceptance": 0, "acceptance_window": 1}, "buffer").min_acceptance == 0
