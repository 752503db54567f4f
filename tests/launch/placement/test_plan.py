"""``python -m launch plan`` and what the launcher calls for ``placement.layout``: the three
candidates and a pick on this machine, costs calibrated from a run dir, explicit layouts."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from launch.__main__ import main
from launch.config import dump_run_config, load_run_config
from launch.placement.command import table
from launch.placement.inputs import (
    TINY_CONFIG,
    measure_peak_flops,
    plan_for_run,
    roles_of,
    run_costs,
    run_sizes,
    run_workload,
    this_machine,
)
from yatt.errors import ConfigError
from yatt.placement.costs import hf_param_count
from yatt.placement.layouts import assign, cpu_cluster, gpu_cluster
from yatt.placement.plan import LAYOUTS
from yatt.placement.planner import GIB, candidates

ROOT = Path(__file__).resolve().parents[3]


def test_plan_prints_the_three_layouts_and_a_pick(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--peak-flops", "1e11"]) == 0
    out = capsys.readouterr().out
    cores = len(os.sched_getaffinity(0))
    assert out.startswith(f"cluster: {cores} cpu slots") and "peak 100.0 GFLOP/s" in out
    rows = [line.split()[0] for line in out.splitlines() if line and not line.startswith(" ")]
    assert [r for r in rows if r in LAYOUTS] == list(LAYOUTS)
    pick = out.splitlines()[-1]
    assert pick.startswith("pick: ") and pick.split()[1].rstrip(":") in LAYOUTS and "s/step" in pick
    assert main(["plan", "--peak-flops", "1e11", "--search", "trainer.world_size=1"]) == 0
    searched = capsys.readouterr().out
    assert f"processes  buffer 1 reward 1 controller 2 trainer {cores}" in searched  # colocated: a rank per slot


def test_table_of_a_gpu_cluster_summarises_the_slots() -> None:
    cfg = load_run_config(None, ["generator.backend=vllm"])
    cluster = gpu_cluster([80 * int(GIB)] * 16, list(range(32)), peak_flops=8e14)
    sizes, costs = run_sizes(cfg, "gpu"), run_costs(cfg, cluster)
    text = table(candidates(cluster, sizes, costs, run_workload(cfg, "gpu"), roles_of(cfg), search=True))
    assert "idle share per slot  min " in text and "memory GiB per slot  min " in text and " max 40.0" in text
    assert text.splitlines()[-1].startswith("pick: ")


def test_plan_calibrates_from_a_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_run_config(None)
    dump_run_config(cfg, tmp_path / "config.yaml")
    row = {"step": 0, "tokens_per_s": 60.0, "samples_per_s": 10.0, "time/step_s": 2.0, "time/train_s": 0.9,
           "time/wait_for_buffer_s": 0.8, "time/weight_sync_s": 0.07, "buffer/acceptance_ema": 0.4}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({**row, "step": k}) + "\n" for k in range(3)))
    cluster = cpu_cluster([0, 1], 8 * int(GIB), peak_flops=1e11)
    costs = run_costs(cfg, cluster, tmp_path)
    assert (costs.weight_sync_s, costs.acceptance, costs.completion_mean) == (0.07, 0.4, 6.0)
    assert costs != run_costs(cfg, cluster)
    partial = assign("partial", cluster, roles_of(cfg))  # the generator had 1 of the 2 slots
    (tmp_path / "plan.json").write_text(json.dumps(partial.to_json()))
    planned = run_costs(cfg, cluster, tmp_path)  # the same rollout time on fewer slots: a slot is faster
    assert planned.gen_token_s < costs.gen_token_s and planned.train_token_s == pytest.approx(costs.train_token_s)
    assert main(["plan", "--peak-flops", "1e11", "--from", str(tmp_path)]) == 0
    assert f"costs measured in {tmp_path}" in capsys.readouterr().out
    assert main(["plan", "--peak-flops", "1e11", "--from", str(tmp_path / "nothing")]) == 2
    assert "not a run dir" in capsys.readouterr().err


def test_plan_for_run_auto_and_explicit_layouts() -> None:
    cfg = load_run_config(None)
    cluster = cpu_cluster([0, 1], 8 * int(GIB), peak_flops=1e11)
    costs = run_costs(cfg, cluster)
    auto = plan_for_run(cfg, cluster, costs)
    assert auto.layout in LAYOUTS and auto.predicted_step_s > 0 and set(auto.idle_share) == {0, 1}
    for layout in LAYOUTS:
        plan = plan_for_run(cfg, cluster, costs, layout)
        assert plan.layout == layout and plan.predicted_step_s >= auto.predicted_step_s
    assert plan_for_run(cfg, cluster, costs, "partial").of("generator")[0].slots == (0,)
    tiny = cpu_cluster([0, 1], 1 << 20, peak_flops=1e11)  # 0.5 MiB per slot: nothing fits
    with pytest.raises(ConfigError, match=r"placement.layout=colocated: slot \d needs .* but has 0.00 GiB"):
        plan_for_run(cfg, tiny, costs, "colocated")
    with pytest.raises(ConfigError, match="no layout fits"):
        plan_for_run(cfg, tiny, costs)
    with pytest.raises(ConfigError, match="placement.layout must be auto"):
        plan_for_run(cfg, cluster, costs, "spread")
    unmeasured = cpu_cluster([0, 1], 8 * int(GIB))  # the launcher's: no peak yet; measured here
    assert plan_for_run(cfg, unmeasured).predicted_step_s > 0
    placed = load_run_config(None)
    object.__setattr__(placed, "placement", SimpleNamespace(layout="partial"))  # the section to come
    assert plan_for_run(placed, cluster, costs).layout == "partial"


def test_vllm_on_gpu_reserves_its_share() -> None:
    cfg = load_run_config(None, ["generator.backend=vllm", "generator.vllm_gpu_memory_utilization=0.4"])
    assert run_workload(cfg, "gpu").engine_reserve_share == 0.4
    assert run_workload(cfg, "cpu").engine_reserve_share == 0.0


def test_the_tiny_config_is_the_default_models() -> None:
    """TINY_CONFIG mirrors build_tiny_model's defaults (read from its source: no transformers import)."""
    tree = ast.parse((ROOT / "workers" / "models.py").read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "build_tiny_model")
    defaults = {a.arg: ast.literal_eval(d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True) if d}
    assert TINY_CONFIG["hidden_size"] == defaults["hidden_size"]
    assert TINY_CONFIG["num_hidden_layers"] == defaults["num_layers"]
    assert TINY_CONFIG["num_attention_heads"] == defaults["num_heads"]
    assert TINY_CONFIG["vocab_size"] == defaults["vocab_size"]
    assert run_sizes(load_run_config(None), "cpu").policy_params == hf_param_count(TINY_CONFIG)


def test_measure_peak_flops_and_this_machine() -> None:
    assert measure_peak_flops(size=64, seconds=0.01) > 0
    cluster = this_machine(peak_flops=5e10)
    assert len(cluster.slots) >= 1 and cluster.peak_flops == 5e10 and cluster.slots[0].memory_bytes > 0


def test_world_size_0_is_the_plans_pick_measured_from_the_models_thread_scaling(tmp_path: Path) -> None:
    """trainer.world_size=0: the costs carry the tiny model's measured thread scaling (its
    small operations scale worse over threads than over processes), the plan picks the
    ranks, and the config the roles read names the plan's count."""
    from launch.placement.plan_file import with_planned_ranks

    cfg = load_run_config(None, ["trainer.world_size=0", "buffer.filter=none"])
    cluster = cpu_cluster([0, 1], 8 * int(GIB), peak_flops=1e11)
    costs = run_costs(cfg, cluster)
    assert costs.thread_scaling is not None and costs.gen_thread_scaling is not None
    assert 0 <= costs.gen_thread_scaling <= 1 and costs.collective_s > 0
    assert run_costs(load_run_config(None), cluster).thread_scaling is None  # ranks fixed by the config: not measured
    plan = plan_for_run(cfg, cluster, costs)
    ranks = len(plan.of("trainer"))
    resolved = with_planned_ranks(cfg, plan)
    assert ranks in (1, 2) and resolved.trainer.world_size == ranks
    dump_run_config(resolved, tmp_path / "config.yaml")
    assert load_run_config(tmp_path / "config.yaml").trainer.world_size == ranks
    assert with_planned_ranks(load_run_config(None), plan).trainer.world_size == 2  # a given count stands
    assert main(["slurm", "--nodes", "1", "trainer.world_size=0"]) == 2  # srun needs the count: one line, before submitting


def test_the_workload_knows_the_prompts_length_and_whether_the_trainer_shares_them() -> None:
    cfg = load_run_config(None)
    work = run_workload(cfg, "cpu", prompt_tokens=13.0)
    assert work.prompt_tokens == 13.0 and work.prompt_shared_by == cfg.buffer.group_size  # share_prompt auto
    assert run_workload(load_run_config(None, ["trainer.share_prompt=false"]), "cpu").prompt_shared_by == 1
    assert run_workload(cfg, "cpu").prompt_tokens == 64.0  # not read yet
