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
    assert cfg.model.path == "" and cfg.data.task == "repeated"
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
    sync_every_3 = ["trainer.weight_sync_every=3", "buffer.max_staleness=2"]
    with pytest.raises(ConfigError, match=r"run\.eval_every = 40 .* make it a multiple of 3"):  # the default job evaluates every 40
        load_run_config(None, sync_every_3)
    assert load_run_config(None, [*sync_every_3, "run.eval_every=6"]).trainer.weight_sync_every == 3
    with pytest.raises(ConfigError, match=r"model\.warm_start_steps must be >= 0"):
        load_run_config(None, ["model.warm_start_steps=-1"])
    with pytest.raises(ConfigError, match=r"model\.lora\.rank = 1024: vLLM serves adapters up to rank 512"):
        load_run_config(None, ["model.lora.rank=1024", "generator.backend=vllm"])
    assert load_run_config(None, ["model.lora.rank=16", "generator.backend=vllm"]).model.lora.rank == 16


def test_bad_key_stops_the_launcher_before_anything_starts(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["run", "buffer.max_stalenes=1", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "unknown config key buffer.max_stalenes; did you mean buffer.max_staleness?" in err
    assert not (tmp_path / "run").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2]\n")
    assert main(["run", str(bad)]) == 2
    assert "trainer must be a mapping" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.checkpoint_every=-5", r"trainer\.checkpoint_every.*must be >= 0 steps"),
        ("run.restart_limit=-1", r"run\.restart_limit.*must be >= 0"),
        ("controller.request_timeout_s=-1", r"controller\.request_timeout_s.*must be > 0 seconds"),
        ("run.stall_timeout_s=-3", r"run\.stall_timeout_s.*must be >= 0"),
        ("run.host=0.0.0.0", r"run\.host.*must be a loopback address"),
        ("run.eval_every=5 data.eval_split=0", r"run\.eval_every.*nothing to evaluate on: set data\.eval_split"),
        ("eval.n=-1", r"eval\.n.*must be >= 0"),
        ("data.eval_split=-0.1", r"data\.eval_split.*must be >= 0"),
        ("run.eval_every=3 data.eval_split=10 trainer.weight_sync_every=2 buffer.max_staleness=1", r"run\.eval_every.*multiple of 2"),
        ("run.report_to=[tensorboard,mlflow]", r"run\.report_to.*knows tensorboard and wandb, not \['mlflow'\]"),
        ("run.rollouts_per_step=-1", r"run\.rollouts_per_step.*must be >= 0"),
        ("trainer.keep_checkpoints=-2", r"trainer\.keep_checkpoints.*must be >= 0"),
        ("reward.max_failure_share=1.5", r"reward\.max_failure_share.*must be in \[0, 1\]"),
    ],
)
def test_values_that_cannot_work_are_refused_before_anything_starts(
    override: str, message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["run", *override.split(), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, "one line, no traceback"
    assert err.startswith("yatt: config error:")
    import re

    assert re.search(message, err), err
    assert not (tmp_path / "run").exists()


def test_an_empty_dataset_and_a_reused_run_dir_are_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["run", "data.source=jsonl", f"data.path={empty}", "--run-dir", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "yields no prompts" in err, err
    empty.write_text("\n")  # no rows, but not an empty file
    assert main(["run", "data.source=jsonl", f"data.path={empty}", "--run-dir", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "yields no prompts" in err, err
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text('{"step": 0}\n')
    assert main(["run", "--run-dir", str(used)]) == 2
    err = capsys.readouterr().err
    assert f"run dir {used} already holds a run; continue it with `python -m launch run --resume {used}`" in err
    assert (used / "metrics.jsonl").read_text() == '{"step": 0}\n', "the old run was touched"


def test_a_reward_function_that_cannot_be_called_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "trl.yaml"
    config.write_text(
        "reward:\n  scorers:\n    - kind: custom\n      function: tests.workers.reward.scorer_fixtures:trl_needs_solution\n"
    )
    assert main(["run", str(config), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "needs ['solution']" in err and "['answer']" in err, err
    assert not list((tmp_path / "run" / "logs").iterdir()), "a role started"


def test_print_config_shows_every_default_and_starts_nothing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import yaml

    assert main(["run", "buffer.max_staleness=2", "--print-config", "--run-dir", str(tmp_path / "run")]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["buffer"]["max_staleness"] == 2 and printed["buffer"]["max_filtered_batches"] == 10
    assert printed["run"]["authenticate"] is True and set(printed) >= {"run", "model", "data", "trainer", "placement"}
    assert not (tmp_path / "run").exists()


def test_help_lists_the_sections_and_where_they_are_documented(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for section in ("run", "model", "data", "controller", "generator", "reward", "buffer", "algorithm", "trainer", "transport", "placement", "slurm"):
        assert f"\n  {section} " in out, section
    assert "yatt/rl/config.py: BufferConfig" in out and "--print-config" in out
