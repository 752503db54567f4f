"""The benchmarks run end to end in their quick form (``python -m benchmarks NAME --quick``)
and write a JSON whose figures and ratios are well formed; bad ``--set`` options are
refused with the field named."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.__main__ import main

REPO = Path(__file__).resolve().parents[2]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def run_quick(name: str, out: Path) -> dict[str, Any]:
    """Run one benchmark's quick form in a fresh interpreter; return its JSON."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", name, "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    data: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    assert data["benchmark"] == name
    return data


@pytest.mark.slow
def test_generation_quick_measures_every_column(tmp_path: Path) -> None:
    data = run_quick("generation", tmp_path)
    figures, ratios = data["figures"], data["ratios"]
    columns = ["hf_plain", "hf_yatt"] + (["vllm_plain", "vllm_yatt"] if HAS_VLLM else [])
    expected = {f"tiny_{c}_{unit}" for c in columns for unit in ("tok_per_s", "tokens_per_batch")}
    expected |= {f"tiny_{c}_engine_calls_per_batch" for c in columns if c.endswith("_yatt")}
    assert set(figures) == expected
    expected_ratios = {"tiny_hf_yatt_vs_plain"}
    if HAS_VLLM:
        expected_ratios |= {"tiny_vllm_yatt_vs_plain", "tiny_vllm_vs_hf"}
    else:
        assert any("no vLLM columns" in note for note in data["notes"])
    assert set(ratios) == expected_ratios
    for key, value in {**figures, **ratios}.items():
        assert math.isfinite(value) and value > 0, f"{key} = {value}"
    # The quick batch is 8 prompts x 2 samples x at most 16 new tokens (at least 1 each).
    for c in columns:
        assert 8 * 2 <= figures[f"tiny_{c}_tokens_per_batch"] <= 8 * 2 * 16
    for c in columns:
        if c.endswith("_yatt"):  # at least one engine call, at most one per request
            assert 1 <= figures[f"tiny_{c}_engine_calls_per_batch"] <= 8
    assert ratios["tiny_hf_yatt_vs_plain"] == pytest.approx(
        figures["tiny_hf_yatt_tok_per_s"] / figures["tiny_hf_plain_tok_per_s"]
    )
    if HAS_VLLM:
        assert ratios["tiny_vllm_vs_hf"] == pytest.approx(
            figures["tiny_vllm_yatt_tok_per_s"] / figures["tiny_hf_yatt_tok_per_s"]
        )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generation", "--set", "modles=[tiny]"], "did you mean models?"),
        (["generation", "--set", "reps=0"], "reps must be >= 1 (got 0)"),
        (["generation", "--set", "models=[gpt2]"], "models[0] must be one of 'tiny', 'smollm2'"),
        (["generation", "--set", "reps"], "must look like dotted.key=value"),
        (["transport", "--set", "reps=2"], "benchmark transport takes no --set options"),
        (["e2e", "--set", "sizes=[gpt2]"], "sizes[0] must be one of 'tiny', 'smollm2'"),
        (["e2e", "--set", "tiny_step=3"], "did you mean tiny_steps?"),
        (["e2e", "--set", "tiny_steps=2"], "tiny_steps must be >= 3"),
        (["e2e", "--set", "sizes=[tiny,tiny]"], "sizes must not repeat a size"),
        (["staleness", "--set", "ks=[1,2]"], "ks must include 0"),
        (["staleness", "--set", "ks=[0,-1]"], "ks must all be >= 0"),
        (["staleness", "--set", "steps=2"], "steps must be >= 3"),
        (["controllers", "--set", "controllers=[1,0]"], "controllers[1] must be >= 1 (got 0)"),
        (["controllers", "--set", "window_s=0"], "window_s must be > 0 (got 0.0)"),
        (["controllers", "--set", "in_flght=4"], "did you mean in_flight?"),
        (["controllers", "--set", "generators=0"], "generators must be >= 1 (got 0)"),
        (["placement", "--set", "workloads=[judges]"], "workloads unknown ['judges']"),
        (["placement", "--set", "sizes=[4]"], "sizes must all be >= 8 GPUs (got [4])"),
        (["placement", "--set", "live_repeats=0"], "live_repeats must be >= 1 (got 0)"),
        (["endpoint", "--set", "model=gpt2"], "endpoint.model must be tiny or smollm2"),
        (["endpoint", "--set", "turns=0"], "endpoint.turns must be >= 1 (got 0)"),
    ],
)
def test_bad_options_are_refused_with_the_field_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "a refused run must write nothing"


def test_transport_quick_measures_every_pattern(tmp_path: Path) -> None:
    data = run_quick("transport", tmp_path)
    figures, ratios = data["figures"], data["ratios"]
    for pattern in ("small_msgs_per_s", "rpc_round_trips_per_s", "batch_1MiB_MB_per_s", "batch_16MiB_MB_per_s"):
        for side in ("yatt", "raw_zmq"):
            assert any(k.startswith(f"{pattern}_{side}") for k in figures), f"{pattern} {side}"
    assert {"batch_16MiB_vs_raw_zmq", "rpc_vs_raw_zmq", "small_msgs_vs_raw_zmq"} <= set(ratios)
    curve = {k for k in ratios if k.startswith("curve_vs_plain_")}
    assert len(curve) == 5, f"authentication's cost on each pattern: {curve}"
    for key, value in {**figures, **ratios}.items():
        assert math.isfinite(value) and value > 0, f"{key} = {value}"
    assert ratios["rpc_vs_raw_zmq"] == pytest.approx(
        figures["rpc_round_trips_per_s_yatt_1_in_flight"] / figures["rpc_round_trips_per_s_raw_zmq_1_in_flight"]
    )
    assert data["env"]["cpus"] and data["env"]["torch"]


def test_soak_growth_compares_the_medians_of_the_first_and_last_tenths() -> None:
    """20 samples: the first two (the first tenth) 100 and 104 MiB, the last two 110 and
    250 (one sample in a step's peak): growth from median 102 to median 180; fds first/last."""
    from benchmarks.faults import Usage

    rss = [100.0, 104.0, *[105.0] * 16, 110.0, 250.0]
    usage = Usage.of([(r, 30 + (i == 19)) for i, r in enumerate(rss)])
    assert usage.rss_mb == (102.0, 180.0) and usage.fds == (30, 31)
    assert abs(usage.rss_growth - (180 / 102 - 1)) < 1e-12


def test_a_failures_cost_is_the_wall_time_of_the_steps_around_it_over_the_median() -> None:
    """Steps end every second (time/unix), but a failure after step 4 makes step 4 end 2.5 s
    late and step 5 0.5 s later still: 3 s lost, counted from the end of step 3 to the end
    of step 6. A trainer group killed after step 9 rolls back to its checkpoint after step 7
    (the metrics too): the step 7 that stays ends 5 s after step 6, the two steps trained
    twice and the restart, 4 s over, seen only when the window reaches back 2 steps."""
    from benchmarks.faults import failure_cost

    ends = [0.0, 1.0, 2.0, 3.0, 6.5, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0]
    assert failure_cost(ends, 4) == 3.0
    assert failure_cost(ends, 9) == 0.0
    rolled_back = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    assert failure_cost(rolled_back, 9, back=2) == 4.0
    assert failure_cost(rolled_back, 9) == 0.0


def test_a_role_killed_after_the_stop_grace_is_counted_with_where_it_was(tmp_path: Path) -> None:
    """The faults benchmark's run dirs go with it: a role the launcher had to SIGKILL at a
    stop keeps its line and the end of its log (its stacks) in the notes."""
    from benchmarks.faults import late_stops
    from benchmarks.harness import Result

    role_log = tmp_path / "undisturbed" / "logs" / "reward-0.log"
    role_log.parent.mkdir(parents=True)
    role_log.write_text("serving\nThread 0x1 (most recent call first):\n  File \"x.py\", line 3 in join\n")
    line = f"yatt: reward-0 did not stop within 15 s of SIGTERM; killing it (where its threads and tasks were is at the end of its log: {role_log})"
    (tmp_path / "undisturbed.launcher.log").write_text(f"yatt: all roles READY\n{line}\n")
    (tmp_path / "role_restart.launcher.log").write_text("yatt: done\n")
    result = Result()
    late_stops(tmp_path, result)
    assert result.figures["roles_killed_after_the_stop_grace"] == 1
    assert result.notes == [f"undisturbed.launcher.log: {line}\n" + role_log.read_text().rstrip("\n")]


@pytest.mark.slow
def test_agents_quick_measures_each_mode(tmp_path: Path) -> None:
    data = run_quick("agents", tmp_path)
    figures, ratios = data["figures"], data["ratios"]
    for mode in ("yatt", "lockstep", "record", "env_role", "trl"):
        assert figures[f"{mode}_episodes_per_s"] > 0 and 0 < figures[f"{mode}_generator_busy_share"] <= 1
    # TRL's rollout is part of its optimizer step; its turns are as long as the others' (2 a quick episode, all run)
    assert figures["trl_step_s"] > 8 / figures["trl_episodes_per_s"]
    assert figures["trl_turn_s"] == pytest.approx(8 / figures["trl_episodes_per_s"] / 2)
    assert set(ratios) == {"yatt_vs_lockstep", "yatt_vs_trl", "record_cost_share", "env_role_vs_inline"}
    assert all(math.isfinite(v) and v > 0 for v in ratios.values())


def test_endpoint_quick_measures_each_way_of_asking(tmp_path: Path) -> None:
    """The same episodes asked directly, over HTTP, through the openai SDK and through it
    hosted in an env worker: every mode ran its turns, and the ratios are the added time
    over the direct turn."""
    data = run_quick("endpoint", tmp_path)
    figures, ratios = data["figures"], data["ratios"]
    modes = ("direct", "http", "openai", "hosted")
    assert all(figures[f"{mode}_turn_s"] > 0 and figures[f"{mode}_calls_per_s"] > 0 for mode in modes)
    assert set(ratios) == {"endpoint_cost_share", "openai_sdk_cost_share", "hosting_cost_share"}
    assert ratios["endpoint_cost_share"] == pytest.approx(figures["http_added_s_per_turn"] / figures["direct_turn_s"])
    assert ratios["hosting_cost_share"] == pytest.approx(figures["hosted_added_s_per_turn"] / figures["direct_turn_s"])


def test_training_quick_times_each_layout_and_counts_the_prompt_tokens_saved(tmp_path: Path) -> None:
    """Quick: 2 prompts of 16 tokens x 2 completions; the shared layouts spare each prompt
    but its last token once (2 x 15), the others nothing; the FLOPs fall with it."""
    data = run_quick("training", tmp_path)
    figures, ratios = data["figures"], data["ratios"]
    layouts = ("padded", "packed", "shared", "shared_packed")
    assert all(figures[f"{name}_fwd_bwd_s"] > 0 for name in layouts)
    assert [figures[f"{name}_prompt_tokens_saved"] for name in layouts] == [0, 0, 30, 30]
    assert figures["packed_positions"] == figures["real_tokens"]
    assert figures["shared_packed_positions"] == figures["real_tokens"] - 30
    assert figures["shared_gflops_per_loss_token"] < figures["padded_gflops_per_loss_token"]
    assert set(ratios) == {f"{name}_speedup_vs_padded" for name in layouts} and ratios["padded_speedup_vs_padded"] == 1
