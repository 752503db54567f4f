"""``python -m launch slurm``: one run as one SLURM allocation, same processes as ``launch run``.

Why it exists: a run that outgrows one machine needs its roles spread over nodes, its
addresses taken from the allocation and its life tied to the job (scancel, requeue)::

    login node   python -m launch slurm CONFIG --nodes N --submit
                   plan_layout(config, N, GPUs) -> which role on which node (or a ConfigError)
                   render launch/slurm/{one_node,nodes}.sbatch.tmpl -> RUN_DIR/job.sbatch -> sbatch
    first node   the batch script execs `python -m launch slurm-head` (the head, a LocalLauncher):
                   nodes and their addresses from `scontrol show hostnames` / `show node`
                   registry + torch.distributed store bound on the first node's address
                   one `srun` job step per role process on its planned node, binding there:
                     generators, trainer ranks: --exact, their share of the node's CPUs,
                                                one GPU each on GPU nodes
                     buffer, controllers, rewards: --overlap (light, CPU only)
                   READY handshake, restarts and shutdown exactly as `launch run`
    scancel      SIGTERM to the head and every step; each role exits, the head stops the rest
    requeue      the script runs again in the same run dir; the head resumes from the last
                 complete checkpoint (or, with none yet, starts over with the old files set aside)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import shutil
import socket
import string
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from launch.config import RunConfig, load_run_config, split_items
from launch.local import LocalLauncher
from launch.prepare import latest_checkpoint
from launch.processes import Proc, role_counts
from yatt.errors import ConfigError, TransportError
from yatt.placement.nodes import HEAVY, LAYOUT_NAMES, Placement, placement_plan, plan_layout
from yatt.placement.plan import Plan
from yatt.runtime import run_dir as names

TEMPLATES = Path(__file__).resolve().parent / "slurm"
# Files of a previous attempt that a fresh start (no checkpoint yet) must not reuse.
ATTEMPT_FILES = (*names.LEDGER_FILES, names.METRICS, names.TENSORBOARD, names.FINAL)


class SlurmError(ConfigError):
    """A SLURM setup problem the user fixes (no SLURM here, sbatch refused, outside a job)."""


def resolve_layout(cfg: RunConfig, nodes: int, cpus: Sequence[int], gpus_per_node: int) -> str:
    """``placement.layout``, with ``auto`` decided by the planner on the allocation's slots
    (every node's GPUs, or its CPUs): the layout it predicts fastest for this run."""
    layout = cfg.placement.layout
    if layout != "auto":
        return layout
    choices = fitting_layouts(cfg, nodes, gpus_per_node)
    if len(choices) <= 1:  # nothing to choose (none: the disaggregated layout's error says what to ask for)
        return choices[0] if choices else "disaggregated"
    from launch.placement.inputs import machine_memory, plan_for_run
    from yatt.placement.layouts import cpu_cluster, gpu_cluster

    if gpus_per_node:
        import torch

        gpu_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 80 << 30
        cluster = gpu_cluster([gpu_bytes] * (nodes * gpus_per_node), list(range(sum(cpus))))
    else:
        node_bytes = (slurm_mem_mb() << 20) or machine_memory()
        cluster = cpu_cluster(list(range(sum(cpus))), node_bytes * nodes)
    picked = plan_for_run(cfg, cluster).layout
    return picked if picked in choices else choices[0]


def fitting_layouts(cfg: RunConfig, nodes: int, gpus_per_node: int) -> list[str]:
    """The layouts ``plan_layout`` can place this run in on the allocation."""
    fit = []
    for layout in LAYOUT_NAMES:
        try:
            plan_layout(role_counts(cfg), nodes, gpus_per_node, layout)
        except ConfigError:
            continue
        fit.append(layout)
    return fit


def slurm_mem_mb() -> int:
    """Memory per node the job was given (``SLURM_MEM_PER_NODE``, MB); 0 when unset or all of it."""
    mem = os.environ.get("SLURM_MEM_PER_NODE")
    return int(mem) if mem and mem.isdigit() and int(mem) > 0 else 0


# ---------------------------------------------------------------------------- the script


class _Template(string.Template):
    delimiter = "@"  # a shell script is full of $


def _flag_value(name: str, value: str) -> str:
    if not value or any(c.isspace() for c in value) or "'" in value or '"' in value:
        raise ConfigError(f"{name} {value!r}: must be one word (no spaces or quotes)")
    return value


def render_script(
    cfg: RunConfig,
    *,
    config_path: str | None,
    overrides: Sequence[str],
    nodes: int,
    run_dir: Path,
    gpus_per_node: int = 0,
    partition: str | None = None,
    time_limit: str | None = None,
    workdir: Path | None = None,
    python: str = sys.executable,
) -> str:
    """The sbatch script of one run (raises ``ConfigError`` when the layout does not fit)."""
    layout = cfg.placement.layout
    shown = [layout] if layout != "auto" else fitting_layouts(cfg, nodes, gpus_per_node)
    if not shown:  # auto, and nothing fits: the disaggregated layout's error says what to ask for
        shown = ["disaggregated"]
    placements = {name: plan_layout(role_counts(cfg), nodes, gpus_per_node, name) for name in shown}
    workdir = (workdir or Path.cwd()).resolve()
    run_dir = run_dir if run_dir.is_absolute() else workdir / run_dir
    options = []
    if partition is not None:
        options.append(f"#SBATCH --partition={_flag_value('--partition', partition)}")
    if time_limit is not None:
        options.append(f"#SBATCH --time={_flag_value('--time', time_limit)}")
    if gpus_per_node:
        options.append(f"#SBATCH --gres=gpu:{gpus_per_node}")
    head = [python, "-m", "launch", "slurm-head"]
    if config_path is not None:
        head.append(str((workdir / config_path).resolve()))
    head += [*overrides, "--run-dir", str(run_dir), "--gpus-per-node", str(gpus_per_node)]
    template = TEMPLATES / ("one_node.sbatch.tmpl" if nodes == 1 else "nodes.sbatch.tmpl")
    gpu_note = " (1 GPU each: generators, trainer ranks)" if gpus_per_node else " (CPU only)"
    plan = []
    if layout == "auto":
        plan.append("#   placement.layout=auto: the head picks the layout the planner predicts fastest on the")
        plan.append("#   allocation's CPUs/GPUs when the job starts (`python -m launch plan` shows why), one of:")
    for name, placement in placements.items():
        plan.append(f"#   {name}:")
        lines = [f"#     {line}" for line in placement.describe()]
        lines[0] += "   <- head, registry, torch.distributed store"
        plan += lines
    plan.append(f"#   {gpus_per_node or 'no'} GPUs per node{gpu_note}")
    return _Template(template.read_text()).substitute(
        nodes=nodes,
        run_dir=str(run_dir),
        plan="\n".join(plan),
        job_name="yatt",
        sbatch_options="\n".join(options),
        workdir=str(workdir),
        head=shlex.join(head),
    ).replace("\n\n#SBATCH --chdir", "\n#SBATCH --chdir")  # no blank line where no options were given


def submit(script: Path) -> str:
    """``sbatch`` the script; the job id."""
    if shutil.which("sbatch") is None:
        raise SlurmError(
            "sbatch not found: this machine has no SLURM client. Submit from a login node of the "
            "cluster, or write the script with --print; on one machine use `python -m launch run`"
        )
    done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SlurmError(
            f"sbatch refused {script}: {done.stderr.strip() or done.stdout.strip()} (compare --nodes, "
            "--gpus-per-node and --partition with what `sinfo -o '%P %D %c %G'` lists)"
        )
    return done.stdout.strip().split(";")[0]


# ---------------------------------------------------------------------------- the allocation


def _scontrol(*args: str) -> str:
    if shutil.which("scontrol") is None:
        raise SlurmError("scontrol not found: the head runs inside a SLURM job, on a node with the SLURM client")
    done = subprocess.run(["scontrol", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SlurmError(f"scontrol {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def allocation_nodes(nodelist: str) -> list[str]:
    """The node names of ``SLURM_JOB_NODELIST`` in SLURM's order (the first runs the head)."""
    return _scontrol("show", "hostnames", nodelist).split()


def node_address(name: str) -> str:
    """The IP address SLURM reaches ``name`` at (its NodeAddr, resolved)."""
    match = re.search(r"\bNodeAddr=(\S+)", _scontrol("show", "node", "-o", name))
    addr = match.group(1) if match else name
    try:
        return socket.gethostbyname(addr)
    except OSError as e:
        raise SlurmError(f"node {name}: its address {addr!r} does not resolve ({e}); check /etc/hosts or DNS") from e


def cpus_per_node(spec: str, nodes: int) -> list[int]:
    """``SLURM_JOB_CPUS_PER_NODE`` (e.g. ``"36,24(x2)"``) as one count per node."""
    out: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise SlurmError(f"SLURM_JOB_CPUS_PER_NODE={spec!r} is not of the form 36,24(x2)")
        out += [int(match.group(1))] * int(match.group(2) or 1)
    if len(out) != nodes:
        raise SlurmError(f"SLURM_JOB_CPUS_PER_NODE={spec!r} describes {len(out)} nodes, the job has {nodes}")
    return out


def check_head_ports(node: str, host: str, first: int) -> None:
    """Fail early, with the fix, when one of the head's fixed ports is taken on its node."""
    for port in range(first, first + 3):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
            try:
                s.bind((host, port))
            except OSError as e:
                raise ConfigError(
                    f"port {port} on {node} ({host}) is in use ({e.strerror}): the head needs ports "
                    f"{first}..{first + 2} (slurm.head_port={first}); set slurm.head_port to another "
                    "free range, or to 0 for any free ports"
                ) from None


# ---------------------------------------------------------------------------- the head


class SlurmLauncher(LocalLauncher):
    """``LocalLauncher`` whose processes are ``srun`` steps on the nodes of ``placement``."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        *,
        placement: Placement,
        nodes: list[str],
        addresses: list[str],
        cpus: list[int],
        job_id: str,
        resume: Path | None = None,
    ) -> None:
        super().__init__(cfg, run_dir, resume=resume, show_progress=False)
        self.fork_server = None  # each role is an srun step on its node
        self.placement = placement
        self.nodes = nodes
        self.addresses = addresses
        self.cpus = cpus
        self.job_id = job_id
        self.host = addresses[0]
        self.mem_mb = slurm_mem_mb()

    def registry_endpoints(self) -> tuple[str, str]:
        port = self.cfg.slurm.head_port
        if not port:
            return super().registry_endpoints()
        return f"tcp://{self.host}:{port}", f"tcp://{self.host}:{port + 1}"

    def rendezvous_port(self) -> int:
        """Host the store here, on the first node, so the ranks meet wherever rank 0 runs."""
        port = self.cfg.slurm.head_port + 2 if self.cfg.slurm.head_port else 0
        try:
            port = self.host_store(port)
        except (OSError, RuntimeError) as e:
            raise ConfigError(
                f"cannot host the torch.distributed store on {self.nodes[0]} ({self.host}:{port}): {e}. "
                "If the port is in use, set slurm.head_port to a free one, or 0 for any free ports"
            ) from e
        self._record(port)
        return port

    def _record(self, store_port: int) -> None:
        """Write the job and its addresses into the run dir (one line per attempt)."""
        line = {
            "job_id": self.job_id,
            "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
            "time": time.time(),
            "nodes": dict(zip(self.nodes, self.addresses, strict=True)),
            "registry": self.registry_endpoint,
            "rendezvous": f"{self.host}:{store_port}",
            "placement": self.placement.describe(),
            "resume": str(self.resume) if self.resume else None,
        }
        with (self.run_dir / "slurm.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")

    def make_plan(self) -> Plan:
        """The node placement as the run's plan (plan.json): which roles take turns, which
        trainer ranks host a generator engine, the threads of each."""
        return placement_plan(self.placement, self.cpus)

    def make_adapter(self, ready_s: float) -> None:
        """No re-planning on SLURM yet: its plan places roles by node, and moving one means a
        new job step on another node (the run keeps the plan it started with)."""
        return None

    def role_command(self, role: str, index: int) -> list[str]:
        node = self.placement.node_of(role, index)
        step = ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={self.nodes[node]}", f"--job-name={role}-{index}"]
        if self.placement.exclusive(role):
            share = max(1, self.cpus[node] // self.placement.heavy_on(node))
            step += ["--exact", f"--cpus-per-task={share}"]
            if self.placement.gpus_per_node:
                step.append("--gres=gpu:1")
            if self.mem_mb:  # memory is scheduled: a step would otherwise claim all of it
                step.append(f"--mem={self.mem_mb // (self.placement.heavy_on(node) + 1)}M")
        else:
            cpus = self.cpus[node] if role in HEAVY else 1  # partial: a generator overlaps its node's ranks
            step += ["--overlap", f"--cpus-per-task={cpus}"]
            if self.placement.gpus_per_node:
                step.append("--gres=none")
        cmd = super().role_command(role, index) + ["--host", self.addresses[node]]
        if role == "generator" and self.placement.gpus_per_node:
            cmd += ["--device", "cuda"]
        return step + cmd

    def ask_to_stop(self, procs: list[Proc]) -> None:
        """SIGTERM to every process of each one's step (``scancel --signal``), as ``launch run``
        signals a process group. Not to srun itself: srun answers SIGTERM with SIGKILL."""
        listed = subprocess.run(
            ["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"], capture_output=True, text=True
        ).stdout
        steps: dict[str, str] = {}  # step name (role-index) -> job.step
        for line in listed.splitlines():
            step_id, _, name = line.partition(" ")
            steps[name] = step_id
        ids = [steps[p.name] for p in procs if p.name in steps]
        if ids:
            subprocess.run(["scancel", "--signal=TERM", *ids], capture_output=True)
        super().ask_to_stop([p for p in procs if p.name not in steps])  # steps not started yet

    def role_env(self, role: str, index: int) -> dict[str, str]:
        env = super().role_env(role, index)
        env.pop("YATT_LAUNCHER_PID", None)  # a step's parent is slurmstepd: the steps end with the job
        if role == "trainer":
            # Every rank is its own step and sees only its own GPU, as cuda:0.
            env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        return env


def set_aside_attempt(run_dir: Path, attempt: str) -> None:
    """Move a previous attempt's ledger and metrics away before starting over."""
    stale = [run_dir / name for name in ATTEMPT_FILES if (run_dir / name).exists()]
    if not stale:
        return
    dest = run_dir / "previous" / attempt
    dest.mkdir(parents=True, exist_ok=True)
    for path in stale:
        path.rename(dest / path.name)
    print(f"yatt: no complete checkpoint yet; starting over, the previous attempt's files are in {dest}", flush=True)


def head_main(args: argparse.Namespace) -> int:
    """``python -m launch slurm-head``: the run inside the allocation (the batch script execs it)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not job_id or not nodelist:
        raise SlurmError(
            "slurm-head runs inside a SLURM job (the script of `python -m launch slurm --submit` starts it); "
            "on one machine use `python -m launch run`"
        )
    run_dir: Path = args.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path, overrides = split_items(args.items)
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    resume = latest_checkpoint(run_dir)
    if resume is not None:
        config_path, overrides = str(run_dir / names.CONFIG), []
        print(f"yatt: job {job_id} (restart {restarts}) resumes from {resume} with {config_path}", flush=True)
    else:
        set_aside_attempt(run_dir, f"job{job_id}-{int(time.time())}")
    cfg = load_run_config(config_path, overrides)
    nodes = allocation_nodes(nodelist)
    cpus = cpus_per_node(os.environ.get("SLURM_JOB_CPUS_PER_NODE", f"1(x{len(nodes)})"), len(nodes))
    layout = resolve_layout(cfg, len(nodes), cpus, args.gpus_per_node)
    placement = plan_layout(role_counts(cfg), len(nodes), args.gpus_per_node, layout)
    addresses = [node_address(n) for n in nodes]
    if cfg.slurm.head_port:
        check_head_ports(nodes[0], addresses[0], cfg.slurm.head_port)
    print(f"yatt: job {job_id}; run dir {run_dir}; placement.layout={cfg.placement.layout} -> {layout}", flush=True)
    for n, line in enumerate(placement.describe()):
        print(f"yatt:   {line}   [{nodes[n]} {addresses[n]}, {cpus[n]} CPUs]", flush=True)
    launcher = SlurmLauncher(
        cfg, run_dir, placement=placement, nodes=nodes, addresses=addresses, cpus=cpus, job_id=job_id, resume=resume
    )
    try:
        return asyncio.run(launcher.run())
    except TransportError as e:
        raise SlurmError(
            f"{e}. The registry binds on {nodes[0]}: if slurm.head_port={cfg.slurm.head_port} is in use "
            "there, set another one, or slurm.head_port=0 for free ports"
        ) from e


def submit_main(args: argparse.Namespace) -> int:
    """``python -m launch slurm``: render the script, print it or submit it."""
    config_path, overrides = split_items(args.items)
    cfg = load_run_config(config_path, overrides)
    if cfg.trainer.world_size == 0:
        raise ConfigError("trainer.world_size: 0 (the plan picks the ranks) is for runs on one machine; "
                          "under SLURM give the rank count (srun starts one task per rank)")
    run_dir: Path = args.run_dir or Path(cfg.slurm.run_root) / time.strftime("%Y%m%d-%H%M%S")
    run_dir = run_dir.resolve()
    script = render_script(
        cfg,
        config_path=config_path,
        overrides=overrides,
        nodes=args.nodes,
        run_dir=run_dir,
        gpus_per_node=args.gpus_per_node,
        partition=args.partition,
        time_limit=args.time,
    )
    if not args.submit:
        sys.stdout.write(script)
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)  # sbatch opens the output file there
    path = run_dir / "job.sbatch"
    path.write_text(script)
    job_id = submit(path)
    print(job_id, flush=True)
    print(
        f"yatt: submitted job {job_id}; run dir {run_dir}\n"
        f"yatt:   follow: tail -f {run_dir}/slurm-{job_id}.out    stop: scancel {job_id}",
        file=sys.stderr,
    )
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``slurm`` and ``slurm-head`` subcommands of ``python -m launch``."""
    slurm = sub.add_parser("slurm", help="render the sbatch script of a run; print it or submit it")
    slurm.add_argument("items", nargs="*", metavar="CONFIG.yaml | dotted.key=value")
    slurm.add_argument("--nodes", type=int, required=True, help="nodes of the allocation")
    slurm.add_argument("--partition", default=None, help="the SLURM partition (default: the cluster's)")
    slurm.add_argument("--gpus-per-node", type=int, default=0, help="GPUs of each node (0: CPU nodes)")
    slurm.add_argument("--time", default=None, help="time limit, e.g. 04:00:00 (default: the partition's)")
    slurm.add_argument("--run-dir", type=Path, default=None, help="where the run writes (default slurm.run_root/<time>)")
    mode = slurm.add_mutually_exclusive_group()
    mode.add_argument("--submit", action="store_true", help="submit it with sbatch and print the job id")
    mode.add_argument("--print", action="store_true", help="print the script (the default)")
    slurm.set_defaults(main=submit_main)
    head = sub.add_parser("slurm-head", help="(inside the allocation; the sbatch script runs it)")
    head.add_argument("items", nargs="*", metavar="CONFIG.yaml | dotted.key=value")
    head.add_argument("--run-dir", type=Path, required=True)
    head.add_argument("--gpus-per-node", type=int, default=0)
    head.set_defaults(main=head_main)
