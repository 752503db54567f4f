"""Role processes forked from a warm template process (a fork server), not started cold.

A role process started as ``python -m launch.role`` spends its first seconds importing
torch and transformers (3-4 s on an idle core of this machine, more while the run keeps
both cores busy), and that import is most of what a restarted generator, buffer or
controller costs the run. The local launcher starts one fork server (the standard
library's ``multiprocessing`` "forkserver", its modules preloaded) beside its own start,
and forks those roles from it: the child sets itself up as its command line would have (a
session of its own, its log as stdout and stderr, its environment and thread count, the
command line as its process title for ``ps``) and runs ``launch.role`` as ``__main__`` on
the same arguments. A fork takes milliseconds; the imports are paid once per run. One
difference shows: ``/proc/PID/environ`` of a forked role is the server's (the kernel
keeps a process's first environment there), ``os.environ`` inside it is its own; the
trainer ranks' rendezvous port is in ``<run_dir>/launcher.json``.

Only roles on CPUs are forked. The server never sees a GPU (it starts with
``CUDA_VISIBLE_DEVICES`` empty, so nothing it imports can start CUDA); a role with GPU
slots is started from its command line, its devices visible from the start.
``run.fork_roles=false`` starts every role that way; SLURM roles are ``srun`` steps on
their own nodes and never forked.

What dies with what: the kernel kills the server the moment its launcher goes, even
after a SIGKILL (``launch/forkserver_init.py``), and each forked role when the server goes
(``launch.role.die_with_launcher``).
"""

from __future__ import annotations

import atexit
import io
import json
import multiprocessing
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

PRELOAD = (
    "launch.forkserver_init", "torch", "transformers", "workers.engines.hf", "workers.reward.worker", "workers.trainer_rank", "yatt.rl.buffer",
    "yatt.rl.controller", "workers.env", "launch.role",
)  # fmt: skip
"""What the server imports once: the modules whose import takes a forked role's time."""


MODEL_ENV = "YATT_FORK_SERVER_MODEL"
"""The run's ``model.path``, handed to the server for ``launch.forkserver_model``."""


def model_modules(model_path: str) -> list[str]:
    """The transformers module that defines the run's model (``model.path``; the built-in
    models are Llamas), which transformers imports only when a model of its type first
    loads: 0.25 s in every trainer rank and generator a server without it forks. Named in
    the server (``launch.forkserver_model``): transformers' import is not the launcher's."""
    model_type = "llama"
    if model_path and not model_path.startswith("builtin:"):
        try:
            model_type = str(json.loads((Path(model_path) / "config.json").read_text())["model_type"])
        except (OSError, ValueError, KeyError, TypeError):
            return []  # not a local model directory: the checks before the start say so
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(model_type)
    return [f"transformers.models.{module}.modeling_{module}"]


class RoleProcess(Protocol):
    """What the launcher uses of a role process: ``subprocess.Popen`` or a ``ForkedRole``."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> Any: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class ForkedRole:
    """A role process forked from the server, with ``subprocess.Popen``'s ``pid``,
    ``poll``, ``wait`` and ``returncode`` (negative: the signal that killed it)."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        assert process.pid is not None
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            import subprocess

            raise subprocess.TimeoutExpired(f"forked role {self.pid}", timeout or 0.0)
        return self._process.exitcode


class ForkServer:
    """Forks role processes from one server process that has imported ``preload``."""

    def __init__(self, preload: Sequence[str] = PRELOAD, *, model_path: str | None = None) -> None:
        """``model_path``: the run's model, whose transformers module the server imports too."""
        model = ["launch.forkserver_model"] if model_path is not None else []
        self.preload = [*preload, *model, "launch.forkserver_freeze"]  # last: it freezes what the others made
        self.model_path = model_path
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(self.preload)

    def start(self) -> None:
        """Start the server now; it imports ``preload`` in the background (the first fork
        waits for that). The server sees no GPU, and dies with this process (its thread
        that calls this: the launcher's main thread)."""
        from multiprocessing import forkserver

        from launch.forkserver_init import MARK

        marks = {"CUDA_VISIBLE_DEVICES": "", MARK: str(os.getpid())}  # no GPU; dies with this process
        if self.model_path is not None:
            marks[MODEL_ENV] = self.model_path
        saved = {name: os.environ.get(name) for name in marks}
        os.environ.update(marks)
        try:
            forkserver.ensure_running()
        finally:
            for name, value in saved.items():
                if value is None:
                    del os.environ[name]
                else:
                    os.environ[name] = value

    def fork(self, cmd: Sequence[str], env: dict[str, str], log: Path) -> ForkedRole:
        """A process running ``cmd`` (``python -m MODULE ARGS``: ``launch.role`` for a role)
        as if started from it, with ``env`` and its output appended to ``log``."""
        if len(cmd) < 3 or cmd[1] != "-m":
            raise ValueError(f"the fork server runs `python -m MODULE ...` command lines, not {shlex.join(cmd)}")
        self.start()  # each time: a server that died starts again here, marked, not unmarked in Process.start
        return ForkedRole(self.call(run_role, list(cmd), dict(env), str(log), name=" ".join(cmd[3:4])))

    def call(self, target: Callable[..., object], *args: object, name: str) -> multiprocessing.process.BaseProcess:
        """A process forked from the server running ``target(*args)`` (pickled to the server:
        a module-level function; a ``Connection`` among the args crosses as its fd), started."""
        self.start()  # each time: a server that died starts again here, marked, not unmarked in Process.start
        process = self._context.Process(target=target, args=args, name=name)
        process.start()
        return process

    def pipe(self) -> tuple[Connection, Connection]:
        """A one-way pipe (receiving end, sending end) whose ends ``call`` can hand a child."""
        receive, send = self._context.Pipe(duplex=False)
        return receive, send


def become_forked_child() -> None:
    """What every process forked from the server does first (a role, the launcher's checks)."""
    # A child of the server inherits its "forkserver" start method; a started role has the
    # interpreter's default (fork on Linux), where a library's multiprocessing lock (tqdm's,
    # made as transformers loads a model) is unlinked at once. Under "forkserver" it was a
    # named semaphore registered with the launcher's resource tracker (every forked role
    # shares it), and a role that died without cleaning up (SIGKILLed: a trainer group's
    # restart, the kill after the grace) left the tracker to say, as the launcher exited,
    # "There appear to be 1 leaked semaphore objects".
    multiprocessing.set_start_method(None, force=True)
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if getattr(server, "_forkserver_alive_fd", None) is not None:
        # multiprocessing hands each child the launcher's end of the server's "alive" pipe;
        # held here it would keep the server, and so this role, alive after a SIGKILLed launcher
        os.close(server._forkserver_alive_fd)  # type: ignore[union-attr]
        server._forkserver_alive_fd = None  # type: ignore[union-attr]


def run_role(cmd: list[str], env: dict[str, str], log: str) -> None:
    """In the forked child: become the process ``cmd`` would have started, then run its
    module as ``__main__`` (its ``sys.exit`` code is the process's exit code)."""
    os.setsid()  # signalled as a group, as start_new_session=True does
    become_forked_child()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)  # what PYTHONUNBUFFERED gives a started process
    from setproctitle import setproctitle

    setproctitle(shlex.join(cmd))  # before the environment changes: it takes over argv's and environ's memory
    os.environ.clear()
    os.environ.update(env)
    torch = sys.modules.get("torch")
    if torch is not None and (threads := env.get("OMP_NUM_THREADS")):  # OpenMP read it in the server, at torch's load
        torch.set_num_threads(int(threads))
    import runpy

    sys.argv = [cmd[2], *cmd[3:]]  # runpy puts the module's path first, as python -m does
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # python -m looks in the current directory first
    try:
        runpy.run_module(cmd[2], run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()  # a forked child ends with os._exit: flush what a started one would
