"""``python -m launch run [CONFIG.yaml] [dotted.key=value ...] [--run-dir DIR] [--resume DIR]``;
``python -m launch slurm [CONFIG.yaml] [dotted.key=value ...] --nodes N [--submit]`` on a SLURM cluster;
``python -m launch plan [CONFIG.yaml] [dotted.key=value ...] [--from RUN_DIR]`` prints the placement candidates;
``python -m launch eval RUN_DIR|MODEL_DIR [CONFIG.yaml] [dotted.key=value ...]`` evaluates a model on held-out prompts.

With no config it runs the built-in default: a tiny model built from a config, a
tokenizer trained in-process, a synthetic task with a shaped reward, 2 controllers,
1 generator, 1 reward worker and 2 FSDP trainer ranks, on CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import yaml

from launch import evaluate, slurm
from launch.config import load_run_config, split_items
from launch.local import LocalLauncher
from launch.placement import command
from launch.prepare import latest_checkpoint
from yatt.errors import ConfigError
from yatt.runtime import run_dir as names
from yatt.runtime.configtools import to_dict

SECTIONS = """config sections (a YAML file with any of them, or dotted.key=value overrides; every field is
documented where its class is defined; --print-config shows them all with their values):
  run        the run as a whole: steps, processes, restarts, authentication  launch/config.py: RunSettings
  model      the policy: local path, dtype                                    yatt/rl/config.py: ModelConfig
  data       prompts: synthetic, jsonl, parquet, reasoning_gym; held-out ones yatt/rl/config.py: DataConfig
  eval       evaluation: greedy, n samples, pass threshold (run.eval_every)  yatt/rl/config.py: EvalConfig
  controller sampling, request timeouts                                       yatt/rl/config.py: ControllerConfig
  generator  engine (transformers, vllm), batching                           yatt/rl/config.py: GeneratorConfig
  reward     the scorers of the reward mix                                    yatt/rl/config.py: RewardConfig
  buffer     dynamic sampling, staleness, micro-batches                       yatt/rl/config.py: BufferConfig
  algorithm  advantage, losses, KL, clipping                                  yatt/rl/config.py: AlgorithmConfig
  trainer    FSDP2 ranks, optimizer, checkpoints, weight sync                 yatt/rl/config.py: TrainerConfig
  transport  ZeroMQ: timeouts, heartbeats, CURVE                              yatt/runtime/transport.py: TransportConfig
  placement  colocated, partial, disaggregated, auto                          yatt/rl/config.py: PlacementConfig
  slurm      run dirs and head ports under SLURM                              launch/config.py: SlurmSettings
  env        multi-turn episodes: environment or tools, turn limits         yatt/rl/config.py: EnvConfig
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run every role on this machine",
        epilog=SECTIONS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("items", nargs="*", metavar="CONFIG.yaml | dotted.key=value")
    run.add_argument("--run-dir", type=Path, default=None, help="where the run writes (default runs/<time>)")
    run.add_argument("--resume", type=Path, default=None, help="a run dir to continue from its last checkpoint")
    run.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    run.add_argument(
        "--print-config", action="store_true", help="print the resolved config (every default filled in) and exit"
    )
    slurm.add_parsers(sub)
    command.add_parser(sub)
    evaluate.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command != "run":
        try:
            return int(args.main(args))
        except slurm.SlurmError as e:
            print(f"yatt: {e}", file=sys.stderr)
            return 2
        except ConfigError as e:
            print(f"yatt: config error: {e}", file=sys.stderr)
            return 2
    try:
        config_path, overrides = split_items(args.items)
        resume_ckpt = None
        run_dir = args.run_dir
        if args.resume is not None:
            resume_ckpt = latest_checkpoint(args.resume)
            if resume_ckpt is None:
                raise ConfigError(f"--resume {args.resume}: no complete checkpoint under {args.resume}/checkpoints")
            run_dir = run_dir or args.resume
            config_path = config_path or str(args.resume / names.CONFIG)
        cfg = load_run_config(config_path, overrides)
    except ConfigError as e:
        print(f"yatt: config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    run_dir = run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    launcher = LocalLauncher(cfg, run_dir, resume=resume_ckpt, show_progress=not args.no_progress)
    return asyncio.run(launcher.run())


if __name__ == "__main__":
    sys.exit(main())
