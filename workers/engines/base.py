"""What every inference engine behind the generator worker promises, and the checks they share.

The generator actor (``workers/generator.py``) batches GenerateRequests and hands them to one
``Engine``; it never knows which library samples. Two engines implement the protocol:
``workers.engines.hf.HFEngine`` (transformers ``generate``, runs anywhere) and
``workers.engines.vllm_engine.VLLMEngine`` (vLLM, CPU build or GPU wheel).

The logprob contract is what keeps RL honest: a sample's ``logprobs`` are the numbers the
trainer recomputes for its importance ratio, so both engines return, per sampled token,
``log_softmax(logits / temperature)`` of the weights that sampled it (see each engine for
the one documented exception: vLLM under top-p/top-k truncation). Greedy requests
(temperature 0) report temperature-1 logprobs, since ``logits / 0`` has no distribution.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from protocols.messages import SamplingParams
from yatt.errors import ProtocolError
from yatt.runtime.dtypes import compute_dtype_name

DType = Literal["auto", "float32", "bfloat16", "float16"]

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (vLLM's own threshold, so both engines agree)."""


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One sampled continuation."""

    token_ids: list[int]
    """Generated tokens only; the stop or EOS token is included when it ended the sample."""
    logprobs: list[float]
    """Per token, log p under log_softmax(logits / temperature) of the sampling weights."""
    finish_reason: str
    """"stop" (EOS or a stop token) or "length" (max_new_tokens reached)."""


@dataclass(frozen=True, kw_only=True)
class PromptRequest:
    """Sample ``n`` continuations of one prompt."""

    prompt_ids: list[int]
    """The prompt's token ids (token in, token out: no text anywhere)."""
    n: int
    """How many samples."""
    sampling: SamplingParams
    """How to sample; requests in one call may differ."""
    mm_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """The prompt's images, processed (``GenerateRequest.mm_inputs``); empty for text."""
    images: list[bytes] = field(default_factory=list)
    """The same images encoded (``GenerateRequest.images``), for an engine that runs the
    processor itself (vLLM); the transformers engine reads ``mm_inputs``."""


class Engine(Protocol):
    """An inference engine: sampling with logprobs, and in-place weight updates."""

    def generate(self, requests: Sequence[PromptRequest]) -> list[list[Sample]]:
        """One list of ``n`` samples per request, in request order."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace every weight in place, between ``generate`` calls.

        One call carries the whole state dict (HF ``state_dict`` names, full unsharded
        tensors; a caller with buckets chains them into one iterable). A name the model
        lacks, a wrong shape, or a missing weight raises ``ProtocolError``.
        """
        ...

    def sequence_logprobs(
        self, prompt_ids: list[int], completion_ids: list[int], mm_inputs: dict[str, torch.Tensor] | None = None
    ) -> list[float]:
        """Temperature-1 logprobs of ``completion_ids`` after ``prompt_ids`` (and its images,
        ``mm_inputs``), current weights."""
        ...

    def sleep(self) -> None:
        """Free what the engine can while training runs on its device (KV cache, weights)."""
        ...

    def wake_up(self) -> None:
        """Undo ``sleep`` before the next ``generate`` or ``update_weights``."""
        ...

    def close(self) -> None:
        """Free the model (and any engine processes); later calls raise ``Closed``."""
        ...


def is_greedy(sampling: SamplingParams) -> bool:
    """Temperature 0 (below ``GREEDY_TEMPERATURE``) means greedy decoding."""
    return sampling.temperature < GREEDY_TEMPERATURE


def validate_requests(requests: Sequence[PromptRequest], max_len: int | None) -> None:
    """Reject a request an engine cannot serve, naming the field and the allowed values.

    ``max_len``: the longest prompt + completion the engine serves (None: no limit).
    """
    for i, req in enumerate(requests):
        where, sp = f"requests[{i}]", req.sampling
        if not req.prompt_ids:
            raise ProtocolError(f"{where}.prompt_ids is empty: a prompt needs at least one token")
        if req.n < 1:
            raise ProtocolError(f"{where}.n must be >= 1 (got {req.n})")
        if not sp.temperature >= 0:
            raise ProtocolError(f"{where}.sampling.temperature must be >= 0 (got {sp.temperature})")
        if not 0 < sp.top_p <= 1:
            raise ProtocolError(f"{where}.sampling.top_p must be in (0, 1] (got {sp.top_p})")
        if sp.top_k != -1 and sp.top_k < 1:
            raise ProtocolError(f"{where}.sampling.top_k must be -1 (off) or >= 1 (got {sp.top_k})")
        bad = next((name for name, t in req.mm_inputs.items() if t.dim() < 1 or t.shape[0] < 1), None)
        if bad is not None:
            raise ProtocolError(f"{where}.mm_inputs[{bad!r}] must have a first dimension >= 1 (got shape {tuple(req.mm_inputs[bad].shape)})")
        if sp.max_new_tokens < 1:
            raise ProtocolError(f"{where}.sampling.max_new_tokens must be >= 1 (got {sp.max_new_tokens})")
        if max_len is not None and len(req.prompt_ids) + sp.max_new_tokens > max_len:
            raise ProtocolError(
                f"{where}: prompt ({len(req.prompt_ids)} tokens) + sampling.max_new_tokens "
                f"({sp.max_new_tokens}) exceeds the engine's {max_len} (vllm_max_model_len, or the "
                "model's max_position_embeddings); shorten the prompt or lower max_new_tokens"
            )


def resolve_dtype(dtype: DType | str, device: torch.device) -> torch.dtype:
    """The compute dtype ``model.dtype`` names; ``auto`` is bfloat16 on GPU and on a CPU
    with native bf16 (``cpu_has_bf16``), else float32. Trainer and engines both resolve it
    here, so they compute in the same dtype."""
    resolved: torch.dtype = getattr(torch, compute_dtype_name(dtype, device.type))
    return resolved


class WeightNames:
    """The HF ``state_dict`` names and shapes of a model, tied aliases grouped.

    A weight update must name each tensor at least once; tied weights (e.g. the input
    embedding and an lm_head that shares it) are one tensor under two names, and either
    name satisfies both.
    """

    def __init__(self, model: torch.nn.Module, *, only: Callable[[str], bool] | None = None) -> None:
        """``only``: the names an update carries (LoRA: the adapters); every other is refused."""
        # keep_vars: tied names map to the same Parameter object, on any device (meta too).
        groups: dict[int, list[str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, tensor in model.state_dict(keep_vars=True).items():
            if only is not None and not only(name):
                continue
            groups.setdefault(id(tensor), []).append(name)
            self.shapes[name] = tuple(tensor.shape)
        self.groups = [tuple(names) for names in groups.values()]

    def check_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Raise ``ProtocolError`` unless ``name`` is a weight of this shape, all finite."""
        shape = self.shapes.get(name)
        if shape is None:
            example = next(iter(self.shapes), "")
            raise ProtocolError(
                f"weight update names {name!r}, which the model does not have; "
                f"send the HF state_dict names (e.g. {example!r})"
            )
        if tuple(tensor.shape) != shape:
            raise ProtocolError(
                f"weight update {name!r} has shape {tuple(tensor.shape)}, the model's is {shape}"
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ProtocolError(f"weight update {name!r} holds NaN or inf; the engine keeps its weights")

    def check_complete(self, sent: Iterable[str]) -> None:
        """Raise ``ProtocolError`` if some weight got no tensor."""
        got = set(sent)
        missing = [names[0] for names in self.groups if not got.intersection(names)]
        if missing:
            raise ProtocolError(
                f"weight update lacks {len(missing)} of {len(self.groups)} tensors "
                f"(first: {missing[:3]}); one update_weights call must carry the whole state dict"
            )


def stop_string_end(tokenizer: Any, token_ids: Sequence[int], stops: Sequence[str]) -> int | None:
    """How many of ``token_ids`` a sample keeps when it stops on one of ``stops``: up to
    and including the token that completes the first stop string to appear (whole tokens:
    text after the string within that token stays, as vLLM's ``include_stop_str_in_output``
    keeps it); None when no stop string appears. A prefix's text containing a stop string
    only grows with the prefix, so a binary search decodes log2(L) prefixes."""

    def within(n: int) -> bool:
        text = tokenizer.decode(list(token_ids[:n]), skip_special_tokens=False)
        return any(stop in text for stop in stops)

    if not stops or not within(len(token_ids)):
        return None
    low, high = 1, len(token_ids)  # within(high) holds
    while low < high:
        mid = (low + high) // 2
        if within(mid):
            high = mid
        else:
            low = mid + 1
    return low
