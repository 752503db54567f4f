"""The local launcher's placement: CPU threads (computing roles share the cores, the rest
get one thread; an explicit setting wins) and, on a GPU machine, each process's GPUs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import launch.local
from launch.config import load_run_config
from launch.local import LocalLauncher
from launch.placement.inputs import make_plan
from launch.processes import Proc, role_threads
from yatt.errors import RUN_STOPPED_EXIT, ActorFailed, ConfigError, PeerLost
from yatt.placement.layouts import cpu_cluster, gpu_cluster
from yatt.runtime.actor import cancel

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


class ScriptLauncher(LocalLauncher):
    """A launcher whose role processes run ``script`` (through ``launch.role.failed``, as a
    role's ``main`` does), each start counted in ``<run_dir>/starts``."""

    def __init__(self, run_dir: Path, script: str, *overrides: str) -> None:
        super().__init__(load_run_config(None, ["run.fork_roles=false", *overrides]), run_dir)
        self.script = script
        (run_dir / "logs").mkdir(parents=True)

    def role_command(self, role: str, index: int) -> list[str]:
        starts = self.run_dir / "starts"
        count = f"from pathlib import Path\np = Path({str(starts)!r})\nn = len(p.read_text()) if p.exists() else 0\np.write_text('x' * (n + 1))\n"
        return [sys.executable, "-c", count + textwrap.dedent(self.script)]

    async def watch(self, role: str) -> None:
        """Start one ``role`` process and handle its exits until the run stops."""
        self.procs = [self.spawn(role, 0)]
        while True:
            await self._exits(None)  # type: ignore[arg-type]  # (used only to restart the trainer group)
            await asyncio.sleep(0.05)


FAILS = """
    import sys
    from launch.role import failed
    def load(n):
        {raise_it}
    try:
        load(n)
    except Exception as e:
        sys.exit(failed(e))
"""


def test_a_role_that_fails_twice_the_same_way_is_not_restarted_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same error at the same line after a restart stops the run at once (not after
    run.restart_limit restarts), its line last, the traceback left in the role's log."""
    launcher = ScriptLauncher(tmp_path, FAILS.format(raise_it="raise IndexError('index out of range in self')"))
    with pytest.raises(ActorFailed) as stopped:
        asyncio.run(asyncio.wait_for(launcher.watch("buffer"), 120))
    assert launcher.procs[0].restarts == 1 and (tmp_path / "starts").read_text() == "xx"
    log = tmp_path / "logs" / "buffer-0.log"
    assert str(stopped.value) == (
        "buffer-0 failed twice the same way, so the run stops (a restart would fail again): "
        f"IndexError: index out of range in self (at <string>:9); its log: {log}"
    )
    err = capsys.readouterr().err
    assert "yatt: buffer-0 exited with code 1 (IndexError: index out of range in self (at <string>:9)); restarting it" in err
    assert "Traceback" not in err and log.read_text().count("Traceback (most recent call last)") == 2


def test_a_role_that_fails_another_way_each_time_is_restarted_to_the_limit(tmp_path: Path) -> None:
    """Failures that differ (here the message) are restarted as before, up to run.restart_limit."""
    launcher = ScriptLauncher(tmp_path, FAILS.format(raise_it="raise ValueError(f'start {n}')"), "run.restart_limit=2")
    with pytest.raises(ActorFailed, match="reward-0 died 3 times"):
        asyncio.run(asyncio.wait_for(launcher.watch("reward"), 120))
    assert launcher.procs[0].restarts == 2 and (tmp_path / "starts").read_text() == "xxx"


def test_a_role_killed_twice_by_a_signal_is_restarted(tmp_path: Path) -> None:
    """A start that dies without a word (SIGKILL) is not taken for the same failure as the
    one before it, even with that one's line still in its log."""
    script = FAILS.format(raise_it="raise IndexError('index out of range in self')").replace(
        "    try:", "    if n > 0:\n        import os, signal; os.kill(os.getpid(), signal.SIGKILL)\n    try:"
    )
    launcher = ScriptLauncher(tmp_path, script, "run.restart_limit=2")
    with pytest.raises(ActorFailed, match="controller-0 died 3 times"):
        asyncio.run(asyncio.wait_for(launcher.watch("controller"), 120))
    assert (tmp_path / "starts").read_text() == "xxx"


def test_a_storage_error_in_a_role_stops_the_run_with_one_line(tmp_path: Path) -> None:
    """A full disk, the cause of the actor's failure: the role exits RUN_STOPPED_EXIT at the
    first failure, its log holds the traceback, the run stops with its one line."""
    storage = FAILS.format(
        raise_it="from yatt.errors import ActorFailed, storage_error\n"
        "        try:\n"
        "            raise OSError(28, 'No space left on device')\n"
        "        except OSError as e:\n"
        "            raise ActorFailed('buffer failed:\\nTraceback ...') from storage_error('/runs/x/ledger.db', e)"
    )
    launcher = ScriptLauncher(tmp_path, storage)
    with pytest.raises(ActorFailed) as stopped:
        asyncio.run(asyncio.wait_for(launcher.watch("buffer"), 120))
    assert launcher.procs[0].restarts == 0
    log = tmp_path / "logs" / "buffer-0.log"
    said = str(stopped.value)
    assert said.startswith(
        f"buffer-0 stopped the run (its log: {log}). the run cannot go on: no space left on device writing /runs/x/ledger.db"
    ), said
    assert "\n" not in said and "free space there" in said, said
    assert "Traceback (most recent call last)" in log.read_text()


def test_a_config_error_in_a_role_exits_run_stopped_with_the_field(tmp_path: Path) -> None:
    """``python -m launch.role`` itself: a config error anywhere in it is a failure no
    restart fixes: RUN_STOPPED_EXIT, the field and the fix as its last line."""
    (tmp_path / "config.yaml").write_text("buffer:\n  max_staleness: -1\n")
    done = subprocess.run(
        [sys.executable, "-m", "launch.role", "buffer", "--run-dir", str(tmp_path), "--registry", "tcp://127.0.0.1:1",
         "--model-path", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == RUN_STOPPED_EXIT, done.stderr
    assert "Traceback (most recent call last)" in done.stderr
    assert done.stderr.splitlines()[-1] == "yatt: the run cannot go on: buffer.max_staleness must be >= 0 (got -1)"


def test_a_stopping_role_cancels_again_a_task_that_went_on_after_its_cancellation() -> None:
    """Python 3.11's ``asyncio.wait_for``, cancelled in the turn the request it waits on
    fails, raises the request's error instead (gh-86296): a controller re-issued its
    buffer request as the buffer stopped with it, waited for a buffer that never came
    back, and was killed after the launcher's 15 s grace. A role cancels it again."""

    async def stop_while_a_request_fails() -> bool:
        reply: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        retried = asyncio.Event()

        async def request() -> None:  # as Controller._call: a request to a lost peer is re-issued
            try:
                await asyncio.wait_for(reply, 300)
            except PeerLost:
                retried.set()
                await asyncio.Event().wait()  # a live buffer, which never comes

        task = asyncio.create_task(request())
        await asyncio.sleep(0)
        reply.set_exception(PeerLost("buffer-0", "left the directory"))  # the buffer stops...
        await asyncio.wait_for(cancel({task}), 60)  # ...in the turn this role's SIGTERM comes
        return task.cancelled() and retried.is_set()

    assert asyncio.run(stop_while_a_request_fails()) == (sys.version_info < (3, 12))


CHECKS = """
import asyncio, json, sys
import torch
from pathlib import Path
from launch.config import load_run_config
from launch.local import LocalLauncher
torch.ones(256, 256) @ torch.ones(256, 256)  # this process's OpenMP threads started: a fork of it would hang in them
launcher = LocalLauncher(load_run_config(None, ["model.warm_start_steps=2", *sys.argv[2:]]), Path(sys.argv[1]))
asyncio.run(launcher._check())
print(json.dumps({
    "imported": sorted(m for m in ("transformers.modeling_utils", "workers.models") if m in sys.modules),
    "model": (launcher.model_path / "config.json").is_file(), "prompt_tokens": launcher.prompt_tokens,
    "plan": launcher.plan is not None, "ranks": launcher.cfg.trainer.world_size,
}))
"""


def checks(run_dir: Path, *overrides: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", CHECKS, str(run_dir), *overrides], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (run_dir / "config.yaml").is_file() and (run_dir / "prompts.msgpack").is_file()
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    assert result["model"] and result["plan"] and float(result["prompt_tokens"]) > 5, result  # type: ignore[arg-type]
    return result


def test_the_checks_run_in_a_child_of_the_fork_server_that_takes_the_model_code_with_it(tmp_path: Path) -> None:
    """Where roles are forked, the launcher prepares the model, tokenises the prompts, plans
    (the planned ranks come back in its config) and warm-starts in a process forked from the
    fork server, and never imports transformers' model code, which held ~180 MB of its
    memory for the whole run; with run.fork_roles=false it does all that itself."""
    forked = checks(tmp_path / "forked")
    assert forked["imported"] == [] and int(forked["ranks"]) >= 1, forked  # type: ignore[call-overload]
    here = checks(tmp_path / "here", "run.fork_roles=false")
    assert here["imported"] == ["transformers.modeling_utils", "workers.models"] and int(here["ranks"]) >= 1, here  # type: ignore[call-overload]


class PlanlessLauncher(LocalLauncher):
    def make_plan(self) -> None:
        raise ValueError("the plan went missing")


def test_an_error_in_the_checks_child_is_raised_in_the_launcher(tmp_path: Path) -> None:
    """A config error comes back as itself (the launcher prints it as one line); any other
    error with the child's traceback; the launcher still has no plan."""
    bad_data = LocalLauncher(load_run_config(None, ["data.path=/nonexistent/prompts.jsonl"]), tmp_path / "a")
    with pytest.raises(ConfigError, match="data.path"):
        asyncio.run(bad_data._check())
    assert bad_data.plan is None
    crashed = PlanlessLauncher(load_run_config(None, ["model.warm_start_steps=0"]), tmp_path / "b")
    with pytest.raises(RuntimeError, match="ValueError: the plan went missing") as raised:
        asyncio.run(crashed._check())
    notes = "".join(raised.value.__notes__)
    assert "in the checks' process" in notes and "in make_plan" in notes, notes


def test_the_trainer_ranks_store_is_hosted_by_a_child_of_the_fork_server(tmp_path: Path) -> None:
    """The launcher does not import torch for the ranks' TCPStore: a process forked from the
    fork server hosts it; a restarted group's store replaces it on the same port (SLURM's
    fixed one), and a store that cannot listen is an error in the launcher."""
    import multiprocessing.process
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    launcher = LocalLauncher(load_run_config(None), tmp_path / "run")
    assert launcher.fork_server is not None
    try:
        port = launcher.host_store(0)
        first = launcher._store
        assert isinstance(first, multiprocessing.process.BaseProcess) and first.is_alive()
        assert first.pid != os.getpid()
        client = TCPStore(launcher.host, port, None, False, timeout=timedelta(seconds=30))
        client.set("rank0", "here")
        assert client.get("rank0") == b"here"
        del client
        assert launcher.host_store(port) == port  # the first store's port, free again
        assert not first.is_alive()
        with socket.create_server((launcher.host, 0)) as taken:
            with pytest.raises(RuntimeError, match="Address already in use"):
                launcher.host_store(taken.getsockname()[1])
    finally:
        launcher._close_store()
    assert launcher._store is None
