"""The launcher's role processes: what it knows of each, and how it signals, reads and sizes them.

A role process is started from the fork server or its command line (``launch.local``) in
a process group of its own: a signal goes to the group (vLLM's engine core, scorer pools),
SIGUSR1 asks it to write its threads' and asyncio tasks' stacks to its log first.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from launch.config import RunConfig
from launch.forkserver import RoleProcess
from yatt.placement.plan import Plan

STACKS_S = 0.5
"""How long a role has to write its stacks to its log (``write_stacks``)."""
FAILED_MARK = "yatt: failed: "
"""Begins the last line a role that failed writes to its log (``launch.role.failed``): its
error and where it was raised, what the launcher compares its failures by (``failure_of``)."""
STOPPED_MARK = "yatt: the run cannot go on: "
"""Begins what a role that stopped the run (``RUN_STOPPED_EXIT``) writes last: why."""
FAILURE_TAIL_BYTES = 65536
"""How much of the end of a role's log ``failure_of`` reads (its line is the last but a few)."""
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")

@dataclass
class Proc:
    """One role process the launcher watches."""

    role: str
    index: int
    popen: RoleProcess
    log: Path
    restarts: int = 0
    started: float = field(default_factory=time.monotonic)
    registered: bool = False  # seen in the directory (its pid)
    missing_since: float | None = None  # dropped from the directory (silent) while alive
    log_from: int = 0  # where this start's part of its log begins (the log's size before it)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


def role_counts(cfg: RunConfig) -> dict[str, int]:
    """How many processes of each role the run has, in the order they are started."""
    return {
        "buffer": 1,
        "reward": cfg.run.num_rewards,
        "env": cfg.env.env_workers,
        "generator": cfg.run.num_generators,
        "controller": cfg.controller.num_controllers,
        "trainer": cfg.trainer.world_size,
    }


def role_threads(cfg: RunConfig, role: str, index: int = 0, plan: Plan | None = None) -> int:
    """CPU threads of one role process: ``generator.threads`` / ``trainer.threads`` when set,
    else the plan's (the cores of its slots; a colocated rank's engine generates on them).
    Without a plan (SLURM), the generators and trainer ranks get their share of the cores.
    The buffer, controllers and reward workers move messages and run Python: one thread."""
    configured = {"generator": cfg.generator.threads, "trainer": cfg.trainer.threads}.get(role, 0)
    if configured:
        return configured
    if plan is not None:
        mine = [a for a in plan.assignments if a.role == role and a.index == index]
        if mine:
            return mine[0].threads
    cores = len(os.sched_getaffinity(0))
    if role == "generator":
        return max(1, cores // cfg.run.num_generators)
    if role == "trainer":
        return max(1, cores // cfg.trainer.world_size)
    return 1


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop_message(path: Path) -> str:
    """What a role that stopped the run (RUN_STOPPED_EXIT) said: its log from its last
    "the run cannot go on" to the end (a scorer's traceback included)."""
    text = log_tail(path, 200)
    return text[text.rindex(STOPPED_MARK) + len("yatt: "):] if STOPPED_MARK in text else text.splitlines()[-1] if text else ""


def failure_of(p: Proc) -> str | None:
    """How role process ``p`` failed: the line it wrote last (``launch.role.failed``), its
    error's type and first line and the file:line it was raised at, e.g. ``IndexError: index
    out of range in self (at .../torch/nn/functional.py:2551)``; None when this start wrote
    none (killed by a signal, or dead before ``launch.role.main`` could say).

    Two failures of a role are the same when these lines are equal (hex addresses aside:
    ``<object at 0x7f...>`` differs in every process). The role writes it from the exception
    itself, the innermost of its causes (``raise ... from``): the error where it arose, not
    the wrappers it travelled in (an ``ActorFailed`` carries a group key, a traceback in its
    message). That is sturdier than reading back the traceback the log shows: a chained
    one prints every cause, the actor's logger prints it once more, and the log is appended
    to across starts, so only the part this start wrote (from ``p.log_from``) is read: a
    start killed by a signal never takes an earlier start's failure for its own."""
    try:
        with p.log.open("rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(p.log_from, size - FAILURE_TAIL_BYTES))
            text = log.read().decode(errors="replace")
    except OSError:
        return None
    lines = [line for line in text.splitlines() if line.startswith(FAILED_MARK)]
    return lines[-1][len(FAILED_MARK):] if lines else None


def same_failure(failure: str, others: set[str]) -> bool:
    """Whether ``failure`` (``failure_of``) is one of ``others``, hex addresses aside."""
    return _ADDRESS.sub("0x", failure) in {_ADDRESS.sub("0x", other) for other in others}


def loopback_interface(host: str) -> str | None:
    """The network interface holding loopback address ``host`` (Linux: lo), else None."""
    import psutil

    if not ipaddress.ip_address(host).is_loopback:
        return None
    return next((name for name, addrs in psutil.net_if_addrs().items() if any(a.address == host for a in addrs)), None)


def without_option(cmd: list[str], option: str) -> list[str]:
    """``cmd`` without ``option`` and its value."""
    if option not in cmd:
        return cmd
    i = cmd.index(option)
    return cmd[:i] + cmd[i + 2 :]


def signal_group(popen: RoleProcess, sig: signal.Signals) -> None:
    """Signal the process and everything it started (vLLM's engine core, scorer pools)."""
    try:
        os.killpg(popen.pid, sig)
    except ProcessLookupError:
        pass


async def write_stacks(procs: list[Proc]) -> None:
    """Ask each running role process to write its threads' and asyncio tasks' stacks to its
    log (SIGUSR1, ``launch.role``), and give them ``STACKS_S`` to do it."""
    import psutil

    asked = False
    for p in procs:
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if p.popen.poll() is None and psutil.Process(p.popen.pid).status() != psutil.STATUS_STOPPED:  # (SIGSTOP: it cannot)
                os.kill(p.popen.pid, signal.SIGUSR1)
                asked = True
    if asked:
        await asyncio.sleep(STACKS_S)
