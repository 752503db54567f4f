"""Agents: multi-turn episodes with tools and environments.

An episode is a conversation the controller drives turn by turn: the policy generates a
turn (token ids in, token ids out), the environment (Gymnasium's ``reset``/``step``
convention, or a set of plain Python tools) answers with an observation, the renderer
turns that observation into token ids appended after the policy's own, untouched. The
row trained is the concatenation: prompt | generated (loss) | observation (no loss) | ...

- ``tools``: plain functions as tools (their JSON schema from signature and docstring),
  tool calls parsed from tags or from the chat template's format, run with a timeout.
- ``render``: observation messages -> token ids, per chat-template family, and the
  start-up self-check that refuses a template whose rendering drifts.
- ``envs``: loading a user's environment class (Gymnasium's convention), the tool environment.
- ``episodes``: one episode's run, turn by turn, and the row it leaves (mask, versions).
- ``client``: agent code that drives its own episode (``env.episode``): its client's
  calls (token in/out, or chat messages through the renderer) are the turns.
- ``endpoint``: the OpenAI-compatible endpoint that serves agent code's requests as calls.
- ``remote``: an episode's environment in the env role, as the controller sees it.
- ``hosted``: agent code in the env role (its calls forwarded to the controller).
- ``demonstrations``: scripted episodes played through the run's episode code (warm start).
- ``games``: built-in environments (guess the number; also as agent code).
"""
