"""``python -m benchmarks placement``: a cluster simulator of 8 to 1024 GPUs with the
planner and the replanner in the loop, comparing static layouts with adaptive placement.

Why: a plan chosen before the run is chosen for the costs of step 0. Completions grow as
the policy learns, dynamic sampling's acceptance falls as more groups are solved, a
generative judge's cost per sample moves; the best split of the devices moves with them.
No one can run 1024 GPUs here, so this models them, with the same planner code
(``yatt.placement.planner``, ``yatt.placement.adaptive``) deciding, not a copy of it.

The model, per training step k (every figure a published one or derived from one; the
constants below say which)::

    lengths    S_k = accepted / acceptance_k samples, lognormal completion lengths
               (mean m_k, sigma 0.8, capped at max_new_tokens), drawn once per step and
               shared by every layout (common random numbers)
    engines    each generator engine (one GPU) decodes its share of the step's requests
               with continuous batching, at most BATCH sequences at once; a decoding step
               of b sequences takes DECODE_LATENCY_S + b * DECODE_PER_SEQ_S. Simulated
               event by event (requests finish, queued ones join), so the long tail decodes
               alone at the latency-bound pace
    sync       colocated and partial wait for every request of the step (the tail)
    async      disaggregated with max_staleness 1: engines never wait for a step's last
               requests (they join the next step), so a step costs the pool's time at
               full occupancy (the tail hidden)
    judge      a generative judge on its own engines: S_k * judge_s_k / engines, overlapped
               with generation, plus one sample's latency after the last completion
    train      TRAIN_FIXED_S + tokens * TRAIN_TOKEN_S / (n * eff(n)), eff(n) =
               1 / (1 + 0.03 log2 n) (FSDP collectives grow with the group), 5% noise
    colocated  generate + judge + SWITCH_S + train         (verl's hybrid engine)
    partial    max(generate, judge) + SWITCH_S + train + WEIGHT_SYNC_S
    disagg.    max(generate_async, judge, train + WEIGHT_SYNC_S)

Each step the simulated roles report what a run's roles trace (pool busy time, the
tail, judge, train, sync, switch, lengths, acceptance); the ``Replanner`` turns them into
costs, predicts the current plan and its neighbours, and changes the plan when one wins
by its margin for ``patience`` steps net of the change's cost, which the simulated run
pays at the boundary (an engine's start 13.8 s, a stop 5.0 s: verl's 9.1 s / 3.3 s for a
5B model scaled to 7.6B; a trainer reshard: restart plus a DCP checkpoint and restore).

Compared on each workload: the planner's best split of each layout chosen at step 0
(colocated-sync, partial, disaggregated-async), the best static plan chosen in hindsight
(every layout and split simulated over the whole run, the fastest kept), and adaptive
(starting from the planner's step-0 pick). Workloads: ``growing`` (mean completion 1,000
-> 5,000 tokens), ``acceptance`` (dynamic sampling keeps 100% -> 25% of groups),
``judge`` (a 7B generative judge whose cost per sample goes x0.25 -> x3 -> x0.5).

Calibration against real runs (``calibration``, on by default, ~4 min): the cost model the
simulator's planner uses is only as good as its calibration, so the default job runs here
twice, colocated and disaggregated (``placement.layout``); each run's metrics calibrate the
costs (``launch.placement.inputs.run_costs``, what ``python -m launch plan --from RUN_DIR`` does), and
the planner predicts the median step of both runs from each calibration: the run's own
layout (the fit) and the other layout (a prediction it was not fitted to).

Live, here (``live``, on by default, ~5 min): ``examples/adaptive_judge.yaml`` (2
generators, a judge and a trainer rank on 4 slots sharing the 2 cores) with its judge
turning slow mid-run (``YATT_SLOW_REWARD=150:0.15``), re-planned (``placement.adaptive``)
and pinned (``placement.adaptive=false``), ``live_repeats`` times each, interleaved: wall
time, training time, median step after the change, held-out accuracy at the first and the
last evaluation, groups lost and duplicated (from the ledger).

Options (``--set KEY=VALUE``): ``sizes`` (GPUs, default [64, 1024]), ``workloads``,
``steps`` (60), ``scaling_sizes`` (the throughput-vs-size sweep, [8 ... 1024]; [] skips
it), ``seed``, ``calibration`` (true), ``calibration_steps`` (40), ``live`` (true),
``live_repeats`` (1).
"""

from __future__ import annotations

import heapq
import math
import statistics
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path

import numpy as np

from benchmarks.harness import LinePlot, Result, Series
from yatt.errors import LayoutError
from yatt.placement.adaptive import Replanner, StepTimes, SwitchCosts, pools
from yatt.placement.layouts import Roles, assign, gpu_cluster
from yatt.placement.plan import LAYOUTS, Layout, Plan
from yatt.placement.planner import GIB, ModelSizes, StageCosts, Workload, candidates, ladder, predict
from yatt.runtime import run_dir as names
from yatt.runtime.configtools import build, require
from yatt.runtime.run_dir import read_jsonl

# Qwen2.5-7B on H200-class GPUs (141 GB, 989 TFLOP/s dense bf16, 4.8 TB/s).
POLICY = ModelSizes(
    policy_params=7_600_000_000, reward_params=7_600_000_000, weight_bytes=2, train_bytes=16,
    kv_bytes_per_token=2 * 28 * 4 * 128 * 2,  # K and V, 28 layers, 4 KV heads of 128, bf16: 57 KB
    activation_bytes_per_token=100_000,  # activation checkpointing: a layer input per layer, and the logits' share
)  # fmt: skip
GPU_MEMORY = 141 * GIB
DECODE_LATENCY_S = 0.008
"""One decoding step of a lone sequence: 15 GB of weights read at 4.8 TB/s, plus kernel launches and sampling."""
DECODE_PER_SEQ_S = 55e-6
"""Added per sequence in the batch: 2 x 7.6 GFLOP at half of peak, plus its KV reads (2k tokens x 57 KB)."""
BATCH = 128
"""Sequences one engine decodes at once (its KV cache at 8,704 tokens each fills ~64 GB)."""
TRAIN_TOKEN_S = 6 * 7.6e9 / (989e12 * 0.4)
"""GPU-seconds per trained token: 6 x params FLOPs at 40% MFU."""
TRAIN_FIXED_S = 3.0
"""Per step beyond the tokens: the optimizer step, collectives' latency, Python."""
WEIGHT_SYNC_S = 2.0
"""Pushing 15 GB of bf16 weights to the generator engines (NCCL broadcast, ~10 GB/s effective, plus the load)."""
TO_ROLLOUT_S = 9.1 * 7.6 / 5
"""verl's switch of a device to rollout (9.1 s for a 5B model), scaled by parameters."""
TO_TRAIN_S = 3.3 * 7.6 / 5
"""verl's switch back to training (3.3 s for 5B), scaled by parameters."""
SWITCH_S = TO_ROLLOUT_S + TO_TRAIN_S
"""colocated and partial pay both switches every step."""
RESTART_S = 30.0
"""A trainer group's restart: processes, CUDA and NCCL initialisation, the model's construction."""
CHECKPOINT_BYTES_PER_S = 2e9
"""One rank's checkpoint write or read (local NVMe)."""
JUDGE_TOKENS = 256
"""Tokens a generative judge writes per verdict."""
PROMPT_TOKENS = 512
MAX_NEW_TOKENS = 8192
GROUP_SIZE = 16
SIGMA = 0.8
"""Log-normal sigma of completion lengths: the p90 is ~2.8x the median, the longest ~10x."""


def decode_step_s(batch: int | np.ndarray) -> np.ndarray | float:
    return DECODE_LATENCY_S + batch * DECODE_PER_SEQ_S


def judge_sample_s(length: float) -> float:
    """GPU-seconds per verdict at full batch: the prefill of prompt + completion at half of
    peak, and JUDGE_TOKENS decoded at full batch."""
    prefill = 2 * POLICY.reward_params * (PROMPT_TOKENS + length) / (989e12 * 0.5)
    return prefill + JUDGE_TOKENS * float(decode_step_s(BATCH)) / BATCH


def train_efficiency(n: int) -> float:
    return 1.0 / (1.0 + 0.03 * math.log2(max(1, n)))


@dataclass(frozen=True, kw_only=True)
class Drift:
    """How one workload moves over the run: values at a fraction x in [0, 1] of its steps."""

    name: str
    length_mean: tuple[float, float]
    """Mean completion tokens at the first and the last step (linear in between)."""
    acceptance: tuple[float, float]
    judge: tuple[float, ...] = ()
    """The judge's cost multiplier in equal phases of the run (empty: rule rewards, no judge engines)."""

    def at(self, x: float) -> tuple[float, float, float]:
        """(mean length, acceptance, judge multiplier) at run fraction ``x``."""
        mean = self.length_mean[0] + x * (self.length_mean[1] - self.length_mean[0])
        acc = self.acceptance[0] + x * (self.acceptance[1] - self.acceptance[0])
        judge = self.judge[min(len(self.judge) - 1, int(x * len(self.judge)))] if self.judge else 0.0
        return mean, acc, judge


WORKLOADS = {
    "growing": Drift(name="growing", length_mean=(1000, 5000), acceptance=(0.8, 0.8)),
    "acceptance": Drift(name="acceptance", length_mean=(2000, 2000), acceptance=(1.0, 0.25)),
    "judge": Drift(name="judge", length_mean=(1500, 1500), acceptance=(0.8, 0.8), judge=(0.25, 3.0, 0.5)),
}


@dataclass(frozen=True, kw_only=True)
class Options:
    """What to simulate (``--set KEY=VALUE``; ``--quick``: fewer sizes and steps)."""

    sizes: list[int] = field(default_factory=lambda: [64, 1024])
    """Cluster sizes (GPUs) of the main table."""
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    steps: int = 60
    scaling_sizes: list[int] = field(default_factory=lambda: [8, 16, 32, 64, 128, 256, 512, 1024])
    """GPUs of the throughput-vs-size sweep (on the ``acceptance`` workload); [] skips it."""
    seed: int = 0
    calibration: bool = True
    """Run the default job here in two layouts and check the calibrated planner's predictions."""
    calibration_steps: int = 40
    live: bool = True
    """Run examples/adaptive_judge.yaml here, re-planned and pinned, with its judge turning slow."""
    live_repeats: int = 1

    def __post_init__(self) -> None:
        require(self.live_repeats >= 1, "live_repeats", f"must be >= 1 (got {self.live_repeats})")
        require(all(s >= 8 for s in self.sizes), "sizes", f"must all be >= 8 GPUs (got {self.sizes})")
        require(all(s >= 8 for s in self.scaling_sizes), "scaling_sizes", f"must all be >= 8 GPUs (got {self.scaling_sizes})")
        unknown = [w for w in self.workloads if w not in WORKLOADS]
        require(not unknown, "workloads", f"unknown {unknown}; known: {sorted(WORKLOADS)}")
        require(self.steps >= 6, "steps", f"must be >= 6 (got {self.steps})")
        require(self.calibration_steps >= 6, "calibration_steps", f"must be >= 6 (got {self.calibration_steps})")


QUICK: dict[str, object] = {"sizes": [16], "steps": 12, "scaling_sizes": [], "calibration": False, "live": False}


# ---------------------------------------------------------------------------- the world


@dataclass(frozen=True)
class StepDraw:
    """One step's requests (shared by every layout)."""

    lengths: np.ndarray
    """[S] completion tokens of every generated sample."""
    acceptance: float
    judge: float
    """The judge's GPU-seconds per sample at full batch (0: no judge)."""
    noise: float
    """Multiplier of the step's training and judging time (5% log-normal)."""


class World:
    """One workload on one cluster size: the draws, and the simulation of any plan's step."""

    def __init__(self, drift: Drift, gpus: int, steps: int, seed: int) -> None:
        self.drift, self.gpus, self.steps = drift, gpus, steps
        self.groups = gpus  # one prompt per GPU per step, a group of 16 each: 16 accepted samples per GPU
        self.accepted = self.groups * GROUP_SIZE
        self.cluster = gpu_cluster([int(GPU_MEMORY)] * gpus, list(range(8 * gpus)), peak_flops=989e12)
        self.workload = Workload(groups_per_step=self.groups, group_size=GROUP_SIZE, max_staleness=1,
                                 max_new_tokens=MAX_NEW_TOKENS, prompt_tokens=PROMPT_TOKENS,
                                 micro_batches_per_step=4, max_batch_sequences=BATCH)
        self.draws = [self._draw(k, np.random.default_rng([seed, gpus, k])) for k in range(steps)]
        self._sync: dict[tuple[int, int], tuple[float, float, float]] = {}
        self.reshard_s = RESTART_S + 2 * POLICY.policy_params * POLICY.train_bytes / (gpus / 2 * CHECKPOINT_BYTES_PER_S)

    def _draw(self, k: int, rng: np.random.Generator) -> StepDraw:
        mean, acc, judge = self.drift.at(k / max(1, self.steps - 1))
        groups = math.ceil(self.groups / acc)
        mu = math.log(mean) - SIGMA**2 / 2
        lengths = np.clip(rng.lognormal(mu, SIGMA, groups * GROUP_SIZE), 16, MAX_NEW_TOKENS).astype(np.int64)
        return StepDraw(lengths=lengths, acceptance=self.groups / groups,
                        judge=judge * judge_sample_s(mean), noise=float(rng.lognormal(0.0, 0.05)))

    def roles(self) -> Roles:
        judged = bool(self.drift.judge)
        return Roles(trainers=self.gpus // 2, generators=self.gpus // 2, rewards=max(1, self.gpus // 8) if judged else 4,
                     controllers=4, reward_engines=judged)

    # -- generation

    def sync_pool(self, k: int, engines: int) -> tuple[float, float, float]:
        """(makespan, time 90% of samples were done, mean engine busy seconds) of ``engines``
        decoding step k's requests, each engine event by event."""
        key = (k, engines)
        if key not in self._sync:
            self._sync[key] = _sync_pool(self.draws[k].lengths, engines)
        return self._sync[key]

    def async_pool(self, k: int, engines: int) -> float:
        """Seconds for ``engines`` kept at full occupancy (two steps of requests queued) to
        produce step k's tokens: the busiest engine's tokens x the decoding step / its batch."""
        lengths = self.draws[k].lengths
        per = _split(lengths, engines)
        b = np.minimum(BATCH, 2 * np.count_nonzero(per, axis=1))
        return float(np.max(per.sum(axis=1) * decode_step_s(b) / np.maximum(b, 1)))

    # -- one step of a plan

    def step(self, plan: Plan, k: int) -> tuple[float, StepTimes, dict[str, float]]:
        """(seconds, what the roles measured, idle share per pool) of plan ``plan`` at step k."""
        d = self.draws[k]
        n = pools(plan)
        n_gen = n["generate"]
        makespan, t90, busy = self.sync_pool(k, n_gen)
        samples = len(d.lengths)
        judge = d.judge * samples / n["reward"] * d.noise if n["reward"] and d.judge else 0.0
        judge_end = max(judge, makespan + JUDGE_TOKENS * DECODE_LATENCY_S) if judge else 0.0
        mean_len = float(d.lengths.mean())
        train_tokens = self.accepted * (PROMPT_TOKENS + mean_len)
        train = (TRAIN_FIXED_S + train_tokens * TRAIN_TOKEN_S / (n["train"] * train_efficiency(n["train"]))) * d.noise
        sync = switch = 0.0
        if plan.layout == "colocated":
            switch = SWITCH_S
            step = makespan + judge + switch + train
            gen_s = makespan
        elif plan.layout == "partial":
            switch, sync = SWITCH_S, WEIGHT_SYNC_S
            step = max(makespan, judge_end) + switch + train + sync
            gen_s = makespan
        else:
            sync = WEIGHT_SYNC_S
            gen_s = self.async_pool(k, n_gen)
            busy = gen_s
            step = max(gen_s, judge, train + sync)
        tail = makespan - t90
        times = StepTimes(
            generate_s=gen_s - tail if plan.layout != "disaggregated" else gen_s, tail_s=tail, reward_s=judge,
            train_s=train, weight_sync_s=sync, switch_s=switch, completion_mean=mean_len,
            completion_p90=float(np.quantile(d.lengths, 0.9)), acceptance=d.acceptance,
        )
        if plan.layout == "colocated":
            idle = {"all": 1 - (busy + train + judge * n["reward"] / self.gpus) / step}
        elif plan.layout == "partial":
            idle = {"generate": 1 - (busy + train) / step, "train": 1 - train / step}
            if n["reward"]:
                idle["reward"] = 1 - (judge + train) / step
        else:
            idle = {"generate": 1 - busy / step, "train": 1 - train / step}
            if n["reward"]:
                idle["reward"] = 1 - judge / step
        return step, times, idle

    def true_costs(self, k: int) -> StageCosts:
        """The costs of step k in the planner's terms (what a short calibration run would measure)."""
        d = self.draws[k]
        return StageCosts(
            gen_token_s=float(decode_step_s(BATCH)) / BATCH, gen_latency_s=float(decode_step_s(1)),
            completion_mean=float(d.lengths.mean()), completion_p90=float(np.quantile(d.lengths, 0.9)),
            acceptance=d.acceptance, reward_s=d.judge, train_token_s=TRAIN_TOKEN_S, train_fixed_s=TRAIN_FIXED_S,
            weight_sync_s=WEIGHT_SYNC_S, switch_s=SWITCH_S, gen_scaling=1.0, train_scaling=0.9,
        )

    def switch_costs(self) -> SwitchCosts:
        return SwitchCosts(to_rollout_s=TO_ROLLOUT_S, to_train_s=TO_TRAIN_S, reshard_s=self.reshard_s)


def _split(lengths: np.ndarray, engines: int) -> np.ndarray:
    """[engines, ceil(S / engines)]: the requests dealt round-robin (the draw is in random
    order), zero-padded."""
    per = math.ceil(len(lengths) / engines)
    padded = np.zeros(per * engines, dtype=np.int64)
    padded[: len(lengths)] = lengths
    return padded.reshape(per, engines).T


def _sync_pool(lengths: np.ndarray, engines: int) -> tuple[float, float, float]:
    per = _split(lengths, engines)
    if per.shape[1] <= BATCH:  # every request in flight from the start: the batch only thins out
        s = np.sort(per, axis=1)
        phases = np.diff(s, axis=1, prepend=0) * decode_step_s(per.shape[1] - np.arange(per.shape[1]))
        done = np.cumsum(phases, axis=1)[s > 0]
        busy = float(np.cumsum(phases, axis=1)[:, -1].mean())
    else:
        finished = [_engine(row[row > 0]) for row in per]
        done = np.concatenate(finished)
        busy = float(np.mean([f.max() for f in finished]))
    return float(done.max()), float(np.quantile(done, 0.9)), busy


def _engine(lengths: np.ndarray) -> np.ndarray:
    """Completion times of one engine's requests, FIFO with at most BATCH in flight: all in
    flight decode in lockstep, so a request finishes when the engine's decoding-step count
    reaches its start count plus its length."""
    queue = iter(lengths.tolist())
    active: list[int] = []
    for _ in range(min(BATCH, len(lengths))):
        heapq.heappush(active, next(queue))
    decoded, now, out = 0, 0.0, []
    while active:
        until = active[0]
        now += (until - decoded) * float(decode_step_s(len(active)))
        decoded = until
        while active and active[0] == until:
            heapq.heappop(active)
            out.append(now)
            nxt = next(queue, None)
            if nxt is not None:
                heapq.heappush(active, decoded + nxt)
    return np.asarray(out)


# ---------------------------------------------------------------------------- the runs


@dataclass
class Run:
    """One layout policy over a whole workload."""

    label: str
    step_s: list[float] = field(default_factory=list)
    idle: list[float] = field(default_factory=list)
    """Slot-weighted idle share of the whole cluster, per step."""
    idle_by_pool: dict[str, list[float]] = field(default_factory=dict)
    switch_s: float = 0.0
    changes: list[str] = field(default_factory=list)
    plans: list[str] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return sum(self.step_s) + self.switch_s


def describe_plan(plan: Plan) -> str:
    n = pools(plan)
    parts = [f"{k} {v}" for k, v in n.items() if v]
    return f"{plan.layout} ({', '.join(parts)})"


def simulate(world: World, plan: Plan, label: str) -> Run:
    run = Run(label=label)
    for k in range(world.steps):
        _record(world, run, plan, k)
    return run


def _record(world: World, run: Run, plan: Plan, k: int) -> StepTimes:
    step, times, idle = world.step(plan, k)
    run.step_s.append(step)
    n = pools(plan)
    weights = {"all": world.gpus, "generate": n["generate"], "reward": n["reward"],
               "train": n["train"] if plan.layout == "disaggregated" else world.gpus - n["generate"] - n["reward"]}
    run.idle.append(sum(idle[p] * weights[p] for p in idle) / sum(weights[p] for p in idle))
    for pool, share in idle.items():
        run.idle_by_pool.setdefault(pool, []).append(share)
    run.plans.append(describe_plan(plan))
    return times


def static_plans(world: World) -> list[Plan]:
    """Every layout with every split of the slots on the planner's ladder (generators, and
    judge engines when there is a judge), less those the planner predicts at over twice the
    best step time both at the first and at the last step (with the true costs of each):
    a plan that slow at both ends cannot be the best in hindsight, and simulating it at
    1024 GPUs (a few engines decoding thousands of requests each) takes most of the time."""
    roles = world.roles()
    n = world.gpus
    judge_counts = ladder(n // 2) if roles.reward_engines else [roles.rewards]
    plans: list[Plan] = []
    for r in judge_counts:
        options: list[tuple[Layout, Roles]] = [("colocated", replace(roles, trainers=n, generators=n, rewards=r))]
        free = n - (r if roles.reward_engines else 0)
        options += [("partial", replace(roles, trainers=n, generators=g, rewards=r)) for g in ladder(free - 1)]
        options += [("disaggregated", replace(roles, generators=g, trainers=free - g, rewards=r)) for g in ladder(free - 1)]
        for layout, option in options:
            try:
                plans.append(assign(layout, world.cluster, option))
            except LayoutError:
                continue
    ends = [world.true_costs(0), world.true_costs(world.steps - 1)]
    predicted = [[predict(p, world.cluster, POLICY, c, world.workload).step_s for c in ends] for p in plans]
    fastest = [min(col) for col in zip(*predicted, strict=True)]
    return [p for p, steps in zip(plans, predicted, strict=True) if any(s <= 2 * f for s, f in zip(steps, fastest, strict=True))]


def run_workload(world: World) -> dict[str, Run]:
    """Every policy on one world: the planner's step-0 split of each layout, the best static
    plan in hindsight, the per-step oracle (each step on its own best static plan, switching
    free: no policy can beat it), and adaptive."""
    costs0 = world.true_costs(0)
    cands = {c.layout: c for c in candidates(world.cluster, POLICY, costs0, world.workload, world.roles(), search=True)}
    runs: dict[str, Run] = {}
    for layout in LAYOUTS:
        c = cands[layout]
        if c.plan is not None and not c.refused:
            runs[layout] = simulate(world, c.plan, layout)
    start = min((c for c in cands.values() if c.prediction and not c.refused),
                key=lambda c: c.prediction.step_s if c.prediction else math.inf)
    assert start.plan is not None
    statics = [simulate(world, p, "best static (hindsight)") for p in static_plans(world)]
    runs["hindsight"] = min(statics, key=lambda r: r.wall_s)
    oracle = Run(label="per-step oracle")  # the best static plan of each step, switching free: a bound
    for k in range(world.steps):
        pick = min(statics, key=lambda r: r.step_s[k])
        oracle.step_s.append(pick.step_s[k])
        oracle.idle.append(pick.idle[k])
        oracle.plans.append(pick.plans[k])
    runs["oracle"] = oracle
    runs["adaptive"] = adaptive(world, start.plan, costs0)
    return runs


def adaptive(world: World, plan: Plan, costs: StageCosts) -> Run:
    """The replanner in the loop: each step measured, the next step's plan decided; a change
    pays its switch cost at the boundary."""
    replanner = Replanner(plan, cluster=world.cluster, sizes=POLICY, costs=costs, workload=world.workload,
                          switch=world.switch_costs())
    run = Run(label="adaptive")
    for k in range(world.steps):
        times = _record(world, run, replanner.plan, k)
        before = replanner.plan
        decision = replanner.observe(k, times, steps_left=world.steps - k - 1)
        if decision.changed:
            assert decision.best is not None
            run.switch_s += decision.best.switch_s
            run.changes.append(f"after step {k}: {describe_plan(before)} -> {describe_plan(decision.plan)}; {decision.reason}")
    return run


@cache
def _world(workload: str, gpus: int, steps: int, seed: int) -> World:
    return World(WORKLOADS[workload], gpus, steps, seed)


def run(*, quick: bool = False, options: Mapping[str, object] | None = None) -> Result:
    opts = build(Options, {**(QUICK if quick else {}), **(options or {})})
    result = Result()
    f, r = result.figures, result.ratios
    started = time.perf_counter()
    for name in opts.workloads:
        for gpus in opts.sizes:
            world = _world(name, gpus, opts.steps, opts.seed)
            runs = run_workload(world)
            tag = f"{name}_{gpus}gpu"
            for key, rn in runs.items():
                f[f"{tag}_{key}_step_s"] = rn.wall_s / world.steps
                f[f"{tag}_{key}_samples_per_s"] = world.accepted * world.steps / rn.wall_s
                f[f"{tag}_{key}_idle_share"] = statistics.fmean(rn.idle)
                for pool, shares in rn.idle_by_pool.items():
                    f[f"{tag}_{key}_idle_{pool}"] = statistics.fmean(shares)
            f[f"{tag}_adaptive_changes"] = len(runs["adaptive"].changes)
            f[f"{tag}_adaptive_switch_s"] = runs["adaptive"].switch_s
            r[f"{tag}_adaptive_vs_best_static"] = runs["adaptive"].wall_s / runs["hindsight"].wall_s
            for layout in LAYOUTS:
                if layout in runs:
                    r[f"{tag}_adaptive_vs_{layout}"] = runs["adaptive"].wall_s / runs[layout].wall_s
            makespan, t90, _ = world.sync_pool(world.steps - 1, gpus)  # colocated: every GPU generates
            f[f"{tag}_last_10pct_share_of_rollout"] = (makespan - t90) / makespan
            result.notes.append(f"{tag}: best static in hindsight {runs['hindsight'].plans[0]}; adaptive started "
                                f"{runs['adaptive'].plans[0]}, ended {runs['adaptive'].plans[-1]}")
            result.notes += [f"{tag}: {c}" for c in runs["adaptive"].changes]
            if gpus == 64 or gpus == opts.sizes[0]:
                result.plots[f"idle_{name}_{gpus}"] = LinePlot(
                    title=f"{name}, {gpus} GPUs: idle share of the cluster per step", xlabel="step",
                    ylabel="idle share", series=[Series(label=k, x=list(range(world.steps)), y=rn.idle)
                                                 for k, rn in runs.items()])
    if opts.scaling_sizes:
        series: dict[str, Series] = {}
        for gpus in opts.scaling_sizes:
            runs = run_workload(_world("acceptance", gpus, opts.steps, opts.seed))
            for key, rn in runs.items():
                s = series.setdefault(key, Series(label=key, x=[], y=[]))
                s.x.append(gpus)
                s.y.append(gpus * GROUP_SIZE * opts.steps / rn.wall_s / gpus)
                f[f"scaling_{gpus}gpu_{key}_samples_per_s_per_gpu"] = s.y[-1]
        result.plots["throughput"] = LinePlot(title="acceptance workload: samples/s per GPU vs cluster size",
                                              xlabel="GPUs", ylabel="accepted samples/s per GPU",
                                              series=list(series.values()), logx=True)
    f["simulation_wall_s"] = time.perf_counter() - started
    if opts.calibration:
        calibration(result, opts.calibration_steps)
    if opts.live:
        live(result, opts.live_repeats)
    return result


LIVE_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "adaptive_judge.yaml"
LIVE_SLOW = "150:0.15"
"""The judge's shift in the live runs: 0.15 s more per group once 150 groups are judged."""


def live(result: Result, repeats: int) -> None:
    """``LIVE_EXAMPLE`` re-planned and pinned, interleaved, its judge turning slow mid-run."""

    from benchmarks.faults import audit, training_prompts
    from benchmarks.jobs import run_yatt
    from launch.config import load_run_config
    from workers.reward.worker import SLOW_ENV

    f, r = result.figures, result.ratios
    seed = load_run_config(LIVE_EXAMPLE).run.seed
    walls: dict[str, list[float]] = {"adaptive": [], "pinned": []}
    change_at = 0
    with tempfile.TemporaryDirectory(prefix="yatt-live-") as scratch:
        for k in range(repeats):
            for mode in walls:
                run_dir = Path(scratch) / f"{mode}-{k}"
                job = run_yatt([str(LIVE_EXAMPLE), f"placement.adaptive={mode == 'adaptive'}"], run_dir,
                               timeout_s=900.0, env={SLOW_ENV: LIVE_SLOW})
                walls[mode].append(job.wall_s)
                tag = f"live_{mode}_{k}"
                steps = [m["time/step_s"] for m in job.metrics]
                f[f"{tag}_wall_s"] = job.wall_s
                f[f"{tag}_training_s"] = sum(steps)
                evals = read_jsonl(run_dir / names.EVAL)
                f[f"{tag}_accuracy_first"] = evals[0]["eval/reward/accuracy"]
                f[f"{tag}_accuracy_last"] = evals[-1]["eval/reward/accuracy"]
                out = audit(run_dir, seed, training_prompts(run_dir), job.wall_s, finished=True)  # run_yatt raises otherwise
                f[f"{tag}_groups_lost"], f[f"{tag}_groups_duplicated"] = float(out.lost), float(out.duplicated)
                decisions = read_jsonl(run_dir / names.PLACEMENT)
                changed = [int(d["step"]) for d in decisions if d["placement/changed"]]
                f[f"{tag}_changes"] = float(len(changed))
                if mode == "adaptive":
                    result.notes += [f"{tag}: {d['reason']}" for d in decisions if d["placement/changed"]]
                    change_at = changed[0] if changed else len(steps) - 1
                # from 4 steps after the adaptive run's change (its new judge started), in both runs
                f[f"{tag}_median_step_after_change_s"] = statistics.median(steps[min(change_at + 4, len(steps) - 1):])
    r["live_adaptive_vs_pinned_wall"] = statistics.fmean(walls["adaptive"]) / statistics.fmean(walls["pinned"])
    r["live_adaptive_vs_pinned_training"] = (
        statistics.fmean(f[f"live_adaptive_{k}_training_s"] for k in range(repeats))
        / statistics.fmean(f[f"live_pinned_{k}_training_s"] for k in range(repeats))
    )


CALIBRATION_LAYOUTS = ("colocated", "disaggregated")


def calibration(result: Result, steps: int) -> None:
    """The default job in each of ``CALIBRATION_LAYOUTS`` here; each run calibrates the
    planner, which predicts both runs' median step (steps 2 .. n-2: warm-up and the final
    checkpoint left out)."""
    from benchmarks.jobs import run_yatt
    from launch.config import load_run_config
    from launch.placement.inputs import plan_for_run, run_costs, this_machine

    overrides = [f"run.steps={steps}", "trainer.checkpoint_every=0"]
    with tempfile.TemporaryDirectory(prefix="yatt-placement-") as scratch:
        measured: dict[str, float] = {}
        configs = {}
        for layout in CALIBRATION_LAYOUTS:
            items = [*overrides, f"placement.layout={layout}"]
            job = run_yatt(items, Path(scratch) / layout, timeout_s=900.0)
            measured[layout] = statistics.median(m["time/step_s"] for m in job.metrics[2:-2])
            configs[layout] = load_run_config(None, items)
        cluster = this_machine(dtype=configs["colocated"].model.dtype)
        for source in CALIBRATION_LAYOUTS:
            costs = run_costs(configs[source], cluster, Path(scratch) / source)
            for target in CALIBRATION_LAYOUTS:
                predicted = plan_for_run(configs[target], cluster, costs, layout=target).predicted_step_s
                tag = f"calibration_from_{source}_{target}"
                result.figures[f"{tag}_predicted_step_s"] = predicted
                result.figures[f"{tag}_measured_step_s"] = measured[target]
                result.ratios[f"{tag}_predicted_vs_measured"] = predicted / measured[target]

