"""yatt: an RL trainer for language models built from parallel asyncio controllers and
workers that exchange msgpack messages over ZeroMQ.

This package holds the actor runtime, the controllers, the dynamic sampling buffer, the
RL math and the configs. It imports neither vLLM nor FSDP (see tests/yatt/test_imports.py).
"""

__version__ = "0.1.0"
