"""Run whole training jobs and measure them: the shared part of the job-level benchmarks
(``e2e``, ``staleness``, ``stages``).

A job is a subprocess tree watched from this process::

    run_yatt(items, run_dir)   python -m launch run ITEMS --run-dir RUN_DIR --no-progress
      run_monitored(cmd, log)    Popen (stdout+stderr -> log) + MemoryMonitor thread
        MemoryMonitor              every 0.25 s: PSS of the process and all its descendants
      -> JobRun(run_dir, metrics.jsonl lines, wall_s, peak_memory_mb)

Memory is the sum of PSS (proportional set size: each shared page split between the
processes that map it), so the torch libraries that every role process maps count once,
not once per process as a sum of RSS would; RSS is the fallback where PSS is not readable.
Reading PSS is not free: the kernel walks the process's page tables for
``/proc/PID/smaps_rollup``, 15-80 ms per torch process on this 2-core machine (reading RSS
takes 0.03 ms), so a 7-process yatt tree sampled every 0.25 s would keep most of a core
busy. The monitor therefore samples every 0.25 s or, when a sample took longer, as often
as keeps its own work under ``MAX_BUSY`` (10 %) of one core; ``Monitored.memory_samples``
says how many samples a job got. A peak shorter than the sampling period can be missed.

The functions at the bottom read a job's per-step metrics (yatt's ``metrics.jsonl``, or the
same keys written by ``benchmarks.trl_grpo``): the training window, trailing moving
averages of the reward, when a reward is first reached and what the reward was at a given
time. They are pure, so tests/benchmarks/test_e2e.py checks them on hand-computed cases.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from yatt.runtime import run_dir as names
from yatt.runtime.run_dir import read_jsonl

REPO = Path(__file__).resolve().parents[1]
SAMPLE_INTERVAL_S = 0.25
MAX_BUSY = 0.1
"""Largest share of one core the memory monitor may spend reading PSS."""
STOP_GRACE_S = 30.0
"""How long a job that ran out of time gets after SIGTERM before its whole tree is killed."""


# ---------------------------------------------------------------- memory


def tree_memory_mb(root: psutil.Process) -> float:
    """PSS (else RSS) of ``root`` and all its descendants, in MB (10^6 bytes)."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:  # the root has exited
        return 0.0
    total = 0
    for proc in procs:
        try:
            try:
                total += int(getattr(proc.memory_full_info(), "pss", 0)) or proc.memory_info().rss
            except psutil.AccessDenied:
                total += proc.memory_info().rss
        except psutil.Error:  # exited between the listing and the reading
            continue
    return total / 1e6


@dataclass
class MemoryMonitor:
    """The peak of ``tree_memory_mb`` of a process tree, sampled in a thread while the
    ``watch`` block runs: every ``interval_s``, or less often when sampling would
    otherwise take more than ``max_busy`` of one core."""

    pid: int
    interval_s: float = SAMPLE_INTERVAL_S
    max_busy: float = MAX_BUSY
    peak_mb: float = 0.0
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    def _loop(self, root: psutil.Process) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            self.peak_mb = max(self.peak_mb, tree_memory_mb(root))
            self.samples += 1
            took = time.perf_counter() - start
            self._stop.wait(max(self.interval_s, took / self.max_busy) - took)

    @contextlib.contextmanager
    def watch(self) -> Iterator[MemoryMonitor]:
        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            yield self
            return
        thread = threading.Thread(target=self._loop, args=(root,), name=f"memory-{self.pid}", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join()


# ---------------------------------------------------------------- jobs


@dataclass(frozen=True, kw_only=True)
class Monitored:
    """What watching one subprocess tree measured."""

    started_unix: float
    """Wall clock when the process was started."""
    wall_s: float
    """From start to exit."""
    peak_memory_mb: float
    """Peak PSS (else RSS) of the whole process tree."""
    memory_samples: int
    """How many times the tree's memory was read."""


@dataclass(frozen=True, kw_only=True)
class JobRun:
    """One finished yatt job."""

    run_dir: Path
    metrics: list[dict[str, float]]
    """The lines of ``run_dir/metrics.jsonl``, one per step."""
    wall_s: float
    """The launcher's whole run: startup, training, final export and shutdown."""
    peak_memory_mb: float
    """Peak PSS (else RSS) of the launcher and every process below it."""
    started_unix: float
    """Wall clock when the launcher was started (for the startup time)."""
    memory_samples: int
    """How many times the tree's memory was read."""


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process (yatt's launcher stops its roles on it), SIGKILL to the rest
    of its tree after a grace."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        tree = []
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.kill()
    proc.wait()


def run_monitored(
    cmd: Sequence[str], log: Path, *, timeout_s: float, what: str, env: Mapping[str, str] | None = None
) -> Monitored:
    """Run ``cmd`` (cwd: the repo root, stdout and stderr into ``log``, ``env`` added to the
    environment) to its end while sampling its tree's memory; raise with the log's tail if
    it fails or runs too long."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        started_unix, start = time.time(), time.perf_counter()
        proc = subprocess.Popen(list(cmd), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **env} if env else None)
        with MemoryMonitor(proc.pid).watch() as memory:
            try:
                code = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                _stop_tree(proc)
                raise RuntimeError(
                    f"{what} ran past {timeout_s:.0f} s and was stopped; its log ({log}):\n{log_tail(log)}"
                ) from None
        wall_s = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"{what} failed with exit code {code}; its log ({log}):\n{log_tail(log)}")
    return Monitored(
        started_unix=started_unix, wall_s=wall_s, peak_memory_mb=memory.peak_mb, memory_samples=memory.samples
    )




def run_yatt(items: list[str], run_dir: Path, *, timeout_s: float, env: Mapping[str, str] | None = None) -> JobRun:
    """``python -m launch run ITEMS`` into ``run_dir`` (items: an optional config path and
    dotted.key=value overrides), measured; its output goes to ``run_dir/launcher.log``."""
    cmd = [sys.executable, "-m", "launch", "run", *items, "--run-dir", str(run_dir), "--no-progress"]
    measured = run_monitored(cmd, run_dir / "launcher.log", timeout_s=timeout_s, what="yatt job " + " ".join(items), env=env)
    metrics = read_jsonl(run_dir / names.METRICS)
    if not metrics:
        raise RuntimeError(f"the yatt job in {run_dir} wrote no metrics; its log:\n{log_tail(run_dir / 'launcher.log')}")
    return JobRun(
        run_dir=run_dir,
        metrics=metrics,
        wall_s=measured.wall_s,
        peak_memory_mb=measured.peak_memory_mb,
        started_unix=measured.started_unix,
        memory_samples=measured.memory_samples,
    )


# ---------------------------------------------------------------- reading metrics


@dataclass(frozen=True, kw_only=True)
class Training:
    """A job's training window, read from its per-step metrics."""

    start_unix: float
    """Wall clock at the first step's start (its end minus its duration)."""
    duration_s: float
    """From the first step's start to the last step's end."""
    samples: float
    """Samples trained, all steps."""
    tokens: float
    """Completion tokens trained (= generated for those samples), all steps."""
    step_s: list[float]
    """Each step's duration."""
    times_s: list[float]
    """Each step's end, seconds after ``start_unix``."""
    rewards: list[float]
    """Each step's mean reward."""

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.duration_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.duration_s


def training(metrics: Sequence[dict[str, float]]) -> Training:
    """The training window of per-step metrics with ``time/unix`` (step end), ``time/step_s``,
    ``samples_per_s``, ``tokens_per_s`` and ``reward/mean``."""
    if not metrics:
        raise ValueError("no steps in the metrics")
    start = metrics[0]["time/unix"] - metrics[0]["time/step_s"]
    return Training(
        start_unix=start,
        duration_s=metrics[-1]["time/unix"] - start,
        samples=sum(m["samples_per_s"] * m["time/step_s"] for m in metrics),
        tokens=sum(m["tokens_per_s"] * m["time/step_s"] for m in metrics),
        step_s=[m["time/step_s"] for m in metrics],
        times_s=[m["time/unix"] - start for m in metrics],
        rewards=[m["reward/mean"] for m in metrics],
    )


def moving_average(values: Sequence[float], window: int = 3) -> list[float]:
    """Trailing mean: item i is the mean of values[i - window + 1 .. i] (fewer at the start)."""
    if window < 1:
        raise ValueError(f"window must be >= 1 (got {window})")
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def time_to_reward(times: Sequence[float], rewards: Sequence[float], target: float) -> float | None:
    """The first time at which ``rewards`` (a curve, e.g. a moving average) is >= ``target``;
    None if it never is."""
    for t, r in zip(times, rewards, strict=True):
        if r >= target:
            return t
    return None


def reward_at(times: Sequence[float], rewards: Sequence[float], at: float) -> float:
    """The curve's value at time ``at``: that of the last point at or before it (the curve
    holds its value between steps)."""
    if not times or at < times[0]:
        raise ValueError(f"no point at or before t = {at} (the first is at {times[0] if times else math.nan})")
    value = rewards[0]
    for t, r in zip(times, rewards, strict=True):
        if t > at:
            break
        value = r
    return value
