"""The typed configs of every component, nested into one run config.

Each component receives only its own config (and the model's). Every class is a frozen,
keyword-only dataclass; every field says in one line what it is. ``configtools.build``
loads YAML data into them and rejects unknown keys and bad values by dotted name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from yatt.errors import ConfigError
from yatt.rl.tasks import TASKS
from yatt.runtime.configtools import require

VLLM_MAX_LORA_RANK = 512
"""The largest LoRA rank vLLM serves (its ``max_lora_rank`` choices end there)."""


@dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Low-rank adapters (peft's LoRA) instead of full fine-tuning: the trainer trains only
    the adapters, generators receive only them, exports hold them and the merged model."""

    rank: int = 0
    """Rank r of each adapter; 0: full fine-tuning."""
    alpha: int = 16
    """Scale numerator: the update is (alpha / rank) * B @ A, as peft's lora_alpha."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Names of the linear layers that get adapters (peft's target_modules)."""

    def __post_init__(self) -> None:
        require(self.rank >= 0, "rank", f"must be >= 0, 0 for full fine-tuning (got {self.rank})")
        require(self.alpha > 0, "alpha", f"must be > 0 (got {self.alpha})")
        require(not self.rank or bool(self.target_modules), "target_modules", "must name at least one layer")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which policy model to train and serve."""

    path: str = ""
    """A local Hugging Face directory (a causal LM, or a vision-language model with its processor),
    builtin:smollm2, or builtin:tiny-vlm (a tiny LLaVA built in the run dir); empty: the tiny
    default model, built in the run dir."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype of trainer and engines (master weights stay float32): auto is bfloat16 on
    GPU and on CPUs with native bf16 (AMX or AVX512-BF16), else float32."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters (lora.rank > 0) instead of full fine-tuning."""
    warm_start_steps: int = 0
    """Supervised steps of the built-in tiny model (path empty) on the training prompts'
    reference answers (metadata "answer"), in the launcher before any role starts, so that RL
    begins from a policy that knows the answer format and a little of the task (the default
    job: 150, ~5 s). 0: RL from the random model. A model of your own (model.path) is used
    as it is: the launcher says so and skips this."""
    warm_start_lr: float = 3e-3
    """AdamW learning rate of the warm start (batches of 32 prompts)."""
    train_vision: bool = False
    """A vision-language model: train its vision tower too (false: frozen, as verl's
    freeze_vision_tower and most VLM RL recipes do; the projector into the language model
    and the language model train)."""

    def __post_init__(self) -> None:
        require(self.warm_start_steps >= 0, "warm_start_steps", f"must be >= 0, 0 for none (got {self.warm_start_steps})")
        require(self.warm_start_lr > 0, "warm_start_lr", f"must be > 0 (got {self.warm_start_lr})")


@dataclass(frozen=True, kw_only=True)
class GeneratorConfig:
    """One generator worker (an inference engine serving GenerateRequests)."""

    backend: Literal["auto", "transformers", "vllm"] = "auto"
    """transformers: batched HF generate, runs anywhere; vllm: the vLLM engine; auto: the
    one that generates the run faster, measured on this machine where vLLM could win
    (launch/placement/engines.py), else transformers."""
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
    """reward_model / judge: a local Hugging Face directory (``builtin:tiny``: a tiny untrained
    model built in the run dir, to try a judge's cost and placement on a CPU)."""
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
        require(
            self.judge_max_new_tokens >= 1, "judge_max_new_tokens", f"must be >= 1 (got {self.judge_max_new_tokens})"
        )
        if self.kind == "format_regex":
            try:
                re.compile(self.pattern, re.DOTALL)
            except re.error as e:
                require(False, "pattern", f"= {self.pattern!r} is not a valid regex ({e})")
        if self.kind == "judge" and self.judge_template:
            try:
                self.judge_template.format(prompt="", completion="", answer="")
            except (KeyError, IndexError, ValueError) as e:
                require(
                    False, "judge_template",
                    f"is not a valid template ({type(e).__name__}: {e}); use only {{prompt}}, {{completion}} and "
                    "{answer}, and write other braces doubled: {{ }}",
                )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """One reward worker: a weighted mix of scorers."""

    scorers: list[ScorerConfig] = field(default_factory=lambda: [ScorerConfig(kind="exact_match")])
    """The scorers; the reward is their weighted sum."""
    timeout_s: float = 10.0
    """Per-sample time limit of a scorer; past it the sample scores as failed (0)."""
    max_batch: int = 256
    """Most samples scored in one batch."""
    max_failure_share: float = 0.5
    """Stop the run when one scorer failed (raised, timed out, returned a non-number) on more
    than this share of its last 64 samples (judged from 16 on), with its error and traceback;
    1: never stop. Failed samples score 0 until then, and count in reward/failed_share."""
    processes: int = 2
    """Worker processes that run the rule and custom scorers."""

    def __post_init__(self) -> None:
        require(len(self.scorers) >= 1, "scorers", "must name at least one scorer")
        require(self.timeout_s > 0, "timeout_s", f"must be > 0 (got {self.timeout_s})")
        require(self.max_batch >= 1, "max_batch", f"must be >= 1 (got {self.max_batch})")
        require(0 <= self.max_failure_share <= 1, "max_failure_share", f"must be in [0, 1] (got {self.max_failure_share})")
        require(self.processes >= 1, "processes", f"must be >= 1 (got {self.processes})")
        names = [sc.name or sc.kind for sc in self.scorers]
        for i, name in enumerate(names):
            require(
                name not in names[:i], f"scorers[{i}].name",
                f"{name!r} is already used by reward.scorers[{names.index(name)}]; give each scorer a distinct name",
            )  # fmt: skip


POLICY_LOSSES = ("ppo", "gspo", "cispo", "gmpo", "sapo", "clip_cov", "kl_cov", "gpg", "reinforce")
"""The built-in ``algorithm.policy_loss`` names (``yatt.rl.rl_math.POLICY_LOSSES``)."""
KLEstimator = Literal["k1", "k2", "k3", "abs", "k1+", "k3+"]
AggregationMode = Literal[
    "token_mean", "token_sum", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"
]
ImportanceKind = Literal["none", "tis", "mis"]
ImportanceLevel = Literal["token", "sequence", "geometric"]


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """The RL math: advantages, policy loss, KL and aggregation (formulas: ``yatt.rl.rl_math``).

    Defaults are verl's where both have the knob; where yatt differs, on purpose:
    - ``dual_clip`` 3.0 is verl's ``clip_ratio_c`` (verl always applies it to PPO; null here
      turns it off); GSPO never dual-clips, as in verl.
    - GSPO clamps its log sequence ratio to [-20, 20] before exp; verl clamps it above at 10
      only. Both leave ordinary ratios untouched; yatt's also bounds a collapsing ratio.
    - ``value_clip`` 0.5 is verl's ``cliprange_value`` (yatt used 0.2 before).
    - ``kl_in_reward_estimator`` k1 is verl's ``algorithm.kl_penalty`` ("kl");
      ``kl_estimator`` k3 is verl's ``kl_loss_type`` low_var_kl. k3 is clamped as in verl.
    - ``kl_coef`` 0 (verl: 0.001) since a reference model costs memory and time; one
      coefficient serves the loss or the reward, whichever ``kl_in_reward`` picks.
    - ``importance_*`` follow verl's rollout correction with one switch for truncation
      (tis, verl's rollout_is) and masking (mis, verl's rollout_rs) at one ``level``.
    """

    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"] = "grpo"
    """Advantage estimator; reinforce_pp, reinforce_pp_baseline and gae whiten over the whole batch."""
    policy_loss: str = "ppo"
    """ppo, gspo, cispo, gmpo, sapo, clip_cov, kl_cov, gpg, reinforce, or 'package.module:function'."""
    clip_low: float = 0.2
    """Lower clip range: ratio >= 1 - clip_low (gmpo: log-ratio >= -clip_low)."""
    clip_high: float = 0.2
    """Upper clip range: ratio <= 1 + clip_high (DAPO clip-higher: 0.28; gmpo: log-ratio)."""
    dual_clip: float | None = 3.0
    """PPO dual clip constant c > 1 bounding the loss of negative advantages at -c A; null: off."""
    aggregation: AggregationMode = "token_mean"
    """How per-token losses make the step loss (seq_mean_token_sum_norm: Dr.GRPO's)."""
    aggregation_norm: float = 0.0
    """seq_mean_token_sum_norm's constant divisor (Dr.GRPO: the generation budget, e.g. max_new_tokens)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch; each pass takes trainer.mini_batches optimizer steps."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """PPO's old log-probs: recomputed with the batch's starting weights, or the rollout engine's (verl's bypass)."""
    kl_coef: float = 0.0
    """KL penalty coefficient against the reference model; 0: no reference model."""
    kl_estimator: KLEstimator = "k3"
    """KL estimator of the KL loss term (k3: verl's low_var_kl; k1+/k3+: straight-through k2 gradient)."""
    kl_in_reward: bool = False
    """Fold the KL into the reward instead of adding it to the loss."""
    kl_in_reward_estimator: KLEstimator = "k1"
    """KL estimator when folded into the reward (verl's algorithm.kl_penalty)."""
    kl_controller: Literal["fixed", "adaptive"] = "fixed"
    """fixed: kl_coef throughout; adaptive: steer it towards kl_target (Ziegler et al. 2019)."""
    kl_target: float = 0.1
    """Adaptive KL controller: the target KL per token."""
    kl_horizon: int = 10000
    """Adaptive KL controller: horizon in sequences."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (the loss subtracts entropy_coef * entropy)."""
    importance_sampling: ImportanceKind = "none"
    """Correct for train/rollout mismatch: truncated (tis) or masked (mis) importance weights."""
    importance_level: ImportanceLevel = "token"
    """Weight per token, per sequence (product of ratios), or their geometric mean; mis at sequence levels rejects sequences."""
    importance_cap: float = 2.0
    """TIS cap / MIS upper bound on the train-vs-rollout ratio."""
    importance_floor: float = 0.0
    """MIS lower bound (IcePop: 0.5, cap 5); 0: none."""
    importance_veto: float = 0.0
    """Drop a sequence whose any token ratio falls below this (verl's veto threshold); 0: off."""
    value_clip: float = 0.5
    """PPO critic: value clipping range (verl's cliprange_value)."""
    gamma: float = 1.0
    """Discount of GAE and REINFORCE++ returns."""
    lam: float = 1.0
    """GAE lambda."""
    tau_pos: float = 1.0
    """SAPO gate temperature for positive advantages."""
    tau_neg: float = 1.05
    """SAPO gate temperature for non-positive advantages."""
    cov_ratio: float = 2e-4
    """Clip-Cov / KL-Cov: share of tokens whose gradient is cut / KL-penalised."""
    cov_lb: float = 1.0
    """Clip-Cov: lower bound of the covariance of the tokens that may be cut."""
    cov_ub: float = 5.0
    """Clip-Cov: upper bound of that covariance."""
    kl_cov_coef: float = 1.0
    """KL-Cov: coefficient of |log-ratio| on the penalised tokens."""
    overlong_buffer: int = 0
    """DAPO overlong penalty: length of the soft-penalty zone before max_new_tokens; 0: off."""
    overlong_penalty: float = 1.0
    """DAPO overlong penalty at the limit."""

    def __post_init__(self) -> None:
        require(
            self.policy_loss in POLICY_LOSSES or ":" in self.policy_loss or "." in self.policy_loss,
            "policy_loss",
            f"must be one of {', '.join(POLICY_LOSSES)} or 'package.module:function' (got {self.policy_loss!r})",
        )
        require(0 <= self.clip_low < 1, "clip_low", f"must be in [0, 1) (got {self.clip_low})")
        require(self.clip_high >= 0, "clip_high", f"must be >= 0 (got {self.clip_high})")
        require(self.dual_clip is None or self.dual_clip > 1, "dual_clip", f"must be > 1 or null (got {self.dual_clip})")
        require(
            (self.aggregation == "seq_mean_token_sum_norm") == (self.aggregation_norm > 0),
            "aggregation_norm",
            f"must be > 0 exactly when aggregation is seq_mean_token_sum_norm (got {self.aggregation_norm} "
            f"with {self.aggregation}); Dr.GRPO uses the generation budget, controller.max_new_tokens",
        )
        require(
            self.advantage != "dr_grpo" or self.aggregation == "seq_mean_token_sum_norm",
            "aggregation",
            f"must be seq_mean_token_sum_norm for advantage dr_grpo, Dr.GRPO's constant normaliser "
            f"(got {self.aggregation}); set aggregation_norm too",
        )
        require(
            self.policy_loss != "gmpo" or self.aggregation == "seq_mean_token_mean",
            "aggregation",
            f"must be seq_mean_token_mean for policy_loss gmpo, a loss per sequence (got {self.aggregation})",
        )
        require(self.ppo_epochs >= 1, "ppo_epochs", f"must be >= 1 (got {self.ppo_epochs})")
        require(self.kl_coef >= 0, "kl_coef", f"must be >= 0 (got {self.kl_coef})")
        require(
            self.kl_controller == "fixed" or self.kl_coef > 0,
            "kl_coef",
            "must be > 0 for kl_controller adaptive (its starting value)",
        )
        require(self.kl_target > 0, "kl_target", f"must be > 0 (got {self.kl_target})")
        require(self.kl_horizon >= 1, "kl_horizon", f"must be >= 1 (got {self.kl_horizon})")
        require(self.entropy_coef >= 0, "entropy_coef", f"must be >= 0 (got {self.entropy_coef})")
        require(self.importance_cap > 0, "importance_cap", f"must be > 0 (got {self.importance_cap})")
        require(
            0 <= self.importance_floor < self.importance_cap,
            "importance_floor",
            f"must be in [0, importance_cap={self.importance_cap}) (got {self.importance_floor})",
        )
        require(
            self.importance_floor == 0 or self.importance_sampling == "mis",
            "importance_floor",
            f"only masks (importance_sampling mis); got {self.importance_floor} with {self.importance_sampling}",
        )
        require(
            0 <= self.importance_veto < 1, "importance_veto", f"must be in [0, 1), 0 for off (got {self.importance_veto})"
        )
        require(self.value_clip >= 0, "value_clip", f"must be >= 0 (got {self.value_clip})")
        require(0 <= self.gamma <= 1, "gamma", f"must be in [0, 1] (got {self.gamma})")
        require(0 <= self.lam <= 1, "lam", f"must be in [0, 1] (got {self.lam})")
        require(self.tau_pos > 0, "tau_pos", f"must be > 0 (got {self.tau_pos})")
        require(self.tau_neg > 0, "tau_neg", f"must be > 0 (got {self.tau_neg})")
        require(0 < self.cov_ratio <= 1, "cov_ratio", f"must be in (0, 1] (got {self.cov_ratio})")
        require(self.cov_lb < self.cov_ub, "cov_ub", f"must exceed cov_lb={self.cov_lb} (got {self.cov_ub})")
        require(self.kl_cov_coef >= 0, "kl_cov_coef", f"must be >= 0 (got {self.kl_cov_coef})")
        require(self.overlong_buffer >= 0, "overlong_buffer", f"must be >= 0 (got {self.overlong_buffer})")

    @property
    def batch_wide(self) -> bool:
        """Whether the advantages need the whole batch (whitening) before the first update."""
        return self.advantage in ("reinforce_pp", "reinforce_pp_baseline", "gae")


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The FSDP2 trainer ranks."""

    world_size: int = 2
    """Number of trainer ranks (processes); 0: the placement plan picks (on a CPU machine, one
    rank per core or one rank over every core, whichever it predicts faster from the model's
    measured thread scaling and the collectives' cost; one per GPU)."""
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
    pack: bool = False
    """Run each micro-batch as one row of its real tokens (no FLOPs on padding; the same log-probs,
    loss and counts); off by default: on CPU, sdpa's block-diagonal mask over the row makes it slower."""
    share_prompt: bool | Literal["auto"] = "auto"
    """Compute a group's prompt once in training: the rows of a micro-batch that share a prompt
    run as one row, the prompt then each row's completion (``workers/packing.py``: the same
    log-probs, loss and gradients, the prompt's gradient the sum of its rows'), and the buffer
    keeps a group's rows in one micro-batch. auto: a micro-batch runs so where that costs fewer
    estimated FLOPs than without (long prompts next to their completions; a long row's
    attention grows with its square) and the model's attention is sdpa or eager; true: always
    (refused with flash attention, whose kernels take no prepared mask); false: never."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps; 0: only at the end."""
    keep_checkpoints: int = 0
    """Keep the newest N complete checkpoints (the final one among them), deleting older ones
    as each new one is written; 0: keep all."""
    checkpoint_hf: bool = False
    """Also export each checkpoint as a Hugging Face directory into its hf/ (safetensors,
    config, tokenizer: loads in transformers and vLLM); synchronous."""
    checkpoint_async: bool = True
    """Write checkpoints in a background thread (DCP async_save): a step pays for copying the
    state into host memory, which holds that copy until it is written; the final one is synchronous."""
    weight_bucket_mb: float = 64.0
    """Size of one weight-update bucket sent to the generators."""
    weight_sync_every: int = 1
    """Publish weights to the generators every N steps (N > 1 needs buffer.max_staleness >= N - 1)."""
    mini_batches: int = 1
    """Optimizer steps per rollout batch (per ppo epoch): the rank's micro-batches split into this many
    equal runs; must divide buffer.micro_batches_per_step."""
    critic_lr: float = 1e-5
    """PPO critic learning rate (advantage gae)."""
    seed: int = 0
    """Seed of parameter init (tiny models) and dropout."""
    threads: int = 0
    """CPU threads of each rank (OMP_NUM_THREADS); 0: this machine's cores / world_size."""

    def __post_init__(self) -> None:
        require(self.threads >= 0, "threads", f"must be >= 0, 0 for the cores / world size (got {self.threads})")
        require(self.world_size >= 0, "world_size", f"must be >= 1, or 0 for the plan's pick (got {self.world_size})")
        require(self.lr > 0, "lr", f"must be > 0 (got {self.lr})")
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas",
            f"must be two numbers in [0, 1), AdamW's (got {self.betas})",
        )  # fmt: skip
        require(self.weight_decay >= 0, "weight_decay", f"must be >= 0 (got {self.weight_decay})")
        require(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0 (got {self.warmup_steps})")
        require(self.total_steps >= 0, "total_steps", f"must be >= 0 (got {self.total_steps})")
        require(self.grad_clip >= 0, "grad_clip", f"must be >= 0, 0 for no clipping (got {self.grad_clip})")
        require(self.mini_batches >= 1, "mini_batches", f"must be >= 1 (got {self.mini_batches})")
        require(self.critic_lr > 0, "critic_lr", f"must be > 0 (got {self.critic_lr})")
        require(self.weight_bucket_mb > 0, "weight_bucket_mb", f"must be > 0 (got {self.weight_bucket_mb})")
        require(self.weight_sync_every >= 1, "weight_sync_every", f"must be >= 1 (got {self.weight_sync_every})")
        require(
            self.checkpoint_every >= 0,
            "checkpoint_every",
            f"must be >= 0 steps, 0 for a checkpoint only at the end (got {self.checkpoint_every})",
        )
        require(self.keep_checkpoints >= 0, "keep_checkpoints", f"must be >= 0, 0 to keep all (got {self.keep_checkpoints})")


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
        require(self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 (off) or >= 1 (got {self.top_k})")
        require(self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1 (got {self.max_new_tokens})")
        require(self.max_attempts >= 1, "max_attempts", f"must be >= 1 (got {self.max_attempts})")
        require(self.request_timeout_s > 0, "request_timeout_s", f"must be > 0 seconds (got {self.request_timeout_s})")
        require(self.plan_wait_s > 0, "plan_wait_s", f"must be > 0 seconds (got {self.plan_wait_s})")


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
    max_filtered_batches: int = 10
    """The bound on dynamic sampling (verl's max_num_gen_batches): when this many steps' worth
    of groups (groups_per_step each) in a row are all filtered, the buffer acts as on_stall
    says (warning at half the bound); 0: no bound."""
    on_stall: Literal["error", "train"] = "error"
    """At a bound (max_filtered_batches, min_acceptance): stop the run with the filter reasons,
    the reward statistics and what to change (error), or train on the filtered groups until
    one is accepted again, or acceptance is back at the floor (train;
    all-equal groups carry zero advantages, so only the KL and entropy terms act)."""
    min_acceptance: float = 0.05
    """The floor on dynamic sampling's acceptance (a crawl that max_filtered_batches misses:
    a few groups accepted now and then): below it over the last acceptance_window groups, the
    buffer acts as on_stall says (error: the run stops with the filter, the rewards and what
    to change; train: filtered groups are trained until it is back). 0.05: each trained group
    then costs over 20 generated ones, while healthy runs accept far more (the default job
    60-100%, a SmolLM2 arithmetic run ~40%, ~14% at its first step: never below 0.05 over 200
    groups by chance); 0: no floor."""
    acceptance_window: int = 200
    """The groups (the last ones decided, in prompt order) over which min_acceptance is
    measured; nothing is judged before this many were decided."""
    settled_after: int = 2
    """A prompt is settled once its last this-many groups were filtered as all rewards equal
    (always solved, or never): with filter all_equal, generating it again is likely thrown
    away. 0: no prompt is ever settled."""
    settled_keep: float = 0.25
    """The share of a settled prompt's visits (one an epoch) still generated, drawn by a
    seeded coin per visit; the others are skipped without generating (``buffer/skipped_settled``).
    A kept visit that is accepted unsettles the prompt. 1: settled prompts are all generated."""

    def __post_init__(self) -> None:
        require(
            self.max_completion_tokens >= 0, "max_completion_tokens",
            f"must be >= 0, 0 for no length filter (got {self.max_completion_tokens})",
        )  # fmt: skip
        require(
            0 <= self.min_acceptance < 1,
            "min_acceptance",
            f"must be in [0, 1), 0 for no floor (got {self.min_acceptance})",
        )
        require(self.acceptance_window >= 1, "acceptance_window", f"must be >= 1 (got {self.acceptance_window})")
        require(self.settled_after >= 0, "settled_after", f"must be >= 0, 0 for never (got {self.settled_after})")
        require(0 <= self.settled_keep <= 1, "settled_keep", f"must be in [0, 1] (got {self.settled_keep})")
        require(
            self.max_filtered_batches >= 0,
            "max_filtered_batches",
            f"must be >= 0, 0 for no bound (got {self.max_filtered_batches})",
        )
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

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ConfigError`` unless a micro-batch wave splits evenly over ``world_size`` ranks."""
        per_wave = self.groups_per_step // self.micro_batches_per_step * self.group_size
        if world_size < 1 or per_wave % world_size:
            raise ConfigError(
                f"a micro-batch wave has {per_wave} samples (buffer.groups_per_step / micro_batches_per_step"
                f" * group_size), which does not split evenly over {world_size} trainer ranks"
            )


CUSTOM_FILTER = "a function f(group: ScoredGroup) -> str that returns '' to keep the group or why it drops it"
"""What ``buffer.custom_filter`` must name."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the prompts come from and how they become token ids (yatt/rl/data.py)."""

    source: Literal["synthetic", "jsonl", "parquet", "reasoning_gym"] = "synthetic"
    """synthetic: a built-in task (yatt/rl/tasks.py); jsonl/parquet: local files; reasoning_gym: generated."""
    path: str = ""
    """jsonl/parquet: a file, or a directory whose .jsonl/.json (.parquet) files are read in name order."""
    prompt_field: str = "prompt"
    """jsonl/parquet: the column holding the prompt, a string or a list of {role, content} messages;
    a dotted path reaches into nested fields (``question.text``)."""
    answer_field: str = "answer"
    """jsonl/parquet: the field copied into metadata['answer'], a dotted path for nested ones
    (verl's parquet: ``reward_model.ground_truth``); empty: the data has no answers."""
    image_field: str = "images"
    """jsonl/parquet: the column of a row's images, as TRL and verl read them: a list (or one) of
    file paths (relative ones against the data file's directory), raw bytes, or Hugging Face
    datasets Image values ({bytes, path}, an Image column); rows without it, or with an empty list, are text."""
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
    eval_path: str = ""
    """Held-out prompts for evaluation (run.eval_every): a file or directory of the same kind
    and fields as the training data (jsonl/parquet by its suffix); empty: none, or eval_split."""
    eval_split: float = 0.0
    """Hold out this share (0 < x < 1) or this many (x >= 1) of the training prompts for
    evaluation, chosen with data.seed and never trained on; 0: none (or eval_path)."""

    def __post_init__(self) -> None:
        if self.source == "synthetic" and self.path:  # a path means a file source: which one, by its suffix
            suffix = Path(self.path).suffix
            inferred = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(suffix)
            require(
                inferred is not None,
                "source",
                f"is synthetic, but data.path = {self.path!r} is set; say which files it holds: "
                "data.source: jsonl or parquet",
            )
            object.__setattr__(self, "source", inferred)
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
        require(self.eval_split >= 0, "eval_split", f"must be >= 0 (got {self.eval_split})")
        require(
            self.eval_split < 1 or self.eval_split == int(self.eval_split),
            "eval_split",
            f"is a share (0 < x < 1) or a count of prompts (a whole number), not {self.eval_split}",
        )
        require(
            not (self.eval_split and self.eval_path),
            "eval_split",
            "and data.eval_path are both set; evaluate on a held-out split or on a file, not both",
        )
        if self.eval_path:
            require(
                Path(self.eval_path).suffix in (".jsonl", ".json", ".parquet") or Path(self.eval_path).is_dir(),
                "eval_path",
                f"= {self.eval_path!r} is not a .jsonl, .json or .parquet file or a directory of them",
            )

    @property
    def has_eval(self) -> bool:
        """Whether the run has held-out prompts to evaluate on."""
        return bool(self.eval_path or self.eval_split)

    def eval_source(self) -> DataConfig:
        """The config that reads ``eval_path`` with this config's fields and template."""
        import dataclasses

        suffix = Path(self.eval_path).suffix
        files = Path(self.eval_path).glob("*.parquet") if not suffix else []
        parquet = suffix == ".parquet" or any(True for _ in files)
        return dataclasses.replace(self, source="parquet" if parquet else "jsonl", path=self.eval_path, eval_path="", num_prompts=0)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Evaluation on the held-out prompts (data.eval_path or data.eval_split), every
    run.eval_every steps and before the first: each prompt once greedily and ``n`` times
    sampled, through the run's own controllers, generators and reward workers."""

    greedy: bool = True
    """One greedy completion per prompt (temperature 0): eval/<scorer>/greedy and /accuracy."""
    n: int = 4
    """Sampled completions per prompt: eval/<scorer>/mean@n and pass@n; 0: none."""
    temperature: float = 1.0
    """Temperature of the sampled completions."""
    pass_threshold: float = 1.0
    """A completion passes (accuracy, pass@n) when its score reaches this."""
    max_new_tokens: int = 0
    """Longest completion; 0: controller.max_new_tokens."""

    def __post_init__(self) -> None:
        require(self.n >= 0, "n", f"must be >= 0, 0 for no sampled completions (got {self.n})")
        require(self.greedy or self.n > 0, "greedy", "is false and eval.n is 0: nothing would be evaluated")
        require(self.temperature > 0, "temperature", f"must be > 0 for sampled completions (got {self.temperature})")
        require(self.max_new_tokens >= 0, "max_new_tokens", f"must be >= 0 (got {self.max_new_tokens})")


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """Multi-turn episodes (yatt/rl/agents): the environment or the tools each prompt's
    episodes run against, and their limits. Neither ``class`` nor ``tools`` set: one
    completion per prompt, no episodes."""

    class_: str = ""
    """(``env.class``) 'module:Class', an environment in Gymnasium's convention (text in, text
    out): one instance per episode, ``reset(seed=, options={"row": row})`` then ``step(action)``
    per turn, sync or ``async def``; empty with ``tools`` set: the built-in tool environment."""
    kwargs: dict[str, bool | int | float | str | list[str]] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    episode: str = ""
    """'module:function', agent code that drives its own episode: ``async def run(client, row)
    -> float | dict``, its calls ``client.generate(ids)`` (token in, token out) and
    ``client.chat(messages, tools=)`` each a turn (yatt/rl/agents/client.py), or an
    ``openai.AsyncOpenAI()`` on ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (an endpoint of the
    episode's own: yatt/rl/agents/hosted.py); under max_turns, max_total_tokens and
    episode_timeout_s; like an environment, in the env role's processes under their limits
    (``inline``: in the controllers, with ``client.base_url`` and ``client.api_key``)."""
    tools: list[str] = field(default_factory=list)
    """'module:function' tools (type hints and a docstring: transformers' get_json_schema)."""
    protocol: Literal["tags", "hermes"] = "tags"
    """How the model calls tools: tags (``<tool>name(args)</tool>``, the result inline as
    ``<result>...</result>``: small models without a tool-calling template) or hermes (the chat
    template's ``<tool_call>{json}</tool_call>``, the result a tool message)."""
    instructions: str | None = None
    """The system message that says how to call ``tools`` with tags: None, yatt's paragraph
    listing each tool's signature and the protocol; a text, that text; "", none (a model
    that learnt the protocol, e.g. from the warm start's demonstrations, needs no paragraph
    filling its context). hermes: the chat template writes its own from the schemas."""
    observations: Literal["auto", "chat", "inline"] = "auto"
    """How observations join the episode: chat (each a message of the chat template: the
    policy's turn closed, the message, the next assistant turn opened) or inline (the text as
    it is, within the policy's turn: tag protocols such as ``<result>...</result>``); auto:
    inline for tools with the tags protocol, chat otherwise."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a turn (whole tokens kept), besides EOS; tags adds ``</tool>``."""
    max_turns: int = 4
    """Policy turns per episode; the episode ends as 'max_turns' after the last."""
    max_total_tokens: int = 0
    """Context budget of an episode (prompt, turns and observations); 0: the model's positions."""
    max_obs_tokens: int = 256
    """Longest observation, in tokens; a longer one is cut (``obs_truncate`` says where), but
    never through an image: one with images over it ends the episode (its reason: budget)."""
    obs_truncate: Literal["start", "end"] = "end"
    """Which end of a long observation is cut off."""
    tool_timeout_s: float = 10.0
    """Longest a tool call may take; past it the model reads a timeout error."""
    episode_timeout_s: float = 300.0
    """Longest an episode's environment time may take (generation not counted); past it the
    episode ends as 'timeout' and is trained on as far as it got."""
    reward_weight: float = 1.0
    """Weight of the environment's rewards (summed over turns) added to the scorer mix."""
    credit: Literal["episode", "turn"] = "episode"
    """episode: the episode's reward, its GRPO advantage on every policy token; turn: each
    turn's discounted return from its step rewards (the scorer mix counts at the last turn)
    minus the group's mean episode return (yatt.rl.rl_math.turn_advantages)."""
    gamma: float = 1.0
    """Discount per turn of ``credit: turn``."""
    inline: bool = False
    """Run the environments (or tools, or ``episode``'s agent code) inside the controllers:
    for pure, fast, trusted code. false: in the env role's processes (``workers``), each
    episode's environment (or agent) in a process of its own under the limits below, where a
    hang, a crash or a memory blow-up ends that episode only."""
    workers: int = 1
    """Env role processes (not ``inline``); the controllers spread episodes over them."""
    concurrency: int = 32
    """Episodes each controller keeps live in the env role at once (each one a process
    there); the others wait their turn before their reset. An evaluation round starts every
    held-out episode together: hundreds of processes forked at once starve an env worker
    on a small machine past its heartbeat limit. ``inline`` episodes are not bounded."""
    cpu_limit_s: float = 600.0
    """CPU seconds one episode's environment process may use (RLIMIT_CPU); past it the
    process is killed and the episode ends as env_error. 0: no limit."""
    memory_limit_mb: int = 4096
    """Address space of one episode's environment process (RLIMIT_AS), in MiB; an allocation
    past it fails (MemoryError) and the episode ends as env_error. 0: no limit."""
    network: bool = False
    """Let environments and tools reach the network; false: each episode's process runs in a
    network namespace of its own (no interface but a down loopback) where the OS allows it
    (Linux with user namespaces or root; elsewhere the env role says once that it cannot)."""

    def __post_init__(self) -> None:
        require(self.concurrency >= 1, "concurrency", f"must be >= 1 (got {self.concurrency})")
        require(self.workers >= 1, "workers", f"must be >= 1 (got {self.workers}); env.inline: true runs environments in the controllers")
        require(self.cpu_limit_s >= 0, "cpu_limit_s", f"must be >= 0 seconds, 0 for no limit (got {self.cpu_limit_s})")
        require(self.memory_limit_mb >= 0, "memory_limit_mb", f"must be >= 0 MiB, 0 for no limit (got {self.memory_limit_mb})")
        require(not self.tools or not self.class_, "tools", "and env.class are both set: a user environment calls its own tools; set one")
        require(
            not self.episode or not (self.tools or self.class_), "episode",
            "is set with env.class or env.tools: agent code that drives its own episode calls its own tools; set one",
        )  # fmt: skip
        require(
            self.instructions is None or bool(self.tools), "instructions",
            "is set without env.tools: it is the tools' system message (an environment or agent code writes its own prompt)",
        )  # fmt: skip
        require(self.max_turns >= 1, "max_turns", f"must be >= 1 (got {self.max_turns})")
        require(self.max_total_tokens >= 0, "max_total_tokens", f"must be >= 0 (got {self.max_total_tokens})")
        require(self.max_obs_tokens >= 1, "max_obs_tokens", f"must be >= 1 (got {self.max_obs_tokens})")
        require(self.tool_timeout_s > 0, "tool_timeout_s", f"must be > 0 seconds (got {self.tool_timeout_s})")
        require(self.episode_timeout_s > 0, "episode_timeout_s", f"must be > 0 seconds (got {self.episode_timeout_s})")
        require(all(self.stop), "stop", f"must not hold an empty string (got {self.stop})")
        require(0 < self.gamma <= 1, "gamma", f"must be in (0, 1] (got {self.gamma})")

    @property
    def enabled(self) -> bool:
        """Whether prompts run as multi-turn episodes."""
        return bool(self.class_ or self.tools or self.episode)

    @property
    def env_workers(self) -> int:
        """Env role processes the run starts: ``workers`` for episodes not run ``inline``, else 0."""
        return self.workers if self.enabled and not self.inline else 0

    @property
    def render_protocol(self) -> Literal["chat", "raw"]:
        """The renderer's protocol (yatt/rl/agents/render.py) for ``observations``."""
        inline = self.observations == "inline" or (self.observations == "auto" and bool(self.tools) and self.protocol == "tags")
        return "raw" if inline else "chat"

    @property
    def stop_strings(self) -> list[str]:
        """What ends a turn besides EOS: ``stop``, and a tag-protocol tool call's end."""
        tags = ["</tool>"] if self.tools and self.protocol == "tags" else []
        return list(dict.fromkeys([*self.stop, *tags]))


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """Where the roles run on the machine's device slots (yatt/placement)."""

    layout: Literal["auto", "colocated", "partial", "disaggregated"] = "auto"
    """colocated: each trainer rank also hosts a generator engine (they take turns on its slot);
    partial: training on every slot, generators on a subset, asleep while training runs;
    disaggregated: disjoint slots, asynchronous within buffer.max_staleness;
    auto: the planner picks the layout with the lowest predicted step time."""
    adaptive: bool = True
    """Re-plan at run time from each step's measured stage times (yatt/placement/adaptive.py):
    slots move between the generator, reward-engine and trainer pools (or the layout
    changes: ``adaptive_layouts``) at a step boundary when a neighbouring plan is predicted
    faster by ``adaptive_margin`` for ``adaptive_patience`` steps and pays back its switch.
    Every decision is a line of ``placement.jsonl`` (and TensorBoard scalars of the run
    ``tensorboard/placement``); false pins the plan of the start."""
    adaptive_margin: float = 0.05
    """Share of the predicted step time a neighbouring plan must save to be considered."""
    adaptive_patience: int = 3
    """Steps in a row a neighbour must win before the plan changes (hysteresis)."""
    adaptive_warmup: int = 2
    """Steps measured and written to ``placement.jsonl`` but not re-planned on: the first
    ones of a run (or of a resumed one) and the first ones after each change, which run slow
    while new processes warm up (the default job's first two steps take 2-4x the later
    ones); 0: re-plan from the first step."""
    adaptive_layouts: bool = False
    """Let a re-planned run also switch between the disaggregated and colocated layouts
    (through a checkpoint, as a move of the trainer's slots); false: slots move within the
    layout it started with (a partial run always does: its generators are parked and
    woken). Off by default: a switch restarts the trainer group and every engine, and a
    colocated step predicted from a disaggregated run's measurements was 30% short of the
    measured one on a 2-core machine (0.37 against 0.53 s)."""
    cpu_slots: int = 0
    """On a CPU machine: the device slots its cores are cut into; 0: one per core. More slots
    than cores time-share them (each gets cores/slots of a core's throughput, and the planner
    predicts with that): a small machine can then place as many pools as a larger one."""

    def __post_init__(self) -> None:
        require(self.adaptive_margin >= 0, "adaptive_margin", f"must be >= 0 (got {self.adaptive_margin})")
        require(self.adaptive_patience >= 1, "adaptive_patience", f"must be >= 1 (got {self.adaptive_patience})")
        require(self.adaptive_warmup >= 0, "adaptive_warmup", f"must be >= 0, 0 to re-plan from the first step (got {self.adaptive_warmup})")
        require(self.cpu_slots >= 0, "cpu_slots", f"must be >= 0, 0 for one slot per core (got {self.cpu_slots})")
