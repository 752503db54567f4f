"""The launcher's side of re-planning, without a run: where the moved processes go, what a
change stops and starts, time-shared CPU slots, the injected slow judge, the knobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.config import load_run_config
from workers.reward.worker import SLOW_ENV
from yatt.errors import ConfigError
from yatt.placement.changes import keep_places, moved
from yatt.placement.layouts import Roles, assign, cpu_cluster, slot_share
from yatt.runtime.trace import reward_slowdown

GIB = 1 << 30
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "adaptive_judge.yaml"


def roles(generators: int, rewards: int) -> Roles:
    return Roles(trainers=1, generators=generators, rewards=rewards, controllers=2, reward_engines=True)


def test_four_slots_share_two_cores_at_half_a_core_each() -> None:
    shared = cpu_cluster([0, 1], 8 * GIB, slots=4)
    assert [s.cores for s in shared.slots] == [(0,), (1,), (0,), (1,)]
    assert slot_share(shared) == 0.5 and shared.slots[0].memory_bytes == 2 * GIB
    one_each = cpu_cluster([0, 1], 8 * GIB)
    assert len(one_each.slots) == 2 and slot_share(one_each) == 1.0


def test_a_moved_slot_stops_one_generator_and_starts_one_judge_the_rest_stay() -> None:
    cluster = cpu_cluster([0, 1], 8 * GIB, slots=4)
    old = assign("disaggregated", cluster, roles(2, 1))
    new = assign("disaggregated", cluster, roles(1, 2))
    # as assigned, judge 0 would move to the freed slot 1 and judge 1 take its slot 2
    assert [a.slots for a in new.of("reward")] == [(1,), (2,)]
    kept = keep_places(old, new)
    assert {(a.role, a.index): a.slots for a in kept.assignments if a.slots} == {
        ("generator", 0): (0,), ("reward", 0): (2,), ("reward", 1): (1,), ("trainer", 0): (3,),
    }  # fmt: skip
    assert [a.cores for a in kept.of("reward")] == [(0,), (1,)]
    assert moved(old, kept) == ([("generator", 1)], [("reward", 1)])
    assert moved(old, old) == ([], [])
    back = keep_places(kept, assign("disaggregated", cluster, roles(2, 1)))
    assert moved(kept, back) == ([("reward", 1)], [("generator", 1)])  # and back: judge 0 stays on slot 2


def test_the_slow_judge_is_parsed_named_when_wrong_and_shared_by_a_marker(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(SLOW_ENV, raising=False)
    assert reward_slowdown(tmp_path) is None
    for bad in ("fast", "10", "10:x", "-1:0.5"):
        monkeypatch.setenv(SLOW_ENV, bad)
        with pytest.raises(ConfigError, match=f"{SLOW_ENV}={bad!r}: expected GROUPS:SECONDS"):
            reward_slowdown(tmp_path)
    monkeypatch.setenv(SLOW_ENV, "3:0.25")
    first, joining = reward_slowdown(tmp_path), reward_slowdown(tmp_path)
    assert first is not None and joining is not None and first.seconds == 0.25
    assert not first.active(2) and not joining.active(0)
    assert first.active(3)  # the 3rd group judged: slow from now on, for every worker of the run
    assert joining.active(0)


@pytest.mark.parametrize(
    ("item", "says"),
    [
        ("placement.cpu_slots=-1", "placement.cpu_slots must be >= 0"),
        ("placement.adaptive_patience=0", "placement.adaptive_patience must be >= 1"),
        ("placement.adaptive_margin=-0.1", "placement.adaptive_margin must be >= 0"),
        ("placement.adaptive_warmup=-1", "placement.adaptive_warmup must be >= 0"),
    ],
)
def test_placement_knobs_that_cannot_work_are_named(item: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        load_run_config(None, [item])
    assert load_run_config(None, ["placement.adaptive=false"]).placement.adaptive is False


@pytest.mark.parametrize(
    ("items", "replans"),
    [
        (["placement.layout=disaggregated"], True),
        (["placement.layout=disaggregated", "placement.adaptive=false"], False),  # pinned
        (["placement.layout=colocated"], True),  # no move to make; its decisions are logged
        (["placement.layout=partial"], True),  # within the partial layout: its generators are parked and woken
    ],
)
def test_a_run_re_plans_unless_pinned(items: list[str], replans: bool, tmp_path: Path) -> None:
    from launch.local import LocalLauncher

    launcher = LocalLauncher(load_run_config(EXAMPLE, items), tmp_path, show_progress=False)
    launcher.plan = plan = launcher.make_plan()
    assert plan is not None
    adapter = launcher.make_adapter(ready_s=12.0)
    assert (adapter is not None) == replans
    if adapter is not None:
        assert not adapter.replanner.keep_trainers and adapter.replanner.layouts == (plan.layout,)
        switching = LocalLauncher(load_run_config(EXAMPLE, [*items, "placement.adaptive_layouts=true"]), tmp_path)
        switching.plan = switching.make_plan()
        both = switching.make_adapter(ready_s=12.0)
        partial = plan.layout == "partial"  # it switches to no other layout
        assert both is not None and both.replanner.layouts == (("partial",) if partial else ("disaggregated", "colocated"))
        assert adapter.replanner.switch.to_rollout_s == adapter.replanner.switch.reshard_s == 12.0
        assert adapter.replanner.world_sizes == frozenset({1, 2, 4})  # a wave of 64 samples, 4 slots: no 3-rank group
        assert adapter.replanner.trainer_wait_steps == 1  # a trainer move waits for the checkpoint it asks for
        without = LocalLauncher(load_run_config(EXAMPLE, [*items, "trainer.checkpoint_every=0"]), tmp_path)
        without.plan = without.make_plan()
        asked = without.make_adapter(ready_s=12.0)
        assert asked is not None and not asked.replanner.keep_trainers  # the checkpoint is asked for


def test_a_checkpoint_ask_is_read_back_withdrawn_and_a_foreign_file_ignored(tmp_path: Path) -> None:
    from yatt.rl.checkpoints import (
        REQUEST_FILE,
        ask_for_checkpoint,
        asked_for_checkpoint,
        withdraw_checkpoint_request,
    )

    assert asked_for_checkpoint(tmp_path) is None
    ask_for_checkpoint(tmp_path, 7)
    assert asked_for_checkpoint(tmp_path) == 7 and [p.name for p in tmp_path.iterdir()] == [REQUEST_FILE]
    withdraw_checkpoint_request(tmp_path)
    withdraw_checkpoint_request(tmp_path)  # twice: nothing to withdraw is no error
    assert asked_for_checkpoint(tmp_path) is None
    (tmp_path / REQUEST_FILE).write_text("soon")  # not the launcher's: the periodic checkpoints go on
    assert asked_for_checkpoint(tmp_path) is None


def test_warm_up_steps_are_written_not_re_planned_on(tmp_path: Path) -> None:
    """The first steps of a run and the first after a change are measured and written,
    never fed to the replanner (their slow start would start a streak)."""
    from launch.local import LocalLauncher
    from yatt.placement.adaptive import StepTimes

    launcher = LocalLauncher(load_run_config(EXAMPLE, ["placement.adaptive_warmup=2"]), tmp_path, show_progress=False)
    launcher.plan = launcher.make_plan()
    adapter = launcher.make_adapter(ready_s=12.0)
    assert adapter is not None
    slow = StepTimes(generate_s=9.0, tail_s=0.0, reward_s=9.0, train_s=0.1, weight_sync_s=0.0, completion_mean=20,
                     completion_p90=40, acceptance=1.0)  # fmt: skip
    adapter.settle(0)
    assert [adapter.warming(s, slow) for s in range(3)] == [True, True, False]
    adapter.settle(7)  # a change carried out after step 6
    assert [adapter.warming(s, slow) for s in (7, 8, 9)] == [True, True, False]
    assert adapter.replanner.decisions == []  # nothing fed to it
    records = [json.loads(line) for line in adapter.path.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 7, 8]
    assert all(r["reason"].startswith("warm-up (placement.adaptive_warmup=2)") and r["measured/generate_s"] == 9.0
               for r in records)  # fmt: skip


def test_the_first_decision_prints_the_estimate_from_the_runs_own_costs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plan's number at start assumes the acceptance (0.5 with a filter) and lengths;
    the first re-planned step prints the step time predicted from what the run measured,
    with the acceptance and lengths it saw, once."""
    from launch.local import LocalLauncher
    from yatt.placement.adaptive import StepTimes

    launcher = LocalLauncher(load_run_config(EXAMPLE, ["placement.adaptive_warmup=0"]), tmp_path, show_progress=False)
    launcher.plan = plan = launcher.make_plan()
    adapter = launcher.make_adapter(ready_s=1.0)
    assert adapter is not None
    times = StepTimes(generate_s=3.0, tail_s=0.0, reward_s=0.5, train_s=0.2, weight_sync_s=0.0, completion_mean=31,
                      completion_p90=40, acceptance=0.14)  # fmt: skip
    assert plan is not None
    start = plan.predicted_step_s
    first = adapter.decide(0, times)
    adapter.decide(1, times)
    lines = [line for line in capsys.readouterr().out.splitlines() if "measured costs" in line]
    assert lines == [
        f"yatt: placement: after step 0, from this run's measured costs: {first.predicted_step_s:.3g} s/step for this "
        f"plan (acceptance 14%, completions 31 tokens mean; {start:.3g} s/step was the "
        "estimate before the first step)"
    ]


def test_each_decision_is_a_tensorboard_scalar_and_a_change_its_reason_as_text(tmp_path: Path) -> None:
    """Beside ``placement.jsonl``, the decisions are TensorBoard scalars of the run
    ``tensorboard/placement`` (with the run's own scalars), and a change's reason is text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from launch.local import LocalLauncher
    from yatt.placement.adaptive import StepTimes

    items = ["placement.adaptive_warmup=0", "placement.adaptive_patience=2"]
    launcher = LocalLauncher(load_run_config(EXAMPLE, items), tmp_path, show_progress=False)
    launcher.plan = launcher.make_plan()
    adapter = launcher.make_adapter(ready_s=1.0)
    assert adapter is not None
    slow_judge = StepTimes(generate_s=0.05, tail_s=0.0, reward_s=9.0, train_s=0.1, weight_sync_s=0.0,
                           completion_mean=6, completion_p90=8, acceptance=1.0)  # fmt: skip
    decisions = [adapter.decide(step, slow_judge) for step in range(3)]
    adapter.close()
    assert [d.changed for d in decisions] == [False, True, False], [d.reason for d in decisions]
    events = EventAccumulator(str(tmp_path / "tensorboard" / "placement"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("placement/changed")] == [(0, 0.0), (1, 1.0), (2, 0.0)]
    assert [e.value for e in events.Scalars("measured/reward_s")] == [9.0, 9.0, 9.0]
    [text] = events.Tensors("placement/change/text_summary")
    assert text.step == 1 and "1 slots generate -> reward" in text.tensor_proto.string_val[0].decode()
    (tmp_path / "quiet").mkdir()
    pinned = LocalLauncher(load_run_config(EXAMPLE, [*items, "run.report_to=[]"]), tmp_path / "quiet", show_progress=False)
    pinned.plan = pinned.make_plan()
    quiet = pinned.make_adapter(ready_s=1.0)
    assert quiet is not None
    quiet.decide(0, slow_judge)
    assert not (tmp_path / "quiet" / "tensorboard").exists()  # report_to without tensorboard


def test_a_new_trainer_group_waits_for_a_checkpoint_after_its_decision_and_never_for_the_last(tmp_path: Path) -> None:
    """A change that keeps the ranks goes now; one that moves them waits for a complete
    checkpoint after the step it was decided after and for that step's metrics line, and
    is dropped when that checkpoint is the run's last (nothing left to train)."""
    from launch.local import LocalLauncher

    cluster = cpu_cluster([0, 1], 8 * GIB, slots=4)
    launcher = LocalLauncher(load_run_config(EXAMPLE, ["run.steps=10"]), tmp_path, show_progress=False)
    launcher.plan = assign("disaggregated", cluster, roles(2, 1))
    same_ranks = keep_places(launcher.plan, assign("disaggregated", cluster, roles(1, 2)))
    two_ranks = assign("disaggregated", cluster, Roles(trainers=2, generators=1, rewards=1, controllers=2, reward_engines=True))
    assert launcher.executor.can_go(same_ranks, 3, logged=3) == "now"
    assert launcher.executor.can_go(two_ranks, 3, logged=3) == "later"  # no checkpoint yet

    def checkpoint(step: int) -> None:
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step}" / "done").write_text("")

    checkpoint(3)
    assert launcher.executor.can_go(two_ranks, 3, logged=3) == "later"  # not after the decision
    checkpoint(5)
    assert launcher.executor.can_go(two_ranks, 3, logged=3) == "later"  # step 4's line not written yet
    assert launcher.executor.can_go(two_ranks, 3, logged=4) == "now"
    checkpoint(10)
    assert launcher.executor.can_go(two_ranks, 3, logged=9) == "never"
