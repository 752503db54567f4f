"""The run config: the built-in default loads, every example loads, and relations between
sections are checked with the dotted field named."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.__main__ import main
from launch.config import dump_run_config, load_run_config
from yatt.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_default_is_the_tiny_job() -> None:
    cfg = load_run_config(None)
    assert cfg.model.path == "" and cfg.data.task == "digits"
    assert (cfg.controller.num_controllers, cfg.run.num_generators, cfg.run.num_rewards, cfg.trainer.world_size) == (2, 1, 1, 2)


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_load(path: Path) -> None:
    load_run_config(path)


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = load_run_config(None, ["buffer.max_staleness=2", "trainer.lr=3e-4"])
    dump_run_config(cfg, tmp_path / "config.yaml")
    assert load_run_config(tmp_path / "config.yaml") == cfg


def test_cross_section_check_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.weight_sync_every = 3 lets generators lag 2 versions"):
        load_run_config(None, ["trainer.weight_sync_every=3"])
    assert load_run_config(None, ["trainer.weight_sync_every=3", "buffer.max_staleness=2"]).trainer.weight_sync_every == 3


def test_bad_key_stops_the_launcher_before_anything_starts(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["run", "buffer.max_stalenes=1", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "unknown config key buffer.max_stalenes; did you mean buffer.max_staleness?" in err
    assert not (tmp_path / "run").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2]\n")
    assert main(["run", str(bad)]) == 2
    assert "trainer must be a mapping" in capsys.readouterr().err
