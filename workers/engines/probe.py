"""``python -m workers.engines.probe``: what one engine costs on one step's batch, measured.

``generator.backend=auto`` (``launch.placement.engines``) runs this once per engine in a
process of its own: the engine starts and frees its memory (vLLM's KV cache) with it, no
OpenMP pool of the launcher's checks is forked into vLLM's engine core, and a GPU is
touched by the probe, not by the launcher. It reads a ``Probe`` as JSON on stdin and prints
the ``Measured`` costs as one JSON line on stdout::

    start_s     make_engine (weights loaded, vLLM's engine core up) + its first batch beyond the others (compilation)
    generate_s  the fastest of two batches after that one
    update_s    one weight update of every policy weight (the adapters' with LoRA), as the run's each step
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from protocols.messages import SamplingParams
from yatt.rl.config import GeneratorConfig, LoRAConfig


@dataclass(frozen=True, kw_only=True)
class Probe:
    """One engine on one step's batch (the run's own prompts and sampling)."""

    model_path: str
    generator: dict[str, Any]
    """``GeneratorConfig`` fields, ``backend`` naming the engine measured."""
    dtype: str
    """``model.dtype``."""
    device: str
    """cpu or cuda."""
    lora: dict[str, Any] | None = None
    """``LoRAConfig`` fields, when the run trains adapters."""
    prompts: list[list[int]] = field(default_factory=list)
    """A step's prompts' token ids, one group each."""
    n: int = 1
    """Samples per prompt (buffer.group_size)."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """``SamplingParams`` fields (the controller's)."""


@dataclass(frozen=True, kw_only=True)
class Measured:
    """One engine's costs on the probe's batch, in seconds."""

    start_s: float
    generate_s: float
    update_s: float


def measure(probe: Probe) -> Measured:
    """Start the engine, generate the batch three times (the first counts as start-up) and
    load one weight update."""
    import torch

    from workers.engines import PromptRequest, make_engine
    from workers.engines.base import resolve_dtype
    from workers.lora import is_adapter, with_lora
    from workers.models import load_model

    lora = LoRAConfig(**probe.lora) if probe.lora else None
    began = time.perf_counter()
    engine = make_engine(probe.model_path, GeneratorConfig(**probe.generator), device=probe.device,
                         dtype=probe.dtype, lora=lora)  # type: ignore[arg-type]
    try:
        sampling = SamplingParams(**probe.sampling)
        requests = [PromptRequest(prompt_ids=ids, n=probe.n, sampling=dataclasses.replace(sampling, seed=i))
                    for i, ids in enumerate(probe.prompts)]
        first = time.perf_counter()
        engine.generate(requests)
        built, warm = first - began, time.perf_counter() - first
        times = []
        for _ in range(2):
            t = time.perf_counter()
            engine.generate(requests)
            times.append(time.perf_counter() - t)
        model: Any = load_model(probe.model_path, dtype=resolve_dtype(probe.dtype, torch.device(probe.device)))
        if lora is not None:
            model = with_lora(model, lora)
        weights = [(name, p.detach()) for name, p in model.named_parameters() if lora is None or is_adapter(name)]
        if probe.device != "cpu":
            weights = [(name, w.to(probe.device)) for name, w in weights]
        t = time.perf_counter()
        engine.update_weights(weights)
        if probe.device != "cpu":
            torch.cuda.synchronize()
        update = time.perf_counter() - t
    finally:
        engine.close()
    generate = min(times)
    return Measured(start_s=built + max(0.0, warm - generate), generate_s=generate, update_s=update)


def main() -> None:
    probe = Probe(**json.loads(sys.stdin.read()))
    print(json.dumps(dataclasses.asdict(measure(probe))), flush=True)


if __name__ == "__main__":
    main()
