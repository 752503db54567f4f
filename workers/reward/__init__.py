"""The reward role and its scorers.

``worker`` (the reward actor: a group in, scores out), ``scorers`` (rule verifiers, custom
and TRL-style functions, the mix and its per-sample time limits), ``model_scorers`` (a
reward model or an LLM judge on an engine) and ``score_types`` (what a scorer sees).
"""
