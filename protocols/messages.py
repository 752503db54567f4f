"""Every message that crosses a process boundary in yatt, and nothing else.

Each message is a frozen, keyword-only dataclass with a wire ``KIND`` (one byte string,
the first ZeroMQ frame) and a ``SCHEMA_VERSION`` (bumped on any incompatible change; a
receiver rejects a version it does not know). Field types are limited to what the codec
validates: ``bool``, ``int``, ``float``, ``str``, ``bytes``, ``torch.Tensor``, nested
dataclasses from this module, ``list[...]``, ``dict[str, ...]`` and ``... | None``.

Tensors travel out of band as their own frames (see ``protocols.codec``); the comments
give their shapes and dtypes.

The loop, in messages::

    controller --GenerateRequest--> generator --Completions--> controller
    controller --ScoreRequest-----> reward    --Scores-------> controller
    controller --ScoredGroup------> buffer    --Ack----------> controller
    trainer    --MicroBatchRequest> buffer    --MicroBatch---> trainer
    trainer    --WeightUpdate-----> generator --Ack----------> trainer
    every actor --Register/Heartbeat--> registry --Membership--> subscribers
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from torch import Tensor as Tensor
else:

    class Tensor:
        """``torch.Tensor`` in the field types, without importing torch to read them: a process
        that only passes messages along (the launcher) need not load it. The codec encodes
        and decodes these fields as real tensors."""


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base of every wire message."""

    KIND: ClassVar[bytes] = b""
    SCHEMA_VERSION: ClassVar[int] = 1


# ---------------------------------------------------------------- shared value types


@dataclass(frozen=True, kw_only=True)
class GroupKey:
    """The stable identity of one prompt's group of samples.

    Retries and controller restarts reuse the key (``attempt`` counts re-generations
    after a filter rejected the group), so the buffer's ledger can keep exactly-once.
    """

    epoch: int  # < 0: a group of the evaluation of policy version -epoch - 1 (yatt.rl.evaluation)
    shard: int
    prompt_index: int  # index into the epoch's shuffled order of the whole dataset (eval: of the held-out prompts)
    attempt: int = 0  # eval: 0 the greedy completion, 1 the sampled ones

    def as_str(self) -> str:
        return f"{self.prompt_str()}/a{self.attempt}"

    def prompt_str(self) -> str:
        """The prompt of its epoch the key is an attempt at: e0/s1/p23."""
        return f"e{self.epoch}/s{self.shard}/p{self.prompt_index}"


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample; the fields follow vLLM's ``SamplingParams`` names."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings (an agent's "</tool>"): the sample ends with the token completing one
    seed: int | None = None


@dataclass(frozen=True, kw_only=True)
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: Tensor  # [L] int32, the generated tokens only
    logprobs: Tensor  # [L] float32, log p(token) under the generating policy
    finish_reason: str  # "stop" (EOS or a stop token) or "length"
    policy_version_min: int  # oldest policy version that produced any token of it
    policy_version_max: int  # newest one (differs only if weights changed mid-sample)


@dataclass(frozen=True, kw_only=True)
class WorkerInfo:
    """One member of the service directory."""

    actor_id: str  # unique per process incarnation, e.g. "generator-0@1a2b"
    role: str  # "generator", "reward", "buffer", "trainer", "controller", ...
    endpoint: str  # where its ROUTER listens, e.g. "tcp://127.0.0.1:5555"
    meta: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- generation


@dataclass(frozen=True, kw_only=True)
class GenerateRequest(Message):
    """Sample ``n`` completions of one prompt (one group)."""

    KIND: ClassVar[bytes] = b"gen.req"

    group_key: GroupKey
    prompt_ids: Tensor  # [P] int32
    n: int
    sampling: SamplingParams
    min_policy_version: int = 0  # the generator waits until it holds at least this version
    # A prompt with images: the processor's outputs beside prompt_ids, by the model's argument
    # name (pixel_values [images, 3, H, W] or [patches, D] float32, image_grid_thw [images, 3]
    # int64, ...), first dimension per image or patch; empty for text (yatt.rl.data.Prompt.mm_inputs).
    mm_inputs: dict[str, Tensor] = field(default_factory=dict)
    # The same images encoded (PNG), in order, for an engine that processes them itself (vLLM:
    # generator.backend=vllm); empty otherwise (yatt.rl.data.Prompt.images).
    images: list[bytes] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Completions(Message):
    """The group of samples answering a ``GenerateRequest``."""

    KIND: ClassVar[bytes] = b"gen.rep"

    group_key: GroupKey
    completions: list[Completion]


# ---------------------------------------------------------------- reward


@dataclass(frozen=True, kw_only=True)
class ScoreRequest(Message):
    """Score every completion of one group."""

    KIND: ClassVar[bytes] = b"score.req"

    group_key: GroupKey
    prompt_ids: Tensor  # [P] int32
    completion_ids: list[Tensor]  # n x [L_i] int32
    finish_reasons: list[str]  # n, "stop" or "length"
    metadata: dict[str, str] = field(default_factory=dict)  # e.g. {"answer": "42"} for verifiers


@dataclass(frozen=True, kw_only=True)
class Scores(Message):
    """Rewards of one group; a scorer that failed for a sample records why."""

    KIND: ClassVar[bytes] = b"score.rep"

    group_key: GroupKey
    rewards: Tensor  # [n] float32, the weighted mix
    components: dict[str, Tensor]  # scorer name -> [n] float32, before weighting
    failures: list[str]  # n, "" where every scorer succeeded, else the reasons


# ---------------------------------------------------------------- buffer and trainer


@dataclass(frozen=True, kw_only=True)
class ScoredGroup(Message):
    """A group ready for training, pushed by a controller into the buffer."""

    KIND: ClassVar[bytes] = b"group"

    group_key: GroupKey
    prompt_ids: Tensor  # [P] int32
    completion_ids: list[Tensor]  # n x [L_i] int32
    rollout_logprobs: list[Tensor]  # n x [L_i] float32, from the generator
    rewards: Tensor  # [n] float32
    advantages: Tensor  # [n] float32, per sequence (broadcast over its tokens)
    policy_versions: Tensor  # [n] int64, oldest version per sample (staleness uses it)
    finish_reasons: list[str]  # n
    scores: dict[str, Tensor] = field(default_factory=dict)  # scorer name -> [n] float32, raw (Scores.components)
    failures: list[str] = field(default_factory=list)  # n (or empty), "" where every scorer succeeded
    # Multi-turn episodes (yatt.rl.agents); all empty for single-turn groups. A completion is
    # then the episode after its prompt: generated turns and the observations between them.
    completion_masks: list[Tensor] = field(default_factory=list)  # n x [L_i] bool, True on the policy's own tokens
    token_versions: list[Tensor] = field(default_factory=list)  # n x [L_i] int64, the version that sampled each token; -1 on observations
    episodes: list[EpisodeInfo] = field(default_factory=list)  # n, how each episode went
    token_advantages: list[Tensor] = field(default_factory=list)  # n x [L_i] float32, per token (credit per turn); empty: ``advantages``
    forked: list[ForkedRow] = field(default_factory=list)  # more rows of the samples: agent calls that did not extend their row
    mm_inputs: dict[str, Tensor] = field(default_factory=dict)  # the prompt's images, processed (GenerateRequest.mm_inputs)
    # n (or empty): each sample's images after its prompt's (an environment's observations),
    # processed; the sample's row holds their placeholders after the prompt's.
    sample_mm_inputs: list[dict[str, Tensor]] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class ForkedRow:
    """One more training row of a sample (``ScoredGroup.forked``): agent code's call whose
    context did not extend the sample's row so far (a rewritten history, a summary, a
    sub-agent) started it; its own prompt (that call's context: no loss, so a turn it
    repeats is trained once, in its own row), then its turns and observations, with its
    sample's advantage on the policy's tokens."""

    sample: int  # the sample (episode) it belongs to, 0-based
    prompt_ids: Tensor  # [P] int32
    completion_ids: Tensor  # [L] int32
    completion_mask: Tensor  # [L] bool, True on the policy's own tokens
    rollout_logprobs: Tensor  # [L] float32
    token_versions: Tensor  # [L] int64; -1 on observations
    advantages: Tensor  # [L] float32, per token (0 on observations)


@dataclass(frozen=True, kw_only=True)
class EpisodeInfo:
    """How one multi-turn episode went (``ScoredGroup.episodes``)."""

    ended: str  # done | truncated | max_turns | budget | timeout | env_error
    turns: int  # policy turns generated
    turn_rewards: list[float]  # the environment's reward after each turn (NaN where it gave none)
    tool_errors: int  # tool calls that did not parse, named no tool, had bad arguments, raised or timed out
    detail: str = ""  # the error that ended it (env_error, timeout), one line


@dataclass(frozen=True, kw_only=True)
class TurnRecord(Message):
    """One finished turn of an episode, pushed by a controller into the buffer's ledger
    before the episode goes on: a restarted controller resumes the episode after its last
    recorded turn (``TurnsRequest``) instead of from the start. Dropped once the group is
    decided."""

    KIND: ClassVar[bytes] = b"turn"

    group_key: GroupKey
    sample: int  # which of the group's episodes
    turn: int  # 0-based, in the episode
    token_ids: Tensor  # [L] int32, the policy's turn as sampled
    logprobs: Tensor  # [L] float32, rollout log-probs
    policy_version: int  # the version that sampled it
    finish_reason: str  # "stop" or "length"
    obs_ids: Tensor  # [O] int32, the observation appended after it (empty when the episode ended)
    reward: float  # the environment's reward for it; NaN: none
    tool_errors: int
    ended: str = ""  # how the episode ended at this turn; "": it goes on
    detail: str = ""  # the error that ended it, one line
    env_state: bytes = b""  # the environment's snapshot() after this turn's step (b"": none)
    obs_images: list[bytes] = field(default_factory=list)  # the observation's images, encoded, in order


@dataclass(frozen=True, kw_only=True)
class TurnsRequest(Message):
    """A controller starting a group asks for its episodes' recorded turns."""

    KIND: ClassVar[bytes] = b"turns?"

    group_key: GroupKey
    drop_sample: int = -1  # >= 0: first forget that sample's turns (its episode runs again from the start)


@dataclass(frozen=True, kw_only=True)
class TurnRecords(Message):
    """The recorded turns of one group, by sample then turn (``TurnRecord``)."""

    KIND: ClassVar[bytes] = b"turns"

    group_key: GroupKey
    records: list[TurnRecord]


@dataclass(frozen=True, kw_only=True)
class EnvCall(Message):
    """A controller's call on one episode's environment, hosted by the env role
    (``workers.env``): reset it, step it with the policy's turn, or close it."""

    KIND: ClassVar[bytes] = b"env.call"

    episode: str  # the episode's id, unique per attempt of it
    method: str  # "reset" | "step" | "snapshot" | "restore" | "close"
    turn: int = -1  # step: 0-based; the same turn again is answered again, not stepped twice
    seed: int = 0  # reset
    row_json: str = ""  # reset: the data row's fields, JSON
    action: str = ""  # step: the policy's turn as text
    state: bytes = b""  # restore: what the environment's snapshot() gave


@dataclass(frozen=True, kw_only=True)
class EnvReply(Message):
    """What an environment answered to an ``EnvCall`` (close: nothing but the episode)."""

    KIND: ClassVar[bytes] = b"env.rep"

    episode: str
    messages: list[dict[str, str]] = field(default_factory=list)  # the observation, as chat messages
    images: list[bytes] = field(default_factory=list)  # its image parts' encoded images, in order (yatt.rl.agents.envs.to_wire)
    reward: float | None = None
    terminated: bool = False
    truncated: bool = False
    tool_errors: int = 0  # step: info["tool_errors"]
    tools_json: str = ""  # reset: info["tools"] (OpenAI function schemas), JSON; "": none
    snapshots: bool = False  # reset: the environment has snapshot() and restore()
    state: bytes = b""  # snapshot: the environment's state


@dataclass(frozen=True, kw_only=True)
class StepReport(Message):
    """What the buffer saw of one step's groups (every group it consumed for the step,
    trained or filtered): reward, per-scorer, failure and length statistics, and a sample
    of the groups themselves for the rollout log. Reply to Query("step_report"); and to
    Query("evaluate"), with ``step`` the evaluated version and eval/* values (yatt.rl.evaluation)."""

    KIND: ClassVar[bytes] = b"step.report"

    step: int
    values: dict[str, float]  # metric name -> value, e.g. "reward/mean", "response_length/clip_ratio"
    groups: list[ScoredGroup]  # up to run.rollouts_per_step, trained ones first


@dataclass(frozen=True, kw_only=True)
class MicroBatchRequest(Message):
    """A trainer rank asks for its next micro-batch of ``step``."""

    KIND: ClassVar[bytes] = b"mb.req"

    step: int
    rank: int
    world_size: int
    index: int  # which of the rank's micro-batches of the step (a retry asks the same index)


@dataclass(frozen=True, kw_only=True)
class MicroBatch(Message):
    """One micro-batch for one trainer rank, right-padded to its longest sequence.

    Every rank gets ``count`` micro-batches for the step; ``index`` counts from 0. A
    sample that only pads the batch has an all-zero ``loss_mask``.
    """

    KIND: ClassVar[bytes] = b"mb"

    step: int
    rank: int
    index: int
    count: int
    input_ids: Tensor  # [B, T] int64, prompt + completion, right-padded
    attention_mask: Tensor  # [B, T] bool, True on real tokens
    loss_mask: Tensor  # [B, T] bool, True on completion tokens that count in the loss
    rollout_logprobs: Tensor  # [B, T] float32, generator logprobs aligned with input_ids
    advantages: Tensor  # [B, T] float32
    policy_versions: Tensor  # [B] int64
    group_keys: list[GroupKey]  # B, the group of each row
    # The rows' images, processed (ScoredGroup.mm_inputs), each name's tensors concatenated
    # over the rows in row order (a row repeats its prompt's), as a processor batches them;
    # the model matches them to the image placeholder tokens of input_ids in that order.
    mm_inputs: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class PlanRequest(Message):
    """A controller asks which groups of its shard to generate now.

    The buffer answers at once if its plan changed since ``after_seq``, else when it
    changes or ``wait_s`` has passed (a long poll), with a ``DispatchPlan``.
    """

    KIND: ClassVar[bytes] = b"plan.req"

    shard: int
    num_shards: int
    after_seq: int  # the plan_seq of the last plan this controller saw; -1 on (re)start
    wait_s: float = 1.0


@dataclass(frozen=True, kw_only=True)
class DispatchPlan(Message):
    """Every group of one shard that should be in flight now; the controller issues the
    ones it has not issued yet, and a restarted controller issues them all."""

    KIND: ClassVar[bytes] = b"plan"

    plan_seq: int  # grows whenever the plan changes
    keys: list[GroupKey]  # undecided groups of this shard inside the dispatch window, in order
    min_policy_version: int  # generate with at least this policy version
    step: int  # the step being assembled


# ---------------------------------------------------------------- weights


@dataclass(frozen=True, kw_only=True)
class WeightUpdate(Message):
    """One bucket of a versioned weight update, trainer -> generator.

    A generator applies version ``version`` once all ``num_buckets`` buckets have arrived,
    between engine calls, and then acks it. ``incarnation`` counts the trainer group's
    restarts in the run: an update of a newer incarnation is taken even at a lower version
    (the run went back to a checkpoint); one of an older incarnation is refused.
    """

    KIND: ClassVar[bytes] = b"weights"

    version: int
    incarnation: int = 0
    bucket_index: int
    num_buckets: int
    names: list[str]  # parameter names in Hugging Face naming
    tensors: list[Tensor]  # full (unsharded) tensors, one per name


# ---------------------------------------------------------------- control


@dataclass(frozen=True, kw_only=True)
class Register(Message):
    """An actor joins the service directory (or re-announces itself)."""

    KIND: ClassVar[bytes] = b"reg"

    worker: WorkerInfo


@dataclass(frozen=True, kw_only=True)
class Deregister(Message):
    """An actor leaves the service directory on purpose."""

    KIND: ClassVar[bytes] = b"dereg"

    actor_id: str


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    """I am alive. Sent every heartbeat interval to each peer that watches this actor."""

    KIND: ClassVar[bytes] = b"hb"

    actor_id: str
    seq: int


@dataclass(frozen=True, kw_only=True)
class Membership(Message):
    """The whole service directory at ``epoch`` (it grows by one on every change)."""

    KIND: ClassVar[bytes] = b"members"

    epoch: int
    workers: list[WorkerInfo]


@dataclass(frozen=True, kw_only=True)
class PolicyVersion(Message):
    """Broadcast: the trainer published weights of ``version``."""

    KIND: ClassVar[bytes] = b"policy"

    version: int


@dataclass(frozen=True, kw_only=True)
class Query(Message):
    """A small typed request with no payload of its own (``what`` names the question)."""

    KIND: ClassVar[bytes] = b"query"

    what: str
    args: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Metrics(Message):
    """Named measurements, e.g. the buffer's stats or a worker's stage times."""

    KIND: ClassVar[bytes] = b"metrics"

    values: dict[str, float]


@dataclass(frozen=True, kw_only=True)
class Ack(Message):
    """Accepted. ``seq`` is the stream sequence number or the acknowledged item's number."""

    KIND: ClassVar[bytes] = b"ack"

    seq: int = 0
    info: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Error(Message):
    """A handler raised, or the request could not be decoded."""

    KIND: ClassVar[bytes] = b"error"

    error_type: str  # the exception's class name
    message: str
    traceback: str  # the remote traceback, formatted


@dataclass(frozen=True, kw_only=True)
class Shutdown(Message):
    """Stop serving and exit cleanly."""

    KIND: ClassVar[bytes] = b"shutdown"

    reason: str = ""


MESSAGE_TYPES: tuple[type[Message], ...] = (
    GenerateRequest,
    Completions,
    ScoreRequest,
    Scores,
    ScoredGroup,
    TurnRecord,
    TurnsRequest,
    TurnRecords,
    EnvCall,
    EnvReply,
    StepReport,
    MicroBatchRequest,
    MicroBatch,
    PlanRequest,
    DispatchPlan,
    WeightUpdate,
    Register,
    Deregister,
    Heartbeat,
    Membership,
    PolicyVersion,
    Query,
    Metrics,
    Ack,
    Error,
    Shutdown,
)
