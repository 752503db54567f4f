"""The TRL side of the e2e benchmark: one GRPO job with TRL's ``GRPOTrainer``, in a process
of its own so the parent measures it (time, memory of its tree) as it measures a yatt job::

    python -m benchmarks.trl_grpo SPEC.json OUT_DIR

SPEC.json holds a ``TrlSpec`` (every setting comes from the yatt run config it is compared
with; ``benchmarks/e2e.py`` derives it). The job writes ``OUT_DIR/metrics.jsonl``, one line
per optimizer step with yatt's keys where they exist::

    step, time/unix (the step's end), time/step_s, reward/mean,
    samples, tokens (completion tokens generated in the step), samples_per_s, tokens_per_s,
    time/generate_s, time/train_s, train/prompt_tokens, train/completion_tokens

A ``TrainerCallback`` times each step from ``on_step_begin`` to ``on_step_end`` (one
optimizer step: one generation of prompts_per_step x group_size completions, then
micro_batches forward/backward passes) and takes the step's ``reward`` and
``completions/mean_length`` from the log TRL writes after it (``logging_steps=1``).

The training part of a step (``time/train_s``, yatt's key for its forward, backward and
optimizer time) is the step minus ``time/generate_s``, the time spent in
``GRPOTrainer._generate_and_score_completions`` (generation, reward, advantages), which a
subclass times by wrapping it. What is left is the micro-batches' forward and backward
passes, gradient clipping, the AdamW step and zeroing the gradients, and the Trainer's
few bookkeeping lines between them. Timing the rest rather than wrapping
``training_step`` is the robust choice: TRL generates inside ``training_step`` (its
``_prepare_inputs`` generates on the step's first micro-batch) and the optimizer step runs
outside it, in the Trainer's loop. The same wrapper counts the tokens trained, exactly:
``prompt_mask`` and ``completion_mask`` summed over the generated batch
(``train/prompt_tokens``, ``train/completion_tokens``).

The process uses every core (``torch.set_num_threads(os.cpu_count())``): TRL trains,
generates and scores in this one process, while yatt's launcher gives each of its role
processes the threads its placement plan assigns.

Precision: ``bf16`` in the spec sets GRPOConfig's ``bf16`` (with ``use_cpu``): TRL loads the
model in float32 (its default) and accelerate runs its forwards under a bfloat16 autocast,
so float32 master weights and bfloat16 compute, as yatt's FSDP2 mixed precision does.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from yatt.rl.tasks import TASKS, digits_reward
from yatt.runtime import run_dir as names
from yatt.runtime.configtools import build


@dataclass(frozen=True, kw_only=True)
class TrlSpec:
    """One TRL GRPO job (JSON in SPEC.json)."""

    model_dir: str
    """A saved Hugging Face model directory (model and tokenizer)."""
    prompts: list[str]
    """Prompt texts, chat template applied (TRL tokenizes them as plain text)."""
    answers: list[str]
    """metadata["answer"] of each prompt, for the reward."""
    prompts_per_step: int
    group_size: int
    micro_batches: int
    """Gradient accumulation steps per optimizer step."""
    max_new_tokens: int
    lr: float
    betas: list[float]
    weight_decay: float
    clip_low: float
    clip_high: float
    grad_clip: float
    temperature: float
    top_p: float
    steps: int
    seed: int
    threads: int = 0
    """torch threads; 0: os.cpu_count()."""
    bf16: bool = False
    """Compute in bfloat16 (autocast over float32 weights), as yatt does when its model.dtype
    resolves to bfloat16."""
    task: str = "digits"
    """The built-in task (yatt.rl.tasks.TASKS) whose reward scores the completions."""
    image_metadata: list[dict[str, str]] = field(default_factory=list)
    """A visual task's job (benchmarks/vlm.py): each prompt's metadata, from which the task
    redraws its pictures (``Task.images``); ``prompts`` are then the question texts, which
    TRL gets as a user message of an image part and the text, with the model's processor
    (``processing_class``), as its VLM recipes have them."""
    save_final: bool = False
    """Save the trained model (and tokenizer) into OUT_DIR/final after the last step, as
    yatt's run writes its final/ (benchmarks/e2e.py evaluates both on held-out prompts)."""

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))


def reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float | None]:
    """yatt's digits reward in TRL's reward-function form (dataset columns as keyword lists)."""
    return [digits_reward(p, c, {"answer": a}) for p, c, a in zip(prompts, completions, answer, strict=True)]


def task_reward(task: str) -> Callable[..., list[float | None]]:
    """The reward of yatt's built-in ``task`` in TRL's form; a conversational completion
    (a visual job's: a list of one assistant message) is scored on its text."""
    if task == "digits":
        return reward
    score = TASKS[task].reward

    def reward_of(prompts: list[Any], completions: list[Any], answer: list[str], **_: Any) -> list[float | None]:
        texts = [c if isinstance(c, str) else str(c[0]["content"]) for c in completions]
        return [score("", text, {"answer": a}) for text, a in zip(texts, answer, strict=True)]

    reward_of.__name__ = "reward"  # TRL logs rewards/<name>/mean
    return reward_of


def grpo_config(spec: TrlSpec, out_dir: Path) -> Any:
    """TRL's GRPOConfig for ``spec``: the same knobs as yatt's side of the comparison."""
    from trl.trainer.grpo_config import GRPOConfig

    return GRPOConfig(
        output_dir=str(out_dir / "trl"),
        num_generations=spec.group_size,
        per_device_train_batch_size=spec.prompts_per_step * spec.group_size // spec.micro_batches,
        gradient_accumulation_steps=spec.micro_batches,
        max_completion_length=spec.max_new_tokens,
        learning_rate=spec.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=spec.betas[0],
        adam_beta2=spec.betas[1],
        weight_decay=spec.weight_decay,
        beta=0.0,
        epsilon=spec.clip_low,
        epsilon_high=spec.clip_high,
        loss_type="dapo",
        scale_rewards="group",
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=0,
        max_grad_norm=spec.grad_clip,
        gradient_checkpointing=False,
        num_iterations=1,
        max_steps=spec.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=spec.seed,
        use_cpu=True,
        bf16=spec.bf16,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )


def train(spec: TrlSpec, out_dir: Path) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.trainer.grpo_trainer import GRPOTrainer

    torch.set_num_threads(spec.threads or os.cpu_count() or 1)
    samples_per_step = spec.prompts_per_step * spec.group_size
    metrics_path = out_dir / names.METRICS
    generated = {"s": 0.0, "prompt_tokens": 0.0, "completion_tokens": 0.0}  # this step's, so far

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that times generation and scoring and counts the tokens it produced."""

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            start = time.perf_counter()
            output = super()._generate_and_score_completions(inputs)
            generated["s"] += time.perf_counter() - start
            generated["prompt_tokens"] += float(output["prompt_mask"].sum())
            generated["completion_tokens"] += float(output["completion_mask"].sum())
            return output

    class StepMetrics(TrainerCallback):
        """Times each optimizer step and writes its metrics line once TRL has logged it."""

        def __init__(self) -> None:
            self.begin = 0.0
            self.step_s = 0.0
            self.end_unix = 0.0
            self.step: dict[str, float] = {}

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            generated.update(s=0.0, prompt_tokens=0.0, completion_tokens=0.0)
            self.begin = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.step_s = time.perf_counter() - self.begin
            self.end_unix = time.time()
            self.step = dict(generated)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
            if not logs or "reward" not in logs:  # e.g. the summary at the end of training
                return
            tokens = logs["completions/mean_length"] * samples_per_step
            line = {
                "step": float(state.global_step - 1),  # yatt counts steps from 0
                "time/unix": self.end_unix,
                "time/step_s": self.step_s,
                "reward/mean": float(logs["reward"]),
                "samples": float(samples_per_step),
                "tokens": tokens,
                "samples_per_s": samples_per_step / self.step_s,
                "tokens_per_s": tokens / self.step_s,
                "time/generate_s": self.step["s"],
                "time/train_s": self.step_s - self.step["s"],
                "train/prompt_tokens": self.step["prompt_tokens"],
                "train/completion_tokens": self.step["completion_tokens"],
            }
            with metrics_path.open("a") as f:
                f.write(json.dumps(line) + "\n")

    config = grpo_config(spec, out_dir)
    if spec.image_metadata:  # a visual task: conversational prompts with their images, and the processor
        from transformers import AutoProcessor

        draw = TASKS[spec.task].images
        assert draw is not None, f"task {spec.task} draws no images"
        dataset = Dataset.from_dict({
            "prompt": [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": p}]}] for p in spec.prompts],
            "images": [draw(m) for m in spec.image_metadata],
            "answer": spec.answers,
        })  # fmt: skip
        processing: Any = AutoProcessor.from_pretrained(spec.model_dir)  # type: ignore[no-untyped-call]
    else:
        dataset = Dataset.from_dict({"prompt": spec.prompts, "answer": spec.answers})
        processing = AutoTokenizer.from_pretrained(spec.model_dir)
    trainer = TimedGRPOTrainer(
        model=spec.model_dir,
        reward_funcs=task_reward(spec.task),
        args=config,
        train_dataset=dataset,
        processing_class=processing,
        callbacks=[StepMetrics()],
    )
    trainer.train()
    if spec.save_final:
        trainer.save_model(str(out_dir / "final"))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m benchmarks.trl_grpo SPEC.json OUT_DIR", file=sys.stderr)
        return 2
    spec = build(TrlSpec, json.loads(Path(argv[0]).read_text()))
    out_dir = Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    train(spec, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
