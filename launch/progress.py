"""What the user sees of a run: a progress bar over its steps, and its last line."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from yatt.runtime import run_dir as names
from yatt.runtime.run_dir import read_jsonl


class Progress:
    """A tqdm bar over the steps, fed by the lines of ``metrics.jsonl``."""

    def __init__(self, path: Path, total: int, *, enabled: bool) -> None:
        self.path = path
        self._offset = 0
        self._bar = None
        self.lines: list[dict[str, float]] = []
        """The lines the last ``update`` read."""
        self.last_step = -1
        """The last step with a line (-1: none yet)."""
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stdout)

    def update(self) -> int:
        """Read the new lines; returns how many steps they reported."""
        if not self.path.exists():
            return 0
        with self.path.open() as f:
            f.seek(self._offset)
            text = f.read()
        complete = text[: text.rfind("\n") + 1]
        self._offset += len(complete.encode())
        lines = complete.splitlines()
        self.lines = [json.loads(line) for line in lines]
        self.last_step = max([self.last_step, *(int(m["step"]) for m in self.lines)])
        for m in self.lines:
            if self._bar is None:
                continue
            self._bar.n = int(m["step"]) + 1
            self._bar.set_postfix(
                reward=f"{m.get('reward/mean', float('nan')):.3f}",
                samples_s=f"{m.get('samples_per_s', 0):.1f}",
                filtered=f"{m.get('groups/filtered_share', 0):.2f}",
                stale=f"{m.get('staleness/mean', 0):.2f}",
                refresh=False,
            )
            self._bar.refresh()
        return len(lines)

    def rewind(self, step: int) -> None:
        """The metrics file was trimmed to the steps before ``step``: read it from there."""
        self._offset = sum(len(line.encode()) + 1 for line in self.path.read_text().splitlines()) if self.path.exists() else 0
        self.last_step = step - 1
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def write_curves(run_dir: Path) -> Path | None:
    """``curves.png`` in the run dir: the training reward, the held-out greedy accuracy and
    the step time over the steps (matplotlib, no display needed); None when no step was
    logged."""
    steps = read_jsonl(run_dir / names.METRICS) if (run_dir / names.METRICS).exists() else []
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [e for e in read_jsonl(run_dir / names.EVAL) if "eval/reward/accuracy" in e] if (run_dir / names.EVAL).exists() else []
    panels = [
        ("training reward (reward/mean)", [(r["step"], r["reward/mean"]) for r in steps if "reward/mean" in r]),
        ("held-out greedy accuracy", [(e["step"], e["eval/reward/accuracy"]) for e in evals]),
        ("step time, s (time/step_s)", [(r["step"], r["time/step_s"]) for r in steps if "time/step_s" in r]),
    ]
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (title, points) in zip(axes, panels, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if points:
            ax.plot(*zip(*points, strict=True), marker="o" if len(points) < 12 else None)
        else:
            ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes)
    figure.suptitle(str(run_dir), fontsize=9)
    figure.tight_layout()
    path = run_dir / names.CURVES
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path



def finish_line(run_dir: Path) -> str:
    """What a run that ended well says last: its steps, its training reward (mean of the first
    and the last 10 steps, with 20 or more), the held-out accuracy of its first and last
    evaluation (``eval/reward/accuracy`` in eval.jsonl, if it evaluated) and its model."""
    steps = read_jsonl(run_dir / names.METRICS)
    said = f"done: {int(steps[-1]['step']) + 1 if steps else 0} steps trained"
    rewards = [r["reward/mean"] for r in steps if "reward/mean" in r]
    if len(rewards) >= 20:  # what GRPO optimises, over the first and the last 10 steps
        said += f"; training reward {statistics.mean(rewards[:10]):.2f} -> {statistics.mean(rewards[-10:]):.2f}"
    evals = [e for e in read_jsonl(run_dir / names.EVAL) if "eval/reward/accuracy" in e]
    if evals:
        first, last = evals[0], evals[-1]
        said += (
            f"; held-out greedy accuracy (eval/reward/accuracy, eval.jsonl) {first['eval/reward/accuracy']:.2f} at step "
            f"{int(first['step'])} -> {last['eval/reward/accuracy']:.2f} at step {int(last['step'])}"
        )
    curves = run_dir / names.CURVES
    return f"{said}; model in {run_dir / names.FINAL}" + (f"; curves in {curves}" if curves.exists() else "")
