"""Spans: what a role process was doing, and when, for timelines and stage breakdowns.

With ``run.trace: true`` every role process writes one JSON line per span to
``<run_dir>/trace/<role>-<index>.jsonl``::

    {"kind": "generate", "start": 1764690000.123, "duration": 0.181}
    {"kind": "_cpu", "start": 1764690000.5, "cpu_s": 7.25}   (every CPU_SAMPLE_S, and as each step
                                                              ends: the process's CPU so far)
    ...
    {"kind": "_process", "cpu_s": 12.3, "wall_s": 40.1}      (at exit)

``start`` is the wall clock (``time.time()``), so the files of all processes of one
machine line up on one axis (across SLURM nodes only as well as their clocks agree).
Spans of one kind may overlap inside a process (concurrent requests); readers take the
union. Off (the default), ``span`` costs one attribute check.

Kinds written (``benchmarks/stages.py`` reads them): generator ``generate`` (inside
the engine), ``weight_load``, ``park`` and ``unpark`` (out of the pool and back: a
re-planned partial run); reward ``score`` (inside the scorers); buffer ``offer``
(a decision) and ``ledger_commit`` (one fsync for the decisions of one turn); trainer
ranks ``wait_for_buffer``, ``forward_backward``, ``optimizer`` (gradient reduction,
clip, step), ``weight_gather``, ``weight_push`` (rank 0: buckets to every generator,
then the new version to the buffer; ``weight_bucket``: one bucket to one generator,
acknowledged), ``checkpoint``, ``log_step`` (rank 0: the step's report, stats and
metrics line), ``step`` (one trainer step, end to end), ``wake`` / ``sleep`` (the
colocated rank's engine given the weights / put away), and the collectives nested in the compute spans: ``all_reduce``, ``all_gather``
and ``reduce_scatter`` (FSDP2's, traced through its custom-collective hooks); the reward
scorers' ``pool_round_trip`` (a call: its samples to a pool process and their scores back); trainer
ranks' ``checkpoint_write`` (this rank's checkpoint files, in a background thread with
``trainer.checkpoint_async``).

Failpoints: with ``YATT_FAILPOINT=PROCESS:KIND:N`` in its environment (e.g.
``trainer-1:checkpoint_write:2``), that role process SIGKILLs itself as it enters its
N-th span of KIND, traced or not: how the faults benchmark and the kill tests land a kill
inside a stage of a few milliseconds (a weight push, a checkpoint write). It fires once
per run: a marker file in ``<run_dir>/failpoints`` keeps the restarted process running.
``PROCESS:KIND:N:raise`` raises ``InjectedFailure`` there instead, in every start of the
process (the marker is written, not read): a failure that a restart cannot fix, as a bug
at one point of a role's code would be (the launcher stops the run after its first repeat).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from yatt.errors import ConfigError

CPU_SAMPLE_S = 0.5
"""How often a traced process writes its CPU time (user + system, this process's threads)."""

_lock = threading.Lock()
_file: IO[str] | None = None
_wall0 = time.time()
_sampler: threading.Thread | None = None

FAILPOINT_ENV = "YATT_FAILPOINT"
SLOW_REWARD_ENV = "YATT_SLOW_REWARD"
"""A workload shift injected into the reward workers (``SlowDown``): ``GROUPS:SECONDS``."""
SLOW_TRAIN_ENV = "YATT_SLOW_TRAIN"
"""A workload shift injected into the trainer ranks (``SlowDown``): ``STEPS:SECONDS``."""


@dataclass(frozen=True)
class SlowDown:
    """A stage turning slow mid-run, injected for tests and benchmarks by an environment
    variable ``COUNT:SECONDS``: once a process of the run has done COUNT units of its work
    (groups judged, steps trained), every process of that role (a restarted or newly started
    one too: a marker file in the run dir, holding the time it began, says so) takes SECONDS
    longer per unit."""

    after: int
    seconds: float
    marker: Path

    @classmethod
    def from_env(cls, env: str, marker: Path, unit: str) -> SlowDown | None:
        """The shift ``env`` asks for (None when unset); ``unit`` names COUNT in the error."""
        spec = os.environ.get(env, "")
        if not spec:
            return None
        try:
            count, seconds = spec.split(":")
            slow = cls(int(count), float(seconds), marker)
        except ValueError:
            slow = None
        if slow is None or slow.after < 0 or not slow.seconds >= 0:
            raise ConfigError(f"{env}={spec!r}: expected {unit}:SECONDS ({unit} >= 0, SECONDS >= 0), e.g. 40:0.5")
        return slow

    def active(self, done: int) -> bool:
        """Whether the work is slow now, ``done`` units done by this process."""
        if self.marker.exists():
            return True
        if done >= self.after:
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.write_text(f"{time.time()}\n")
            return True
        return False


def reward_slowdown(run_dir: Path) -> SlowDown | None:
    """``YATT_SLOW_REWARD=GROUPS:SECONDS``: each group takes SECONDS longer to judge once a
    reward worker has judged GROUPS (one group at a time, as a judge engine that serves one
    batch at a time)."""
    return SlowDown.from_env(SLOW_REWARD_ENV, run_dir / "failpoints" / "slow_reward", "GROUPS")


def training_slowdown(run_dir: Path) -> SlowDown | None:
    """``YATT_SLOW_TRAIN=STEPS:SECONDS``: from step STEPS on, each step's training takes
    SECONDS longer, shared by the ranks (each sleeps SECONDS / world size): compute that more
    ranks split, as longer completions would be."""
    return SlowDown.from_env(SLOW_TRAIN_ENV, run_dir / "failpoints" / "slow_train", "STEPS")


class InjectedFailure(Exception):
    """What a ``raise`` failpoint raises: the same error at the same point in every start."""


class _Failpoint:
    def __init__(self, spec: str, kind: str, nth: int, marker: Path, *, raises: bool) -> None:
        self.spec, self.kind, self.nth, self.marker, self.raises = spec, kind, nth, marker, raises
        self.entered = 0

    def enter(self) -> None:
        with _lock:
            self.entered += 1
            if self.entered != self.nth:
                return
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.write_text(f"{time.time()}\n")
            if self.raises:
                raise InjectedFailure(f"failpoint {self.spec}: raised entering span {self.kind!r} #{self.nth}")
            sys.stderr.write(f"failpoint {self.spec}: SIGKILL entering span {self.kind!r} #{self.nth}\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)


_failpoint: _Failpoint | None = None


def parse_failpoint(spec: str) -> tuple[str, str, int, bool]:
    """``PROCESS:KIND:N[:raise]`` -> (process, kind, n, raises); ConfigError naming the variable otherwise."""
    parts = spec.split(":")
    if (
        len(parts) not in (3, 4) or not all(parts) or not parts[2].isdigit() or int(parts[2]) < 1
        or parts[3:] not in ([], ["raise"])
    ):  # fmt: skip
        raise ConfigError(
            f"{FAILPOINT_ENV}={spec!r}: expected PROCESS:SPAN_KIND:N with N >= 1, e.g. trainer-1:checkpoint_write:2 "
            "(a SIGKILL once per run), or PROCESS:SPAN_KIND:N:raise (an exception in every start)"
        )
    return parts[0], parts[1], int(parts[2]), len(parts) == 4


def arm_failpoint(spec: str, process: str, markers: Path) -> None:
    """Arm ``spec`` in this process when it names ``process`` (``role-index``) and, a kill,
    has not fired in this run yet (no marker in ``markers``)."""
    global _failpoint
    who, kind, nth, raises = parse_failpoint(spec)
    marker = markers / spec.replace(":", "_")
    if who == process and (raises or not marker.exists()):
        _failpoint = _Failpoint(spec, kind, nth, marker, raises=raises)


def configure(path: Path | None) -> None:
    """Start writing this process's spans to ``path`` (appending); ``None`` turns tracing off."""
    global _file, _sampler
    with _lock:
        if _file is not None:
            _file.close()
            _file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            _file = path.open("a", buffering=1)  # line-buffered: a killed process loses at most a line
            if _sampler is None:
                _sampler = threading.Thread(target=_sample_cpu, name="yatt-trace-cpu", daemon=True)
                _sampler.start()


def _cpu_line() -> str:
    return json.dumps({"kind": "_cpu", "start": round(time.time(), 6), "cpu_s": round(time.process_time(), 6)}) + "\n"


def _sample_cpu() -> None:
    while True:
        with _lock:
            if _file is not None:
                _file.write(_cpu_line())
        time.sleep(CPU_SAMPLE_S)


def enabled() -> bool:
    return _file is not None


def record(kind: str, start: float, duration: float) -> None:
    """Write one span that started at wall-clock ``start`` and lasted ``duration`` seconds."""
    if _file is None:
        return
    line = json.dumps({"kind": kind, "start": round(start, 6), "duration": round(duration, 6)}) + "\n"
    if kind == "step":  # a CPU sample at each step's end: a window of steps is always covered,
        line += _cpu_line()  # even when the sampler thread did not get the GIL in time
    with _lock:
        if _file is not None:
            _file.write(line)


@contextmanager
def span(kind: str) -> Iterator[None]:
    """Time the body as one span of ``kind`` (also across ``await`` and in threads)."""
    if _failpoint is not None and kind == _failpoint.kind:
        _failpoint.enter()
    if _file is None:
        yield
        return
    start, t0 = time.time(), time.perf_counter()
    try:
        yield
    finally:
        record(kind, start, time.perf_counter() - t0)


@atexit.register
def _close() -> None:
    global _file
    with _lock:
        if _file is None:
            return
        _file.write(_cpu_line())  # the samples cover the process to its end (a window that ends just before it)
        cpu = time.process_time()
        _file.write(json.dumps({"kind": "_process", "cpu_s": round(cpu, 6), "wall_s": round(time.time() - _wall0, 6)}) + "\n")
        _file.close()
        _file = None
