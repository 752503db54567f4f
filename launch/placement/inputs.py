"""The planner's inputs, gathered from the world, and the run's plan.

The planner (``yatt.placement.planner``) is pure; this module gathers its inputs: this machine's slots and memory, the bf16 (or float32) matmul peak of one slot, the
model's sizes from its config.json (no weights are loaded), and measured costs from a run's
``metrics.jsonl``. The launcher calls ``make_plan`` for ``placement.layout`` (``auto``
runs the planner; an explicit layout is placed and predicted); ``python -m launch plan``
(``launch.placement.command``) prints the candidates.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from launch.config import RunConfig, load_run_config
from yatt.errors import ConfigError, LayoutError
from yatt.placement.costs import calibrate, estimate_costs, hf_param_count, model_sizes
from yatt.placement.layouts import Roles, cpu_cluster, gpu_cluster, slot_share
from yatt.placement.plan import ClusterSpec, Plan
from yatt.placement.planner import (
    ModelSizes,
    StageCosts,
    Workload,
    candidates,
    choose,
    finish,
)
from yatt.runtime import run_dir as names
from yatt.runtime.cache import smollm2_dir
from yatt.runtime.dtypes import compute_dtype_name
from yatt.runtime.run_dir import read_jsonl

TINY_CONFIG: dict[str, object] = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "head_dim": 32, "intermediate_size": 128, "vocab_size": 512, "tie_word_embeddings": False,
}  # fmt: skip
"""The shape of the tiny default model (``workers.models.build_tiny_model``'s defaults)."""

SMOLLM2_CONFIG: dict[str, object] = {
    "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
}  # fmt: skip
"""The shape of SmolLM2-135M-Instruct (``builtin:smollm2``), used before it is exported."""

TINY_VLM = "builtin:tiny-vlm"
"""model.path of the tiny vision-language model (``workers.models.build_tiny_vlm``), built in the run dir."""

TINY_VLM_CONFIG: dict[str, object] = {
    "model_type": "llava", "text_config": {**TINY_CONFIG, "model_type": "llama", "vocab_size": 513},
    "vision_config": {"hidden_size": 32, "num_hidden_layers": 2, "image_size": 56, "patch_size": 14},
}  # fmt: skip
"""The shape of ``builtin:tiny-vlm``, before it is built."""

BUILTIN_TINY = "builtin:tiny"
"""A reward_model or judge scorer's model_path for a tiny untrained model built in the run dir."""

FILTERED_ACCEPTANCE = 0.5
"""Acceptance rate assumed for a filtering buffer until a run measures it."""


def measure_peak_flops(*, device: str = "cpu", dtype: str = "bfloat16", threads: int = 1,
                       size: int | None = None, seconds: float = 0.3) -> float:
    """FLOP/s of a ``size`` x ``size`` matmul in ``dtype`` on ``device`` (``threads`` CPU
    threads), repeated for about ``seconds`` after one warm-up. ``size`` None: 1024 on a CPU,
    8192 on a GPU, where a smaller product measures its launch and synchronisation (an H200:
    74-79 TFLOP/s in bf16 at 1024, 642-649 at 8192)."""
    size = size or (8192 if device.startswith("cuda") else 1024)
    return _matmul_flops((size, size, size), device=device, dtype=dtype, threads=threads, seconds=seconds)


def _matmul_flops(shape: tuple[int, int, int], *, device: str, dtype: str, threads: int, seconds: float) -> float:
    """FLOP/s of an [m, k] x [k, n] matmul, repeated for about ``seconds`` after one warm-up."""
    import torch

    m, k, n = shape
    cuda = device.startswith("cuda")
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        dt = getattr(torch, dtype)
        a = torch.randn(m, k, device=device).to(dt)
        b = torch.randn(k, n, device=device).to(dt)
        a @ b
        if cuda:
            torch.cuda.synchronize(device)
        count, start = 0, time.perf_counter()
        while True:
            a @ b
            count += 1
            if cuda:
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                return 2.0 * m * k * n * count / elapsed
    finally:
        torch.set_num_threads(previous)


def measure_thread_scaling(config: dict[str, Any], rows: int, length: int, decoding: int, cores: int,
                           dtype: str = "bfloat16", seconds: float = 0.2) -> tuple[float, float]:
    """Scaling efficiency of one process's ``cores`` threads (each added core adds this share
    of one, in [0, 1]) in training and in generation: a forward and backward of one decoder
    layer of the model of ``config`` (built from it, random weights, a 256-token vocabulary)
    over ``rows`` x ``length`` tokens, and a forward of ``decoding`` sequences' next token, in
    ``dtype``. A small model's many small operations, which threads barely speed up, say so,
    as a big model's matmuls say the opposite. 1 and ``cores`` threads in turn, twice each,
    the faster of each kept."""
    if cores <= 1:
        return 1.0, 1.0
    return _thread_scaling_of(json.dumps(config, sort_keys=True), rows, length, decoding, cores, dtype, seconds)


@functools.lru_cache(maxsize=8)
def _thread_scaling_of(config_json: str, rows: int, length: int, decoding: int, cores: int, dtype: str,
                       seconds: float) -> tuple[float, float]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads(config_json)
    config = config.get("text_config") or config  # a vision-language model: its language model
    config.pop("architectures", None)
    shape = AutoConfig.for_model(**{**config, "num_hidden_layers": 1, "vocab_size": 256,
                                    "model_type": config.get("model_type", "llama")})
    previous = torch.get_num_threads()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(shape).to(getattr(torch, dtype))  # type: ignore[no-untyped-call]
    ids = torch.randint(0, 256, (max(1, rows), max(2, length)))
    next_tokens = torch.randint(0, 256, (max(1, decoding), 1))

    def train() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    def decode() -> None:
        with torch.no_grad():
            model(input_ids=next_tokens, use_cache=False)

    def scaling(work: Callable[[], None]) -> float:
        def rate(threads: int) -> float:
            torch.set_num_threads(threads)
            work()  # warm-up
            count, start = 0, time.perf_counter()
            while count == 0 or time.perf_counter() - start < seconds:
                work()
                count += 1
            return count / (time.perf_counter() - start)

        one = many = 0.0
        for _ in range(2):
            one, many = max(one, rate(1)), max(many, rate(cores))
        return min(1.0, max(0.0, (many / one - 1.0) / (cores - 1)))

    try:
        return scaling(train), scaling(decode)
    finally:
        torch.set_num_threads(previous)


def compute_dtype(dtype: str, kind: str) -> str:
    """The dtype ``model.dtype`` computes in on slots of ``kind``, as the trainer and engines
    resolve it (``workers.engines.base.resolve_dtype``)."""
    return compute_dtype_name(dtype, "cuda" if kind == "gpu" else "cpu")


def machine_memory() -> int:
    """This machine's memory: MemTotal of /proc/meminfo, else the page count."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def this_machine(*, peak_flops: float | None = None, dtype: str = "auto", cpu_slots: int = 0) -> ClusterSpec:
    """The slots of this machine: one per GPU when torch sees any, else one per core of this
    process's affinity (or ``cpu_slots`` sharing them, placement.cpu_slots); ``peak_flops``
    None measures one slot's in ``dtype`` (model.dtype)."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    if torch.cuda.is_available():
        memory = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
        cluster = gpu_cluster(memory, cores)
    else:
        cluster = cpu_cluster(cores, machine_memory(), slots=cpu_slots)
    return with_peak(cluster, dtype) if peak_flops is None else replace(cluster, peak_flops=peak_flops)


def with_peak(cluster: ClusterSpec, dtype: str = "auto") -> ClusterSpec:
    """``cluster`` with one slot's matmul peak measured (in ``dtype`` resolved for its kind)."""
    slot = cluster.slots[0]
    dt = compute_dtype(dtype, slot.kind)
    if slot.kind == "gpu":
        return replace(cluster, peak_flops=measure_peak_flops(device=slot.device, dtype=dt))
    peak = measure_peak_flops(dtype=dt, threads=max(1, len(slot.cores)))
    return replace(cluster, peak_flops=peak * slot_share(cluster))


def _read_config_json(path: str, what: str) -> dict[str, Any]:
    file = Path(path) / "config.json"
    try:
        loaded = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{what} {path!r}: cannot read its config.json ({e}); give a Hugging Face model directory") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{what} {path!r}: config.json must hold an object")
    return loaded


def model_config(cfg: RunConfig) -> dict[str, Any]:
    """The policy's config.json as a dict, without building or loading the model."""
    if cfg.model.path == "":
        return dict(TINY_CONFIG)
    if cfg.model.path == TINY_VLM:
        return dict(TINY_VLM_CONFIG)
    if cfg.model.path == "builtin:smollm2":
        exported = smollm2_dir()
        return _read_config_json(str(exported), "model.path") if (exported / "config.json").exists() else dict(SMOLLM2_CONFIG)
    return _read_config_json(cfg.model.path, "model.path")


def run_sizes(cfg: RunConfig, kind: str) -> ModelSizes:
    """What the run's models weigh: the policy, a reference when the KL term is on, a critic
    for GAE, and a reward model or judge when a scorer runs one."""
    dtype = compute_dtype(cfg.model.dtype, kind)
    reward_params = sum(
        hf_param_count(TINY_CONFIG if s.model_path == BUILTIN_TINY else _read_config_json(s.model_path, f"reward.scorers[{i}].model_path"))
        for i, s in enumerate(cfg.reward.scorers) if s.kind in ("reward_model", "judge")
    )
    return model_sizes(
        model_config(cfg),
        weight_bytes=4 if dtype == "float32" else 2,
        reference=cfg.algorithm.kl_coef > 0,
        critic=cfg.algorithm.advantage == "gae",
        reward_params=reward_params,
        activation_checkpointing=cfg.trainer.activation_checkpointing,
    )


def run_workload(cfg: RunConfig, kind: str, prompt_tokens: float | None = None) -> Workload:
    """One step of the run on slots of ``kind``, from its buffer, controller and generator
    configs; ``prompt_tokens``: the prompt set's mean length, when read (else 64)."""
    vllm_gpu = cfg.generator.backend == "vllm" and kind == "gpu"
    return Workload(
        prompt_tokens=64.0 if prompt_tokens is None else prompt_tokens,
        prompt_shared_by=cfg.buffer.group_size if cfg.trainer.share_prompt is not False else 1,
        groups_per_step=cfg.buffer.groups_per_step,
        group_size=cfg.buffer.group_size,
        max_staleness=cfg.buffer.max_staleness,
        max_new_tokens=cfg.controller.max_new_tokens,
        micro_batches_per_step=cfg.buffer.micro_batches_per_step,
        max_batch_sequences=cfg.generator.max_batch_prompts * cfg.buffer.group_size,
        engine_reserve_share=cfg.generator.vllm_gpu_memory_utilization if vllm_gpu else 0.0,
    )


def run_costs(cfg: RunConfig, cluster: ClusterSpec, measured: Path | None = None,
              prompt_tokens: float | None = None) -> StageCosts:
    """The run's stage costs: estimated from FLOPs at the cluster's peak, then calibrated by
    the metrics of the run in ``measured`` (a run dir) when given."""
    kind = cluster.slots[0].kind
    sizes = run_sizes(cfg, kind)
    acceptance = FILTERED_ACCEPTANCE if cfg.buffer.filter != "none" or cfg.buffer.custom_filter else 1.0
    workload = run_workload(cfg, kind, prompt_tokens)
    costs = estimate_costs(sizes=sizes, workload=workload, kind=kind, peak_flops=cluster.peak_flops,
                           acceptance=acceptance, thread_scaling=_thread_scaling(cfg, cluster, workload))
    if measured is None:
        return costs
    metrics, config = measured / names.METRICS, measured / names.CONFIG
    if not metrics.is_file() or not config.is_file():
        raise ConfigError(f"--from {measured}: not a run dir (it needs metrics.jsonl and config.yaml)")
    rows = read_jsonl(metrics)
    try:
        past = load_run_config(config)
    except ConfigError as e:
        raise ConfigError(f"--from {measured}: its config.yaml does not load in this version of yatt ({e})") from None
    gen_slots, train_slots, engines, ranks = _measured_slots(measured, past, len(cluster.slots))
    return calibrate(rows, costs, run_workload(past, kind), gen_slots=gen_slots, train_slots=train_slots,
                     gen_processes=engines, train_ranks=ranks)


def _thread_scaling(cfg: RunConfig, cluster: ClusterSpec, workload: Workload) -> tuple[float, float] | None:
    """One process's thread scaling over this CPU machine's cores in training and generation,
    measured on one decoder layer of the model (one rank's micro-batch; a step's samples
    decoding), where the plan picks the rank count (trainer.world_size 0); None otherwise (a
    GPU, one core, or ranks fixed by the config)."""
    cores = len({c for s in cluster.slots for c in s.cores})
    if cfg.trainer.world_size != 0 or cluster.slots[0].kind != "cpu" or cores <= 1:
        return None
    samples = workload.groups_per_step * workload.group_size
    rows = samples // max(1, workload.micro_batches_per_step)
    length = int(workload.prompt_tokens + 0.6 * workload.max_new_tokens)
    return measure_thread_scaling(model_config(cfg), rows, length, min(samples, workload.max_batch_sequences), cores,
                                  compute_dtype(cfg.model.dtype, "cpu"))


def _measured_slots(run_dir: Path, past: RunConfig, n: int) -> tuple[int, int, int, int]:
    """Slots the generators and the trainer ranks of a past run computed on, and how many of
    each there were: from its ``plan.json`` when it has one, else (a run without a plan)
    their threads on ``n`` cores."""
    path = run_dir / names.PLAN
    if path.is_file():
        assignments = json.loads(path.read_text())["assignments"]
        trainers = [a for a in assignments if a["role"] == "trainer"]
        generators = [a for a in trainers if a["hosts_generator"]] or [a for a in assignments if a["role"] == "generator"]

        def slots(group: list[dict[str, Any]]) -> int:
            return n if any(not a["slots"] for a in group) else len({s for a in group for s in a["slots"]})

        return slots(generators), slots(trainers), len(generators), len(trainers)
    gens, ranks = past.run.num_generators, past.trainer.world_size
    return (min(n, gens * (past.generator.threads or max(1, n // gens))),
            min(n, ranks * (past.trainer.threads or max(1, n // ranks))), gens, ranks)


def plan_for_run(
    cfg: RunConfig, cluster: ClusterSpec, costs: StageCosts | None = None, layout: str | None = None,
    prompt_tokens: float | None = None,
) -> Plan:
    """The run's plan for ``layout`` (None: the config's placement.layout, auto when it has
    none): ``auto`` picks the layout with the lowest predicted step time; an explicit layout is
    placed with the config's role counts and predicted. ``costs`` None: estimated from FLOPs
    (measuring the cluster's peak if it has none). Raises ``ConfigError`` when the layout
    cannot be placed or does not fit in memory."""
    if costs is None:
        if cluster.peak_flops <= 0:
            cluster = with_peak(cluster, cfg.model.dtype)
        costs = run_costs(cfg, cluster, prompt_tokens=prompt_tokens)
    if layout is None:
        layout = str(getattr(getattr(cfg, "placement", None), "layout", "auto"))
    kind = cluster.slots[0].kind
    sizes, workload, roles = run_sizes(cfg, kind), run_workload(cfg, kind, prompt_tokens), roles_of(cfg)
    if layout == "auto":
        return choose(cluster, sizes, costs, workload, roles)
    for c in candidates(cluster, sizes, costs, workload, roles):
        if c.layout == layout:
            if c.refused:
                raise ConfigError(f"placement.layout={layout}: {c.refused}; choose another layout or auto")
            return finish(c)
    raise ConfigError(f"placement.layout must be auto, colocated, partial or disaggregated (got {layout!r})")


def roles_of(cfg: RunConfig) -> Roles:
    """How many processes of each role the config asks for."""
    return Roles(
        trainers=cfg.trainer.world_size,
        generators=cfg.run.num_generators,
        rewards=cfg.run.num_rewards,
        controllers=cfg.controller.num_controllers,
        envs=cfg.env.env_workers,
        reward_engines=any(s.kind in ("reward_model", "judge") for s in cfg.reward.scorers),
        tensor_parallel=cfg.generator.tensor_parallel,
    )


def make_plan(cfg: RunConfig, cluster: ClusterSpec, prompt_tokens: float | None = None) -> Plan:
    """The plan of ``cfg.placement.layout`` on ``cluster`` with its predicted step time:
    ``auto`` is the planner's pick; an explicit layout is placed as asked (``ConfigError``
    when it cannot be, or does not fit in memory). ``prompt_tokens``: the prompt set's mean length."""
    try:
        return plan_for_run(cfg, cluster, prompt_tokens=prompt_tokens)
    except LayoutError as e:
        raise ConfigError(f"placement.layout={cfg.placement.layout}: {e}") from None
