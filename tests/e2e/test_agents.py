"""Multi-turn episodes through the launcher: every role started as in any run, the
controllers driving episodes against a user environment (Gymnasium's convention) and
against tools, the trainer training rows with holes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.faults import REPO, launch_run
from launch.config import load_run_config

pytestmark = pytest.mark.slow


def run(run_dir: Path, *items: str) -> None:
    proc = launch_run(run_dir, list(items))
    code = proc.wait(timeout=600)
    log = (run_dir.parent / f"{run_dir.name}.launcher.log").read_text(errors="replace")
    assert code == 0, log[-4000:]


def warm_started_as(reference: Path, run_dir: Path) -> None:
    """Start ``run_dir``'s run from ``reference``'s warm-started model (its ``model/``, which
    the launcher then neither builds nor warm-starts again), for tests that compare two runs
    token for token: what they compare is what the kill or the hosting changes, not whether
    two warm starts agree to the last bit (under pytest on the Intel Xeon with AMX, one
    agent_guess warm start in ~8 ended at other float32 weights, loss 0.12913 against
    0.12870, and every later token differed; 8 launches outside pytest, loaded or not, all
    agreed; not explained)."""
    shutil.copytree(reference / "model", run_dir / "model")


def lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("example", ["agent_guess", "agent_calculator", "agent_client"])  # (agent_openai: below)
def test_the_agent_examples_run_episodes(tmp_path: Path, example: str) -> None:
    run_dir = tmp_path / example
    run(run_dir, str(REPO / "examples" / f"{example}.yaml"), "run.steps=3", "model.warm_start_steps=20", "run.eval_every=0",
        "buffer.filter=none")  # (the loop, not learning: 20 warm-start steps teach next to nothing)
    rows = lines(run_dir / "metrics.jsonl")
    assert [int(r["step"]) for r in rows] == [0, 1, 2]  # type: ignore[call-overload]
    assert all("episode/turns/mean" in r and "episode/obs_share" in r for r in rows)
    rollouts = lines(run_dir / "rollouts.jsonl")
    assert rollouts and all(r["turns"] and r["ended"] for r in rollouts)
    if example in ("agent_guess", "agent_client"):  # (the game, as an environment and as agent code)
        # Several turns, the environment's answer between them, its reward in the row.
        assert max(len(r["turns"]) for r in rollouts) > 1  # type: ignore[arg-type]
        assert any("Higher." in t["observation"] or "Lower." in t["observation"] for r in rollouts for t in r["turns"])  # type: ignore[attr-defined]
        assert all("env" in r["scores"] for r in rollouts)  # type: ignore[operator]
        assert any(float(r["episode/obs_share"]) > 0 for r in rows)  # type: ignore[arg-type]


LEARNED = 0.2
"""How much the agent examples' held-out greedy success must rise over their 20 steps
(issues 31 and 34). An AMD EPYC without AMX (2026-12-06), run.seed 0: agent_guess and
agent_client (the same game as agent code: the same tokens) 0.61 -> 1.00, agent_calculator
0.16 -> 0.46, agent_openai 0.17 -> 0.41 at step 20 (in the env role as in the controllers:
the same tokens); an Intel Xeon with AMX (2026-12-07): agent_openai 0.13 -> 0.30 at step 20
(its fp32 kernels sample other tokens), 0.40 at step 30, its steps since; agent_calculator with trainer.lr=1e-9 (no learning) 0.16 -> 0.16. agent_client is
not run here: it trains agent_guess's tokens (its run's episodes are checked against an
undisturbed one in the kill tests). agent_openai runs its agent in the controllers here
(env.inline=true): in the env role it trains the same tokens (the test after this one),
at 2.4x this run's time on 2 cores (a process and an endpoint an episode, 64 a step)."""


@pytest.mark.parametrize(
    ("example", "items"),
    [pytest.param("agent_guess", [], id="agent_guess"), pytest.param("agent_calculator", [], id="agent_calculator"),
     pytest.param("agent_openai", ["env.inline=true"], id="agent_openai")],
)  # fmt: skip
def test_the_agent_examples_learn(tmp_path: Path, example: str, items: list[str]) -> None:
    """The examples as shipped (their warm start plays the rows' demonstrations through the
    same game, tool loop or agent code): the held-out share of games won (halving the range)
    or of right answers to two-digit sums (calling the calculator) rises."""
    run_dir = tmp_path / example
    run(run_dir, str(REPO / "examples" / f"{example}.yaml"), *items)
    evals = lines(run_dir / "eval.jsonl")
    steps = load_run_config(REPO / "examples" / f"{example}.yaml").run.steps
    assert [int(e["step"]) for e in evals] == list(range(0, steps + 1, 10))  # type: ignore[call-overload]
    start, end = (float(e["eval/reward/accuracy"]) for e in (evals[0], evals[-1]))  # type: ignore[arg-type]
    assert round(end - start, 6) >= LEARNED, f"held-out success {start:.2f} -> {end:.2f}, less than +{LEARNED}"
    rollouts = lines(run_dir / "rollouts.jsonl")
    if example == "agent_guess":  # (won after feedback: a game of several turns)
        assert any(len(r["turns"]) > 1 and float(r["reward"]) == 1.0 for r in rollouts)  # type: ignore[arg-type]
    else:  # (the calculator called, and the answer right)
        assert any("<tool>calculator(" in str(r["completion"]) and float(r["reward"]) == 1.0 for r in rollouts)  # type: ignore[arg-type]


def test_agent_code_in_the_env_role_trains_the_tokens_it_trains_in_the_controllers(tmp_path: Path) -> None:
    """agent_openai's agent (the openai SDK against an endpoint) run in the env role (the
    default: a process and an endpoint of its own an episode, OPENAI_BASE_URL set) and in
    the controllers (env.inline=true): every group trains the same episodes, token for
    token, so what the inline run learns (above) the hosted one learns."""
    items = [str(REPO / "examples" / "agent_openai.yaml"), "run.steps=3", "model.warm_start_steps=100", "run.eval_every=0",
             "placement.layout=disaggregated", "buffer.filter=none"]  # fmt: skip
    run(tmp_path / "hosted", *items)
    warm_started_as(tmp_path / "hosted", tmp_path / "inline")
    run(tmp_path / "inline", *items, "env.inline=true")
    assert (tmp_path / "hosted" / "logs" / "env-0.log").exists() and not (tmp_path / "inline" / "logs" / "env-0.log").exists()
    rollouts = lines(tmp_path / "hosted" / "rollouts.jsonl")
    assert rollouts and all(r["turns"] and r["ended"] for r in rollouts)
    hosted, inline = accepted_episodes(tmp_path / "hosted"), accepted_episodes(tmp_path / "inline")
    assert len(hosted) == 3 * 8 and hosted == inline


def test_an_environment_that_does_not_load_stops_the_run_before_it_starts(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "launch", "run", str(REPO / "examples" / "agent_guess.yaml"), "env.kwargs.high=1",
         "--run-dir", str(tmp_path / "run"), "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    said = out.stderr.strip().splitlines()
    assert said[-1].startswith("yatt: config error: env.class: 'yatt.rl.agents.games:GuessNumber' cannot be made"), said
    assert "high must be >= 2" in said[-1] and not (tmp_path / "run" / "logs").exists()


def recorded_turns(run_dir: Path) -> list[tuple[int, int, int, int]]:
    """(shard, prompt_index, sample, turn) of each turn the ledger holds now."""
    import sqlite3

    if not (run_dir / "ledger.db").exists():
        return []
    db = sqlite3.connect(f"file:{run_dir / 'ledger.db'}?mode=ro", uri=True)
    try:
        return [tuple(r) for r in db.execute("SELECT shard, prompt_index, sample, turn FROM turns")]
    except sqlite3.OperationalError:  # (the buffer has not made the table yet)
        return []
    finally:
        db.close()


def accepted_episodes(run_dir: Path) -> dict[str, list[list[int]]]:
    """Each trained group's episodes (token ids after the prompt), by group key."""
    from yatt.rl.ledger import Ledger
    from yatt.rl.sampling import unpack

    ledger = Ledger(run_dir / "ledger.db")
    try:
        trained = sorted({e.key for e in ledger.entries("trained")}, key=lambda k: k.as_str())
        return {
            key.as_str(): [ids.tolist() for ids in unpack(e.payload or b"").completion_ids]
            for key, e in ledger.decided(trained, 1 << 62).items()
        }  # fmt: skip
    finally:
        ledger.close()


KILL_ITEMS = {
    example: [str(REPO / "examples" / f"{example}.yaml"), "run.steps=4", "placement.layout=disaggregated", "env.inline=false"]
    for example in ("agent_guess", "agent_client")  # an environment; agent code (hosted in the env role)
}


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The run dir of an example's kill-test run with nothing killed (made once, on first
    use): the episodes every group trains there, and the warm-started model the killed
    runs start from."""
    done: dict[str, Path] = {}

    def reference(example: str) -> Path:
        if example not in done:
            done[example] = tmp_path_factory.mktemp(example) / "undisturbed"
            run(done[example], *KILL_ITEMS[example])
        return done[example]

    return reference


@pytest.mark.parametrize(
    ("example", "role", "says"),
    [
        ("agent_guess", "controller", "resumes after turn"),  # its episodes go on after their recorded turns
        ("agent_guess", "env", "rebuilt on"),  # each episode of the env worker reset and its actions stepped again elsewhere
        ("agent_guess", "generator", "re-issuing"),  # the turns in flight asked again
        ("agent_client", "controller", "resumes after turn"),  # the function run again, its recorded calls answered from the ledger
        ("agent_client", "env", "rebuilt on"),  # its process gone with its worker: the function run again with the replies it had
    ],
)
def test_a_role_killed_mid_episode_loses_no_turn(
    tmp_path: Path, undisturbed: Callable[[str], Path], example: str, role: str, says: str
) -> None:
    """SIGKILL a controller, the env worker or the generator once the ledger holds the
    second turn of an episode (of 4), of an environment (agent_guess) or of agent code
    hosted in the env role (agent_client, ``env.episode``): the launcher restarts it, the
    episodes go on (the controllers' logs say how: agent code runs again with its calls up
    to the one in flight answered as before, from the ledger or from the controller's record
    of the replies it gave), and every group trains the same episodes, token for token, as
    an undisturbed run."""
    reference = undisturbed(example)  # (its run first: not beside the one to be killed)
    run_dir = tmp_path / "killed"
    warm_started_as(reference, run_dir)
    proc = launch_run(run_dir, KILL_ITEMS[example], env={"YATT_LOG_LEVEL": "INFO"})
    kill_mid_episode(run_dir, proc, role, says, accepted_episodes(reference))


def kill_mid_episode(
    run_dir: Path, proc: subprocess.Popen[bytes], role: str, says: str, undisturbed: dict[str, list[list[int]]]
) -> None:
    """SIGKILL ``role`` once the ledger holds an episode's second turn; the run must finish,
    its controllers' logs say ``says`` and every group train ``undisturbed``'s episodes."""
    import os
    import signal
    import time

    from benchmarks.fuzzing import role_processes

    deadline = time.monotonic() + 300
    while not (second := [t for t in recorded_turns(run_dir) if t[3] == 1]):
        assert time.monotonic() < deadline and proc.poll() is None, "no episode reached its second turn"
        time.sleep(0.02)
    victim = f"controller-{second[0][0]}" if role == "controller" else f"{role}-0"
    os.kill(role_processes(run_dir)[victim], signal.SIGKILL)
    code = proc.wait(timeout=600)
    log = (run_dir.parent / f"{run_dir.name}.launcher.log").read_text(errors="replace")
    assert code == 0, log[-4000:]
    assert f"{victim} exited" in log
    controllers = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("controller-*.log"))
    assert says in controllers, controllers[-3000:]
    episodes = accepted_episodes(run_dir)
    assert len(episodes) == 4 * 8 and episodes == undisturbed

