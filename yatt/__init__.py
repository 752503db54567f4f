"""yatt: an RL trainer for language models built from parallel asyncio controllers and
workers that exchange msgpack messages over ZeroMQ.

Three rooms, imports pointing down only (``tests/test_layers.py`` keeps it so)::

    protocols/        every wire message and the one codec
    yatt/runtime/     actors, transport, streams, registry, trace, config tools: knows no RL
    yatt/rl/          the loop's logic: controller, buffer, sampling, ledger, RL math, data, configs
    yatt/placement/   the pure planner and replanner: which role on which slot
    yatt/errors.py    the one error tree, shared by all of them

None of it imports vLLM, FSDP or transformers (``tests/yatt/test_imports.py``).
"""

__version__ = "0.1.0"
