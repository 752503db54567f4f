"""A stand-in for a role in tests/launch/test_forkserver.py: writes what its process looks
like to the file named by its first argument, then sleeps (or exits with the code its
second argument names)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    import torch

    from launch.role import die_with_launcher

    die_with_launcher()  # as launch.role's main does first

    out, code = Path(sys.argv[1]), int(sys.argv[2])
    print("probe started", flush=True)
    out.write_text(json.dumps({
        "argv": sys.argv, "pid": os.getpid(), "pgid": os.getpgid(0), "ppid": os.getppid(),
        "env": os.environ.get("PROBE"), "threads": torch.get_num_threads(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }))  # fmt: skip
    if code >= 0:
        sys.exit(code)
    import time

    time.sleep(600)
