"""LoRA adapters (peft) on a transformers model, the same way in the trainer and the engines.

The trainer wraps its policy before FSDP2 shards it and trains only the adapters; a
generator's transformers engine wraps its model the same way, so the two share parameter
names (``base_model.model.<HF name>``, adapters under ``.lora_A.default`` and
``.lora_B.default``) and a weight update carries only the adapters. Fresh adapters change
nothing (peft starts ``lora_B`` at zero), so an engine that has not had an update yet
generates with the base model, as the trainer's version 0 is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transformers import PreTrainedModel

from yatt.errors import ConfigError
from yatt.rl.config import LoRAConfig

if TYPE_CHECKING:
    from peft import LoraConfig


VISION_MODULES = r".*\.(vision_tower|visual|vision_model)\..*"
"""A vision-language model's image encoder's modules (LLaVA's ``vision_tower``, Qwen2-VL's
``visual``): LoRA leaves them out, as it adapts the language model only."""


def peft_config(config: LoRAConfig, *, vision_language: bool = False) -> LoraConfig:
    """peft's ``LoraConfig`` of ``config``: what the trainer wraps with and what an adapter
    directory's ``adapter_config.json`` holds. ``vision_language``: the model has a vision
    tower, whose layers (CLIP's q_proj, ...) get no adapters."""
    from peft import LoraConfig

    return LoraConfig(
        r=config.rank, lora_alpha=config.alpha, target_modules=list(config.target_modules), lora_dropout=0.0, bias="none",
        exclude_modules=VISION_MODULES if vision_language else None,
    )  # fmt: skip


def with_lora(model: PreTrainedModel, config: LoRAConfig) -> Any:
    """``model`` wrapped in peft's LoRA of ``config`` (a ``PeftModelForCausalLM``); a
    vision-language model's language model only."""
    from peft import get_peft_model

    from workers.models import is_vision_language

    try:
        return get_peft_model(model, peft_config(config, vision_language=is_vision_language(model.config)))
    except ValueError as e:
        raise ConfigError(f"model.lora.target_modules = {config.target_modules}: {e}") from None


def is_adapter(name: str) -> bool:
    """Whether a parameter of a wrapped model is a LoRA adapter's (what trains and is sent)."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_file_name(name: str) -> str:
    """The name peft saves an adapter tensor under (``save_pretrained``): the adapter's
    name (``.default``) dropped, e.g. ``...q_proj.lora_A.default.weight`` ->
    ``...q_proj.lora_A.weight``; vLLM loads adapters by these names."""
    return name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
