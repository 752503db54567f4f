"""yatt.runtime.lifetime: a process dies with its parent, and exits at once if it was orphaned
before it could ask for that."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import assert_gone

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_a_process_whose_parent_is_not_the_one_it_names_exits_at_once() -> None:
    code = "import os\nfrom yatt.runtime.lifetime import die_with_parent\ndie_with_parent(os.getppid() + 1)\nprint('alive')"
    done = _python(code)
    assert (done.returncode, done.stdout) == (1, "")
    code = "import os\nfrom yatt.runtime.lifetime import die_with_parent\ndie_with_parent(os.getppid())\nprint('alive')"
    assert _python(code).stdout == "alive\n"


def test_a_child_dies_with_its_sigkilled_parent() -> None:
    parent = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import os, time\\n"
        "from yatt.runtime.lifetime import die_with_parent\\n"
        "die_with_parent(' + str(os.getpid()) + ')\\nprint(os.getpid(), flush=True)\\ntime.sleep(600)'])\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    assert_gone([child], "a process outlived its SIGKILLed parent")


def test_release_freed_memory_hands_freed_heap_back() -> None:
    """Freed heap below a live allocation stays in the process (glibc trims only its top)
    until ``release_freed_memory``."""
    script = (
        "import os\n"
        "from yatt.runtime.lifetime import release_freed_memory\n"
        "rss = lambda: int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) // 1024\n"
        "blocks = [os.urandom(2048) for _ in range(100_000)]\n"  # ~200 MB of malloc'd (not pymalloc'd) blocks
        "pin = os.urandom(2048)\n"  # above them: the heap's top cannot shrink past it
        "full = rss(); del blocks\n"
        "kept = rss(); release_freed_memory()\n"
        "print(full, kept, rss())\n"
    )
    out = _python(script).stdout
    full, kept, released = (int(v) for v in out.split())
    assert kept > full - 50, f"RSS {full} -> {kept} MB after the free: the C library trimmed by itself"
    assert released < kept - 150, f"RSS {kept} -> {released} MB: the freed heap was not handed back"
