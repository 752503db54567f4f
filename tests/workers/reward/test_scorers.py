"""The reward mix: every scorer on hand-written cases, the weighted sum, and time limits.

Rules are called directly for their cases (they are plain picklable callables) and
through ``RewardMix`` (its spawned process pool) for the mix, hangs, errors and crashes.
Model scorers run on tiny models built here: a one-output Llama classifier as reward
model, the tiny causal Llama as judge (its verdicts are gibberish, so the verdict parser
is tested on hand-written strings and the judge end to end for plumbing only).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import reasoning_gym
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForSequenceClassification,
)

from tests.processes import assert_gone
from workers.models import build_tiny_model, build_tokenizer
from workers.reward.model_scorers import Judge, parse_verdict
from workers.reward.score_types import Outcome, ScoreInput
from workers.reward.scorers import (
    Custom,
    ExactMatch,
    FormatRegex,
    MathVerify,
    ReasoningGym,
    RewardMix,
    ScorerPool,
    _ThreadedModel,
    check_custom_scorers,
    final_answer,
)
from yatt.errors import Closed, ConfigError
from yatt.rl.config import RewardConfig, ScorerConfig
from yatt.runtime.configtools import build

ROOT = Path(__file__).resolve().parents[3]

FIXTURES = "tests.workers.reward.scorer_fixtures"


def sample(
    completion: str, prompt: str = "<|user|>What is 6 * 7?\n<|assistant|>", **metadata: str
) -> ScoreInput:
    return ScoreInput(prompt=prompt, completion=completion, metadata=metadata, finish_reason="stop")


@pytest.fixture
def mixes() -> Iterator[list[RewardMix]]:
    """Collects the mixes a test makes and closes them (their pool processes) afterwards."""
    made: list[RewardMix] = []
    yield made
    for mix in made:
        mix.close()


def make(mixes: list[RewardMix], *scorers: ScorerConfig, timeout_s: float = 10.0, **kw: object) -> RewardMix:
    mix = RewardMix(RewardConfig(scorers=list(scorers), timeout_s=timeout_s, processes=2), **kw)  # type: ignore[arg-type]
    mixes.append(mix)
    return mix


# ---------------------------------------------------------------- rules, called directly


def test_final_answer_extraction() -> None:
    assert final_answer("so \\boxed{42}.") == "42"
    assert final_answer("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"  # last box, nested braces
    assert final_answer("work\nAnswer:  17 \nthat is all") == "17"
    assert final_answer("answer: 3\nANSWER: 4") == "4"
    assert final_answer("  plain 5 \n") == "plain 5"
    assert final_answer("\\boxed{unclosed answer: 9") == "9"  # an unbalanced box falls through


def test_math_verify_compares_math_not_text() -> None:
    rule = MathVerify("answer")
    assert rule(sample("The answer is \\boxed{1/2}", answer="0.5")) == 1.0
    assert rule(sample("so $\\frac{1}{2}$", answer="0.5")) == 1.0
    assert rule(sample("\\boxed{1+x}", answer="x+1")) == 1.0
    assert rule(sample("The answer is \\boxed{1/3}", answer="0.5")) == 0.0
    assert rule(sample("no number here", answer="0.5")) == 0.0
    with pytest.raises(KeyError, match="set answer_key"):
        rule(sample("\\boxed{1}", solution="1"))


def test_exact_match_uses_the_final_answer() -> None:
    rule = ExactMatch("answer")
    assert rule(sample("6 * 7 = 42. Answer: 42", answer=" 42 ")) == 1.0
    assert rule(sample("\\boxed{42}", answer="42")) == 1.0
    assert rule(sample("Answer: 42.0", answer="42")) == 0.0  # exact, not numeric
    assert ExactMatch("gold")(sample("yes", gold="yes")) == 1.0


def test_format_regex_searches_across_lines() -> None:
    rule = FormatRegex(r"^<think>.*</think>\s*Answer:")
    assert rule(sample("<think>six\ntimes seven</think>\nAnswer: 42")) == 1.0
    assert rule(sample("Answer: 42")) == 0.0


def test_reasoning_gym_scores_with_the_task() -> None:
    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=7)[0]
    raw = json.dumps(entry)
    rule = ReasoningGym()
    assert (
        rule(sample(f"thinking... <answer>{entry['answer']}</answer>", task="basic_arithmetic", entry=raw))
        == 1.0
    )
    wrong = str(int(entry["answer"]) + 1)
    assert rule(sample(f"<answer>{wrong}</answer>", task="basic_arithmetic", entry=raw)) == 0.0
    assert rule(sample(f"{entry['answer']} without tags", entry=raw)) == 0.0  # task from the entry
    with pytest.raises(KeyError, match="entry"):
        rule(sample("<answer>1</answer>", task="basic_arithmetic"))


def test_custom_functions_sync_and_async() -> None:
    assert Custom(f"{FIXTURES}:length_tenths")(sample("abcde")) == 0.5
    assert Custom(f"{FIXTURES}.async_length_tenths")(sample("abcdefghij")) == 1.0
    with pytest.raises(TypeError, match="must return a float"):
        Custom(f"{FIXTURES}:return_text")(sample("x"))


# ---------------------------------------------------------------- the mix over the pool


async def test_weighted_mix_of_two_scorers(mixes: list[RewardMix]) -> None:
    mix = make(
        mixes,
        ScorerConfig(kind="exact_match", weight=0.7),
        ScorerConfig(kind="format_regex", name="format", pattern=r"<think>.*</think>", weight=0.3),
    )
    batch = [
        sample("<think>6*7</think> Answer: 42", answer="42"),
        sample("Answer: 41", answer="42"),
        sample("<think>\n</think>Answer: 41", answer="42"),
        sample("Answer: 42", answer="42"),
    ]
    results = await mix.score(batch)
    assert [r.reward for r in results] == pytest.approx([1.0, 0.0, 0.3, 0.7])
    assert [r.components for r in results] == [
        {"exact_match": 1.0, "format": 1.0},
        {"exact_match": 0.0, "format": 0.0},
        {"exact_match": 0.0, "format": 1.0},
        {"exact_match": 1.0, "format": 0.0},
    ]
    assert [r.failure for r in results] == ["", "", "", ""]


async def test_every_rule_kind_runs_in_the_pool(mixes: list[RewardMix]) -> None:
    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=3)[0]
    mix = make(
        mixes,
        ScorerConfig(kind="math_verify", weight=0.5),
        ScorerConfig(kind="reasoning_gym", weight=0.25),
        ScorerConfig(kind="custom", name="length", function=f"{FIXTURES}:async_length_tenths", weight=0.1),
    )
    right = f"It is \\boxed{{{entry['answer']}}}, so <answer>{entry['answer']}</answer>"
    meta = {"answer": entry["answer"], "entry": json.dumps(entry)}
    results = await mix.score(
        [
            ScoreInput(prompt="p", completion=right, metadata=meta, finish_reason="stop"),
            ScoreInput(prompt="p", completion="<answer>x</answer>", metadata=meta, finish_reason="length"),
        ]
    )
    assert results[0].components == {"math_verify": 1.0, "reasoning_gym": 1.0, "length": len(right) / 10}
    assert results[0].reward == pytest.approx(0.5 + 0.25 + 0.1 * len(right) / 10)
    assert results[1].components == {"math_verify": 0.0, "reasoning_gym": 0.0, "length": 1.8}
    assert results[1].reward == pytest.approx(0.18)
    assert [r.failure for r in results] == ["", ""]


def _process_gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(")")[-1].split()[0] in ("Z", "X")  # a zombie has stopped too
    except FileNotFoundError:
        return True


async def test_hanging_scorer_times_out_and_the_mix_keeps_serving(
    mixes: list[RewardMix], tmp_path: Path
) -> None:
    mix = make(
        mixes,
        ScorerConfig(kind="custom", function=f"{FIXTURES}:hang_on_request"),
        ScorerConfig(kind="exact_match"),
        timeout_s=1.0,
    )
    pid_file = tmp_path / "hung.pid"
    batch = [sample("Answer: 42", answer="42", hang=str(pid_file))] + [
        sample(f"Answer: {i}", answer="42") for i in (41, 42, 43)
    ]
    results = await mix.score(batch)
    assert results[0].components == {"custom": 0.0, "exact_match": 1.0}
    assert results[0].failure == "custom: timed out after 1.0s"
    assert results[0].reward == 1.0
    # The samples that shared the killed pool were re-submitted and scored.
    assert [r.components for r in results[1:]] == [
        {"custom": 1.0, "exact_match": 0.0},
        {"custom": 1.0, "exact_match": 1.0},
        {"custom": 1.0, "exact_match": 0.0},
    ]
    assert [r.failure for r in results[1:]] == ["", "", ""]
    # The hung process was killed, not left behind.
    hung = int(pid_file.read_text())
    for _ in range(200):
        if _process_gone(hung):
            break
        time.sleep(0.05)
    assert _process_gone(hung), f"the hung scorer process {hung} is still running"
    # The next batch is served by the fresh pool.
    again = await mix.score([sample("Answer: 42", answer="42"), sample("Answer: 7", answer="42")])
    assert [r.reward for r in again] == [2.0, 1.0]
    assert [r.failure for r in again] == ["", ""]


async def test_raising_scorer_records_type_and_message(mixes: list[RewardMix]) -> None:
    mix = make(
        mixes,
        ScorerConfig(kind="custom", name="grader", function=f"{FIXTURES}:raise_value_error", weight=2.0),
        ScorerConfig(kind="custom", name="typed", function=f"{FIXTURES}:return_text"),
        ScorerConfig(kind="custom", name="nan", function=f"{FIXTURES}:return_nan"),
        ScorerConfig(kind="exact_match", answer_key="gold", weight=0.5),
        ScorerConfig(kind="math_verify", name="math", answer_key="gold"),
    )
    results = await mix.score([sample("Answer: 5", gold="5"), sample("Answer: 6")])
    assert results[0].components == {"grader": 0.0, "typed": 0.0, "nan": 0.0, "exact_match": 1.0, "math": 1.0}
    assert results[0].reward == 1.5
    assert results[0].failure == (
        "grader: ValueError: cannot grade 'Answer: 5'; "
        f"typed: TypeError: {FIXTURES}:return_text returned 'high'; a custom scorer must return a float; "
        "nan: score is nan, not a finite number"
    )
    # A sample without the reference answer fails the verifiers with the fix in the reason.
    assert results[1].reward == 0.0
    assert "exact_match: KeyError:" in results[1].failure and "set answer_key" in results[1].failure
    assert "math: KeyError:" in results[1].failure


async def test_a_batch_is_one_call_per_process_and_the_limit_stays_per_sample(
    mixes: list[RewardMix], monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 samples on 2 processes: 2 calls of 4. Two samples of 0.6 s in one call (1.2 s) pass
    a 1 s limit, each being under it; a sample of 1.5 s in a call fails alone, its neighbours
    scored in the fresh pool."""
    calls: list[int] = []
    attempt = ScorerPool._attempt

    async def counted(self: ScorerPool, rule: Any, samples: Sequence[ScoreInput], timeout_s: float, slot: int) -> Any:
        calls.append(len(samples))
        return await attempt(self, rule, samples, timeout_s, slot)

    monkeypatch.setattr(ScorerPool, "_attempt", counted)
    mix = make(mixes, ScorerConfig(kind="custom", name="slow", function=f"{FIXTURES}:sleep_on_request"), timeout_s=1.0)
    results = await mix.score([sample(f"Answer: {i}") for i in range(8)])
    assert sorted(calls) == [4, 4] and [r.reward for r in results] == [1.0] * 8

    calls.clear()
    results = await mix.score([sample("a", sleep="0.6") for _ in range(4)])
    assert sorted(calls) == [2, 2]
    assert [r.failure for r in results] == [""] * 4 and [r.reward for r in results] == [1.0] * 4

    calls.clear()
    results = await mix.score([sample("a"), sample("b", sleep="1.5"), sample("c"), sample("d")])
    assert [r.failure for r in results] == ["", "slow: timed out after 1.0s", "", ""]
    assert [r.reward for r in results] == [1.0, 0.0, 1.0, 1.0]
    assert sorted(calls)[-2:] == [2, 2] and len(calls) >= 3  # "a" went to the fresh pool again


async def test_crashing_scorer_fails_alone(mixes: list[RewardMix]) -> None:
    mix = make(
        mixes,
        ScorerConfig(kind="custom", function=f"{FIXTURES}:exit_on_request"),
        ScorerConfig(kind="exact_match"),
    )
    batch = [sample("Answer: 42", answer="42", exit="3")] + [
        sample(f"Answer: {i}", answer="42") for i in (42, 43)
    ]
    results = await mix.score(batch)
    assert results[0].components == {"custom": 0.0, "exact_match": 1.0}
    assert results[0].failure.startswith("custom: ActorFailed: its pool process died running it alone")
    # The calls that the crash took down with it were re-run and scored.
    assert [r.components for r in results[1:]] == [
        {"custom": 1.0, "exact_match": 1.0},
        {"custom": 1.0, "exact_match": 0.0},
    ]
    assert [r.failure for r in results[1:]] == ["", ""]
    again = await mix.score([sample("Answer: 42", answer="42")])
    assert again[0].reward == 2.0 and again[0].failure == ""


@pytest.mark.parametrize(
    ("function", "reason"),
    [
        ("tests.workers.no_such_module:f", "ModuleNotFoundError"),
        (f"{FIXTURES}:no_such_function", "has no attribute 'no_such_function'"),
        (f"{FIXTURES}:NOT_A_FUNCTION", "not a function"),
        ("no_separator", "is not of the form"),
    ],
)
def test_bad_custom_path_names_the_field(function: str, reason: str) -> None:
    config = RewardConfig(
        scorers=[ScorerConfig(kind="exact_match"), ScorerConfig(kind="custom", function=function)]
    )
    with pytest.raises(ConfigError, match=r"reward\.scorers\[1\]\.function") as info:
        RewardMix(config)
    assert reason in str(info.value) and "package.module:function" in str(info.value)


async def test_a_trl_style_reward_is_called_with_the_prompts_fields(mixes: list[RewardMix]) -> None:
    mix = make(mixes, ScorerConfig(kind="custom", name="trl", function=f"{FIXTURES}:trl_exact"))
    results = await mix.score([sample("so 42", answer="42"), sample("so 41", answer="42")])
    assert [r.components["trl"] for r in results] == [1.0, 0.0] and [r.failure for r in results] == ["", ""]


def test_reward_signatures_are_checked_before_anything_starts() -> None:
    def config(function: str) -> RewardConfig:
        return RewardConfig(scorers=[ScorerConfig(kind="custom", function=f"{FIXTURES}:{function}")])

    check_custom_scorers(config("trl_exact"), {"answer"})
    check_custom_scorers(config("length_tenths"), set())
    with pytest.raises(ConfigError, match=r"reward\.scorers\[0\]\.function .* needs \['solution'\].*\['answer'\]"):
        check_custom_scorers(config("trl_needs_solution"), {"answer"})
    with pytest.raises(ConfigError, match=r"signature is \(prompt, completion\); .*f\(prompt, completion, metadata\).*TRL"):
        check_custom_scorers(config("two_arguments"), {"answer"})


async def test_a_scorer_failing_on_most_samples_says_so_with_its_traceback(mixes: list[RewardMix]) -> None:
    mix = make(mixes, ScorerConfig(kind="custom", name="flaky", function=f"{FIXTURES}:fail_sometimes"))
    await mix.score([sample("fail")] * 8 + [sample("ok")] * 8)  # half of 16: at the bound, not past it
    assert mix.failing() == ""
    await mix.score([sample("fail")])
    why = mix.failing()
    assert why.startswith("reward scorer 'flaky' (custom tests.workers.reward.scorer_fixtures:fail_sometimes) failed on 9 of its last 17")
    assert "reward.max_failure_share = 0.5" in why
    assert "Traceback" in why and "in fail_sometimes" in why and "ZeroDivisionError" in why  # from the pool process
    await mix.score([sample("ok")] * 64)  # the window moves on
    assert mix.failing() == ""


def test_bad_mix_configs_are_rejected() -> None:
    """As the config loads (before any process starts, and so before a mix is made)."""
    twice = {"scorers": [{"kind": "exact_match"}, {"kind": "exact_match"}]}
    with pytest.raises(ConfigError, match=r"reward\.scorers\[1\]\.name 'exact_match' is already used"):
        build(RewardConfig, twice, "reward")
    regex = {"scorers": [{"kind": "format_regex", "pattern": "(unclosed"}]}
    with pytest.raises(ConfigError, match=r"reward\.scorers\[0\]\.pattern .* is not a valid regex"):
        build(RewardConfig, regex, "reward")


async def test_closed_mix_refuses_to_score(mixes: list[RewardMix]) -> None:
    mix = make(mixes, ScorerConfig(kind="exact_match"))
    assert (await mix.score([sample("Answer: 1", answer="1")]))[0].reward == 1.0
    mix.close()
    with pytest.raises(Closed):
        await mix.score([sample("Answer: 1", answer="1")])


# ---------------------------------------------------------------- model scorers


def save_classifier(out: Path, num_labels: int) -> Path:
    """A tiny Llama sequence classifier with ``num_labels`` outputs, and the tiny tokenizer."""
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.num_labels = num_labels
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(out)  # type: ignore[no-untyped-call]
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_classifier(tmp_path_factory.mktemp("reward_model"), num_labels=1)


async def test_reward_model_scores_batched_like_one_by_one(
    mixes: list[RewardMix], reward_model_dir: Path
) -> None:
    mix = make(
        mixes, ScorerConfig(kind="reward_model", name="rm", model_path=str(reward_model_dir), batch_size=2)
    )
    batch = [sample("42"), sample("it is forty two, I think"), sample("six times seven equals 42 so 42")]
    results = await mix.score(batch)
    # Unbatched forward passes of the same model, no padding involved.
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    with torch.no_grad():
        expected = [
            float(model(**tokenizer(s.prompt + s.completion, return_tensors="pt")).logits[0, 0])
            for s in batch
        ]
    assert [r.components["rm"] for r in results] == pytest.approx(expected, abs=1e-5)
    assert [r.reward for r in results] == pytest.approx(expected, abs=1e-5)
    assert len(set(expected)) == 3 and [r.failure for r in results] == ["", "", ""]


def test_reward_model_with_several_labels_is_rejected(tmp_path: Path) -> None:
    save_classifier(tmp_path, num_labels=2)
    reward = RewardConfig(scorers=[ScorerConfig(kind="reward_model", model_path=str(tmp_path))])
    with pytest.raises(ConfigError, match=r"reward\.scorers\[0\]\.model_path .* num_labels=2"):
        RewardMix(reward)
    missing = RewardConfig(scorers=[ScorerConfig(kind="reward_model", model_path=str(tmp_path / "nowhere"))])
    with pytest.raises(ConfigError, match=r"reward\.scorers\[0\]\.model_path .* cannot be loaded"):
        RewardMix(missing)


def test_verdict_parser_on_hand_written_verdicts() -> None:
    assert parse_verdict("score: 0.7") == 0.7
    assert parse_verdict("The answer is right. Score = 1") == 1.0
    assert parse_verdict("score: 0.2 ... on reflection, SCORE: .9") == 0.9  # the last one counts
    assert parse_verdict("Yes, it matches.") == 1.0
    assert parse_verdict("  no") == 0.0
    assert parse_verdict("0.25") == 0.25
    assert parse_verdict(" 1. ") == 1.0
    for bad in ("score: 7", "-0.5", "maybe", "nothing 0.5 here", "yesterday", ""):
        with pytest.raises(ValueError, match="verdict"):
            parse_verdict(bad)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("judge"))


async def test_judge_end_to_end_on_the_tiny_model(mixes: list[RewardMix], judge_dir: Path) -> None:
    judge_config = ScorerConfig(
        kind="judge", model_path=str(judge_dir), judge_samples=3, judge_max_new_tokens=8
    )
    batch = [sample("Answer: 42", answer="42"), sample("Answer: 41", answer="42")]
    # k sampled verdicts per sample (the random model writes gibberish).
    judge = Judge(judge_config, tokenizer_path=None, field="reward.scorers[0]")
    try:
        verdicts = judge.verdicts(batch)
    finally:
        judge.close()
    assert [len(v) for v in verdicts] == [3, 3] and all(isinstance(t, str) for v in verdicts for t in v)
    results = await make(mixes, judge_config).score(batch)
    for r in results:
        assert 0.0 <= r.components["judge"] <= 1.0 and r.reward == r.components["judge"]
        # Each unparsable verdict is a failed judge sample, counted and recorded.
        assert r.failure == "" or (
            r.failure.startswith("judge: ") and "/3 verdicts failed, first: " in r.failure
        )
    assert any("unparsable verdict" in r.failure for r in results)


def test_judge_template_with_unknown_field_is_rejected(judge_dir: Path) -> None:
    config = {"kind": "judge", "model_path": str(judge_dir), "judge_template": "Grade {completion} for {user}"}
    with pytest.raises(ConfigError, match=r"reward\.scorers\[0\]\.judge_template .*KeyError: 'user'"):
        build(RewardConfig, {"scorers": [config]}, "reward")


@pytest.mark.parametrize("threads", [1, 2])
def test_pool_processes_die_with_a_killed_reward_worker(tmp_path: Path, threads: int) -> None:
    """A reward worker SIGKILLed (no cleanup runs) must not leave its pool behind. Its pool
    is forked while it runs one thread (no interpreter start), spawned when it runs more."""
    script = (
        "import threading, time\n"
        "from workers.reward.scorers import RewardMix\n"
        "from yatt.rl.config import RewardConfig, ScorerConfig\n"
        f"for _ in range({threads} - 1):\n"
        "    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
        "mix = RewardMix(RewardConfig(scorers=[ScorerConfig(kind='exact_match')], processes=2))\n"
        "print(' '.join(str(p) for p in mix._pool._executor._processes), flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2
    spawned = ["spawn_main" in Path(f"/proc/{p}/cmdline").read_text() for p in pids]
    assert spawned == [threads > 1] * 2, spawned
    proc.kill()
    proc.wait()
    assert_gone(pids, "pool processes outlived their reward worker")


class _CountingModel:
    """A model scorer that scores a sample by its completion's length and records the size
    of every call (the batching is under test, not a model)."""

    def __init__(self, fail_on: str = "") -> None:
        self.calls: list[int] = []
        self.fail_on = fail_on

    def __call__(self, batch: Sequence[ScoreInput]) -> list[Outcome]:
        self.calls.append(len(batch))
        time.sleep(0.05)  # long enough for the other batches to arrive and wait
        if any(s.completion == self.fail_on for s in batch):
            raise ValueError("a sample this model cannot score")
        return [Outcome(float(len(s.completion))) for s in batch]

    def close(self) -> None:
        pass


def _batches(completions: list[str], size: int = 4) -> list[list[ScoreInput]]:
    return [[ScoreInput(prompt="p", completion=c, metadata={}, finish_reason="stop")] * size for c in completions]


async def _score_while_the_first_runs(scorer: _ThreadedModel, batches: list[list[ScoreInput]]) -> list[list[Outcome]]:
    first = asyncio.ensure_future(scorer.score(batches[0], 10.0))
    await asyncio.sleep(0.01)  # its call has started
    rest = await asyncio.gather(*(scorer.score(b, 10.0) for b in batches[1:]))
    return [await first, *rest]


@pytest.mark.parametrize(("max_batch", "calls"), [(64, [4, 20]), (8, [4, 8, 8, 4])])
async def test_batches_waiting_for_a_model_scorer_go_into_one_call(max_batch: int, calls: list[int]) -> None:
    model = _CountingModel()
    scorer = _ThreadedModel(model, max_batch)
    batches = _batches(["x" * (i + 1) for i in range(6)])
    results = await _score_while_the_first_runs(scorer, batches)
    assert [[o.score for o in r] for r in results] == [[float(i + 1)] * 4 for i in range(6)]  # each its own
    assert model.calls == calls  # the first alone; those that arrived meanwhile together, max_batch at most


async def test_a_merged_model_call_that_raises_fails_only_the_batch_it_fails_on() -> None:
    model = _CountingModel(fail_on="bad")
    scorer = _ThreadedModel(model, 64)
    results = await _score_while_the_first_runs(scorer, _batches(["a", "bb", "bad", "cccc"]))
    assert [o.score for o in results[1]] == [2.0] * 4 and [o.score for o in results[3]] == [4.0] * 4
    assert all(o.failure == "ValueError: a sample this model cannot score" for o in results[2])
    assert model.calls == [4, 12, 4, 4, 4]  # the merged call failed: each of its batches again alone


async def test_a_batch_that_waited_past_its_limit_is_not_scored() -> None:
    model = _CountingModel()
    scorer = _ThreadedModel(model, 64)
    first = asyncio.ensure_future(scorer.score(_batches(["a"])[0], 10.0))
    await asyncio.sleep(0.01)  # its call has started
    late = await scorer.score(_batches(["b"])[0], 0.01)  # times out waiting for the first call
    assert all(o.failure == "timed out after 0.01s (whole batch)" for o in late)
    await first
    await asyncio.sleep(0.1)
    assert model.calls == [4]  # skipped, not run for a caller that gave up


async def test_a_closed_model_scorer_fails_the_batches_in_its_call_and_waiting_at_once() -> None:
    """Closing (the actor stops) fails at once the batch in the model call and those waiting
    for the next one, instead of leaving their callers to their time limit."""
    scorer = _ThreadedModel(_CountingModel(), 64)
    in_call = asyncio.ensure_future(scorer.score(_batches(["a"])[0], 60.0))
    await asyncio.sleep(0.01)  # its call has started
    waiting = asyncio.ensure_future(scorer.score(_batches(["b"])[0], 60.0))
    await asyncio.sleep(0)
    scorer.close()
    results = await asyncio.wait_for(asyncio.gather(in_call, waiting), 5.0)
    assert all(o.failure == "Closed: the scorer stopped" for r in results for o in r), results
