"""``python -m launch plan [CONFIG.yaml] [dotted.key=value ...] [--from RUN_DIR]``: the three
placement candidates of a run on this machine, with their predicted step time, idle share
and memory per slot, and the one the planner picks (the inputs: ``launch.placement.inputs``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from launch.config import load_run_config, split_items
from launch.placement.inputs import roles_of, run_costs, run_sizes, run_workload, this_machine
from yatt.placement.planner import GIB, Candidate, best, candidates, describe, finish


def _per_slot(values: dict[int, float], fmt: str) -> str:
    """Values by slot, all of them for a few slots, else min/mean/max."""
    if len(values) <= 8:
        return " ".join(format(v, fmt) for v in values.values())
    v = list(values.values())
    return f"min {min(v):{fmt}} mean {sum(v) / len(v):{fmt}} max {max(v):{fmt}}"


def table(cands: list[Candidate]) -> str:
    """The candidates as a text table, and the pick."""
    lines = []
    for c in cands:
        p = c.prediction
        head = f"{c.layout:<14}"
        if p is None:
            lines.append(f"{head} refused: {c.refused}")
            continue
        counts = c.plan.counts() if c.plan is not None else {}
        lines.append(f"{head} {p.step_s:8.3f} s/step   {describe(p)}")
        lines.append(f"{'':14} processes  {' '.join(f'{r} {k}' for r, k in counts.items() if k)}")
        lines.append(f"{'':14} idle share per slot  {_per_slot(p.idle_share, '.2f')}")
        lines.append(f"{'':14} memory GiB per slot  {_per_slot({s: m / GIB for s, m in p.memory_bytes.items()}, '.3f')}")
        if c.refused:
            lines.append(f"{'':14} refused: {c.refused}")
    pick = best(cands)
    lines.append(f"pick: {finish(pick).reason}" if pick else "pick: none fits (see the refusals)")
    return "\n".join(lines)


def plan_main(args: argparse.Namespace) -> int:
    config_path, overrides = split_items(args.items)
    cfg = load_run_config(config_path, overrides)
    cluster = this_machine(peak_flops=args.peak_flops, dtype=cfg.model.dtype, cpu_slots=cfg.placement.cpu_slots)
    kind = cluster.slots[0].kind
    costs = run_costs(cfg, cluster, args.measured)
    sizes, workload = run_sizes(cfg, kind), run_workload(cfg, kind)
    cands = candidates(cluster, sizes, costs, workload, roles_of(cfg), search=args.search)
    print(f"cluster: {len(cluster.slots)} {kind} slots of {cluster.slots[0].memory_bytes / GIB:.2f} GiB, "
          f"peak {cluster.peak_flops / 1e9:.1f} GFLOP/s per slot")
    print(f"model: {sizes.policy_params / 1e6:.3g}M parameters; costs {'measured in ' + str(args.measured) if args.measured else 'estimated from FLOPs'}")
    print(table(cands))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``plan`` subcommand of ``python -m launch``."""
    p = sub.add_parser("plan", help="print the three placement candidates of a run on this machine and the pick")
    p.add_argument("items", nargs="*", metavar="CONFIG.yaml | dotted.key=value")
    p.add_argument("--from", dest="measured", type=Path, default=None,
                   help="a run dir whose metrics.jsonl calibrates the costs (default: estimated from FLOPs)")
    p.add_argument("--peak-flops", type=float, default=None,
                   help="FLOP/s of one slot (default: measured with a matmul for 0.3 s)")
    p.add_argument("--search", action="store_true",
                   help="let the planner choose how many generators and trainer ranks (default: the config's)")
    p.set_defaults(main=plan_main)
