"""Where the planner's inputs come from: model sizes from a Hugging Face config.json (no
weights loaded), stage costs estimated from FLOPs, and those costs calibrated by what a run
measured.

Estimates (``estimate_costs``): 2 * params FLOPs per generated token, 6 * params per trained
token, at the slot's measured matmul peak times a stated efficiency per stage and slot kind
(``EFFICIENCY``: first-order guesses until a run is measured).

Calibration (``calibrate``): the planner needs costs per slot; a run measures seconds per
step on the slots it had. So each measured stage is compared with what the cost model
predicts for that run's slots, and the estimate's costs of that stage are scaled by the
ratio::

    completion_mean  = median(tokens_per_s / samples_per_s)      (trained tokens are completions)
    acceptance       = the last buffer/acceptance_ema
    weight_sync_s    = median(time/weight_sync_s)
    train            x= median(time/train_s) / T(train_slots)    train_token_s and train_fixed_s
    generation       x= median(time/wait_for_buffer_s) / (G(gen_slots) + tail)
                        on-policy runs only: there the trainer waits for the whole rollout;
                        with max_staleness >= 1 the wait is only what generation failed to hide

The first step is left out when there are more (it pays for warm-up: compilation, the
first weight load). Pure: it takes parsed rows and dicts; ``launch.placement.inputs`` reads the files.
``calibrate`` is the entry point run-time re-planning will feed each step's times into.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from yatt.errors import ConfigError
from yatt.placement.planner import ModelSizes, StageCosts, Workload, stage_times


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Stated efficiency factors that turn FLOPs and bytes into seconds (``estimate_costs``)."""

    decode: float
    """Share of the slot's peak FLOP/s that batched decoding reaches."""
    latency: float
    """Share of peak one sequence decoding alone reaches (memory-bound)."""
    forward: float
    """Share of peak a reward model's forward pass reaches."""
    train: float
    """Share of peak FSDP training reaches (forward + backward)."""
    decode_step_s: float
    """Seconds per decoding step beyond the FLOPs (kernel launches, sampling, Python)."""
    train_fixed_s: float
    """Seconds per training step beyond the FLOPs (optimizer step, collectives, Python)."""
    sync_bytes_per_s: float
    """Bytes/s of a weight push to the generators over the transport."""
    sync_fixed_s: float
    """Seconds per weight push beyond the bytes (gather, message round trips, the engine's load)."""
    copy_bytes_per_s: float
    """Bytes/s of the in-process weight load of a switch (FSDP shards -> engine)."""
    wake_s: float
    """Seconds to put an engine to sleep and wake it again, per step."""
    rule_reward_s: float
    """Seconds per sample of a rule-based scorer (a Python function in a process pool)."""
    collective_bytes_per_s: float = 0.0
    """Bytes of the policy's parameters a 2-rank group's FSDP collectives get through per
    second (counted as 2 x weight_bytes gathered and 4 reduced per parameter and micro-batch);
    0: none counted apart (``train_scaling`` covers them)."""


EFFICIENCY: dict[Literal["cpu", "gpu"], Efficiency] = {
    "gpu": Efficiency(decode=0.25, latency=0.01, forward=0.5, train=0.4, decode_step_s=0.003, train_fixed_s=0.05,
                      sync_bytes_per_s=5e9, sync_fixed_s=0.05, copy_bytes_per_s=50e9, wake_s=0.5, rule_reward_s=0.0005),
    "cpu": Efficiency(decode=0.1, latency=0.05, forward=0.3, train=0.3, decode_step_s=0.01, train_fixed_s=0.05,
                      sync_bytes_per_s=1e9, sync_fixed_s=0.01, copy_bytes_per_s=5e9, wake_s=0.005, rule_reward_s=0.0005,
                      collective_bytes_per_s=0.7e9),
}
"""Efficiency factors by slot kind: first-order guesses, replaced by measured costs once a run exists.
CPU collectives: gloo between 2 ranks of one core each moved SmolLM2-135M's 2 micro-batches a
step (2 x 8 bytes a parameter) in 3.1 s (``benchmarks stages``, 2026-12-03): ~0.7 GB/s."""


def _int(config: Mapping[str, object], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"model config.json: {key} must be an integer (got {value!r}); is it a decoder-only model's config?")
    return value


@dataclass(frozen=True, kw_only=True)
class _Shape:
    """The numbers of a decoder-only Hugging Face config that sizes depend on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    attention_bias: bool


def _shape(config: Mapping[str, object]) -> _Shape:
    text = config.get("text_config")
    c = text if isinstance(text, Mapping) else config
    hidden, heads = _int(c, "hidden_size"), _int(c, "num_attention_heads")
    return _Shape(
        hidden=hidden,
        layers=_int(c, "num_hidden_layers"),
        heads=heads,
        kv_heads=_int(c, "num_key_value_heads", heads),
        head_dim=_int(c, "head_dim") if c.get("head_dim") is not None else hidden // heads,
        intermediate=_int(c, "intermediate_size"),
        vocab=_int(c, "vocab_size"),
        tied=bool(c.get("tie_word_embeddings", True)),
        attention_bias=bool(c.get("attention_bias")) or c.get("model_type") == "qwen2",
    )


def hf_param_count(config: Mapping[str, object]) -> int:
    """Parameters of a decoder-only Hugging Face model (Llama, Qwen, Mistral, SmolLM shapes:
    gated MLP, grouped-query attention; not mixture-of-experts) from its config.json, without
    loading weights."""
    m = _shape(config)
    attention = m.hidden * m.head_dim * (2 * m.heads + 2 * m.kv_heads)
    if m.attention_bias:
        attention += m.head_dim * (m.heads + 2 * m.kv_heads)
    per_layer = attention + 3 * m.hidden * m.intermediate + 2 * m.hidden
    embeddings = m.vocab * m.hidden * (1 if m.tied else 2)
    return m.layers * per_layer + embeddings + m.hidden


def model_sizes(
    config: Mapping[str, object],
    *,
    weight_bytes: int,
    reference: bool = False,
    critic: bool = False,
    reward_params: int = 0,
    activation_checkpointing: bool = False,
) -> ModelSizes:
    """The sizes of a run whose policy has Hugging Face ``config`` (a reference and a critic of
    the same shape when the algorithm uses them), computing with ``weight_bytes`` per
    parameter (the trainer keeps float32 master weights whatever it computes in). Activations per token follow Korthikanti et
    al. (2022) with flash attention: 34 * hidden bytes per layer in 16-bit (2 * hidden, the layer
    inputs, with activation checkpointing), plus the float32 logits and their gradient."""
    params = hf_param_count(config)
    m = _shape(config)
    per_layer = (2 if activation_checkpointing else 34) * m.hidden * weight_bytes // 2
    return ModelSizes(
        policy_params=params,
        reference_params=params if reference else 0,
        critic_params=params if critic else 0,
        reward_params=reward_params,
        weight_bytes=weight_bytes,
        train_bytes=16,
        kv_bytes_per_token=2 * m.layers * m.kv_heads * m.head_dim * weight_bytes,
        activation_bytes_per_token=m.layers * per_layer + 8 * m.vocab,
    )


def estimate_costs(
    *,
    sizes: ModelSizes,
    workload: Workload,
    kind: Literal["cpu", "gpu"],
    peak_flops: float,
    acceptance: float = 1.0,
    efficiency: Efficiency | None = None,
    thread_scaling: tuple[float, float] | None = None,
) -> StageCosts:
    """Stage costs from FLOPs when nothing was measured: 2 * params FLOPs per generated token,
    6 * params per trained token (plus 2 * reference and 6 * critic params), a reward model's
    2 * params per scored token, at the slot's ``peak_flops`` times the stated efficiencies.
    Completions are assumed to average 0.6 * max_new_tokens with the p90 at the limit.
    ``thread_scaling``: one process's threads over several CPU slots, in training and in
    generation, when measured."""
    if peak_flops <= 0:
        raise ConfigError(f"peak_flops must be > 0 to estimate costs (got {peak_flops}); measure it first")
    e = efficiency or EFFICIENCY[kind]
    batch = float(max(1, workload.max_batch_sequences))
    mean, p90 = 0.6 * workload.max_new_tokens, float(workload.max_new_tokens)
    gen_flops = 2.0 * sizes.policy_params
    train_flops = 6.0 * (sizes.policy_params + sizes.critic_params) + 2.0 * sizes.reference_params
    if sizes.reward_params:
        reward_s = 2.0 * sizes.reward_params * (workload.prompt_tokens + mean) / (peak_flops * e.forward)
    else:
        reward_s = e.rule_reward_s
    engine_bytes = sizes.policy_params * sizes.weight_bytes
    trained = sizes.policy_params + sizes.critic_params
    collective_s = (workload.micro_batches_per_step * trained * (2 * sizes.weight_bytes + 4) / e.collective_bytes_per_s
                    if e.collective_bytes_per_s > 0 else 0.0)
    return StageCosts(
        gen_token_s=gen_flops / (peak_flops * e.decode) + e.decode_step_s / batch,
        gen_latency_s=gen_flops / (peak_flops * e.latency) + e.decode_step_s,
        completion_mean=mean,
        completion_p90=p90,
        acceptance=acceptance,
        reward_s=reward_s,
        train_token_s=train_flops / (peak_flops * e.train),
        train_fixed_s=e.train_fixed_s,
        weight_sync_s=engine_bytes / e.sync_bytes_per_s + e.sync_fixed_s,
        switch_s=engine_bytes / e.copy_bytes_per_s + e.wake_s,
        thread_scaling=thread_scaling[0] if thread_scaling else None,
        gen_thread_scaling=thread_scaling[1] if thread_scaling else None,
        collective_s=collective_s,
    )



def _median(rows: Sequence[Mapping[str, float]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if key in r]
    return statistics.median(values) if values else None


def calibrate(
    rows: Sequence[Mapping[str, float]],
    estimate: StageCosts,
    workload: Workload,
    *,
    gen_slots: int,
    train_slots: int,
    gen_processes: int = 0,
    train_ranks: int = 0,
) -> StageCosts:
    """``estimate`` corrected by the metrics ``rows`` of a run with ``workload`` whose
    generators (``gen_processes`` engines, 0: one per slot) computed on ``gen_slots`` slots
    and trainer ranks (``train_ranks``) on ``train_slots``."""
    if len(rows) > 1:
        rows = rows[1:]
    if not rows:
        return estimate
    costs = estimate
    lengths = [r["tokens_per_s"] / r["samples_per_s"] for r in rows if r.get("samples_per_s", 0.0) > 0]
    if lengths:
        mean = statistics.median(lengths)
        costs = replace(costs, completion_mean=mean, completion_p90=max(costs.completion_p90, mean))
    acceptance = rows[-1].get("buffer/acceptance_ema", 0.0)
    if 0 < acceptance <= 1:
        costs = replace(costs, acceptance=acceptance)
    sync = _median(rows, "time/weight_sync_s")
    if sync is not None:
        costs = replace(costs, weight_sync_s=sync)
    switch = _median(rows, "time/switch_s")  # runs that took turns (colocated, partial)
    if switch is not None:
        costs = replace(costs, switch_s=switch)
    gen, tail, train = stage_times(costs, workload, gen_slots=gen_slots, train_slots=train_slots,
                                   gen_processes=gen_processes, train_ranks=train_ranks)
    measured_train = _median(rows, "time/train_s")
    if measured_train is not None and measured_train > 0 and train > 0:
        f = measured_train / train
        costs = replace(costs, train_token_s=costs.train_token_s * f, train_fixed_s=costs.train_fixed_s * f)
    rollout = _median(rows, "time/wait_for_buffer_s")
    if workload.max_staleness == 0 and rollout is not None and rollout > 0 and gen + tail > 0:
        f = rollout / (gen + tail)
        costs = replace(costs, gen_token_s=costs.gen_token_s * f, gen_latency_s=costs.gen_latency_s * f)
    return costs
