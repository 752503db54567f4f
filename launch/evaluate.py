"""``python -m launch eval RUN_DIR|MODEL_DIR [CONFIG.yaml] [dotted.key=value ...] [--run-dir DIR]``:
evaluate a finished run's final model, or any Hugging Face model directory, on held-out
prompts, with the same processes a run has (buffer, controllers, generators, reward
workers; no trainer) and the same metrics (``yatt.rl.evaluation``).

- ``RUN_DIR`` (it holds ``config.yaml`` and ``final/``): the run's config and its final
  model, written to ``RUN_DIR/evals/<time>`` by default.
- ``MODEL_DIR`` (it holds ``config.json``): the model with CONFIG (default: the built-in
  job's), written to ``runs/eval-<time>`` by default.

The held-out prompts are the config's ``data.eval_split`` or ``data.eval_path`` (give them
as overrides, e.g. ``data.eval_path=held_out.jsonl``), sampled as its ``eval`` section
says. The launcher asks the buffer for the evaluation of version 0 (the weights the
generators loaded), writes ``eval.jsonl`` and ``eval_rollouts.jsonl`` into the eval dir and
prints the metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import time
from pathlib import Path

from launch.config import RunConfig, load_run_config, split_items
from launch.local import LocalLauncher
from protocols.messages import Query, StepReport
from workers.run_log import RunLog
from yatt.errors import ConfigError
from yatt.placement.plan import Plan
from yatt.runtime import run_dir as names
from yatt.runtime.registry import Directory


def eval_target(target: Path, items: list[str]) -> tuple[RunConfig, Path, int]:
    """(the config, the eval dir's default, the step label) of ``launch eval TARGET ITEMS``."""
    config_path, overrides = split_items(items)
    if (target / names.CONFIG).is_file() and not (target / "config.json").is_file():  # a run dir
        model = target / "final"
        if not (model / "config.json").is_file():
            raise ConfigError(f"{target} is a run dir without a final model ({model}); let the run finish, or evaluate a checkpoint's hf/ export")
        cfg = load_run_config(config_path or target / names.CONFIG, [*overrides, f"model.path={model}", "model.warm_start_steps=0"])
        return cfg, target / "evals" / time.strftime("%Y%m%d-%H%M%S"), cfg.run.steps
    if (target / "config.json").is_file():  # a Hugging Face model directory
        cfg = load_run_config(config_path, [*overrides, f"model.path={target}", "model.warm_start_steps=0"])
        return cfg, Path("runs") / f"eval-{time.strftime('%Y%m%d-%H%M%S')}", 0
    raise ConfigError(f"{target} is neither a run dir (config.yaml, final/) nor a Hugging Face model directory (config.json)")


class EvalLauncher(LocalLauncher):
    """A run without a trainer: it evaluates the generators' weights once and stops."""

    def __init__(self, cfg: RunConfig, run_dir: Path, *, step: int) -> None:
        if not cfg.data.has_eval:
            raise ConfigError(
                "nothing to evaluate on: set data.eval_split (a share or count of the prompts held out) or "
                "data.eval_path (a file of held-out prompts, the data's fields)"
            )
        # Generators as processes of their own (no trainer rank to host them), any core.
        cfg = dataclasses.replace(cfg, placement=dataclasses.replace(cfg.placement, layout="disaggregated"))
        super().__init__(cfg, run_dir, show_progress=False)
        self.step = step
        self._evaluation: asyncio.Future[StepReport] | None = None

    def make_plan(self) -> Plan | None:
        return None

    def processes(self) -> dict[str, int]:
        return {role: n for role, n in super().processes().items() if role != "trainer"}

    def role_command(self, role: str, index: int) -> list[str]:
        cmd = super().role_command(role, index)
        return [*cmd, "--eval-only"] if role == "buffer" else cmd

    def outcome(self, directory: Directory) -> int | None:
        """Started at the first look: ask the buffer for the evaluation; 0 once it is written."""
        if self._evaluation is None:
            query = Query(what="evaluate", args={"version": "0", "rollouts": str(self.cfg.run.rollouts_per_step)})
            within = self.cfg.run.ready_timeout_s
            self._evaluation = asyncio.ensure_future(directory.request("buffer", query, StepReport, timeout=math.inf, within=within))
        if not self._evaluation.done():
            return None
        report = self._evaluation.result()
        log = RunLog(self.run_dir, str(self.model_path), report_to=self.cfg.run.report_to, wandb_project=self.cfg.run.wandb_project)
        try:
            log.metrics({"step": float(self.step), **report.values}, kind="eval")
            log.rollouts(self.step, report.groups, kind="eval")
        finally:
            log.close()
        width = max(len(k) for k in report.values)
        print(f"yatt: evaluation of {self.cfg.model.path} ({self.run_dir / 'eval.jsonl'}):", flush=True)
        for key, value in report.values.items():
            print(f"  {key:<{width}}  {value:.4g}", flush=True)
        return 0


def eval_main(args: argparse.Namespace) -> int:
    cfg, default_dir, step = eval_target(args.target, args.items)
    launcher = EvalLauncher(cfg, args.run_dir or default_dir, step=step)
    return asyncio.run(launcher.run())


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``eval`` subcommand of ``python -m launch``."""
    p = sub.add_parser("eval", help="evaluate a finished run's final model, or a model directory, on held-out prompts")
    p.add_argument("target", type=Path, metavar="RUN_DIR|MODEL_DIR")
    p.add_argument("items", nargs="*", metavar="CONFIG.yaml | dotted.key=value")
    p.add_argument("--run-dir", type=Path, default=None, help="where the evaluation writes")
    p.set_defaults(main=eval_main)
