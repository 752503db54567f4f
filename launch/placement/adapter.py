"""Re-planning inside a run (``placement.adaptive``): the launcher's side of
``yatt.placement.adaptive``.

After each step (a new line of ``metrics.jsonl``) the launcher asks every generator and
reward worker for its busy time (``Query("stats")``: ``generator/generate_s``,
``reward/busy_s``), takes the step's share, adds the trainer's times, lengths and
acceptance from the metrics line, and hands the ``StepTimes`` to a ``Replanner`` seeded
with the planner's own estimates for the run. Every decision is a line of
``<run_dir>/placement.jsonl`` (its reason, predicted step times, gain, switch cost; its
scalars also in TensorBoard, as the run ``tensorboard/placement``, with each change's
reason as text; not in wandb, which takes one writer per run, rank 0; the
first ``placement.adaptive_warmup`` steps of a run and after each change are written, not
re-planned on: ``Adapter.settle``); when the plan changes, the launcher carries it out in
place (``LocalLauncher``):

    keep_places(old, new)    staying processes keep their slots; the moved ones are named
    stop the leaving ones    SIGTERM; the registry drops them, the controllers re-issue
                             their in-flight requests (nothing lost: the ledger decides)
    write plan.json          the joining processes read their slots from it
    start the joining ones   they register and the controllers' pools grow

A partial plan's generators time-share their slots with training, so a change parks them
instead (``parks``): a leaving generator deregisters (its in-flight requests are re-issued
the same way) and sleeps, its process and engine kept (on GPU vLLM's sleep mode frees its
memory for training); a later change that gives the same slots back to that generator
index wakes it (``Query("unpark")``: it registers again and trainer rank 0's push of the
current weights wakes the engine) instead of starting a process and loading a model.

A move of the trainer's slots (a new world size) goes through a checkpoint: the launcher
asks the trainer group for one (``yatt.rl.checkpoints``; with or without
``trainer.checkpoint_every``), written at the end of the step under way, and waits for
the first complete checkpoint after the step it was decided after; then it stops the
leaving engines, kills the trainer ranks, rewinds the buffer to the checkpoint with the
new world size (it splits the micro-batches for it), and starts the new group from the
checkpoint (DCP reshards the weights and optimizer state on load) as a new incarnation;
the step under way when the ranks die is trained again; only the steps after that
checkpoint count towards paying for the move (``Replanner(trainer_wait_steps=1)``). A
layout change between disaggregated and colocated (``RUN_LAYOUTS``) is the same regroup:
the new ranks host engines or not as ``plan.json`` says, and the generator processes of
the old plan stop or those of the new one start (a partial plan moves slots within the
partial layout; the simulator also switches to and from it). The
switch costs are this run's own: its start to READY (every role: an upper bound for one
joining process, and for a new trainer group), and about a second to stop one
(``LocalLauncher.make_adapter``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launch.config import RunConfig
from launch.placement.inputs import run_costs, run_sizes, run_workload
from protocols.messages import Metrics, Query
from yatt.errors import ConfigError, YattError
from yatt.placement.adaptive import Decision, Replanner, StepTimes, SwitchCosts
from yatt.placement.plan import ClusterSpec, Layout, Plan
from yatt.rl.config import BufferConfig
from yatt.runtime import run_dir as names
from yatt.runtime.registry import Directory

if TYPE_CHECKING:
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

RUN_LAYOUTS: tuple[Layout, ...] = ("disaggregated", "colocated")
"""The layouts a run switches between (``placement.adaptive_layouts``); a partial run moves
slots within its layout."""
BUSY_KEYS = {"generator": "generator/generate_s", "reward": "reward/busy_s", "env": "env/cpu_s"}
"""The cumulative busy seconds each pool's workers report in their stats (the env role's: its
episode processes' CPU seconds)."""


def splits_over(config: BufferConfig, world_size: int) -> bool:
    """Whether the buffer's micro-batch waves split evenly over ``world_size`` ranks."""
    try:
        config.check_world_size(world_size)
    except ConfigError:
        return False
    return True


class Adapter:
    """The run's replanner, fed from the roles' stats and the metrics lines."""

    def __init__(self, cfg: RunConfig, plan: Plan, cluster: ClusterSpec, run_dir: Path, *, switch: SwitchCosts,
                 prompt_tokens: float | None = None) -> None:
        kind = cluster.slots[0].kind
        self.cfg = cfg
        self.path = run_dir / names.PLACEMENT
        self.replanner = Replanner(
            plan, cluster=cluster, sizes=run_sizes(cfg, kind), costs=run_costs(cfg, cluster, prompt_tokens=prompt_tokens),
            workload=run_workload(cfg, kind, prompt_tokens), switch=switch, margin=cfg.placement.adaptive_margin,
            patience=cfg.placement.adaptive_patience,
            layouts=RUN_LAYOUTS if cfg.placement.adaptive_layouts and plan.layout in RUN_LAYOUTS else (plan.layout,),
            world_sizes=frozenset(n for n in range(1, len(cluster.slots) + 1) if splits_over(cfg.buffer, n)),
            trainer_wait_steps=1,  # a trainer move waits for the checkpoint it asks for: the step under way
        )  # fmt: skip
        self.warm_until = 0
        """The first step re-planned on (``settle``)."""
        self.start_estimate_s = plan.predicted_step_s
        """The step time the planner predicted before any step (assumed acceptance and lengths)."""
        self.calibrated = False
        """Whether the estimate from this run's measured costs was printed (at the first decision)."""
        self._tensorboard = run_dir / "tensorboard" / "placement" if "tensorboard" in cfg.run.report_to else None
        self._writer: EventFileWriter | None = None
        self._busy: dict[str, float] = {}  # actor id -> its busy seconds at the last step
        self.busy_workers = {role: 0 for role in BUSY_KEYS}
        """Workers of each pool busy in the last measured step."""

    async def busy(self, directory: Directory, role: str, timeout: float, *, summed: bool = False) -> tuple[float | None, int]:
        """The pool's busy seconds since the last call: the mean over its live workers of
        each one's growth (``summed``: the sum; a worker seen for the first time counts from
        its start; None when no worker answered), and how many of them were busy."""
        grown = []
        for member in directory.members(role):
            try:
                reply = await directory.client(member.actor_id).request(Query(what="stats"), Metrics, timeout=timeout)
            except (YattError, KeyError):
                continue  # leaving, gone or busy past the limit: the next step measures the pool
            total = reply.values.get(BUSY_KEYS[role])
            if total is None:
                continue
            grown.append(max(0.0, total - self._busy.get(member.actor_id, 0.0)))
            self._busy[member.actor_id] = total
        return (sum(grown) / (1 if summed else len(grown)) if grown else None), sum(g > 0 for g in grown)

    async def measure(self, directory: Directory, line: dict[str, float]) -> StepTimes | None:
        """One step's ``StepTimes`` from its metrics line and the pools' busy time."""
        timeout = self.cfg.transport.request_timeout_s
        generate, self.busy_workers["generator"] = await self.busy(directory, "generator", timeout)
        reward, self.busy_workers["reward"] = await self.busy(directory, "reward", timeout)
        env, self.busy_workers["env"] = await self.busy(directory, "env", timeout, summed=True)
        if generate is None or "time/train_s" not in line:
            return None
        mean = line.get("response_length/mean") or line.get("tokens_per_s", 0.0) / max(line.get("samples_per_s", 0.0), 1e-9)
        acceptance = line.get("buffer/acceptance_ema", 1.0)
        return StepTimes(
            generate_s=generate, tail_s=0.0, reward_s=reward or 0.0, train_s=line["time/train_s"],
            weight_sync_s=line.get("time/weight_sync_s", 0.0), switch_s=line.get("time/switch_s", 0.0),
            completion_mean=max(1.0, mean), completion_p90=max(1.0, line.get("response_length/max", mean)),
            acceptance=min(1.0, acceptance) if 0 < acceptance and math.isfinite(acceptance) else 1.0, env_s=env or 0.0,
        )  # fmt: skip

    def settle(self, step: int) -> None:
        """``step`` is the first of a run, of a resumed one, or the first after a change:
        it and the next ``placement.adaptive_warmup - 1`` are measured, not re-planned on."""
        self.warm_until = step + self.cfg.placement.adaptive_warmup

    def warming(self, step: int, times: StepTimes) -> bool:
        """Whether ``step`` is a warm-up step; if so its record is written."""
        if step >= self.warm_until:
            return False
        self.wait(step, times, f"warm-up (placement.adaptive_warmup={self.cfg.placement.adaptive_warmup}): measured, not re-planned on")
        return True

    def wait(self, step: int, times: StepTimes, reason: str) -> None:
        """A step measured while a change waits to be carried out: written, not re-planned on."""
        record: dict[str, Any] = {"step": step, "reason": reason, "placement/streak": 0.0, "placement/changed": 0.0}
        self._write(record, times)

    def decide(self, step: int, times: StepTimes) -> Decision:
        """The replanner's decision after ``step``, written to ``placement.jsonl``."""
        decision = self.replanner.observe(step, times, steps_left=self.cfg.run.steps - step - 1)
        if not self.calibrated:  # the start's number assumed the acceptance and lengths: say what they are
            self.calibrated = True
            from tqdm import tqdm  # (its write clears the progress bar, prints, and draws it again)

            tqdm.write(
                f"yatt: placement: after step {step}, from this run's measured costs: {decision.predicted_step_s:.3g} "
                f"s/step for this plan (acceptance {times.acceptance:.0%}, completions {times.completion_mean:.0f} "
                f"tokens mean; {self.start_estimate_s:.3g} s/step was the estimate before the first step)",
                file=sys.stdout,
            )
        record: dict[str, Any] = {"step": step, "reason": decision.reason, **decision.metrics()}
        if decision.changed:
            record["plan"] = decision.plan.to_json()
        self._write(record, times)
        return decision

    def _write(self, record: dict[str, Any], times: StepTimes) -> None:
        record["measured/generate_s"], record["measured/reward_s"] = times.generate_s, times.reward_s
        record["measured/train_s"], record["measured/env_cpu_s"] = times.train_s, times.env_s
        record.update({f"measured/{role}_busy_workers": n for role, n in self.busy_workers.items()})
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            if self._writer is None:
                from tensorboard.summary.writer.event_file_writer import EventFileWriter

                self._writer = EventFileWriter(str(self._tensorboard))
            step = int(record["step"])
            values = [
                summary_value(key, value)
                for key, value in record.items()
                if isinstance(value, float | int) and key != "step"
            ]
            if record.get("placement/changed"):
                values.append(summary_value("placement/change", record["reason"]))
            self._writer.add_event(event(step, values))
            self._writer.flush()

    def close(self) -> None:
        """Close the TensorBoard writer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def summary_value(tag: str, value: float | str) -> Any:
    """A TensorBoard summary value: a scalar, or text (shown by the text plugin), as torch's
    ``SummaryWriter.add_scalar`` / ``add_text`` write them, from tensorboard's own protos:
    the launcher writes its placement metrics without importing torch (~200 MB)."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.text import metadata as text_metadata
    from tensorboard.util import tensor_util

    if isinstance(value, str):
        tensor = tensor_util.make_tensor_proto([value])
        return Summary.Value(
            tag=f"{tag}/text_summary",
            metadata=text_metadata.create_summary_metadata(display_name="", description=""),
            tensor=tensor,
        )
    return Summary.Value(tag=tag, simple_value=float(value))


def event(step: int, values: list[Any]) -> Any:
    """One TensorBoard event of ``values`` (``summary_value``) at ``step``, stamped now."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    return Event(wall_time=time.time(), step=step, summary=Summary(value=values))
