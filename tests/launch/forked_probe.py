"""A stand-in for a role in tests/launch/test_forkserver.py: writes what its process looks
like to the file named by its first argument, then sleeps (or exits with the code its
second argument names). Preloaded by a fork server with ``PROBE_SERVER_EXIT`` set, it
makes the server's interpreter shutdown last 5 s and then write that file."""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import time
from pathlib import Path

if __name__ != "__main__" and (_marker := os.environ.get("PROBE_SERVER_EXIT")):
    _server = os.getpid()

    def _slow_shutdown() -> None:  # as an interpreter with torch loaded takes its time
        if os.getpid() == _server:
            time.sleep(5)
            Path(str(_marker)).write_text("shut down")

    atexit.register(_slow_shutdown)

if __name__ == "__main__":
    import torch

    from launch.role import die_with_launcher

    die_with_launcher()  # as launch.role's main does first

    out, code = Path(sys.argv[1]), int(sys.argv[2])
    print("probe started", flush=True)
    out.write_text(json.dumps({
        "argv": sys.argv, "pid": os.getpid(), "pgid": os.getpgid(0), "ppid": os.getppid(),
        "env": os.environ.get("PROBE"), "threads": torch.get_num_threads(), "frozen": gc.get_freeze_count(),
    }))  # fmt: skip
    if code >= 0:
        sys.exit(code)
    time.sleep(600)
