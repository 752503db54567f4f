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
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from launch.config import RunConfig
from launch.forkserver import RoleProcess
from yatt.placement.plan import Plan

STACKS_S = 0.5
"""How long a role has to write its stacks to its log (``write_stacks``)."""

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

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


def role_counts(cfg: RunConfig) -> dict[str, int]:
    """How many processes of each role the run has, in the order they are started."""
    return {
        "buffer": 1,
        "reward": cfg.run.num_rewards,
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
    marker = "yatt: the run cannot go on: "
    return text[text.rindex(marker) + len("yatt: "):] if marker in text else text.splitlines()[-1] if text else ""


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
