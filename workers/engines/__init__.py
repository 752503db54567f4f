"""Inference engines behind the generator worker, chosen by ``GeneratorConfig.backend``.

``make_engine`` is the one place that picks a backend; it imports the chosen engine's
module only when asked, so a transformers-only process never imports vLLM.
"""

from __future__ import annotations

from workers.engines.base import DType, Engine, PromptRequest, Sample
from yatt.errors import ConfigError
from yatt.rl.config import GeneratorConfig, LoRAConfig

__all__ = ["Engine", "PromptRequest", "Sample", "make_engine"]


def make_engine(
    model_path: str, config: GeneratorConfig, *, device: str = "cpu", dtype: DType = "auto", lora: LoRAConfig | None = None
) -> Engine:
    """Start the engine ``config.backend`` names on ``model_path`` (a local HF directory).

    ``device`` is "cpu" or "cuda[:i]" (vLLM takes the process's visible GPU); ``dtype`` is
    ``ModelConfig.dtype`` (auto: bfloat16 on GPU and on a CPU with native bf16, else float32);
    ``lora``: the trainer's adapters (``ModelConfig.lora``); updates then carry only them.
    """
    if config.backend in ("transformers", "auto"):  # (auto: a run's launcher resolves it; used alone, the portable engine)
        from workers.engines.hf import HFEngine

        return HFEngine(model_path, config, device=device, dtype=dtype, lora=lora)
    if config.backend == "vllm":
        from workers.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, config, device=device, dtype=dtype, lora=lora)
    raise ConfigError(f"generator.backend must be 'auto', 'transformers' or 'vllm' (got {config.backend!r})")
