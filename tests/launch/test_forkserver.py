"""Role processes forked from the launcher's warm fork server (launch/forkserver.py) are
what their command line would have started: its arguments, title, session, environment,
thread count, output and exit code (tests/launch/forked_probe.py reports them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import psutil
import pytest

from launch.forkserver import ForkServer

PROBE = "tests.launch.forked_probe"


@pytest.fixture(scope="module")
def server() -> ForkServer:
    fork_server = ForkServer(preload=["torch"])
    fork_server.start()
    return fork_server


def wait_for_file(path: Path, timeout: float = 120) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} was never written"
        time.sleep(0.1)
    return dict(json.loads(path.read_text()))


def test_a_forked_process_is_what_its_command_line_would_start(server: ForkServer, tmp_path: Path) -> None:
    out, log = tmp_path / "probe.json", tmp_path / "probe.log"
    cmd = [sys.executable, "-m", PROBE, str(out), "-1", "--run-dir", str(tmp_path)]
    child = server.fork(cmd, {**os.environ, "PROBE": "yes", "OMP_NUM_THREADS": "1"}, log)
    try:
        seen = wait_for_file(out)
        assert seen["pid"] == child.pid
        assert seen["argv"] == [str(Path(__file__).with_name("forked_probe.py")), *cmd[3:]]
        assert seen["pgid"] == child.pid, "not in a session of its own: the launcher's killpg would miss its children"
        assert seen["env"] == "yes"
        assert seen["threads"] == 1, "OMP_NUM_THREADS was read in the server; the child must set it"
        # torch's objects, made in the server, are out of the child's collections: their pages stay shared
        assert int(str(seen["frozen"])) > 10_000, seen["frozen"]
        parent = psutil.Process(int(str(seen["ppid"])))
        assert parent.pid != os.getpid() and parent.ppid() == os.getpid(), "not forked from the server"
        ps = subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(child.pid)], capture_output=True, text=True).stdout
        assert ps.strip() == " ".join(cmd), "ps does not show the command line"
        assert child.poll() is None
    finally:
        os.kill(child.pid, signal.SIGKILL)
    assert child.wait(timeout=30) == -signal.SIGKILL
    assert child.returncode == -signal.SIGKILL
    assert "probe started" in log.read_text()


def test_exit_codes_and_errors_reach_the_launcher_and_the_log(server: ForkServer, tmp_path: Path) -> None:
    out, log = tmp_path / "probe.json", tmp_path / "probe.log"
    assert server.fork([sys.executable, "-m", PROBE, str(out), "3"], dict(os.environ), log).wait(timeout=60) == 3
    missing = server.fork([sys.executable, "-m", "tests.launch.no_such_module"], dict(os.environ), log)
    assert missing.wait(timeout=60) == 1
    assert "No module named tests.launch.no_such_module" in log.read_text()
    with pytest.raises(ValueError, match="python -m MODULE"):
        server.fork([sys.executable, "script.py"], dict(os.environ), log)


LAUNCHER = """
import os, sys, time
from pathlib import Path
from launch.forkserver import ForkServer
os.environ["PROBE_SERVER_EXIT"] = sys.argv[3]
server = ForkServer(preload=["launch.forkserver_init", "torch", "tests.launch.forked_probe"])
out, log = sys.argv[1], Path(sys.argv[2])
env = {**os.environ, "YATT_LAUNCHER_PID": str(os.getpid())}
server.fork([sys.executable, "-m", "tests.launch.forked_probe", out, "-1"], env, log)
time.sleep(600)
"""


def test_forked_roles_and_the_server_die_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    """At once: the kernel kills the server with its launcher, so the server does not live
    through its interpreter's shutdown (seconds with torch loaded, here 5 s in an atexit
    handler) and its roles with it."""
    out, log, shutdown = tmp_path / "probe.json", tmp_path / "probe.log", tmp_path / "server_shut_down"
    root = Path(__file__).parents[2]
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(out), str(log), str(shutdown)], cwd=root)
    try:
        seen = wait_for_file(out)
        role, server = psutil.Process(int(str(seen["pid"]))), psutil.Process(int(str(seen["ppid"])))
        assert server.ppid() == launcher.pid and role.is_running()
    finally:
        launcher.kill()  # SIGKILL, as the OOM killer would
        launcher.wait()
    gone, alive = psutil.wait_procs([role, server], timeout=30)
    assert not alive, f"still running after their launcher was SIGKILLed: {[p.cmdline()[:4] for p in alive]}"
    assert not shutdown.exists(), "the server shut down in its own time instead of dying with its launcher"


PRELOADED = """
import sys
from launch.config import load_run_config
from launch.local import LocalLauncher
from tests.launch.test_forkserver import imported
launcher = LocalLauncher(load_run_config(None, [f"model.path={sys.argv[1]}"]), __import__("pathlib").Path(sys.argv[2]))
receive, send = launcher.fork_server.pipe()
child = launcher.fork_server.call(imported, send, "transformers.models.qwen2.", name="probe")
send.close()
print(" ".join(receive.recv()))
print(" ".join(name for name in sys.modules if name.startswith("transformers")))
child.join()
"""


def imported(send: Connection, prefix: str) -> None:
    """In a child of the server: which of its modules start with ``prefix``."""
    send.send(sorted(name for name in sys.modules if name.startswith(prefix)))


def test_the_server_preloads_the_module_that_defines_the_runs_model(tmp_path: Path) -> None:
    """transformers imports a model type's module on the first load of such a model: in
    every forked trainer rank and generator unless the server imported it. The server
    names that module itself, from the run's model.path: the launcher never imports
    transformers."""
    from launch.forkserver import model_modules

    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert model_modules(str(tmp_path / "qwen")) == ["transformers.models.qwen2.modeling_qwen2"]
    assert model_modules(str(tmp_path / "missing")) == []
    assert model_modules("") == ["transformers.models.llama.modeling_llama"]  # the built-in models
    root = Path(__file__).parents[2]
    done = subprocess.run(
        [sys.executable, "-c", PRELOADED, str(tmp_path / "qwen"), str(tmp_path / "run")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    in_server, in_launcher = done.stdout.splitlines()[-2:]
    assert "transformers.models.qwen2.modeling_qwen2" in in_server.split(), in_server
    assert in_launcher == "", in_launcher
