"""Re-planning inside a run, live: the judge of ``examples/adaptive_judge.yaml`` turns slow
mid-run (injected: ``YATT_SLOW_REWARD``); the launcher moves a generator's slot to a second
judge between two steps, without stopping the run, losing nothing. Training turning slow
(``YATT_SLOW_TRAIN``) gets a generator's slot as a second trainer rank, through a
checkpoint and a resharded restore; turning much slower, it switches the run to the
colocated layout the same way."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from benchmarks.faults import audit, training_prompts
from launch.config import load_run_config
from tests.e2e.test_loop import finish, metrics
from tests.learning import assert_learned
from workers.reward.worker import SLOW_ENV
from yatt.placement.layouts import Roles, assign
from yatt.placement.plan import Plan
from yatt.runtime.trace import SLOW_TRAIN_ENV

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "adaptive_judge.yaml"
SLOTS_FOR_TRAINING = ["placement.layout=disaggregated", "placement.cpu_slots=4", "run.num_generators=3",
                      "trainer.world_size=1", "trainer.checkpoint_every=0", "run.eval_every=0"]
"""The default job on 4 slots, 3 generators and 1 trainer rank, checkpoints only at the end."""


def run_shifted(run_dir: Path, args: list[str], env: dict[str, str]) -> tuple[str, list[dict[str, Any]]]:
    """``python -m launch run ARGS`` into ``run_dir`` with a workload shift injected by
    ``env``, to its end; the launcher's output and the decisions of ``placement.jsonl``."""
    log = run_dir.parent / f"{run_dir.name}.launcher.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "launch", "run", *args, "--run-dir", str(run_dir), "--no-progress"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **env},
        )  # fmt: skip
    finish(proc, run_dir)
    return log.read_text(), [json.loads(line) for line in (run_dir / "placement.jsonl").read_text().splitlines()]


def first_slow(rows: list[dict[str, float]], run_dir: Path, marker: str) -> int:
    """The first step that ended after the injected shift began (its marker's time)."""
    since = float((run_dir / "failpoints" / marker).read_text())
    return next(i for i, row in enumerate(rows) if row["time/unix"] > since)


def test_a_judge_turning_slow_gets_a_generators_slot_mid_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "adaptive"
    said, decisions = run_shifted(run_dir, [str(EXAMPLE)], {SLOW_ENV: "150:0.15"})
    assert [d["step"] for d in decisions] == list(range(40)), "a decision after every step"
    changes = [d for d in decisions if d["placement/changed"]]
    assert len(changes) == 1 and "1 slots generate -> reward" in changes[0]["reason"], [d["reason"] for d in decisions]
    # The shift caused the change: before the judge turned slow no move beat the example's
    # margin (placement.adaptive_margin=0.4; a second judge is predicted 30-35% faster on
    # this machine from the start), after it the same move did for 3 steps in a row (the
    # hysteresis), each of them a step that ended with the judge slow. Once it changed, the
    # plan holds its two judges.
    rows = metrics(run_dir)
    slow = first_slow(rows, run_dir, "slow_reward")
    assert not any(d["placement/changed"] for d in decisions[:slow]), [d["reason"] for d in decisions]
    held = decisions[changes[0]["step"] - 2 : changes[0]["step"]]
    assert [d["placement/streak"] for d in held] == [1.0, 2.0]
    assert held[0]["step"] >= slow, (slow, [d["reason"] for d in decisions])
    after = decisions[changes[0]["step"] + 1 :]  # two steps warm up on the new plan (placement.adaptive_warmup)
    assert all(d["reason"].startswith(("keep", "warm-up")) for d in after[:2]), [d["reason"] for d in decisions]
    assert all(d["reason"].startswith("keep") for d in after[2:]), [d["reason"] for d in decisions]
    assert [d["reason"].split()[0] for d in decisions[:2]] == ["warm-up", "warm-up"]
    # Carried out in place: generator-1 stopped, reward-1 started on its slot, the run went on.
    assert "stopped generator-1" in said and "started reward-1" in said, said[-3000:]
    assert "exited with code" not in said and "restarting" not in said, said[-3000:]
    plan = json.loads((run_dir / "plan.json").read_text())["assignments"]
    placed = {(a["role"], a["index"]): a["slots"] for a in plan if a["role"] in ("generator", "reward")}
    assert placed == {("generator", 0): [0], ("reward", 0): [2], ("reward", 1): [1]}
    after = [d for d in decisions if d["step"] > changes[0]["step"] + 2]
    assert any(d["measured/reward_busy_workers"] == 2 for d in after), "the second judge never scored"
    assert "re-planning after step" not in said, said[-3000:]
    assert_learned(rows, run_dir)
    # The ledger against the prompt order (two epochs): no group lost, none trained twice.
    out = audit(run_dir, load_run_config(EXAMPLE).run.seed, training_prompts(run_dir), 0.0, True)
    assert (out.lost, out.duplicated, out.steps_twice) == (0, 0, 0)


def test_a_trainer_turning_slow_gets_a_second_rank_mid_run(tmp_path: Path) -> None:
    """The default job on 4 slots, 3 generators and 1 trainer rank; from step 6 training
    turns slow (``YATT_SLOW_TRAIN``: 2 s more a step, shared by the ranks; at 1 s the gain
    over the steps left was within the noise of a CI machine's switch cost). The replanner
    moves a generator's slot to the trainer: no periodic checkpoint (``checkpoint_every=0``),
    the launcher asks for one, written at the end of the step under way; the trainer group
    restarts from it with 2 ranks (DCP reshards the 1-rank checkpoint), the buffer splits
    the micro-batches for 2, and nothing is lost."""
    run_dir = tmp_path / "regroup"
    said, decisions = run_shifted(run_dir, [*SLOTS_FOR_TRAINING, "run.steps=20"], {SLOW_TRAIN_ENV: "6:2.0"})
    changes = [d for d in decisions if d["placement/changed"]]
    assert len(changes) == 1 and "1 slots generate -> train" in changes[0]["reason"], [d["reason"] for d in decisions]
    rows = metrics(run_dir)
    assert len(rows) == 20 and [int(r["step"]) for r in rows] == list(range(20))
    slow = first_slow(rows, run_dir, "slow_train")
    assert changes[0]["step"] - 2 >= slow, (slow, [d["reason"] for d in decisions])
    # Carried out through the checkpoint it asked for, of the step under way (the next, or
    # the one after when the ask came as rank 0 had looked): generator-2 stopped, the
    # buffer rewound to it with the new world size, two ranks started from it.
    resumed = int(said.split("trainer group 1 -> 2 ranks from step ")[1].split()[0])
    assert changes[0]["step"] + 2 <= resumed <= changes[0]["step"] + 3, (changes[0]["step"], said[-3000:])
    assert not (run_dir / "checkpoint_request").exists(), "the ask was withdrawn once served"
    checkpoints = sorted(int(d.name[5:]) for d in (run_dir / "checkpoints").glob("step_*"))
    assert checkpoints == [resumed, 20], checkpoints  # the asked one and the last: no other
    assert f"buffer rewound to step {resumed} (" in said and "trainer group incarnation 1" in said, said[-3000:]
    assert "stopped generator-2" in said and "exited with code" not in said, said[-3000:]
    plan = json.loads((run_dir / "plan.json").read_text())["assignments"]
    assert sorted(a["index"] for a in plan if a["role"] == "trainer") == [0, 1]
    assert len([a for a in plan if a["role"] == "generator"]) == 2
    # Until it was carried out, the steps the old group trained were logged, not re-planned on.
    later = [d for d in decisions if d["step"] > changes[0]["step"]]
    assert all(d["reason"].startswith("keep")
               or (d["reason"].startswith("wait for a checkpoint after step") and d["step"] <= resumed)
               or (d["reason"].startswith("warm-up") and resumed <= d["step"] < resumed + 2)
               for d in later), [d["reason"] for d in later]  # fmt: skip
    # The ledger against the prompt order: no group lost, none trained twice; the step
    # under way when the one-rank group stopped was trained again (at most that one).
    out = audit(run_dir, load_run_config(run_dir / "config.yaml").run.seed, training_prompts(run_dir), 0.0, True)
    assert (out.lost, out.duplicated) == (0, 0) and out.steps_twice <= 1
    # Resumed with more steps: the config's one rank restores the 2-rank checkpoint
    # (resharded); the re-planner measures the new steps only (the resumed run's are decided).
    _, resumed_decisions = run_shifted(run_dir, [*SLOTS_FOR_TRAINING, "run.steps=24", "--resume", str(run_dir)], {})
    decided = [d["step"] for d in resumed_decisions]
    assert set(decided[: len(decisions)]) == set(range(20)) and decided[len(decisions) :] == [20, 21, 22, 23], decided
    assert [int(r["step"]) for r in metrics(run_dir)] == list(range(24))
    out = audit(run_dir, load_run_config(run_dir / "config.yaml").run.seed, training_prompts(run_dir), 0.0, True)
    assert (out.lost, out.duplicated) == (0, 0)


def test_training_turning_much_slower_switches_the_run_to_colocated(tmp_path: Path) -> None:
    """The same job, free to switch layouts (``placement.adaptive_layouts``); from step 4
    training turns 3 s a step slower. The replanner's best neighbour is no longer a slot
    moved but the colocated layout: every slot trains and hosts an engine (they take turns). Carried out through the checkpoint it asks for: the
    three generator processes stop, four ranks start from it, each serving an engine."""
    run_dir = tmp_path / "relayout"
    items = [*SLOTS_FOR_TRAINING, "run.steps=16", "placement.adaptive_layouts=true"]
    said, decisions = run_shifted(run_dir, items, {SLOW_TRAIN_ENV: "4:3.0"})
    changes = [d for d in decisions if d["placement/changed"]]
    assert len(changes) == 1 and "layout disaggregated -> colocated" in changes[0]["reason"], [d["reason"] for d in decisions]
    rows = metrics(run_dir)
    assert [int(r["step"]) for r in rows] == list(range(16))
    slow = first_slow(rows, run_dir, "slow_train")
    assert changes[0]["step"] - 2 >= slow, (slow, [d["reason"] for d in decisions])
    resumed = int(said.split("trainer group 1 -> 4 ranks from step ")[1].split(",")[0])
    assert changes[0]["step"] + 2 <= resumed <= changes[0]["step"] + 3, (changes[0]["step"], said[-3000:])
    assert ", disaggregated -> colocated" in said and "stopped generator-0, generator-1, generator-2" in said, said[-3000:]
    assert "exited with code" not in said, said[-3000:]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["layout"] == "colocated"
    ranks = [a for a in plan["assignments"] if a["role"] == "trainer"]
    assert len(ranks) == 4 and all(a["hosts_generator"] for a in ranks)
    assert not [a for a in plan["assignments"] if a["role"] == "generator"]
    # The ranks' engines generated the steps after it (the engines take turns with training).
    assert all("time/switch_s" in r for r in rows[resumed:]) and not any("time/switch_s" in r for r in rows[:resumed])
    assert any(d["measured/generator_busy_workers"] == 4 for d in decisions if d["step"] > resumed), decisions[-3:]
    out = audit(run_dir, load_run_config(run_dir / "config.yaml").run.seed, training_prompts(run_dir), 0.0, True)
    assert (out.lost, out.duplicated) == (0, 0) and out.steps_twice <= 1


class Driven:
    """A launcher run in this process, its plan changed from the test between steps through
    the replanner's entry point (``LocalLauncher.change_plan``): deterministic moves."""

    def __init__(self, run_dir: Path, items: list[str]) -> None:
        from launch.local import LocalLauncher

        self.run_dir = run_dir
        self.cfg = load_run_config(None, items)
        self.launcher = LocalLauncher(self.cfg, run_dir, show_progress=False)
        self.run: asyncio.Future[int] | None = None

    async def logged(self, step: int) -> None:
        """Until ``step``'s metrics line is written."""
        while not (self.run_dir / "metrics.jsonl").exists() or len(metrics(self.run_dir)) <= step:
            assert self.run is not None and not self.run.done(), "the run ended first"
            await asyncio.sleep(0.05)

    async def turn_taken(self, after: float) -> None:
        """Until trainer rank 0 has put the generators to sleep for a step's training (a
        partial plan), later than ``after``."""
        trace = self.run_dir / "trace" / "trainer-0.jsonl"
        while not any(s["kind"] == "generators_sleep" and s["start"] > after
                      for s in map(json.loads, trace.read_text().splitlines())):  # fmt: skip
            assert self.run is not None and not self.run.done(), "the run ended first"
            await asyncio.sleep(0.01)

    def pid_of(self, name: str) -> int:
        return next(p.popen.pid for p in self.launcher.procs if p.name == name)

    def plan(self) -> Plan:
        assert self.launcher.plan is not None
        return self.launcher.plan


def test_a_partial_runs_generator_is_parked_by_a_change_and_woken_by_the_next(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default job in the partial layout on 4 slots (training on all, 2 generators on
    slots 0 and 1), its plan changed twice: generator-1's slot goes to training only, then
    back. The first change parks generator-1 (out of the pool, asleep, its process kept),
    the second wakes the same process, which generates again; nothing lost or duplicated.
    The second change is carried out while a step trains (made 1 s longer from step 4):
    the woken generator gets its weights (which wake its engine) only once training ends."""
    monkeypatch.setenv(SLOW_TRAIN_ENV, "4:1.0")
    run_dir = tmp_path / "partial"
    driven = Driven(run_dir, ["placement.layout=partial", "placement.cpu_slots=4", "run.num_generators=2",
                              "trainer.world_size=1", "placement.adaptive=false", "run.steps=10",
                              "run.eval_every=0", "run.trace=true"])  # fmt: skip
    seen: dict[str, float] = {}

    async def drive() -> int:
        driven.run = asyncio.ensure_future(driven.launcher.run())
        await driven.logged(2)
        both = driven.plan()
        assert both.layout == "partial"
        seen["pid"] = driven.pid_of("generator-1")
        one = replace(both, assignments=tuple(a for a in both.assignments if (a.role, a.index) != ("generator", 1)))
        driven.launcher.executor.change_plan(one, "1 slots generate -> train (the test's)", 2)
        await driven.logged(5)
        await driven.turn_taken(after=time.time())  # step 6 trains now, for 1 s more
        seen["parked_until"] = time.time()
        assert 1 in driven.launcher.executor.parked and not any(p.name == "generator-1" for p in driven.launcher.procs)
        driven.launcher.executor.change_plan(both, "1 slots train -> generate (the test's)", 5)
        await driven.logged(6)
        seen["woken_pid"] = driven.pid_of("generator-1")
        return await driven.run

    assert asyncio.run(drive()) == 0
    said = "".join(capsys.readouterr())  # stdout and stderr
    assert "stopped generator-1 (parked)" in said and "started generator-1 (woken)" in said, said[-3000:]
    assert seen["woken_pid"] == seen["pid"], "generator-1 was started again, not woken"
    assert "exited with code" not in said and "restarting" not in said, said[-3000:]
    spans = [json.loads(line) for line in (run_dir / "trace" / "generator-1.jsonl").read_text().splitlines()]
    park = next(s for s in spans if s["kind"] == "park")
    unpark = next(s for s in spans if s["kind"] == "unpark")
    generated = [s["start"] for s in spans if s["kind"] == "generate"]
    assert park["start"] < unpark["start"] < seen["parked_until"] + 5
    assert not any(park["start"] + park["duration"] < t < unpark["start"] for t in generated), "it generated while parked"
    assert any(t > unpark["start"] for t in generated), "the woken generator never generated again"
    trainer = [json.loads(line) for line in (run_dir / "trace" / "trainer-0.jsonl").read_text().splitlines()]
    # Training ends just before the step's weights are gathered; from then on rank 0's watcher
    # may bring the woken generator up to the last version (the previous step's) before the new
    # push starts (seen: 3.5 ms before it), so the bound is the gather's start, less the
    # all-reduce between the two (50 ms: far under the step's extra 1 s of training).
    trained = next(s["start"] for s in trainer if s["kind"] == "weight_gather" and s["start"] > unpark["start"])
    loaded = next(s["start"] for s in spans if s["kind"] == "weight_load" and s["start"] > unpark["start"])
    assert loaded >= trained - 0.05, f"woken {loaded - unpark['start']:.2f} s after its unpark, {trained - loaded:.2f} s before training ended"
    assert [int(r["step"]) for r in metrics(run_dir)] == list(range(10))
    out = audit(run_dir, driven.cfg.run.seed, training_prompts(run_dir), 0.0, True)
    assert (out.lost, out.duplicated, out.steps_twice) == (0, 0, 0)


def test_a_colocated_run_switched_to_disaggregated_goes_on_from_the_checkpoint_it_asked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The other direction of the live layout switch above: the default job colocated on 4
    slots (2 ranks, each hosting an engine) changed after step 2 to disaggregated (1 rank,
    3 generator processes). The change asks for a checkpoint of the step under way; the
    two ranks stop, one starts from it (DCP reshards 2 -> 1), three generators start and
    generate the rest; no line missing, nothing lost or duplicated."""
    run_dir = tmp_path / "colocated"
    driven = Driven(run_dir, ["placement.layout=colocated", "placement.cpu_slots=4", "trainer.world_size=2",
                              "placement.adaptive=false", "trainer.checkpoint_every=0", "run.steps=10",
                              "run.eval_every=0", "run.trace=true"])  # fmt: skip

    async def drive() -> int:
        driven.run = asyncio.ensure_future(driven.launcher.run())
        await driven.logged(2)
        colocated = driven.plan()
        assert colocated.layout == "colocated" and len(colocated.of("trainer")) == 2
        assert driven.launcher.cluster is not None
        roles = Roles(trainers=1, generators=3, rewards=len(colocated.of("reward")),
                      controllers=len(colocated.of("controller")))  # fmt: skip
        driven.launcher.executor.change_plan(assign("disaggregated", driven.launcher.cluster, roles), "layout colocated -> disaggregated (the test's)", 2)
        return await driven.run

    assert asyncio.run(drive()) == 0
    said = "".join(capsys.readouterr())  # stdout and stderr
    resumed = int(said.split("trainer group 2 -> 1 ranks from step ")[1].split(",")[0])
    assert 4 <= resumed <= 5, said[-3000:]  # the step under way when it was decided (3), or the next
    assert ", colocated -> disaggregated" in said and "started generator-0, generator-1, generator-2" in said, said[-3000:]
    assert "exited with code" not in said, said[-3000:]
    checkpoints = sorted(int(d.name[5:]) for d in (run_dir / "checkpoints").glob("step_*"))
    assert checkpoints == [resumed, 10], checkpoints  # the asked one and the last
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["layout"] == "disaggregated" and [a["index"] for a in plan["assignments"] if a["role"] == "trainer"] == [0]
    rows = metrics(run_dir)
    assert [int(r["step"]) for r in rows] == list(range(10))
    assert not any("time/switch_s" in r for r in rows[resumed:])  # no turns taken: the engines are their own
    for g in range(3):  # each new generator served the steps after it
        spans = [json.loads(line) for line in (run_dir / "trace" / f"generator-{g}.jsonl").read_text().splitlines()]
        assert any(s["kind"] == "generate" for s in spans), g
    out = audit(run_dir, driven.cfg.run.seed, training_prompts(run_dir), 0.0, True)
    assert (out.lost, out.duplicated) == (0, 0) and out.steps_twice <= 1
