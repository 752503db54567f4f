"""The actor runtime: what every role process is built from, and nothing about RL.

``transport`` (the one socket factory, CURVE keys), ``actor`` (handlers, clients, replies),
``streams`` (bounded, acknowledged pushes), ``registry`` (membership, heartbeats, the
directory of live workers), ``trace`` (spans, failpoints, injected slowdowns),
``configtools`` (typed, loudly validated configs), ``plugins`` (a user's
``package.module:function``), ``run_dir`` (the run directory's file names) and ``lifetime``
(a process dies with its parent). Imports only ``protocols`` and ``yatt.errors``.
"""
