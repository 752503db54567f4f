"""Heavy imports stay at the edges: yatt/ and protocols/ import neither vLLM nor FSDP,
nor transformers; only workers/ may."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEAVY = ("vllm", "transformers", "torch.distributed.fsdp", "flash_attn")


def test_core_packages_do_not_import_heavy_modules() -> None:
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for package in ("yatt", "protocols")
        for p in (ROOT / package).rglob("*.py")
        if p.name != "__main__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"bad = [h for h in {HEAVY!r} if h in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", f"yatt/protocols pulled in {out.stdout.strip()}"
