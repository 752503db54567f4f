"""``python -m benchmarks training``: the trainer's forward and backward, layout by layout.

One micro-batch of GRPO groups (``groups`` prompts of ``prompt_tokens`` tokens, ``samples``
completions each, lengths drawn from ``completion_tokens`` / 2 to ``completion_tokens``)
trains on the real ``workers.trainer.Trainer`` (one gloo rank in a spawned process,
``threads`` threads, float32 master weights in ``model.dtype``), in four layouts:

    padded        [B, T] right-padded rows (the default)
    packed        trainer.pack: one row of the real tokens
    shared        trainer.share_prompt: a row per prompt, its completions after it
    shared_packed both: every prompt and its completions in one row

Each layout has its own trainer; the layouts take turns (one untimed warm-up step each,
then ``reps`` rounds, the order rotating), and a step is ``accumulate`` (forward and
backward) then ``finish_step`` (optimizer). Figures per layout: the median forward and
backward seconds, the positions the model computes (rows x width), the pad share, the
prompt tokens not computed again, and the training FLOPs per loss token: 6 x parameters x
positions (the dense part) + 12 x layers x hidden x sum over rows of width^2 (attention,
computed over every (query, key) pair, masked or not, as sdpa does on CPU), over the
batch's loss tokens. Ratios: padded seconds over each layout's.

Options (``--set``): ``model`` (tiny or smollm2), ``groups`` (4), ``samples`` (8),
``prompt_tokens`` (128), ``completion_tokens`` (32), ``reps`` (5), ``threads`` (0: the
machine's cores), ``dtype`` (auto).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import Result
from yatt.errors import ConfigError
from yatt.runtime.cache import smollm2_dir
from yatt.runtime.configtools import build

LAYOUTS: dict[str, dict[str, bool]] = {
    "padded": {},
    "packed": {"pack": True},
    "shared": {"share_prompt": True},
    "shared_packed": {"share_prompt": True, "pack": True},
}


@dataclass(frozen=True, kw_only=True)
class Options:
    model: str = "tiny"
    """tiny (the built-in test model) or smollm2 (SmolLM2-135M, exported once into $YATT_CACHE_DIR, default ~/.cache/yatt)."""
    groups: int = 4
    """Prompts in the micro-batch."""
    samples: int = 8
    """Completions per prompt."""
    prompt_tokens: int = 128
    """Tokens of every prompt."""
    completion_tokens: int = 32
    """Longest completion; each is drawn from half of it to all of it."""
    reps: int = 5
    """Timed steps per layout, after one warm-up step."""
    threads: int = 0
    """torch threads of the trainer; 0: this machine's cores."""
    dtype: str = "auto"
    """model.dtype (the compute dtype)."""

    def __post_init__(self) -> None:
        if self.model not in ("tiny", "smollm2"):
            raise ConfigError(f"training.model must be tiny or smollm2 (got {self.model!r})")
        for name in ("groups", "samples", "prompt_tokens", "completion_tokens", "reps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"training.{name} must be >= 1 (got {getattr(self, name)})")
        if self.threads < 0:
            raise ConfigError(f"training.threads must be >= 0, 0 for the machine's cores (got {self.threads})")


def _batch(opts: Options, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rows = [
        (prompt, torch.randint(3, vocab, (int(torch.randint(opts.completion_tokens // 2 or 1, opts.completion_tokens + 1, (1,), generator=g)),), generator=g))
        for prompt in (torch.randint(3, vocab, (opts.prompt_tokens,), generator=g) for _ in range(opts.groups))
        for _ in range(opts.samples)
    ]  # fmt: skip
    width = max(len(p) + len(c) for p, c in rows)
    shape = (len(rows), width)
    ids, attention, loss = torch.zeros(shape, dtype=torch.int64), torch.zeros(shape, dtype=torch.bool), torch.zeros(shape, dtype=torch.bool)
    for b, (p, c) in enumerate(rows):
        ids[b, : len(p)], ids[b, len(p) : len(p) + len(c)] = p, c
        attention[b, : len(p) + len(c)] = True
        loss[b, len(p) : len(p) + len(c)] = True
    advantages = torch.randn(shape, generator=g) * loss
    rollout = -torch.rand(shape, generator=g) * loss
    return dict(input_ids=ids, attention_mask=attention, loss_mask=loss, rollout_logprobs=rollout, advantages=advantages)


def _worker(rank: int, model_dir: str, opts: Options, out: str) -> None:
    import torch.distributed as dist

    from protocols.messages import GroupKey, MicroBatch
    from workers.packing import share_prompts
    from workers.trainer import Trainer
    from yatt.rl.config import AlgorithmConfig, ModelConfig, TrainerConfig

    torch.set_num_threads(opts.threads or os.cpu_count() or 1)
    dist.init_process_group("gloo", init_method=f"file://{out}.init", rank=0, world_size=1)
    trainers = {
        name: Trainer(
            ModelConfig(dtype=opts.dtype),  # type: ignore[arg-type]
            TrainerConfig(world_size=1, lr=1e-6, **flags),  # type: ignore[arg-type]
            AlgorithmConfig(),
            model_path=model_dir,
        )
        for name, flags in LAYOUTS.items()
    }
    policy = trainers["padded"].policy
    config = policy.config
    batch = _batch(opts, int(config.vocab_size))

    def micro_batch(step: int) -> MicroBatch:
        rows = batch["input_ids"].shape[0]
        fields: dict[str, Any] = {k: v.clone() for k, v in batch.items()}
        return MicroBatch(
            step=step, rank=0, index=0, count=1, **fields,
            policy_versions=torch.full((rows,), step, dtype=torch.int64),
            group_keys=[GroupKey(epoch=0, shard=0, prompt_index=r // opts.samples) for r in range(rows)],
        )  # fmt: skip

    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    steps = {name: 0 for name in LAYOUTS}
    names = list(LAYOUTS)
    for rep in range(opts.reps + 1):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            trainer = trainers[name]
            start = time.perf_counter()
            trainer.accumulate(micro_batch(steps[name]))
            elapsed = time.perf_counter() - start
            trainer.finish_step()
            steps[name] += 1
            if rep:
                times[name].append(elapsed)
    params = sum(p.numel() for p in policy.parameters())
    layers, hidden = int(config.num_hidden_layers), int(config.hidden_size)
    attention, loss = batch["attention_mask"], batch["loss_mask"]
    loss_tokens = int(loss.sum())
    shapes: dict[str, list[int]] = {
        "padded": [int(attention.shape[1])] * attention.shape[0],
        "packed": [int(attention.sum())],
    }
    saved = {"padded": 0, "packed": 0}
    for name, one_row in (("shared", False), ("shared_packed", True)):
        layout = share_prompts(batch["input_ids"], attention, loss, one_row=one_row)
        shapes[name] = [int(layout.input_ids.shape[1])] * layout.input_ids.shape[0]
        saved[name] = layout.shared
    figures: dict[str, float] = {"parameters": float(params), "loss_tokens": float(loss_tokens), "real_tokens": float(attention.sum())}
    for name in LAYOUTS:
        positions = sum(shapes[name])
        flops = 6 * params * positions + 12 * layers * hidden * sum(w * w for w in shapes[name])
        figures[f"{name}_fwd_bwd_s"] = statistics.median(times[name])
        figures[f"{name}_positions"] = float(positions)
        figures[f"{name}_pad_share"] = 1 - (float(attention.sum()) - saved[name]) / positions if name != "padded" else float((~attention).sum()) / attention.numel()
        figures[f"{name}_prompt_tokens_saved"] = float(saved[name])
        figures[f"{name}_gflops_per_loss_token"] = flops / loss_tokens / 1e9
    torch.save(figures, out)
    dist.destroy_process_group()


def run(*, quick: bool = False, options: dict[str, object] | None = None) -> Result:
    opts = build(Options, {**({"reps": 1, "groups": 2, "samples": 2, "prompt_tokens": 16} if quick else {}), **(options or {})}, "training")
    from torch.multiprocessing.spawn import spawn

    from workers.models import build_tiny_model, export_smollm2

    result = Result()
    with tempfile.TemporaryDirectory(prefix="yatt-training-") as tmp:
        if opts.model == "tiny":
            model_dir = build_tiny_model(Path(tmp) / "tiny", seed=0)
        else:

            model_dir = export_smollm2(smollm2_dir())
        out = str(Path(tmp) / "figures.pt")
        spawn(_worker, args=(str(model_dir), opts, out), nprocs=1, join=True)  # type: ignore[no-untyped-call]
        figures: dict[str, Any] = torch.load(out)
    result.figures.update(figures)
    for name in LAYOUTS:
        result.ratios[f"{name}_speedup_vs_padded"] = figures["padded_fwd_bwd_s"] / figures[f"{name}_fwd_bwd_s"]
    result.notes.append(
        f"{opts.model}: {opts.groups} prompts of {opts.prompt_tokens} tokens x {opts.samples} completions of "
        f"{max(opts.completion_tokens // 2, 1)}-{opts.completion_tokens} tokens, one micro-batch, one rank, "
        f"{opts.threads or os.cpu_count()} threads, model.dtype={opts.dtype}; median of {opts.reps} steps per layout, interleaved"
    )
    return result
