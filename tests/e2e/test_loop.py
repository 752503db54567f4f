"""The whole loop as processes, started by ``python -m launch run`` as a user would.

These are the slowest tests of the suite (a few minutes on 2 cores); they use the
built-in default job, shortened through overrides where the property does not need the
full run.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from benchmarks.faults import launch_run, training_prompts
from benchmarks.fuzzing import dealer, fuzz, launcher_ports, role_ports, role_processes
from launch.config import DEFAULT_CONFIG, load_run_config
from tests.learning import assert_default_job_learned
from workers.trainer_rank import read_consumed
from yatt.rl.ledger import Ledger
from yatt.rl.sampling import epoch_order
from yatt.runtime.run_dir import read_jsonl
from yatt.runtime.trace import SLOW_TRAIN_ENV

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def launch(
    run_dir: Path, *overrides: str, resume: Path | None = None, failpoint: str = "", env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    return launch_run(run_dir, list(overrides), resume=resume, failpoint=failpoint, env=env)


def finish(proc: subprocess.Popen[bytes], run_dir: Path, timeout: float = 900) -> None:
    code = proc.wait(timeout=timeout)
    log = (run_dir.parent / f"{run_dir.name}.launcher.log").read_text(errors="replace")
    assert code == 0, f"launcher exited {code}:\n{log[-4000:]}"


def metrics(run_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def trained_keys(run_dir: Path) -> dict[int, list[str]]:
    ledger = Ledger(run_dir / "ledger.db")
    try:
        steps: dict[int, list[str]] = {}
        for e in ledger.entries("trained"):
            assert e.step is not None
            steps.setdefault(e.step, []).append(e.key.as_str())
        return steps
    finally:
        ledger.close()


def wait_for(predicate: object, timeout: float, every: float = 0.5) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(every)


def role_pid(run_dir: Path, role: str, index: int, launcher: subprocess.Popen[bytes]) -> int:
    """The pid of a role process of the run."""
    pid = role_processes(run_dir).get(f"{role}-{index}")
    assert pid is not None, f"no {role}-{index} process of {run_dir}"
    return pid


LAYOUTS = ["auto", "colocated", "partial", "disaggregated"]


def layout_args(layout: str) -> tuple[str, ...]:
    return () if layout == "auto" else (f"placement.layout={layout}",)


def planned_layout(run_dir: Path) -> str:
    return str(json.loads((run_dir / "plan.json").read_text())["layout"])


def replies_to_stats(endpoint: str, keys: Path | None, *, authorised: bool) -> bool:
    """Whether a ``Query("stats")`` sent to ``endpoint`` gets any reply within 3 s: without
    CURVE (keys None), or as a CURVE client with the run's server key and either the run's
    client key (authorised) or a key of its own."""
    import zmq

    from protocols.codec import encode
    from protocols.messages import Query
    from yatt.runtime.actor import request_id

    ctx = zmq.Context()
    sock = dealer(ctx, endpoint, keys, authorised=authorised)
    try:
        sock.send_multipart([request_id(7), *(bytes(f) for f in encode(Query(what="stats")))])
        return bool(sock.poll(3000))
    finally:
        sock.close()
        ctx.term()


def assert_only_the_runs_keys_reach_handlers(run_dir: Path, proc: subprocess.Popen[bytes]) -> None:
    import psutil

    buffer = psutil.Process(role_pid(run_dir, "buffer", 0, proc))
    ports = [c.laddr.port for c in buffer.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    assert ports, "the buffer listens on no port"
    keys = run_dir / "keys"
    assert (keys / "client.key_secret").stat().st_mode & 0o077 == 0, "the run's secret key is readable by others"
    for port in ports:
        endpoint = f"tcp://127.0.0.1:{port}"
        assert not replies_to_stats(endpoint, None, authorised=False), "a client without CURVE got a reply"
        assert not replies_to_stats(endpoint, keys, authorised=False), "a client with its own key got a reply"
    assert any(replies_to_stats(f"tcp://127.0.0.1:{port}", keys, authorised=True) for port in ports)
    # Nothing of the run listens off loopback: the registry, the actors, the launcher's
    # torch.distributed store, gloo's sockets of the trainer ranks.
    launcher = psutil.Process(proc.pid)
    listening = [
        (p.name(), c.laddr) for p in [launcher, *launcher.children(recursive=True)]
        for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN
    ]
    assert len(listening) > len(ports), listening
    assert all(ipaddress.ip_address(addr.ip).is_loopback for _, addr in listening), listening


@pytest.mark.parametrize("layout", LAYOUTS)
def test_default_job_learns(tmp_path: Path, layout: str) -> None:
    run_dir = tmp_path / "default"
    ranks = ["trainer.world_size=0"] if layout == "auto" else []  # auto: the plan picks the ranks too
    proc = launch(run_dir, *layout_args(layout), *ranks)
    if layout == "auto":  # while it runs: only the run's own processes can talk to it
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 2, 600)
        assert_only_the_runs_keys_reach_handlers(run_dir, proc)
        # The launcher checked, planned, hosts the ranks' store and writes the placement's
        # TensorBoard scalars without loading torch (~200 MB): its children do all of that.
        loaded = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" not in loaded and "transformers" not in loaded, "the launcher loaded torch"
    if layout == "disaggregated":  # while it runs: junk into every port crashes, hangs and poisons nothing
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 2, 600)
        registry = launcher_ports(proc.pid, run_dir)
        assert len(registry) == 2, registry  # its requests and its membership feed
        ports = [port for listed in role_ports(run_dir).values() for port in listed] + registry
        assert len(ports) >= 8, ports
        with_keys = fuzz(ports, 10_000, keys=run_dir / "keys", authorised=True)
        assert with_keys.replies > 100, "the fuzz reached no handler"
        assert fuzz(ports, 1_000, keys=run_dir / "keys", authorised=False, seed=1).replies == 0
        assert len(metrics(run_dir)) < 40, "the run ended before the fuzz did"
    finish(proc, run_dir)
    if layout == "disaggregated":
        log = (run_dir.parent / f"{run_dir.name}.launcher.log").read_text()
        assert "exited with code" not in log and "stopped answering" not in log, log[-3000:]
    rows = metrics(run_dir)
    assert_default_job_learned(rows, run_dir)
    if ranks:  # the plan's count, written where the roles and a resume read it
        planned = sum(a["role"] == "trainer" for a in json.loads((run_dir / "plan.json").read_text())["assignments"])
        assert planned >= 1 and load_run_config(run_dir / "config.yaml").trainer.world_size == planned
    # The launcher's last line: the headline, from the first evaluation to the last.
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    first, last = evals[0]["eval/reward/accuracy"], evals[-1]["eval/reward/accuracy"]
    headline = f"held-out greedy accuracy (eval/reward/accuracy, eval.jsonl) {first:.2f} at step 0 -> {last:.2f} at step 80"
    assert headline in (run_dir.parent / f"{run_dir.name}.launcher.log").read_text()
    assert f"; curves in {run_dir / 'curves.png'}" in (run_dir.parent / f"{run_dir.name}.launcher.log").read_text()
    assert (run_dir / "curves.png").stat().st_size > 10_000
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert {"samples_per_s", "staleness/mean", "time/step_s", "buffer/accepted"} <= set(rows[-1])
    assert {"reward/repeated/mean", "reward/failed_share", "response_length/mean", "response_length/clip_ratio"} <= set(rows[-1])
    # What the model wrote, as text, with what each scorer gave it: 2 groups of 8 per step.
    rollouts = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert Counter(r["step"] for r in rollouts) == {step: 16 for step in range(len(rows))}
    assert all(r["prompt"] and set(r["scores"]) == {"repeated"} and r["failure"] == "" for r in rollouts)
    assert any(r["completion"] and r["reward"] > 0 for r in rollouts)
    if layout == "auto":
        assert planned_layout(run_dir) in LAYOUTS[1:]
        assert "placement: " in (run_dir.parent / "default.launcher.log").read_text()
        # generator.backend=auto: 80 steps of ~0.2 s are over before vLLM could have started
        assert "yatt: generator: transformers (generator.backend=auto: the whole run is planned at " in (
            run_dir.parent / "default.launcher.log").read_text()
        assert load_run_config(run_dir / "config.yaml").generator.backend == "transformers"
    else:
        assert planned_layout(run_dir) == layout
    if planned_layout(run_dir) == "colocated":  # each rank's engine and training took turns
        assert all(r["time/switch_s"] > 0 for r in rows)


@pytest.mark.gpu
def test_the_default_job_trains_on_a_gpu(tmp_path: Path) -> None:
    """The default job on one GPU (one trainer rank hosting the generator engine): every
    collective of a step on the device NCCL reduces, the weights pushed to the engine, the
    trainer's and the engine's device memory shared by turns."""
    run_dir = tmp_path / "gpu"
    finish(launch(run_dir, "trainer.world_size=1", "run.steps=6", "run.eval_every=0"), run_dir, timeout=600)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(6))
    assert [r["buffer/policy_version"] for r in rows[:-1]] == list(range(1, 6))  # pushed to the engine
    plan = json.loads((run_dir / "plan.json").read_text())
    trainer = [a for a in plan["assignments"] if a["role"] == "trainer"]
    assert plan["layout"] == "colocated" and [a["slots"] for a in trainer] == [[0]], plan  # GPU 0


def prompt_of(key: str) -> tuple[int, int]:
    """(epoch, prompt index) of a group key written as ``GroupKey.as_str``: e0/s1/p23/a0."""
    epoch, _, prompt, _ = (int(part[1:]) for part in key.split("/"))
    return epoch, prompt


def assert_exactly_once(run_dir: Path, steps: int) -> dict[int, dict[int, list[str]]]:
    """No group was committed or trained twice, no prompt trained twice in its epoch (under
    two attempts), every step trained, and no prompt of the epoch's order before the last
    trained one is missing. From the trainer's side too: what the ranks record they trained
    (``consumed/``, the last time of a step trained again) is, step by step, what the
    ledger says the step trained, each group's samples once over the ranks. Returns that
    record: step -> rank -> the group key of each row it trained."""
    cfg = load_run_config(run_dir / "config.yaml")
    ledger = Ledger(run_dir / "ledger.db")
    try:
        accepted = Counter(e.key for e in ledger.entries("accepted"))
        assert accepted and max(accepted.values()) == 1, "a group was committed twice"
        trained = Counter(e.key for e in ledger.entries("trained"))
        assert max(trained.values()) == 1, "a group was trained twice"
        prompts = Counter((e.key.epoch, e.key.prompt_index) for e in ledger.entries("trained"))
        assert max(prompts.values()) == 1, "a prompt was trained twice in its epoch (under two attempts)"
        assert max(e.step or 0 for e in ledger.entries("trained")) == steps - 1
        # The final word on a prompt is the last entry of its newest attempt, duplicates
        # (a restarted controller re-delivering) aside.
        final: dict[int, tuple[int, str]] = {}
        for e in ledger.entries():
            assert e.key.epoch == 0
            attempt, _ = final.get(e.key.prompt_index, (-1, ""))
            if e.status != "duplicate" and e.key.attempt >= attempt:
                final[e.key.prompt_index] = (e.key.attempt, e.status)
        order = epoch_order(training_prompts(run_dir), load_run_config(None).run.seed, 0)
        last = max(order.index(i) for i, (_, status) in final.items() if status == "trained")
        assert all(final.get(order[p], (0, "missing"))[1] in ("trained", "filtered") for p in range(last + 1))
    finally:
        ledger.close()
    # Every step's metrics line has its groups (a buffer restarted between a step's publish
    # and rank 0's ask for its report once lost them: groups 0, reward NaN).
    reported = [(int(r["step"]), r.get("groups", 0.0), r.get("reward/mean")) for r in metrics(run_dir)]
    assert all(groups > 0 and reward == reward for _, groups, reward in reported), [r for r in reported if not r[1] > 0]
    consumed, handed_out = read_consumed(run_dir), trained_keys(run_dir)
    assert list(consumed) == list(range(steps)), f"the ranks recorded steps {list(consumed)}"
    for step, ranks in consumed.items():
        assert sorted(ranks) == list(range(cfg.trainer.world_size)), f"step {step}: only ranks {sorted(ranks)} recorded it"
        rows = Counter(key for keys in ranks.values() for key in keys)
        assert sorted(rows) == sorted(handed_out[step]), f"step {step}: the ranks trained other groups than the ledger says"
        assert set(rows.values()) == {cfg.buffer.group_size}, f"step {step}: a group's samples were not each trained once: {rows}"
    trained_prompts = Counter(prompt_of(key) for ranks in consumed.values() for key in {k for keys in ranks.values() for k in keys})
    assert max(trained_prompts.values()) == 1, "the ranks trained a prompt twice in its epoch"
    return consumed


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An undisturbed run of the kill tests' job (20 steps). On-policy (the default
    max_staleness 0) the buffer decides every step in the seeded prompt order, and the
    default job trains bit for bit the same in every layout (CPU, float32), so this one
    run is the reference of the kill runs of every layout (``assert_trained_as``)."""
    run_dir = tmp_path_factory.mktemp("undisturbed") / "run"
    finish(launch(run_dir, "run.steps=20", "placement.layout=disaggregated", "trainer.checkpoint_every=5"), run_dir)
    return run_dir


def assert_trained_as(run_dir: Path, reference: Path, consumed: dict[int, dict[int, list[str]]]) -> None:
    """Every step of ``run_dir`` trained what the same step of ``reference`` trained, rank
    by rank and row by row (``consumed``: the run's record), to the same training metrics
    bit for bit (as text, so that a NaN equals a NaN). Row by row, a row is its prompt: a
    group made with the weights of a step the run went back before is redone as a newer
    attempt of its prompt (``rolled_back`` in the ledger), and samples what it would have
    sampled undisturbed (its seed is the prompt's); the metrics say it did."""

    def prompts(ranks: dict[int, list[str]]) -> dict[int, list[str]]:
        return {rank: [key.rsplit("/", 1)[0] for key in keys] for rank, keys in ranks.items()}

    expected = read_consumed(reference)
    for step, ranks in consumed.items():
        assert prompts(ranks) == prompts(expected[step]), f"step {step} trained other rows than in the undisturbed run"

    def training(run: Path) -> list[dict[str, str]]:
        return [
            {k: repr(v) for k, v in row.items() if k.startswith("train/") and "time" not in k and k != ENGINE_NOISE}
            for row in metrics(run)
        ]

    steps = training(run_dir)
    for step, (got, want) in enumerate(zip(steps, training(reference)[: len(steps)], strict=True)):
        assert got == want, f"step {step} trained to other metrics than in the undisturbed run: {got} != {want}"
    for step, (got_row, want_row) in enumerate(zip(metrics(run_dir), metrics(reference), strict=False)):
        noise, reference_noise = got_row[ENGINE_NOISE], want_row[ENGINE_NOISE]
        assert abs(noise - reference_noise) <= 1e-6, f"step {step}: {ENGINE_NOISE} {noise} != {reference_noise}"


# The trainer's log-probs minus the engine's (~2e-7 in float32): the engine's move in their
# last bits with how wide the batch a row was generated in was, and batches form by timing
# (a colocated run has an engine per rank, the reference one generator; a killed generator's
# requests come again in other batches), so the two runs agree to float noise only (1e-6);
# the update does not read them (train/loss and every other train/ metric: bit for bit).
ENGINE_NOISE = "train/logprob_diff"


def ledger_rows(run_dir: Path, *statuses: str, after: int = 0) -> list[int]:
    """The seq of each row of the run's ledger of one of ``statuses`` after row ``after``
    (any status: none given), read while the buffer writes it (read-only, no lock held)."""
    db = sqlite3.connect(f"file:{run_dir / 'ledger.db'}?mode=ro", uri=True)
    try:
        where = f" AND status IN ({','.join('?' * len(statuses))})" if statuses else ""
        return [seq for (seq,) in db.execute(f"SELECT seq FROM decisions WHERE seq > ?{where} ORDER BY seq", (after, *statuses))]
    finally:
        db.close()


def stop_holding_a_wave(run_dir: Path, pid: int) -> None:
    """SIGSTOP the role process ``pid`` the moment the buffer opens a step's window (its
    ledger's next ``version`` row: the trainer published, the controllers issue the step's
    groups at once). Stopped before its stage could pass the wave (no group decided in the
    next 0.5 s), it holds the wave: the step's groups wait at it or before it, in flight,
    and the window cannot move; it returns with the process stopped, for the caller to kill
    or resume within the 5 s heartbeat limit. Else it resumes and waits for the next window."""
    for _ in range(5):
        now = max(ledger_rows(run_dir), default=0)
        deadline = time.monotonic() + 120
        while not (opened := ledger_rows(run_dir, "version", after=now)):
            assert time.monotonic() < deadline, "no window opened"
            time.sleep(0.005)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.5)
        if not ledger_rows(run_dir, "accepted", "filtered", after=opened[0]):
            return
        os.kill(pid, signal.SIGCONT)
    raise AssertionError(f"process {pid} was never stopped before the wave passed it")


def reissued(log: Path) -> list[int]:
    """What each start of a controller issued at once (its first plan: after a restart in a
    window that has not moved, the groups its predecessor had in flight), from its log
    (``YATT_LOG_LEVEL=INFO``)."""
    return [int(n) for n in re.findall(r"controller \d+: issuing the (\d+) undecided groups", log.read_text())]


def lost_with_requests(role: str, logs: list[Path]) -> int:
    """How many requests to ``role`` failed because it was lost (died or went silent) and
    were re-issued, from the callers' logs (a controller's, or a trainer rank's to the buffer)."""
    said = "".join(log.read_text() for log in logs)
    return len(re.findall(rf"(?:{role} request failed|request to the {role} failed) \(peer '[^']+' lost: ", said))


LOG_INFO = {"YATT_LOG_LEVEL": "INFO"}  # the roles' INFO lines: what a restarted controller re-issued


@pytest.mark.parametrize("layout", ["disaggregated", "partial"])
def test_killed_controller_generator_reward_and_buffer_lose_nothing(
    tmp_path: Path, layout: str, undisturbed: Path
) -> None:
    """Each role dies with work in flight: the generator stopped as a step's window opens
    holds the step's groups, so the controller killed then has its share of them in flight
    (its restart, the window unmoved, issues them again) and the generator, killed next, the
    requests of both; the reward worker dies scoring a group (a failpoint); the buffer is
    stopped as a window opens, the trainer ranks' calls waiting on it. Every step trains
    what an undisturbed run trains, row for row."""
    run_dir = tmp_path / "kills"
    failpoint = "reward-0:score:700"  # about step 7 (400 groups of the evaluation at step 0, ~40 a step)
    proc = launch(run_dir, "run.steps=20", f"placement.layout={layout}", "trainer.checkpoint_every=5", failpoint=failpoint, env=LOG_INFO)
    wait_for(lambda: "reward-0" in role_processes(run_dir), 600, every=0.05)
    reward = role_pid(run_dir, "reward", 0, proc)
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 3, 600, every=0.1)
    killed = {"controller": role_pid(run_dir, "controller", 0, proc), "generator": role_pid(run_dir, "generator", 0, proc)}
    stop_holding_a_wave(run_dir, killed["generator"])
    os.kill(killed["controller"], signal.SIGKILL)
    wait_for(lambda: len(reissued(run_dir / "logs" / "controller-0.log")) == 2, 30, every=0.05)
    os.kill(killed["generator"], signal.SIGKILL)
    killed["reward"] = reward
    wait_for(lambda: (run_dir / "failpoints" / failpoint.replace(":", "_")).exists() or proc.poll() is not None, 600, every=0.1)
    assert proc.poll() is None, "the run ended before the reward worker's failpoint"
    wait_for(lambda: len(metrics(run_dir)) >= 12, 600, every=0.1)
    # Disaggregated: the buffer dies. Partial: it hangs (SIGSTOP); the launcher kills it.
    buffer = role_pid(run_dir, "buffer", 0, proc)
    stop_holding_a_wave(run_dir, buffer)
    if layout == "disaggregated":
        os.kill(buffer, signal.SIGKILL)
    assert len(metrics(run_dir)) < 20, "the buffer was killed after the run was done"
    import psutil

    def restarted() -> list[psutil.Process] | None:
        """The restarted controller, generator and reward worker, once all three run."""
        pids = role_processes(run_dir)
        if any(pids.get(f"{role}-0") in (None, pid) for role, pid in killed.items()):
            return None  # its death not seen yet (the launcher looks every 50 ms), or not forked yet
        return [psutil.Process(pids[f"{role}-0"]) for role in killed]

    wait_for(lambda: restarted() is not None, 60, every=0.05)
    roles = restarted()
    assert roles is not None, "a restarted role died again"
    assert all(p.ppid() != proc.pid and p.parent().ppid() == proc.pid for p in roles), "not forked warm"
    # The reward worker's scorer processes: forked, no interpreter started (each sets its
    # title as it starts; until then it has the reward worker's).
    pool = roles[2]
    wait_for(lambda: pool.children() and all(p.cmdline()[0].startswith("yatt scorer process") for p in pool.children()), 30, every=0.05)
    finish(proc, run_dir)
    assert len(metrics(run_dir)) == 20
    assert_trained_as(run_dir, undisturbed, assert_exactly_once(run_dir, 20))
    log = (run_dir.parent / f"{run_dir.name}.launcher.log").read_text()
    assert all(f"{role}-0 exited" in log for role in ("controller", "generator", "reward", "buffer"))
    # Each died with work in flight: what the restarted controller issued at once (the
    # window had not moved since the kill), the requests its callers re-issued (the
    # controllers' to the generator and the reward worker, the trainer ranks' to the buffer).
    logs = run_dir / "logs"
    starts = reissued(logs / "controller-0.log")
    assert len(starts) == 2 and starts[-1] > 0, starts
    controllers = [logs / "controller-0.log", logs / "controller-1.log"]
    assert lost_with_requests("generator", controllers) > 0, "the generator died with no request in flight"
    assert lost_with_requests("reward", controllers) > 0, "the reward worker died with no request in flight"
    assert lost_with_requests("buffer", [logs / "trainer-0.log", logs / "trainer-1.log"]) > 0, "no trainer rank waited on the buffer"
    if layout == "partial":
        assert "buffer-0 stopped answering" in log
    # The restarted buffer carried on from the ledger, not from nothing: from the snapshot
    # of a checkpoint after step 10 (or 5), then the events after it.
    assert "state rebuilt from the snapshot at ledger row" in (run_dir / "logs" / "buffer-0.log").read_text()


def test_killed_colocated_rank_restarts_the_trainer_group_losing_nothing(
    tmp_path: Path, undisturbed: Path
) -> None:
    """A colocated trainer rank takes its engine with it: the launcher restarts the group
    from the last complete checkpoint without a person, the buffer rewinds to it, and the
    run ends with every step trained once (the rolled-back steps stay in the ledger's
    history), each as in an undisturbed run. The rank dies writing the step-8 checkpoint in
    the background (a failpoint), steps 4-7 trained since the checkpoint the group restarts
    from: the half-written checkpoint is not that one. A controller dies too, with its
    share of a step's groups in flight (held by the reward worker, stopped meanwhile)."""
    run_dir = tmp_path / "colocated"
    proc = launch(
        run_dir, "run.steps=16", "trainer.checkpoint_every=4", "placement.layout=colocated",
        failpoint="trainer-1:checkpoint_write:2", env=LOG_INFO,
    )
    wait_for(lambda: (run_dir / "metrics.jsonl").exists() and len(metrics(run_dir)) >= 2, 600)
    reward = role_pid(run_dir, "reward", 0, proc)
    stop_holding_a_wave(run_dir, reward)
    os.kill(role_pid(run_dir, "controller", 0, proc), signal.SIGKILL)  # restarted, as in every layout
    wait_for(lambda: len(reissued(run_dir / "logs" / "controller-0.log")) == 2, 30, every=0.05)
    os.kill(reward, signal.SIGCONT)
    finish(proc, run_dir)
    assert (run_dir / "failpoints" / "trainer-1_checkpoint_write_2").exists(), "the rank was not killed"
    log = (run_dir.parent / f"{run_dir.name}.launcher.log").read_text()
    assert "controller-0 exited" in log and "trainer-1 exited" in log, log[-3000:]
    assert f"restarting the trainer group from {run_dir}/checkpoints/step_4" in log
    assert "incarnation 1" in log
    assert [int(r["step"]) for r in metrics(run_dir)] == list(range(16))
    assert_trained_as(run_dir, undisturbed, assert_exactly_once(run_dir, 16))
    starts = reissued(run_dir / "logs" / "controller-0.log")
    assert len(starts) == 2 and starts[-1] > 0, starts
    # Rank 1 died with steps in flight: those since step_4, trained again by the new group.
    record = read_jsonl(run_dir / "consumed" / "trainer-1.jsonl")
    redone = {r["step"] for r in record if r["incarnation"] == 0} & {r["step"] for r in record if r["incarnation"] == 1}
    assert redone >= {4, 5, 6, 7}, redone
    ledger = Ledger(run_dir / "ledger.db")
    try:
        history = ledger.history()
        assert [e.reason for e in history if e.status == "rewind"][0].startswith("trainer restarted from")
        trained_ever = sum(e.status == "trained" for e in history)
        assert trained_ever > len(ledger.entries("trained")), "no step was rolled back and trained again"
    finally:
        ledger.close()


@pytest.mark.parametrize("layout", ["colocated", "partial", "disaggregated"])
def test_resume_gives_the_same_steps(tmp_path: Path, layout: str) -> None:
    overrides: tuple[str, ...] = ("run.steps=8", "trainer.checkpoint_every=4", f"placement.layout={layout}", "trainer.keep_checkpoints=1")
    if layout == "colocated":  # roles started from their command lines, not forked: they too die with the launcher
        overrides += ("run.fork_roles=false",)
    if layout == "disaggregated":
        overrides += ("trainer.checkpoint_hf=true",)
    reference = tmp_path / "reference"
    finish(launch(reference, *overrides), reference)
    run_dir = tmp_path / "resumed"
    proc = launch(run_dir, *overrides)
    wait_for(lambda: (run_dir / "checkpoints" / "step_4" / "done").exists(), 600)
    wait_for(lambda: len(metrics(run_dir)) >= 5 or proc.poll() is not None, 600)
    assert proc.poll() is None and len(metrics(run_dir)) < 8, "the run ended before the kill"
    os.kill(proc.pid, signal.SIGKILL)  # the launcher, as the OOM killer would: every role dies with it

    wait_for(lambda: not role_processes(run_dir), 30)
    finish(launch(run_dir, resume=run_dir), run_dir)
    ledger = Ledger(run_dir / "ledger.db")
    try:  # the resumed run went back to the checkpoint: it did not start over, nor carry on
        assert [e.reason for e in ledger.history() if e.status == "rewind"] == [f"resumed from {run_dir}/checkpoints/step_4"]
    finally:
        ledger.close()
    expected, got = trained_keys(reference), trained_keys(run_dir)
    assert sorted(got) == list(range(8))
    for step in range(4, 8):
        assert got[step] == expected[step], f"step {step} trained other groups after the resume"
    assert [d.name for d in (run_dir / "checkpoints").iterdir()] == ["step_8"]  # trainer.keep_checkpoints=1
    if layout == "disaggregated":  # beside it, a Hugging Face export
        assert json.loads((run_dir / "checkpoints" / "step_8" / "hf" / "config.json").read_text())["model_type"] == "llama"


def test_a_finished_run_is_extended_with_more_steps(tmp_path: Path) -> None:
    """Resumed with more steps. Then with a checkpoint every step, each written in the
    background while the next step trains: each counts (``done``) as soon as it is written,
    two are kept. Rank 0 dies as it comes to save step 8: the group restarts from step 7
    (written while step 8 trained), not from step 6."""
    run_dir = tmp_path / "extended"
    finish(launch(run_dir, "run.steps=3", "placement.layout=disaggregated"), run_dir)
    finish(launch(run_dir, "run.steps=5", "placement.layout=disaggregated", resume=run_dir), run_dir)
    assert [int(r["step"]) for r in metrics(run_dir)] == list(range(5))
    assert sorted(d.name for d in (run_dir / "checkpoints").iterdir()) == ["step_3", "step_5"]
    again = launch(run_dir, "run.steps=5", "placement.layout=disaggregated", resume=run_dir)  # resuming a finished run says so
    finish(again, run_dir)
    assert "is done: its last checkpoint is step 5" in (run_dir.parent / "extended.launcher.log").read_text()
    every = ("trainer.checkpoint_every=1", "trainer.keep_checkpoints=2")
    finish(launch(run_dir, "run.steps=8", "placement.layout=disaggregated", *every, resume=run_dir, failpoint="trainer-0:checkpoint:3"), run_dir)
    assert (run_dir / "failpoints" / "trainer-0_checkpoint_3").exists(), "the rank was not killed"
    assert f"restarting the trainer group from {run_dir}/checkpoints/step_7" in (run_dir.parent / "extended.launcher.log").read_text()
    assert [int(r["step"]) for r in metrics(run_dir)] == list(range(8))
    assert sorted(d.name for d in (run_dir / "checkpoints").iterdir()) == ["step_7", "step_8"]
    assert all((run_dir / "checkpoints" / name / "done").exists() for name in ("step_7", "step_8"))
    # Written at once (not in the background), a checkpoint counts only once its step's
    # metrics line is written: rank 0 dies between the two (entering its 2nd log_step, of
    # step 9, after saving step_10) and the group restarts from step_9, so no line is missing.
    sync = ("trainer.checkpoint_every=1", "trainer.keep_checkpoints=2", "trainer.checkpoint_async=false")
    finish(launch(run_dir, "run.steps=11", "placement.layout=disaggregated", *sync, resume=run_dir, failpoint="trainer-0:log_step:2"), run_dir)
    assert (run_dir / "failpoints" / "trainer-0_log_step_2").exists(), "the rank was not killed"
    said = (run_dir.parent / "extended.launcher.log").read_text()
    assert f"restarting the trainer group from {run_dir}/checkpoints/step_9" in said, said[-3000:]
    assert [int(r["step"]) for r in metrics(run_dir)] == list(range(11))


def evals(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


FINAL_LOGPROB_TOLERANCE = 1e-4
"""Largest |difference| of a token's log-prob between final/ and the trainer's policy."""


def final_logprob_gap(run_dir: Path) -> float:
    """The largest |difference| between the token log-probs of ``final/`` (transformers,
    as a user loads it) and the trainer's own (its FSDP policy, in this process on one
    gloo rank, restored from the checkpoint of the run's last step: the weights the export
    was made from), on the run's last step's rollouts (prompt and completion as logged,
    tokenized again), at the rollouts' temperature."""
    import tempfile

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.trainer import Trainer
    from yatt.rl.rl_math import token_logprobs

    cfg = load_run_config(run_dir / "config.yaml")
    rows = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    last = [r["prompt"] + r["completion"] for r in rows if r["step"] == cfg.run.steps - 1]
    assert last, "no rollouts logged for the last step"
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    batch = tokenizer(last, return_tensors="pt", padding=True)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    temperature = cfg.controller.temperature or 1.0
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(run_dir / "final")(input_ids=ids, attention_mask=mask).logits
    exported = token_logprobs(logits.float(), ids, temperature=temperature)
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
        try:
            trainer = Trainer(
                cfg.model, cfg.trainer, cfg.algorithm, model_path=cfg.model.path or str(run_dir / "model"),
                run_steps=cfg.run.steps, temperature=cfg.controller.temperature,
            )
            trainer.load_checkpoint(run_dir / "checkpoints" / f"step_{cfg.run.steps}" / "trainer")
            assert trainer.step == cfg.run.steps
            trained = trainer.logprobs(ids, mask)
        finally:
            dist.destroy_process_group()
    scored = mask.bool() & torch.roll(mask.bool(), -1, dims=1)  # predicted tokens: both positions real
    scored[:, -1] = False
    return float((exported - trained)[scored].abs().max())


def test_evaluation_on_held_out_prompts_in_the_run_and_after_it(tmp_path: Path) -> None:
    """Evaluated before step 0, every 3 steps and at the end, through the run's own
    processes (colocated: the trainer ranks' engines serve it), on 20 held-out prompts; an
    extended run evaluates what is new; ``launch eval`` gives the final model's figures."""
    run_dir = tmp_path / "evaluated"
    job = ("placement.layout=colocated", "data.eval_split=20", "run.eval_every=3", "eval.n=2")
    finish(launch(run_dir, "run.steps=6", *job), run_dir)
    finish(launch(run_dir, "run.steps=9", *job, resume=run_dir), run_dir)
    rows = evals(run_dir / "eval.jsonl")
    assert [int(r["step"]) for r in rows] == [0, 3, 6, 9]
    assert all(r["eval/prompts"] == 20 and r["eval/policy_version"] == r["step"] for r in rows)
    assert {"eval/repeated/greedy", "eval/repeated/accuracy", "eval/repeated/mean@2", "eval/repeated/pass@2"} <= set(rows[-1])
    samples = [json.loads(line) for line in (run_dir / "eval_rollouts.jsonl").read_text().splitlines()]
    assert Counter(r["step"] for r in samples) == {0: 2, 3: 2, 6: 2, 9: 2}  # 2 greedy groups of 1 each
    assert all(r["group"].startswith("e-") and r["prompt"] for r in samples)
    ledger = Ledger(run_dir / "ledger.db")
    try:
        assert all(e.key.epoch >= 0 for e in ledger.entries()), "an eval group reached the training ledger"
    finally:
        ledger.close()
    # The finished run's final model, evaluated from the command line: the same greedy figures.
    out = tmp_path / "eval-final"
    done = subprocess.run(
        [sys.executable, "-m", "launch", "eval", str(run_dir), "--run-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "eval/repeated/accuracy" in done.stdout
    [final] = evals(out / "eval.jsonl")
    assert final["step"] == 9 and final["eval/prompts"] == 20
    # That model is the trainer's last step: the same log-probs (0 here; exporting the step before's weights: 0.63).
    gap = final_logprob_gap(run_dir)
    assert gap < FINAL_LOGPROB_TOLERANCE, f"final/ and the trainer's last step differ by {gap:.2e} in a token's log-prob"
    # A model directory with a config that holds out nothing: refused at once, in one line.
    refused = subprocess.run(
        [sys.executable, "-m", "launch", "eval", str(run_dir / "final"), "data.eval_split=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "data.eval_split" in refused.stderr


@pytest.mark.parametrize("backend", ["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_lora_adapters_go_to_generator_processes_and_colocated_engines(tmp_path: Path, backend: str) -> None:
    """LoRA: adapters pushed to a generator process (disaggregated), then the run resumed
    colocated (transformers: each rank's engine generates with its own peft-wrapped module;
    vLLM: each rank's engine loads the gathered adapters); every step's rollouts were
    sampled with the trainer's adapters (their log-probs match the trainer's); the export
    holds the adapter and the merged model."""
    run_dir = tmp_path / "lora"
    lora = ("model.lora.rank=8", "model.lora.target_modules=[q_proj,v_proj]", "trainer.checkpoint_every=2")
    engine = f"generator.backend={backend}"
    finish(launch(run_dir, "run.steps=4", "placement.layout=disaggregated", engine, *lora), run_dir)
    finish(launch(run_dir, "run.steps=6", "placement.layout=colocated", engine, resume=run_dir), run_dir)
    assert [int(r["step"]) for r in metrics(run_dir)] == list(range(6))
    # Rollouts sampled without the adapters differ from the trainer's log-probs by ~0.1-0.2.
    assert max(r["train/logprob_diff"] for r in metrics(run_dir)) < 1e-3
    adapter = json.loads((run_dir / "final" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and sorted(adapter["target_modules"]) == ["q_proj", "v_proj"]
    from safetensors import safe_open

    with safe_open(str(run_dir / "final" / "model.safetensors"), "pt") as merged:
        assert not any("lora" in k or "base_layer" in k for k in merged.keys())  # a plain model


def test_async_mode_respects_the_staleness_bound(tmp_path: Path) -> None:
    """(buffer.filter=none: which groups are accepted must not hang on what the policy
    learns; uncorrected, staleness 2 collapsed it to all-zero rewards in one CI run.)"""
    run_dir = tmp_path / "async"
    overrides = ("run.steps=8", "buffer.max_staleness=2", "buffer.filter=none", "algorithm.importance_sampling=tis")
    finish(launch(run_dir, *overrides, "placement.layout=disaggregated"), run_dir)
    ledger = Ledger(run_dir / "ledger.db")
    try:
        trained = ledger.entries("trained")
        assert len(trained) == 8 * load_run_config(None).buffer.groups_per_step
        assert all((e.step or 0) - (e.policy_version or 0) <= 2 for e in trained)
        assert any((e.step or 0) - (e.policy_version or 0) > 0 for e in trained), "nothing ran ahead"
    finally:
        ledger.close()
    assert max(r["staleness/mean"] for r in metrics(run_dir)) <= 2


def stopped_run(tmp_path: Path, name: str, function: str, **buffer: object) -> tuple[Path, str]:
    """The default job scored only by ``scorer_fixtures.<function>`` (and ``buffer`` fields):
    it must stop the run (exit 1); returns its run dir and launcher log."""
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["reward"]["scorers"] = [{"kind": "custom", "name": name, "function": f"tests.workers.reward.scorer_fixtures:{function}"}]
    config["buffer"].update(buffer)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / name
    assert launch(run_dir, str(path)).wait(timeout=600) == 1
    return run_dir, (run_dir.parent / f"{run_dir.name}.launcher.log").read_text()


def test_a_task_never_solved_stops_with_the_filter_and_what_to_change(tmp_path: Path) -> None:
    """Dynamic sampling has a bound: a reward that is always 0 stops the run with the filter,
    the rewards and the fix, instead of waiting for good."""
    run_dir, log = stopped_run(tmp_path, "never", "never_solved", max_filtered_batches=2)
    bound = 2 * load_run_config(None).buffer.groups_per_step
    assert "buffer-0 stopped the run" in log and f"accepted none of the last {bound} groups" in log, log[-3000:]
    assert f"'all rewards equal': {bound}" in log and "buffer.filter=none" in log
    assert not (run_dir / "metrics.jsonl").exists(), "a step was trained"


def test_a_broken_reward_stops_the_run_with_the_scorers_error(tmp_path: Path) -> None:
    """A reward function that always raises does not train on zeros with exit 0: the run
    stops with the scorer's error, its traceback and the fix."""
    _, log = stopped_run(tmp_path, "broken", "raise_value_error")
    assert "reward-0 stopped the run" in log and "reward scorer 'broken'" in log, log[-3000:]
    assert "reward.max_failure_share" in log and "Traceback" in log and "ValueError: cannot grade" in log



def test_a_run_without_a_new_step_stops_with_each_roles_state_and_where_it_waits(tmp_path: Path) -> None:
    """No silent hangs: training turns 60 s slower from step 2 on (``YATT_SLOW_TRAIN``),
    past ``run.stall_timeout_s``: the launcher stops the run, naming every role with its
    state and log tail, and every role wrote where its threads and asyncio tasks were to
    its log (trainer-0: asleep in the injected slowdown, inside its step)."""
    run_dir = tmp_path / "stall"
    proc = launch(run_dir, "run.steps=10", "run.stall_timeout_s=6", env={SLOW_TRAIN_ENV: "2:60"})
    code = proc.wait(timeout=600)
    log = (run_dir.parent / f"{run_dir.name}.launcher.log").read_text(errors="replace")
    assert code != 0 and "no step for 6 s (run.stall_timeout_s); the run stops" in log, log[-3000:]
    roles = ("buffer-0", "controller-0", "controller-1", "reward-0", "trainer-0", "trainer-1")  # (colocated: engines in the ranks)
    assert all(f"  {role}: alive, 0 restarts" in log for role in roles), log[-3000:]
    assert len(metrics(run_dir)) == 2
    for role in roles:
        assert "asyncio tasks (SIGUSR1)" in (run_dir / "logs" / f"{role}.log").read_text(errors="replace"), role
    trainer = (run_dir / "logs" / "trainer-0.log").read_text(errors="replace")
    assert "most recent call first" in trainer and "in _step" in trainer and "await asyncio.sleep(self._slow.seconds" in trainer, trainer[-3000:]


@pytest.mark.parametrize(("role", "failpoint"), [("trainer-1", "step:2"), ("buffer-0", "ledger_commit:60")])
def test_a_role_that_fails_twice_the_same_way_stops_the_run_with_the_cause_last(tmp_path: Path, role: str, failpoint: str) -> None:
    """Trainer rank 1 (as it enters its second step) or the buffer (its 60th ledger commit,
    steps after READY) raises in every start (a ``raise`` failpoint: a bug at one line).
    The launcher restarts it once (the trainer group, from the start); the same failure
    again stops the run at once (not after run.restart_limit restarts), exit 1, with the
    error and where it was raised as the last line, its traceback in the role's log only."""
    run_dir = tmp_path / "repeats"
    spec = f"{role}:{failpoint}:raise"
    # Disaggregated: a colocated rank's engine can hang in its close after the failure (its
    # batching task misses its cancellation, Python 3.11's wait_for), be killed as hung, and
    # a death by a signal is never taken for a repeat.
    proc = launch(run_dir, "run.steps=40", "placement.layout=disaggregated", failpoint=spec)
    code = proc.wait(timeout=600)
    said = (run_dir.parent / f"{run_dir.name}.launcher.log").read_text(errors="replace")
    assert code == 1, said[-3000:]
    restarted = "restarting the trainer group" if role.startswith("trainer") else f"{role} exited with code 1 ("
    assert said.count(restarted) == 1 and said.count("restarting") == 1, said[-3000:]
    log = run_dir / "logs" / f"{role}.log"
    trace_py = ROOT / "yatt" / "runtime" / "trace.py"
    raised_at = next(i for i, line in enumerate(trace_py.read_text().splitlines(), 1) if "raise InjectedFailure(" in line)
    kind, nth = failpoint.split(":")
    failure = f"yatt.runtime.trace.InjectedFailure: failpoint {spec}: raised entering span '{kind}' #{nth} (at {trace_py}:{raised_at})"
    assert said.strip().splitlines()[-1] == (
        f"yatt: {role} failed twice the same way, so the run stops (a restart would fail again): {failure}; its log: {log}"
    ), said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    text = log.read_text(errors="replace")
    assert text.count(f"yatt: failed: {failure}") == 2 and "Traceback" in text
