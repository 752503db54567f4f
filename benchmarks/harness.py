"""The benchmark convention: one function per benchmark returns figures and ratios;
the harness adds the machine, prints a table and writes ``DIR/NAME.json``."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(kw_only=True)
class Result:
    """What one benchmark measured: named figures (with units in the name) and ratios."""

    figures: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


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
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path
