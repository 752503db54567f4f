"""The FSDP2 trainer: one ``Trainer`` per torch.distributed rank, driven by method calls.

Why it exists: the policy (and the reference model and critic when the algorithm needs
them) must be sharded over the trainer ranks, trained on micro-batches that stream in from
the buffer before the step's batch is complete, checkpointed, and published to the
generators, without ever holding the whole model on one rank. One step::

    accumulate(mb_0) ... accumulate(mb_{count-1})   forward, loss SUM, backward (grads add up;
          |                                          FSDP2 reduce-scatters them with SUM, not mean)
    reduce_gradients()     all-reduce the step's loss count (tokens or sequences) over every
          |                rank and micro-batch; divide every gradient by it
    finish_step()          clip, AdamW step, LR schedule step, zero grads -> metrics
          |
    weight_buckets(v)      gather full tensors parameter by parameter -> WeightUpdate buckets

``train_step(micro_batches)`` runs the three for an iterable. The division by the global
count after the last backward makes the result equal to the full-batch token mean (or
sequence mean) for any number of ranks and micro-batches (see ``yatt.rl.rl_math``).

Several updates per batch. With ``trainer.mini_batches`` > 1, ``algorithm.ppo_epochs`` > 1
or a batch-wide estimator (reinforce_pp, reinforce_pp_baseline, gae), ``train_step`` holds
the step's micro-batches instead::

    collect every micro-batch of the step (checked as above)
    prepare: no-grad forwards with the weights that start the batch -> old log-probs
             (or the rollout engine's, ``algorithm.old_logprobs: rollout``), reference
             log-probs, critic values; token advantages; whitening over the whole batch
             with moments all-reduced over every rank
    for each epoch, for each of ``mini_batches`` equal runs of micro-batches:
        accumulate each (as above), reduce, clip, AdamW step      -> one optimizer step
    LR schedule step, adaptive KL update                          -> one run step

What streaming gives up: the whole batch is needed before the first backward, so the
step cannot overlap the buffer's delivery of its last micro-batches, and every
micro-batch is forwarded once more (no grad) for the old log-probs. With one update per
batch and a per-group estimator nothing needs the whole batch: the old log-probs are the
current ones (ratio 1 exactly), and micro-batches stream as they arrive.

Counting: ``step`` is the run step and the policy version (one ``train_step``, one
version); ``optimizer_steps`` counts AdamW updates. The LR schedule advances once per run
step, as verl's does (``trainer.warmup_steps`` and ``total_steps`` count run steps).

Requirement: every rank must call ``accumulate`` the same number of times per step (the
buffer gives every rank ``count`` micro-batches). FSDP2 runs collectives in every forward
and backward, so a rank with fewer micro-batches leaves the others waiting in a collective
until the process group's timeout. At the first micro-batch of a step the ranks agree (one
small all-reduce) that every rank's micro-batch is valid and announces the same ``count``,
else all of them raise ``ProtocolError``; a rank whose stream then ends early or runs long
raises on its own (the others wait in FSDP's next collective until the timeout).

Conventions:
- Old log-probs: those of the weights that start the batch (streaming: the current ones,
  detached), or the rollout engine's; ``algorithm.importance_sampling`` weights each token
  by old (rollout mode: current) over rollout probability, truncated or masked; masked
  tokens leave the loss and its count (verl's rejection).
- Advantages (``rl_math.token_advantages``): for ``gae`` and ``reinforce_pp`` the
  ``advantages`` field carries each sequence's reward, read at its last completion token;
  with ``kl_in_reward`` the KL (``kl_in_reward_estimator``, old vs reference log-probs)
  enters as a per-token reward. reinforce_pp, reinforce_pp_baseline and gae advantages are
  whitened over the whole batch, as in verl.
- Parameters are kept in float32 (master weights); ``model.dtype`` is the compute dtype
  (FSDP2 mixed precision): auto is bfloat16 on GPU and on CPUs with native bf16
  (``workers.engines.base.resolve_dtype``), else float32. Exports and weight
  buckets are in the compute dtype, which is what the generators run.
- Models stay in eval mode (no dropout), as in inference, so trainer and generator
  log-probs agree; activation checkpointing wraps each decoder layer instead of using the
  Hugging Face switch that only works in training mode.
- Padding: with ``trainer.pack`` every forward (policy, reference, critic) reads a
  micro-batch as one row of its real tokens, position ids restarting per sequence
  (``workers.packing``), and its per-token results come back [B, T]: the log-probs, losses
  and counts are the padded computation's. The ``pad_share`` metric is the share of the
  step's [B, T] positions that are padding, packed or not.
- A group's prompt: with ``trainer.share_prompt`` (auto: where the estimated FLOPs are
  fewer) the rows of a micro-batch that share a prompt run as one row, the prompt once and
  each row's remainder after it (``workers.packing.share_prompts``, a prepared 4D mask);
  the same per-token results come back [B, T], and autograd sums the rows' gradients into
  the one prompt. ``prompt_tokens_saved`` counts the prompt tokens not computed again.
- On GPU each process must ``torch.cuda.set_device(local_rank)`` before ``Trainer(...)``.
"""

from __future__ import annotations

import dataclasses
import math
import random
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (  # private, torch pinned: traced (run.trace)
    DefaultAllGather,
    DefaultReduceScatter,
)
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForTokenClassification,
    AutoProcessor,
    AutoTokenizer,
    PreTrainedModel,
)

from protocols.messages import MicroBatch, WeightUpdate
from workers.engines.base import resolve_dtype
from workers.lora import is_adapter, with_lora
from workers.models import ImageTokens, is_vision_language, load_model
from workers.packing import Layout, forward_flops, pack, padding_problem, plan, share_prompts, unpack
from yatt.errors import ConfigError, ProtocolError, YattError, storage_error
from yatt.rl import rl_math
from yatt.rl.config import AlgorithmConfig, ModelConfig, TrainerConfig
from yatt.runtime import trace

# The step's local sums, all-reduced together in one collective by reduce_gradients.
_SUMS = (
    "loss count tokens clip_frac approx_kl kl entropy is_weight is_weight_sq is_masked logprob_diff "
    "value_loss value sequences padding positions prompt_saved"
).split()
# Checkpoint entries that older checkpoints (or another kl_controller) may lack.
_OPTIONAL_STATE = ("optimizer_steps", "kl_coef")


class Trainer:
    """The policy's FSDP2 shard on this rank, its optimizer, and the step's accumulators."""

    def __init__(
        self,
        model: ModelConfig,
        trainer: TrainerConfig,
        algorithm: AlgorithmConfig,
        *,
        model_path: str,
        run_steps: int = 0,
        temperature: float = 1.0,
    ) -> None:
        """``model_path``: the resolved local HF directory; ``run_steps``: the run's length,
        the schedule's horizon when ``trainer.total_steps`` is 0; ``temperature``: the
        rollouts' sampling temperature (controller.temperature; 0, greedy, counts as 1): the
        trainer's log-probs use softmax(logits / temperature), as the generator's do."""
        if not dist.is_initialized():
            raise YattError("Trainer needs torch.distributed initialised first (gloo on CPU, nccl on GPU)")
        if not (Path(model_path) / "config.json").exists():
            raise ConfigError(
                f"model.path {model_path!r} is not a Hugging Face model directory (no config.json)"
            )
        if temperature < 0:
            raise ConfigError(f"controller.temperature must be >= 0 (got {temperature})")
        self._config, self._algo, self.model_path = trainer, algorithm, model_path
        self._temperature = temperature or 1.0
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = _device()
        self._mesh: DeviceMesh = init_device_mesh(self.device.type, (self.world_size,))
        self.compute_dtype = resolve_dtype(model.dtype, self.device)
        self._mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        total = trainer.total_steps or run_steps
        if trainer.schedule != "constant" and total <= trainer.warmup_steps:
            raise ConfigError(
                f"trainer.total_steps must exceed warmup_steps={trainer.warmup_steps} for schedule "
                f"{trainer.schedule} (got {total}); set trainer.total_steps or the run's number of steps"
            )
        # The same seed on every rank: each rank builds the full model before sharding it,
        # and freshly initialised weights (the critic's head) must agree across ranks.
        torch.manual_seed(trainer.seed)
        random.seed(trainer.seed)
        self._lora = model.lora if model.lora.rank else None
        policy = _load(load_model, model_path)
        self._images = ImageTokens(policy, self.device)  # a VLM's image tokens, which engines never sample
        self.vision = self._images.vision
        if self.vision and algorithm.advantage == "gae":
            raise ConfigError(
                "algorithm.advantage=gae needs a critic (a token-classification head), which transformers has "
                f"for no vision-language model ({type(policy).__name__}); use grpo, rloo or reinforce_pp"
            )
        attention = str(getattr(policy.config, "_attn_implementation", ""))
        if trainer.share_prompt is True and attention not in ("sdpa", "eager"):
            raise ConfigError(
                f"trainer.share_prompt needs sdpa or eager attention (the model runs {attention}, whose "
                "kernels take no prepared 4D mask); set trainer.share_prompt=auto or false"
            )
        self._config = dataclasses.replace(trainer, share_prompt=False) if attention not in ("sdpa", "eager") else trainer
        text = policy.config.get_text_config()
        # A forward's FLOPs, per position and per (query, key) pair: what share_prompt=auto weighs.
        self._flops_model = (
            float(sum(p.numel() for p in policy.parameters())),
            float(text.num_hidden_layers * text.hidden_size),
        )
        self.policy = self._shard(with_lora(policy, self._lora) if self._lora else policy, trainable=True, peft=bool(self._lora))
        if self._lora:  # only the adapters train (and are sent, and hold optimizer state)
            for name, param in self.policy.named_parameters():
                param.requires_grad_(is_adapter(name))
        if self.vision and not model.train_vision:  # (the projector into the language model trains)
            for param in _vision_tower(self.policy).parameters():
                param.requires_grad_(False)
        self.reference = (
            self._shard(_load(load_model, model_path), trainable=False)
            if algorithm.kl_coef > 0
            else None
        )
        self.critic = (
            self._shard(
                _load(AutoModelForTokenClassification.from_pretrained, model_path, num_labels=1),
                trainable=True,
            )
            if algorithm.advantage == "gae"
            else None
        )
        # What an optimizer trains (and a checkpoint holds): name -> (module, AdamW, schedule).
        self._trained = {"policy": (self.policy, *self._optimizer(self.policy, trainer.lr, total))}
        if self.critic is not None:
            self._trained["critic"] = (self.critic, *self._optimizer(self.critic, trainer.critic_lr, total))
        self._loss_fn = rl_math.get_policy_loss(algorithm.policy_loss)
        self._loss_params = rl_math.LossParams(
            **{f.name: getattr(algorithm, f.name) for f in dataclasses.fields(rl_math.LossParams)}
        )
        self._kl = (
            rl_math.AdaptiveKLController(algorithm.kl_coef, target=algorithm.kl_target, horizon=algorithm.kl_horizon)
            if algorithm.kl_controller == "adaptive"
            else None
        )
        self._holds_batch = trainer.mini_batches > 1 or algorithm.ppo_epochs > 1 or algorithm.batch_wide
        # Background checkpoint writes run their collectives on a group of their own, so
        # they never interleave with the training step's (gloo: a CPU group on GPU too).
        self._checkpoint_group = dist.new_group(backend="gloo")
        self._writing: Future[None] | None = None  # the background save in flight
        self._step = 0
        self._gathered = False  # gather_policy: full weights resident for the colocated engine
        self._optimizer_steps = 0
        self._begin_step()

    # ------------------------------------------------------------------ setup

    def _shard(self, module: PreTrainedModel, *, trainable: bool, peft: bool = False) -> PreTrainedModel:
        """fully_shard each decoder layer, then the root; gradients summed, not averaged.
        ``peft``: the root is the transformers model inside peft's wrapper, whose forward is
        what both training (through the wrapper) and a colocated engine's generate() run."""
        root = cast(PreTrainedModel, cast(Any, module).get_base_model()) if peft else module
        layers = _decoder_layers(root)
        if self._config.activation_checkpointing and trainable:
            for i, layer in enumerate(layers):
                layers[i] = checkpoint_wrapper(layer)
        for layer in layers:
            fully_shard(layer, mesh=self._mesh, mp_policy=self._mp)
        fully_shard(root, mesh=self._mesh, mp_policy=self._mp)
        for m in module.modules():
            if isinstance(m, FSDPModule):
                # Token sums are divided by the global count later; FSDP's default mean over
                # ranks would divide them by the world size on top. Plain SUM works on gloo.
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)
                if trace.enabled():  # run.trace: FSDP2's own collectives become spans too
                    m.set_custom_all_gather(_TracedAllGather())
                    m.set_custom_reduce_scatter(_TracedReduceScatter())
        nn.Module.train(module, False)  # eval mode for good: no dropout, as in inference
        module.requires_grad_(trainable)
        return module

    def _optimizer(self, module: nn.Module, lr: float, total: int) -> tuple[torch.optim.AdamW, LambdaLR]:
        """AdamW over the module's (sharded) parameters and its warmup + decay schedule."""
        c = self._config
        optimizer = torch.optim.AdamW(
            [p for p in module.parameters() if p.requires_grad], lr=lr, betas=(c.betas[0], c.betas[1]), weight_decay=c.weight_decay
        )
        return optimizer, LambdaLR(optimizer, _schedule(c.schedule, c.warmup_steps, total))

    def _begin_step(self) -> None:
        self._received = 0  # micro-batches accepted this step
        self._count = 0  # micro-batches announced for this step
        self._fwd_bwd_s = 0.0
        self._begin_update()

    def _begin_update(self) -> None:
        self._sums = {k: torch.zeros((), dtype=torch.float64, device=self.device) for k in _SUMS}
        self._reduced: dict[str, float] | None = None  # global sums, once reduce_gradients ran

    @property
    def kl_coef(self) -> float:
        """The KL coefficient now (moves with ``algorithm.kl_controller: adaptive``)."""
        return self._kl.value if self._kl is not None else self._algo.kl_coef

    @property
    def step(self) -> int:
        """Run steps taken (``train_step`` calls): the policy version of the current weights."""
        return self._step

    @property
    def optimizer_steps(self) -> int:
        """AdamW updates applied: ``trainer.mini_batches * algorithm.ppo_epochs`` per run step."""
        return self._optimizer_steps

    # ------------------------------------------------------------------ training

    def train_step(self, micro_batches: Iterable[MicroBatch]) -> dict[str, float]:
        """One run step on this rank's micro-batches of the step; returns its metrics.

        Streams them into one optimizer step, or holds them for several (module docstring).
        """
        if self._gathered:
            raise YattError("the policy is gathered for generation; call release_policy() before training")
        if not self._holds_batch:
            for mb in micro_batches:
                self.accumulate(mb)
            return self.finish_step()
        return self._train_held(micro_batches)

    def accumulate(self, mb: MicroBatch) -> None:
        """Forward and backward one micro-batch, adding its loss SUM's gradients (streaming)."""
        if self._gathered:
            raise YattError("the policy is gathered for generation; call release_policy() before training")
        if self._holds_batch:
            raise YattError(
                "accumulate streams one update per batch; with trainer.mini_batches > 1, "
                "algorithm.ppo_epochs > 1 or a batch-wide advantage, call train_step"
            )
        with trace.span("forward_backward"):
            self._check(mb)
            self._received += 1
            self._forward_backward(self._inputs(mb))

    def _inputs(self, mb: MicroBatch) -> _Batch:
        """The micro-batch on this device; advantages as they arrived (streaming finishes them)."""
        attention = mb.attention_mask.to(self.device, torch.bool)  # [B, T]
        return _Batch(
            ids=mb.input_ids.to(self.device, torch.int64),  # [B, T]
            attention=attention,
            mask=mb.loss_mask.to(self.device, torch.bool) & attention,  # [B, T]
            rollout=mb.rollout_logprobs.to(self.device, torch.float32),  # [B, T]
            advantages=mb.advantages.to(self.device, torch.float32),  # [B, T]
            mm=self._mm_inputs(mb.mm_inputs),
        )

    def _mm_inputs(self, mm: dict[str, Tensor]) -> dict[str, Tensor]:
        """A micro-batch's images (``MicroBatch.mm_inputs``) on this device, for the model's forward."""
        if mm and not self.vision:
            raise ProtocolError(
                f"MicroBatch.mm_inputs carries {sorted(mm)}, but model.path {self.model_path!r} is a text model; "
                "train prompts with images on a vision-language model"
            )
        return {name: tensor.to(self.device) for name, tensor in mm.items()}

    def _train_held(self, micro_batches: Iterable[MicroBatch]) -> dict[str, float]:
        """Collect, prepare (old log-probs, advantages, whitening), then several updates."""
        batches: list[_Batch] = []
        with trace.span("collect"):
            for mb in micro_batches:
                self._check(mb)
                self._received += 1
                batches.append(self._inputs(mb))
        if not batches or len(batches) != self._count:
            raise ProtocolError(
                f"rank {self.rank} got {len(batches)} of {self._count} micro-batches for step {self._step}"
            )
        runs = self._config.mini_batches
        if len(batches) % runs:
            raise ConfigError(
                f"trainer.mini_batches={runs} must divide the micro-batches each rank gets per step "
                f"(buffer.micro_batches_per_step={len(batches)})"
            )
        start = time.perf_counter()
        with trace.span("prepare"):
            for b in batches:
                self._prepare(b)
            if self._algo.batch_wide:
                self._whiten(batches)
        prepare_s = time.perf_counter() - start
        size = len(batches) // runs
        updates: list[dict[str, float]] = []
        for _ in range(self._algo.ppo_epochs):
            for i in range(runs):
                self._begin_update()
                with trace.span("forward_backward"):
                    for b in batches[i * size : (i + 1) * size]:
                        self._forward_backward(b)
                with trace.span("optimizer"):
                    updates.append(self._update(self._reduce()))
        metrics = {k: sum(u[k] for u in updates) / (1 if k.startswith("time_") else len(updates)) for k in updates[0]}
        for key in ("tokens", "padding", "positions", "prompt_saved"):  # the batch's, once
            metrics[key] = sum(u[key] for u in updates[:runs])
        metrics["clip_frac_last"] = updates[-1]["clip_frac"]  # the last update's, most off-policy
        metrics["time_prepare_s"] = prepare_s
        return self._end_step(metrics, sequences=sum(u["sequences"] for u in updates[:runs]))

    @torch.no_grad()
    def _prepare(self, b: _Batch) -> None:
        """Old log-probs, reference log-probs, critic values and token advantages of one
        micro-batch, with the weights that start the batch (no grad)."""
        algo = self._algo
        b.old = b.rollout if algo.old_logprobs == "rollout" else self._logprobs(self.policy, b)
        if self.reference is not None:
            b.ref = self._logprobs(self.reference, b)
        if self.critic is not None:
            b.old_values = self._values(b)
        b.advantages, b.returns = self._token_advantages(b, b.old)

    def _token_advantages(self, b: _Batch, old: Tensor) -> tuple[Tensor, Tensor | None]:
        """rl_math.token_advantages with the KL in the reward from ``old`` vs the reference."""
        algo = self._algo
        kl = None
        if b.ref is not None and algo.kl_in_reward:
            kl = rl_math.kl_penalty(old, b.ref, kind=algo.kl_in_reward_estimator).detach()
        return rl_math.token_advantages(
            algo.advantage, b.advantages, b.mask,
            kl=kl, kl_coef=self.kl_coef, values=b.old_values, gamma=algo.gamma, lam=algo.lam,
        )  # fmt: skip

    def _whiten(self, batches: list[_Batch]) -> None:
        """Whiten every micro-batch's advantages with the moments of the whole batch,
        all-reduced over every rank (verl's masked_whiten over the global batch)."""
        moments = torch.zeros(3, dtype=torch.float64, device=self.device)
        for b in batches:
            moments += torch.stack(rl_math.masked_moments(b.advantages, b.mask))
        with trace.span("all_reduce"):
            dist.all_reduce(moments)
        total, total_sq, count = moments.unbind()
        for b in batches:
            b.advantages = rl_math.masked_whiten(b.advantages, b.mask, moments=(total, total_sq, count))

    def _values(self, b: _Batch) -> Tensor:
        """The critic's values [B, T]: the value of the state before token t is its output
        at t - 1 (aligned like log-probs), 0 at t = 0; differentiable."""
        assert self.critic is not None
        out, _, unpacked = self._forward(self.critic, b)  # [R, S, 1]
        return unpacked(torch.nn.functional.pad(out[..., 0][:, :-1].float(), (1, 0)))  # [B, T]

    def _forward(self, module: nn.Module, b: _Batch) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
        """``module``'s logits [R, S, V] for the batch ``b.ids`` [B, T], the ids they read
        [R, S], and the map of a per-token result [R, S] aligned like log-probs back to
        [B, T]. With ``trainer.share_prompt`` a row per prompt, its rows' remainders after it
        (``workers.packing.share_prompts``; with ``trainer.pack`` all in one row); else with
        ``trainer.pack`` the batch runs as one row of its real tokens (R = 1, S = N,
        ``workers.packing``), else padded as given (the map is the identity)."""
        ids, attention = b.ids, b.attention
        if b.mm:  # images: the padded batch (a model's image positions, e.g. Qwen2-VL's 3D rope, come from it)
            logits = module(input_ids=ids, attention_mask=attention, use_cache=False, **self._images.inputs(ids, b.mm)).logits
            return self._images.masked(logits), ids, lambda x: x
        layout = self._shared_layout(b)
        if layout is not None:
            logits = module(
                input_ids=layout.input_ids,
                attention_mask=layout.attention_mask,
                position_ids=layout.position_ids,
                use_cache=False,
            ).logits
            return self._images.masked(logits), layout.input_ids, layout.back
        if not self._config.pack:
            logits = module(input_ids=ids, attention_mask=attention, use_cache=False).logits
            return self._images.masked(logits), ids, lambda x: x
        packing = plan(attention)
        packed = pack(ids, packing)  # [1, N]
        # No attention mask: transformers reads the restarting positions as sequence bounds.
        logits = module(input_ids=packed, position_ids=packing.position_ids, use_cache=False).logits
        return self._images.masked(logits), packed, lambda x: unpack(x, packing, shifted=True)

    def _shared_layout(self, b: _Batch) -> Layout | None:
        """The batch's shared-prompt layout, chosen once per batch: always with
        ``trainer.share_prompt: true``; with ``auto`` where rows share a prompt and its
        estimated FLOPs (``workers.packing.forward_flops``) are below the padded (or, with
        ``trainer.pack``, packed) layout's; never with ``false``."""
        share = self._config.share_prompt
        if share is False or not b.share:
            return None
        if b.layout is None:
            b.layout = share_prompts(b.ids, b.attention, b.mask, one_row=self._config.pack)
            if share == "auto":
                shape = (1, int(b.attention.sum())) if self._config.pack else tuple(b.ids.shape)
                params, width = self._flops_model
                plain = forward_flops(shape, params, width)
                shared = forward_flops(tuple(b.layout.input_ids.shape), params, width)
                b.share = b.layout.shared > 0 and shared < plain
                if not b.share:
                    b.layout = None
        return b.layout

    def _logprobs(self, module: nn.Module, b: _Batch) -> Tensor:
        """[B, T] float32 log-probs of ``ids`` under ``module`` at the rollouts' temperature."""
        logits, read, unpacked = self._forward(module, b)
        return unpacked(rl_math.token_logprobs(logits, read, temperature=self._temperature).float())

    def _forward_backward(self, b: _Batch) -> None:
        start = time.perf_counter()
        algo, sums, mask = self._algo, self._sums, b.mask
        logits, ids, unpacked = self._forward(self.policy, b)  # [R, S, V]
        logprobs = unpacked(rl_math.token_logprobs(logits, ids, temperature=self._temperature))  # [B, T]
        if b.old is None:  # streaming: before the only update, the current weights are the old ones
            old = b.rollout if algo.old_logprobs == "rollout" else logprobs.detach()
            if self.reference is not None:
                with torch.no_grad():
                    b.ref = self._logprobs(self.reference, b)
            advantages, _ = self._token_advantages(b, old)
        else:
            old, advantages = b.old, b.advantages
        weights = rl_math.importance_weights(
            logprobs.detach() if algo.old_logprobs == "rollout" else old, b.rollout, mask,
            kind=algo.importance_sampling, cap=algo.importance_cap, level=algo.importance_level,
            floor=algo.importance_floor, veto=algo.importance_veto,
        )  # fmt: skip
        masked = mask & (weights == 0) if algo.importance_sampling == "mis" or algo.importance_veto > 0 else None
        loss_mask = mask & ~masked if masked is not None else mask  # rejected tokens leave the loss
        if self.critic is not None:
            self._critic_backward(b, loss_mask)
        per_token, stats = self._loss_fn(logprobs, old, advantages, loss_mask, self._loss_params)
        per_token = per_token * weights
        kl = None
        if b.ref is not None:  # the loss term, or (kl_in_reward) a metric with the reward's estimator
            kind = algo.kl_in_reward_estimator if algo.kl_in_reward else algo.kl_estimator
            kl = rl_math.kl_penalty(logprobs, b.ref, kind=kind)  # [B, T]
            if not algo.kl_in_reward:
                per_token = per_token + self.kl_coef * kl
        if algo.entropy_coef > 0:
            entropy = unpacked(rl_math.entropy_from_logits(logits, temperature=self._temperature))  # [B, T]
            per_token = per_token - algo.entropy_coef * entropy
        else:
            with torch.no_grad():  # a metric only
                entropy = unpacked(rl_math.entropy_from_logits(logits.detach(), temperature=self._temperature))
        numerator = rl_math.loss_sum(per_token, loss_mask, mode=algo.aggregation, norm=algo.aggregation_norm)
        torch.autograd.backward(numerator)
        with torch.no_grad():
            tokens = mask.sum()
            sums["loss"] += numerator.detach()
            sums["count"] += rl_math.loss_count(loss_mask, mode=algo.aggregation)
            sums["tokens"] += tokens
            sums["sequences"] += mask.any(-1).sum()
            sums["padding"] += (~b.attention).sum()
            sums["positions"] += b.attention.numel()
            sums["prompt_saved"] += b.layout.shared if b.layout is not None else 0
            sums["clip_frac"] += stats.get("clip_frac", 0.0) * tokens
            sums["approx_kl"] += stats.get("approx_kl", 0.0) * tokens
            sums["entropy"] += _masked_sum(entropy, mask)
            sums["is_weight"] += _masked_sum(weights, mask)
            sums["is_weight_sq"] += _masked_sum(weights * weights, mask)
            sums["logprob_diff"] += _masked_sum((old - b.rollout).abs(), mask)
            if masked is not None:
                sums["is_masked"] += masked.sum()
            if kl is not None:
                sums["kl"] += _masked_sum(kl.detach(), mask)
        self._fwd_bwd_s += time.perf_counter() - start

    def _critic_backward(self, b: _Batch, mask: Tensor) -> None:
        """Critic forward and clipped value-loss backward against the batch's returns."""
        assert b.old_values is not None and b.returns is not None
        algo = self._algo
        values = self._values(b)
        per_token = rl_math.value_loss(values, b.old_values, b.returns, mask, clip=algo.value_clip)
        numerator = rl_math.loss_sum(per_token, mask, mode=algo.aggregation, norm=algo.aggregation_norm)
        torch.autograd.backward(numerator)
        with torch.no_grad():
            self._sums["value_loss"] += numerator.detach()
            self._sums["value"] += _masked_sum(b.old_values, mask)

    def _check(self, mb: MicroBatch) -> None:
        """The micro-batch belongs to this rank and step, in order, with consistent shapes.

        At a step's first micro-batch the verdict and ``count`` are all-reduced, so a bad
        micro-batch or a count mismatch raises on every rank instead of hanging the others.
        """
        shape, problem = tuple(mb.input_ids.shape), ""
        bad = [
            n
            for n in ("attention_mask", "loss_mask", "rollout_logprobs", "advantages")
            if getattr(mb, n).shape != shape
        ]
        if mb.rank != self.rank or mb.step != self._step:
            problem = f"MicroBatch.rank/step is {mb.rank}/{mb.step}; this trainer is rank {self.rank} at step {self._step}"
        elif mb.index != self._received or (
            self._received and (mb.count != self._count or mb.index >= mb.count)
        ):
            problem = f"MicroBatch.index/count is {mb.index}/{mb.count}; expected {self._received}/{self._count or 'any'}"
        elif len(shape) != 2 or shape[1] < 2:
            problem = f"MicroBatch.input_ids must be [B, T] with T >= 2 (got {shape})"
        elif bad:
            problem = f"MicroBatch.{bad[0]} has shape {tuple(getattr(mb, bad[0]).shape)}, input_ids {shape}"
        elif self._config.pack:
            problem = padding_problem(mb.attention_mask)
        if self._received > 0:
            if problem:
                raise ProtocolError(problem)
            return
        verdict = torch.tensor(
            [mb.count, -mb.count, int(bool(problem))], dtype=torch.int64, device=self.device
        )
        with trace.span("all_reduce"):
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        high, low, rejected = int(verdict[0]), -int(verdict[1]), int(verdict[2])
        if problem or rejected:
            raise ProtocolError(
                problem or f"another rank rejected its micro-batch {mb.index} of step {self._step}"
            )
        if high != low or low < 1:
            raise ProtocolError(
                f"ranks disagree on MicroBatch.count for step {self._step}: {low} to {high}; must be equal and >= 1"
            )
        self._count = mb.count

    def reduce_gradients(self) -> dict[str, float]:
        """All-reduce the step's sums and divide every gradient by the global loss count.

        Called by ``finish_step``; tests call it first to read the step's gradients.
        Returns the global sums (loss, count, tokens, ...).
        """
        if self._reduced is None and (self._received == 0 or self._received != self._count):
            raise ProtocolError(
                f"rank {self.rank} got {self._received} of {self._count} micro-batches for step {self._step}"
            )
        return self._reduce()

    def _reduce(self) -> dict[str, float]:
        """All-reduce this update's sums; divide the gradients by the global count (once)."""
        if self._reduced is not None:
            return self._reduced
        totals = torch.stack([self._sums[k] for k in _SUMS])  # [len(_SUMS)] float64
        with trace.span("all_reduce"):
            dist.all_reduce(totals)
        reduced = dict(zip(_SUMS, totals.tolist(), strict=True))
        divisor = max(reduced["count"], 1.0)  # all-padding step or token_sum: no division
        for module, _, _ in self._trained.values():
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.div_(divisor)
        self._reduced = reduced
        return reduced

    def finish_step(self) -> dict[str, float]:
        """Clip, step the optimizer(s) and schedules, zero the gradients; the step's metrics."""
        with trace.span("optimizer"):
            s = self.reduce_gradients()
            return self._end_step(self._update(s), sequences=s["sequences"])

    def _update(self, s: dict[str, float]) -> dict[str, float]:
        """One optimizer step of every trained module on reduced sums ``s``; its metrics."""
        start = time.perf_counter()
        norms = {name: _step(module, optimizer, clip=self._config.grad_clip) for name, (module, optimizer, _) in self._trained.items()}
        self._optimizer_steps += 1
        count, tokens = max(s["count"], 1.0), max(s["tokens"], 1.0)
        metrics = {"loss": s["loss"] / count, "grad_norm": norms["policy"]}
        if self.critic is not None:
            metrics["value_loss"] = s["value_loss"] / count
            metrics["critic_grad_norm"] = norms["critic"]
            metrics["value_mean"] = s["value"] / tokens
        for name in ("clip_frac", "approx_kl", "entropy", "is_weight", "logprob_diff"):
            metrics[name] = s[name] / tokens
        metrics["is_weight_std"] = math.sqrt(max(s["is_weight_sq"] / tokens - metrics["is_weight"] ** 2, 0.0))
        metrics["is_masked_frac"] = s["is_masked"] / tokens
        if self.reference is not None:
            metrics["kl"] = s["kl"] / tokens
        metrics.update(
            tokens=s["tokens"], sequences=s["sequences"], padding=s["padding"], positions=s["positions"],
            prompt_saved=s["prompt_saved"],
            time_optimizer_s=time.perf_counter() - start,
        )  # fmt: skip
        self._begin_update()
        return metrics

    def _end_step(self, metrics: dict[str, float], *, sequences: float) -> dict[str, float]:
        """Close the run step: LR schedules, the adaptive KL, the counters; final metrics."""
        metrics["lr"] = float(self._trained["policy"][2].get_last_lr()[0])
        for _, _, scheduler in self._trained.values():
            scheduler.step()
        if self._kl is not None and "kl" in metrics:
            metrics["kl_coef"] = self._kl.update(metrics["kl"], int(sequences))
        self._step += 1
        metrics.pop("sequences", None)
        metrics["pad_share"] = metrics.pop("padding") / max(metrics.pop("positions"), 1.0)
        metrics["prompt_tokens_saved"] = metrics.pop("prompt_saved")
        metrics.update(
            step=float(self._step),
            optimizer_steps=float(self._optimizer_steps),
            time_forward_backward_s=self._fwd_bwd_s,
        )
        self._begin_step()
        return metrics

    # ------------------------------------------------------------------ colocated generation

    def gather_policy(self) -> None:
        """Make the policy's full weights resident on this rank until ``release_policy``;
        collective (one all-gather per FSDP module, in the compute dtype).

        While gathered, a forward runs without any collective, so each rank's colocated
        generator generates on the module itself, independently of the other ranks (no copy
        of the weights, nothing sent over a socket). Training must wait for ``release_policy``.
        """
        if self._gathered:
            return
        self._between_steps("gather_policy")
        modules = [m for m in self.policy.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.unshard()
            m.set_reshard_after_forward(False, recurse=False)
        self._gathered = True

    def gathered_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """The policy's full tensors in HF naming while gathered (tied weights once)."""
        if not self._gathered:
            raise YattError("gathered_tensors() needs gather_policy() first")
        for name, tensor in self.policy.named_parameters():
            yield name.replace(_WRAPPED, ""), tensor.detach()
        for prefix, module in self.policy.named_modules():
            for name, tensor in module.named_buffers(recurse=False):
                if name not in module._non_persistent_buffers_set:  # what a state dict holds
                    yield f"{prefix}.{name}".lstrip(".").replace(_WRAPPED, ""), tensor

    def release_policy(self) -> None:
        """Free the full weights ``gather_policy`` made resident (local: no collective)."""
        if not self._gathered:
            return
        for m in self.policy.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
                m.set_reshard_after_forward(True, recurse=False)
        self._gathered = False

    @torch.no_grad()
    def logprobs(self, input_ids: Tensor, attention_mask: Tensor, mm_inputs: dict[str, Tensor] | None = None) -> Tensor:
        """[B, T] float32 log-probs of the tokens under the current policy (CPU); collective.
        ``mm_inputs``: the rows' images, as ``MicroBatch.mm_inputs`` carries them."""
        ids, attention = input_ids.to(self.device, torch.int64), attention_mask.to(self.device, torch.bool)
        none = torch.zeros_like(ids, dtype=torch.float32)
        batch = _Batch(
            ids=ids, attention=attention, mask=attention, rollout=none, advantages=none, share=False,
            mm=self._mm_inputs(mm_inputs or {}),
        )  # fmt: skip
        return self._logprobs(self.policy, batch).cpu()

    # ------------------------------------------------------------------ checkpoints

    def _between_steps(self, what: str) -> None:
        if self._gathered:
            raise YattError(f"{what} needs the policy sharded; call release_policy() first")
        if self._received:
            raise YattError(
                f"{what} is only possible between steps; step {self._step} has micro-batches pending"
            )

    def _state(self) -> dict[str, Any]:
        """What a checkpoint holds; DCP saves the DTensor shards of every rank."""
        state: dict[str, Any] = {"step": self._step, "optimizer_steps": self._optimizer_steps}
        if self._kl is not None:
            state["kl_coef"] = self._kl.value
        for name, (module, optimizer, scheduler) in self._trained.items():
            state[name], state[f"{name}_optimizer"] = get_state_dict(module, optimizer)
            state[f"{name}_scheduler"] = scheduler.state_dict()
        return state

    def save_checkpoint(self, directory: str | Path, *, background: bool = False) -> Future[None]:
        """Save model, optimizer, schedule, step and this rank's RNG state; collective.

        ``background``: copy the state to host memory now, write it in a thread (DCP
        ``async_save``) while training goes on; the returned future completes when every
        rank's files and the ``.metadata`` are written, and raises ``StorageError`` for a
        failed write. Otherwise it returns completed. A save first waits for the previous one."""
        self._between_steps("save_checkpoint")
        self.wait_for_checkpoint()
        state = self._state()
        state[_rng_key(self.rank)] = _rng_state()
        result: Future[None] = Future()
        try:
            if not background:
                dcp_save(state, storage_writer=_TracedWriter(directory))
                result.set_result(None)
                return result
            # The writer also stages: a blocking copy of every tensor into host memory.
            written = dcp_async_save(state, storage_writer=_TracedWriter(directory), process_group=self._checkpoint_group)
        except Exception as e:
            error = _checkpoint_error(directory, e)
            if error is e:
                raise
            raise error from e
        assert isinstance(written, Future)  # the thread executor's (not the AsyncSaveResponse of a stager)

        def done(f: Future[Any]) -> None:
            failed = f.exception()
            if failed is None:
                result.set_result(None)
                return
            error = _checkpoint_error(directory, failed)
            if error is not failed:
                error.__cause__ = failed
            result.set_exception(error)

        written.add_done_callback(done)
        self._writing = result
        return result

    def wait_for_checkpoint(self) -> None:
        """Until the background save in flight (if any) is written; raises its error."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore what ``save_checkpoint`` wrote; the world size may differ (DCP reshards),
        in which case the RNG is reseeded from the seed, step and rank."""
        self._between_steps("load_checkpoint")
        self.wait_for_checkpoint()
        path = Path(directory)
        if not (path / ".metadata").exists():
            raise ConfigError(f"checkpoint directory {str(path)!r} holds no DCP checkpoint (no .metadata)")
        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        state = {k: v for k, v in self._state().items() if k in saved or k not in _OPTIONAL_STATE}
        key = _rng_key(self.rank)
        has_rng = f"{key}.torch" in saved  # absent when the checkpoint had fewer ranks
        if has_rng:
            state[key] = _rng_state()
        dcp_load(state, checkpoint_id=str(path))
        for name, (module, optimizer, scheduler) in self._trained.items():
            set_state_dict(
                module, optimizer, model_state_dict=state[name], optim_state_dict=state[f"{name}_optimizer"]
            )
            scheduler.load_state_dict(state[f"{name}_scheduler"])
        self._step = int(state["step"])
        self._optimizer_steps = int(state.get("optimizer_steps", self._step))
        if self._kl is not None and "kl_coef" in state:
            self._kl.value = float(state["kl_coef"])
        if has_rng:
            _set_rng_state(state[key])
        else:
            seed = self._config.seed + self._step * self.world_size + self.rank
            torch.manual_seed(seed)
            random.seed(seed)
        self._begin_step()

    # ------------------------------------------------------------------ publishing

    def export_hf(self, directory: str | Path) -> None:
        """Write a Hugging Face directory (safetensors, config, tokenizer) on rank 0; collective."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(self.policy, options=options)  # rank 0: every tensor; others: {}
        if self.rank == 0:
            out = Path(directory)
            out.mkdir(parents=True, exist_ok=True)
            config = AutoConfig.from_pretrained(self.model_path)
            with torch.device("meta"):
                auto: Any = AutoModelForImageTextToText if self.vision else AutoModelForCausalLM
                model = auto.from_config(config)
                if self._lora:
                    model = with_lora(model, self._lora)
            model.load_state_dict(
                {k: cast(Tensor, v).to(self.compute_dtype) for k, v in full.items()}, assign=True
            )
            if self._lora:  # the adapter alone (peft loads it on the base), then merged for any engine
                model.save_pretrained(out / "adapter")
                model = model.merge_and_unload()
            model.config.dtype = self.compute_dtype
            model.save_pretrained(out)
            # A vision-language model's processor (image processor, tokenizer, chat template) with it.
            (AutoProcessor if self.vision else AutoTokenizer).from_pretrained(self.model_path).save_pretrained(out)
            generation = Path(self.model_path) / "generation_config.json"
            if generation.exists():
                shutil.copy(generation, out / generation.name)
        del full
        dist.barrier()

    def weight_buckets(self, version: int, bucket_bytes: int) -> Iterator[WeightUpdate]:
        """The policy's full tensors in HF naming (with LoRA, its adapters only), packed
        into buckets of at most ``bucket_bytes`` (one tensor larger than that travels
        alone); collective.

        Rank 0 yields every bucket; the other ranks yield nothing but must exhaust the
        iterator too. Each FSDP module (a decoder layer, then the root) is unsharded with
        one all-gather for all its parameters (``FSDPModule.unshard``) and resharded at
        once, so only one layer is ever full, and rank 0 holds at most one bucket more.
        With LoRA each adapter is gathered alone; the base weights never move.
        """
        if bucket_bytes < 1:
            raise ConfigError(f"trainer.weight_bucket_mb must be > 0 (got {bucket_bytes} bytes)")
        itemsize = torch.empty((), dtype=self.compute_dtype).element_size()
        if self._lora:
            sizes = [(name, numel * itemsize) for name, numel in self._adapter_sizes()]
            tensors = self._adapter_tensors()
        else:
            sizes = [(name, numel * itemsize) for name, numel in self._policy_tensor_sizes()]
            tensors = self._policy_tensors(full=True)
        plan = _plan_buckets(sizes, bucket_bytes)
        gathered: dict[str, Tensor] = {}
        index = 0
        for name, full in tensors:
            if self.rank == 0:
                gathered[name] = full.to("cpu", self.compute_dtype, copy=True)  # FSDP frees `full` next
            while self.rank == 0 and index < len(plan) and all(n in gathered for n in plan[index]):
                names = plan[index]
                update = [gathered.pop(n) for n in names]
                yield WeightUpdate(version=version, bucket_index=index, num_buckets=len(plan), names=names, tensors=update)
                index += 1

    def _adapter_sizes(self) -> list[tuple[str, int]]:
        """LoRA: (name, element count) of each adapter, in ``_adapter_tensors``' order."""
        return [(name.replace(_WRAPPED, ""), p.numel()) for name, p in self.policy.named_parameters() if is_adapter(name)]

    def _adapter_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """LoRA: each adapter's full tensor, one all-gather of its shards each (a collective)."""
        for name, param in self.policy.named_parameters():
            if is_adapter(name):
                full = param.full_tensor() if isinstance(param, DTensor) else param
                yield name.replace(_WRAPPED, ""), full.detach()

    def _policy_tensor_sizes(self) -> list[tuple[str, int]]:
        """(HF name, element count) of every tensor the generators load, in the order
        ``_policy_tensors(full=True)`` yields them; nothing is gathered."""
        return [(name, tensor.numel()) for name, tensor in self._policy_tensors(full=False)]

    def _policy_tensors(self, *, full: bool) -> Iterator[tuple[str, Tensor]]:
        """The policy's tensors in HF naming: each decoder layer's parameters, then the
        root's own (tied weights once, under their first name), then any other state-dict
        tensor (persistent buffers). ``full``: unsharded, a collective; each tensor is valid
        only until the next one is asked for (its module is resharded then)."""
        modules = [(prefix, m) for prefix, m in self.policy.named_modules() if isinstance(m, FSDPModule)]
        modules = modules[1:] + modules[:1]  # the root (first in named_modules) owns what is left
        seen: set[str] = set()
        for prefix, module in modules:
            if full:
                module.unshard()  # one all-gather for all of this module's parameters
            try:
                for name, param in module.named_parameters(prefix=prefix):  # type: ignore[attr-defined]
                    clean = name.replace(_WRAPPED, "")
                    if clean not in seen:
                        seen.add(clean)
                        yield clean, param.detach()
            finally:
                if full:
                    module.reshard()
        params = {n.replace(_WRAPPED, "") for n, _ in self.policy.named_parameters(remove_duplicate=False)}
        for name, tensor in cast(dict[str, Tensor], get_model_state_dict(self.policy)).items():
            if name not in params:  # a buffer (every parameter, tied aliases too, is in params)
                yield name, (tensor.full_tensor() if full and isinstance(tensor, DTensor) else tensor)


# ---------------------------------------------------------------------- helpers


@dataclasses.dataclass
class _Batch:
    """One micro-batch on the device, and what ``_prepare`` adds to it (all [B, T])."""

    ids: Tensor
    attention: Tensor
    mask: Tensor
    rollout: Tensor
    advantages: Tensor  # the MicroBatch field; final token advantages once prepared
    old: Tensor | None = None  # old log-probs; None while streaming (the current ones)
    ref: Tensor | None = None  # reference log-probs
    old_values: Tensor | None = None  # critic values before the batch's updates
    returns: Tensor | None = None  # value targets (gae)
    share: bool = True  # False: no shared layout (Trainer.logprobs' rows have no prompt; auto found none cheaper)
    mm: dict[str, Tensor] = dataclasses.field(default_factory=dict)  # the rows' images (MicroBatch.mm_inputs)
    layout: Layout | None = None  # with trainer.share_prompt, built at the batch's first forward


def _device() -> torch.device:
    """CUDA (the current device) when the process group runs NCCL, else CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _load(from_pretrained: Callable[..., Any], path: str, **kwargs: object) -> PreTrainedModel:
    """A transformers model from a local directory, in float32 (the master weights)."""
    return cast(PreTrainedModel, from_pretrained(path, dtype=torch.float32, **kwargs))


def _vision_tower(model: nn.Module) -> nn.Module:
    """A vision-language model's image encoder (LLaVA's ``vision_tower``, Qwen2-VL's ``visual``)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("vision_tower", "visual", "vision_model"):
            return cast(nn.Module, module)
    raise ConfigError(
        f"model.train_vision=false: cannot find the vision tower of {type(model).__name__} (no vision_tower, "
        "visual or vision_model module); set model.train_vision=true"
    )


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder layers (the classes the model lists in _no_split_modules);
    a vision-language model's language model's (not its vision tower's blocks)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    decoder = getattr(model, "get_decoder", None)
    text = decoder() if callable(decoder) and is_vision_language(getattr(model, "config", None)) else None
    for module in (text or model).modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module)
            and all(type(m).__name__ in names for m in module)
        ):
            return module
    raise ConfigError(
        f"model.path: cannot find the decoder layers of {type(model).__name__} "
        f"(no nn.ModuleList of its _no_split_modules {sorted(names)}); use a standard decoder-only model"
    )


def _schedule(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """LR factor of optimizer step s (0-based): linear warmup, then constant/linear/cosine to total."""

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _step(module: nn.Module, optimizer: torch.optim.Optimizer, *, clip: float) -> float:
    """Clip (when clip > 0), step, zero grads; the global gradient norm before clipping."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        with trace.span("all_reduce"):  # the shards' partial norms summed over the ranks
            norm = norm.full_tensor()
    if clip > 0:
        torch.nn.utils.clip_grads_with_norm_(module.parameters(), clip, norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


class _TracedAllGather(DefaultAllGather):
    """FSDP2's parameter all-gather, traced as an ``all_gather`` span: framework time in the
    stages benchmark although it runs inside forward_backward (on GPU the span only covers
    the launch on FSDP's stream)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dist.Work | None:
        with trace.span("all_gather"):
            return super().__call__(*args, **kwargs)


class _TracedReduceScatter(DefaultReduceScatter):
    """FSDP2's gradient reduce-scatter in the backward, traced as a ``reduce_scatter`` span
    (blocking on CPU; on GPU the span only covers the launch)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dist.Work:
        with trace.span("reduce_scatter"):
            return super().__call__(*args, **kwargs)


_WRAPPED = "_checkpoint_wrapped_module."
"""The name part activation checkpointing adds to a layer's parameters (HF names lack it)."""


def _plan_buckets(sizes: list[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Greedy in state-dict order: a bucket closes before the tensor that would overflow it."""
    plan: list[list[str]] = []
    used = 0
    for name, size in sizes:
        if not plan or (plan[-1] and used + size > bucket_bytes):
            plan.append([])
            used = 0
        plan[-1].append(name)
        used += size
    return plan


def _masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    return torch.where(
        mask, values.double(), torch.zeros((), dtype=torch.float64, device=values.device)
    ).sum()


class _TracedWriter(FileSystemWriter):
    """DCP's file writer, its writes traced as ``checkpoint_write`` spans (this rank's files,
    in the background thread when the save is)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        with trace.span("checkpoint_write"):
            return super().write_data(plan, planner)


def _checkpoint_error(directory: str | Path, error: BaseException) -> BaseException:
    """DCP wraps each rank's OSError (a full disk) in a CheckpointException: say it plainly."""
    if isinstance(error, OSError) or "No space left" in str(error):
        return storage_error(directory, error)
    return error


def _rng_key(rank: int) -> str:
    return f"rng_rank{rank}"


def _rng_state() -> dict[str, object]:
    """This rank's random generators (torch CPU, CUDA when present, Python's random)."""
    state: dict[str, object] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, object]) -> None:
    torch.set_rng_state(cast(Tensor, state["torch"]))
    random.setstate(cast(tuple[object, ...], state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(cast(Tensor, state["cuda"]))
