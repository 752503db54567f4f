"""yatt.runtime.trace writes one line per span, CPU samples and an exit record; off, it writes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from yatt.errors import ConfigError
from yatt.runtime import trace


def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True, timeout=60)


def test_spans_cpu_samples_and_exit_record(tmp_path: Path) -> None:
    path = tmp_path / "trace" / "generator-0.jsonl"
    _run(f"""
        import asyncio, threading, time
        from pathlib import Path
        from yatt.runtime import trace
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


def test_each_step_end_writes_a_cpu_sample_so_a_window_of_steps_is_covered(tmp_path: Path) -> None:
    path = tmp_path / "trace" / "trainer-0.jsonl"
    _run(f"""
        import time
        from pathlib import Path
        from yatt.runtime import trace
        trace.CPU_SAMPLE_S = 1000.0  # the sampler thread writes once, then never again here
        trace.configure(Path({str(path)!r}))
        for _ in range(2):
            with trace.span("step"):
                end = time.time() + 0.05
                while time.time() < end:
                    pass
    """)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = [rec["kind"] for rec in lines]
    assert kinds[-6:] == ["step", "_cpu", "step", "_cpu", "_cpu", "_process"]  # the last sample: at exit
    for step, sample in ((lines[-6], lines[-5]), (lines[-4], lines[-3])):
        assert sample["start"] >= step["start"] + step["duration"] - 1e-3
    assert lines[-3]["cpu_s"] > lines[-5]["cpu_s"]


def test_a_process_writes_a_last_cpu_sample_at_exit(tmp_path: Path) -> None:
    """A role without steps (a controller) that ends shortly after the measured window is
    still covered by its samples: the sampler runs every 0.5 s, the exit writes one more."""
    path = tmp_path / "trace" / "controller-0.jsonl"
    _run(f"""
        import time
        from pathlib import Path
        from yatt.runtime import trace
        trace.CPU_SAMPLE_S = 1000.0  # the sampler thread writes once, then never again here
        trace.configure(Path({str(path)!r}))
        time.sleep(0.1)
    """)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [rec["kind"] for rec in lines][-2:] == ["_cpu", "_process"]
    # (the first sample's clock is read in the sampler thread, up to a few ms after the sleep begins)
    assert sum(rec["kind"] == "_cpu" for rec in lines) == 2 and lines[-2]["start"] >= lines[0]["start"] + 0.05


def test_off_by_default_writes_nothing(tmp_path: Path) -> None:
    assert not trace.enabled()
    with trace.span("generate"):
        pass
    trace.record("score", 1.0, 1.0)
    assert not trace.enabled()
    assert list(tmp_path.iterdir()) == []


def test_a_failpoint_kills_its_process_once_per_run_at_the_nth_span(tmp_path: Path) -> None:
    code = f"""
        import sys
        from pathlib import Path
        from yatt.runtime import trace
        trace.arm_failpoint("trainer-1:checkpoint_write:3", sys.argv[1], Path({str(tmp_path)!r}))
        for i in range(5):
            with trace.span("weight_push"):
                pass
            with trace.span("checkpoint_write"):
                print(i, flush=True)
    """

    def run(process: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), process], capture_output=True, text=True, timeout=60
        )

    other = run("trainer-0")  # not the process named
    assert other.returncode == 0 and other.stdout.split() == ["0", "1", "2", "3", "4"]
    killed = run("trainer-1")
    assert killed.returncode == -9 and killed.stdout.split() == ["0", "1"]
    assert "failpoint trainer-1:checkpoint_write:3: SIGKILL" in killed.stderr
    assert (tmp_path / "trainer-1_checkpoint_write_3").exists()
    restarted = run("trainer-1")  # the marker disarms it: the restarted process runs on
    assert restarted.returncode == 0 and restarted.stdout.split() == ["0", "1", "2", "3", "4"]


def test_a_malformed_failpoint_names_the_variable() -> None:
    for spec in ("trainer-1:checkpoint_write", "trainer-1:checkpoint_write:0", "::1", "a:b:c"):
        with pytest.raises(ConfigError, match="YATT_FAILPOINT=.*PROCESS:SPAN_KIND:N"):
            trace.parse_failpoint(spec)
