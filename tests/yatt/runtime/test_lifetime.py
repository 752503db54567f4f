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
