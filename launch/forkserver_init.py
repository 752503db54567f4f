"""Imported first by the fork server (``launch/forkserver.py``), before its slow imports:
the server dies the moment its launcher does (``PR_SET_PDEATHSIG``: the kernel sends
SIGKILL), so the roles forked from it die at once with it, not after the server's own
interpreter shutdown (seconds with torch loaded, in which trainer ranks kept training).

Importing it anywhere else does nothing: it acts only in the process that
``ForkServer.start`` marked with ``YATT_FORK_SERVER_OF=<launcher pid>`` whose parent
that launcher is."""

from __future__ import annotations

import os

from yatt.runtime.lifetime import die_with_parent

MARK = "YATT_FORK_SERVER_OF"

if (launcher := os.environ.pop(MARK, None)) == str(os.getppid()):
    die_with_parent(int(launcher))  # (nothing where the kernel cannot: not Linux)
