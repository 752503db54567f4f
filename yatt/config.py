"""The typed configs of every component, nested into one run config.

Each component receives only its own config (and the model's). Every class is a frozen,
keyword-only dataclass; every field says in one line what it is. ``configtools.build``
loads YAML data into them and rejects unknown keys and bad values by dotted name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from yatt.configtools import require
from yatt.tasks import TASKS


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which policy model to train and serve."""

    path: str = ""
    """A local Hugging Face directory, or builtin:smollm2; empty: the tiny default model, built in the run dir."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype of trainer and engines (master weights stay float32): auto is bfloat16 on
    GPU and on CPUs with native bf16 (AMX or AVX512-BF16), else float32."""


@dataclass(frozen=True, kw_only=True)
class GeneratorConfig:
    """One generator worker (an inference engine serving GenerateRequests)."""

    backend: Literal["transformers", "vllm"] = "transformers"
    """transformers: batched HF generate, runs anywhere; vllm: the vLLM engine."""
    max_batch_prompts: int = 64
    """Most prompts (groups) batched into one engine call."""
    batch_wait_ms: float = 5.0
    """How long to wait for more concurrent requests before an engine call (at least)."""
    batch_wait_share: float = 0.05
    """...or this share of the last engine call, if longer: a request that just misses a
    call waits for the whole next one, so on slow engines company is worth a longer wait."""
    vllm_kv_cache_gib: float = 1.0
    """vLLM on CPU: KV cache size (VLLM_CPU_KVCACHE_SPACE)."""
    vllm_gpu_memory_utilization: float = 0.5
    """vLLM on GPU: share of device memory the engine may take."""
    vllm_max_model_len: int = 1024
    """vLLM: longest prompt + completion."""
    vllm_enforce_eager: bool = False
    """vLLM: skip torch.compile and CUDA graphs (starts 40 s faster on CPU, decodes slower)."""
    seed: int = 0
    """Base sampling seed when a request carries none."""
    threads: int = 0
    """CPU threads of the engine (OMP_NUM_THREADS); 0: from the placement plan (the cores of its slots)."""
    tensor_parallel: int = 1
    """GPUs one vLLM generator spans (tensor parallelism), for a model too large for one."""

    def __post_init__(self) -> None:
        require(self.threads >= 0, "threads", f"must be >= 0, 0 for the cores / generators (got {self.threads})")
        require(self.tensor_parallel >= 1, "tensor_parallel", f"must be >= 1 (got {self.tensor_parallel})")
        require(self.max_batch_prompts >= 1, "max_batch_prompts", f"must be >= 1 (got {self.max_batch_prompts})")
        require(self.batch_wait_ms >= 0, "batch_wait_ms", f"must be >= 0 (got {self.batch_wait_ms})")
        require(0 <= self.batch_wait_share <= 1, "batch_wait_share", f"must be in [0, 1] (got {self.batch_wait_share})")
        require(
            self.vllm_kv_cache_gib >= 1 and float(self.vllm_kv_cache_gib).is_integer(),
            "vllm_kv_cache_gib",
            f"must be a whole number of GiB >= 1, as vLLM's CPU KV cache takes (got {self.vllm_kv_cache_gib})",
        )
        require(
            0 < self.vllm_gpu_memory_utilization <= 1,
            "vllm_gpu_memory_utilization",
            f"must be in (0, 1] (got {self.vllm_gpu_memory_utilization})",
        )
        require(
            self.vllm_max_model_len >= 2,
            "vllm_max_model_len",
            f"must be >= 2 (got {self.vllm_max_model_len})",
        )


@dataclass(frozen=True, kw_only=True)
class ScorerConfig:
    """One scorer of the reward mix."""

    kind: Literal[
        "math_verify", "exact_match", "format_regex", "reasoning_gym", "reward_model", "judge", "custom"
    ]
    """Which scorer."""
    name: str = ""
    """Name in metrics; default: the kind."""
    weight: float = 1.0
    """Weight in the reward mix."""
    pattern: str = ""
    """format_regex: the regex a completion must match (re.search, DOTALL)."""
    answer_key: str = "answer"
    """Which metadata field of the prompt holds the reference answer."""
    function: str = ""
    """custom: dotted path 'package.module:function' or 'package.module.function'."""
    model_path: str = ""
    """reward_model / judge: a local Hugging Face directory."""
    judge_template: str = ""
    """judge: prompt template with {prompt}, {completion} and {answer}."""
    judge_samples: int = 1
    """judge: verdicts sampled and averaged per completion."""
    judge_max_new_tokens: int = 16
    """judge: tokens the judge may write for its verdict."""
    batch_size: int = 16
    """reward_model: completions per forward pass."""

    def __post_init__(self) -> None:
        require(self.kind != "format_regex" or bool(self.pattern), "pattern", "is required for kind format_regex")
        require(self.kind != "custom" or bool(self.function), "function", "is required for kind custom")
        require(
            self.kind not in ("reward_model", "judge") or bool(self.model_path),
            "model_path",
            f"is required for kind {self.kind}",
        )
        require(self.judge_samples >= 1, "judge_samples", f"must be >= 1 (got {self.judge_samples})")
        require(self.batch_size >= 1, "batch_size", f"must be >= 1 (got {self.batch_size})")


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """One reward worker: a weighted mix of scorers."""

    scorers: list[ScorerConfig] = field(default_factory=lambda: [ScorerConfig(kind="exact_match")])
    """The scorers; the reward is their weighted sum."""
    timeout_s: float = 10.0
    """Per-sample time limit of a scorer; past it the sample scores as failed (0)."""
    max_batch: int = 256
    """Most samples scored in one batch."""
    processes: int = 2
    """Worker processes that run the rule and custom scorers."""

    def __post_init__(self) -> None:
        require(len(self.scorers) >= 1, "scorers", "must name at least one scorer")
        require(self.timeout_s > 0, "timeout_s", f"must be > 0 (got {self.timeout_s})")
        require(self.max_batch >= 1, "max_batch", f"must be >= 1 (got {self.max_batch})")
        require(self.processes >= 1, "processes", f"must be >= 1 (got {self.processes})")


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """The RL math: advantages, policy loss, KL and aggregation."""

    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"] = "grpo"
    """Advantage estimator."""
    policy_loss: Literal["ppo", "gspo"] = "ppo"
    """ppo: token-level clipped ratio; gspo: sequence-level ratio."""
    clip_low: float = 0.2
    """Lower clip range: ratio >= 1 - clip_low."""
    clip_high: float = 0.2
    """Upper clip range: ratio <= 1 + clip_high (DAPO clip-higher: 0.28)."""
    dual_clip: float | None = None
    """Dual clip constant c > 1 for negative advantages; null: off."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"] = "token_mean"
    """How per-token losses make the step loss."""
    kl_coef: float = 0.0
    """KL penalty coefficient against the reference model; 0: no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    kl_in_reward: bool = False
    """Fold the KL into the reward instead of adding it to the loss."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    importance_sampling: Literal["none", "tis", "mis"] = "none"
    """Correct for train/rollout mismatch: truncated (tis) or masked (mis) importance sampling."""
    importance_cap: float = 2.0
    """TIS cap / MIS threshold on the train-vs-rollout ratio."""
    value_clip: float = 0.2
    """PPO critic: value clipping range."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 1.0
    """GAE lambda."""
    overlong_buffer: int = 0
    """DAPO overlong penalty: length of the soft-penalty zone before max_new_tokens; 0: off."""
    overlong_penalty: float = 1.0
    """DAPO overlong penalty at the limit."""

    def __post_init__(self) -> None:
        require(0 <= self.clip_low < 1, "clip_low", f"must be in [0, 1) (got {self.clip_low})")
        require(self.clip_high >= 0, "clip_high", f"must be >= 0 (got {self.clip_high})")
        require(self.dual_clip is None or self.dual_clip > 1, "dual_clip", f"must be > 1 or null (got {self.dual_clip})")
        require(self.kl_coef >= 0, "kl_coef", f"must be >= 0 (got {self.kl_coef})")
        require(self.importance_cap > 0, "importance_cap", f"must be > 0 (got {self.importance_cap})")
        require(self.overlong_buffer >= 0, "overlong_buffer", f"must be >= 0 (got {self.overlong_buffer})")


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The FSDP2 trainer ranks."""

    world_size: int = 2
    """Number of trainer ranks (processes)."""
    lr: float = 1e-5
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    warmup_steps: int = 0
    """Linear warmup steps."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warmup."""
    total_steps: int = 0
    """Steps the schedule decays over; 0: the run's number of steps."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0: no clipping."""
    activation_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps; 0: only at the end."""
    weight_bucket_mb: float = 64.0
    """Size of one weight-update bucket sent to the generators."""
    weight_sync_every: int = 1
    """Publish weights to the generators every N steps (N > 1 needs buffer.max_staleness >= N - 1)."""
    critic_lr: float = 1e-5
    """PPO critic learning rate (advantage gae)."""
    seed: int = 0
    """Seed of parameter init (tiny models) and dropout."""
    threads: int = 0
    """CPU threads of each rank (OMP_NUM_THREADS); 0: this machine's cores / world_size."""

    def __post_init__(self) -> None:
        require(self.threads >= 0, "threads", f"must be >= 0, 0 for the cores / world size (got {self.threads})")
        require(self.world_size >= 1, "world_size", f"must be >= 1 (got {self.world_size})")
        require(self.lr > 0, "lr", f"must be > 0 (got {self.lr})")
        require(len(self.betas) == 2, "betas", f"must be two numbers (got {self.betas})")
        require(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0 (got {self.warmup_steps})")
        require(self.total_steps >= 0, "total_steps", f"must be >= 0 (got {self.total_steps})")
        require(self.grad_clip >= 0, "grad_clip", f"must be >= 0, 0 for no clipping (got {self.grad_clip})")
        require(self.critic_lr > 0, "critic_lr", f"must be > 0 (got {self.critic_lr})")
        require(self.weight_bucket_mb > 0, "weight_bucket_mb", f"must be > 0 (got {self.weight_bucket_mb})")
        require(self.weight_sync_every >= 1, "weight_sync_every", f"must be >= 1 (got {self.weight_sync_every})")


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """The per-shard controllers that drive prompts through generation and reward."""

    num_controllers: int = 2
    """Number of controller processes; prompt i belongs to shard i mod num_controllers."""
    temperature: float = 1.0
    """Sampling temperature of rollouts."""
    top_p: float = 1.0
    """Nucleus sampling of rollouts."""
    top_k: int = -1
    """Top-k sampling of rollouts; -1: off."""
    max_new_tokens: int = 32
    """Longest completion."""
    request_timeout_s: float = 300.0
    """Deadline of one generate or score request before it is re-issued elsewhere."""
    max_attempts: int = 5
    """Tries of one request (across workers) before the controller gives up and fails."""
    plan_wait_s: float = 2.0
    """Long-poll time of a plan request to the buffer."""

    def __post_init__(self) -> None:
        require(self.num_controllers >= 1, "num_controllers", f"must be >= 1 (got {self.num_controllers})")
        require(self.temperature >= 0, "temperature", f"must be >= 0 (got {self.temperature})")
        require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1] (got {self.top_p})")
        require(self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1 (got {self.max_new_tokens})")
        require(self.max_attempts >= 1, "max_attempts", f"must be >= 1 (got {self.max_attempts})")


@dataclass(frozen=True, kw_only=True)
class BufferConfig:
    """The dynamic sampling buffer between the controllers and the trainer ranks."""

    groups_per_step: int = 8
    """Accepted groups (prompts) in one training step."""
    group_size: int = 4
    """Samples per group (n); every ScoredGroup must carry this many."""
    micro_batches_per_step: int = 1
    """Micro-batches each trainer rank gets per step (gradient accumulation)."""
    max_staleness: int = 0
    """A group of policy version v trains step k only if k - v <= max_staleness; 0: on-policy."""
    filter: Literal["none", "all_equal"] = "all_equal"
    """Dynamic sampling: drop groups whose rewards are all equal (no learning signal)."""
    max_completion_tokens: int = 0
    """Drop groups with a completion longer than this; 0: no length filter."""
    custom_filter: str = ""
    """Dotted path 'module:function(group: ScoredGroup) -> str' returning '' to keep or the drop reason."""
    max_oversample: float = 4.0
    """Cap on the over-sampling factor 1 / acceptance rate."""
    acceptance_ema: float = 0.9
    """Smoothing of the measured acceptance rate (EMA weight of the past)."""
    pad_token_id: int = 0
    """Token id used to right-pad micro-batches (masked out everywhere)."""

    def __post_init__(self) -> None:
        require(self.groups_per_step >= 1, "groups_per_step", f"must be >= 1 (got {self.groups_per_step})")
        require(self.group_size >= 1, "group_size", f"must be >= 1 (got {self.group_size})")
        require(self.max_staleness >= 0, "max_staleness", f"must be >= 0 (got {self.max_staleness})")
        require(
            self.micro_batches_per_step >= 1 and self.groups_per_step % self.micro_batches_per_step == 0,
            "micro_batches_per_step",
            f"must be >= 1 and divide groups_per_step={self.groups_per_step} (got {self.micro_batches_per_step})",
        )
        require(self.max_oversample >= 1, "max_oversample", f"must be >= 1 (got {self.max_oversample})")
        require(0 <= self.acceptance_ema < 1, "acceptance_ema", f"must be in [0, 1) (got {self.acceptance_ema})")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the prompts come from and how they become token ids (yatt/data.py)."""

    source: Literal["synthetic", "jsonl", "parquet", "reasoning_gym"] = "synthetic"
    """synthetic: a built-in task (yatt/tasks.py); jsonl/parquet: local files; reasoning_gym: generated."""
    path: str = ""
    """jsonl/parquet: a file, or a directory whose .jsonl/.json (.parquet) files are read in name order."""
    prompt_field: str = "prompt"
    """jsonl/parquet: the column holding the prompt, a string or a list of {role, content} messages."""
    answer_field: str = "answer"
    """jsonl/parquet: the column copied into metadata['answer']; empty: the data has no answers."""
    task: str = "digits"
    """synthetic: the built-in task name; reasoning_gym: the dataset name (e.g. basic_arithmetic)."""
    task_args: dict[str, bool | int | float | str | list[str]] = field(default_factory=dict)
    """reasoning_gym: options of the dataset's config, e.g. {max_terms: 2, max_digits: 2}."""
    num_prompts: int = 0
    """synthetic/reasoning_gym: how many to generate (0: 1000); jsonl/parquet: the first n rows (0: all)."""
    seed: int = 0
    """Seed of the generated prompts (synthetic, reasoning_gym)."""
    system_prompt: str = ""
    """A system message put before every prompt that has none of its own; empty: none."""
    instruction: str = "\n\nGive only the final answer, inside <answer></answer> tags."
    """reasoning_gym: appended to every question (its scorer reads the answer from these tags)."""
    max_prompt_tokens: int = 0
    """Longest prompt allowed, in tokens (template included); a longer one is an error. 0: no limit."""
    apply_chat_template: bool = True
    """Wrap each prompt in the tokenizer's chat template (when it has one); false: plain text."""

    def __post_init__(self) -> None:
        require(
            self.source not in ("jsonl", "parquet") or bool(self.path),
            "path",
            f"is required for source {self.source}: a file or a directory of them",
        )
        require(
            self.source != "synthetic" or self.task in TASKS,
            "task",
            f"must be a built-in task: one of {', '.join(sorted(TASKS))} (got {self.task!r})",
        )
        require(
            self.source != "reasoning_gym" or bool(self.task),
            "task",
            "is required for source reasoning_gym: a reasoning-gym dataset name, e.g. basic_arithmetic",
        )
        require(bool(self.prompt_field), "prompt_field", "must name the prompt column")
        require(self.num_prompts >= 0, "num_prompts", f"must be >= 0 (got {self.num_prompts})")
        require(self.max_prompt_tokens >= 0, "max_prompt_tokens", f"must be >= 0 (got {self.max_prompt_tokens})")


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """Where the roles run on the machine's device slots (yatt/placement)."""

    layout: Literal["auto", "colocated", "partial", "disaggregated"] = "auto"
    """colocated: each trainer rank also hosts a generator engine (they take turns on its slot);
    partial: training on every slot, generators on a subset, asleep while training runs;
    disaggregated: disjoint slots, asynchronous within buffer.max_staleness;
    auto: the planner picks the layout with the lowest predicted step time."""
