"""The transformers engine: batched ``generate`` with a KV cache, on any device.

It is the engine that runs everywhere (CI, a CPU-only box, a GPU without vLLM) and the
reference the vLLM engine is checked against. Requests with equal sampling parameters go
into one ``generate`` call (prompts left-padded, each repeated ``n`` times), seeded or
not. Every row samples with an RNG of its own, seeded from its request's seed and its
index in the request (``_RowSampler``, the Gumbel-max trick), so a seeded request's
samples do not depend on what else was batched with it; requests without a seed draw one
from a stream seeded by ``GeneratorConfig.seed``, so a whole run is reproducible too.
A request's n rows share one prefill of its prompt (``_shared_prefill``: the prompt's KV
cache computed once and repeated n times; ``prompt_tokens_saved`` counts what that spared),
as vLLM's prefix cache does for it.

Logprobs come from ``output_logits=True``: the raw logits of every step (before any
temperature, top-k or top-p warper), then ``log_softmax(logits / temperature)`` gathered
at the sampled token, which is exactly what the trainer recomputes. Memory: transformers
holds those logits for the whole call, rows x new tokens x vocab x 4 bytes.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
)
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from workers.engines.base import (
    DType,
    PromptRequest,
    Sample,
    WeightNames,
    is_greedy,
    resolve_dtype,
    stop_string_end,
    validate_requests,
)
from workers.lora import is_adapter, with_lora
from workers.models import ImageTokens, load_model, without_placeholders
from yatt.errors import Closed, ConfigError, ProtocolError
from yatt.rl.config import GeneratorConfig, LoRAConfig

# What requests must share to go into one generate call: every sampling parameter but the seed.
_GroupKey = tuple[object, ...]


def row_seed(seed: int, index: int) -> int:
    """The RNG seed of sample ``index`` of a request seeded with ``seed``."""
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


class _RowSampler(LogitsProcessor):
    """Samples every row from softmax(scores / T), after top-k and top-p, with the row's own
    RNG. Gumbel-max: argmax(scores / T + G), G standard Gumbel noise, is exactly such a
    sample, so ``generate`` runs greedy over what this returns, and a row's draws depend on
    its seed and its own logits only, never on its batch neighbours."""

    def __init__(self, seeds: list[int], *, temperature: float, top_k: int, top_p: float, device: torch.device) -> None:
        self._generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self._temperature = temperature
        self._warpers: list[LogitsProcessor] = []
        if top_k > 0:
            self._warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            self._warpers.append(TopPLogitsWarper(top_p))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scaled: Any = scores.float() / self._temperature  # [R, V]
        for warper in self._warpers:
            scaled = warper(input_ids, scaled)  # masked tokens: -inf
        vocab = scaled.shape[-1]
        uniform = torch.stack(
            [torch.rand(vocab, generator=g, device=scaled.device) for g in self._generators]
        )  # [R, V] in [0, 1)
        gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-20)))
        out: torch.FloatTensor = scaled + gumbel
        return out


class _Never(LogitsProcessor):
    """A vision-language model's image placeholder tokens are never sampled
    (``workers.models.placeholder_token_ids``): their scores go to ``NEVER_SAMPLED``."""

    def __init__(self, token_ids: torch.Tensor) -> None:
        self._ids = token_ids

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return cast(torch.FloatTensor, without_placeholders(scores, self._ids))


def _rows_mm_inputs(per_request: list[dict[str, torch.Tensor]], rows: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """The images of a call's rows: each request's tensors repeated for its ``rows``, each
    name's concatenated along the first dimension in row order; {} when no request has any."""
    names = sorted({name for mm in per_request for name in mm})
    return {
        name: torch.cat([mm[name] for mm, n in zip(per_request, rows, strict=True) if mm for _ in range(n)]).to(device)
        for name in names
    }


def _as_list(ids: int | list[int] | None) -> list[int]:
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else list(ids)


class HFEngine:
    """transformers ``AutoModelForCausalLM`` behind the ``Engine`` protocol."""

    def __init__(
        self, model_path: str, config: GeneratorConfig, *, device: str = "cpu", dtype: DType = "auto",
        lora: LoRAConfig | None = None,
    ) -> None:
        """``lora``: wrap the model in the trainer's LoRA adapters (``workers.lora``); weight
        updates then carry, and must carry, the adapters only."""
        self._device = torch.device(device)
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"generator device {device!r} needs CUDA, which this machine lacks; use 'cpu'")
        self._dtype = resolve_dtype(dtype, self._device)
        # Any: transformers 5.19's own annotations of generate() and to() do not type-check.
        model: Any = load_model(model_path, dtype=self._dtype)  # a causal LM, or a vision-language model
        if lora is not None and lora.rank:
            model = with_lora(model, lora)
        model.to(self._device).eval()
        self._setup(model, config, tokenizer_path=model_path)
        if lora is not None and lora.rank:
            self._names = WeightNames(model, only=is_adapter)

    @classmethod
    def on_module(
        cls, model: torch.nn.Module, config: GeneratorConfig, *, device: torch.device, tokenizer_path: str | None = None
    ) -> HFEngine:
        """An engine that generates with ``model`` itself, e.g. a trainer rank's own policy
        (the colocated layout): no copy of the weights, so ``update_weights`` is never needed;
        the caller makes the module's full weights available around ``generate`` calls.
        ``tokenizer_path``: where stop strings find the tokenizer (none: stop strings refused)."""
        engine = cls.__new__(cls)
        engine._device = device
        engine._dtype = next(model.parameters()).dtype
        engine._setup(model, config, tokenizer_path=tokenizer_path)
        return engine

    def _setup(self, model: Any, config: GeneratorConfig, *, tokenizer_path: str | None) -> None:
        self._model: Any = model
        self._tokenizer_path = tokenizer_path
        self._tokenizer: Any = None  # loaded at the first request with stop strings
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
        self._max_len: int | None = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self._images = ImageTokens(model, self._device)  # a VLM's image tokens: never sampled
        self._seeds = random.Random(config.seed)
        self.prompt_tokens_saved = 0  # prompt tokens not prefilled again for a request's other samples

    def _live_model(self) -> Any:
        if self._model is None:
            raise Closed("HFEngine is closed")
        return self._model

    def generate(self, requests: Sequence[PromptRequest]) -> list[list[Sample]]:
        """Sample every request; equal sampling parameters share one ``generate`` call."""
        self._live_model()
        validate_requests(requests, self._max_len)
        with_images = next((i for i, r in enumerate(requests) if r.mm_inputs), None)
        if with_images is not None and not self._images.vision:
            raise ProtocolError(
                f"requests[{with_images}] carries images (mm_inputs), but this engine's model is a text model; "
                "serve a vision-language model (model.path)"
            )
        groups: dict[_GroupKey, list[int]] = {}
        for i, req in enumerate(requests):
            sp = req.sampling
            key: _GroupKey = (sp.temperature, sp.top_p, sp.top_k, sp.max_new_tokens, tuple(sp.stop_token_ids), tuple(sp.stop))
            groups.setdefault(key, []).append(i)
        seeds = [r.sampling.seed if r.sampling.seed is not None else self._seeds.getrandbits(63) for r in requests]
        results: list[list[Sample]] = [[] for _ in requests]
        for indices in groups.values():
            samples = self._generate_group([requests[i] for i in indices], [seeds[i] for i in indices])
            for i, group_samples in zip(indices, samples, strict=True):
                results[i] = group_samples
        return results

    @torch.no_grad()
    def _generate_group(self, requests: list[PromptRequest], seeds: list[int]) -> list[list[Sample]]:
        """One ``generate`` call for requests that share their sampling parameters."""
        model = self._live_model()
        sp = requests[0].sampling
        greedy = is_greedy(sp)
        # Greedy samples are identical: decode each prompt once and copy it n times.
        rows = [1 if greedy else r.n for r in requests]
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((sum(rows), width), self._pad_id, dtype=torch.long)  # [R, T]
        attention_mask = torch.zeros((sum(rows), width), dtype=torch.long)  # [R, T]
        first_row = [sum(rows[:p]) for p in range(len(requests))]
        for p, req in enumerate(requests):
            span = slice(first_row[p], first_row[p] + rows[p])
            input_ids[span, width - len(req.prompt_ids) :] = torch.tensor(req.prompt_ids, dtype=torch.long)
            attention_mask[span, width - len(req.prompt_ids) :] = 1
        stop_ids = sorted(set(self._eos_ids) | set(sp.stop_token_ids))
        gen_config = GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=False,  # greedy over _RowSampler's noisy scores = sampling
            max_new_tokens=sp.max_new_tokens,
            eos_token_id=stop_ids or None,
            pad_token_id=self._pad_id,
            return_dict_in_generate=True,
            output_logits=True,
            stop_strings=list(sp.stop) or None,
        )
        never = self._images.never
        processors = LogitsProcessorList([_Never(never)] if never is not None else [])
        if not greedy:
            processors.append(
                _RowSampler(
                    [row_seed(seed, k) for seed, n in zip(seeds, rows, strict=True) for k in range(n)],
                    temperature=sp.temperature,
                    top_k=0 if sp.top_k == -1 else sp.top_k,
                    top_p=sp.top_p,
                    device=self._device,
                )
            )
        input_ids, attention_mask = input_ids.to(self._device), attention_mask.to(self._device)
        # The rows' images in row order (each of a request's rows repeats its prompt's), as a
        # processor batches them; with images every row prefills (the model merges them there).
        mm = self._images.inputs(input_ids, _rows_mm_inputs([r.mm_inputs for r in requests], rows, self._device))
        shared = None if mm else self._shared_prefill(input_ids, attention_mask, first_row, rows)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=gen_config,
            logits_processor=processors,
            synced_gpus=False,  # an FSDP module generates on each rank alone (colocated layout)
            past_key_values=shared,
            **({"tokenizer": self._stop_tokenizer()} if sp.stop else {}),
            **mm,
        )
        if shared is not None:
            self.prompt_tokens_saved += sum((n - 1) * (len(r.prompt_ids) - 1) for r, n in zip(requests, rows, strict=True))
        new_tokens = out.sequences[:, width:]  # [R, L] int64, pad after a row's stop token
        temperature = 1.0 if greedy else sp.temperature
        logprobs = torch.stack(
            [
                torch.log_softmax(self._images.masked(step_logits.float()) / temperature, dim=-1)
                .gather(1, new_tokens[:, t : t + 1])
                .squeeze(1)  # [R]
                for t, step_logits in enumerate(out.logits)  # L x [R, V] raw logits
            ],
            dim=1,
        ).cpu()  # [R, L] float32
        stop_set = set(stop_ids)
        samples: list[list[Sample]] = []
        for p, req in enumerate(requests):
            group = []
            for k in range(req.n):
                r = first_row[p] + (0 if greedy else k)
                tokens = new_tokens[r].tolist()
                # Cut after the first stop token or the token completing a stop string: what
                # follows is padding.
                end = next((t + 1 for t, tok in enumerate(tokens) if tok in stop_set), None)
                if sp.stop and (at := stop_string_end(self._stop_tokenizer(), tokens[: end or len(tokens)], sp.stop)):
                    end = at
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

    def _shared_prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, first_row: list[int], rows: list[int]) -> Any:
        """The KV cache of every row's prompt but its last token, each prompt computed once
        and its cache repeated for its ``n`` rows (the n samples of a request share their
        prompt: computed n times, it is n-1 prefills wasted); ``generate`` goes on from it
        with the prompts' last tokens. None (``generate`` prefills every row) where no
        prompt has two rows or prompts are one token."""
        if max(rows) < 2 or input_ids.shape[1] < 2:
            return None
        ids, mask = input_ids[first_row, :-1], attention_mask[first_row, :-1]  # [P, T-1] each prompt once
        # Positions as generate computes them for left-padded rows: counted from each row's first real token.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = self._live_model()(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True).past_key_values
        if not callable(getattr(cache, "reorder_cache", None)):  # (a model whose cache cannot be repeated: each row prefills)
            return None
        cache.reorder_cache(torch.repeat_interleave(torch.arange(len(rows), device=ids.device), torch.tensor(rows, device=ids.device)))
        return cache

    def _stop_tokenizer(self) -> Any:
        """The model's tokenizer, which stop strings need (transformers' ``StopStringCriteria``)."""
        if self._tokenizer is None:
            if self._tokenizer_path is None:
                raise ProtocolError("this engine has no tokenizer, so it cannot stop on strings; send stop_token_ids")
            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
        return self._tokenizer

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every tensor into the model in place (any dtype or device: ``copy_`` converts).

        All or nothing: every name, shape and value is checked (a bad name or shape, a
        missing weight, NaN or inf raise ``ProtocolError``) before the first copy, so a
        refused update leaves the model on its old weights.
        """
        model = self._live_model()
        params = model.state_dict()
        update: list[tuple[str, torch.Tensor]] = []
        for name, tensor in named_tensors:
            self._names.check_tensor(name, tensor)
            update.append((name, tensor))
        self._names.check_complete([name for name, _ in update])
        with torch.no_grad():
            for name, tensor in update:
                params[name].copy_(tensor)

    @torch.no_grad()
    def sequence_logprobs(
        self, prompt_ids: list[int], completion_ids: list[int], mm_inputs: dict[str, torch.Tensor] | None = None
    ) -> list[float]:
        """One forward over prompt + completion (and the prompt's images); temperature-1
        logprobs of the completion."""
        model = self._live_model()
        if not prompt_ids:
            raise ValueError("sequence_logprobs needs a prompt of at least one token")
        if not completion_ids:
            return []
        ids = torch.tensor([prompt_ids + completion_ids], dtype=torch.long, device=self._device)  # [1, T]
        mm = self._images.inputs(ids, {name: t.to(self._device) for name, t in (mm_inputs or {}).items()})
        logits: torch.Tensor = model(input_ids=ids, **mm).logits[0, len(prompt_ids) - 1 : -1].float()  # [L, V]
        logits = self._images.masked(logits)
        targets = ids[0, len(prompt_ids) :].unsqueeze(1)  # [L, 1]
        logprobs: list[float] = torch.log_softmax(logits, dim=-1).gather(1, targets).squeeze(1).cpu().tolist()
        return logprobs

    def sleep(self) -> None:
        """Between phases nothing is cached (each call builds its KV cache); on GPU, return
        the cached blocks of the last call to the device so training can use them."""
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Nothing to restore: the weights never left."""

    def close(self) -> None:
        """Drop the model; a second close is a no-op."""
        self._model = None
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
