"""``python -m launch slurm``: the placement plan, the rendered scripts, the errors a user
meets, and (marked ``slurm``) real jobs on the private SLURM cluster that ``.ci/run``
starts (2 emulated nodes with 2 fake GPUs each, ``.ci/start_local_slurm.sh``).

The cluster tests skip when no SLURM answers here, except under CI (``CI`` set), where
a missing cluster fails them: CI starts one, so a skip there would hide a broken setup.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from launch.__main__ import main
from launch.config import load_run_config
from launch.prepare import latest_checkpoint, trim_metrics
from launch.processes import role_counts
from launch.slurm import (
    SlurmLauncher,
    check_head_ports,
    cpus_per_node,
    render_script,
    resolve_layout,
    set_aside_attempt,
)
from tests.learning import assert_default_job_learned
from yatt.errors import ConfigError
from yatt.placement.nodes import placement_plan, plan_layout
from yatt.rl.ledger import Ledger

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = role_counts(load_run_config(None))  # buffer 1, reward 1, generator 1, controller 2, trainer 2
LIGHT = ("buffer-0", "reward-0", "controller-0", "controller-1")


def counts(**changes: int) -> dict[str, int]:
    return {**DEFAULT, **changes}


# ------------------------------------------------------------------ the plan


def test_one_node_holds_everything() -> None:
    plan = plan_layout(DEFAULT, 1, 0)
    assert plan.describe() == ["node 0: " + " ".join([*LIGHT, "generator-0", "trainer-0", "trainer-1"])]
    assert plan.heavy_on(0) == 3


def test_two_cpu_nodes_split_generators_from_trainers() -> None:
    plan = plan_layout(DEFAULT, 2, 0)
    assert plan.describe() == ["node 0: " + " ".join([*LIGHT, "generator-0"]), "node 1: trainer-0 trainer-1"]
    assert plan.node_of("trainer", 1) == 1 and plan.node_of("controller", 1) == 0
    with pytest.raises(KeyError, match="generator-1 is not in the plan"):
        plan.node_of("generator", 1)


def test_gpu_nodes_get_one_gpu_per_generator_and_rank() -> None:
    plan = plan_layout(counts(generator=6, trainer=8), 4, 4)
    # 6 generators on 2 nodes of 4 GPUs (3 + 3), 8 ranks on 2 nodes (4 + 4), contiguous.
    assert [sorted({r for r, _ in node}) for node in plan.nodes] == [
        ["buffer", "controller", "generator", "reward"], ["generator"], ["trainer"], ["trainer"]
    ]
    assert [i for _, i in plan.nodes[2]] == [0, 1, 2, 3] and [i for _, i in plan.nodes[3]] == [4, 5, 6, 7]
    assert [plan.heavy_on(n) for n in range(4)] == [3, 3, 4, 4]


def test_three_cpu_nodes_spread_the_ranks() -> None:
    plan = plan_layout(DEFAULT, 3, 0)
    assert plan.describe()[1:] == ["node 1: trainer-0", "node 2: trainer-1"]


@pytest.mark.parametrize(
    ("layout", "nodes", "gpus", "fix"),
    [
        (counts(), 1, 2, "ask for --gpus-per-node 3 or --nodes 2"),
        (counts(trainer=8, generator=2), 2, 4, "ask for --nodes 3"),
        (counts(), 5, 0, "fills only 3 of the 5 nodes asked for"),
        (counts(), 0, 0, "--nodes must be >= 1"),
        (counts(), 2, -1, "--gpus-per-node must be >= 0"),
    ],
)
def test_a_layout_that_does_not_fit_says_what_to_ask_for(layout: dict[str, int], nodes: int, gpus: int, fix: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fix)):
        plan_layout(layout, nodes, gpus)


def test_cpus_per_node_reads_slurms_compressed_form() -> None:
    assert cpus_per_node("36,24(x2)", 3) == [36, 24, 24]
    assert cpus_per_node("2(x2)", 2) == [2, 2]
    with pytest.raises(ConfigError, match="describes 1 nodes, the job has 2"):
        cpus_per_node("8", 2)


# ------------------------------------------------------------------ the scripts


def sbatch_options(script: str) -> list[str]:
    """The #SBATCH lines that sbatch reads: those before the first command."""
    options = []
    for line in script.splitlines()[1:]:
        if line.startswith("#SBATCH"):
            options.append(line.removeprefix("#SBATCH "))
        elif line.strip() and not line.startswith("#"):
            break
    return options


def head_command(script: str) -> str:
    (line,) = [line for line in script.splitlines() if line.startswith("exec ")]
    return line


def render(
    tmp_path: Path, nodes: int, gpus: int, *overrides: str, partition: str | None = None, time_limit: str | None = None
) -> str:
    cfg = load_run_config(None, list(overrides))
    script = render_script(
        cfg, config_path=None, overrides=overrides, nodes=nodes, run_dir=tmp_path / "run", gpus_per_node=gpus,
        partition=partition, time_limit=time_limit, workdir=tmp_path, python="/opt/py/bin/python",
    )  # fmt: skip
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid shell
    return script


def test_one_node_cpu_script(tmp_path: Path) -> None:
    script = render(tmp_path, 1, 0, "run.steps=5", "placement.layout=disaggregated")
    assert sbatch_options(script) == [
        "--job-name=yatt", "--nodes=1", "--exclusive", "--mem=0", f"--chdir={tmp_path}",
        f"--output={tmp_path}/run/slurm-%j.out", "--open-mode=append", "--requeue",
    ]  # fmt: skip
    assert head_command(script) == (
        f"exec /opt/py/bin/python -m launch slurm-head run.steps=5 placement.layout=disaggregated --run-dir {tmp_path}/run "
        "--gpus-per-node 0"
    )
    assert "#   disaggregated:\n#     node 0: buffer-0 reward-0 controller-0 controller-1 generator-0 trainer-0 trainer-1   <- head" in script
    assert "one_node.sbatch.tmpl" in script


def test_one_node_gpu_script(tmp_path: Path) -> None:
    script = render(tmp_path, 1, 4, partition="gpu", time_limit="02:00:00")
    options = sbatch_options(script)
    assert {"--nodes=1", "--partition=gpu", "--time=02:00:00", "--gres=gpu:4", "--requeue"} <= set(options)
    assert head_command(script).endswith("--gpus-per-node 4")
    assert "#   4 GPUs per node (1 GPU each: generators, trainer ranks)" in script


def test_several_nodes_cpu_script(tmp_path: Path) -> None:
    script = render(tmp_path, 3, 0, "placement.layout=disaggregated")
    assert "--nodes=3" in sbatch_options(script) and not any("gres" in o for o in sbatch_options(script))
    assert "#     node 1: trainer-0\n#     node 2: trainer-1\n#   no GPUs per node (CPU only)" in script
    assert "nodes.sbatch.tmpl" in script


def test_several_nodes_gpu_script(tmp_path: Path) -> None:
    script = render(tmp_path, 3, 4, "run.num_generators=4", "trainer.world_size=8", "placement.layout=disaggregated", partition="a100")
    options = sbatch_options(script)
    assert {"--nodes=3", "--gres=gpu:4", "--partition=a100", "--exclusive"} <= set(options)
    assert "#     node 1: trainer-0 trainer-1 trainer-2 trainer-3\n#     node 2: trainer-4" in script
    assert "run.num_generators=4 trainer.world_size=8 placement.layout=disaggregated --run-dir" in head_command(script)


def test_a_config_file_is_passed_by_absolute_path(tmp_path: Path) -> None:
    cfg_path = ROOT / "examples" / "grpo.yaml"
    cfg = load_run_config(cfg_path)
    script = render_script(cfg, config_path=os.path.relpath(cfg_path, tmp_path), overrides=[], nodes=2, run_dir=Path("r"), workdir=tmp_path)
    assert f"slurm-head {cfg_path} --run-dir {tmp_path}/r " in head_command(script)


def test_a_flag_with_spaces_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--partition 'a b': must be one word"):
        render(tmp_path, 1, 0, partition="a b")


def test_slurm_steps_of_a_gpu_placement() -> None:
    cfg = load_run_config(None, ["run.num_generators=2"])
    plan = plan_layout(role_counts(cfg), 2, 2)
    launcher = SlurmLauncher(
        cfg, Path("/runs/x"), placement=plan, nodes=["gpu1", "gpu2"], addresses=["10.0.0.1", "10.0.0.2"],
        cpus=[16, 32], job_id="7",
    )  # fmt: skip
    launcher.registry_endpoint = "tcp://10.0.0.1:5000"
    gen = launcher.role_command("generator", 1)
    assert gen[: gen.index(sys.executable)] == [
        "srun", "--nodes=1", "--ntasks=1", "--nodelist=gpu1", "--job-name=generator-1",
        "--exact", "--cpus-per-task=8", "--gres=gpu:1",
    ]  # fmt: skip
    assert gen[-4:] == ["--host", "10.0.0.1", "--device", "cuda"]
    rank = launcher.role_command("trainer", 0)
    assert "--nodelist=gpu2" in rank and "--cpus-per-task=16" in rank and rank[-2:] == ["--host", "10.0.0.2"]
    buffer = launcher.role_command("buffer", 0)
    assert {"--overlap", "--gres=none", "--cpus-per-task=1"} <= set(buffer) and "--exact" not in buffer
    env = launcher.role_env("trainer", 1)
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"], env["TORCHELASTIC_USE_AGENT_STORE"]) == ("1", "2", "10.0.0.1", "True")
    assert "YATT_LAUNCHER_PID" not in env, "a step's parent is slurmstepd, not the launcher"


def test_colocated_ranks_host_their_engines_on_every_node() -> None:
    plan = plan_layout(DEFAULT, 2, 0, "colocated")
    assert plan.describe() == [
        "node 0: " + " ".join([*LIGHT, "trainer-0 (+ generator engine)"]), "node 1: trainer-1 (+ generator engine)"
    ]
    assert [plan.heavy_on(n) for n in range(2)] == [1, 1]
    run_plan = placement_plan(plan, [4, 4])
    assert run_plan.layout == "colocated" and run_plan.counts()["generator"] == 0
    assert all(a.hosts_generator and a.shared and a.threads == 4 for a in run_plan.of("trainer"))
    gpu = plan_layout(counts(trainer=8), 2, 4, "colocated")
    assert [len(node) for node in gpu.nodes] == [4 + 4, 4] and gpu.heavy_on(1) == 4


def test_partial_generators_share_the_trainer_nodes() -> None:
    plan = plan_layout(DEFAULT, 2, 0, "partial")
    assert plan.describe() == ["node 0: " + " ".join([*LIGHT, "generator-0", "trainer-0"]), "node 1: trainer-1"]
    assert plan.heavy_on(0) == 1 and plan.exclusive("trainer") and not plan.exclusive("generator")
    cfg = load_run_config(None, ["placement.layout=partial"])
    launcher = SlurmLauncher(
        cfg, Path("/runs/x"), placement=plan, nodes=["n1", "n2"], addresses=["10.0.0.1", "10.0.0.2"], cpus=[8, 8], job_id="7",
    )  # fmt: skip
    launcher.registry_endpoint = "tcp://10.0.0.1:5000"
    gen = launcher.role_command("generator", 0)
    assert {"--overlap", "--cpus-per-task=8"} <= set(gen) and "--exact" not in gen  # it sleeps while the rank trains
    rank = launcher.role_command("trainer", 0)
    assert {"--exact", "--cpus-per-task=8"} <= set(rank)
    assert launcher.make_plan().layout == "partial"
    with pytest.raises(ConfigError, match="partial on GPU nodes under SLURM is not supported yet"):
        plan_layout(DEFAULT, 2, 4, "partial")


def test_a_shared_layout_needs_a_rank_on_every_node() -> None:
    with pytest.raises(ConfigError, match=re.escape("2 ranks fill only 2 of the 3 nodes asked for")):
        plan_layout(DEFAULT, 3, 0, "colocated")


def test_an_auto_script_shows_every_layout_that_fits(tmp_path: Path) -> None:
    script = render(tmp_path, 2, 0)
    assert "placement.layout=auto: the head picks" in script
    for line in (
        "#   colocated:\n#     node 0: buffer-0 reward-0 controller-0 controller-1 trainer-0 (+ generator engine)   <- head",
        "#   partial:\n#     node 0: buffer-0 reward-0 controller-0 controller-1 generator-0 trainer-0   <- head",
        "#   disaggregated:\n#     node 0: buffer-0 reward-0 controller-0 controller-1 generator-0   <- head",
    ):
        assert line in script
    only = render(tmp_path, 1, 2)  # one node of 2 GPUs: 3 processes fit only as colocated
    assert "#   colocated:" in only and "#   disaggregated:" not in only and "#   partial:" not in only


def test_auto_resolves_to_a_layout_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_run_config(None)
    assert resolve_layout(cfg, 2, [2, 2], 0) in ("colocated", "partial", "disaggregated")
    assert resolve_layout(cfg, 1, [8], 2) == "colocated"  # the only layout 2 GPUs hold
    assert resolve_layout(load_run_config(None, ["placement.layout=partial"]), 2, [2, 2], 0) == "partial"


# ------------------------------------------------------------------ a restarted job's run dir


def test_a_resumed_run_forgets_the_metrics_of_the_steps_it_redoes(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": k, "reward/mean": k / 10}) + "\n" for k in range(7)))
    trim_metrics(tmp_path, 4)
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1, 2, 3]


def test_a_restart_without_checkpoint_sets_the_old_attempt_aside(tmp_path: Path) -> None:
    for name in ("ledger.db", "metrics.jsonl", "config.yaml"):
        (tmp_path / name).write_text(name)
    (tmp_path / "logs").mkdir()
    set_aside_attempt(tmp_path, "job5-1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "logs", "previous"]
    assert sorted(p.name for p in (tmp_path / "previous" / "job5-1").iterdir()) == ["ledger.db", "metrics.jsonl"]
    set_aside_attempt(tmp_path, "job5-2")  # nothing left to move: no empty folder
    assert not (tmp_path / "previous" / "job5-2").exists()


# ------------------------------------------------------------------ user errors


def test_a_head_port_in_use_says_what_to_do() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} on node7 .127.0.0.1. is in use .*set slurm.head_port to another"):
            check_head_ports("node7", "127.0.0.1", port)


def test_print_is_the_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["slurm", "run.steps=3", "--nodes", "2", "--run-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/usr/bin/env bash") and "--nodes=2" in out
    assert not (tmp_path / "r").exists()


def test_too_few_nodes_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--nodes", "2", "--gpus-per-node", "4"]
    assert main(["slurm", "trainer.world_size=8", "placement.layout=disaggregated", *flags]) == 2
    assert "ask for --nodes 3" in capsys.readouterr().err
    assert main(["slurm", "trainer.world_size=8", *flags]) == 0  # auto: 8 colocated ranks fit 2 nodes of 4 GPUs
    assert "trainer-7 (+ generator engine)" in capsys.readouterr().out


def test_submit_without_slurm_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without the SLURM client
    assert main(["slurm", "--nodes", "1", "--run-dir", str(tmp_path / "r"), "--submit"]) == 2
    err = capsys.readouterr().err
    assert "sbatch not found: this machine has no SLURM client" in err and "--print" in err


def test_the_head_outside_a_job_says_what_to_do(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert main(["slurm-head", "--run-dir", "/nonexistent"]) == 2
    assert "runs inside a SLURM job" in capsys.readouterr().err


# ------------------------------------------------------------------ on the cluster


def _cluster() -> tuple[int, int]:
    """(idle nodes, GPUs on the first) of the SLURM that answers here; (0, 0) if none."""
    if shutil.which("sinfo") is None:
        return 0, 0
    try:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%T %G"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return 0, 0
    rows = [line.split() for line in done.stdout.splitlines()] if done.returncode == 0 else []
    up = [r for r in rows if r and r[0] in ("idle", "mixed", "allocated")]
    gres = re.search(r"gpu:(\d+)", up[0][1]) if up and len(up[0]) > 1 else None
    return len(up), int(gres.group(1)) if gres else 0


@pytest.fixture(scope="module")
def cluster() -> tuple[int, int]:
    nodes, gpus = _cluster()
    if nodes < 2:
        reason = f"needs a SLURM cluster of 2 nodes answering sinfo here (found {nodes}); start one with .ci/start_local_slurm.sh"
        if os.environ.get("CI"):
            pytest.fail(reason + " (CI starts it in .ci/run)")
        pytest.skip(reason)
    return nodes, gpus


def submit(run_dir: Path, *items: str) -> str:
    cmd = [sys.executable, "-m", "launch", "slurm", *items, "--nodes", "2", "--run-dir", str(run_dir), "--submit"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.split()[0]


def job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def in_queue(job_id: str) -> bool:
    """True while the job is pending, running or completing (its steps may still run)."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
    return bool(out.strip())


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
            raise AssertionError(f"timed out waiting for {what}\n{tail}")
        time.sleep(1)


def metrics(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def processes_of(run_dir: Path) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if str(run_dir) in line]


@pytest.fixture
def cancel_after() -> Iterator[list[str]]:
    """Jobs a test submitted; any still queued at its end are cancelled."""
    jobs: list[str] = []
    yield jobs
    for job_id in jobs:
        subprocess.run(["scancel", job_id], capture_output=True)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["auto", "partial"])
def test_the_default_job_on_two_nodes_learns(
    cluster: tuple[int, int], tmp_path: Path, cancel_after: list[str], layout: str
) -> None:
    run_dir = tmp_path / "default"
    job_id = submit(run_dir, f"placement.layout={layout}")
    cancel_after.append(job_id)
    out = run_dir / f"slurm-{job_id}.out"
    wait_for(lambda: not in_queue(job_id), 900, "the job to end", out)
    state = job(job_id)
    assert (state["JobState"], state["ExitCode"]) == ("COMPLETED", "0:0"), out.read_text()[-3000:]
    assert_default_job_learned(metrics(run_dir), run_dir)  # as the loop test on one machine
    (record,) = [json.loads(line) for line in (run_dir / "slurm.jsonl").read_text().splitlines()]
    assert record["job_id"] == job_id and list(record["nodes"]) == ["node1", "node2"]
    placed = json.loads((run_dir / "plan.json").read_text())["layout"]  # auto: the planner's pick
    assert placed == layout or layout == "auto"
    assert record["placement"] == plan_layout(DEFAULT, 2, 0, placed).describe()
    assert f"placement.layout={layout} -> {placed}" in out.read_text()
    assert "all roles READY" in out.read_text()
    wait_for(lambda: processes_of(run_dir) == [], 30, f"every process of the run to exit: {processes_of(run_dir)}")


@pytest.mark.slurm
@pytest.mark.slow
def test_scancel_mid_run_leaves_no_process(cluster: tuple[int, int], tmp_path: Path, cancel_after: list[str]) -> None:
    run_dir = tmp_path / "cancelled"
    job_id = submit(run_dir, "run.steps=500", "placement.layout=disaggregated",  # generator steps too
                    "generator.backend=transformers")  # (auto would measure vLLM first: 500 steps could pay for its start)
    cancel_after.append(job_id)
    out = run_dir / f"slurm-{job_id}.out"
    wait_for(lambda: len(metrics(run_dir)) >= 2, 600, "two steps", out)
    assert len(processes_of(run_dir)) >= 7  # the head, the srun clients and the roles
    subprocess.run(["scancel", job_id], check=True)
    wait_for(lambda: not in_queue(job_id), 120, "the cancelled job to leave the queue", out)
    assert job(job_id)["JobState"] == "CANCELLED"
    wait_for(lambda: processes_of(run_dir) == [], 30, f"every process of the run to exit: {processes_of(run_dir)}")


@pytest.mark.slurm
@pytest.mark.slow
def test_a_requeued_colocated_job_resumes_from_its_checkpoint(cluster: tuple[int, int], tmp_path: Path, cancel_after: list[str]) -> None:
    run_dir = tmp_path / "requeued"
    steps = 10
    job_id = submit(run_dir, f"run.steps={steps}", "trainer.checkpoint_every=4", "placement.layout=colocated")
    cancel_after.append(job_id)
    out = run_dir / f"slurm-{job_id}.out"
    wait_for(lambda: (run_dir / "checkpoints" / "step_4" / "done").exists(), 600, "the checkpoint of step 4", out)
    subprocess.run(["scontrol", "requeue", job_id], check=True)
    # A requeued job waits (BeginTime) before it may start again; let it start now.
    wait_for(lambda: job(job_id)["JobState"] == "PENDING", 120, "the job to be pending again", out)
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None and checkpoint.name != f"step_{steps}", "the first attempt ended before the requeue"
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
    wait_for(lambda: not in_queue(job_id), 900, "the requeued job to end", out)
    state = job(job_id)
    assert (state["JobState"], state["Restarts"]) == ("COMPLETED", "1"), out.read_text()[-3000:]
    attempts = [json.loads(line) for line in (run_dir / "slurm.jsonl").read_text().splitlines()]
    assert [a["restart_count"] for a in attempts] == [0, 1]
    assert attempts[1]["resume"] == str(checkpoint)
    assert f"job {job_id} (restart 1) resumes from {checkpoint}" in out.read_text()
    assert [int(r["step"]) for r in metrics(run_dir)] == list(range(steps))  # the redone steps once
    assert attempts[1]["placement"] == ["node 0: " + " ".join([*LIGHT, "trainer-0 (+ generator engine)"]),
                                        "node 1: trainer-1 (+ generator engine)"]  # fmt: skip
    assert all(r["time/switch_s"] > 0 for r in metrics(run_dir))  # each rank's engine took turns with training
    ledger = Ledger(run_dir / "ledger.db")
    try:
        trained = ledger.entries("trained")
        assert {e.step for e in trained} == set(range(steps))
        assert max(Counter(e.key for e in trained).values()) == 1, "a group was trained twice"
    finally:
        ledger.close()


@pytest.mark.slurm
def test_gpu_steps_each_get_their_own_gpu(cluster: tuple[int, int], tmp_path: Path) -> None:
    """The srun steps of a GPU placement, on SLURM's fake GPUs: one GPU per generator and rank."""
    gpus = cluster[1]
    if gpus < 2:
        reason = f"needs nodes with 2 GPUs in gres (found {gpus}); start the cluster with SLURM_LOCAL_GPUS=2"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    cmd = [
        "salloc", "-Q", "--nodes=2", "--exclusive", "--gres=gpu:2",
        sys.executable, "-m", "tests.launch.slurm_probe", str(tmp_path), "2", "run.num_generators=2",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    seen = {name: step["seen"] for name, step in report["steps"].items()}
    assert all(step["code"] == 0 for step in report["steps"].values()), report
    node0, node1 = sorted({s[0] for s in seen.values()})
    assert {name: s for name, s in seen.items() if s[1] == "none"} == {name: [node0, "none"] for name in LIGHT}
    assert sorted([seen["generator-0"][1], seen["generator-1"][1]]) == ["0", "1"]
    assert sorted([seen["trainer-0"][1], seen["trainer-1"][1]]) == ["0", "1"]
    assert seen["generator-0"][0] == seen["generator-1"][0] == node0
    assert seen["trainer-0"][0] == seen["trainer-1"][0] == node1

