"""The local launcher's placement: CPU threads (computing roles share the cores, the rest
get one thread; an explicit setting wins) and, on a GPU machine, each process's GPUs."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launch.local
from launch.config import load_run_config
from launch.local import LocalLauncher
from launch.placement.inputs import make_plan
from launch.processes import Proc, role_threads
from yatt.placement.layouts import cpu_cluster, gpu_cluster

ROOT = Path(__file__).resolve().parents[2]


def test_threads_share_the_cores_between_computing_roles() -> None:
    cores = len(os.sched_getaffinity(0))
    cfg = load_run_config(None, ["trainer.world_size=2", "run.num_generators=1"])
    assert role_threads(cfg, "generator") == cores
    assert role_threads(cfg, "trainer") == max(1, cores // 2)
    for role in ("buffer", "controller", "reward"):
        assert role_threads(cfg, role) == 1
    many = load_run_config(None, [f"run.num_generators={4 * cores}", f"trainer.world_size={4 * cores}"])
    assert role_threads(many, "generator") == role_threads(many, "trainer") == 1


def test_explicit_threads_win() -> None:
    cfg = load_run_config(None, ["generator.threads=3", "trainer.threads=5"])
    assert role_threads(cfg, "generator") == 3
    assert role_threads(cfg, "trainer") == 5


def gpu_launcher(layout: str, *overrides: str) -> LocalLauncher:
    """A launcher holding the plan it would make on a 4-GPU machine (no GPU needed)."""
    cfg = load_run_config(None, [f"placement.layout={layout}", *overrides])
    launcher = LocalLauncher(cfg, Path("/runs/x"))
    cluster = gpu_cluster([80 << 30] * 4, list(range(16)), peak_flops=1e15)
    launcher.plan, launcher.gpu_slots = make_plan(cfg, cluster), True
    launcher.registry_endpoint = "tcp://127.0.0.1:5000"
    return launcher


def test_every_layout_uses_the_gpus() -> None:
    disaggregated = gpu_launcher("disaggregated")  # generator on GPU 0, the ranks on 1 and 2
    assert disaggregated.role_command("generator", 0)[-2:] == ["--device", "cuda"]
    assert disaggregated.role_env("generator", 0)["CUDA_VISIBLE_DEVICES"] == "0"
    env = disaggregated.role_env("trainer", 1)
    assert (env["CUDA_VISIBLE_DEVICES"], env["LOCAL_RANK"], env["RANK"]) == ("2", "0", "1")
    assert disaggregated.role_env("buffer", 0)["CUDA_VISIBLE_DEVICES"] == ""
    colocated = gpu_launcher("colocated", "trainer.world_size=4")
    assert [colocated.role_env("trainer", i)["CUDA_VISIBLE_DEVICES"] for i in range(4)] == ["0", "1", "2", "3"]
    assert colocated.processes()["generator"] == 0 and colocated.expected()["generator"] == 4
    tensor_parallel = gpu_launcher("disaggregated", "generator.tensor_parallel=2")
    assert tensor_parallel.role_env("generator", 0)["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_a_cpu_plan_sets_no_gpus() -> None:
    cfg = load_run_config(None, ["placement.layout=colocated"])
    launcher = LocalLauncher(cfg, Path("/runs/x"))
    launcher.plan = make_plan(cfg, cpu_cluster([0, 1], 8 << 30, peak_flops=1e11))
    assert "CUDA_VISIBLE_DEVICES" not in launcher.role_env("trainer", 0) or os.environ.get("CUDA_VISIBLE_DEVICES")
    assert "--device" not in launcher.role_command("trainer", 0)


def test_a_role_deaf_to_sigterm_is_killed_after_the_grace_and_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Stopping the roles waits ``GRACE_S`` for each to exit on SIGTERM; one still running
    then is SIGKILLed, and the launcher says which (a silent wait of 15 s at a run's end)."""
    monkeypatch.setattr(launch.local, "GRACE_S", 0.5)
    launcher = LocalLauncher(load_run_config(None), tmp_path)
    deaf = (
        "import faulthandler, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "faulthandler.register(signal.SIGUSR1, all_threads=True)"  # (as launch.role sets it up)
    )
    code = {"deaf": f"{deaf}; print('up', flush=True); time.sleep(60)",
            "obeys": "import sys, time; print('up', flush=True); time.sleep(60)"}
    procs = []
    for index, name in enumerate(code):
        log = (tmp_path / f"{name}.log").open("w")
        popen = subprocess.Popen(
            [sys.executable, "-c", code[name]], stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
        )
        assert popen.stdout is not None and popen.stdout.readline() == "up\n"  # its handler is set
        procs.append(Proc(role="reward" if name == "deaf" else "controller", index=index, popen=popen, log=tmp_path / f"{name}.log"))
    asyncio.run(launcher.stop(procs))
    err = capsys.readouterr().err
    assert procs[0].popen.returncode == -signal.SIGKILL and procs[1].popen.returncode == -signal.SIGTERM
    assert "reward-0 did not stop within 0.5 s of SIGTERM; killing it" in err and "controller-1" not in err
    # Where it was, written to its log before the kill: the main thread, asleep in time.sleep.
    assert f"is at the end of its log: {tmp_path / 'deaf.log'}" in err
    stacks = (tmp_path / "deaf.log").read_text()
    assert "most recent call first" in stacks and 'File "<string>", line 1 in <module>' in stacks, stacks


def test_sigusr1_makes_a_role_write_its_threads_and_asyncio_tasks(tmp_path: Path) -> None:
    """A role (``launch.role``'s signal handlers) asked for its stacks writes every thread's
    and every asyncio task's, with where each waits, and goes on serving."""
    code = """
import asyncio, sys
from launch.role import _stop_on_signals

async def waits_for_a_micro_batch(stop: asyncio.Event) -> None:
    await stop.wait()

async def main() -> None:
    stop = asyncio.Event()
    _stop_on_signals(stop)
    task = asyncio.create_task(waits_for_a_micro_batch(stop), name="fetch")
    print("up", flush=True)
    await task
    print("stopped", flush=True)

asyncio.run(main())
"""
    with (tmp_path / "role.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
        assert proc.stdout is not None and proc.stdout.readline() == "up\n"
        os.kill(proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while "waits_for_a_micro_batch" not in (tmp_path / "role.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # still serving: it stops as asked
        assert proc.stdout.readline() == "stopped\n" and proc.wait(timeout=30) == 0
    stacks = (tmp_path / "role.log").read_text()
    assert "most recent call first" in stacks and "asyncio tasks (SIGUSR1)" in stacks, stacks
    # The whole chain of awaits, down to the event it waits on (print_stack would stop at the first).
    assert "task 'fetch':\n  File \"<string>\", line 6, in waits_for_a_micro_batch\n" in stacks, stacks
    assert "locks.py\", line" in stacks.split("task 'fetch':")[1] and "await fut" in stacks, stacks
