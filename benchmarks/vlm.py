"""``python -m benchmarks vlm``: the vision-language example's GRPO job (examples/vlm_count.yaml:
a tiny LLaVA counting red squares in pictures drawn with PIL) trained by yatt and by TRL's
``GRPOTrainer``, in turns on this machine, measured as ``benchmarks e2e`` measures its jobs
(``benchmarks.e2e.measure``: samples/s, time to TRL's final reward, peak PSS of each
process tree; repeats in alternating order, medians)::

    build_tiny_vlm + warm start (the example's 50 steps, once) --> MODEL_DIR, both start from it
    yatt:  python -m launch run examples/vlm_count.yaml model.path=MODEL_DIR model.warm_start_steps=0 ...
    TRL:   python -m benchmarks.trl_grpo SPEC OUT   (the questions as user messages with an image part,
           the pictures redrawn from each prompt's metadata, AutoProcessor as processing_class)

Both get the same model, pictures, questions, reward (``yatt.rl.tasks:count_reward``), group
size, batch, completion length, learning rate, optimizer and steps; yatt's overrides make
the job one TRL can follow (``benchmarks.e2e.unmatchable``): no dynamic-sampling filter
(TRL trains every group), no checkpoints, no evaluations, no dual clip, the vision tower
trained (GRPOTrainer trains every weight). Options (``--set``):
``steps`` (80), ``repeats`` (3), ``layouts`` ([auto]), ``trl_threads`` (0: every core). At
40 steps and 2 repeats (what it ran before) the two reward curves cross several times and
the time to TRL's final reward came out 0 or 1x by which realisation ended on top; 80 x 3
(~5 min here) both curves rise well past the start and the verdict held in every run.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.e2e import WINDOW, Job, Layout, Options, compute_dtype_of, measure, unmatchable
from benchmarks.harness import Result
from benchmarks.trl_grpo import TrlSpec
from launch.config import RunConfig, load_run_config
from yatt.runtime.configtools import build, require

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "vlm_count.yaml"
REWARD = "yatt.rl.tasks:count_reward"
QUICK: dict[str, object] = {"steps": 4, "repeats": 1}


@dataclass(frozen=True, kw_only=True)
class VlmOptions:
    """What to run (``--set KEY=VALUE``; ``--quick``: 4 steps, one repeat)."""

    steps: int = 80
    """Optimizer steps of each job."""
    repeats: int = 3
    """Rounds of yatt and TRL; figures are medians over them."""
    layouts: list[Layout] = field(default_factory=lambda: ["auto"])
    """yatt's placement layouts, one run each per repeat."""
    trl_threads: int = 0
    """torch threads of the TRL process; 0: all cores."""

    def __post_init__(self) -> None:
        require(self.steps >= WINDOW, "steps", f"must be >= {WINDOW}, the reward's moving-average window (got {self.steps})")
        require(self.repeats >= 1, "repeats", f"must be >= 1 (got {self.repeats})")
        require(bool(self.layouts), "layouts", "must name at least one layout: auto, colocated, partial, disaggregated")
        require(self.trl_threads >= 0, "trl_threads", f"must be >= 0, 0 for all cores (got {self.trl_threads})")


def _items(model_dir: Path, steps: int) -> list[str]:
    return [
        str(EXAMPLE), f"model.path={model_dir}", "model.warm_start_steps=0", f"run.steps={steps}", "run.eval_every=0",
        "buffer.filter=none", "trainer.checkpoint_every=0", "algorithm.dual_clip=null", "model.train_vision=true",
    ]  # fmt: skip


def _warm_model(scratch: Path) -> Path:
    """The example's model as its launcher makes it: built, then warm-started on the
    training prompts' answers (what both frameworks start from)."""
    from workers.models import build_tiny_vlm, warm_start
    from yatt.rl.data import load_prompts

    cfg = load_run_config(EXAMPLE, [])
    model_dir = build_tiny_vlm(scratch / "vlm", seed=cfg.run.seed)
    prompts = load_prompts(cfg.data, str(model_dir))
    warm_start(
        model_dir, [(p.prompt_ids, p.metadata["answer"]) for p in prompts], mm_inputs=[p.mm_inputs for p in prompts],
        steps=cfg.model.warm_start_steps, lr=cfg.model.warm_start_lr, seed=cfg.run.seed,
    )  # fmt: skip
    return model_dir


def _job(cfg: RunConfig, items: list[str], model_dir: Path, threads: int) -> Job:
    """The job both frameworks run: yatt's ``items``, and TRL's spec from the same prompts."""
    import json

    from yatt.placement.costs import hf_param_count
    from yatt.rl.data import load_prompts

    problems = unmatchable(cfg, REWARD)
    if problems:
        raise RuntimeError("the TRL job cannot match this yatt config: " + "; ".join(problems))
    prompts = load_prompts(cfg.data, str(model_dir))
    spec = TrlSpec(
        model_dir=str(model_dir), prompts=[p.text for p in prompts], answers=[p.metadata["answer"] for p in prompts],
        prompts_per_step=cfg.buffer.groups_per_step, group_size=cfg.buffer.group_size,
        micro_batches=cfg.buffer.micro_batches_per_step, max_new_tokens=cfg.controller.max_new_tokens,
        lr=cfg.trainer.lr, betas=list(cfg.trainer.betas), weight_decay=cfg.trainer.weight_decay,
        clip_low=cfg.algorithm.clip_low, clip_high=cfg.algorithm.clip_high, grad_clip=cfg.trainer.grad_clip,
        temperature=cfg.controller.temperature, top_p=cfg.controller.top_p, steps=cfg.run.steps, seed=cfg.run.seed,
        threads=threads, bf16=compute_dtype_of(cfg) == "bfloat16", task=cfg.data.task,
        image_metadata=[p.metadata for p in prompts],
    )  # fmt: skip
    config = json.loads((model_dir / "config.json").read_text())
    return Job(
        size="vlm", overrides=items, spec=spec, params=hf_param_count(config),
        prompt_tokens=statistics.fmean(len(p.prompt_ids) for p in prompts), timeout_s=600.0 + 60.0 * cfg.run.steps,
    )  # fmt: skip


def run(*, quick: bool = False, options: Mapping[str, object] | None = None) -> Result:
    from launch.placement.inputs import compute_dtype, measure_peak_flops

    opts = build(VlmOptions, {**(QUICK if quick else {}), **(options or {})})
    result = Result()
    threads = os.cpu_count() or 1
    peak_flops = measure_peak_flops(dtype=compute_dtype("auto", "cpu"), threads=threads, size=2048, seconds=1.0)
    result.figures["peak_gflops"] = peak_flops / 1e9
    with tempfile.TemporaryDirectory(prefix="yatt-vlm-") as tmp:
        scratch = Path(tmp)
        model_dir = _warm_model(scratch)
        items = _items(model_dir, opts.steps)
        job = _job(load_run_config(EXAMPLE, items[1:]), items, model_dir, opts.trl_threads)
        e2e_opts = Options(layouts=opts.layouts, repeats=opts.repeats, trl_threads=opts.trl_threads)
        measure(job, e2e_opts, scratch, peak_flops, result)
    result.notes += [
        f"both start from the example's warm-started tiny LLaVA ({job.params:,} parameters of its language "
        "model counted in the FLOPs) and train every weight (yatt: model.train_vision=true, as GRPOTrainer has "
        "no switch to freeze the vision tower)",
        f"TRL: one process with {opts.trl_threads or threads} torch thread(s); yatt: the plan's processes and threads",
        "prompt order and sampling seeds differ (each framework shuffles and seeds its own way)",
    ]
    return result
