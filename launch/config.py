"""The run config: every component's config nested into one, loaded from one YAML file.

``load_run_config(path, overrides)`` reads YAML (or nothing: the built-in default),
applies ``dotted.key=value`` overrides and validates everything before any process
starts; the launcher writes the resolved config into the run dir, and every role process
reads that file back, taking only its own section.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from yatt.errors import ConfigError
from yatt.rl.config import (
    VLLM_MAX_LORA_RANK,
    AlgorithmConfig,
    BufferConfig,
    ControllerConfig,
    DataConfig,
    EnvConfig,
    EvalConfig,
    GeneratorConfig,
    ModelConfig,
    PlacementConfig,
    RewardConfig,
    TrainerConfig,
)
from yatt.runtime.configtools import apply_overrides, build, require, to_dict
from yatt.runtime.transport import TransportConfig

DEFAULT_CONFIG = Path(__file__).with_name("default.yaml")
"""The built-in default job: a tiny model on a synthetic task, on CPU."""


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """The run as a whole: its length, its processes and where it writes."""

    steps: int = 30
    """Optimizer steps of the run."""
    seed: int = 0
    """Seed of the prompt order, of sampling and of the trainer."""
    num_generators: int = 1
    """Generator processes."""
    num_rewards: int = 1
    """Reward worker processes."""
    host: str = "127.0.0.1"
    """Address every role binds on (one machine)."""
    ready_timeout_s: float = 600.0
    """How long the launcher waits for every role to report READY."""
    restart_limit: int = 5
    """Restarts of one role process (of the trainer group as a whole) before the run fails."""
    fork_roles: bool = True
    """Fork the role processes that run on CPUs from one process that has imported torch and
    transformers once (launch/forkserver.py): a restarted role or trainer group skips those
    seconds. Off: every role starts from its command line, as roles on GPUs and SLURM steps
    always do."""
    authenticate: bool = True
    """Authenticate and encrypt every socket of the run with CURVE keys the launcher makes in
    <run_dir>/keys (readable by this user only), loopback included: a process without them
    reaches no handler. Off: any local process can talk to the run (see benchmarks/README.md
    for what CURVE costs). An explicit transport.curve with its own keys is kept."""
    stall_timeout_s: float = 1800.0
    """No new step for this long after READY stops the run, with every role's state and log
    tail (a hang is never silent); 0: wait for good."""
    rollouts_per_step: int = 2
    """Groups of each step (all their completions) written as text to <run_dir>/rollouts.jsonl
    and TensorBoard's text tab, with rewards per scorer, advantages and failures; 0: none."""
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Where metrics and rollouts go besides metrics.jsonl and rollouts.jsonl: tensorboard
    (<run_dir>/tensorboard), wandb (the wandb extra; project run.wandb_project; WANDB_MODE=offline
    writes <run_dir>/wandb without a network)."""
    wandb_project: str = "yatt"
    """The wandb project of run.report_to: [wandb]."""
    eval_every: int = 0
    """Evaluate on the held-out prompts (data.eval_path or data.eval_split; see the eval
    section) before the first step, every this many steps and after the last; 0: never."""
    trace: bool = False
    """Write every role's spans to <run_dir>/trace/<role>-<index>.jsonl (yatt.runtime.trace; for timelines)."""

    def __post_init__(self) -> None:
        require(self.steps >= 1, "steps", f"must be >= 1 (got {self.steps})")
        require(self.num_generators >= 1, "num_generators", f"must be >= 1 (got {self.num_generators})")
        require(self.num_rewards >= 1, "num_rewards", f"must be >= 1 (got {self.num_rewards})")
        require(self.restart_limit >= 0, "restart_limit", f"must be >= 0, 0 for no restarts (got {self.restart_limit})")
        require(self.ready_timeout_s > 0, "ready_timeout_s", f"must be > 0 seconds (got {self.ready_timeout_s})")
        unknown = sorted(set(self.report_to) - {"tensorboard", "wandb"})
        require(not unknown, "report_to", f"knows tensorboard and wandb, not {unknown}")
        require(
            "wandb" not in self.report_to or importlib.util.find_spec("wandb") is not None,
            "report_to",
            "includes wandb, which is not installed: pip install -e '.[wandb]' (WANDB_MODE=offline runs without a network)",
        )
        require(self.rollouts_per_step >= 0, "rollouts_per_step", f"must be >= 0, 0 for none (got {self.rollouts_per_step})")
        require(self.eval_every >= 0, "eval_every", f"must be >= 0, 0 for no evaluation (got {self.eval_every})")
        require(self.stall_timeout_s >= 0, "stall_timeout_s", f"must be >= 0, 0 to wait for good (got {self.stall_timeout_s})")
        require(
            self.host in ("127.0.0.1", "localhost", "::1") or self.host.startswith("127."),
            "host",
            f"must be a loopback address for a run on one machine (got {self.host!r}): every role, the "
            "registry and the torch.distributed store bind on it, and nothing off this machine may reach them",
        )

@dataclass(frozen=True, kw_only=True)
class SlurmSettings:
    """A run on SLURM (``python -m launch slurm``): where it writes, which ports its head binds."""

    run_root: str = "runs"
    """Folder of the run dirs (``<run_root>/<time>``); on a cluster, shared storage every node mounts."""
    head_port: int = 0
    """First of 3 consecutive ports on the first node (registry, membership feed, torch.distributed store); 0: free ones."""

    def __post_init__(self) -> None:
        require(bool(self.run_root), "run_root", "must name a folder (got an empty string)")
        require(
            self.head_port == 0 or 1024 <= self.head_port <= 65533,
            "head_port",
            f"must be 0 (free ports) or in 1024..65533 (got {self.head_port})",
        )


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one run needs; each process takes only its own section."""

    run: RunSettings = field(default_factory=RunSettings)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    slurm: SlurmSettings = field(default_factory=SlurmSettings)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self) -> None:
        every, staleness = self.trainer.weight_sync_every, self.buffer.max_staleness
        require(
            staleness >= every - 1,
            "trainer.weight_sync_every",
            f"= {every} lets generators lag {every - 1} versions, more than buffer.max_staleness = {staleness}; "
            f"raise buffer.max_staleness to {every - 1} or sync every step",
        )
        require(
            not self.run.eval_every or self.data.has_eval,
            "run.eval_every",
            f"= {self.run.eval_every}, but there is nothing to evaluate on: set data.eval_split (a share or "
            "count of the prompts held out) or data.eval_path (a file of held-out prompts)",
        )
        require(
            self.run.eval_every % every == 0,
            "run.eval_every",
            f"= {self.run.eval_every} evaluates weights the generators never get (trainer.weight_sync_every = "
            f"{every}); make it a multiple of {every}",
        )
        require(
            self.model.lora.rank <= VLLM_MAX_LORA_RANK or self.generator.backend != "vllm",
            "model.lora.rank",
            f"= {self.model.lora.rank}: vLLM serves adapters up to rank {VLLM_MAX_LORA_RANK}; lower it or use "
            "generator.backend=transformers",
        )
        mbs, runs = self.buffer.micro_batches_per_step, self.trainer.mini_batches
        require(
            mbs % runs == 0,
            "trainer.mini_batches",
            f"must divide buffer.micro_batches_per_step={mbs} (got {runs})",
        )


def split_items(items: list[str]) -> tuple[str | None, list[str]]:
    """The optional config path (the first item without '=') and the overrides of a command line."""
    config = None
    overrides = []
    for item in items:
        if "=" in item:
            overrides.append(item)
        elif config is None:
            config = item
        else:
            raise ConfigError(f"two config files given ({config}, {item}); overrides look like dotted.key=value")
    return config, overrides


def load_run_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """The validated run config from YAML ``path`` (None: the built-in default) and overrides."""
    p = DEFAULT_CONFIG if path is None else Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist")
    try:
        loaded = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {p} must hold a mapping of sections (got {type(loaded).__name__})")
    data: dict[str, Any] = loaded or {}
    apply_overrides(data, overrides or [])
    return build(RunConfig, data)


def dump_run_config(config: RunConfig, path: Path) -> None:
    """Write the resolved config (every default filled in) as YAML."""
    path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
