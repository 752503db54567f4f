"""``python -m benchmarks e2e``: the same GRPO job trained by yatt and by TRL, one after the
other on this machine.

For each model size the job is one yatt run config; the TRL job is derived from it, so
both frameworks get the same model directory, tokenizer, prompts (token for token),
reward function, group size, batch, completion length, learning rate, optimizer and
number of steps::

    load_run_config(overrides)  --> run_yatt: python -m launch run OVERRIDES   (7 processes)
         |                                         metrics.jsonl, wall time, peak PSS of the tree
         +-> TrlSpec (prompts decoded from yatt's own token ids)
                              --> python -m benchmarks.trl_grpo SPEC OUT      (1 process)
                                                   metrics.jsonl (same keys), wall time, peak PSS

Sizes. ``tiny`` (default): the default job of ``launch/default.yaml`` on its tiny model
(built once with ``build_tiny_model(dir, seed=0)``, as the launcher builds it, and passed
to both as ``model.path``), plus ``buffer.filter=none`` (TRL trains every group; yatt's
default all_equal dynamic-sampling filter would drop groups with no signal and make the
jobs differ) and ``trainer.checkpoint_every=0``: 8 prompts x 8 completions per step, 2
micro-batches, <= 8 new tokens, lr 5e-3, 40 steps. ``smollm2`` (``--set
sizes=[tiny,smollm2]``): SmolLM2-135M-Instruct (``export_smollm2``) on the same task,
4 prompts x 8 completions, <= 16 new tokens, lr 1e-5, 10 steps: about 12 minutes on
this 2-core machine (the tiny job: about 2). The latest figures are in
benchmarks/README.md.

Matched settings (checked against both codebases; ``_unmatchable`` refuses a yatt config
that TRL could not follow):

    yatt (run config)                         TRL (GRPOConfig)
    buffer.group_size 8                       num_generations 8
    buffer.groups_per_step 8 (64 samples)     per_device_train_batch_size 32 x gradient_accumulation_steps 2
    buffer.micro_batches_per_step 2             (one generation of 64 completions, one optimizer step)
    controller.max_new_tokens 8               max_completion_length 8
    controller.temperature 1, top_p 1, top_k off    temperature 1.0, top_p 1.0, top_k 0
    trainer.lr, betas 0.9/0.999, wd 0         learning_rate, adam_beta1/2, weight_decay, optim adamw_torch
    schedule constant, warmup 0               lr_scheduler_type constant, warmup_steps 0
    trainer.grad_clip 1.0                     max_grad_norm 1.0
    algorithm.advantage grpo (std-normalised) scale_rewards "group"
    aggregation token_mean (global tokens)    loss_type "dapo" (token mean over the global batch)
    clip_low / clip_high 0.2                  epsilon / epsilon_high 0.2
    kl_coef 0 (no reference model)            beta 0.0
    one update per batch (old = current)      num_iterations 1
    float32 on CPU                            float32 (TRL's default dtype), use_cpu, bf16 False
    run.steps, run.seed                       max_steps, seed; logging_steps 1, save_strategy no

Prompts: yatt's own (``yatt.data.load_prompts``, chat template applied), each decoded back to
text; TRL tokenizes a plain-text prompt with ``processing_class(text=prompts)`` (trl 1.16,
``GRPOTrainer._tokenize_prompts``), and the benchmark checks that this gives back exactly
yatt's ids for every prompt (it does for both tokenizers). Reward: ``yatt.tasks:digits_reward``
on the completion decoded with ``skip_special_tokens=True`` in both.

Not matched, and why (also in the result's notes):

- Processes and threads: yatt runs 7 processes (buffer, reward, generator, 2 controllers,
  2 FSDP2 trainer ranks over gloo); its launcher gives the generator the machine's cores as
  threads and each trainer rank half of them (on-policy they take turns), every other role
  one thread (``launch.local.role_threads``). TRL runs generation, reward and training in
  one process, given all cores
  (``torch.set_num_threads(os.cpu_count())``; ``--set trl_threads=N`` changes it). That
  difference is what is being compared, and it makes TRL's figures depend on what else
  runs: on this 2-core machine, with other jobs using most of it, TRL's tiny step took
  0.1-0.2 s with 1 thread but 0.4-5 s (median 2.1 s) with 2, whose parallel regions wait
  for whichever thread is descheduled; on a quiet machine both took 0.1-0.2 s. Compare
  runs taken under the same load, and look at ``trl_threads=1`` before reading a ratio
  taken on a busy machine.
- Prompt order and sampling: each framework shuffles the 1000 prompts with its own seeded
  sampler and seeds generation its own way, so the two runs see different prompts and
  samples; rewards are compared as curves, not step by step.
- GRPO's epsilon: advantages are (r - mean) / (std + eps) with the unbiased std in both,
  eps 1e-6 in yatt and 1e-4 in TRL (hard-coded there); it only matters for groups with
  nearly equal rewards.
- Data parallelism: yatt's batch is split over 2 trainer ranks x 2 micro-batches of 16
  samples, TRL's into 2 micro-batches of 32; both divide the summed token losses by the
  step's global token count, so the gradient is the same up to float rounding.
- yatt keeps the model in eval mode and TRL in train mode; both models have no dropout.

Figures, per size and framework (``<size>_<yatt|trl>_...``): ``samples_per_s`` and
``tokens_per_s`` (samples trained and their completion tokens generated, over the training
window: the first step's start to the last step's end), ``step_s_median``, ``training_s``,
``startup_s`` (process start to the first step's start), ``wall_s`` (the whole job, startup
and shutdown included), ``peak_memory_mb`` (peak PSS of the whole process tree, sampled
every 0.25 s), ``reward_first3`` and ``reward_last3`` (mean reward of the first and last 3
steps). Ratios per size: ``<size>_samples_per_s_vs_trl`` (yatt / TRL) and
``<size>_time_to_reward_vs_trl``: TRL's training time to reach the reward it ends with
(the 3-step trailing moving average of its last step, = reward_last3) over yatt's time to
reach that same reward on its own 3-step moving average; > 1 means yatt got there sooner.
When yatt's average never reaches it, the ratio is 0 (and a note says so). A step's reward
counts at the step's end. Both tiny curves rise to the end, so each usually first reaches
TRL's final reward in its last steps and this ratio comes out close to the samples/s ratio;
it departs from it when one framework learns more per step. Plot ``<size>_reward``: the
moving average vs training time.

Options (``--set KEY=VALUE``): ``sizes=[tiny,smollm2]`` (default ``[tiny]``),
``tiny_steps`` (default 40), ``smollm2_steps`` (default 10), ``trl_threads`` (default 0: all
cores). ``--quick``: tiny, 6 steps (about 2 minutes here).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from benchmarks.harness import LinePlot, Result, Series
from benchmarks.jobs import (
    Training,
    moving_average,
    read_metrics,
    run_monitored,
    run_yatt,
    time_to_reward,
    training,
)
from benchmarks.trl_grpo import TrlSpec
from launch.config import RunConfig, load_run_config
from yatt.configtools import build, require

SMOLLM2_DIR = Path.home() / ".cache" / "yatt" / "smollm2-135m-instruct"
Size = Literal["tiny", "smollm2"]
QUICK: dict[str, object] = {"tiny_steps": 6}
WINDOW = 3
"""Steps in the trailing moving average of the reward (and in reward_first3 / reward_last3)."""

JOBS: dict[Size, list[str]] = {
    "tiny": ["buffer.filter=none", "trainer.checkpoint_every=0", "algorithm.dual_clip=null"],
    "smollm2": [
        "buffer.filter=none",
        "trainer.checkpoint_every=0",
        "algorithm.dual_clip=null",
        "buffer.groups_per_step=4",
        "buffer.group_size=8",
        "controller.max_new_tokens=16",
        "trainer.lr=1e-5",
    ],
}
"""Overrides of launch/default.yaml per size (plus model.path and run.steps)."""


@dataclass(frozen=True, kw_only=True)
class Options:
    """What to run (``--set KEY=VALUE``; ``--quick`` shortens the tiny job)."""

    sizes: list[Size] = field(default_factory=lambda: ["tiny"])
    """Model sizes, in order."""
    tiny_steps: int = 40
    """Optimizer steps of the tiny job (the default job's 40)."""
    smollm2_steps: int = 10
    """Optimizer steps of the SmolLM2 job."""
    trl_threads: int = 0
    """torch threads of the TRL process; 0: all cores (os.cpu_count())."""

    def __post_init__(self) -> None:
        require(bool(self.sizes), "sizes", "must name at least one size: tiny, smollm2")
        require(len(set(self.sizes)) == len(self.sizes), "sizes", f"must not repeat a size (got {self.sizes})")
        for name in ("tiny_steps", "smollm2_steps"):
            value = getattr(self, name)
            require(value >= WINDOW, name, f"must be >= {WINDOW}, the reward's moving-average window (got {value})")
        require(self.trl_threads >= 0, "trl_threads", f"must be >= 0, 0 for all cores (got {self.trl_threads})")


def _model_dir(size: Size, scratch: Path) -> Path:
    from workers.models import build_tiny_model, export_smollm2

    return build_tiny_model(scratch / "tiny", seed=0) if size == "tiny" else export_smollm2(SMOLLM2_DIR)


def _unmatchable(cfg: RunConfig) -> list[str]:
    """Settings of a yatt config that the TRL job does not reproduce (must be none)."""
    a, t, c, b = cfg.algorithm, cfg.trainer, cfg.controller, cfg.buffer
    wanted: list[tuple[str, object, object]] = [
        ("algorithm.advantage", a.advantage, "grpo"),
        ("algorithm.policy_loss", a.policy_loss, "ppo"),
        ("algorithm.aggregation", a.aggregation, "token_mean"),
        ("algorithm.kl_coef", a.kl_coef, 0.0),
        ("algorithm.entropy_coef", a.entropy_coef, 0.0),
        ("algorithm.dual_clip", a.dual_clip, None),
        ("algorithm.importance_sampling", a.importance_sampling, "none"),
        ("algorithm.overlong_buffer", a.overlong_buffer, 0),
        ("trainer.schedule", t.schedule, "constant"),
        ("trainer.warmup_steps", t.warmup_steps, 0),
        ("trainer.weight_sync_every", t.weight_sync_every, 1),
        ("controller.top_k", c.top_k, -1),
        ("buffer.filter", b.filter, "none"),
        ("buffer.max_staleness", b.max_staleness, 0),
        ("buffer.max_completion_tokens", b.max_completion_tokens, 0),
        ("buffer.custom_filter", b.custom_filter, ""),
        ("model.dtype", cfg.model.dtype, "auto"),  # float32 on CPU, as TRL loads it
    ]
    return [f"{name} = {got!r} (TRL job needs {want!r})" for name, got, want in wanted if got != want]


def _trl_spec(cfg: RunConfig, model_dir: Path, threads: int) -> TrlSpec:
    """The TRL job of yatt config ``cfg``: its prompts as text that TRL tokenizes back into
    exactly yatt's ids, and its settings."""
    from transformers import AutoTokenizer

    from yatt.data import load_prompts

    problems = _unmatchable(cfg)
    if problems:
        raise RuntimeError("the TRL job cannot match this yatt config: " + "; ".join(problems))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts, answers = [], []
    for prompt in load_prompts(cfg.data, str(model_dir)):
        text = str(tokenizer.decode(prompt.prompt_ids, skip_special_tokens=False))
        again = tokenizer(text=[text])["input_ids"][0]  # as GRPOTrainer._tokenize_prompts does
        if list(again) != prompt.prompt_ids:
            raise RuntimeError(
                f"prompt {prompt.index} does not survive decode + tokenize: yatt's ids {prompt.prompt_ids}, "
                f"TRL would train on {list(again)}"
            )
        texts.append(text)
        answers.append(prompt.metadata["answer"])
    return TrlSpec(
        model_dir=str(model_dir),
        prompts=texts,
        answers=answers,
        prompts_per_step=cfg.buffer.groups_per_step,
        group_size=cfg.buffer.group_size,
        micro_batches=cfg.buffer.micro_batches_per_step,
        max_new_tokens=cfg.controller.max_new_tokens,
        lr=cfg.trainer.lr,
        betas=list(cfg.trainer.betas),
        weight_decay=cfg.trainer.weight_decay,
        clip_low=cfg.algorithm.clip_low,
        clip_high=cfg.algorithm.clip_high,
        grad_clip=cfg.trainer.grad_clip,
        temperature=cfg.controller.temperature,
        top_p=cfg.controller.top_p,
        steps=cfg.run.steps,
        seed=cfg.run.seed,
        threads=threads,
    )


@dataclass(frozen=True, kw_only=True)
class Side:
    """One framework's measured job."""

    train: Training
    startup_s: float
    wall_s: float
    peak_memory_mb: float
    memory_samples: int


def _record(result: Result, prefix: str, side: Side) -> None:
    f = result.figures
    tr = side.train
    f[f"{prefix}_samples_per_s"] = tr.samples_per_s
    f[f"{prefix}_tokens_per_s"] = tr.tokens_per_s
    f[f"{prefix}_step_s_median"] = statistics.median(tr.step_s)
    f[f"{prefix}_training_s"] = tr.duration_s
    f[f"{prefix}_startup_s"] = side.startup_s
    f[f"{prefix}_wall_s"] = side.wall_s
    f[f"{prefix}_peak_memory_mb"] = side.peak_memory_mb
    f[f"{prefix}_reward_first3"] = statistics.fmean(tr.rewards[:WINDOW])
    f[f"{prefix}_reward_last3"] = statistics.fmean(tr.rewards[-WINDOW:])


def _measure(size: Size, steps: int, opts: Options, scratch: Path, result: Result) -> None:
    model_dir = _model_dir(size, scratch)
    overrides = [f"model.path={model_dir}", f"run.steps={steps}", *JOBS[size]]
    cfg = load_run_config(None, overrides)
    spec = _trl_spec(cfg, model_dir, opts.trl_threads)
    per_step = 60.0 if size == "tiny" else 300.0
    timeout_s = 600.0 + per_step * steps

    job = run_yatt(overrides, scratch / f"{size}-yatt", timeout_s=timeout_s)
    yatt_train = training(job.metrics)
    yatt = Side(
        train=yatt_train,
        startup_s=yatt_train.start_unix - job.started_unix,
        wall_s=job.wall_s,
        peak_memory_mb=job.peak_memory_mb,
        memory_samples=job.memory_samples,
    )

    out = scratch / f"{size}-trl"
    out.mkdir()
    spec.dump(out / "spec.json")
    cmd = [sys.executable, "-m", "benchmarks.trl_grpo", str(out / "spec.json"), str(out)]
    measured = run_monitored(cmd, out / "trl.log", timeout_s=timeout_s, what=f"TRL job ({size})")
    trl_train = training(read_metrics(out / "metrics.jsonl"))
    trl = Side(
        train=trl_train,
        startup_s=trl_train.start_unix - measured.started_unix,
        wall_s=measured.wall_s,
        peak_memory_mb=measured.peak_memory_mb,
        memory_samples=measured.memory_samples,
    )
    for name, side in (("yatt", yatt), ("trl", trl)):
        if len(side.train.rewards) != steps:
            raise RuntimeError(f"the {name} job ({size}) logged {len(side.train.rewards)} steps, not {steps}")
        _record(result, f"{size}_{name}", side)

    result.ratios[f"{size}_samples_per_s_vs_trl"] = yatt.train.samples_per_s / trl.train.samples_per_s
    curves = {name: moving_average(side.train.rewards, WINDOW) for name, side in (("yatt", yatt), ("trl", trl))}
    target = curves["trl"][-1]  # = the mean of TRL's last WINDOW steps
    trl_time = time_to_reward(trl.train.times_s, curves["trl"], target)
    yatt_time = time_to_reward(yatt.train.times_s, curves["yatt"], target)
    assert trl_time is not None, "a curve reaches its own last value"
    if yatt_time is None:
        result.ratios[f"{size}_time_to_reward_vs_trl"] = 0.0
        result.notes.append(
            f"{size}: yatt's {WINDOW}-step average reward never reached TRL's final {target:.3f} "
            f"(yatt ended at {curves['yatt'][-1]:.3f}): {size}_time_to_reward_vs_trl is 0"
        )
    else:
        result.ratios[f"{size}_time_to_reward_vs_trl"] = trl_time / yatt_time
    result.plots[f"{size}_reward"] = LinePlot(
        title=f"{size}: reward ({WINDOW}-step moving average) vs training time, {steps} steps",
        xlabel="training wall time (s, from the first step's start)",
        ylabel="mean reward",
        series=[
            Series(label="yatt", x=yatt.train.times_s, y=curves["yatt"]),
            Series(label="TRL", x=trl.train.times_s, y=curves["trl"]),
        ],
    )
    result.notes.append(
        f"{size}: {cfg.buffer.groups_per_step} prompts x {cfg.buffer.group_size} completions per step, "
        f"<= {cfg.controller.max_new_tokens} new tokens, lr {cfg.trainer.lr:g}, {steps} steps; "
        f"yatt overrides: {' '.join(JOBS[size])}; memory read {yatt.memory_samples} times (yatt, "
        f"{yatt.wall_s:.0f} s) and {trl.memory_samples} times (TRL, {trl.wall_s:.0f} s)"
    )


def run(*, quick: bool = False, options: Mapping[str, object] | None = None) -> Result:
    opts = build(Options, {**(QUICK if quick else {}), **(options or {})})
    result = Result()
    with tempfile.TemporaryDirectory(prefix="yatt-e2e-") as scratch:
        for size in opts.sizes:
            _measure(size, opts.tiny_steps if size == "tiny" else opts.smollm2_steps, opts, Path(scratch), result)
    result.notes += [
        "yatt: 7 processes (buffer, reward, generator, 2 controllers, 2 FSDP2 trainer ranks); threads: "
        "generator = cores, each trainer rank = cores / 2, the rest 1 (launch.local.role_threads); "
        f"TRL: one process with {opts.trl_threads or os.cpu_count()} torch thread(s)",
        "prompt order and sampling seeds differ (each framework shuffles and seeds its own way)",
        "GRPO advantage eps: yatt 1e-6, TRL 1e-4 (hard-coded); both use the unbiased group std",
        "yatt splits each step over 2 trainer ranks x 2 micro-batches, TRL over 2 micro-batches; "
        "both normalise by the step's global token count",
        "jobs run one after the other (yatt first) on a shared machine: drifting load affects them unequally",
    ]
    return result
