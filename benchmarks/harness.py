"""The benchmark convention: one function per benchmark returns figures, ratios and plots;
the harness adds the machine, prints a table, writes ``DIR/NAME.json`` and renders each
plot to ``DIR/NAME_<plot>.png`` (matplotlib, from the bench extra)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(kw_only=True)
class Series:
    """One line of a line plot."""

    label: str
    x: list[float]
    y: list[float]


@dataclass(kw_only=True)
class LinePlot:
    """y against x, one line per series."""

    title: str
    xlabel: str
    ylabel: str
    series: list[Series]
    logx: bool = False


@dataclass(kw_only=True)
class Span:
    """One bar of a timeline: what a role was doing from ``start`` for ``duration`` seconds."""

    start: float
    duration: float
    kind: str


@dataclass(kw_only=True)
class Timeline:
    """What each role (one row each) was doing over time, a colour per kind of span."""

    title: str
    rows: dict[str, list[Span]]
    xlabel: str = "seconds"


Plot = LinePlot | Timeline


@dataclass(kw_only=True)
class Result:
    """What one benchmark measured: named figures (with units in the name), ratios, notes
    and plots (key -> plot; rendered to ``NAME_<key>.png``, their data kept in the JSON)."""

    figures: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    plots: dict[str, Plot] = field(default_factory=dict)


def machine() -> dict[str, object]:
    """The facts a reader needs to compare figures across machines."""
    import torch
    import zmq

    info: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    return info


def report(name: str, result: Result, out_dir: Path) -> Path:
    """Print the table and write the JSON; returns the JSON's path."""
    rows = [(k, v) for k, v in result.figures.items()] + [(f"ratio {k}", v) for k, v in result.ratios.items()]
    width = max((len(k) for k, _ in rows), default=10)
    print(f"\n{name}")
    print("-" * (width + 16))
    for key, value in rows:
        print(f"{key:<{width}}  {value:>14,.3f}")
    for note in result.notes:
        print(f"note: {note}")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    payload = {
        "benchmark": name,
        "figures": result.figures,
        "ratios": result.ratios,
        "notes": result.notes,
        "env": machine(),
        "command": " ".join([Path(sys.executable).name, "-m", "benchmarks", *sys.argv[1:]]),
    }
    pngs = {key: render(plot, out_dir / f"{name}_{key}.png") for key, plot in result.plots.items()}
    payload["plots"] = {key: {"png": png.name, **asdict(result.plots[key])} for key, png in pngs.items()}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}" + "".join(f", {png}" for png in pngs.values()))
    return path


def render(plot: Plot, path: Path) -> Path:
    """Draw one plot into a PNG file (no screen needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(8, 4.5) if isinstance(plot, LinePlot) else (11, 1.2 + 0.45 * len(plot.rows)))
    try:
        if isinstance(plot, LinePlot):
            for series in plot.series:
                ax.plot(series.x, series.y, marker="o" if len(series.x) <= 12 else None, markersize=4, label=series.label)
            if plot.logx:
                ax.set_xscale("log", base=2)
            ax.set_ylabel(plot.ylabel)
            ax.grid(alpha=0.3)
            if len(plot.series) > 1:
                ax.legend()
        else:
            kinds = sorted({span.kind for spans in plot.rows.values() for span in spans})
            colours = {kind: plt.get_cmap("tab10")(i % 10) for i, kind in enumerate(kinds)}
            names = list(plot.rows)
            for i, row in enumerate(names):
                spans = plot.rows[row]
                for kind in kinds:
                    bars = [(s.start, s.duration) for s in spans if s.kind == kind]
                    if bars:
                        ax.broken_barh(bars, (i - 0.4, 0.8), facecolors=colours[kind])
            ax.set_yticks(range(len(names)), names)
            ax.invert_yaxis()
            handles = [Patch(color=colours[k], label=k) for k in kinds]
            ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
        ax.set_title(plot.title)
        ax.set_xlabel(plot.xlabel)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path
