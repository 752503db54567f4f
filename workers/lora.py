"""LoRA adapters (peft) on a transformers model, the same way in the trainer and the engines.

The trainer wraps its policy before FSDP2 shards it and trains only the adapters; a
generator's transformers engine wraps its model the same way, so the two share parameter
names (``base_model.model.<HF name>``, adapters under ``.lora_A.default`` and
``.lora_B.default``) and a weight update carries only the adapters. Fresh adapters change
nothing (peft starts ``lora_B`` at zero), so an engine that has not had an update yet
generates with the base model, as the trainer's version 0 is.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel

from yatt.config import LoRAConfig
from yatt.errors import ConfigError


def with_lora(model: PreTrainedModel, config: LoRAConfig) -> Any:
    """``model`` wrapped in peft's LoRA of ``config`` (a ``PeftModelForCausalLM``)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.rank, lora_alpha=config.alpha, target_modules=list(config.target_modules), lora_dropout=0.0, bias="none"
    )
    try:
        return get_peft_model(model, lora)
    except ValueError as e:
        raise ConfigError(f"model.lora.target_modules = {config.target_modules}: {e}") from None


def is_adapter(name: str) -> bool:
    """Whether a parameter of a wrapped model is a LoRA adapter's (what trains and is sent)."""
    return ".lora_A." in name or ".lora_B." in name
