"""The buffer's decisions: in-order assembly, filtering, over-sampling, staleness,
exactly-once, balanced micro-batches, and a replay of the ledger that continues identically."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import random
import sqlite3
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from protocols.messages import ForkedRow, GroupKey, ScoredGroup
from yatt.errors import ConfigError, PluginError, ProtocolError
from yatt.rl.config import BufferConfig
from yatt.rl.ledger import Ledger
from yatt.rl.sampling import SamplingBuffer, epoch_order, newest_version, step_report, validate_group

N_PROMPTS = 12


def make_group(key: GroupKey, version: int, *, n: int = 2, equal: bool | None = None) -> ScoredGroup:
    """A deterministic group: prompt length and rewards follow from the prompt index."""
    if equal is None:
        equal = key.prompt_index % 3 == 0  # every third prompt is filtered (all rewards equal)
    rewards = torch.ones(n) if equal else torch.tensor([1.0] + [0.0] * (n - 1))
    p = 2 + key.prompt_index % 3
    lengths = [1 + (key.prompt_index + i) % 4 for i in range(n)]
    return ScoredGroup(
        group_key=key,
        prompt_ids=torch.full((p,), 7, dtype=torch.int32),
        completion_ids=[torch.arange(1, L + 1, dtype=torch.int32) for L in lengths],
        rollout_logprobs=[-torch.arange(1, L + 1, dtype=torch.float32) / 10 for L in lengths],
        rewards=rewards,
        advantages=rewards - rewards.mean(),
        policy_versions=torch.full((n,), version, dtype=torch.int64),
        finish_reasons=["stop"] * n,
    )


def make_buffer(tmp_path: Path, name: str = "ledger.db", **overrides: object) -> SamplingBuffer:
    config = BufferConfig(**{"groups_per_step": 4, "group_size": 2, "micro_batches_per_step": 2, **overrides})  # type: ignore[arg-type]
    return SamplingBuffer(config, num_prompts=N_PROMPTS, num_shards=2, world_size=2, seed=3, ledger=Ledger(tmp_path / name))


def drive(buf: SamplingBuffer, steps: int, rng: random.Random | None) -> list[list[str]]:
    """Play controllers + trainer: generate every planned group (in a shuffled arrival
    order if ``rng``), train each step once all its micro-batches exist. Returns each
    step's sample keys."""
    trained: list[list[str]] = []
    while len(trained) < steps:
        step = buf.step if not buf.ready else min(s for s, _ in buf.ready)
        waves = [buf.ready.get((step, i)) for i in range(buf.config.micro_batches_per_step)]
        if all(w is not None for w in waves):
            keys = [k.as_str() for w in waves for mb in w or [] for k in mb.group_keys]
            trained.append(keys)
            for i in range(buf.config.micro_batches_per_step):
                buf.release(step, i)
            buf.publish_version(step + 1)
            continue
        planned = [k for shard in range(buf.num_shards) for k in buf.plan(shard)]
        assert planned, "the buffer must ask for work while a step is incomplete"
        if rng is not None:
            rng.shuffle(planned)
        for key in planned:
            buf.offer(make_group(key, max(buf.min_policy_version, buf.version)))
    return trained


def prompts(steps: list[list[str]]) -> list[list[str]]:
    """Each step's sample keys without the attempt (a redone group has a new one)."""
    return [[key.rsplit("/", 1)[0] for key in step] for step in steps]


def test_epoch_order_is_seeded() -> None:
    assert epoch_order(10, 1, 0) == epoch_order(10, 1, 0)
    assert epoch_order(10, 1, 0) != epoch_order(10, 1, 1)
    assert sorted(epoch_order(10, 1, 5)) == list(range(10))


def test_steps_do_not_depend_on_arrival_order(tmp_path: Path) -> None:
    in_order = drive(make_buffer(tmp_path, "a.db"), 6, None)
    shuffled = drive(make_buffer(tmp_path, "b.db"), 6, random.Random(0))
    assert in_order == shuffled
    # Each step trains groups_per_step groups of group_size samples.
    assert all(len(keys) == 8 for keys in in_order)


def test_filter_and_ledger_exactly_once(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path)
    drive(buf, 5, random.Random(1))
    accepted = [e.key for e in buf.ledger.entries("accepted")]
    assert len(accepted) == len(set(accepted)), "a key was accepted twice"
    filtered = buf.ledger.entries("filtered")
    assert filtered and all(e.reason == "all rewards equal" and e.key.prompt_index % 3 == 0 for e in filtered)
    trained = buf.ledger.entries("trained")
    assert {e.key for e in trained} <= set(accepted)
    assert [e.step for e in trained] == sorted(e.step or 0 for e in trained)
    # Every prompt of the first epoch was decided: trained, filtered, or superseded and redone.
    first_epoch = {e.key.prompt_index for e in buf.ledger.entries() if e.key.epoch == 0 and e.status in ("trained", "filtered")}
    assert first_epoch == set(range(N_PROMPTS))


def test_duplicates_and_superseded_arrivals_are_dropped(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path)
    key = buf.plan(0)[0]
    assert buf.offer(make_group(key, 0)) in ("accepted", "filtered: all rewards equal")
    assert buf.offer(make_group(key, 0)) == "duplicate"
    other = buf.plan(1)[0]
    old_attempt = GroupKey(epoch=other.epoch, shard=other.shard, prompt_index=other.prompt_index, attempt=5)
    assert buf.offer(make_group(old_attempt, 0)) == "superseded"
    assert [e.status for e in buf.ledger.entries()][-2:] == ["duplicate", "superseded"]
    assert buf.stats.duplicates == 1 and buf.stats.superseded == 1


def test_a_long_run_keeps_the_orders_of_few_epochs_and_still_knows_old_keys(tmp_path: Path) -> None:
    """12 prompts, 4 groups a step: 30 steps go through 10+ epochs; the buffer keeps the
    orders of the last ones only, and a late copy of a first-epoch group is still a duplicate."""
    buf = make_buffer(tmp_path)
    first = buf.plan(0)[0]
    buf.offer(make_group(first, 0))
    drive(buf, 30, None)
    assert buf.cursor // N_PROMPTS >= 10
    assert len(buf._orders) <= 3 and len(buf._positions) <= 3, sorted(buf._orders)
    assert buf.offer(make_group(first, 0)) == "duplicate"
    assert buf.stats.duplicates == 1


def test_on_policy_closes_the_window_and_supersedes_extras(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path, micro_batches_per_step=1, filter="none")
    keys = [k for s in (0, 1) for k in buf.plan(s)]
    assert len(keys) == 4  # acceptance 1: exactly one step's worth, nothing more
    for k in keys:
        buf.offer(make_group(k, 0))
    assert buf.step == 1 and buf.plan(0) == [] and buf.plan(1) == []  # waits for version 1
    buf.publish_version(1)
    assert len([k for s in (0, 1) for k in buf.plan(s)]) == 4


def test_oversampling_follows_acceptance(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path, micro_batches_per_step=1, max_oversample=3.0, settled_after=0)
    # Reject everything in order: the EMA falls and the window widens, up to the cap.
    for _ in range(3):
        for k in [k for s in (0, 1) for k in buf.plan(s)]:
            buf.offer(make_group(k, 0, equal=True))
    assert buf.ema < 0.5
    assert buf.dispatch_end - buf.cursor == 12  # ceil(4 needed * min(3, 1/ema))


def test_staleness_bound_drops_and_redispatches(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path, micro_batches_per_step=1, max_staleness=1, filter="none")
    buf.publish_version(2)
    buf.step = 2  # the trainer is at step 2 (as after a resume)
    key = buf.key_at(buf.cursor)
    assert buf.offer(make_group(key, 0)) == "accepted"  # accepted on arrival, but 2 - 0 > 1
    assert [e.key for e in buf.ledger.entries("stale")] == [key]
    assert buf.stats.stale_dropped == 1
    assert buf.key_at(buf.cursor).attempt == 1 and buf.plan(key.shard)[0] == buf.key_at(buf.cursor)
    for k in [k for s in (0, 1) for k in buf.plan(s)]:
        buf.offer(make_group(k, 1))
    assert buf.ready
    for (step, _), batches in buf.ready.items():
        for mb in batches:
            assert all(step - int(v) <= 1 for v in mb.policy_versions)


def test_micro_batches_are_balanced_and_aligned(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path, filter="none")
    for k in [k for s in (0, 1) for k in buf.plan(s)]:
        buf.offer(make_group(k, 0))
    a, b = buf.ready[(0, 0)]
    assert a.input_ids.shape[0] == b.input_ids.shape[0] == 2  # same count per rank
    assert (a.index, a.count, a.rank, b.rank) == (0, 2, 0, 1)
    for mb in (a, b):
        for row in range(mb.input_ids.shape[0]):
            mask = mb.loss_mask[row]
            completion = mb.input_ids[row][mask]
            assert torch.equal(completion, torch.arange(1, len(completion) + 1))
            assert torch.allclose(mb.rollout_logprobs[row][mask], -completion.float() / 10)
            assert not (mb.loss_mask[row] & ~mb.attention_mask[row]).any()
    tokens = [int(mb.attention_mask.sum()) for mb in (a, b)]
    assert abs(tokens[0] - tokens[1]) <= 4


@pytest.mark.parametrize("keep_groups", [False, True])
def test_kept_groups_go_whole_to_one_rank(tmp_path: Path, keep_groups: bool) -> None:
    """trainer.share_prompt computes a group's prompt once where its rows share a
    micro-batch: the buffer deals whole groups (by tokens) instead of single rows."""
    config = BufferConfig(groups_per_step=4, group_size=4, micro_batches_per_step=1, filter="none")
    buf = SamplingBuffer(
        config, num_prompts=N_PROMPTS, num_shards=2, world_size=2, seed=3, ledger=Ledger(tmp_path / "l.db"),
        keep_groups=keep_groups,
    )  # fmt: skip
    for k in [k for s in (0, 1) for k in buf.plan(s)]:
        buf.offer(make_group(k, 0, n=4))
    micro_batches = buf.ready[(0, 0)]
    ranks_of = {k: {mb.rank for mb in micro_batches if k in mb.group_keys} for mb in micro_batches for k in mb.group_keys}
    split = [k for k, ranks in ranks_of.items() if len(ranks) > 1]
    assert len(ranks_of) == 4
    assert not split if keep_groups else split
    assert all(mb.input_ids.shape[0] > 0 for mb in micro_batches)


def forked(group: ScoredGroup, sample: int, version: int = 0) -> ScoredGroup:
    """``group`` with one more row of ``sample``: a forked call's (prompt 9 9 9; a turn of 3
    tokens, an observation, a turn of 1)."""
    mask = torch.tensor([True, True, True, False, True])
    row = ForkedRow(
        sample=sample, prompt_ids=torch.full((3,), 9, dtype=torch.int32), completion_ids=torch.tensor([4, 5, 6, 8, 4], dtype=torch.int32),
        completion_mask=mask, rollout_logprobs=torch.tensor([-0.4, -0.5, -0.6, 0.0, -0.4]),
        token_versions=torch.tensor([version] * 3 + [-1, version], dtype=torch.int64),
        advantages=float(group.advantages[sample]) * mask.float(),
    )  # fmt: skip
    return dataclasses.replace(group, forked=[row])


def test_a_forked_row_trains_as_a_row_of_its_own_with_its_samples_advantage(tmp_path: Path) -> None:
    """Each of a step's 4 groups of 2 samples, sample 0 of the first with a forked row: 9
    rows over 2 ranks (5 and 4); the forked row is its own prompt (no loss) then its turns
    (loss, its sample's advantage) and observation (no loss)."""
    buf = make_buffer(tmp_path, filter="none", micro_batches_per_step=1)
    keys = [k for s in (0, 1) for k in buf.plan(s)]
    for k in keys:
        buf.offer(forked(make_group(k, 0), 0) if k == keys[0] else make_group(k, 0))
    a, b = buf.ready[(0, 0)]
    assert sorted([a.input_ids.shape[0], b.input_ids.shape[0]]) == [4, 5]
    found = [(mb, r) for mb in (a, b) for r in range(mb.input_ids.shape[0]) if mb.input_ids[r, 0] == 9]
    [(mb, r)] = found
    assert mb.input_ids[r, :8].tolist() == [9, 9, 9, 4, 5, 6, 8, 4] and not mb.attention_mask[r, 8:].any()
    assert mb.loss_mask[r, :8].tolist() == [False] * 3 + [True] * 3 + [False, True]
    advantage = float(make_group(keys[0], 0).advantages[0])
    assert advantage != 0 and mb.advantages[r, :8].tolist() == [0.0] * 3 + [advantage] * 3 + [0.0, advantage]
    assert torch.allclose(mb.rollout_logprobs[r, 3:8], torch.tensor([-0.4, -0.5, -0.6, 0.0, -0.4]))
    assert mb.group_keys[r] == keys[0]
    # Its newest token is a version its sample's first row does not have: it counts.
    assert newest_version(forked(make_group(keys[0], 0), 0, version=3)) == 3


def test_a_forked_row_that_does_not_fit_its_group_is_refused_naming_it() -> None:
    group = make_group(GroupKey(epoch=0, shard=0, prompt_index=1, attempt=0), 0)
    with pytest.raises(ProtocolError, match=r"forked\[0\].sample is 2; the group has samples 0..1"):
        validate_group(dataclasses.replace(forked(group, 0), forked=[dataclasses.replace(forked(group, 0).forked[0], sample=2)]), 2)
    short = dataclasses.replace(forked(group, 1).forked[0], advantages=torch.zeros(2))
    with pytest.raises(ProtocolError, match=r"forked\[0\].advantages has shape \(2,\), its completion_ids \(5,\)"):
        validate_group(dataclasses.replace(group, forked=[short]), 2)


def test_images_that_cannot_feed_a_model_are_refused_naming_the_tensor() -> None:
    group = make_group(GroupKey(epoch=0, shard=0, prompt_index=1, attempt=0), 0)
    validate_group(dataclasses.replace(group, mm_inputs={"pixel_values": torch.zeros(1, 3, 4, 4)}), 2)
    for bad in (torch.zeros(0, 3, 4, 4), torch.tensor(1.0), torch.full((1, 3, 4, 4), float("nan"))):
        with pytest.raises(ProtocolError, match=r"mm_inputs\['pixel_values'\] must be finite, with a first dimension"):
            validate_group(dataclasses.replace(group, mm_inputs={"pixel_values": bad}), 2)


STATE = (
    "cursor", "step", "wave_index", "version", "ema", "dispatch_end", "attempts", "stats", "version_ceiling",
    "settled", "skipped_settled",
)


def state(buf: SamplingBuffer) -> dict[str, object]:
    """What the buffer decided so far (the plan number aside: it restarts from a random base)."""
    values: dict[str, object] = {name: copy.deepcopy(getattr(buf, name)) for name in STATE}
    values["decided"] = {g: (group.group_key, accepted) for g, (group, accepted) in buf.decided.items()}
    values["wave"] = [group.group_key for group in buf.wave]
    values["ready"] = {k: [mb.group_keys for mb in v] for k, v in buf.ready.items()}
    return values


def test_replay_rebuilds_the_state_and_continues_identically(tmp_path: Path) -> None:
    reference = drive(make_buffer(tmp_path, "ref.db"), 6, None)
    buf = make_buffer(tmp_path, "run.db")
    first = drive(buf, 3, random.Random(1))
    planned = [k for s in (0, 1) for k in buf.plan(s)]
    buf.offer(make_group(planned[0], buf.version))  # a decision past the last step
    buf.offer(make_group(planned[0], buf.version))  # and a duplicate of it
    buf.ledger.commit()
    restarted = make_buffer(tmp_path, "run.db")  # a new process on the same ledger
    assert restarted.replay() > 0
    assert state(restarted) == state(buf)
    assert first + drive(restarted, 3, random.Random(2)) == reference
    assert len(restarted.ledger.entries("trained")) == 6 * 4


def test_replay_rebuilds_whole_the_groups_the_buffer_goes_on_with(tmp_path: Path) -> None:
    """Replay decodes a stored group only as far as its decisions look (key, versions,
    rewards); the micro-batches of a step not trained yet, its step report, the wave being
    filled and the groups beyond the cursor come back whole."""
    buf = make_buffer(tmp_path, "run.db", groups_per_step=8)
    drive(buf, 2, None)
    for _ in range(100):  # until step 2's first wave is assembled and its second begun
        if (2, 0) in buf.ready and buf.wave:
            break
        buf.offer(make_group([k for s in (0, 1) for k in buf.plan(s)][0], buf.version))
    buf.ledger.commit()
    restarted = make_buffer(tmp_path, "run.db", groups_per_step=8)
    restarted.replay()
    assert state(restarted) == state(buf) and (2, 0) in restarted.ready
    kept = [g for g, _ in restarted.decided.values()] + restarted.wave
    kept += [g for groups in restarted.step_groups.values() for g, _ in groups]
    assert restarted.wave and restarted.step_groups[2] and all(type(g) is ScoredGroup for g in kept), [type(g) for g in kept]
    for k, batches in buf.ready.items():
        for a, b in zip(batches, restarted.ready[k], strict=True):
            assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("input_ids", "rollout_logprobs", "advantages", "loss_mask"))


def test_rewind_goes_back_to_the_mark_and_rolls_back_newer_groups(tmp_path: Path) -> None:
    reference = drive(make_buffer(tmp_path, "ref.db"), 6, None)
    buf = make_buffer(tmp_path, "run.db")
    first = drive(buf, 3, random.Random(1))
    mark, at_mark = buf.ledger.mark(), state(buf)
    drive(buf, 2, random.Random(3))  # steps 3 and 4, then the trainer dies
    buf.ledger.rewind(mark, "trainer restarted")
    rewound = make_buffer(tmp_path, "run.db")
    rewound.replay()
    assert {**state(rewound), "version_ceiling": None} == at_mark and rewound.version_ceiling == 3
    # A group made with the discarded weights of version 5 is redone, not trained.
    key = [k for s in (0, 1) for k in rewound.plan(s)][0]
    assert rewound.offer(make_group(key, 5)) == "rolled_back"
    assert [k for s in (0, 1) for k in rewound.plan(s)][0] == GroupKey(**{**key.__dict__, "attempt": key.attempt + 1})
    rewound.ledger.commit()
    again = make_buffer(tmp_path, "run.db")  # a buffer restart after the rewind replays it too
    again.replay()
    assert state(again) == state(rewound)
    assert prompts(first + drive(again, 3, random.Random(2))) == prompts(reference)
    trained = Counter(e.key for e in again.ledger.entries("trained"))
    assert len(trained) == 6 * 4 and max(trained.values()) == 1, "a rolled-back step counted"
    voided = [e for e in again.ledger.history() if e.status == "trained" and e.step in (3, 4)]
    assert len(voided) == 2 * 2 * 4, "the history keeps the rolled-back steps"
    assert again.version_ceiling is None  # the new trainer published version 4


@pytest.mark.parametrize("change", [{"filter": "none"}, {"group_size": 4}])
def test_replay_refuses_a_changed_config(tmp_path: Path, change: dict[str, object]) -> None:
    buf = make_buffer(tmp_path, "run.db")
    drive(buf, 2, None)
    buf.mark()  # a snapshot made under the old config is not used: every decision is checked
    drive(buf, 1, None)
    with pytest.raises(ConfigError, match="must not change across a restart"):
        make_buffer(tmp_path, "run.db", **change).replay()


def test_a_snapshot_made_under_another_custom_filter_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same ``module:function``, its code changed between two runs: the snapshot is
    passed over and the whole replay finds the decisions that differ."""
    module = tmp_path / "my_filter.py"
    module.write_text("def keep(group):\n    return ''\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    buf = make_buffer(tmp_path, "run.db", custom_filter="my_filter:keep")
    drive(buf, 2, None)
    buf.mark()
    module.write_text("def keep(group):\n    return 'too easy' if group.group_key.prompt_index % 2 else ''\n")
    importlib.invalidate_caches()
    monkeypatch.delitem(sys.modules, "my_filter")
    with pytest.raises(ConfigError, match="must not change across a restart"):
        make_buffer(tmp_path, "run.db", custom_filter="my_filter:keep").replay()


def test_a_custom_filter_that_does_not_load_is_refused_naming_the_field(tmp_path: Path) -> None:
    """``buffer.custom_filter`` loads through the one plug-in loader: its error names the field."""
    with pytest.raises(PluginError, match=r"buffer\.custom_filter: 'no_such_filters:keep' cannot be imported"):
        make_buffer(tmp_path, "run.db", custom_filter="no_such_filters:keep")


def whole_state(buf: SamplingBuffer) -> dict[str, object]:
    """``state`` and the rest a replay rebuilds: the steps not trained yet (their groups
    with the decision, their micro-batches whole), why the groups beyond the cursor were
    filtered, the run of filtered groups and the acceptance window."""
    values = state(buf)
    values["step_groups"] = {
        step: [(g.group_key, accepted) for g, accepted in consumed] for step, consumed in buf.step_groups.items() if step >= buf.version
    }
    values["ready"] = {
        k: [[mb.group_keys, mb.step, mb.index, mb.input_ids.tolist(), mb.advantages.tolist()] for mb in batches]
        for k, batches in buf.ready.items()
    }
    values.update(reasons=dict(buf._reasons), filtered_run=list(buf.filtered_run), stalled=buf.stalled)
    values.update(recent=list(buf.recent), recent_accepted=buf._recent_accepted)
    return values


def mid_step(buf: SamplingBuffer) -> None:
    """Stop inside a step: its first wave assembled, one group decided beyond the cursor
    (arrived out of order), and a duplicate offered."""
    while (buf.step, 0) not in buf.ready:
        buf.offer(make_group([k for s in range(buf.num_shards) for k in buf.plan(s)][0], max(buf.min_policy_version, buf.version)))
    planned = [k for s in range(buf.num_shards) for k in buf.plan(s)]
    later = max(planned, key=buf.position)
    for _ in range(2):
        buf.offer(make_group(later, max(buf.min_policy_version, buf.version)))
    assert buf.decided and buf.stats.duplicates


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_replay_starts_from_the_last_checkpoints_snapshot_and_continues_identically(tmp_path: Path, staleness: int) -> None:
    """Each checkpoint's mark stores the state; a restart replays only the events after
    the newest one and comes back to the same state, micro-batches, reports and counts,
    mid-step, as the buffer that made them and as a replay of the whole ledger."""
    reference = drive(make_buffer(tmp_path, "ref.db", max_staleness=staleness, settled_after=0), 8, None)
    buf = make_buffer(tmp_path, "run.db", max_staleness=staleness, settled_after=0)
    rng = random.Random(5)
    first = drive(buf, 2, rng)
    buf.mark()
    first += drive(buf, 2, rng)
    mid_step(buf)
    buf.mark()  # mid-step: a wave assembled, a group beyond the cursor, the step's report so far
    first += drive(buf, 1, rng)  # and after it
    mid_step(buf)
    buf.ledger.commit()
    events = len(buf.ledger.events())
    restarted = make_buffer(tmp_path, "run.db", max_staleness=staleness, settled_after=0)
    replayed = restarted.replay()
    assert 0 < replayed < events / 4, f"replayed {replayed} of the ledger's {events} events"
    assert whole_state(restarted) == whole_state(buf)
    db = sqlite3.connect(tmp_path / "whole.db")  # the same ledger without its snapshots
    buf.ledger._db.backup(db)
    db.execute("DELETE FROM snapshots")
    db.commit()
    db.close()
    whole = make_buffer(tmp_path, "whole.db", max_staleness=staleness, settled_after=0)
    assert whole.replay() == events
    assert whole_state(whole) == whole_state(restarted)
    assert prompts(first + drive(restarted, 3, random.Random(2))) == prompts(reference)  # (stale redos: new attempts)
    trained = Counter(e.key for e in restarted.ledger.entries("trained") if (e.step or 0) < 8)  # (off-policy: step 8 begun)
    assert len(trained) == 8 * 4 and max(trained.values()) == 1


def test_a_rewind_starts_from_the_snapshot_at_its_mark_not_a_later_one(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path, "run.db")
    drive(buf, 3, random.Random(1))
    mid_step(buf)
    mark, at_mark = buf.mark(), whole_state(buf)
    drive(buf, 2, random.Random(3))
    buf.mark()  # step 5's snapshot, which the rewind voids
    drive(buf, 1, random.Random(3))
    buf.ledger.rewind(mark, "trainer restarted")
    rewound = make_buffer(tmp_path, "run.db")
    assert rewound.replay() == 1  # the rewind row itself
    assert {**whole_state(rewound), "version_ceiling": None} == at_mark and rewound.version_ceiling == 3
    key = [k for s in (0, 1) for k in rewound.plan(s)][0]
    assert rewound.offer(make_group(key, 5)) == "rolled_back"
    drive(rewound, 1, random.Random(2))
    rewound.ledger.commit()
    again = make_buffer(tmp_path, "run.db")  # restarted after the rewind: the same snapshot, then the rest
    again.replay()
    assert whole_state(again) == whole_state(rewound)


def test_bad_shapes_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not split evenly over 2 trainer ranks"):
        make_buffer(tmp_path, groups_per_step=3, micro_batches_per_step=3, group_size=1)
    with pytest.raises(ConfigError, match="micro_batches_per_step must be >= 1 and divide groups_per_step=4"):
        BufferConfig(groups_per_step=4, micro_batches_per_step=3)


def test_nothing_is_dispatched_or_assembled_past_the_last_step(tmp_path: Path) -> None:
    config = BufferConfig(groups_per_step=4, group_size=2, micro_batches_per_step=2, filter="none")
    buf = SamplingBuffer(config, num_prompts=N_PROMPTS, num_shards=2, world_size=2, seed=3, ledger=Ledger(tmp_path / "l.db"), total_steps=2)
    drive(buf, 2, None)
    buf.publish_version(2)
    assert buf.step == 2 and [k for s in (0, 1) for k in buf.plan(s)] == []
    assert {e.step for e in buf.ledger.entries("trained")} == {0, 1}


def offer_planned(buf: SamplingBuffer, equal: bool) -> None:
    for key in [k for s in (0, 1) for k in buf.plan(s)]:
        buf.offer(make_group(key, buf.version, equal=equal))


def test_dynamic_sampling_that_accepts_nothing_stops_with_what_to_change(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path, max_filtered_batches=2)  # 2 x 4 groups
    for _ in range(20):
        offer_planned(buf, equal=True)
        if buf.stalled:
            break
    assert len(buf.filtered_run) >= 8 and buf.step == 0
    assert "accepted none of the last 8 groups" in buf.stalled
    assert "'all rewards equal': 8" in buf.stalled and "buffer.filter=none" in buf.stalled
    assert buf.ema >= 1e-3  # the floor: one accepted group lifts it again
    assert not buf.plan(0) or buf.dispatch_end - buf.cursor <= 4 * buf.config.max_oversample + 4


def test_on_stall_train_trains_on_the_filtered_groups_until_one_is_accepted(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path, max_filtered_batches=1, on_stall="train")  # bound: 4 groups
    while buf.step == 0:
        offer_planned(buf, equal=True)
    assert not buf.stalled and buf.stats.accepted == 0
    trained = [k for mb in buf.ready[(0, 0)] + buf.ready[(0, 1)] for k in mb.group_keys]
    assert len(set(trained)) == 4, "step 0 was not made of the filtered groups past the bound"
    buf.publish_version(1)
    offer_planned(buf, equal=False)
    assert buf.filtered_run == [] and buf.stats.accepted > 0


def play(
    buf: SamplingBuffer, accepted_at: Callable[[int], bool], groups: int, rng: random.Random | None = None,
    filtered_reward: Callable[[int], float] = lambda g: 1.0,
) -> None:
    """Controllers and trainer: generate what the buffer plans (in prompt order, or in a
    shuffled arrival order if ``rng``), a group passing the filter iff ``accepted_at(its
    position)`` (a filtered one: every sample rewarded ``filtered_reward(its position)``);
    train each step once assembled. Until ``groups`` positions were passed by the cursor
    or the buffer stalls (checked after every offer)."""
    while buf.cursor < groups and not buf.stalled:
        step = buf.step if not buf.ready else min(s for s, _ in buf.ready)
        if all((step, i) in buf.ready for i in range(buf.config.micro_batches_per_step)):
            for i in range(buf.config.micro_batches_per_step):
                buf.release(step, i)
            buf.publish_version(step + 1)
            continue
        planned = sorted((k for s in (0, 1) for k in buf.plan(s)), key=buf.position)
        assert planned, "the buffer must ask for work while a step is incomplete"
        if rng is not None:
            rng.shuffle(planned)
        for key in planned:
            g = buf.position(key)
            group = make_group(key, max(buf.min_policy_version, buf.version), equal=not accepted_at(g))
            if not accepted_at(g):
                group = dataclasses.replace(group, rewards=torch.full((len(group.rewards),), filtered_reward(g)))
            buf.offer(group)
            if buf.stalled or buf.cursor >= groups:
                return


def crawler(tmp_path: Path, name: str = "ledger.db", **overrides: object) -> SamplingBuffer:
    """A buffer with a floor of 1 accepted group in 4 over the last 8."""
    return make_buffer(tmp_path, name, **{"min_acceptance": 0.25, "acceptance_window": 8, "settled_after": 0, **overrides})


def one_in(n: int) -> Callable[[int], bool]:
    return lambda g: g % n == 0


def healthy_then(n: int, after: int) -> Callable[[int], bool]:
    """1 group in 2 accepted before position ``after``, then 1 in ``n``."""
    return lambda g: g % 2 == 0 if g < after else g % n == 0


def test_dynamic_sampling_that_crawls_stops_with_what_to_change(tmp_path: Path) -> None:
    """1 group in 2 accepted, then 1 in 5: never 2 x 4 filtered in a row (the bound), but
    below the floor."""
    buf = crawler(tmp_path, max_filtered_batches=2)
    play(buf, healthy_then(5, 24), 200)
    assert buf.stalled and buf.cursor < 200 and buf.step > 2, "a crawl went on"
    assert buf.filtered_run and "accepted none" not in buf.stalled
    assert buf.stalled.startswith("dynamic sampling accepted 1 of the last 8 groups (12%; floor: buffer.min_acceptance=0.25 over")
    assert "'all rewards equal': 7" in buf.stalled and "group mean rewards: min 0.5, mean 0.938, max 1" in buf.stalled
    for fix in ("partial credit", "buffer.filter=none", "lower buffer.min_acceptance", "buffer.on_stall=train"):
        assert fix in buf.stalled


@pytest.mark.parametrize("accepted_at", [one_in(1), one_in(2), one_in(4)], ids=["all", "half", "at-the-floor"])
def test_a_healthy_acceptance_does_not_stop(tmp_path: Path, accepted_at: Callable[[int], bool]) -> None:
    """Every window of 8 accepts 1 in 4 (exactly the floor) or more: the run goes on."""
    buf = crawler(tmp_path)
    play(buf, accepted_at, 120)
    assert not buf.stalled and buf.cursor >= 120 and len(buf.recent) == 8


def test_the_floor_is_judged_over_a_whole_window_only(tmp_path: Path) -> None:
    """One accepted group, then only filtered ones (the bound off): the first 9 groups are
    no window yet; the 10th fills it with 1 in 10."""
    buf = crawler(tmp_path, "a.db", acceptance_window=10, max_filtered_batches=0)
    play(buf, lambda g: g == 0, 100)
    assert buf.stalled and buf.cursor == 10  # (in prompt order the cursor moves one group an offer)
    assert buf.stalled.startswith("dynamic sampling accepted 1 of the last 10 groups (10%")
    buf = crawler(tmp_path, "b.db", max_filtered_batches=0)  # 1 in 4 until position 12, then 1 in 12
    play(buf, lambda g: g % 4 == 0 if g < 12 else g % 12 == 0, 100)
    assert buf.stalled and buf.cursor == 17, "positions 8-15 hold 2 groups of 8 (the floor), 9-16 one"


def test_a_crawl_is_decided_in_prompt_order_and_across_a_restart(tmp_path: Path) -> None:
    """The same crawl stops at the same group with the same report (a filtered group's
    reward tells its position): offered in prompt order, or shuffled and restarted from a
    checkpoint's snapshot taken with a whole window, a few groups before the restart."""
    accepted_at, reward = healthy_then(6, 40), (lambda g: g / 1000)
    reference = crawler(tmp_path, "ref.db")
    play(reference, accepted_at, 500, None, reward)
    assert reference.stalled and reference.cursor == 47  # (the first window below the floor: 39-46)
    assert "min 0.039, mean 0.0998, max 0.5 (the filtered groups': mean 0.0426)" in reference.stalled
    buf = crawler(tmp_path, "run.db")
    rng = random.Random(4)
    play(buf, accepted_at, 24, rng, reward)
    assert len(buf.recent) == 8 and not buf.stalled
    at_mark = buf.cursor
    buf.mark()
    play(buf, accepted_at, at_mark + 3, None, reward)
    assert buf.cursor - at_mark < 8, "the window at the restart holds groups of the snapshot's"
    buf.ledger.commit()
    restarted = crawler(tmp_path, "run.db")
    restarted.replay()
    assert restarted.replayed_from > 0 and whole_state(restarted) == whole_state(buf)
    play(restarted, accepted_at, 500, rng, reward)
    assert restarted.stalled == reference.stalled


def test_on_stall_train_trains_on_filtered_groups_while_acceptance_is_below_the_floor(tmp_path: Path) -> None:
    """1 in 8 accepted until position 40, then 1 in 2: the filtered groups are trained from
    the one that fills the first window (position 7) until the window is back at the floor."""
    buf = crawler(tmp_path, on_stall="train", max_filtered_batches=0)
    play(buf, lambda g: g % 8 == 0 if g < 40 else g % 2 == 0, 80)
    assert not buf.stalled
    trained = {buf.position(e.key) for e in buf.ledger.entries("trained")}
    assert {g for g in range(48) if g in trained} == {0} | set(range(7, 48)) - {43, 45, 47}
    assert {g for g in range(48, 72) if g in trained} == set(range(48, 72, 2))


# ---------------------------------------------------------------- settled prompts


def solved_until(epoch: int) -> Callable[[GroupKey], bool]:
    """Every third prompt comes back all-equal (solved) in the epochs before ``epoch``;
    every group has a signal from then on."""
    return lambda key: key.prompt_index % 3 != 0 or key.epoch >= epoch


def settle(buf: SamplingBuffer, signal: Callable[[GroupKey], bool], steps: int, rng: random.Random | None) -> list[GroupKey]:
    """Controllers and trainer over ``steps`` steps; returns every key the buffer planned."""
    asked: list[GroupKey] = []
    end = buf.version + steps
    while buf.version < end:
        step = buf.version  # (on-policy: the step to train is the version's)
        if all((step, i) in buf.ready for i in range(buf.config.micro_batches_per_step)):
            for i in range(buf.config.micro_batches_per_step):
                buf.release(step, i)
            buf.publish_version(step + 1)
            continue
        planned = [k for s in (0, 1) for k in buf.plan(s)]
        assert planned, "the buffer must ask for work while a step is incomplete"
        asked += planned
        if rng is not None:
            rng.shuffle(planned)
        for key in planned:
            buf.offer(make_group(key, max(buf.min_policy_version, buf.version), equal=not signal(key)))
    return asked


def visits(keys: list[GroupKey]) -> set[tuple[int, int]]:
    return {(k.epoch, k.prompt_index) for k in keys}


def test_settled_prompts_are_skipped_without_being_generated(tmp_path: Path) -> None:
    """Prompts 0, 3, 6, 9 come back all-equal: once filtered twice in a row (epochs 0 and
    1) they are settled, and from epoch 2 on only the visits their seeded coin keeps
    (settled_keep, 1 in 4) are asked for; the others are never planned, and the cursor
    passes them. The prompts with a signal are asked for every epoch."""
    buf = make_buffer(tmp_path, micro_batches_per_step=1)
    asked = visits(settle(buf, solved_until(99), 12, None))
    epochs = max(e for e, _ in asked)
    assert epochs >= 4
    for e in range(epochs):
        assert {(e, p) for p in range(N_PROMPTS) if p % 3} <= asked  # every prompt with a signal
    solved = {(e, p) for e in range(epochs) for p in range(0, N_PROMPTS, 3)}
    assert {(e, p) for e, p in solved if e < 2} <= asked  # not settled yet
    later = {(e, p) for e, p in solved if e >= 2}
    kept = later & asked
    assert 0 < len(kept) < len(later) / 2, f"{len(kept)} of {len(later)} settled visits generated"
    assert buf.settled == {p: 2 + len({e for e, q in kept if q == p}) for p in range(0, N_PROMPTS, 3)}
    skipped = len([g for g in range(2 * N_PROMPTS, buf.cursor) if (g // N_PROMPTS, buf.key_at(g).prompt_index) not in asked])
    assert skipped > 0 and buf.skipped_settled == skipped
    off = make_buffer(tmp_path, "off.db", micro_batches_per_step=1, settled_keep=1.0)
    assert solved <= visits(settle(off, solved_until(99), 12, None))  # settled_keep 1: all generated
    assert off.skipped_settled == 0


def test_a_settled_prompt_that_is_accepted_again_is_unsettled(tmp_path: Path) -> None:
    """From epoch 3 every group has a signal: a settled prompt's first kept visit is
    accepted, and its next epoch's visit is generated again (no coin)."""
    buf = make_buffer(tmp_path, micro_batches_per_step=1)
    asked = visits(settle(buf, solved_until(3), 20, None))
    epochs = max(e for e, _ in asked)
    unsettled = 0
    for p in range(0, N_PROMPTS, 3):
        kept = sorted(e for e, q in asked if q == p and e >= 3)
        if kept and kept[0] + 1 < epochs:
            assert (kept[0] + 1, p) in asked, f"prompt {p} accepted in epoch {kept[0]}, skipped after"
            unsettled += 1
    assert unsettled > 0
    passed = {e.key.prompt_index for e in buf.ledger.entries("accepted") if e.key.epoch >= 3 and buf.position(e.key) < buf.cursor}
    assert passed & set(range(0, N_PROMPTS, 3)) and not passed & set(buf.settled)


def test_a_visit_waits_for_its_prompts_previous_one_to_be_behind_the_cursor(tmp_path: Path) -> None:
    """With most groups filtered the window spans more than an epoch (12 prompts, up to 4 x
    4 positions), so a prompt's next visit can be in it while its last one is in flight:
    that visit is not asked for while the visits in flight could settle the prompt (its
    record + them >= settled_after), so whether it is skipped never depends on which group
    arrived first."""
    buf = make_buffer(tmp_path, micro_batches_per_step=1, max_oversample=4.0)
    rng = random.Random(7)
    waited = 0
    while buf.version < 12:
        if (buf.version, 0) in buf.ready:
            buf.release(buf.version, 0)
            buf.publish_version(buf.version + 1)
            continue
        planned = [k for s in (0, 1) for k in buf.plan(s)]
        window = range(buf.cursor, buf.dispatch_end)
        for key in planned:
            earlier = [e for e in range(key.epoch) if buf.position(dataclasses.replace(key, epoch=e, attempt=0)) >= buf.cursor]
            assert not earlier or buf.settled.get(key.prompt_index, 0) + len(earlier) < 2, key
        waited += sum(g >= N_PROMPTS and g not in buf.decided and buf._settled(g) == "wait" for g in window)
        rng.shuffle(planned)
        for key in planned[: max(1, len(planned) // 2)]:  # half of it arrives: the rest stays in flight
            buf.offer(make_group(key, max(buf.min_policy_version, buf.version), equal=key.prompt_index % 4 != 0))
    assert waited > 0, "no visit ever waited: the window never spanned a prompt's two visits"


def test_a_small_dataset_is_not_held_back_by_the_wait(tmp_path: Path) -> None:
    """2 prompts, 4 groups a step: a step spans 2 epochs. A visit whose earlier ones are in
    flight waits only if they could settle its prompt (2 all-equal in a row): at the start
    none has a record, so the whole step is asked for at once."""
    config = BufferConfig(groups_per_step=4, group_size=2, micro_batches_per_step=1)
    buf = SamplingBuffer(config, num_prompts=2, num_shards=1, world_size=1, seed=0, ledger=Ledger(tmp_path / "l.db"))
    assert len(buf.plan(0)) == 4


def test_skipping_settled_prompts_does_not_depend_on_arrival_order_or_a_restart(tmp_path: Path) -> None:
    """The same steps, skips and record in prompt order, shuffled, and replayed from the
    ledger (whole, and from a checkpoint's snapshot) mid-run."""
    reference = make_buffer(tmp_path, "ref.db", micro_batches_per_step=1)
    settle(reference, solved_until(4), 16, None)
    buf = make_buffer(tmp_path, "run.db", micro_batches_per_step=1)
    rng = random.Random(3)
    settle(buf, solved_until(4), 7, rng)
    buf.mark()
    settle(buf, solved_until(4), 2, rng)
    assert buf.skipped_settled > 0
    buf.ledger.commit()
    restarted = make_buffer(tmp_path, "run.db", micro_batches_per_step=1)
    restarted.replay()
    assert restarted.replayed_from > 0 and state(restarted) == state(buf)
    db = sqlite3.connect(tmp_path / "whole.db")
    buf.ledger._db.backup(db)
    db.execute("DELETE FROM snapshots")
    db.commit()
    db.close()
    whole = make_buffer(tmp_path, "whole.db", micro_batches_per_step=1)
    whole.replay()
    assert state(whole) == state(buf)
    trained = [(e.step, e.key.epoch, e.key.prompt_index) for e in reference.ledger.entries("trained")]
    settle(restarted, solved_until(4), 7, rng)
    again = [(e.step, e.key.epoch, e.key.prompt_index) for e in restarted.ledger.entries("trained")]
    assert sorted(again) == sorted(trained)
    assert restarted.skipped_settled == reference.skipped_settled and restarted.settled == reference.settled


def test_step_report_by_hand() -> None:
    """Two groups of one step, the filtered one first: hand-computed statistics, and the
    rollout sample takes the trained group first."""
    def group(index: int, rewards: list[float], digits: list[float], failures: list[str], lengths: list[int],
              reasons: list[str]) -> ScoredGroup:
        base = make_group(GroupKey(epoch=0, shard=0, prompt_index=index), 0)
        return dataclasses.replace(
            base, rewards=torch.tensor(rewards), scores={"digits": torch.tensor(digits)}, failures=failures,
            completion_ids=[torch.ones(L, dtype=torch.int32) for L in lengths], finish_reasons=reasons,
        )

    trained = group(1, [1.0, 0.0], [1.0, 0.5], ["", "digits: TypeError: boom"], [2, 4], ["stop", "length"])
    filtered = group(2, [1.0, 1.0], [1.0, 1.0], ["", ""], [1, 3], ["stop", "stop"])
    values, sample = step_report([(filtered, False), (trained, True)], rollouts=1)
    assert values == pytest.approx({
        "reward/mean": 0.75, "reward/std": 0.1875**0.5, "reward/failed_share": 0.25,
        "response_length/mean": 2.5, "response_length/max": 4.0, "response_length/clip_ratio": 0.25,
        "groups": 2.0, "groups/trained": 1.0, "groups/filtered_share": 0.5,
        "reward/digits/mean": 0.875, "reward/digits/std": 0.046875**0.5,
    })
    assert sample == [trained]
    assert step_report([], rollouts=4) == ({"reward/mean": pytest.approx(float("nan"), nan_ok=True), "groups": 0.0, "groups/trained": 0.0}, [])


def test_a_snapshot_naming_a_group_the_ledger_lacks_is_passed_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    buf = make_buffer(tmp_path, "run.db")
    drive(buf, 2, random.Random(1))
    mid_step(buf)
    seq = buf.mark()
    state_blob = json.loads(buf.ledger._db.execute("SELECT state FROM snapshots WHERE seq = ?", (seq,)).fetchone()[0])
    state_blob["decided"][0][1][3] = 99  # an attempt no row has
    buf.ledger._db.execute("UPDATE snapshots SET state = ? WHERE seq = ?", (json.dumps(state_blob).encode(), seq))
    restarted = make_buffer(tmp_path, "run.db")
    assert restarted.replay() == len(buf.ledger.events()) and restarted.replayed_from == 0
    assert whole_state(restarted) == whole_state(buf)
    assert "names groups the ledger lacks" in caplog.text


def _whole_ledger_replay(buf: SamplingBuffer, path: Path, world_size: int) -> SamplingBuffer:
    """A buffer replaying a copy of ``buf``'s ledger without its snapshots."""
    db = sqlite3.connect(path)
    buf.ledger._db.backup(db)
    db.execute("DELETE FROM snapshots")
    db.commit()
    db.close()
    whole = SamplingBuffer(buf.config, num_prompts=N_PROMPTS, num_shards=2, world_size=world_size, seed=3,
                           ledger=Ledger(path), total_steps=buf.total_steps)  # fmt: skip
    whole.replay()
    return whole


@pytest.mark.parametrize("seed", range(60))  # (41, 46 and 51 found the reason left behind)
def test_a_replay_from_a_snapshot_equals_the_whole_ledgers_in_random_runs(tmp_path: Path, seed: int) -> None:
    """Random configs (staleness, waves, filter, the bound, the floor and on_stall, run length, world
    size) and random runs: offers in any order, some stale, some made with weights a rewind
    discarded, duplicates, old attempts, trained steps and their reports, checkpoint marks,
    rewinds to one of them (the group's size changing with it) and restarts. After every
    rewind and restart, the buffer rebuilt from the newest snapshot is the one rebuilt from
    the whole ledger. (A review's fuzz found a filter reason left behind by a superseded
    group this way.)"""
    rng = random.Random(seed)
    config = BufferConfig(
        groups_per_step=4, group_size=rng.choice([2, 4]), micro_batches_per_step=rng.choice([1, 2]),
        max_staleness=rng.choice([0, 1, 2]), filter=rng.choice(["all_equal", "none"]),
        max_filtered_batches=rng.choice([0, 1, 2, 10]), on_stall=rng.choice(["error", "train"]),
        min_acceptance=rng.choice([0.0, 0.3, 0.6]), acceptance_window=rng.choice([1, 4, 10]),
    )  # fmt: skip
    world_size, total_steps, p_equal = rng.choice([1, 2]), rng.choice([None, 5]), rng.choice([0.2, 0.5, 0.9])

    def fresh(path: Path) -> SamplingBuffer:
        return SamplingBuffer(config, num_prompts=N_PROMPTS, num_shards=2, world_size=world_size, seed=3,
                              ledger=Ledger(path), total_steps=total_steps)  # fmt: skip

    buf, marks, offered, restarts = fresh(tmp_path / "run.db"), [0], [], 0
    for _ in range(80):
        action = rng.choices(["offer", "train", "mark", "rewind", "restart", "again"], [10, 4, 2, 1, 1.5, 1])[0]
        if action == "offer":
            planned = [k for s in (0, 1) for k in buf.plan(s)]
            rng.shuffle(planned)
            for key in planned[: rng.randint(1, max(1, len(planned)))]:
                version, r = max(buf.min_policy_version, buf.version), rng.random()
                version = buf.version + 1 if r < 0.1 else max(0, buf.version - rng.randint(1, 3)) if r < 0.2 else version
                offered.append(make_group(key, version, n=config.group_size, equal=rng.random() < p_equal))
                buf.offer(offered[-1])
        elif action == "again" and offered:
            group = rng.choice(offered)
            buf.offer(group)  # a duplicate, and a stale attempt
            buf.offer(make_group(dataclasses.replace(group.group_key, attempt=group.group_key.attempt + 7), buf.version, n=config.group_size))
        elif action == "train" and buf.ready:
            step = min(s for s, _ in buf.ready)
            if all((step, i) in buf.ready for i in range(config.micro_batches_per_step)):
                for i in range(config.micro_batches_per_step):
                    buf.release(step, i)
                buf.publish_version(step + 1)
                if rng.random() < 0.7:  # the trainer's step report (yatt/rl/buffer.py)
                    buf.step_groups.pop(step, None) if step < buf.version else None
        elif action == "mark":
            marks.append(buf.mark())
        elif action in ("rewind", "restart"):
            if action == "rewind":
                mark = rng.choice(marks)
                marks = [m for m in marks if m <= mark]
                buf.ledger.rewind(mark, "a trainer group restarted")
                world_size = rng.choice([1, 2]) if rng.random() < 0.3 else world_size
            buf.ledger.commit()
            restarts += 1
            restarted = fresh(buf.ledger.path)
            restarted.replay()
            whole = _whole_ledger_replay(buf, tmp_path / f"whole{restarts}.db", world_size)
            assert whole_state(restarted) == whole_state(whole), f"{action} {restarts}, from row {restarted.replayed_from}"
            buf.ledger.close()
            buf = restarted


@pytest.mark.parametrize("snapshot", [False, True], ids=["whole-ledger", "from-a-snapshot"])
def test_a_restart_keeps_the_report_of_the_step_trained_last(tmp_path: Path, snapshot: bool) -> None:
    """Rank 0 asks for a step's report after publishing the version it trained: a buffer
    restarted in between must still have that step's groups (it had none: the step's
    metrics line said ``groups 0``, reward NaN, and the run's last line ``-> nan``)."""
    buf = make_buffer(tmp_path, "run.db")
    drive(buf, 3, random.Random(4))  # steps 0-2 trained, version 3 published, step 2 not reported
    if snapshot:
        buf.mark()
    buf.ledger.commit()
    before = step_report(buf.step_groups[2], rollouts=0)[0]
    assert before["groups"] > 0
    again = make_buffer(tmp_path, "run.db")
    again.replay()
    assert (again.replayed_from > 0) == snapshot
    assert step_report(again.step_groups.get(2, []), rollouts=0)[0] == before
    assert 1 not in again.step_groups, "older steps' groups are not kept"
