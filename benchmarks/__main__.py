"""``python -m benchmarks NAME [--out DIR] [--quick] [--set KEY=VALUE ...]``: run one
benchmark, print it, write its JSON.

``--set`` passes options to a benchmark whose ``run`` takes ``options`` (values parsed as
YAML scalars, checked by the benchmark); its module docstring lists them.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path

from benchmarks.harness import report
from yatt.errors import ConfigError
from yatt.runtime.configtools import apply_overrides

BENCHMARKS = {
    "controllers": "benchmarks.controllers",
    "e2e": "benchmarks.e2e",
    "faults": "benchmarks.faults",
    "generation": "benchmarks.generation",
    "lora": "benchmarks.lora",
    "placement": "benchmarks.placement",
    "stages": "benchmarks.stages",
    "staleness": "benchmarks.staleness",
    "transport": "benchmarks.transport",
    "agents": "benchmarks.agents",
    "endpoint": "benchmarks.endpoint",
    "training": "benchmarks.training",
    "vlm": "benchmarks.vlm",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="where NAME.json goes")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (for tests)")
    parser.add_argument(
        "--set", dest="options", action="append", default=[], metavar="KEY=VALUE", help="a benchmark option"
    )
    args = parser.parse_args(argv)
    module = importlib.import_module(BENCHMARKS[args.name])
    kwargs = {}
    if args.options:
        if "options" not in inspect.signature(module.run).parameters:
            parser.error(f"benchmark {args.name} takes no --set options")
        try:
            kwargs["options"] = apply_overrides({}, args.options)
        except ConfigError as e:
            parser.error(str(e))
    try:
        result = module.run(quick=args.quick, **kwargs)
    except ConfigError as e:  # a bad --set value, named by its field
        parser.error(str(e))
    report(args.name, result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
