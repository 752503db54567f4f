"""The RL loop's logic, on top of the runtime: what to generate, what to keep, what to train.

``controller`` (one per data shard: groups through generators and reward workers),
``buffer`` and ``sampling`` (the dynamic sampling buffer and its decisions), ``ledger``
(the durable record of every group's fate), ``rl_math`` (advantages and losses, verl's
knobs), ``data`` and ``tasks`` (prompts and the built-in tasks), ``evaluation`` (held-out
groups), ``checkpoints`` (the launcher's checkpoint requests) and ``config`` (one frozen
config per component). Never imports ``yatt.placement``.
"""
