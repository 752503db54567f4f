"""The transformers engine: batched ``generate`` with a KV cache, on any device.

It is the engine that runs everywhere (CI, a CPU-only box, a GPU without vLLM) and the
reference the vLLM engine is checked against. Requests with equal sampling parameters go
into one ``generate`` call (prompts left-padded, each repeated ``n`` times). A request
with a seed gets a call of its own, seeded, so its samples do not depend on what else
was batched with it; requests without one draw their seeds from one stream seeded by
``GeneratorConfig.seed``, so a whole run is reproducible too.

Logprobs come from ``output_logits=True``: the raw logits of every step (before any
temperature, top-k or top-p warper), then ``log_softmax(logits / temperature)`` gathered
at the sampled token, which is exactly what the trainer recomputes. Memory: transformers
holds those logits for the whole call, rows x new tokens x vocab x 4 bytes.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from protocols.messages import SamplingParams
from workers.engines.base import (
    DType,
    PromptRequest,
    Sample,
    WeightNames,
    is_greedy,
    resolve_dtype,
    validate_requests,
)
from yatt.config import GeneratorConfig
from yatt.errors import Closed, ConfigError

# What requests must share to go into one generate call: n and every sampling parameter.
_GroupKey = tuple[object, ...]


def _as_list(ids: int | list[int] | None) -> list[int]:
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


class HFEngine:
    """transformers ``AutoModelForCausalLM`` behind the ``Engine`` protocol."""

    def __init__(
        self, model_path: str, config: GeneratorConfig, *, device: str = "cpu", dtype: DType = "auto"
    ) -> None:
        self._device = torch.device(device)
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"generator device {device!r} needs CUDA, which this machine lacks; use 'cpu'")
        self._dtype = resolve_dtype(dtype, self._device)
        # Any: transformers 5.19's own annotations of generate() and to() do not type-check.
        model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=self._dtype)
        model.to(self._device).eval()
        self._model: Any = model
        gen = model.generation_config
        self._eos_ids = _as_list(gen.eos_token_id) or _as_list(model.config.eos_token_id)
        pad = _as_list(gen.pad_token_id) or _as_list(model.config.pad_token_id) or self._eos_ids[:1]
        # Any id works as padding (it is masked); 0 only when the model names neither pad nor EOS.
        self._pad_id = pad[0] if pad else 0
        # A checkpoint's generation_config may carry sampling defaults (repetition_penalty,
        # top_k=50, ...) that would silently change the distribution the logprobs describe;
        # only the request decides how to sample.
        model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
            bos_token_id=gen.bos_token_id, eos_token_id=gen.eos_token_id, pad_token_id=self._pad_id
        )
        self._names = WeightNames(model)
        self._max_len: int | None = getattr(model.config, "max_position_embeddings", None)
        self._seeds = random.Random(config.seed)

    def _live_model(self) -> Any:
        if self._model is None:
            raise Closed("HFEngine is closed")
        return self._model

    def generate(self, requests: Sequence[PromptRequest]) -> list[list[Sample]]:
        """Sample every request; equal sampling parameters share one ``generate`` call."""
        self._live_model()
        validate_requests(requests, self._max_len)
        groups: dict[_GroupKey, list[int]] = {}
        for i, req in enumerate(requests):
            sp = req.sampling
            # Seeded requests never share a call: batch neighbours would shift their RNG draws.
            key: _GroupKey = (
                req.n, sp.temperature, sp.top_p, sp.top_k, sp.max_new_tokens,
                tuple(sp.stop_token_ids), i if sp.seed is not None else -1,
            )  # fmt: skip
            groups.setdefault(key, []).append(i)
        results: list[list[Sample]] = [[] for _ in requests]
        for indices in groups.values():
            first = requests[indices[0]]
            seed = first.sampling.seed if first.sampling.seed is not None else self._seeds.getrandbits(63)
            samples = self._generate_group(
                [requests[i].prompt_ids for i in indices], first.n, first.sampling, seed
            )
            for i, group_samples in zip(indices, samples, strict=True):
                results[i] = group_samples
        return results

    @torch.no_grad()
    def _generate_group(
        self, prompts: list[list[int]], n: int, sp: SamplingParams, seed: int
    ) -> list[list[Sample]]:
        """One ``generate`` call for prompts that share ``n`` and ``sp``."""
        model = self._live_model()
        greedy = is_greedy(sp)
        # Greedy samples are identical: decode each prompt once and copy it n times.
        rows_per_prompt = 1 if greedy else n
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)  # [P, T]
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [P, T]
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
        input_ids = input_ids.repeat_interleave(rows_per_prompt, dim=0).to(self._device)  # [R, T]
        attention_mask = attention_mask.repeat_interleave(rows_per_prompt, dim=0).to(self._device)
        stop_ids = sorted(set(self._eos_ids) | set(sp.stop_token_ids))
        gen_config = GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=not greedy,
            temperature=1.0 if greedy else sp.temperature,
            top_p=1.0 if greedy else sp.top_p,
            top_k=0 if greedy or sp.top_k == -1 else sp.top_k,  # 0 disables transformers' top-k
            max_new_tokens=sp.max_new_tokens,
            eos_token_id=stop_ids or None,
            pad_token_id=self._pad_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        # Seed a fork of the RNG so the caller's global RNG state is left as it was.
        with torch.random.fork_rng(devices=[self._device] if self._device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_config
            )
        new_tokens = out.sequences[:, width:]  # [R, L] int64, pad after a row's stop token
        temperature = 1.0 if greedy else sp.temperature
        logprobs = torch.stack(
            [
                torch.log_softmax(step_logits.float() / temperature, dim=-1)
                .gather(1, new_tokens[:, t : t + 1])
                .squeeze(1)  # [R]
                for t, step_logits in enumerate(out.logits)  # L x [R, V] raw logits
            ],
            dim=1,
        ).cpu()  # [R, L] float32
        stop_set = set(stop_ids)
        samples: list[list[Sample]] = []
        for p in range(len(prompts)):
            group = []
            for k in range(n):
                r = p * rows_per_prompt + (0 if greedy else k)
                tokens = new_tokens[r].tolist()
                # Cut after the first stop token: what follows is padding.
                end = next((t + 1 for t, tok in enumerate(tokens) if tok in stop_set), None)
                length = end if end is not None else len(tokens)
                group.append(
                    Sample(
                        token_ids=tokens[:length],
                        logprobs=logprobs[r, :length].tolist(),
                        finish_reason="stop" if end is not None else "length",
                    )
                )
            samples.append(group)
        return samples

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every tensor into the model in place (any dtype or device: ``copy_`` converts).

        A bad name or shape raises before that tensor is copied; a missing tensor raises at
        the end, with the model partly updated, so the caller must resend the whole update.
        """
        model = self._live_model()
        params = model.state_dict()
        sent: list[str] = []
        for name, tensor in named_tensors:
            self._names.check_tensor(name, tensor)
            params[name].copy_(tensor)
            sent.append(name)
        self._names.check_complete(sent)

    @torch.no_grad()
    def sequence_logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
        """One forward over prompt + completion; temperature-1 logprobs of the completion."""
        model = self._live_model()
        if not prompt_ids:
            raise ValueError("sequence_logprobs needs a prompt of at least one token")
        if not completion_ids:
            return []
        ids = torch.tensor([prompt_ids + completion_ids], dtype=torch.long, device=self._device)  # [1, T]
        logits: torch.Tensor = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()  # [L, V]
        targets = ids[0, len(prompt_ids) :].unsqueeze(1)  # [L, 1]
        logprobs: list[float] = torch.log_softmax(logits, dim=-1).gather(1, targets).squeeze(1).cpu().tolist()
        return logprobs

    def close(self) -> None:
        """Drop the model; a second close is a no-op."""
        self._model = None
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
