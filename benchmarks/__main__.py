"""``python -m benchmarks NAME [--out DIR]``: run one benchmark, print it, write its JSON."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from benchmarks.harness import report

BENCHMARKS = {
    "transport": "benchmarks.transport",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="where NAME.json goes")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (for tests)")
    args = parser.parse_args(argv)
    module = importlib.import_module(BENCHMARKS[args.name])
    result = module.run(quick=args.quick)
    report(args.name, result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
