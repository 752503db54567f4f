"""The model scorers of the reward mix: a reward model and an LLM judge.

They live apart from ``workers/reward/scorers.py`` because they import torch, transformers and
an inference engine, which the rule scorers' pool processes (they import
``workers.reward.scorers``) must not pay for. Both score a whole batch synchronously;
``RewardMix`` runs them in a thread under the time limit (see ``workers/reward/scorers.py``).

- ``RewardModel``: a sequence-classification model with one output; the score of a
  sample is ``logits[:, 0]`` of its prompt + completion text.
- ``Judge``: a generative reward model. Each sample's prompt, completion and reference
  answer fill a template, ``judge_samples`` verdicts are sampled, each is parsed to a
  score in [0, 1] (``parse_verdict``) and the scores are averaged; an unparsable verdict
  is a failed judge sample: it counts 0 in the average and its text goes in the failure.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedTokenizerBase

from protocols.messages import SamplingParams
from workers.engines import PromptRequest, make_engine
from workers.reward.score_types import Outcome, ScoreInput
from yatt.errors import ConfigError
from yatt.rl.config import GeneratorConfig, ScorerConfig

DEFAULT_JUDGE_TEMPLATE = (
    "Grade the answer to a question.\n"
    "Question: {prompt}\n"
    "Reference answer: {answer}\n"
    "Answer to grade: {completion}\n"
    "Reply with 'score: X', X from 0 (wrong) to 1 (right)."
)
"""The judge prompt when ``judge_template`` is empty (sent as a user turn if the judge has a chat template)."""

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)"


def parse_verdict(text: str) -> float:
    """The score in [0, 1] a judge's verdict gives; ``ValueError`` saying why if none.

    Read in this order: the last "score: X" (or "score = X", any case); else a leading
    yes (1.0) or no (0.0); else a verdict that is just a number. X outside [0, 1] is an error.
    """
    scores = re.findall(rf"score\s*[:=]\s*({_NUMBER})", text, re.IGNORECASE)
    if scores:
        value = float(scores[-1])
    elif m := re.match(r"\s*(yes|no)\b", text, re.IGNORECASE):
        return 1.0 if m.group(1).lower() == "yes" else 0.0
    elif m := re.fullmatch(rf"\s*({_NUMBER})\s*\.?\s*", text):
        value = float(m.group(1))
    else:
        raise ValueError(f"unparsable verdict {text[:80]!r}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"verdict score {value} is outside [0, 1] in {text[:80]!r}")
    return value


def _load_tokenizer(model_path: str, tokenizer_path: str | None, field: str) -> PreTrainedTokenizerBase:
    """The model's own tokenizer, or ``tokenizer_path``'s when the model directory has none."""
    has_own = (Path(model_path) / "tokenizer_config.json").exists()
    source = model_path if has_own or tokenizer_path is None else tokenizer_path
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{field}.model_path = {model_path!r} has no loadable tokenizer ({e}); save one with the model"
        ) from None


class RewardModel:
    """A sequence-classification reward model: score = logits[:, 0] of prompt + completion.

    The text is the decoded prompt (with the policy's chat markup) followed by the
    completion; a text too long for the model is cut on the left, keeping the completion.
    """

    def __init__(self, model_path: str, *, tokenizer_path: str | None, batch_size: int, field: str) -> None:
        self._device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = torch.bfloat16 if self._device.type == "cuda" else torch.float32
        try:
            model = AutoModelForSequenceClassification.from_pretrained(model_path, dtype=dtype)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{field}.model_path = {model_path!r} cannot be loaded as a reward model ({e}); "
                "point it to a local Hugging Face directory of a sequence-classification model"
            ) from None
        if model.config.num_labels != 1:
            raise ConfigError(
                f"{field}.model_path = {model_path!r} has num_labels={model.config.num_labels}; "
                "a reward model has one output (num_labels=1)"
            )
        tokenizer = _load_tokenizer(model_path, tokenizer_path, field)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.truncation_side = "left"
        # The model pools each row's last non-pad token, so it must know the pad id.
        model.config.pad_token_id = tokenizer.pad_token_id
        self._model: torch.nn.Module | None = model.to(self._device).eval()
        self._tokenizer = tokenizer
        self._max_length = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        self._batch_size = batch_size

    def __call__(self, batch: Sequence[ScoreInput]) -> list[Outcome]:
        assert self._model is not None, "RewardModel used after close()"
        scores: list[float] = []
        for start in range(0, len(batch), self._batch_size):
            chunk = batch[start : start + self._batch_size]
            encoded = self._tokenizer(
                [s.prompt + s.completion for s in chunk],
                padding=True,
                truncation=True,
                max_length=self._max_length,
                return_tensors="pt",
            ).to(self._device)  # input_ids, attention_mask: [b, T]
            with torch.inference_mode():
                logits = self._model(**encoded).logits  # [b, 1]
            scores.extend(logits[:, 0].float().tolist())
        return [Outcome(s) for s in scores]

    def close(self) -> None:
        self._model = None


class Judge:
    """An LLM judge: ``judge_samples`` sampled verdicts per sample, parsed and averaged."""

    def __init__(self, config: ScorerConfig, *, tokenizer_path: str | None, field: str) -> None:
        self._template = config.judge_template or DEFAULT_JUDGE_TEMPLATE
        try:
            self._template.format(prompt="", completion="", answer="")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(
                f"{field}.judge_template is not a valid template ({type(e).__name__}: {e}); use only "
                "{prompt}, {completion} and {answer}, and write other braces doubled: {{ }}"
            ) from None
        self._tokenizer = _load_tokenizer(config.model_path, tokenizer_path, field)
        try:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            self._engine = make_engine(config.model_path, GeneratorConfig(), device=device)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{field}.model_path = {config.model_path!r} cannot be loaded as a judge ({e}); "
                "point it to a local Hugging Face directory of a causal language model"
            ) from None
        self._answer_key = config.answer_key
        self._samples = config.judge_samples
        self._sampling = SamplingParams(temperature=1.0, max_new_tokens=config.judge_max_new_tokens)

    def _prompt_ids(self, sample: ScoreInput) -> list[int]:
        text = self._template.format(
            prompt=sample.prompt,
            completion=sample.completion,
            answer=sample.metadata.get(self._answer_key, "(none)"),
        )
        if self._tokenizer.chat_template:
            rendered = self._tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            assert isinstance(rendered, str), "tokenize=False renders text"
            text = rendered
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def verdicts(self, batch: Sequence[ScoreInput]) -> list[list[str]]:
        """The ``judge_samples`` decoded verdicts of each sample."""
        requests = [
            PromptRequest(prompt_ids=self._prompt_ids(s), n=self._samples, sampling=self._sampling)
            for s in batch
        ]
        return [
            [str(self._tokenizer.decode(v.token_ids, skip_special_tokens=True)) for v in samples]
            for samples in self._engine.generate(requests)
        ]

    def __call__(self, batch: Sequence[ScoreInput]) -> list[Outcome]:
        outcomes = []
        for texts in self.verdicts(batch):
            scores, errors = [], []
            for text in texts:
                try:
                    scores.append(parse_verdict(text))
                except ValueError as e:
                    scores.append(0.0)
                    errors.append(str(e))
            failure = f"{len(errors)}/{len(texts)} verdicts failed, first: {errors[0]}" if errors else ""
            outcomes.append(Outcome(sum(scores) / len(scores), failure))
        return outcomes

    def close(self) -> None:
        self._engine.close()
