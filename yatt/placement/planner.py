"""The planner: predict each layout's step time from stage costs, refuse what does not fit
in memory, and pick the fastest.

It is a pure function of its inputs (cluster spec, model sizes, stage costs, workload):
no I/O, no launcher or worker import, and fast (milliseconds per candidate at 1024
slots), because the same code runs in a cluster simulator and, later, re-plans at
run time from the stage times measured each step. ``yatt.placement.costs`` gives its
inputs: model sizes from a config.json, costs estimated from FLOPs or calibrated by a run.

Cost model, per training step (seconds; ``n_g``, ``n_r``, ``n_t``: slots of the
generators, the reward engines and the trainer ranks)::

    S      = groups_per_step * group_size / acceptance      samples generated
    N_gen  = S * L_mean                                      tokens generated
    N_train = groups_per_step * group_size * (P / s + L_mean)  tokens trained (P: prompt, computed once
                                                              for s samples: a group's when shared)
    k(n, e) = 1 + (n - 1) * e                                speedup of n slots, scaling efficiency e
    k(n, e; m) = k(m, e) * k(n / m, e_thr)                    n slots as m processes of n / m slots each
                                                              (CPU, thread_scaling e_thr measured: one
                                                              process's threads over its cores)
    b      = min(max_batch_sequences, S * q / n_g)           sequences a generating slot decodes at once
                                                              (q = 2 when it runs a step ahead, else 1)
    c(b)   = (gen_latency_s - p) / b + p                     slot-seconds per token at b (p: the part per
                                                              sequence, from gen_token_s at a full batch)
    G      = N_gen * c(b) / k(n_g, gen_scaling)              generation while the batch is full
    tail   = (L_p90 - L_mean) * gen_latency_s                the longest samples decode alone
    W      = S * reward_s / k(n_r, gen_scaling)              reward engines (model or judge)
           = S * reward_s / reward processes                 rule scorers (unpinned, overlap G)
    E      = S * env_s / cores                               environments in the env role's processes
                                                              (CPU seconds spread over the machine's cores):
                                                              added to the step on a CPU machine (they take
                                                              the cores the compute roles use), overlapped on
                                                              a GPU machine (its host cores): step = max(step, E)
    T      = train_fixed_s + N_train * train_token_s / k(n_t, train_scaling; ranks)
             + collective_s * 2 (ranks - 1) / ranks          FSDP's all-gathers and reduce-scatters
                                                              (CPU: gloo; 0 with one rank)

    colocated      max(G + tail (+ W of engines, which share the slots), W of rule scorers)
                   + switch_s + T
    partial        max(G + tail, W) + switch_s + T + weight_sync_s
    disaggregated  max(G, W, T + weight_sync_s)               max_staleness >= 1 (tail hidden)
                   max(G + tail, W) + T + weight_sync_s       on-policy
      unpinned     (G + W + T) / contention + weight_sync_s   max_staleness >= 1, on a CPU machine
                                                              with fewer cores than compute
                                                              processes: all share every core
                   (max(G + tail, W) + T) / contention        on-policy (they take turns; the
                   + weight_sync_s                            idle ones still contend)

A slot's idle share is 1 - (seconds its roles compute) / step; switching, weight sync and
the tail count as idle.

Memory per slot (bytes), refused when over the slot's memory::

    trainer rank   (policy + critic) * train_bytes + reference * weight_bytes, / ranks (FSDP shards)
                   + activations: its micro-batch's tokens * activation_bytes_per_token
    engine         policy * weight_bytes + KV: kv_bytes_per_token * (P + max_new_tokens)
                   * sequences in flight (min(S / engines, max_batch_sequences)),
                   at least engine_reserve_share of the slot (vLLM preallocates its KV cache)
    reward engine  reward * weight_bytes
    peak           resident + max(KV, activations) where generation and training take turns
                   (colocated, partial), resident + KV + activations otherwise

A role spanning several slots spreads its memory evenly over them; unpinned compute roles
spread theirs over every slot (they share the machine's memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from yatt.errors import ConfigError, LayoutError
from yatt.placement.layouts import Roles, assign
from yatt.placement.plan import LAYOUTS, Assignment, ClusterSpec, Layout, Plan

GIB = float(1 << 30)


@dataclass(frozen=True, kw_only=True)
class ModelSizes:
    """What the models of a run weigh, per parameter and per token."""

    policy_params: int
    """Parameters of the policy (trained, and served by every generator engine)."""
    reference_params: int = 0
    """Parameters of the frozen reference model held by the trainer ranks (0: none)."""
    critic_params: int = 0
    """Parameters of the trained critic (PPO with GAE; 0: none)."""
    reward_params: int = 0
    """Parameters of a reward model or judge engine (0: rule-based scorers)."""
    weight_bytes: int = 2
    """Bytes per parameter of weights (2: bf16, 4: float32)."""
    train_bytes: int = 16
    """Bytes per trained parameter a trainer holds: float32 master weights, gradients and AdamW's two moments."""
    kv_bytes_per_token: int = 0
    """KV cache bytes per token of one sequence (all layers)."""
    activation_bytes_per_token: int = 0
    """Training activations kept for backward, bytes per token (all layers, plus the logits)."""


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """Measured or estimated cost of each stage, normalised to one slot."""

    gen_token_s: float
    """Slot-seconds per generated token when one slot decodes a full batch of ``max_batch_sequences``
    (1 / its tokens/s); fewer sequences in flight cost more per token (``gen_token_cost``)."""
    gen_latency_s: float
    """Seconds per decoding step of one sequence: the pace of the tail once the batch thins out."""
    completion_mean: float
    """Mean completion length, tokens."""
    completion_p90: float
    """90th percentile of the completion length, tokens (the tail a synchronous batch waits for)."""
    acceptance: float = 1.0
    """Share of generated groups dynamic sampling keeps (1 / acceptance samples per accepted one)."""
    reward_s: float = 0.0
    """Seconds per sample of one reward worker (a reward engine's slot, or one rule-scoring process)."""
    env_s: float = 0.0
    """CPU seconds per sample of its episode's environment in the env role (every turn's step;
    0 without episodes, or with ``env.inline``); measured at run time (``env/cpu_s``)."""
    train_token_s: float
    """Slot-seconds per trained token: forward, backward and the optimizer's share."""
    train_fixed_s: float = 0.0
    """Seconds per training step that do not shrink with slots or tokens (optimizer step, collectives' latency)."""
    weight_sync_s: float = 0.0
    """Seconds to push a new policy version to the generator engines over the transport."""
    switch_s: float = 0.0
    """Seconds per step to switch a slot from generation to training and back (engine sleep/wake,
    in-process weight load)."""
    gen_scaling: float = 0.9
    """Scaling efficiency of generation across slots (each added slot adds this share of one)."""
    train_scaling: float = 0.85
    """Scaling efficiency of FSDP training across slots (all-gathers and reduce-scatters)."""
    contention: float = 0.8
    """Share of the cores that unpinned compute processes running at once get (scheduler and cache contention)."""
    thread_scaling: float | None = None
    """Scaling efficiency of one trainer rank's threads over the cores of its slots (each added
    core adds this share of one), measured on a CPU on the model's layer; None: a process
    spanning n slots counts as n slots at the stage's scaling (one process per GPU)."""
    gen_thread_scaling: float | None = None
    """``thread_scaling`` of a generator engine's threads (a decoding step's small products)."""
    collective_s: float = 0.0
    """Seconds per step of a 2-rank trainer group's FSDP collectives (parameter all-gathers,
    gradient reduce-scatters) beyond what ``train_scaling`` covers: CPU ranks over gloo; 0
    with one rank, 2 (r - 1) / r of it with r ranks."""

    def __post_init__(self) -> None:
        assert 0 < self.acceptance <= 1, f"acceptance must be in (0, 1] (got {self.acceptance})"
        assert self.completion_p90 >= 0 and self.completion_mean >= 0


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one training step asks for (from the buffer and controller configs)."""

    groups_per_step: int
    """Accepted groups per step (buffer.groups_per_step)."""
    group_size: int
    """Samples per group (buffer.group_size)."""
    max_staleness: int = 0
    """buffer.max_staleness: >= 1 lets generation of step k+1 overlap training of step k."""
    max_new_tokens: int
    """Longest completion (controller.max_new_tokens): sizes the KV cache."""
    prompt_tokens: float = 64.0
    """Mean prompt length in tokens (trained over, and held in the KV cache)."""
    prompt_shared_by: int = 1
    """Samples whose prompt the trainer computes once (trainer.share_prompt: a group's; 1: each its own)."""
    micro_batches_per_step: int = 1
    """Micro-batches each trainer rank gets per step (buffer.micro_batches_per_step)."""
    max_batch_sequences: int = 256
    """Most sequences one engine decodes at once (its KV cache holds this many)."""
    engine_reserve_share: float = 0.0
    """Share of its slots' memory an engine takes up front whatever it needs (vLLM's
    gpu_memory_utilization on GPU; 0: weights and KV only)."""


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What the cost model predicts of one plan."""

    step_s: float
    """Seconds per training step."""
    idle_share: dict[int, float]
    """Share of a step each slot sits idle, by slot index."""
    stages: dict[str, float]
    """Seconds of each stage in a step: generate, tail, reward, train, weight_sync, switch."""
    memory_bytes: dict[int, int]
    """Peak bytes each slot holds, by slot index."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One layout as the planner sees it: its plan and prediction, or why it was refused."""

    layout: Layout
    plan: Plan | None
    """The assignments (None when the layout cannot be placed)."""
    prediction: Prediction | None
    """The predicted step (None when the layout cannot be placed)."""
    refused: str = ""
    """Why the layout was refused (cannot be placed, or a slot's memory is short); empty: usable."""


def speedup(slots: float, scaling: float) -> float:
    """k(n, e) = 1 + (n - 1) * e: the throughput of n slots in units of one."""
    return 1.0 + (slots - 1) * scaling if slots >= 1 else 0.0


def pool_speedup(slots: int, processes: int, scaling: float, thread_scaling: float | None) -> float:
    """The throughput of ``slots`` slots computed on by ``processes`` processes (0: one per
    slot), in units of one slot: k(m, e) * k(n / m, e_thr) when the thread scaling is known
    and a process spans several slots, else k(n, e)."""
    if thread_scaling is None or processes <= 0 or processes >= slots:
        return speedup(slots, scaling)
    return speedup(processes, scaling) * speedup(slots / processes, thread_scaling)


def collective_time(costs: StageCosts, ranks: int) -> float:
    """Seconds per step of a ``ranks``-rank group's collectives beyond ``train_scaling``
    (``collective_s`` is a 2-rank group's; a ring moves 2 (r - 1) / r of the bytes)."""
    return costs.collective_s * 2.0 * (ranks - 1) / ranks if ranks > 1 else 0.0


def gen_token_cost(costs: StageCosts, workload: Workload, in_flight: float) -> float:
    """Slot-seconds per generated token when a slot decodes ``in_flight`` sequences at once: a
    decoding step costs a fixed part (the weights read once) plus a part per sequence, so a
    thin batch pays the fixed part over fewer tokens. ``gen_latency_s`` is the step of one
    sequence, ``gen_token_s`` x ``max_batch_sequences`` the step of a full batch."""
    full = workload.max_batch_sequences
    if full <= 1:
        return costs.gen_token_s
    batch = min(float(full), max(1.0, in_flight))
    per_seq = max(0.0, (costs.gen_token_s * full - costs.gen_latency_s) / (full - 1))
    return max(0.0, costs.gen_latency_s - per_seq) / batch + per_seq


def with_gen_cost(costs: StageCosts, workload: Workload, in_flight: float, measured: float) -> StageCosts:
    """``costs`` with ``gen_token_s`` set so that ``gen_token_cost`` at ``in_flight`` is ``measured``
    (``gen_latency_s`` kept); both scaled together when no ``gen_token_s`` can (a batch of one,
    or generation faster than the latency allows)."""
    full = workload.max_batch_sequences
    batch = min(float(full), max(1.0, in_flight))
    if batch > 1.0 and full > 1:
        per_seq = (measured - costs.gen_latency_s / batch) / (1.0 - 1.0 / batch)
        if per_seq >= 0.0 and costs.gen_latency_s >= per_seq:
            return replace(costs, gen_token_s=(costs.gen_latency_s + per_seq * (full - 1)) / full)
    now = gen_token_cost(costs, workload, in_flight)
    f = measured / now if now > 0 else 1.0
    return replace(costs, gen_token_s=costs.gen_token_s * f, gen_latency_s=costs.gen_latency_s * f)


def in_flight(costs: StageCosts, workload: Workload, gen_slots: int, steps: int = 1) -> float:
    """Sequences each generating slot holds at the start of a step (``steps`` > 1: the next
    step's requests queued too, as asynchronous generation keeps them)."""
    samples = workload.groups_per_step * workload.group_size / costs.acceptance
    return samples * steps / max(1, gen_slots)


def steps_in_flight(layout: Layout, workload: Workload) -> int:
    """Steps' worth of requests a generating slot holds (``q`` in the module docstring): 2 when
    generation runs a step ahead of training (disaggregated with ``max_staleness`` >= 1, so the
    next step's requests queue while this one trains), else 1."""
    return 2 if layout == "disaggregated" and workload.max_staleness >= 1 else 1


def stage_times(
    costs: StageCosts, workload: Workload, *, gen_slots: int, train_slots: int, queued_steps: int = 1,
    gen_processes: int = 0, train_ranks: int = 0,
) -> tuple[float, float, float]:
    """Seconds per step of generation at full batch (G), of its tail, and of training (T) on
    the given slot counts, computed on by ``gen_processes`` engines and ``train_ranks`` ranks
    (0: one per slot); ``queued_steps`` as ``steps_in_flight`` gives it (2: generation runs a
    step ahead)."""
    accepted = workload.groups_per_step * workload.group_size
    tokens = accepted / costs.acceptance * costs.completion_mean
    per_token = gen_token_cost(costs, workload, in_flight(costs, workload, gen_slots, queued_steps))
    gen = tokens * per_token / pool_speedup(gen_slots, gen_processes, costs.gen_scaling, costs.gen_thread_scaling)
    tail = max(0.0, costs.completion_p90 - costs.completion_mean) * costs.gen_latency_s
    train_tokens = trained_tokens(workload, accepted, costs.completion_mean)
    train = (costs.train_fixed_s + collective_time(costs, train_ranks or train_slots)
             + train_tokens * costs.train_token_s
             / pool_speedup(train_slots, train_ranks, costs.train_scaling, costs.thread_scaling))
    return gen, tail, train


def trained_tokens(workload: Workload, samples: float, completion_mean: float) -> float:
    """Tokens the trainer computes for ``samples`` samples: their completions, and their prompts
    once per ``prompt_shared_by`` samples."""
    return samples * (workload.prompt_tokens / max(1, workload.prompt_shared_by) + completion_mean)


def engines_of(plan: Plan) -> list[Assignment]:
    """The plan's generator engines: the trainer ranks that host one (colocated), else the
    generator processes."""
    return [a for a in plan.of("trainer") if a.hosts_generator] or plan.of("generator")


def _slots_of(assignments: list[Assignment]) -> list[int]:
    return sorted({s for a in assignments for s in a.slots})


def predict(plan: Plan, cluster: ClusterSpec, sizes: ModelSizes, costs: StageCosts, workload: Workload) -> Prediction:
    """The step time, idle share and memory of every slot that ``plan`` is predicted to have
    (the formulas are in the module docstring)."""
    n = len(cluster.slots)
    every = list(range(n))
    trainers = plan.of("trainer")
    generators = engines_of(plan)
    engines = [a for a in plan.of("reward") if a.slots]
    rule_workers = len(plan.of("reward")) - len(engines)
    unpinned = any(not a.slots for a in trainers + generators)
    gen_slots = every if unpinned else _slots_of(generators)
    train_slots = every if unpinned else _slots_of(trainers)
    reward_slots = _slots_of(engines)

    samples = workload.groups_per_step * workload.group_size / costs.acceptance
    gen, tail, train = stage_times(costs, workload, gen_slots=len(gen_slots), train_slots=len(train_slots),
                                   queued_steps=steps_in_flight(plan.layout, workload),
                                   gen_processes=len(generators), train_ranks=len(trainers))
    engine_reward = samples * costs.reward_s / speedup(len(reward_slots), costs.gen_scaling) if engines else 0.0
    rule_reward = samples * costs.reward_s / rule_workers if rule_workers else 0.0
    sync = switch = 0.0
    busy = dict.fromkeys(every, 0.0)

    if plan.layout == "colocated":
        switch = costs.switch_s
        step = max(gen + tail + engine_reward, rule_reward) + switch + train
        for s in train_slots:
            busy[s] = gen + train
        for s in reward_slots:
            busy[s] += engine_reward
    elif plan.layout == "partial":
        switch, sync = costs.switch_s, costs.weight_sync_s
        step = max(gen + tail, engine_reward, rule_reward) + switch + train + sync
        for s in train_slots:
            busy[s] = train
        for s in gen_slots:
            busy[s] += gen
        for s in reward_slots:
            busy[s] += engine_reward
    elif unpinned:  # disaggregated on too few cores: every compute process shares every core
        sync = costs.weight_sync_s
        if workload.max_staleness >= 1:  # at once, contending for the cores
            step = max((gen + engine_reward + train) / costs.contention, rule_reward) + sync
        else:  # taking turns, yet the idle processes' threads still cost the running ones
            step = (max(gen + tail + engine_reward, rule_reward) + train) / costs.contention + sync
        busy = dict.fromkeys(every, gen + engine_reward + train)
    else:
        sync = costs.weight_sync_s
        if workload.max_staleness >= 1:
            step = max(gen, engine_reward, rule_reward, train + sync)
        else:
            step = max(gen + tail, engine_reward, rule_reward) + train + sync
        for s in gen_slots:
            busy[s] = gen
        for s in reward_slots:
            busy[s] = engine_reward
        for s in train_slots:
            busy[s] = train

    env = samples * costs.env_s / _cores_of(cluster) if plan.of("env") else 0.0
    step = step + env if cluster.slots[0].kind == "cpu" else max(step, env)
    return Prediction(
        step_s=step,
        idle_share={s: max(0.0, 1.0 - b / step) if step > 0 else 0.0 for s, b in busy.items()},
        stages={"generate": gen, "tail": tail, "reward": max(engine_reward, rule_reward), "train": train,
                "weight_sync": sync, "switch": switch, "env": env},
        memory_bytes={s: int(sum(parts.values())) for s, parts in _memory(plan, cluster, sizes, workload, costs).items()},
    )


def _memory(
    plan: Plan, cluster: ClusterSpec, sizes: ModelSizes, workload: Workload, costs: StageCosts
) -> dict[int, dict[str, float]]:
    """Peak bytes of every slot by part: trainer state, engine weights, reward engine, and the
    larger (taking turns) or the sum (concurrent) of KV cache and activations."""
    every = tuple(range(len(cluster.slots)))
    parts: dict[int, dict[str, float]] = {s: {} for s in every}

    def add(a: Assignment, part: str, nbytes: float) -> None:
        over = a.slots or every
        for s in over:
            parts[s][part] = parts[s].get(part, 0.0) + nbytes / len(over)

    trainers = plan.of("trainer")
    ranks = max(1, len(trainers))
    accepted = workload.groups_per_step * workload.group_size
    samples = accepted / costs.acceptance
    state = (sizes.policy_params + sizes.critic_params) * sizes.train_bytes + sizes.reference_params * sizes.weight_bytes
    tokens_per_micro_batch = accepted * (workload.prompt_tokens + workload.max_new_tokens) / (
        ranks * workload.micro_batches_per_step
    )
    generators = engines_of(plan)
    in_flight = min(math.ceil(samples / max(1, len(generators))), workload.max_batch_sequences)
    kv = sizes.kv_bytes_per_token * (workload.prompt_tokens + workload.max_new_tokens) * in_flight
    for a in trainers:
        add(a, "trainer", state / ranks)
        add(a, "activations", tokens_per_micro_batch * sizes.activation_bytes_per_token)
    for a in generators:
        add(a, "engine", sizes.policy_params * sizes.weight_bytes)
        add(a, "kv", kv)
    for a in plan.of("reward"):
        if a.slots:
            add(a, "reward engine", sizes.reward_params * sizes.weight_bytes)
    if workload.engine_reserve_share > 0:
        for s, p in parts.items():
            if "engine" in p:
                reserve = workload.engine_reserve_share * cluster.slots[s].memory_bytes
                p["kv"] = max(p["kv"], reserve - p["engine"])
    if plan.layout in ("colocated", "partial"):  # generation and training take turns
        for p in parts.values():
            smaller = "kv" if p.get("kv", 0.0) < p.get("activations", 0.0) else "activations"
            p.pop(smaller, None)
    return parts


def _refusal(
    plan: Plan, prediction: Prediction, cluster: ClusterSpec, sizes: ModelSizes, workload: Workload, costs: StageCosts
) -> str:
    """Why ``plan`` does not fit in memory (its fullest slot over the limit, with the parts), or ''."""
    over = {s: m - cluster.slots[s].memory_bytes for s, m in prediction.memory_bytes.items()}
    worst = max(over, key=lambda s: over[s], default=-1)
    if worst < 0 or over[worst] <= 0:
        return ""
    parts = _memory(plan, cluster, sizes, workload, costs)[worst]
    detail = ", ".join(f"{name} {nbytes / GIB:.2f}" for name, nbytes in parts.items() if nbytes > 0)
    return (f"slot {worst} needs {prediction.memory_bytes[worst] / GIB:.2f} GiB ({detail}) "
            f"but has {cluster.slots[worst].memory_bytes / GIB:.2f} GiB")


def ladder(most: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... up to ``most``, and ``most``: the splits worth trying."""
    out: set[int] = set()
    p = 1
    while p <= most:
        out.update(x for x in (p, p + p // 2) if x <= most)
        p *= 2
    return sorted(out | ({most} if most >= 1 else set()))


def role_options(layout: Layout, cluster: ClusterSpec, roles: Roles, search: bool) -> list[Roles]:
    """The role counts to try for ``layout``: ``roles`` as given, or (``search``) every split of
    the slots between generators and trainer ranks on the ladder. ``roles.trainers`` 0 (the
    rank count left to the plan, trainer.world_size 0): a rank per trainer slot, and on a CPU
    machine also one rank over all of them (its threads on every core, no collectives)."""
    if roles.trainers == 0:
        return [r for option in role_options(layout, cluster, replace(roles, trainers=len(cluster.slots)), search)
                for r in _rank_counts(layout, cluster, option)]
    if not search:
        return [roles]
    n = len(cluster.slots)
    if layout == "colocated":
        return [replace(roles, trainers=n, generators=n)]
    reward_slots = roles.rewards if roles.reward_engines else 0
    room = (n - reward_slots) // roles.tensor_parallel
    if layout == "partial":
        return [replace(roles, trainers=n, generators=g) for g in ladder(room)]
    return [replace(roles, generators=g, trainers=n - reward_slots - g * roles.tensor_parallel)
            for g in ladder(room - 1)] or [roles]


def _rank_counts(layout: Layout, cluster: ClusterSpec, roles: Roles) -> list[Roles]:
    """``roles`` with a rank per trainer slot (disaggregated: the slots the generators and
    reward engines leave), and on CPU slots also with one rank spanning them."""
    n = len(cluster.slots)
    if layout == "disaggregated":
        n -= roles.generators * roles.tensor_parallel + (roles.rewards if roles.reward_engines else 0)
    ranks = max(1, n)
    per_slot = replace(roles, trainers=ranks, generators=ranks if layout == "colocated" else roles.generators)
    if ranks == 1 or cluster.slots[0].kind != "cpu":
        return [per_slot]
    return [per_slot, replace(per_slot, trainers=1, generators=1 if layout == "colocated" else roles.generators)]


def candidates(
    cluster: ClusterSpec,
    sizes: ModelSizes,
    costs: StageCosts,
    workload: Workload,
    roles: Roles,
    *,
    search: bool = False,
) -> list[Candidate]:
    """The three layouts, each placed, checked for memory and predicted; with ``search`` each
    layout's best split of the slots between generators and trainer ranks (else ``roles``' counts)."""
    out = []
    for layout in LAYOUTS:
        chosen: Candidate | None = None
        refusals = []
        for option in role_options(layout, cluster, roles, search):
            try:
                plan = assign(layout, cluster, option)
            except LayoutError as e:
                refusals.append(str(e).removeprefix(f"{layout}: "))
                continue
            prediction = predict(plan, cluster, sizes, costs, workload)
            refused = _refusal(plan, prediction, cluster, sizes, workload, costs)
            if refused:
                refusals.append(refused)
                if chosen is None:
                    chosen = Candidate(layout=layout, plan=plan, prediction=prediction, refused=refusals[0])
                continue
            if chosen is None or chosen.refused or chosen.prediction is None or prediction.step_s < chosen.prediction.step_s:
                chosen = Candidate(layout=layout, plan=plan, prediction=prediction)
        out.append(chosen or Candidate(layout=layout, plan=None, prediction=None, refused=refusals[0]))
    return out


def best(cands: list[Candidate]) -> Candidate | None:
    """The usable candidate with the lowest predicted step; ties go to the earlier layout in
    ``LAYOUTS`` (colocated first: one process per slot, no weight push)."""
    pick: Candidate | None = None
    for c in sorted(cands, key=lambda c: LAYOUTS.index(c.layout)):
        if c.refused or c.prediction is None:
            continue
        if pick is None or pick.prediction is None or c.prediction.step_s < pick.prediction.step_s * (1 - 1e-9):
            pick = c
    return pick


def describe(prediction: Prediction) -> str:
    """The stages of a prediction in one line: ``generate 1.2 + tail 0.3 + train 2.0 ...``."""
    return ", ".join(f"{k} {v:.3g} s" for k, v in prediction.stages.items() if v > 0)


def finish(candidate: Candidate) -> Plan:
    """The candidate's plan with its prediction written into it."""
    assert candidate.plan is not None and candidate.prediction is not None
    p = candidate.prediction
    return replace(
        candidate.plan,
        predicted_step_s=p.step_s,
        idle_share=dict(p.idle_share),
        reason=f"{candidate.layout}: predicted {p.step_s:.3g} s/step ({describe(p)}); {candidate.plan.reason}",
    )


def choose(
    cluster: ClusterSpec,
    sizes: ModelSizes,
    costs: StageCosts,
    workload: Workload,
    roles: Roles,
    *,
    search: bool = False,
) -> Plan:
    """The plan with the lowest predicted step time among the layouts that fit; raises
    ``ConfigError`` when none does."""
    cands = candidates(cluster, sizes, costs, workload, roles, search=search)
    pick = best(cands)
    if pick is None:
        why = "; ".join(f"{c.layout}: {c.refused}" for c in cands)
        raise ConfigError(
            f"placement.layout: no layout fits this cluster ({why}); use more or larger slots, a smaller "
            "model, or fewer tokens in flight (controller.max_new_tokens, buffer.groups_per_step)"
        )
    return finish(pick)


def _cores_of(cluster: ClusterSpec) -> int:
    """The machine's cores the env role's processes spread over (at least 1)."""
    return max(1, len({c for s in cluster.slots for c in s.cores}))
