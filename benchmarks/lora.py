"""``python -m benchmarks lora``: LoRA against full fine-tuning, the same job side by side.

The same disaggregated job (``model``, SmolLM2-135M by default, ``steps`` steps, 2 groups
of 2 per step, no filter) trained fully and with LoRA adapters (``model.lora.rank``,
q/k/v/o projections), interleaved ``repeats`` times. Per run: the median over steps 1..N-1
of the step time, of the trainer's compute (``time/train_s``) and of the weight sync
(LoRA sends the adapters only), and the peak RSS of trainer rank 0 and of the generator
(sampled every 0.5 s). Ratios: LoRA over full fine-tuning, from the medians of the runs.

Options (``--set``): ``model`` (builtin:smollm2), ``steps`` (6), ``rank`` (16), ``repeats`` (2),
``backend`` (transformers; ``vllm``: the generator's vLLM engine, which with LoRA loads
each update as a peft adapter and keeps its base weights).
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.fuzzing import role_processes
from benchmarks.harness import Result
from benchmarks.jobs import run_yatt
from yatt.errors import ConfigError
from yatt.runtime.configtools import build


@dataclass(frozen=True, kw_only=True)
class Options:
    model: str = "builtin:smollm2"
    """model.path of both jobs ("" for the tiny default)."""
    steps: int = 6
    """Steps of each run."""
    rank: int = 16
    """model.lora.rank of the LoRA runs."""
    repeats: int = 2
    """Runs of each kind, interleaved."""
    backend: str = "transformers"
    """generator.backend of both jobs."""

    def __post_init__(self) -> None:
        for name in ("steps", "rank", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"lora.{name} must be >= 1 (got {getattr(self, name)})")
        if self.steps < 3:
            raise ConfigError(f"lora.steps must be >= 3: the first and the last step are not measured (got {self.steps})")
        if self.backend not in ("transformers", "vllm"):
            raise ConfigError(f"lora.backend must be 'transformers' or 'vllm' (got {self.backend!r})")


def _peak_rss(run_dir: Path, stop: threading.Event, peaks: dict[str, float]) -> None:
    """Sample the RSS (MiB) of each role process of ``run_dir`` until ``stop``; keep the peak."""
    import psutil

    while not stop.is_set():
        for name, pid in role_processes(run_dir).items():
            try:
                rss = psutil.Process(pid).memory_info().rss / 2**20
            except psutil.Error:
                continue
            peaks[name] = max(peaks.get(name, 0.0), rss)
        time.sleep(0.5)


def _one(run_dir: Path, opts: Options, lora: bool) -> dict[str, float]:
    items = [
        *([f"model.path={opts.model}"] if opts.model else []), f"run.steps={opts.steps}", "placement.layout=disaggregated",
        "buffer.groups_per_step=2", "buffer.group_size=2", "buffer.filter=none", "trainer.checkpoint_every=0",
        f"model.lora.rank={opts.rank if lora else 0}", f"model.lora.alpha={2 * opts.rank}",
        f"generator.backend={opts.backend}",
    ]  # fmt: skip
    peaks: dict[str, float] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=_peak_rss, args=(run_dir, stop, peaks), daemon=True)
    sampler.start()
    try:
        job = run_yatt(items, run_dir, timeout_s=1800)
    finally:
        stop.set()
        sampler.join()
    lines = job.metrics[1:-1]  # not the warm-up, nor the last (final export, synchronous save)
    return {
        "step_s": statistics.median(m["time/step_s"] for m in lines),
        "train_s": statistics.median(m["time/train_s"] for m in lines),
        "weight_sync_s": statistics.median(m["time/weight_sync_s"] for m in lines),
        "trainer0_peak_rss_mb": peaks.get("trainer-0", float("nan")),
        "generator_peak_rss_mb": peaks.get("generator-0", float("nan")),
    }


def run(*, quick: bool = False, options: dict[str, object] | None = None) -> Result:
    opts = build(Options, {**({"model": "", "steps": 3, "repeats": 1} if quick else {}), **(options or {})}, "lora")
    result = Result()
    runs: dict[str, list[dict[str, float]]] = {"full": [], "lora": []}
    with tempfile.TemporaryDirectory(prefix="yatt-lora-") as tmp:
        for i in range(opts.repeats):
            for kind in ("full", "lora"):
                runs[kind].append(_one(Path(tmp) / f"{kind}_{i}", opts, lora=kind == "lora"))
    for kind, measured in runs.items():
        for key in measured[0]:
            result.figures[f"{kind}_{key}"] = statistics.median(m[key] for m in measured)
    for key in ("step_s", "train_s", "weight_sync_s", "trainer0_peak_rss_mb", "generator_peak_rss_mb"):
        result.ratios[f"lora_vs_full_{key}"] = result.figures[f"lora_{key}"] / result.figures[f"full_{key}"]
    result.notes.append(
        f"{opts.model or 'tiny'} model, {opts.backend} generator, {opts.steps} steps, LoRA rank {opts.rank} (alpha {2 * opts.rank}) on "
        f"q/k/v/o vs full fine-tuning, {opts.repeats} interleaved runs each; medians of steps 1..{opts.steps - 2}"
    )
    return result
