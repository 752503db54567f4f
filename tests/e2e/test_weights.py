"""Weights in a run that loses a process while they move: a generator killed while it
loads a weight update (README, "What survives what"). Rank 0's cut-off push is the other
row of that table; the generator's side of it is tested in-process
(``tests/workers/test_generator.py``), where the buckets it got can be chosen."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.e2e.test_loop import finish, launch, metrics

pytestmark = pytest.mark.slow

LOGPROB_DIFF = 1e-5
"""Bound on a step's mean |trainer - rollout| log-prob per token when the generator holds
the trainer's weights of the version it reports: 3e-7 to 5e-7 measured here (float32 on
CPU). A generator that reported version 3 on the base weights was off by 0.52."""


def spans(run_dir: Path, process: str) -> list[dict[str, float | str]]:
    return [json.loads(line) for line in (run_dir / "trace" / f"{process}.jsonl").read_text().splitlines()]


def test_a_generator_killed_loading_weights_serves_only_once_it_holds_the_current_ones(tmp_path: Path) -> None:
    """generator-0, the run's only generator, is SIGKILLed as it starts loading version 3
    (a failpoint), rank 0's bucket in flight. The restarted process holds the base weights
    (version 0): it makes no engine call before rank 0 pushed it the current weights, the
    first it loads are version 3's (before rank 0 pushes version 4), every completion after
    carries the version of its step (on-policy), and the generator's log-probs are the
    trainer's on every step: it holds rank 0's weights of the version it reports."""
    run_dir = tmp_path / "run"
    spec = "generator-0:weight_load:3"
    proc = launch(run_dir, "run.steps=6", "run.eval_every=0", "placement.layout=disaggregated", "run.trace=true", failpoint=spec)
    finish(proc, run_dir)
    launcher_log = (tmp_path / "run.launcher.log").read_text()
    assert "generator-0 exited with code -9; restarting it" in launcher_log, launcher_log[-3000:]
    assert f"failpoint {spec}: SIGKILL entering span 'weight_load' #3" in (run_dir / "logs" / "generator-0.log").read_text()
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert re.search(r"lost: .*failing [1-9]\d* in-flight request", trainer_log), "rank 0 had no bucket in flight to it"

    killed = float((run_dir / "failpoints" / spec.replace(":", "_")).read_text())
    restarted = [s for s in spans(run_dir, "generator-0") if float(s.get("start", 0.0)) > killed]
    loads = [s for s in restarted if s["kind"] == "weight_load"]
    generates = [s for s in restarted if s["kind"] == "generate"]
    assert loads and generates, "the restarted generator loaded or served nothing"
    first_load_end = float(loads[0]["start"]) + float(loads[0]["duration"])
    assert float(generates[0]["start"]) >= first_load_end, "the restarted generator served before it got the weights"
    next_push = min(float(s["start"]) for s in spans(run_dir, "trainer-0") if s["kind"] == "weight_push" and float(s["start"]) > killed)
    assert float(loads[0]["start"]) < next_push, "its first weights were not the current version's (3)"

    rows = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == set(range(6))
    assert all(r["policy_version"] == r["step"] for r in rows), sorted({(r["step"], r["policy_version"]) for r in rows})
    diffs = [m["train/logprob_diff"] for m in metrics(run_dir)]
    assert len(diffs) == 6 and max(diffs) <= LOGPROB_DIFF, f"the generator's log-probs are not the trainer's: {diffs}"
