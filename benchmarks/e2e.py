"""``python -m benchmarks e2e``: the same GRPO job trained by yatt, in each placement
layout, and by TRL, in turns on this machine.

For each model size the job is one yatt run config; the TRL job is derived from it, so
both frameworks get the same model directory, tokenizer, prompts (token for token),
reward function, group size, batch, completion length, learning rate, optimizer, compute
dtype and number of steps. Each repeat runs every yatt layout and TRL once, the order
reversed in every other repeat (A B C T, T C B A, ...), so that load drifting over the
benchmark weighs on each about equally, and with a seed of its own (repeat r: yatt's
``run.seed=r``, TRL's ``seed=r``), so that the repeats are realisations of both learning
curves, not the same curves timed again; figures are medians over the repeats, and the
notes list each repeat's time-to-reward ratio (their spread)::

    load_run_config(overrides) --> run_yatt: python -m launch run OVERRIDES placement.layout=L
         |                                    metrics.jsonl, plan.json, wall time, peak PSS of the tree
         +-> TrlSpec (prompts decoded from yatt's own token ids, bf16 when yatt computes in it)
                              --> python -m benchmarks.trl_grpo SPEC OUT      (1 process)
                                                   metrics.jsonl (same keys), wall time, peak PSS

Layouts (``placement.layout``, ``yatt.placement``): ``colocated`` (each trainer rank also
hosts a generator engine on its own module; generation and training take turns),
``partial`` (training on every slot, generator processes on a subset, asleep while
training runs), ``disaggregated`` (generators on slots of their own, on-policy here) and
``auto`` (the planner's pick; which one it picked, and how many ranks, is read from the
run's plan.json and given in the notes). The plan also picks the rank count
(``trainer.world_size=0``): a rank per core, or one rank whose threads span every core,
from the model's thread scaling measured at start. Each gets the processes, cores and
threads its plan assigns.

Both jobs train on the ``digits`` task with its partial-credit reward
(``yatt.rl.tasks:digits_reward``, ``data.task=digits`` and ``reward.scorers`` set for yatt;
``unmatchable`` refuses any other reward), whatever task the default job has (since
2026-12-06 the ``repeated`` task, exact match: from a model without a warm start its reward
is 0 and nothing is learnt; the e2e figures of 2026-12-06 before this was pinned had yatt at
0.000 -> 0.000 and are void). 30 of its 100 distinct prompts (``HELD_OUT``,
``data.eval_split``) are held out of both jobs' training since 2026-12-07 (figures before
trained on all 100).

Held out, one evaluator: each run's final model (yatt's ``final/``, TRL's ``save_model``
after its last step, both outside the training window) and the initial model answer the
held-out prompts greedily, through the same transformers ``generate`` in the jobs' compute
dtype (``heldout_answers``), scored by the same reward: figures ``heldout_reward`` (mean)
and ``heldout_exact`` (share exactly right), per run and ``<size>_initial_*``; the notes give
them per repeat. So what each framework learnt is judged on prompts it never trained on, by
neither framework's own metrics. Time to reward below still follows the training curves
(held-out answers at the end only: evaluating checkpoints during the runs would add their
writes to both step times).

Sizes. ``tiny`` (default): the default job of ``launch/default.yaml`` on its tiny model
(built once with ``build_tiny_model(dir, seed=0)``, as the launcher builds it, and passed
to both as ``model.path``), plus ``buffer.filter=none`` (TRL trains every group; yatt's
default all_equal dynamic-sampling filter would drop groups with no signal and make the
jobs differ), ``trainer.checkpoint_every=0``, and neither the default job's warm start
nor its evaluations (TRL's job has neither), so RL from the random model at lr 5e-3 and
temperature 1: 8 prompts x 8 completions per step, 2 micro-batches, <= 8 new tokens, 40
steps. ``smollm2`` (``--set
sizes=[tiny,smollm2]``): SmolLM2-135M-Instruct (``export_smollm2``) on the same task,
4 prompts x 8 completions, <= 16 new tokens, lr 1e-5, 10 steps: about 12 minutes per
yatt or TRL run on this 2-core machine (the tiny job: about 2), so 5 runs x 2 repeats
per size with the defaults. The latest figures are in benchmarks/README.md.

Matched settings (checked against both codebases; ``unmatchable`` refuses a yatt config
that TRL could not follow):

    yatt (run config)                         TRL (GRPOConfig)
    buffer.group_size 8                       num_generations 8
    buffer.groups_per_step 8 (64 samples)     per_device_train_batch_size 32 x gradient_accumulation_steps 2
    buffer.micro_batches_per_step 2             (one generation of 64 completions, one optimizer step)
    controller.max_new_tokens 8               max_completion_length 8
    controller.temperature, top_p 1, top_k off      temperature (the same), top_p 1.0, top_k 0
    trainer.lr, betas 0.9/0.999, wd 0         learning_rate, adam_beta1/2, weight_decay, optim adamw_torch
    schedule constant, warmup 0               lr_scheduler_type constant, warmup_steps 0
    trainer.grad_clip 1.0                     max_grad_norm 1.0
    algorithm.advantage grpo (std-normalised) scale_rewards "group"
    aggregation token_mean (global tokens)    loss_type "dapo" (token mean over the global batch)
    clip_low / clip_high 0.2                  epsilon / epsilon_high 0.2
    kl_coef 0 (no reference model)            beta 0.0
    one update per batch (old = current)      num_iterations 1
    model.dtype auto: bfloat16 compute on     use_cpu, bf16 True: float32 weights (TRL's default
      a CPU with native bf16 (AMX), float32     dtype), bfloat16 autocast in generation and
      master weights (FSDP2 mixed precision)    training; bf16 False where yatt computes in float32
    run.steps, run.seed                       max_steps, seed; logging_steps 1, save_strategy no

Prompts: yatt's own (``yatt.rl.data.load_prompts``, chat template applied), each decoded back to
text; TRL tokenizes a plain-text prompt with ``processing_class(text=prompts)`` (trl 1.16,
``GRPOTrainer._tokenize_prompts``), and the benchmark checks that this gives back exactly
yatt's ids for every prompt (it does for both tokenizers). Reward: ``yatt.rl.tasks:digits_reward``
on the completion decoded with ``skip_special_tokens=True`` in both.

Not matched, and why (also in the result's notes):

- Processes and threads: yatt runs 5 to 7 processes (buffer, reward, 2 controllers, 1 or 2
  FSDP2 trainer ranks, over gloo when 2, and a generator process unless colocated), with the
  cores and threads of its plan (``launch.processes.role_threads``); TRL runs generation,
  reward and training in one process, given all cores
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
- Data parallelism: yatt's batch is split over its ranks (the plan's 1 or 2) x 2
  micro-batches, TRL's into 2 micro-batches; both divide the summed token losses by the
  step's global token count, so the gradient is the same up to float rounding.
- Mixed precision: yatt casts the weights to bfloat16 for each forward (FSDP2's
  param_dtype) and reduces gradients in float32; TRL autocasts (matmuls in bfloat16,
  some ops kept in float32 by autocast's lists).
- yatt keeps the model in eval mode and TRL in train mode; both models have no dropout.

Figures, per size and run (``<size>_yatt_<layout>_...`` and ``<size>_trl_...``), each the
median over the repeats: ``samples_per_s`` and ``tokens_per_s`` (samples trained and
their completion tokens generated, over the training window: the first step's start to
the last step's end), ``step_s_median``, ``training_s``, ``startup_s`` (process start to
the first step's start), ``wall_s`` (the whole job, startup and shutdown included),
``peak_memory_mb`` (peak PSS of the whole process tree, sampled every 0.25 s),
``reward_first3`` and ``reward_last3`` (mean reward of the first and last 3 steps), and
the training part of a step:

- ``train_s_median``: the median over the steady steps (all but the first) of
  ``time/train_s``. yatt: its trainer rank 0's forward, backward and optimizer time
  (its metrics' ``time/train_s``: the step without the waits for micro-batches and,
  when taking turns, without the switch between engine and training, but with the
  barrier where the ranks meet before it). TRL: the step minus
  ``GRPOTrainer._generate_and_score_completions`` (``benchmarks.trl_grpo``).
- ``train_gflops_per_s``: achieved training FLOP/s, the steady steps' FLOPs over the sum
  of their ``time/train_s``; a step's FLOPs are 6 x the policy's parameter count
  (``yatt.placement.costs.hf_param_count`` of the model's config.json; embeddings
  included) x the tokens trained that step, prompt + completion tokens of every sample.
  TRL counts them exactly (``train/prompt_tokens`` + ``train/completion_tokens``); yatt's
  metrics count completion tokens only, so its prompt tokens are samples x the mean
  prompt length of the job's prompt set (prompts are drawn uniformly from it).
- ``prompt_tokens_saved_per_step`` and ``computed_token_share``: the prompt tokens yatt's
  trainer did not compute again (a group's prompt computed once, ``trainer.share_prompt``,
  its ``train/prompt_tokens_saved``), per steady step, and the share of the trained tokens
  it did compute (1 - saved / trained; TRL computes every row's prompt: 1). The FLOPs above
  count every trained token, so a shared prompt raises ``train_gflops_per_s`` (useful FLOPs).
- ``mfu``: ``train_gflops_per_s`` over ``peak_gflops``, this machine's matmul peak in the
  dtype ``model.dtype=auto`` computes in here (bfloat16 where the CPU has it natively, AMX
  or AVX512-BF16; float32 where it does not, since bfloat16 then runs ~500x slower than
  float32 and is not what the jobs use), measured once at the start
  (``launch.placement.inputs.measure_peak_flops``, 2048 x 2048, every core, 1 s).

Ratios per size and layout, each the median over repeats of the ratio between the yatt
run and the TRL run of the same repeat: ``<size>_<layout>_samples_per_s_vs_trl`` (yatt /
TRL), ``<size>_<layout>_memory_vs_trl`` (yatt's peak PSS / TRL's) and
``<size>_<layout>_time_to_reward_vs_trl``: TRL's training time to reach the reward it
ends with (the 3-step trailing moving average of its last step, = reward_last3) over
yatt's time to reach that same reward on its own 3-step moving average; > 1 means yatt got
there sooner. When yatt's average never reaches it, the ratio is 0 for that repeat (and a
note says so). A step's reward counts at the step's end. Both tiny curves rise to the end,
so each usually first reaches TRL's final reward in its last steps and this ratio comes
out close to the samples/s ratio; it departs from it when one framework learns more per
step. Plot ``<size>_reward``: the moving average vs training time of the first repeat, a
line per yatt layout and one for TRL.

Targets of the placement work (reported here, asserted nowhere): with ``auto``, SmolLM2
time to TRL's final reward >= 2.0x TRL's and tiny >= 1.0x; peak memory <= 1.5x TRL's on
both; training MFU >= 40 % of the bf16 peak on SmolLM2.

Options (``--set KEY=VALUE``): ``sizes=[tiny,smollm2]`` (default ``[tiny]``),
``layouts`` (default ``[auto,colocated,partial,disaggregated]``), ``repeats`` (default 2),
``tiny_steps`` (default 40), ``smollm2_steps`` (default 10), ``trl_threads`` (default 0:
all cores), ``overrides`` (more yatt items, e.g. ``[generator.backend=vllm]``). ``--quick``: tiny, 6 steps, layout auto, 1 repeat (about 2 minutes here).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from benchmarks.harness import LinePlot, Result, Series
from benchmarks.jobs import (
    Monitored,
    Training,
    moving_average,
    run_monitored,
    run_yatt,
    time_to_reward,
    training,
)
from benchmarks.trl_grpo import TrlSpec
from launch.config import RunConfig, load_run_config
from yatt.runtime import run_dir as names
from yatt.runtime.cache import smollm2_dir
from yatt.runtime.configtools import build, require
from yatt.runtime.run_dir import read_jsonl

if TYPE_CHECKING:
    from yatt.rl.data import Prompt

Size = Literal["tiny", "smollm2"]
Layout = Literal["auto", "colocated", "partial", "disaggregated"]
QUICK: dict[str, object] = {"tiny_steps": 6, "layouts": ["auto"], "repeats": 1}
WINDOW = 3
"""Steps in the trailing moving average of the reward (and in reward_first3 / reward_last3)."""
WARMUP_STEPS = 1
"""Steps left out of the training figures (train_s_median, train_gflops_per_s, mfu)."""

DIGITS = "yatt.rl.tasks:digits_reward"
"""The reward of both jobs (TRL's is ``benchmarks.trl_grpo.reward``, this function)."""
HELD_OUT = 30
"""Distinct prompts of the digits task (sums of two digits: 100) held out of both jobs'
training (``data.eval_split``) and answered greedily by each final model at the end."""
_BOTH = [  # TRL's job neither evaluates nor warm-starts; both compute in bf16 where the CPU has it
    "run.eval_every=0", "model.warm_start_steps=0", "model.dtype=auto",
    "trainer.world_size=0",  # the plan picks the ranks too: a rank per core or one over every core
    # The digits task and its partial-credit reward, whatever launch/default.yaml's task is.
    "data.task=digits", f"data.eval_split={HELD_OUT}", f"reward.scorers=[{{kind: custom, name: digits, function: '{DIGITS}'}}]",
]
JOBS: dict[Size, list[str]] = {
    "tiny": [
        "buffer.filter=none", "trainer.checkpoint_every=0", "algorithm.dual_clip=null", *_BOTH,
        "trainer.lr=5e-3", "controller.temperature=1.0", "buffer.groups_per_step=8",  # the job before the warm start
    ],
    "smollm2": [
        *_BOTH,
        "buffer.filter=none",
        "trainer.checkpoint_every=0",
        "algorithm.dual_clip=null",
        "buffer.groups_per_step=4",
        "buffer.group_size=8",
        "controller.max_new_tokens=16",
        "trainer.lr=1e-5",
    ],
}
"""Overrides of launch/default.yaml per size (plus model.path, run.steps and placement.layout)."""


@dataclass(frozen=True, kw_only=True)
class Options:
    """What to run (``--set KEY=VALUE``; ``--quick`` shortens the tiny job)."""

    sizes: list[Size] = field(default_factory=lambda: ["tiny"])
    """Model sizes, in order."""
    layouts: list[Layout] = field(default_factory=lambda: ["auto", "colocated", "partial", "disaggregated"])
    """yatt's placement layouts, one run each per repeat (``placement.layout``)."""
    repeats: int = 2
    """Rounds of every layout and TRL; figures are medians over them."""
    tiny_steps: int = 40
    """Optimizer steps of the tiny job (the default job's 40)."""
    smollm2_steps: int = 10
    """Optimizer steps of the SmolLM2 job."""
    trl_threads: int = 0
    """torch threads of the TRL process; 0: all cores (os.cpu_count())."""
    overrides: list[str] = field(default_factory=list)
    """More yatt items after the job's (``generator.backend=vllm``); those TRL's job shares
    (lr, batch, lengths) apply to it too."""

    def __post_init__(self) -> None:
        require(bool(self.sizes), "sizes", "must name at least one size: tiny, smollm2")
        require(len(set(self.sizes)) == len(self.sizes), "sizes", f"must not repeat a size (got {self.sizes})")
        require(bool(self.layouts), "layouts", "must name at least one layout: auto, colocated, partial, disaggregated")
        require(
            len(set(self.layouts)) == len(self.layouts), "layouts", f"must not repeat a layout (got {self.layouts})"
        )
        require(self.repeats >= 1, "repeats", f"must be >= 1 (got {self.repeats})")
        for name in ("tiny_steps", "smollm2_steps"):
            value = getattr(self, name)
            require(value >= WINDOW, name, f"must be >= {WINDOW}, the reward's moving-average window (got {value})")
        require(self.trl_threads >= 0, "trl_threads", f"must be >= 0, 0 for all cores (got {self.trl_threads})")
        bad = [item for item in self.overrides if "=" not in item]
        require(not bad, "overrides", f"must be dotted.key=value items (got {bad})")


def _model_dir(size: Size, scratch: Path) -> Path:
    from workers.models import build_tiny_model, export_smollm2

    return build_tiny_model(scratch / "tiny", seed=0) if size == "tiny" else export_smollm2(smollm2_dir())


def compute_dtype_of(cfg: RunConfig) -> str:
    """What yatt computes in on this machine's CPU (the trainer's and engines' resolution)."""
    from launch.placement.inputs import compute_dtype

    return compute_dtype(cfg.model.dtype, "cpu")


def unmatchable(cfg: RunConfig, reward: str = DIGITS) -> list[str]:
    """Settings of a yatt config that the TRL job does not reproduce (must be none);
    ``reward``: the one custom scorer TRL's reward function is (``TrlSpec.task``'s)."""
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
    ]
    problems = [f"{name} = {got!r} (TRL job needs {want!r})" for name, got, want in wanted if got != want]
    scorers = [(s.kind, s.function, s.weight) for s in cfg.reward.scorers]
    if scorers != [("custom", reward, 1.0)]:  # TRL's reward function is this one
        problems.append(f"reward.scorers = {scorers} (TRL job needs [('custom', {reward!r}, 1.0)])")
    dtype = compute_dtype_of(cfg)
    if dtype not in ("float32", "bfloat16"):  # TRL on CPU: float32, or bf16 autocast
        problems.append(f"model.dtype = {cfg.model.dtype!r} computes in {dtype} (TRL job needs float32 or bfloat16)")
    return problems


def _trl_spec(cfg: RunConfig, model_dir: Path, threads: int) -> tuple[TrlSpec, float]:
    """The TRL job of yatt config ``cfg`` (its prompts as text that TRL tokenizes back into
    exactly yatt's ids, and its settings) and the mean prompt length in tokens."""
    from transformers import AutoTokenizer

    from yatt.rl.data import load_prompts

    problems = unmatchable(cfg)
    if problems:
        raise RuntimeError("the TRL job cannot match this yatt config: " + "; ".join(problems))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts, answers, lengths = [], [], []
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
        lengths.append(len(prompt.prompt_ids))
    spec = TrlSpec(
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
        bf16=compute_dtype_of(cfg) == "bfloat16",
    )
    return spec, statistics.fmean(lengths)


def training_flops(steps: Sequence[Mapping[str, float]], *, params: int, prompt_tokens: float) -> float:
    """Training FLOPs of ``steps`` (metrics lines): per step 6 x ``params`` x the tokens
    trained, prompt + completion tokens of every sample. Prompt tokens: the line's
    ``train/prompt_tokens`` where it has one (TRL's), else its samples x ``prompt_tokens``,
    the mean prompt length (yatt's lines count completion tokens only)."""
    flops = 0.0
    for m in steps:
        samples = m["samples_per_s"] * m["time/step_s"]
        completion = m["tokens_per_s"] * m["time/step_s"]
        prompt = m["train/prompt_tokens"] if "train/prompt_tokens" in m else samples * prompt_tokens
        flops += 6.0 * params * (prompt + completion)
    return flops


@dataclass(frozen=True, kw_only=True)
class Job:
    """One size's job, as both frameworks run it."""

    size: str
    """The job's name in figures and notes (tiny, smollm2; vlm: benchmarks/vlm.py)."""
    overrides: list[str]
    """yatt's items (without placement.layout)."""
    spec: TrlSpec
    params: int
    """Parameters of the policy."""
    prompt_tokens: float
    """Mean prompt length of the job's prompt set, in tokens."""
    timeout_s: float
    held_out: list[Prompt] = field(default_factory=list)
    """Prompts neither job trains on, which every final model answers (``heldout_rewards``);
    none: no held-out figures (the vlm job)."""


@dataclass(frozen=True, kw_only=True)
class Side:
    """One framework's measured run."""

    train: Training
    train_s: list[float]
    """Each steady step's training part (``time/train_s``)."""
    train_flops: float
    """FLOPs of the steady steps."""
    startup_s: float
    wall_s: float
    peak_memory_mb: float
    memory_samples: int
    prompt_tokens_saved: float
    """Prompt tokens of the steady steps that training did not compute again (yatt's
    ``train/prompt_tokens_saved``, trainer.share_prompt; TRL computes every row's prompt)."""
    trained_tokens: float
    """Prompt + completion tokens trained in the steady steps (as in ``train_flops``)."""
    heldout: list[float] = field(default_factory=list)
    """The final model's reward on each held-out prompt (``heldout_rewards``)."""

    def figures(self, peak_flops: float) -> dict[str, float]:
        """The run's figures, by name without the ``<size>_<framework>_`` prefix."""
        tr = self.train
        achieved = self.train_flops / sum(self.train_s)
        return {
            "samples_per_s": tr.samples_per_s,
            "tokens_per_s": tr.tokens_per_s,
            "step_s_median": statistics.median(tr.step_s),
            "training_s": tr.duration_s,
            "startup_s": self.startup_s,
            "wall_s": self.wall_s,
            "peak_memory_mb": self.peak_memory_mb,
            "reward_first3": statistics.fmean(tr.rewards[:WINDOW]),
            "reward_last3": statistics.fmean(tr.rewards[-WINDOW:]),
            "train_s_median": statistics.median(self.train_s),
            "train_gflops_per_s": achieved / 1e9,
            "mfu": achieved / peak_flops,
            "prompt_tokens_saved_per_step": self.prompt_tokens_saved / len(self.train_s),
            "computed_token_share": 1.0 - self.prompt_tokens_saved / self.trained_tokens,
            **(heldout_figures(self.heldout) if self.heldout else {}),
        }


def heldout_answers(model_dir: Path, prompts: Sequence[Prompt], *, max_new_tokens: int, bf16: bool) -> list[str]:
    """One evaluator for every model, whichever framework trained it: transformers' greedy
    ``generate`` from each prompt's token ids (left-padded batches of 32), in the jobs'
    compute dtype, up to ``max_new_tokens``; each completion decoded without special tokens.
    Prompts in the order given."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # (the benchmark's output stays its own lines)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if bf16 else torch.float32)
    model.eval()  # no dropout in greedy decoding
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    answers: list[str] = []
    for start in range(0, len(prompts), 32):
        part = prompts[start : start + 32]
        width = max(len(p.prompt_ids) for p in part)
        ids = torch.tensor([[pad] * (width - len(p.prompt_ids)) + p.prompt_ids for p in part])
        mask = torch.tensor([[0] * (width - len(p.prompt_ids)) + [1] * len(p.prompt_ids) for p in part])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad
            )
        answers += [str(tokenizer.decode(row, skip_special_tokens=True)) for row in out[:, width:]]
    return answers


def heldout_rewards(model_dir: Path, prompts: Sequence[Prompt], *, max_new_tokens: int, bf16: bool) -> list[float]:
    """Each held-out prompt's ``heldout_answers`` scored by the jobs' reward
    (``digits_reward``: 1.0 exactly right, partial credit below)."""
    from yatt.rl.tasks import digits_reward

    answers = heldout_answers(model_dir, prompts, max_new_tokens=max_new_tokens, bf16=bf16)
    return [digits_reward(p.text, answer, p.metadata) for p, answer in zip(prompts, answers, strict=True)]


def heldout_figures(rewards: Sequence[float]) -> dict[str, float]:
    """``heldout_reward`` (the mean) and ``heldout_exact`` (the share answered exactly)."""
    return {"heldout_reward": statistics.fmean(rewards), "heldout_exact": sum(r == 1.0 for r in rewards) / len(rewards)}


def _with_heldout(side: Side, job: Job, model_dir: Path) -> Side:
    if not job.held_out:
        return side
    rewards = heldout_rewards(model_dir, job.held_out, max_new_tokens=job.spec.max_new_tokens, bf16=job.spec.bf16)
    return replace(side, heldout=rewards)


def _side(job: Job, metrics: list[dict[str, float]], measured: Monitored, what: str) -> Side:
    """A run's figures from its metrics lines and what watching its process tree measured."""
    if len(metrics) != job.spec.steps:
        raise RuntimeError(f"the {what} job ({job.size}) logged {len(metrics)} steps, not {job.spec.steps}")
    train = training(metrics)
    steady = metrics[WARMUP_STEPS:]
    return Side(
        train=train,
        train_s=[m["time/train_s"] for m in steady],
        train_flops=training_flops(steady, params=job.params, prompt_tokens=job.prompt_tokens),
        startup_s=train.start_unix - measured.started_unix,
        wall_s=measured.wall_s,
        peak_memory_mb=measured.peak_memory_mb,
        memory_samples=measured.memory_samples,
        prompt_tokens_saved=sum(m.get("train/prompt_tokens_saved", 0.0) for m in steady),
        trained_tokens=training_flops(steady, params=1, prompt_tokens=job.prompt_tokens) / 6.0,
    )


def _job(size: Size, steps: int, opts: Options, scratch: Path) -> Job:
    from yatt.placement.costs import hf_param_count
    from yatt.rl.data import load_prompt_sets

    model_dir = _model_dir(size, scratch)
    overrides = [f"model.path={model_dir}", f"run.steps={steps}", *JOBS[size], *opts.overrides]
    cfg = load_run_config(None, overrides)
    spec, prompt_tokens = _trl_spec(cfg, model_dir, opts.trl_threads)
    _, held_out = load_prompt_sets(cfg.data, str(model_dir))
    per_step = 60.0 if size == "tiny" else 300.0
    return Job(
        size=size,
        overrides=overrides,
        spec=spec,
        params=hf_param_count(json.loads((model_dir / "config.json").read_text())),
        prompt_tokens=prompt_tokens,
        timeout_s=600.0 + per_step * steps,
        held_out=held_out,
    )


def _run_yatt(job: Job, layout: Layout, run_dir: Path, *, seed: int) -> tuple[Side, str]:
    """One yatt run in ``layout``; also the layout and rank count its plan placed (auto's pick)."""
    run = run_yatt([*job.overrides, f"placement.layout={layout}", f"run.seed={seed}"], run_dir, timeout_s=job.timeout_s)
    measured = Monitored(
        started_unix=run.started_unix, wall_s=run.wall_s, peak_memory_mb=run.peak_memory_mb,
        memory_samples=run.memory_samples,
    )
    side = _with_heldout(_side(job, run.metrics, measured, f"yatt {layout}"), job, run_dir / "final")
    plan = json.loads((run_dir / names.PLAN).read_text())
    ranks = sum(a["role"] == "trainer" for a in plan["assignments"])
    return side, f"{plan['layout']} ({ranks} trainer rank{'s' if ranks > 1 else ''})"


def _run_trl(job: Job, out: Path, *, seed: int) -> Side:
    out.mkdir()
    replace(job.spec, seed=seed, save_final=bool(job.held_out)).dump(out / "spec.json")
    cmd = [sys.executable, "-m", "benchmarks.trl_grpo", str(out / "spec.json"), str(out)]
    measured = run_monitored(cmd, out / "trl.log", timeout_s=job.timeout_s, what=f"TRL job ({job.size})")
    return _with_heldout(_side(job, read_jsonl(out / names.METRICS), measured, "TRL"), job, out / "final")


def _time_to_reward_ratio(yatt: Side, trl: Side) -> float | None:
    """TRL's time to its final reward over yatt's time to it; None if yatt never gets there."""
    trl_curve = moving_average(trl.train.rewards, WINDOW)
    target = trl_curve[-1]  # = the mean of TRL's last WINDOW steps
    trl_time = time_to_reward(trl.train.times_s, trl_curve, target)
    yatt_time = time_to_reward(yatt.train.times_s, moving_average(yatt.train.rewards, WINDOW), target)
    assert trl_time is not None, "a curve reaches its own last value"
    return None if yatt_time is None else trl_time / yatt_time


def measure(job: Job, opts: Options, scratch: Path, peak_flops: float, result: Result) -> None:
    """Every layout of ``opts`` and TRL on ``job``, ``opts.repeats`` rounds: the figures and
    ratios into ``result``, by ``job.size``."""
    size, steps = job.size, job.spec.steps
    order: list[Layout | Literal["trl"]] = [*opts.layouts, "trl"]
    yatt: dict[Layout, list[Side]] = {layout: [] for layout in opts.layouts}
    trl: list[Side] = []
    picked: list[str] = []
    for r in range(opts.repeats):
        for name in (order if r % 2 == 0 else order[::-1]):
            if name == "trl":
                trl.append(_run_trl(job, scratch / f"{size}-trl-{r}", seed=r))
                continue
            side, placed = _run_yatt(job, name, scratch / f"{size}-{name}-{r}", seed=r)
            yatt[name].append(side)
            if name == "auto":
                picked.append(placed)

    runs: dict[str, list[Side]] = {**{f"yatt_{layout}": sides for layout, sides in yatt.items()}, "trl": trl}
    for key, sides in runs.items():
        per_run = [side.figures(peak_flops) for side in sides]
        for figure in per_run[0]:
            result.figures[f"{size}_{key}_{figure}"] = statistics.median(run[figure] for run in per_run)
    if job.held_out:
        initial = heldout_rewards(
            Path(job.spec.model_dir), job.held_out, max_new_tokens=job.spec.max_new_tokens, bf16=job.spec.bf16
        )
        for figure, value in heldout_figures(initial).items():
            result.figures[f"{size}_initial_{figure}"] = value
    for layout, sides in yatt.items():
        pairs = list(zip(sides, trl, strict=True))
        reached = [_time_to_reward_ratio(y, t) for y, t in pairs]
        if job.held_out:
            result.notes.append(
                f"{size} {layout}: held-out reward (exact share) per repeat, yatt vs TRL, from "
                f"{result.figures[f'{size}_initial_heldout_reward']:.3f} "
                f"({result.figures[f'{size}_initial_heldout_exact']:.2f}) before training, on {len(job.held_out)} "
                "prompts neither trained on: " + ", ".join(
                    "{:.3f} ({:.2f}) vs {:.3f} ({:.2f})".format(
                        *heldout_figures(y.heldout).values(), *heldout_figures(t.heldout).values()
                    )
                    for y, t in pairs
                )
            )
        missed = sum(ratio is None for ratio in reached)
        result.notes.append(
            f"{size} {layout}: time to TRL's final reward vs TRL per repeat (seed r = repeat r): "
            + ", ".join("never" if ratio is None else f"{ratio:.2f}x" for ratio in reached)
        )
        if missed:
            result.notes.append(
                f"{size} {layout}: in {missed} of {len(pairs)} repeats yatt's {WINDOW}-step average reward never "
                f"reached TRL's final one: the ratio counts 0 there"
            )
        ratios = {
            "samples_per_s_vs_trl": [y.train.samples_per_s / t.train.samples_per_s for y, t in pairs],
            "time_to_reward_vs_trl": [0.0 if ratio is None else ratio for ratio in reached],
            "memory_vs_trl": [y.peak_memory_mb / t.peak_memory_mb for y, t in pairs],
        }
        for ratio, values in ratios.items():
            result.ratios[f"{size}_{layout}_{ratio}"] = statistics.median(values)

    series = [
        Series(label=f"yatt {layout}", x=sides[0].train.times_s, y=moving_average(sides[0].train.rewards, WINDOW))
        for layout, sides in yatt.items()
    ]
    series.append(Series(label="TRL", x=trl[0].train.times_s, y=moving_average(trl[0].train.rewards, WINDOW)))
    result.plots[f"{size}_reward"] = LinePlot(
        title=f"{size}: reward ({WINDOW}-step moving average) vs training time, {steps} steps, first repeat",
        xlabel="training wall time (s, from the first step's start)",
        ylabel="mean reward",
        series=series,
    )
    if picked:
        result.notes.append(f"{size}: placement auto picked {', '.join(picked)} (plan.json, one per repeat)")
    spec = job.spec
    samples = [f"{key} {side.memory_samples} ({side.wall_s:.0f} s)" for key, sides in runs.items() for side in sides]
    result.notes.append(
        f"{size}: {spec.prompts_per_step} prompts x {spec.group_size} completions per step, "
        f"<= {spec.max_new_tokens} new tokens, lr {spec.lr:g}, {steps} steps, "
        f"{'bfloat16' if spec.bf16 else 'float32'} compute, {job.params:,} parameters, mean prompt "
        f"{job.prompt_tokens:.1f} tokens; yatt items: {' '.join(job.overrides)}; memory read per run: "
        + ", ".join(samples)
    )


def run(*, quick: bool = False, options: Mapping[str, object] | None = None) -> Result:
    from launch.placement.inputs import compute_dtype, measure_peak_flops

    opts = build(Options, {**(QUICK if quick else {}), **(options or {})})
    result = Result()
    threads = os.cpu_count() or 1
    peak_dtype = compute_dtype("auto", "cpu")
    peak_flops = measure_peak_flops(dtype=peak_dtype, threads=threads, size=2048, seconds=1.0)
    result.figures["peak_gflops"] = peak_flops / 1e9
    with tempfile.TemporaryDirectory(prefix="yatt-e2e-") as scratch:
        for size in opts.sizes:
            steps = opts.tiny_steps if size == "tiny" else opts.smollm2_steps
            measure(_job(size, steps, opts, Path(scratch)), opts, Path(scratch), peak_flops, result)
    sequence = " ".join([*opts.layouts, "TRL"])
    result.notes += [
        "yatt: buffer, reward, 2 controllers, 1 or 2 FSDP2 trainer ranks (as its plan picks) and, "
        "unless colocated, a generator process, with the cores and threads of its plan (launch.processes.role_threads); "
        f"TRL: one process with {opts.trl_threads or threads} torch thread(s)",
        "prompt order and sampling seeds differ (each framework shuffles and seeds its own way)",
        "GRPO advantage eps: yatt 1e-6, TRL 1e-4 (hard-coded); both use the unbiased group std",
        "yatt splits each step over its trainer ranks x 2 micro-batches, TRL over 2 micro-batches; "
        "both normalise by the step's global token count",
        "bfloat16: yatt casts the weights for each forward (FSDP2 mixed precision), TRL autocasts; "
        "both keep float32 master weights",
        f"{opts.repeats} repeat(s), runs in the order {sequence}, reversed every other repeat, on a shared "
        "machine: drifting load affects them unequally; figures are medians over repeats",
        f"peak: {peak_dtype} (what model.dtype=auto computes in here), {threads} threads, 2048 x 2048 matmul, 1 s, "
        "measured once before the runs",
    ]
    return result
