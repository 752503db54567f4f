"""``python -m benchmarks stages``: where one run's time goes, per stage and per role.

One job runs with ``run.trace=true`` (``yatt.runtime.trace``): every role process writes the spans
of its work, on one wall clock. The job is yatt's side of ``python -m benchmarks e2e``
(``benchmarks.e2e.JOBS``: the default job, without the all-equal filter, so that it is
the job compared with TRL), at either size, in one placement layout (``placement.layout``,
default colocated). The benchmark reads them over a steady window (trainer rank 0's steps
after ``skip`` warm-up steps, without the last step, which also holds the final
checkpoint and export) and reports:

- trainer rank 0's step, taken apart into parts that do not overlap (``STEP_PARTS``: each
  part is what its spans cover and no earlier part does): ``generate`` (colocated: the
  engine this rank hosts generating, in the trainer's own process, while the rank waits
  for its micro-batches), ``wait_for_buffer`` (the rest of that wait: the other ranks'
  engines or the generator processes, scoring, the buffer), ``sleep`` and ``wake``
  (colocated: the engine handing the slot to training and back, the wake's all-gather of
  the new weights included), ``weight_gather`` (the FSDP2 full tensors), ``weight_push``
  (buckets to every generator, loaded there, then the version to the buffer),
  ``checkpoint``, ``collectives`` (the all-reduces of the micro-batch check, the step's
  sums and the gradient norm, FSDP2's parameter all-gathers and gradient reduce-scatters:
  ``all_reduce``, ``all_gather`` and ``reduce_scatter`` spans, mostly inside the next two),
  ``forward_backward`` and ``optimizer`` without them, and ``other`` (the rest: the
  barrier before taking turns, the step's staleness all-reduce, metrics, queries);
- per role process: seconds per step of each kind of work (the collectives of the other
  ranks by kind, the reward worker's ``pool_round_trip``), its busy share (the union of its
  spans over the window), idle share (1 - busy) and CPU share (its CPU seconds over the
  window, from the ``_cpu`` samples; controllers do all their work in the event loop, so
  they have no spans, only CPU);
- ``framework_overhead_share``: the share of the window in which no role was inside model
  compute: wall time minus the union of compute over all roles, over wall time. Compute is
  ``generate`` in the engines, ``score`` in the scorers, ``forward_backward`` and
  ``optimizer`` in the trainer ranks, less the framework spans nested in them in the same
  process (``FRAMEWORK_IN_COMPUTE``): the trainer's collectives (gradient reduction
  included) and the reward worker's process-pool round trips (a sample pickled to a pool
  process, scored, the score back; the rule's own run there, microseconds for the digits
  reward, is not traced apart and counts with the round trip). Everything else is the
  framework: messages, the buffer's decisions and ledger, waiting, collectives, weight
  gather, transfer and load, the switch between engine and training, checkpoints, metrics.
  A rank waiting in a collective while another rank computes is not overhead: some role
  is computing.
- ``framework_in_compute_share``: what those nested spans take out of the compute union,
  as a share of the window (the overhead the compute spans alone would hide).

Plot: a timeline of every role over ``timeline_steps`` steps of the window.

Options (``--set KEY=VALUE``): ``model`` (``tiny``; or ``smollm2``:
SmolLM2-135M-Instruct, 4 groups x 8 samples x <= 16 new tokens per step, about 8 minutes
on 2 cores), ``layout`` (``placement.layout``: auto, colocated (default), partial,
disaggregated), ``steps`` (default 20 tiny, 8 smollm2), ``skip`` (warm-up steps left out,
default 2), ``timeline_steps`` (default 3), ``overrides`` (more ``dotted.key=value`` items
for the job, e.g. ``[generator.threads=1]``).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.e2e import JOBS
from benchmarks.harness import Result, Span, Timeline
from benchmarks.jobs import run_yatt
from yatt.errors import ConfigError
from yatt.runtime import run_dir as names

COMPUTE_KINDS = frozenset({"generate", "score", "forward_backward", "optimizer"})
"""Model (and reward function) compute: what is not the framework's own time, less the
framework spans nested in them (``FRAMEWORK_IN_COMPUTE``)."""
COLLECTIVE_KINDS = frozenset({"all_reduce", "reduce_scatter", "all_gather"})
"""The trainer's collectives: explicit all-reduces (the micro-batch check, the step's sums,
the gradient norm, whitening moments) and FSDP2's parameter all-gathers and gradient
reduce-scatters."""
FRAMEWORK_IN_COMPUTE = COLLECTIVE_KINDS | {"pool_round_trip"}
"""Framework spans that run inside compute spans of the same process: the collectives
inside forward_backward and optimizer, the reward worker's process-pool round trips
inside score."""
WAIT_KINDS = frozenset({"step", "wait_for_buffer"})
"""Spans that hold a role without it working (a step contains the others)."""
STEP_PARTS: tuple[tuple[str, frozenset[str]], ...] = (
    ("generate", frozenset({"generate"})),
    ("wait_for_buffer", frozenset({"wait_for_buffer"})),
    ("sleep", frozenset({"sleep"})),
    ("wake", frozenset({"wake"})),
    ("weight_gather", frozenset({"weight_gather"})),
    ("weight_push", frozenset({"weight_push"})),
    ("checkpoint", frozenset({"checkpoint"})),
    ("collectives", COLLECTIVE_KINDS),
    ("forward_backward", frozenset({"forward_backward"})),
    ("optimizer", frozenset({"optimizer"})),
)
"""Trainer rank 0's step, taken apart: each part is the time its spans cover that no earlier
part covers (the colocated engine generates while the rank waits for its micro-batches;
collectives run inside forward_backward, optimizer, wake and weight_gather)."""
LAYOUTS = ("auto", "colocated", "partial", "disaggregated")

MODELS = {"tiny": "", "smollm2": "builtin:smollm2"}
"""model.path of each size (empty: the default job's tiny model, built in the run dir)."""

Interval = tuple[float, float]


@dataclass(kw_only=True)
class RoleTrace:
    """One role process's trace file: its spans by kind and its CPU samples."""

    name: str
    spans: dict[str, list[Interval]] = field(default_factory=dict)  # kind -> [(start, end)]
    cpu: list[tuple[float, float]] = field(default_factory=list)  # (wall time, CPU seconds so far)


def load_traces(trace_dir: Path) -> dict[str, RoleTrace]:
    """Every ``<role>-<index>.jsonl`` of a run's trace dir."""
    roles = {}
    for path in sorted(trace_dir.glob("*.jsonl")):
        role = RoleTrace(name=path.stem)
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec["kind"] == "_cpu":
                role.cpu.append((rec["start"], rec["cpu_s"]))
            elif rec["kind"] != "_process":
                role.spans.setdefault(rec["kind"], []).append((rec["start"], rec["start"] + rec["duration"]))
        roles[role.name] = role
    return roles


def union_length(intervals: Iterable[Interval], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to [lo, hi]."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    total, end = 0.0, lo
    for a, b in clipped:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: list[Interval] = []
    for a, b in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def subtract(intervals: Iterable[Interval], holes: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` without the union of ``holes`` (sorted, disjoint)."""
    cuts = merge(holes)
    out: list[Interval] = []
    first = 0  # cuts before it end before every interval still to come
    for a, b in merge(intervals):
        while first < len(cuts) and cuts[first][1] <= a:
            first += 1
        j = first
        while j < len(cuts) and cuts[j][0] < b:
            c, d = cuts[j]
            if c > a:
                out.append((a, c))
            a = max(a, d)
            j += 1
        if a < b:
            out.append((a, b))
    return out


def cpu_between(samples: list[tuple[float, float]], lo: float, hi: float) -> float | None:
    """CPU seconds spent in [lo, hi], linearly interpolated between samples; None if the
    samples do not cover the window."""
    if len(samples) < 2 or samples[0][0] > lo or samples[-1][0] < hi:
        return None

    def at(t: float) -> float:
        for (t0, c0), (t1, c1) in zip(samples, samples[1:], strict=False):
            if t0 <= t <= t1:
                return c0 + (c1 - c0) * ((t - t0) / (t1 - t0) if t1 > t0 else 0.0)
        raise AssertionError("covered above")

    return at(hi) - at(lo)


@dataclass(kw_only=True)
class Stages:
    """The analysis of one traced run over its steady window."""

    window: Interval
    steps: list[Interval]
    figures: dict[str, float]


def analyse(roles: Mapping[str, RoleTrace], *, skip: int) -> Stages:
    """Stage and role figures over trainer rank 0's steps ``skip .. n-2``."""
    if "trainer-0" not in roles or "step" not in roles["trainer-0"].spans:
        raise ValueError("the trace has no steps of trainer-0 (was run.trace on?)")
    all_steps = sorted(roles["trainer-0"].spans["step"])
    steps = all_steps[skip:-1]
    if not steps:
        raise ValueError(f"{len(all_steps)} traced steps leave none after {skip} warm-up steps and the last one")
    lo, hi = steps[0][0], steps[-1][1]
    wall, n = hi - lo, len(steps)
    figures: dict[str, float] = {
        "window_steps": float(n),
        "window_s": wall,
        "step_s_median": statistics.median(b - a for a, b in steps),
    }
    # Trainer rank 0's step taken apart: exclusive parts, in STEP_PARTS' order.
    step_mean = sum(b - a for a, b in steps) / n
    trainer0 = roles["trainer-0"].spans
    taken: list[Interval] = []
    for part, kinds in STEP_PARTS:
        spans = [iv for kind in kinds for iv in trainer0.get(kind, [])]
        figures[f"trainer_0_{part}_s_per_step"] = union_length(subtract(spans, taken), lo, hi) / n
        taken += spans
    figures["trainer_0_other_s_per_step"] = max(step_mean - union_length(taken, lo, hi) / n, 0.0)
    in_parts = {kind for _, kinds in STEP_PARTS for kind in kinds}
    # Every role: its kinds of work per step, busy, idle and CPU shares.
    for name, role in sorted(roles.items()):
        key = name.replace("-", "_")
        for kind, intervals in sorted(role.spans.items()):
            if kind != "step" and not (name == "trainer-0" and kind in in_parts):
                figures[f"{key}_{kind}_s_per_step"] = union_length(intervals, lo, hi) / n
        busy = [iv for kind, ivs in role.spans.items() if kind not in WAIT_KINDS for iv in ivs]
        if role.spans:
            share = union_length(busy, lo, hi) / wall
            figures[f"{key}_busy_share"] = share
            figures[f"{key}_idle_share"] = 1.0 - share
        cpu = cpu_between(role.cpu, lo, hi)
        if cpu is not None:
            figures[f"{key}_cpu_share"] = cpu / wall
    spans_compute, compute = [], []
    for role in roles.values():
        own = [iv for kind, ivs in role.spans.items() if kind in COMPUTE_KINDS for iv in ivs]
        nested = [iv for kind, ivs in role.spans.items() if kind in FRAMEWORK_IN_COMPUTE for iv in ivs]
        spans_compute += own
        compute += subtract(own, nested)  # nested spans are in the same process as their compute
    figures["framework_overhead_share"] = 1.0 - union_length(compute, lo, hi) / wall
    figures["framework_in_compute_share"] = (union_length(spans_compute, lo, hi) - union_length(compute, lo, hi)) / wall
    return Stages(window=(lo, hi), steps=steps, figures=figures)


def timeline(roles: Mapping[str, RoleTrace], steps: list[Interval], count: int) -> Timeline:
    """What every role did over the first ``count`` steps of the window (seconds from its start)."""
    shown = steps[:count]
    lo, hi = shown[0][0], shown[-1][1]
    rows: dict[str, list[Span]] = {}
    for name, role in sorted(roles.items(), key=lambda kv: _role_order(kv[0])):
        spans = [
            Span(start=max(a, lo) - lo, duration=min(b, hi) - max(a, lo), kind=kind)
            for kind, intervals in role.spans.items()
            if kind != "step"
            for a, b in intervals
            if b > lo and a < hi
        ]
        if spans:
            rows[name] = spans
    return Timeline(title=f"what each role does over {len(shown)} steps", rows=rows)


def _role_order(name: str) -> tuple[int, str]:
    order = ("controller", "generator", "reward", "buffer", "trainer")
    role = name.rsplit("-", 1)[0]
    return (order.index(role) if role in order else len(order), name)


def _options(options: Mapping[str, Any] | None, quick: bool) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "model": "tiny", "layout": "colocated", "steps": None, "skip": 1 if quick else 2, "timeline_steps": 3,
        "overrides": [],
    }
    for key, value in (options or {}).items():
        if key not in opts:
            raise ConfigError(f"{key}: unknown option of the stages benchmark; known: {', '.join(opts)}")
        opts[key] = value
    if opts["model"] not in ("tiny", "smollm2"):
        raise ConfigError(f"model must be one of 'tiny', 'smollm2' (got {opts['model']!r})")
    if opts["layout"] not in LAYOUTS:
        raise ConfigError(f"layout must be one of {', '.join(map(repr, LAYOUTS))} (got {opts['layout']!r})")
    if opts["steps"] is None:
        opts["steps"] = 6 if quick else (20 if opts["model"] == "tiny" else 8)
    for key in ("steps", "skip", "timeline_steps"):
        if not isinstance(opts[key], int) or isinstance(opts[key], bool):
            raise ConfigError(f"{key} must be an integer (got {opts[key]!r})")
    if not (isinstance(opts["overrides"], list) and all(isinstance(o, str) and "=" in o for o in opts["overrides"])):
        raise ConfigError(f"overrides must be a list of dotted.key=value items (got {opts['overrides']!r})")
    if opts["timeline_steps"] < 1:
        raise ConfigError(f"timeline_steps must be >= 1 (got {opts['timeline_steps']})")
    if opts["skip"] < 0:
        raise ConfigError(f"skip must be >= 0 (got {opts['skip']})")
    if opts["steps"] < opts["skip"] + 2:
        raise ConfigError(f"steps must be >= skip + 2 = {opts['skip'] + 2} (got {opts['steps']})")
    return opts


def run(*, quick: bool, options: Mapping[str, Any] | None = None) -> Result:
    opts = _options(options, quick)
    items = [*JOBS[opts["model"]], f"run.steps={opts['steps']}", "run.trace=true", f"placement.layout={opts['layout']}"]
    if MODELS[opts["model"]]:
        items.append(f"model.path={MODELS[opts['model']]}")
    items += opts["overrides"]
    with tempfile.TemporaryDirectory(prefix="yatt-stages-") as tmp:
        job = run_yatt(items, Path(tmp) / "run", timeout_s=3600.0)
        roles = load_traces(job.run_dir / "trace")
        placed = json.loads((job.run_dir / names.PLAN).read_text())["layout"]
    stages = analyse(roles, skip=opts["skip"])
    result = Result(figures=dict(stages.figures))
    result.plots["timeline"] = timeline(roles, stages.steps, opts["timeline_steps"])
    result.notes.append(
        f"launch/default.yaml with {' '.join(items)}; window: steps "
        f"{opts['skip']}..{opts['steps'] - 2} of trainer rank 0"
    )
    result.notes.append(
        f"layout {placed}"
        + (": the generator engines run in the trainer ranks' processes (generate in trainer-N)"
           if placed == "colocated" else "")
    )
    result.notes.append(
        "CPU shares count each process's own threads (a reward worker's scorer pool and a vLLM "
        "engine core are processes of their own and are not in them)"
    )
    return result
