"""yatt.trace writes one line per span, CPU samples and an exit record; off, it writes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from yatt import trace


def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True, timeout=60)


def test_spans_cpu_samples_and_exit_record(tmp_path: Path) -> None:
    path = tmp_path / "trace" / "generator-0.jsonl"
    _run(f"""
        import asyncio, threading, time
        from pathlib import Path
        from yatt import trace
        trace.configure(Path({str(path)!r}))
        with trace.span("generate"):
            time.sleep(0.05)
        async def main():
            with trace.span("score"):
                await asyncio.sleep(0.02)
        asyncio.run(main())
        t = threading.Thread(target=lambda: trace.record("weight_load", 100.0, 0.5))
        t.start(); t.join()
        end = time.time() + 2 * trace.CPU_SAMPLE_S + 0.2
        while time.time() < end:
            pass  # burn CPU so the samples rise
    """)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    spans = [rec for rec in lines if not rec["kind"].startswith("_")]
    assert [s["kind"] for s in spans] == ["generate", "score", "weight_load"]
    assert 0.05 <= spans[0]["duration"] < 1.0
    assert 0.02 <= spans[1]["duration"] < 1.0
    assert spans[1]["start"] >= spans[0]["start"] + spans[0]["duration"] - 1e-3
    assert spans[2] == {"kind": "weight_load", "start": 100.0, "duration": 0.5}
    cpu = [rec for rec in lines if rec["kind"] == "_cpu"]
    assert len(cpu) >= 2
    assert [c["cpu_s"] for c in cpu] == sorted(c["cpu_s"] for c in cpu)
    assert cpu[-1]["cpu_s"] > cpu[0]["cpu_s"]
    assert lines[-1]["kind"] == "_process" and lines[-1]["cpu_s"] >= cpu[-1]["cpu_s"]


def test_off_by_default_writes_nothing(tmp_path: Path) -> None:
    assert not trace.enabled()
    with trace.span("generate"):
        pass
    trace.record("score", 1.0, 1.0)
    assert not trace.enabled()
    assert list(tmp_path.iterdir()) == []
