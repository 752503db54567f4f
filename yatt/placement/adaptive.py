"""Re-planning at run time: each step's measured stage times in, a decision out.

The planner (``planner.py``) picks a layout before the run from estimated or calibrated
costs. During a run the costs move: completions grow as the policy learns, dynamic
sampling's acceptance drifts, a judge's cost per sample varies. ``Replanner`` is fed the
stage times every step (what the roles trace), turns them into stage costs for the
slots they ran on, predicts the current plan and its neighbours with the planner's own
``predict``, and changes the plan at a step boundary when a neighbour wins by more than a
margin for several steps in a row, net of what the change costs::

    step k times ──► costs (smoothed) ──► predict(current), predict(each neighbour)
                                              │
             gain = current - neighbour  ◄────┘        per step
             keep  unless  gain > margin * current
                     and   gain * horizon > switch cost     (the change pays for itself)
                     for   patience steps in a row          (hysteresis: one slow step is noise)

Neighbours of a plan: ``m`` slots moved between generators, reward engines and trainer
ranks (m = 1, 2, 4, ... up to half of the smaller pool: one slot at a time would take
hundreds of changes, each paying a switch, to follow a drift at 1024 GPUs), and the best
split of each other layout. A change's cost (``SwitchCosts``) is paid once at the
boundary: slots that start serving (engine start and weight load), slots that stop
(sleep, in-flight requests finished or re-issued), and a trainer world-size change
(checkpoint and resharded restore), whichever slots move (the others stay in place).
Pure: the cluster simulator (``benchmarks/placement.py``) runs it in its loop, and so does
a run's launcher (``launch/placement/adapter.py``, ``placement.adaptive``), which carries out the
moves between generators, reward engines and trainer ranks (a new trainer group through a
checkpoint it asks for, ``trainer_wait_steps``; ``keep_trainers``: the trainer ranks stay;
``world_sizes``: the group sizes its micro-batches split over).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from yatt.errors import LayoutError
from yatt.placement.layouts import Roles, assign
from yatt.placement.plan import LAYOUTS, ClusterSpec, Layout, Plan
from yatt.placement.planner import (
    ModelSizes,
    StageCosts,
    Workload,
    collective_time,
    engines_of,
    in_flight,
    pool_speedup,
    predict,
    role_options,
    speedup,
    steps_in_flight,
    trained_tokens,
    with_gen_cost,
)


@dataclass(frozen=True, kw_only=True)
class SwitchCosts:
    """Seconds a plan change stops the run for, paid once at the step boundary."""

    to_rollout_s: float
    """Slots that start serving a generator or judge engine: start or wake it and load the weights
    (verl: 9.1 s for a 5B model)."""
    to_train_s: float
    """Slots that stop serving: finish or re-issue in-flight requests, free the KV cache (verl: 3.3 s back)."""
    reshard_s: float
    """A new trainer world size: checkpoint, restart the group, restore resharded (DCP)."""


@dataclass(frozen=True, kw_only=True)
class StepTimes:
    """What the roles measured in one training step (seconds; busy time of each pool)."""

    generate_s: float
    """Generator pool busy at full batch on this step's samples (the tail excluded)."""
    tail_s: float
    """Time the pool took for its last samples once the batch thinned out (the last 10%)."""
    reward_s: float
    """Reward pool busy scoring this step's samples."""
    train_s: float
    """Trainer ranks' compute for the step."""
    weight_sync_s: float = 0.0
    """Pushing the new weights to the generators (disaggregated, partial)."""
    switch_s: float = 0.0
    """Switching slots between generation and training (colocated, partial)."""
    completion_mean: float
    completion_p90: float
    acceptance: float
    """Share of generated groups dynamic sampling kept this step."""
    env_s: float = 0.0
    """CPU seconds the env role's episode processes used this step (all its workers)."""


def roles_of_plan(plan: Plan) -> Roles:
    """The role counts a plan was assigned from."""
    trainers = plan.of("trainer")
    gens = plan.of("generator")
    rewards = plan.of("reward")
    return Roles(
        trainers=len(trainers),
        generators=len(trainers) if plan.layout == "colocated" else len(gens),
        rewards=len(rewards),
        controllers=len(plan.of("controller")),
        envs=len(plan.of("env")),
        reward_engines=any(a.slots for a in rewards),
        tensor_parallel=len(gens[0].slots) if gens and gens[0].slots else 1,
    )


def pools(plan: Plan) -> dict[str, int]:
    """Slots computing for each pool: generate, reward (engines) and train."""
    n_train = len({s for a in plan.of("trainer") for s in a.slots})
    hosted = plan.layout == "colocated"
    return {
        "generate": n_train if hosted else len({s for a in plan.of("generator") for s in a.slots}),
        "reward": len({s for a in plan.of("reward") for s in a.slots}),
        "train": n_train,
    }


def trainer_slots(plan: Plan) -> tuple[tuple[int, ...], ...]:
    """The slots of each trainer rank, in rank order."""
    return tuple(a.slots for a in plan.of("trainer"))


def new_trainer_group(old: Plan, new: Plan) -> bool:
    """Whether going from ``old`` to ``new`` takes a new trainer group: its ranks move, or
    the layout changes (a colocated rank hosts an engine, a disaggregated one does not)."""
    return trainer_slots(old) != trainer_slots(new) or old.layout != new.layout


def costs_from_times(times: StepTimes, base: StageCosts, workload: Workload, plan: Plan) -> StageCosts:
    """Stage costs per slot that explain ``times`` on ``plan``'s slots: each measured stage
    divided back by the planner's own formulas (``stage_times``); what the plan did not
    measure (weight sync in colocated, switches in disaggregated) stays as in ``base``."""
    slots = pools(plan)
    accepted = workload.groups_per_step * workload.group_size
    samples = accepted / times.acceptance
    tokens = samples * times.completion_mean
    train_tokens = trained_tokens(workload, accepted, times.completion_mean)
    costs = replace(base, completion_mean=times.completion_mean, acceptance=times.acceptance,
                    completion_p90=max(times.completion_p90, times.completion_mean))
    if times.completion_p90 > times.completion_mean and times.tail_s > 0:
        costs = replace(costs, gen_latency_s=times.tail_s / (times.completion_p90 - times.completion_mean))
    if tokens > 0 and times.generate_s > 0:
        n = max(1, slots["generate"])
        per_token = times.generate_s * pool_speedup(n, len(engines_of(plan)), base.gen_scaling, base.gen_thread_scaling) / tokens
        in_flight_now = in_flight(costs, workload, n, steps_in_flight(plan.layout, workload))
        costs = with_gen_cost(costs, workload, in_flight_now, per_token)
    if times.reward_s > 0 and samples > 0:
        workers = speedup(slots["reward"], base.gen_scaling) if slots["reward"] else len(plan.of("reward"))
        costs = replace(costs, reward_s=times.reward_s * workers / samples)
    if times.env_s > 0 and samples > 0:
        costs = replace(costs, env_s=times.env_s / samples)
    ranks = len(plan.of("trainer"))
    computing = times.train_s - base.train_fixed_s - collective_time(base, ranks)
    if train_tokens > 0 and computing > 0:
        per_token = computing * pool_speedup(max(1, slots["train"]), ranks, base.train_scaling, base.thread_scaling) / train_tokens
        costs = replace(costs, train_token_s=per_token)
    if times.weight_sync_s > 0:
        costs = replace(costs, weight_sync_s=times.weight_sync_s)
    if times.switch_s > 0:
        costs = replace(costs, switch_s=times.switch_s)
    return costs


def smooth(old: StageCosts, new: StageCosts, weight: float) -> StageCosts:
    """``weight`` of ``new`` and the rest of ``old``, field by field (an exponential moving average)."""
    if weight >= 1.0:
        return new
    mixed = {f.name: (1 - weight) * getattr(old, f.name) + weight * getattr(new, f.name)
             for f in fields(StageCosts) if isinstance(getattr(new, f.name), float)}
    return replace(new, **mixed)


def change_cost(old: Plan, new: Plan, switch: SwitchCosts) -> float:
    """Seconds ``switch`` charges for going from ``old`` to ``new``. Within a layout only the
    slots that change pool pay (whoever executes the change keeps the others in place):
    engines started where a pool grows, stopped where one shrinks, and a reshard when the
    trainer's slots or ranks change. A change of layout restarts every engine."""
    a, b = pools(old), pools(new)
    if old.layout != new.layout:
        cost = switch.to_rollout_s + switch.to_train_s
    else:
        grows = any(b[p] > a[p] for p in ("generate", "reward"))
        shrinks = any(b[p] < a[p] for p in ("generate", "reward"))
        cost = switch.to_rollout_s * grows + switch.to_train_s * shrinks
    if a["train"] != b["train"] or len(old.of("trainer")) != len(new.of("trainer")):
        cost += switch.reshard_s
    return cost


@dataclass(frozen=True, kw_only=True)
class Move:
    """One neighbour of the current plan."""

    plan: Plan
    what: str
    """The move in words: ``4 slots generate -> train``, ``layout colocated -> partial``."""
    predicted_step_s: float
    switch_s: float


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What the replanner decided after one step's measurements."""

    step: int
    plan: Plan
    """The plan to run from the next step on (the current one unless ``changed``)."""
    changed: bool
    predicted_step_s: float
    """The current plan's step time predicted from this step's measured costs."""
    best: Move | None
    """The best neighbour that passed the margin and pays for its switch (None: none did)."""
    streak: int
    """Steps in a row a neighbour has passed (the change happens at ``patience``)."""
    reason: str

    def metrics(self) -> dict[str, float]:
        """The decision as a metrics line (``placement/*``)."""
        gain = self.predicted_step_s - self.best.predicted_step_s if self.best else 0.0
        return {
            "placement/predicted_step_s": self.predicted_step_s,
            "placement/best_neighbour_step_s": self.best.predicted_step_s if self.best else self.predicted_step_s,
            "placement/predicted_gain_s": gain,
            "placement/switch_s": self.best.switch_s if self.best else 0.0,
            "placement/streak": float(self.streak),
            "placement/changed": float(self.changed),
        }


def slot_moves(layout: str, roles: Roles) -> list[tuple[Roles, str]]:
    """The role counts ``m`` slots away from ``roles`` within ``layout``, m = 1, 2, 4, ... up to
    half of the smaller pool, with the move in words. Disaggregated: between any two of
    generators, reward engines and trainer ranks; partial (trainer ranks on every slot):
    generators grow or shrink, or trade slots with reward engines; colocated: none (every
    slot serves and trains)."""
    tp = roles.tensor_parallel
    unit = {"generate": tp, "reward": 1, "train": 1}
    count = {"generate": roles.generators, "reward": roles.rewards, "train": roles.trainers}
    names = ["generate", "train"] + (["reward"] if roles.reward_engines else [])
    if layout == "disaggregated":
        pairs = [(a, b) for a in names for b in names if a != b]
    elif layout == "partial":  # "train" stands for the slots that only train
        pairs = [("train", "generate"), ("generate", "train")]
        pairs += [("reward", "generate"), ("generate", "reward")] if roles.reward_engines else []
    else:
        return []
    out = []
    for donor, taker in pairs:
        step = tp if "generate" in (donor, taker) else 1
        m = step
        while m <= max(step, min(count[donor] * unit[donor], count[taker] * unit[taker]) // 2):
            new = dict(count)
            new[donor] -= m // unit[donor]
            new[taker] += m // unit[taker]
            trainers = roles.trainers if layout == "partial" else new["train"]
            moved = replace(roles, generators=new["generate"], rewards=new["reward"], trainers=trainers)
            out.append((moved, f"{m} slots {donor} -> {taker}"))
            m *= 2
    return out


class Replanner:
    """Keeps or changes the plan from each step's measured stage times (module docstring)."""

    def __init__(
        self,
        plan: Plan,
        *,
        cluster: ClusterSpec,
        sizes: ModelSizes,
        costs: StageCosts,
        workload: Workload,
        switch: SwitchCosts,
        margin: float = 0.05,
        patience: int = 3,
        horizon_steps: int = 20,
        smoothing: float = 0.5,
        layouts: tuple[Layout, ...] = LAYOUTS,
        keep_trainers: bool = False,
        world_sizes: frozenset[int] | None = None,
        trainer_wait_steps: int = 0,
    ) -> None:
        assert margin >= 0 and patience >= 1 and horizon_steps >= 1 and 0 < smoothing <= 1
        self.plan = plan
        self.cluster, self.sizes, self.workload, self.switch = cluster, sizes, workload, switch
        self.costs = costs
        self.margin, self.patience, self.horizon_steps, self.smoothing = margin, patience, horizon_steps, smoothing
        self.layouts = layouts
        self.keep_trainers = keep_trainers
        """Only neighbours with the trainer ranks on the same slots (what a run's executor
        carries out in place today: generators and reward engines joining or leaving)."""
        self.world_sizes = world_sizes
        """The trainer group sizes a neighbour may have (None: any): a run's micro-batches
        split evenly over its ranks only."""
        self.trainer_wait_steps = trainer_wait_steps
        """Steps a move of the trainer's slots waits after its decision (a run's executor:
        1, the step under way ends with the checkpoint the new group starts from; 0: at
        once, as in the simulator): they do not count towards paying for it."""
        self.streak = 0
        self.decisions: list[Decision] = []
        self._plans: dict[tuple[Layout, Roles], Plan | None] = {}

    def _predict(self, plan: Plan) -> float | None:
        """Predicted step of ``plan`` under the current costs; None when it does not fit in memory."""
        p = predict(plan, self.cluster, self.sizes, self.costs, self.workload)
        if any(m > self.cluster.slots[s].memory_bytes for s, m in p.memory_bytes.items()):
            return None
        return p.step_s

    def _move(self, plan: Plan, what: str) -> Move | None:
        step = self._predict(plan)
        if step is None:
            return None
        return Move(plan=plan, what=what, predicted_step_s=step, switch_s=change_cost(self.plan, plan, self.switch))

    def neighbours(self) -> list[Move]:
        """Every plan one move away: slots between pools (same layout), or another layout's best split."""
        roles = roles_of_plan(self.plan)
        layout = self.plan.layout
        options = [(layout, option, what) for option, what in slot_moves(layout, roles)]
        for other in self.layouts:
            if other != layout:
                options += [(other, option, f"layout {layout} -> {other}")
                            for option in role_options(other, self.cluster, roles, search=True)]
        best_of: dict[str, Move] = {}
        for to, option, what in options:
            if option.generators < 1 or option.trainers < 1 or option.rewards < (1 if roles.reward_engines else 0):
                continue
            plan = self._assign(to, option)
            if plan is not None and self.keep_trainers and new_trainer_group(self.plan, plan):
                continue
            if self.world_sizes is not None and option.trainers not in self.world_sizes:
                continue
            move = self._move(plan, what) if plan is not None else None
            if move is not None and (what not in best_of or move.predicted_step_s < best_of[what].predicted_step_s):
                best_of[what] = move
        return list(best_of.values())

    def _assign(self, layout: Layout, roles: Roles) -> Plan | None:
        """``assign``, remembered: the same few hundred plans come back every step."""
        key = (layout, roles)
        if key not in self._plans:
            try:
                self._plans[key] = assign(layout, self.cluster, roles)
            except LayoutError:
                self._plans[key] = None
        return self._plans[key]

    def observe(self, step: int, times: StepTimes, *, steps_left: int | None = None) -> Decision:
        """Take step ``step``'s measurements; return the plan for the next step and why."""
        measured = costs_from_times(times, self.costs, self.workload, self.plan)
        self.costs = smooth(self.costs, measured, self.smoothing) if self.decisions else measured
        current = predict(self.plan, self.cluster, self.sizes, self.costs, self.workload).step_s
        horizon = self.horizon_steps if steps_left is None else min(self.horizon_steps, steps_left)

        def paying(m: Move) -> int:  # the steps that pay for a move: a trainer move's start after its checkpoint
            return horizon - (self.trainer_wait_steps if new_trainer_group(self.plan, m.plan) else 0)

        def net(m: Move) -> float:  # what the move wins over those steps, less its switch
            return (current - m.predicted_step_s) * paying(m) - m.switch_s

        passing = [m for m in self.neighbours() if current - m.predicted_step_s > self.margin * current and net(m) > 0]
        pick = max(passing, key=net, default=None)
        self.streak = self.streak + 1 if pick else 0
        changed = pick is not None and self.streak >= self.patience
        if pick is None:
            reason = f"keep {self.plan.layout}: predicted {current:.3g} s/step, no neighbour better by {self.margin:.0%} net of its switch"
        else:
            gain = current - pick.predicted_step_s
            verb = "change" if changed else f"hold ({self.streak}/{self.patience})"
            reason = (f"{verb}: {pick.what}, predicted {current:.3g} -> {pick.predicted_step_s:.3g} s/step "
                      f"(gain {gain:.3g} s x {paying(pick)} steps vs switch {pick.switch_s:.3g} s)")
        decision = Decision(step=step, plan=pick.plan if changed and pick else self.plan, changed=changed,
                            predicted_step_s=current, best=pick, streak=self.streak, reason=reason)
        if changed:
            self.plan = decision.plan
            self.streak = 0
        self.decisions.append(decision)
        return decision

