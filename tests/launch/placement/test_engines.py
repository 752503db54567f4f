"""``generator.backend=auto`` (launch/placement/engines.py): each engine's generation over
the run, measured on the run's own batch where vLLM could win, cached, and the faster one
chosen; nothing measured where it could not."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from launch.checks import vllm_refusal
from launch.config import RunConfig, load_run_config
from launch.placement.engines import VLLM_START_S, EngineCosts, cache_file, choose_engine, measured, pick
from yatt.placement.plan import Assignment, Plan
from yatt.rl.data import Prompt, load_prompt_sets


def prompts_of(cfg: RunConfig, model_dir: Path) -> tuple[list[Prompt], list[Prompt]]:
    return load_prompt_sets(cfg.data, str(model_dir))


def planned(step_s: float) -> Plan:
    return Plan(layout="colocated", assignments=(), predicted_step_s=step_s)


def no_probe(*args: object, **kwargs: object) -> None:
    raise AssertionError("measured again")


def test_the_faster_engine_over_the_run_is_picked_its_start_counted() -> None:
    hf = EngineCosts(start_s=3.0, generate_s=1.2, update_s=0.1)
    vllm = EngineCosts(start_s=75.0, generate_s=0.4, update_s=0.2)  # 0.7 s a step faster, 72 s slower to start
    both = {"transformers": hf, "vllm": vllm}
    assert pick(both, 100).backend == "transformers"  # 135 s against 133 s
    longer = pick(both, 110)  # 141 s against 146 s
    assert longer.backend == "vllm"
    assert longer.reason == ("measured over 110 steps: vLLM 141 s (75.0 s start, 0.4 s a batch, 0.2 s an update); "
                             "transformers 146 s (3.0 s start, 1.2 s a batch, 0.1 s an update)")
    broken = pick({"transformers": hf, "vllm": EngineCosts(error="exit code 1: RuntimeError: no KV cache")}, 10_000)
    assert broken.backend == "transformers" and "vLLM could not run here (exit code 1: RuntimeError: no KV cache)" in broken.reason


def test_a_run_vllm_cannot_win_is_not_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               tiny_model_dir: Path) -> None:
    monkeypatch.setenv("YATT_CACHE_DIR", str(tmp_path))
    cfg = load_run_config(None, ["run.steps=80"])
    train, _ = prompts_of(cfg, tiny_model_dir)
    short = choose_engine(cfg, planned(0.2), tiny_model_dir, train, refusal=None, threads=1, device="cpu")
    assert short.backend == "transformers"
    assert short.reason == f"the whole run is planned at 16 s, less than vLLM's start alone (>= {VLLM_START_S:.0f} s)"
    refused = choose_engine(cfg, planned(10.0), tiny_model_dir, train, refusal="it needs torchvision", threads=1, device="cpu")
    assert refused.backend == "transformers" and refused.reason == "vLLM cannot serve this run: it needs torchvision"
    assert not cache_file().exists(), "nothing was to be measured"


@pytest.mark.vllm
def test_vllm_is_refused_where_check_against_would_refuse_it(tiny_model_dir: Path) -> None:
    cfg = load_run_config(None, [])
    assert vllm_refusal(cfg, tiny_model_dir, prompts_of(cfg, tiny_model_dir)) is None
    short = load_run_config(None, ["generator.vllm_max_model_len=16"])
    refusal = vllm_refusal(short, tiny_model_dir, prompts_of(short, tiny_model_dir))
    assert refusal is not None and "controller.max_new_tokens = 8" in refusal and "generator.vllm_max_model_len" in refusal


def test_a_failed_probe_is_cached_with_its_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YATT_CACHE_DIR", str(tmp_path))
    cfg = load_run_config(None, ["generator.backend=transformers"])
    probe: dict[str, Any] = {"model_path": str(tmp_path / "no-model"), "dtype": "float32", "device": "cpu", "lora": None,
                             "prompts": [[1, 2, 3]], "n": 2, "sampling": {"max_new_tokens": 4}}
    costs = measured(probe, cfg.generator, 1)
    assert costs.error.startswith("exit code 1: ") and "no-model" in costs.error, costs
    cached = json.loads(cache_file().read_text())
    assert list(cached.values()) == [{"start_s": 0.0, "generate_s": 0.0, "update_s": 0.0, "error": costs.error}]
    monkeypatch.setattr(subprocess, "run", no_probe)
    assert measured(probe, cfg.generator, 1) == costs  # read back, not measured again


@pytest.mark.vllm
def test_auto_measures_both_engines_on_the_runs_batch_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           tiny_model_dir: Path) -> None:
    """Both engines start, generate the run's batch and load an update (vLLM: ~40 s on 2
    CPU cores); the choice is ``pick``'s over those costs; a second run reads them back."""
    monkeypatch.setenv("YATT_CACHE_DIR", str(tmp_path))
    cfg = load_run_config(None, ["run.steps=2000", "buffer.groups_per_step=4"])
    train, _ = prompts_of(cfg, tiny_model_dir)
    choice = choose_engine(cfg, planned(0.2), tiny_model_dir, train, refusal=None, threads=2, device="cpu")
    cached = [EngineCosts(**c) for c in json.loads(cache_file().read_text()).values()]
    assert len(cached) == 2 and all(not c.error and c.start_s > 0 and c.generate_s > 0 and c.update_s > 0 for c in cached)
    assert choice.reason.startswith("measured over 2000 steps: vLLM ")
    vllm_s = float(choice.reason.split("vLLM ")[1].split(" s")[0])
    hf_s = float(choice.reason.split("; transformers ")[1].split(" s")[0])
    assert choice.backend == ("vllm" if vllm_s < hf_s else "transformers")
    monkeypatch.setattr(subprocess, "run", no_probe)
    assert choose_engine(cfg, planned(0.2), tiny_model_dir, train, refusal=None, threads=2, device="cpu") == choice
    # Colocated, the transformers engine generates with the rank's own module: no update to load.
    rank = Assignment(role="trainer", index=0, slots=(0, 1), threads=2, hosts_generator=True)
    colocated = Plan(layout="colocated", assignments=(rank,), predicted_step_s=0.2)
    shared = choose_engine(cfg, colocated, tiny_model_dir, train, refusal=None, threads=2, device="cpu")
    assert shared.reason.endswith(" 0 s an update)") and not choice.reason.endswith(" 0 s an update)"), shared
