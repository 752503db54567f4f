"""``$YATT_CACHE_DIR`` (``yatt.runtime.cache``) moves every cache a machine keeps: the
SmolLM2 export the planner and the roles read, and the engine measurements."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.config import load_run_config
from launch.placement.engines import cache_file
from launch.placement.inputs import model_config
from yatt.runtime.cache import cache_dir, smollm2_dir


def test_yatt_cache_dir_moves_the_smollm2_export_and_the_engine_measurements(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("YATT_CACHE_DIR", str(tmp_path))
    exported = tmp_path / "smollm2-135m-instruct"
    exported.mkdir()
    (exported / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "written_here": True}))
    cfg = load_run_config(None, ["model.path=builtin:smollm2"])
    assert smollm2_dir() == exported
    assert model_config(cfg)["written_here"] is True  # the planner reads the export found there
    assert cache_file() == tmp_path / "engine-probes.json"
    monkeypatch.delenv("YATT_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "yatt"
    assert "written_here" not in model_config(cfg)
