"""``python -m launch run``: every role of one run as processes on this machine.

The launcher hosts the registry, starts the role processes, waits until each has
registered (the READY handshake), then watches them::

    launcher (registry) --spawn--> buffer, reward x R, generator x G, controller x S, trainer x W
        checks     : before any process starts, the config, the model and the data (one line)
        READY      = every expected role registered in the directory
        running    : a controller, generator, reward or buffer process that exits is
                     restarted (the buffer rebuilds its state from the ledger, so nothing
                     is lost); a trainer rank that fails takes its group down, the buffer
                     rewinds to the last complete checkpoint and the group restarts from
                     it (a new incarnation, whose weights the generators take); each at
                     most run.restart_limit times, and not again after it failed twice the
                     same way (the same error at the same line: a restart cannot fix it);
                     a role whose error is a config or storage error stops the run at once
        re-planned : after each step, the pools' busy times and the step's metrics go to the
                     replanner (placement.adaptive, launch/placement/adapter.py; placement.jsonl); a
                     changed plan moves generator and reward-engine slots between two steps
        watched    : no new step within run.stall_timeout_s stops the run with every
                     role's state and log tail; every role dies with the launcher
                     (PR_SET_PDEATHSIG), even a SIGKILLed one
        done       = trainer rank 0 exits 0 after the last step and the final export
        Ctrl-C / SIGTERM, done or failure: SIGTERM to every process, SIGKILL after a grace

The progress bar follows ``metrics.jsonl``, which trainer rank 0 writes once per step.
"""


from __future__ import annotations

import asyncio
import json
import multiprocessing.process
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from launch.checks import advice, check_against, check_config, vllm_refusal
from launch.config import RunConfig, dump_run_config
from launch.forkserver import PRELOAD, ForkServer, RoleProcess, become_forked_child
from launch.placement.adapter import Adapter
from launch.placement.executor import PlanExecutor
from launch.placement.inputs import make_plan, this_machine, with_peak
from launch.placement.plan_file import describe, with_planned_ranks, world_size_of, write_plan
from launch.prepare import (
    check_run_dir,
    checkpoint_step,
    latest_checkpoint,
    prepare_model,
    trim_metrics,
    warm_start_once,
    with_builtin_scorer_models,
    with_run_keys,
    writing,
)
from launch.processes import (
    Proc,
    failure_of,
    log_tail,
    loopback_interface,
    role_counts,
    role_threads,
    same_failure,
    signal_group,
    stop_message,
    without_option,
    write_stacks,
)
from launch.progress import Progress, finish_line, write_curves
from protocols.messages import Ack, Query
from yatt.errors import (
    RUN_STOPPED_EXIT,
    ActorFailed,
    ConfigError,
    PeerLost,
    RemoteError,
    RequestTimeout,
    StorageError,
    TransportError,
)
from yatt.placement.adaptive import SwitchCosts
from yatt.placement.plan import ClusterSpec, Plan
from yatt.placement.planner import engines_of
from yatt.rl.checkpoints import withdraw_checkpoint_request
from yatt.runtime import run_dir as names
from yatt.runtime import trace
from yatt.runtime.lifetime import die_with_parent, release_freed_memory
from yatt.runtime.registry import Directory, Registry
from yatt.runtime.transport import Transport

if TYPE_CHECKING:
    from yatt.rl.data import Prompt

RESTARTABLE = ("controller", "env", "generator", "reward", "buffer")
GRACE_S = 15.0
HUNG_S = 10.0
"""A role process the registry dropped (silent past its heartbeat limit) but still alive
after this long is hung (SIGSTOP, a deadlock): it is killed, then restarted as if it died."""
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
"""A GPU driver's device files (NVIDIA, AMD ROCm, WSL): without one torch sees no GPU."""
WATCH_S = 0.05
"""How often the launcher looks at its role processes: a role's death is seen within it
(a look reads the new metrics lines and polls each process: the launcher took 2.0% of a core
in a disaggregated default job, 1.4% at 0.2 s, where a restart waited 0.1 s on average)."""


class LocalLauncher:
    """Starts, watches and stops one run's processes on this machine.

    A subclass changes where processes run through ``registry_endpoints``,
    ``rendezvous_port``, ``role_command``, ``role_env`` and ``ask_to_stop``
    (``launch.slurm`` runs each as an ``srun`` step).
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, *, resume: Path | None = None, show_progress: bool = True) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.resume = resume
        self.show_progress = show_progress
        self.procs: list[Proc] = []
        self.model_path = Path()
        self.registry_endpoint = ""
        self.master_port = 0
        self._store: object = None  # the trainer ranks' torch.distributed TCPStore
        self._registry: Registry | None = None
        self.host = cfg.run.host
        """The address of the registry and of the torch.distributed rendezvous."""
        self.plan: Plan | None = None
        self.prompt_tokens: float | None = None
        """The training prompts' mean length in tokens (the planner's workload), once read."""
        self.gpu_slots = False  # the plan's slots are GPUs
        self.engine_note = ""
        """Which engine ``generator.backend=auto`` chose and why, once chosen."""
        self.trainer_resume = resume
        """The checkpoint the trainer group (re)starts from."""
        self.incarnation = 0
        """Restarts of the trainer group in this run (its weight updates carry it)."""
        self._group_restarts = 0
        """Restarts of the trainer group after a rank failed (run.restart_limit); a re-planned regroup is not one."""
        self._failures: dict[str, set[str]] = {}
        """How each restarted role process (its name) and the trainer group ("trainer") last
        failed (``failure_of``): a second failure the same way stops the run."""
        self.cluster: ClusterSpec | None = None
        self.executor = PlanExecutor(self, replan_from=checkpoint_step(resume) if resume is not None else 0)
        """Carries re-planned plans out between two steps (placement.adaptive)."""
        self.fork_server = ForkServer(PRELOAD, model_path=cfg.model.path) if cfg.run.fork_roles else None
        """Where the roles on CPUs are forked from, warm (None: every role starts from its command line)."""

    def make_plan(self) -> Plan | None:
        """Where each role runs on this machine (written to the run dir; roles read it back)."""
        cluster = this_machine(peak_flops=0.0, cpu_slots=self.cfg.placement.cpu_slots)  # the planner measures the peak when it needs it
        if self.cfg.placement.adaptive:  # the re-planner always does: measured here, in the checks, not in this process later
            cluster = with_peak(cluster, self.cfg.model.dtype)
        self.gpu_slots = cluster.slots[0].kind == "gpu"
        self.cluster = cluster
        return make_plan(self.cfg, cluster, self.prompt_tokens)

    def make_adapter(self, ready_s: float) -> Adapter | None:
        """The run's replanner (placement.adaptive), its switch costs this run's own: for an
        engine that joins and for a new trainer group, ``ready_s`` (this run's start to
        READY, every role: an upper bound for one process, and for the ranks' build and
        checkpoint load); a second for one that leaves (SIGTERM to exit, measured ~1 s)."""
        if not self.cfg.placement.adaptive or self.plan is None or self.cluster is None:
            return None
        switch = SwitchCosts(to_rollout_s=ready_s, to_train_s=1.0, reshard_s=ready_s)
        return Adapter(self.cfg, self.plan, self.cluster, self.run_dir, switch=switch, prompt_tokens=self.prompt_tokens)

    @property
    def world_size(self) -> int:
        """The trainer group's ranks: the plan's (a run re-planned can change it), else the config's."""
        return world_size_of(self.plan, self.cfg.trainer.world_size)

    def _gpus_of(self, role: str, index: int) -> list[int]:
        """The GPUs of a role process's slots (on a GPU machine; none for a light role)."""
        if self.plan is None or not self.gpu_slots:
            return []
        mine = [a for a in self.plan.assignments if a.role == role and a.index == index]
        return list(mine[0].slots) if mine else []

    def processes(self) -> dict[str, int]:
        """Processes to start per role, in start order."""
        return self.plan.counts() if self.plan is not None else role_counts(self.cfg)

    def expected(self) -> dict[str, int]:
        """Registrations per role before the run is READY (a colocated rank registers its engine too)."""
        counts = dict(self.processes())
        if self.plan is not None:
            counts["generator"] += sum(a.hosts_generator for a in self.plan.of("trainer"))
        return counts

    def registry_endpoints(self) -> tuple[str, str]:
        """Where the registry binds: its requests and its membership feed."""
        return f"tcp://{self.host}:*", f"tcp://{self.host}:*"

    def rendezvous_port(self) -> int:
        """The port of the trainer ranks' torch.distributed store, a fresh one per group,
        written to ``<run_dir>/launcher.json`` with the registry's endpoint (a forked role's
        environment cannot be read from outside: launch/forkserver.py)."""
        port = self.host_store(0)
        record = {"pid": os.getpid(), "registry": self.registry_endpoint, "store_port": port}
        (self.run_dir / names.LAUNCHER).write_text(json.dumps(record) + "\n")
        return port

    def host_store(self, port: int) -> int:
        """Host the trainer ranks' torch.distributed store, listening on ``self.host`` only (a
        TCPStore binds every interface unless handed its socket), on ``port`` (0: a free
        one); the ranks connect as clients (TORCHELASTIC_USE_AGENT_STORE), a restarted group
        on a fresh store. Where roles are forked, a process forked from the fork server hosts
        it (this process never imports torch: ~200 MB less in every run); elsewhere this
        one. Returns the port."""
        self._close_store()
        if self.fork_server is None:
            self._store, bound = open_store(self.host, port)
            return bound
        receive, send = self.fork_server.pipe()
        child = self.fork_server.call(_host_store_in_child, self.host, port, send, name="yatt store")
        send.close()
        try:
            kind, value = receive.recv()
        except EOFError:
            child.join()
            raise RuntimeError(
                f"the store's process exited before it listened (exit code {child.exitcode})"
            ) from None
        finally:
            receive.close()
        self._store = child
        if kind == "raised":
            raise _raised(*value)
        return int(value)

    def _close_store(self) -> None:
        """Close the store (its process, where one hosts it) so that its port is free again."""
        store, self._store = self._store, None  # a TCPStore closes its socket when it goes
        if isinstance(store, multiprocessing.process.BaseProcess):
            store.kill()
            store.join()

    async def run(self) -> int:
        """Run to completion; 0 on success, 1 when a role failed or a write did (a full disk:
        one line, the path and the free space there), 2 on a config error, 130 on Ctrl-C."""
        if self.resume is not None and checkpoint_step(self.resume) >= self.cfg.run.steps:
            print(
                f"yatt: {self.run_dir} is done: its last checkpoint is step {checkpoint_step(self.resume)} of "
                f"run.steps={self.cfg.run.steps}; to train longer, resume with run.steps=N (N > {checkpoint_step(self.resume)})",
                flush=True,
            )
            return 0
        if self.fork_server is not None and self.cfg.trainer.world_size != 0:  # its imports run beside the checks
            self.fork_server.start()  # (with world_size 0 the plan measures thread scaling: see _check)
        try:
            await self._check()
            if self.plan is not None:
                with writing(self.run_dir / names.PLAN):
                    write_plan(self.plan, self.run_dir)
        except ConfigError as e:
            print(f"yatt: config error: {e}", file=sys.stderr, flush=True)
            return 2
        except StorageError as e:
            print(f"yatt: {e}", file=sys.stderr, flush=True)
            return 1
        if self.plan is not None:
            print(f"yatt: {describe(self.plan)}", flush=True)
        if self.engine_note:
            print(f"yatt: {self.engine_note}", flush=True)
        for line in advice(self.cfg):
            print(f"yatt: note: {line}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with Transport(self.cfg.transport) as transport:
            endpoint, publish_endpoint = self.registry_endpoints()
            registry = self._registry = Registry(transport, endpoint=endpoint, publish_endpoint=publish_endpoint)
            self.registry_endpoint = await registry.start()
            try:
                self.master_port = self.rendezvous_port()
                withdraw_checkpoint_request(self.run_dir)  # a resumed run's: its change was not carried out
                async with Directory(transport, self.registry_endpoint, name="launcher") as directory:
                    started = time.monotonic()
                    for role, count in self.processes().items():
                        for index in range(count):
                            self.procs.append(self.spawn(role, index))
                    await self._wait_ready(directory, stop)
                    print(f"yatt: all roles READY; run dir {self.run_dir}", flush=True)
                    self.executor.start(directory, await asyncio.to_thread(self.make_adapter, time.monotonic() - started))
                    try:
                        code = await self._watch(directory, stop)
                    finally:
                        await self.executor.close()
                    if code == 0:
                        try:
                            write_curves(self.run_dir)
                        except (OSError, ImportError, ValueError) as e:  # the run is done either way
                            print(f"yatt: curves.png not drawn ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
                        print(f"yatt: {finish_line(self.run_dir)}", flush=True)
                    return code
            except (ActorFailed, ConfigError, StorageError) as e:
                print(f"yatt: {e}", file=sys.stderr, flush=True)
                return 1
            finally:
                await self._stop_all()
                self._close_store()
                await registry.close()

    CHECKED = ("cfg", "model_path", "prompt_tokens", "plan", "cluster", "gpu_slots", "engine_note")
    """What the checks set on the launcher (``_checked``), sent back from the process they ran in."""

    def __getstate__(self) -> dict[str, object]:
        """What the checks' process gets of this launcher (``_check``): its config and what
        its plan is made from, not this process's fork server, sockets, processes and
        executor."""
        here = ("executor", "fork_server", "_store", "_registry", "procs")
        return {name: value for name, value in self.__dict__.items() if name not in here}

    async def _check(self) -> None:
        """What can be checked before any process starts (``_checked``). Preparing the model,
        tokenising the prompts, the plan's measurements and the warm start import
        transformers' model code and build models: a tiny VLM run's launcher held ~410 MB
        for the whole run after them, ~230 MB with torch's import alone. So where roles are
        forked (a CPU machine), the checks run in a process forked from the fork server
        (its imports made once, no OpenMP threads started: a fork of a process whose
        OpenMP pool ran hangs at its child's first parallel region) and take that memory
        with them when they exit; their results come back over a pipe, a ``ConfigError``
        or ``StorageError`` as itself. Elsewhere (``run.fork_roles=false``, SLURM, a GPU
        machine: the server sees no GPU) they run here."""
        if self.fork_server is None or _sees_gpus():
            await asyncio.to_thread(self._checked)
            release_freed_memory()  # (the warm start's and the prompts' freed heap: ~190 MB of a tiny VLM run's)
            if self.fork_server is not None:
                self.fork_server.start()  # (auto: only now, as its imports would disturb the plan's thread scaling)
            return
        receive, send = self.fork_server.pipe()
        child = self.fork_server.call(_check_in_child, self, send, dict(os.environ), name="yatt checks")
        send.close()
        try:
            try:
                kind, value = await asyncio.to_thread(receive.recv)
            except EOFError:
                await asyncio.to_thread(child.join)
                raise RuntimeError(
                    f"the checks before the start exited without a result (exit code {child.exitcode}); its output is above"
                ) from None
            if kind == "raised":
                raise _raised(*value)
            for name, attribute in value.items():
                setattr(self, name, attribute)
        finally:
            receive.close()
            if child.is_alive():
                child.kill()  # cancelled (Ctrl-C) while it ran
            await asyncio.to_thread(child.join)

    def _checked(self) -> None:
        """The checks: the run dir, the model, the data (read and tokenised here once; the
        roles read these prompts back from ``<run_dir>/prompts.msgpack``), the placement,
        what needs them together (launch/checks.py), then the warm start. A failed write is
        a ``StorageError`` naming its path."""
        check_run_dir(self.run_dir, self.resume)
        check_config(self.cfg)
        if failpoint := os.environ.get(trace.FAILPOINT_ENV):
            trace.parse_failpoint(failpoint)
        trace.reward_slowdown(self.run_dir)  # an injected workload shift, when asked for
        trace.training_slowdown(self.run_dir)
        with writing(self.run_dir):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / names.LOGS).mkdir(exist_ok=True)
        self.model_path = prepare_model(self.cfg, self.run_dir)
        self.cfg = with_builtin_scorer_models(self.cfg, self.run_dir)
        from workers.reward.scorers import check_custom_scorers
        from yatt.rl.data import PROMPT_SETS_FILE, load_prompt_sets, write_prompt_sets

        sets = load_prompt_sets(self.cfg.data, str(self.model_path))
        write_prompt_sets(self.run_dir / PROMPT_SETS_FILE, self.cfg.data, str(self.model_path), sets)  # the roles read them
        prompts = sets[0]
        self.prompt_tokens = sum(len(p.prompt_ids) for p in prompts) / max(1, len(prompts))
        check_custom_scorers(self.cfg.reward, {key for p in prompts[:100] for key in p.metadata})
        self.plan = self.make_plan()
        self.cfg = with_planned_ranks(self.cfg, self.plan)
        if self.cfg.generator.backend == "auto":
            self._choose_engine(sets)
        check_against(self.cfg, self.model_path, sets, self.world_size if self.processes().get("trainer") else 0)
        warm_start_once(self.cfg, self.model_path, prompts)
        if self.resume is not None:  # the steps after the checkpoint are trained again
            trim_metrics(self.run_dir, checkpoint_step(self.resume))
        self.cfg = with_run_keys(self.cfg, self.run_dir)
        with writing(self.run_dir / names.CONFIG):
            dump_run_config(self.cfg, self.run_dir / names.CONFIG)

    def _choose_engine(self, sets: tuple[list[Prompt], list[Prompt]]) -> None:
        """``generator.backend=auto`` made the faster engine for this run, measured where
        vLLM could win (``launch.placement.engines``); on a GPU the plan is made again for
        vLLM's share of the device."""
        from launch.placement.engines import choose_engine

        engines = engines_of(self.plan) if self.plan is not None else []
        threads = role_threads(self.cfg, engines[0].role, engines[0].index, self.plan) if engines else 1
        refusal = vllm_refusal(self.cfg, self.model_path, sets)
        choice = choose_engine(self.cfg, self.plan, self.model_path, sets[0], refusal=refusal, threads=threads,
                               device="cuda" if self.gpu_slots else "cpu")
        self.cfg = replace(self.cfg, generator=replace(self.cfg.generator, backend=choice.backend))
        self.engine_note = f"generator: {choice.backend} (generator.backend=auto: {choice.reason})"
        if choice.backend == "vllm" and self.gpu_slots:
            self.plan = self.make_plan()

    def spawn(self, role: str, index: int, restarts: int = 0) -> Proc:
        log = self.run_dir / names.LOGS / f"{role}-{index}.log"
        log_from = log.stat().st_size if log.exists() else 0  # what this start writes comes after
        cmd, env = self.role_command(role, index), self.role_env(role, index)
        if role == "buffer" and restarts:  # a restart carries on from the ledger, it does not rewind
            cmd = without_option(cmd, "--resume")
        popen: RoleProcess
        if self.fork_server is not None and not self._gpus_of(role, index):
            popen = self.fork_server.fork(cmd, env, log)
        else:
            with log.open("ab") as out:
                popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return Proc(role=role, index=index, popen=popen, log=log, restarts=restarts, log_from=log_from)

    def role_command(self, role: str, index: int) -> list[str]:
        """The command line of one role process."""
        cmd = [
            sys.executable, "-m", "launch.role", role,
            "--run-dir", str(self.run_dir),
            "--registry", self.registry_endpoint,
            "--index", str(index),
            "--model-path", str(self.model_path),
        ]  # fmt: skip
        if role == "buffer" and self.resume is not None:
            cmd += ["--resume", str(self.resume)]
        if role == "trainer":
            if self.trainer_resume is not None:
                cmd += ["--resume", str(self.trainer_resume)]
            cmd += ["--incarnation", str(self.incarnation)]
        if role == "generator" and self._gpus_of(role, index):
            cmd += ["--device", "cuda"]  # its slots' GPUs, the only ones it sees
        return cmd

    def role_env(self, role: str, index: int) -> dict[str, str]:
        """The environment of one role process (a trainer rank's torch.distributed variables)."""
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(role_threads(self.cfg, role, index, self.plan))
        env["PYTHONUNBUFFERED"] = "1"
        env["YATT_LAUNCHER_PID"] = str(os.getpid())  # the role dies with it (launch.role)
        if role == "trainer":
            env.update(
                MASTER_ADDR=self.host,
                MASTER_PORT=str(self.master_port),
                TORCHELASTIC_USE_AGENT_STORE="True",  # the launcher hosts the store
                RANK=str(index),
                WORLD_SIZE=str(self.world_size),
                LOCAL_RANK=str(index),
            )
            interface = loopback_interface(self.host)
            if interface:  # gloo's own sockets: loopback only, as everything else of the run
                env["GLOO_SOCKET_IFNAME"] = interface
        gpus = self._gpus_of(role, index)
        if gpus:  # each process sees only its slots' GPUs (a trainer rank: its one GPU, as cuda:0)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
            if role == "trainer":
                env["LOCAL_RANK"] = "0"
        elif self.gpu_slots and role not in ("generator", "trainer"):
            env["CUDA_VISIBLE_DEVICES"] = ""  # light roles stay off the GPUs
        return env

    def ask_to_stop(self, procs: list[Proc]) -> None:
        """SIGTERM to each process and everything it started (the SIGKILL comes after a grace)."""
        for p in procs:
            signal_group(p.popen, signal.SIGTERM)

    async def _wait_ready(self, directory: Directory, stop: asyncio.Event) -> None:
        expected = self.expected()

        def ready(d: Directory) -> bool:
            return all(len(d.members(role)) >= n for role, n in expected.items())

        deadline = time.monotonic() + self.cfg.run.ready_timeout_s
        while not ready(directory):
            for p in self.procs:
                if p.popen.poll() is not None:
                    raise ActorFailed(
                        f"{p.name} exited with code {p.popen.returncode} before it was READY; "
                        f"its log ({p.log}):\n{log_tail(p.log)}"
                    )
            if stop.is_set():
                raise ActorFailed("interrupted before every role was READY")
            if time.monotonic() > deadline:
                have = {role: len(directory.members(role)) for role in expected}
                raise ActorFailed(
                    f"not every role was READY within run.ready_timeout_s={self.cfg.run.ready_timeout_s}: "
                    f"expected {expected}, registered {have}; see {self.run_dir / 'logs'}"
                )
            try:
                await directory.wait_until(ready, timeout=0.5)
            except RequestTimeout:
                continue  # poll the processes again

    async def _watch(self, directory: Directory, stop: asyncio.Event) -> int:
        progress = Progress(self.run_dir / names.METRICS, self.cfg.run.steps, enabled=self.show_progress)
        last_step = time.monotonic()
        try:
            while not stop.is_set():
                if (code := self.outcome(directory)) is not None:
                    return code
                if progress.update():
                    last_step = time.monotonic()
                    self.executor.feed(progress.lines)  # measured beside this loop
                resumed = await self.executor.at_step_boundary(directory, logged=progress.last_step)
                if resumed is not None:  # the trainer group restarted at its new size
                    progress.rewind(resumed)
                    last_step = time.monotonic()
                stall = self.cfg.run.stall_timeout_s
                if stall and time.monotonic() - last_step > stall:
                    await write_stacks(self.procs)
                    raise ActorFailed(
                        f"no step for {stall:.0f} s (run.stall_timeout_s); the run stops. Every role (where its "
                        "threads and asyncio tasks were is at the end of its log):\n" + self.roles_report()
                    )
                await self._kill_hung(directory)
                exited = await self._exits(directory)
                if exited == "done":
                    progress.update()
                    return 0
                if exited == "regrouped":
                    progress.rewind(checkpoint_step(self.trainer_resume) if self.trainer_resume else 0)
                    last_step = time.monotonic()
                await asyncio.sleep(WATCH_S)
            return 130
        finally:
            progress.close()

    async def _exits(self, directory: Directory) -> Literal["done", "regrouped"] | None:
        """Each role process that exited since the last look: trainer rank 0 done ends the
        run; a role that stopped the run stops it; a restartable one is restarted; a failed
        trainer rank restarts the trainer group (then the rest wait for the next look). A
        role, or the group, that fails the same way as it did the last time (``failure_of``:
        the same error raised at the same line) is not restarted again: the run stops."""
        for i, p in enumerate(self.procs):
            code = p.popen.poll()
            if code is None:
                continue
            await self.forget([p])
            if p.role == "trainer" and p.index == 0 and code == 0:
                return "done"
            if code == RUN_STOPPED_EXIT:
                raise await self._stopped(f"{p.name} stopped the run (its log: {p.log}). {stop_message(p.log)}")
            if p.role in RESTARTABLE:
                failure = failure_of(p)
                if failure is not None and same_failure(failure, self._failures.get(p.name, set())):
                    raise await self._stopped(self._failed_twice(p, failure))
                if p.restarts >= self.cfg.run.restart_limit:
                    raise ActorFailed(
                        f"{p.name} died {p.restarts + 1} times (run.restart_limit={self.cfg.run.restart_limit}); "
                        f"last log ({p.log}):\n{log_tail(p.log)}"
                    )
                self._failures[p.name] = {failure} if failure is not None else set()
                said = f" ({failure})" if failure is not None else ""
                print(f"yatt: {p.name} exited with code {code}{said}; restarting it", file=sys.stderr, flush=True)
                self.procs[i] = self.spawn(p.role, p.index, restarts=p.restarts + 1)
                continue
            if p.role == "trainer" and code == 0:
                continue  # a non-zero rank finished; rank 0 ends the run
            failures = self._group_failures()
            if repeated := [(q, f) for q, f in failures if same_failure(f, self._failures.get("trainer", set()))]:
                raise await self._stopped(self._failed_twice(*repeated[0]))
            self._failures["trainer"] = {f for _, f in failures}
            if self._group_restarts >= self.cfg.run.restart_limit:
                raise ActorFailed(
                    f"{p.name} exited with code {code}, and the trainer group was restarted {self._group_restarts} "
                    f"times (run.restart_limit); the run stops. Resume from the last checkpoint with "
                    f"`python -m launch run --resume {self.run_dir}`. Its log ({p.log}):\n{log_tail(p.log)}"
                )
            self._group_restarts += 1
            said = failure_of(p) or f"its log's end:\n{log_tail(p.log, 10)}"  # (its traceback stays in its log)
            print(f"yatt: {p.name} exited with code {code}; its log: {p.log}; {said}", file=sys.stderr, flush=True)
            for q in self.procs:  # the rank that died first may come later in the list
                if q is not p and q.role == "trainer" and (other := q.popen.poll()) is not None:
                    print(f"yatt: {q.name} exited with code {other} too", file=sys.stderr, flush=True)
            await self.restart_trainers(directory)
            return "regrouped"
        return None

    def _group_failures(self) -> list[tuple[Proc, str]]:
        """How the trainer ranks that exited failed (``failure_of``); none when one of them
        died without saying (a signal: the OOM killer, a person), as the others' errors are
        then what its death did to them (a collective that lost a peer), no fault of theirs."""
        failed = [q for q in self.procs if q.role == "trainer" and q.popen.poll() not in (None, 0)]
        failures = [(q, failure_of(q)) for q in failed]
        return [] if any(f is None for _, f in failures) else [(q, f) for q, f in failures if f is not None]

    @staticmethod
    def _failed_twice(p: Proc, failure: str) -> str:
        return (
            f"{p.name} failed twice the same way, so the run stops (a restart would fail again): {failure}; "
            f"its log: {p.log}"
        )

    async def _stopped(self, cause: str) -> ActorFailed:
        """The run stops with ``cause``: every role is stopped first, so that the cause is
        the last line the user sees (a role killed after the grace is named before it)."""
        await self._stop_all()
        return ActorFailed(cause)

    def outcome(self, directory: Directory) -> int | None:
        """The launcher's exit code once its work is done by another sign than trainer rank 0
        finishing (``launch eval``); None meanwhile."""
        return None

    async def _kill_hung(self, directory: Directory) -> None:
        """SIGKILL a role process that stopped answering: the registry dropped it, its peers
        re-issued its work; killed, it cannot wake up and answer late (a second buffer).
        Where it hung (a deadlock) is written to its log first."""
        pids = {w.meta.get("pid") for w in directory.members()}
        now = time.monotonic()
        for p in self.procs:
            if p.popen.poll() is not None:
                continue
            if str(p.popen.pid) in pids:
                p.registered, p.missing_since = True, None
            elif p.registered:
                p.missing_since = p.missing_since or now
                if now - p.missing_since > HUNG_S:
                    await write_stacks([p])
                    print(
                        f"yatt: {p.name} stopped answering (dropped from the registry {HUNG_S:.0f} s ago); killing it "
                        f"(where it was, unless stopped, is at the end of its log: {p.log})", file=sys.stderr, flush=True,
                    )  # fmt: skip
                    signal_group(p.popen, signal.SIGKILL)
                    p.popen.wait()

    async def restart_trainers(self, directory: Directory, world_size: int | None = None) -> Path | None:
        """The trainer group again, from the last complete checkpoint (or the start): stop
        every rank, rewind the buffer to the checkpoint, trim the metrics, start the ranks
        as a new incarnation (the generators take its weights, older ones are refused).
        ``world_size``: the new group's size (a re-planned run), its ranks on the plan's
        slots. Returns the checkpoint."""
        ranks = [p for p in self.procs if p.role == "trainer"]
        for p in ranks:  # killed, not asked to stop: nothing of theirs is kept (a write in flight needed the dead rank too)
            if p.popen.poll() is None:
                signal_group(p.popen, signal.SIGKILL)
        for p in ranks:
            await asyncio.to_thread(p.popen.wait)
        await self.forget(ranks)
        checkpoint = latest_checkpoint(self.run_dir)
        print(f"yatt: restarting the trainer group from {checkpoint or 'the start'}", file=sys.stderr, flush=True)
        args = {"dir": str(checkpoint)} if checkpoint is not None else {}
        if world_size is not None:
            args["world_size"] = str(world_size)
        try:
            reply = await directory.request(
                "buffer", Query(what="rewind", args=args), Ack,
                timeout=self.cfg.transport.request_timeout_s, within=self.cfg.run.ready_timeout_s,
            )  # fmt: skip
        except (PeerLost, RemoteError, RequestTimeout, TransportError) as e:
            raise ActorFailed(f"the buffer could not rewind to {checkpoint or 'the start'}: {e}") from e
        trim_metrics(self.run_dir, checkpoint_step(checkpoint) if checkpoint is not None else 0)
        self.trainer_resume = checkpoint
        self.incarnation += 1
        self.master_port = self.rendezvous_port()
        if world_size is None:
            for p in ranks:
                self.procs[self.procs.index(p)] = self.spawn("trainer", p.index, restarts=p.restarts + 1)
        else:
            self.procs = [p for p in self.procs if p.role != "trainer"]
            self.procs += [self.spawn("trainer", index) for index in range(world_size)]
        print(
            f"yatt: buffer rewound to step {reply.info.get('version')} (batches assembled up to step {reply.info.get('step')}); "
            f"trainer group incarnation {self.incarnation}", file=sys.stderr, flush=True,
        )  # fmt: skip
        return checkpoint

    async def forget(self, procs: list[Proc]) -> None:
        """Drop the registry entries of processes seen to exit (a process on this machine:
        its pid; SLURM steps are dropped at their heartbeat limit)."""
        if self._registry is not None:
            for p in procs:
                await self._registry.drop_process(p.popen.pid)

    def roles_report(self) -> str:
        """Each role process: alive or its exit code, its restarts, the tail of its log."""
        lines = []
        parked = [x.proc for x in self.executor.parked.values()]
        for p in self.procs + parked:
            code = p.popen.poll()
            state = f"exited {code}" if code is not None else "parked" if p in parked else "alive"
            lines.append(f"  {p.name}: {state}, {p.restarts} restarts, log {p.log}:")
            lines.extend(f"    {line}" for line in log_tail(p.log, 5).splitlines())
        return "\n".join(lines)

    async def _stop_all(self) -> None:
        await self.stop(self.procs + [p.proc for p in self.executor.parked.values()])

    async def stop(self, procs: list[Proc]) -> None:
        """SIGTERM, then SIGKILL after the grace, to those of ``procs`` still running (their
        stacks written to their logs first)."""
        live = [p for p in procs if p.popen.poll() is None]
        self.ask_to_stop(live)
        deadline = time.monotonic() + GRACE_S
        while any(p.popen.poll() is None for p in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        late = [p for p in live if p.popen.poll() is None]
        if late:
            await write_stacks(late)
        for p in late:
            if p.popen.poll() is None:
                print(
                    f"yatt: {p.name} did not stop within {GRACE_S:g} s of SIGTERM; killing it (where its threads and "
                    f"tasks were is at the end of its log: {p.log})", file=sys.stderr, flush=True,
                )  # fmt: skip
                signal_group(p.popen, signal.SIGKILL)
                p.popen.wait()


def _check_in_child(launcher: LocalLauncher, send: Connection, environ: dict[str, str]) -> None:
    """``launcher._checked()`` in a process forked from the fork server, with the launcher's
    environment; sends ``("done", <its CHECKED attributes>)``, or ``("raised", (kind, text,
    traceback))`` (``_raised`` makes the error again in the launcher)."""
    become_forked_child()
    die_with_parent(os.getppid())  # the server, which dies with the launcher
    os.environ.clear()
    os.environ.update(environ)
    try:
        launcher._checked()
    except Exception as e:  # every error reaches the launcher, raised there
        send.send(("raised", _as_data(e)))
        return
    send.send(("done", {name: getattr(launcher, name) for name in launcher.CHECKED}))


def open_store(host: str, port: int) -> tuple[object, int]:
    """A torch.distributed ``TCPStore`` server on ``host``:``port`` (0: a free one), listening
    on that address only; returns it (its socket closes when it goes) and its port."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public; torch's stubs miss it

    listener = socket.create_server((host, port))  # SO_REUSEADDR: the same port again
    bound, fd = int(listener.getsockname()[1]), listener.detach()  # the store owns the socket
    try:
        return TCPStore(host, bound, None, True, wait_for_workers=False, master_listen_fd=fd), bound
    except BaseException:
        os.close(fd)
        raise


def _host_store_in_child(host: str, port: int, send: Connection) -> None:
    """``open_store`` in a process forked from the fork server: sends ``("done", port)`` or
    ``("raised", (kind, text, traceback))``, then serves until it is killed."""
    become_forked_child()
    die_with_parent(os.getppid())  # the server, which dies with the launcher
    try:
        store, bound = open_store(host, port)
    except Exception as e:
        send.send(("raised", _as_data(e)))
        return
    send.send(("done", bound))
    send.close()
    while store is not None:  # the store's server runs in its own thread
        signal.pause()


def _as_data(error: Exception) -> tuple[str, str, str]:
    """A child's error as plain data for its launcher (``_raised`` makes it again): its kind
    (config, storage or the exception's name), its text and the child's traceback."""
    kind = "config" if isinstance(error, ConfigError) else "storage" if isinstance(error, StorageError) else type(error).__name__
    return kind, str(error), traceback.format_exc()


def _raised(kind: str, text: str, trace: str) -> Exception:
    """The checks' error in the launcher: a config or storage error as itself (one line for
    the user), any other with the child's traceback."""
    if kind == "config":
        return ConfigError(text)
    if kind == "storage":
        return StorageError(text)
    error = RuntimeError(f"{kind}: {text}")
    error.add_note(f"(in the checks' process)\n{trace}")
    return error


def _sees_gpus() -> bool:
    """Whether torch sees a GPU here (without starting CUDA in this process). Without a GPU
    driver's device files (NVIDIA's, AMD's, WSL's) it cannot, and torch is not imported to
    say so: a CPU machine's launcher never imports it."""
    if not any(Path(device).exists() for device in GPU_DEVICE_FILES):
        return False
    import torch

    return bool(torch.cuda.is_available())
