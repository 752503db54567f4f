"""``python -m benchmarks faults``: kill each role of the default job mid-run, and the
goodput of a run with a failure every K steps against an undisturbed one and against
restarting everything.

- Kills: one run per role (controller, generator, reward, buffer, trainer rank 1, and a
  buffer that hangs: SIGSTOP), the role killed once after step ``at``; then kills inside
  a stage of milliseconds, landed by a failpoint (``yatt.runtime.trace``): trainer rank 0 halfway
  through a weight push, the generator loading weights, each trainer rank writing a
  checkpoint (in the background). From the ledger and the metrics: did the kill land,
  did the run finish unattended, groups lost (a prompt before the last trained one that
  was neither trained nor filtered, in the seeded prompt order), groups duplicated (a
  group, or a prompt, trained twice in the run as it stands) and steps trained twice
  (voided by a rewind, then trained again).
- Goodput, as RobustRL reports it: effective training time over wall time, where the
  effective time of a run is the wall time of the same run without failures (the same
  steps, startup included). Three runs of ``steps`` steps: no failure; a role killed every
  ``every`` steps (cycling through controller, generator, reward, buffer, trainer rank);
  the restart-everything baseline (the whole job killed at the same steps and resumed with
  ``--resume``, the recovery verl and NeMo-RL have). Per failure of the role-restart run,
  the seconds it cost (``failure_cost``: the wall time of the steps around it, from the
  metrics' timestamps, over as many median steps).

- Checkpoint cost (asked for: ``--set 'parts=[checkpoint]'``): the step time of a job
  (``checkpoint_model``, SmolLM2-135M by default) with a checkpoint every step, written
  synchronously and in the background (``trainer.checkpoint_async``), against the same
  job checkpointing only at the end.
- Fuzz: ``fuzz_frames`` random and mutated frames into every port of a running default
  job (the roles' and the registry's) with the run's keys, and a tenth as many with a key of its own
  (``benchmarks/fuzzing.py``): role crashes (restarts), replies to the keyless peer, and
  whether the run finished.
- Soak: the default job without its all-equal filter (``SOAK_ITEMS``) for ``soak_steps``
  steps, the RSS and open fds of every role process sampled every 2 s from 10% of the
  steps on; RSS growth from the median of the first tenth of the samples to that of the
  last tenth (``Usage``), in percent and in MiB per 1,000 steps (over the steps between
  the two). Then the cost of rebuilding the buffer from the soak's ledger
  (``replay_cost``): from the newest checkpoint's snapshot, as a restarted buffer does,
  against a replay of the whole ledger.

Options (``--set``): ``steps`` (30), ``at`` (8), ``every`` (10), ``checkpoint_every`` (5),
``checkpoint_model`` (builtin:smollm2), ``checkpoint_steps`` (5), ``fuzz_frames`` (100000),
``soak_steps`` (2000), ``goodput_repeats`` (1), ``goodput_items`` ([]: overrides of the goodput runs), ``parts`` ([kills, goodput, fuzz, soak]; add ``checkpoint``).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.fuzzing import role_processes
from benchmarks.harness import Result
from launch.config import load_run_config
from launch.prepare import latest_checkpoint
from yatt.errors import ConfigError
from yatt.rl.ledger import Ledger
from yatt.rl.sampling import epoch_order
from yatt.runtime import run_dir as names
from yatt.runtime.configtools import build
from yatt.runtime.run_dir import read_jsonl
from yatt.runtime.trace import FAILPOINT_ENV

REPO = Path(__file__).resolve().parents[1]
QUICK = {
    "steps": 10, "at": 4, "every": 5, "checkpoint_every": 3, "fuzz_frames": 2000, "soak_steps": 60,
    "checkpoint_model": "", "checkpoint_steps": 4,
}
ROTATION = [("controller", 0), ("generator", 0), ("reward", 0), ("buffer", 0), ("trainer", 1)]


@dataclass(frozen=True, kw_only=True)
class Options:
    steps: int = 30
    """Steps of every run."""
    at: int = 8
    """The kill runs kill their role once this many steps are done."""
    every: int = 10
    """Goodput: a failure every this many steps."""
    checkpoint_every: int = 5
    """trainer.checkpoint_every of every run (what a trainer restart and --resume go back to)."""
    fuzz_frames: int = 100_000
    """Fuzzed messages with the run's keys (and a tenth as many without)."""
    soak_steps: int = 2000
    """Steps of the soak run."""
    checkpoint_model: str = "builtin:smollm2"
    """model.path of the checkpoint-cost runs ("" for the tiny default)."""
    checkpoint_steps: int = 5
    """Steps of each checkpoint-cost run."""
    goodput_repeats: int = 1
    """Goodput: pairs of undisturbed and role-restart runs, interleaved (the median ratio)."""
    goodput_items: list[str] = field(default_factory=list)
    """Config overrides of the goodput runs alone, e.g. a larger batch for longer steps:
    ``[buffer.groups_per_step=48, controller.max_new_tokens=16]``."""
    parts: list[str] = field(default_factory=lambda: ["kills", "goodput", "fuzz", "soak"])
    """Which parts to run (the suite; ``checkpoint`` too, ~7 min more, by asking for it)."""

    def __post_init__(self) -> None:
        for name in ("steps", "at", "every", "checkpoint_every", "fuzz_frames", "soak_steps", "checkpoint_steps", "goodput_repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"faults.{name} must be >= 1 (got {getattr(self, name)})")
        unknown = set(self.parts) - set(PARTS)
        if unknown:
            raise ConfigError(f"faults.parts: unknown {sorted(unknown)}; known: {', '.join(PARTS)}")
        if self.at >= self.steps:
            raise ConfigError(f"faults.at = {self.at} must be < faults.steps = {self.steps}")


@dataclass(kw_only=True)
class Outcome:
    finished: bool
    wall_s: float
    lost: int
    duplicated: int
    steps_twice: int


def launch_run(
    run_dir: Path, items: list[str], *, resume: Path | None = None, failpoint: str = "", env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``python -m launch run ITEMS`` in its own session, its output appended to
    ``<run_dir>.launcher.log``; ``failpoint`` armed (``yatt.runtime.trace``) and ``env`` added."""
    cmd = [sys.executable, "-m", "launch", "run", *items, "--run-dir", str(run_dir), "--no-progress"]
    if resume is not None:
        cmd += ["--resume", str(resume)]
    full_env = {**os.environ, **(env or {}), **({FAILPOINT_ENV: failpoint} if failpoint else {})}
    log = (run_dir.parent / f"{run_dir.name}.launcher.log").open("ab")
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=full_env)


def _steps(run_dir: Path) -> int:
    path = run_dir / names.METRICS
    return len(read_jsonl(path)) if path.exists() else 0


def _wait(proc: subprocess.Popen[bytes], run_dir: Path, steps: int, timeout_s: float = 900) -> bool:
    """Until ``steps`` steps are done (True) or the launcher exits (False)."""
    deadline = time.monotonic() + timeout_s
    while _steps(run_dir) < steps:
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.3)
    return True


def _kill(run_dir: Path, role: str, index: int, sig: signal.Signals = signal.SIGKILL) -> bool:
    pid = role_processes(run_dir).get(f"{role}-{index}")
    if pid is not None:
        os.kill(pid, sig)
    return pid is not None


def training_prompts(run_dir: Path) -> int:
    """How many training prompts the run's data has (those of ``data.eval_split`` aside):
    the length of each epoch's seeded order."""
    from yatt.rl.data import load_prompts

    cfg = load_run_config(run_dir / names.CONFIG)
    return len(load_prompts(cfg.data, cfg.model.path or str(run_dir / "model")))


def audit(run_dir: Path, seed: int, num_prompts: int, wall_s: float, finished: bool) -> Outcome:
    """What the ledger and the metrics say of a run that ended."""
    metrics = read_jsonl(run_dir / names.METRICS)
    ledger = Ledger(run_dir / names.LEDGER)
    try:
        entries, history = ledger.entries(), ledger.history()
    finally:
        ledger.close()
    trained = [e for e in entries if e.status == "trained"]
    by_key = Counter(e.key for e in trained)
    by_prompt = Counter((e.key.epoch, e.key.prompt_index) for e in trained)
    duplicated = sum(n - 1 for n in by_key.values()) + sum(n - 1 for n in by_prompt.values())
    final: dict[tuple[int, int], tuple[int, str]] = {}  # prompt -> (attempt, status) of its newest attempt
    for e in entries:
        prompt = (e.key.epoch, e.key.prompt_index)
        if e.status != "duplicate" and e.key.attempt >= final.get(prompt, (-1, ""))[0]:
            final[prompt] = (e.key.attempt, e.status)
    lost = 0
    if trained:
        order = [(epoch, i) for epoch in range(max(p[0] for p in final) + 1) for i in epoch_order(num_prompts, seed, epoch)]
        last = max(order.index(p) for p, (_, status) in final.items() if status == "trained")
        lost = sum(final.get(p, (0, "missing"))[1] not in ("trained", "filtered") for p in order[: last + 1])
    voided = sum(e.status == "trained" for e in history) - len(trained)
    groups_per_step = max(1, len(trained) // max(1, len(metrics)))
    return Outcome(
        finished=finished,
        wall_s=wall_s,
        lost=lost,
        duplicated=duplicated,
        steps_twice=voided // groups_per_step,
    )


def _run(
    run_dir: Path, items: list[str], kills: list[tuple[int, str, int, signal.Signals]], restart_all: bool,
    failpoint: str = "",
) -> tuple[float, int]:
    """One run, killing ``(after_step, role, index, signal)`` in order (the whole job when
    ``restart_all``, then ``--resume``), and with ``failpoint`` armed (``yatt.runtime.trace``);
    returns the wall seconds of all its launchers and how many kills found their process."""
    start, landed = time.perf_counter(), 0
    proc = launch_run(run_dir, items, failpoint=failpoint)
    for after, role, index, sig in kills:
        if not _wait(proc, run_dir, after):
            break
        if restart_all:
            os.kill(proc.pid, signal.SIGKILL)  # every role dies with its launcher
            proc.wait()
            while role_processes(run_dir):
                time.sleep(0.2)
            if latest_checkpoint(run_dir) is None:  # nothing to resume: start over
                for name in (names.METRICS, *names.LEDGER_FILES):
                    (run_dir / name).unlink(missing_ok=True)
                proc = launch_run(run_dir, items)
            else:
                proc = launch_run(run_dir, items, resume=run_dir)
            landed += 1
        else:
            landed += _kill(run_dir, role, index, sig)
    proc.wait(timeout=1800)
    return time.perf_counter() - start, landed


@dataclass(kw_only=True)
class Usage:
    """One role process's resident memory and open fds, first (after warm-up) and last:
    RSS as the medians of the first and of the last tenth of its samples (one sample
    swings by a few percent with the step's allocations: trainer-0 471-502 MiB within 30
    steps), at the medians of those samples' steps done; fds as the first and last sample."""

    rss_mb: tuple[float, float]
    fds: tuple[int, int]
    steps: tuple[float, float] = (0.0, 0.0)

    @property
    def rss_growth(self) -> float:
        return self.rss_mb[1] / self.rss_mb[0] - 1

    @property
    def rss_mb_per_step(self) -> float:
        """RSS growth per step from the first tenth to the last (MiB); NaN when they span
        no step (a leak's signature: a role that leaks per step grows by it every step,
        whatever its size, where a relative bound lets a large process leak more)."""
        span = self.steps[1] - self.steps[0]
        return (self.rss_mb[1] - self.rss_mb[0]) / span if span > 0 else math.nan

    @classmethod
    def of(cls, samples: list[tuple[float, int]], steps: list[int] | None = None) -> Usage:
        """From (RSS MiB, fds) samples in time order and the steps done at each (none: no
        per-step figure)."""
        tenth = max(1, len(samples) // 10)
        rss = [r for r, _ in samples]
        done = steps or [0] * len(samples)
        return cls(
            rss_mb=(statistics.median(rss[:tenth]), statistics.median(rss[-tenth:])),
            fds=(samples[0][1], samples[-1][1]),
            steps=(statistics.median(done[:tenth]), statistics.median(done[-tenth:])),
        )


SOAK_ITEMS = ["buffer.filter=none"]
"""The soak's job: the default job without its all-equal filter. With it, the policy
solves most sums after ~200 steps, almost every group is filtered and steps wait 1-4 s on
generation (527 steps in 17 min): a soak measures growth per step at a steady rate, and
the filter's saturated regime has tests of its own (the bound on dynamic sampling)."""


def soak(run_dir: Path, steps: int, items: list[str] | None = None) -> dict[str, Usage]:
    """The default job (``SOAK_ITEMS``) for ``steps`` steps; each role process's RSS and
    fds, sampled every 2 s from 10% of the steps on, with the steps done at each sample."""
    import psutil

    proc = launch_run(run_dir, [f"run.steps={steps}", *SOAK_ITEMS, *(items or [])])
    samples: dict[str, list[tuple[float, int]]] = {}
    at: dict[str, list[int]] = {}
    while proc.poll() is None:
        done = _steps(run_dir)
        if done >= max(1, steps // 10) and done < steps:
            for name, pid in role_processes(run_dir).items():
                try:
                    p = psutil.Process(pid)
                    samples.setdefault(name, []).append((p.memory_info().rss / 2**20, p.num_fds()))
                except psutil.Error:
                    continue
                at.setdefault(name, []).append(done)
        time.sleep(2.0)
    if proc.returncode != 0:
        raise RuntimeError(f"the soak run failed; see {run_dir.parent / (run_dir.name + '.launcher.log')}")
    return {n: Usage.of(s, at[n]) for n, s in samples.items()}


def run(*, quick: bool = False, options: dict[str, object] | None = None) -> Result:
    opts = build(Options, {**(QUICK if quick else {}), **(options or {})}, "faults")
    items = [f"run.steps={opts.steps}", f"trainer.checkpoint_every={opts.checkpoint_every}", "placement.layout=disaggregated"]
    result = Result()
    with tempfile.TemporaryDirectory(prefix="yatt-faults-") as tmp:
        for part in opts.parts:
            PARTS[part](Path(tmp), opts, items, result, quick)
        late_stops(Path(tmp), result)
    return result


def late_stops(tmp: Path, result: Result) -> None:
    """A role the launcher had to SIGKILL because it did not stop within its grace (15 s of
    a run's wall time): counted, and each one's line and where it was (its stacks, at the
    end of its log) kept in the notes, since the run dirs go with the benchmark."""
    from launch.processes import log_tail

    late = 0
    for log in sorted(tmp.glob("*.launcher.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "did not stop within" not in line:
                continue
            late += 1
            role_log = Path(line.rsplit("end of its log: ", 1)[-1].rstrip(")"))
            stacks = log_tail(role_log, 80) if role_log.exists() else "(its log is gone)"
            result.notes.append(f"{log.name}: {line}\n{stacks}")
    result.figures["roles_killed_after_the_stop_grace"] = float(late)


@dataclass(frozen=True, kw_only=True)
class Kill:
    """One kill run: a signal to ``role-index`` once ``faults.at`` steps are done, or, to
    land inside a stage of milliseconds, a failpoint (``yatt.runtime.trace``) armed from the start."""

    name: str
    label: str
    role: str = ""
    index: int = 0
    sig: signal.Signals = signal.SIGKILL
    failpoint: str = ""
    items: tuple[str, ...] = ()


def kill_cases(opts: Options, tensors: int, quick: bool) -> list[Kill]:
    """Every role after step ``at``, the buffer hung, and the kills inside a stage: rank 0
    halfway through a weight push (one tensor per bucket, ``tensors`` buckets a push),
    the generator loading weights, each rank writing the first checkpoint after step ``at``."""
    cases = [Kill(name=f"{r}{i}", label=f"{r}-{i}", role=r, index=i) for r, i in (ROTATION[:2] if quick else ROTATION)]
    if quick:
        return cases
    checkpoint = opts.at // opts.checkpoint_every + 1  # its n-th checkpoint, the first after step `at`
    return [
        *cases,
        Kill(name="buffer0_stop", label="buffer-0 (SIGSTOP)", role="buffer", sig=signal.SIGSTOP),
        Kill(
            name="trainer0_push", label=f"trainer-0 in a weight push (bucket {tensors // 2 + 1} of {tensors}, step {opts.at + 1})",
            failpoint=f"trainer-0:weight_bucket:{opts.at * tensors + tensors // 2 + 1}",
            items=("trainer.weight_bucket_mb=0.0001",),
        ),
        Kill(name="generator0_load", label=f"generator-0 loading weights (version {opts.at + 1})",
             failpoint=f"generator-0:weight_load:{opts.at + 1}"),
        *(
            Kill(name=f"trainer{rank}_ckpt", label=f"trainer-{rank} writing checkpoint step_{checkpoint * opts.checkpoint_every}",
                 failpoint=f"trainer-{rank}:checkpoint_write:{checkpoint}")
            for rank in (0, 1)
        ),
    ]


def _tensors_per_push(tmp: Path) -> int:
    """Tensors of the default job's model (one bucket each with a tiny bucket size)."""
    from safetensors import safe_open

    from workers.models import build_tiny_model

    with safe_open(str(build_tiny_model(tmp / "tiny-model") / "model.safetensors"), "pt") as f:
        return len(list(f.keys()))


def _kills(tmp: Path, opts: Options, items: list[str], result: Result, quick: bool) -> None:
    seed, f = load_run_config(None).run.seed, result.figures
    table = ["role killed | kill landed | finished unattended | groups lost | groups duplicated | steps trained twice | wall s"]
    for case in kill_cases(opts, _tensors_per_push(tmp), quick):
        run_dir = tmp / case.name
        if case.failpoint:
            wall, _ = _run(run_dir, [*items, *case.items], [], False, failpoint=case.failpoint)
            landed = (run_dir / "failpoints" / case.failpoint.replace(":", "_")).exists()
        else:
            wall, signalled = _run(run_dir, items, [(opts.at, case.role, case.index, case.sig)], False)
            landed = signalled == 1
        out = audit(run_dir, seed, training_prompts(run_dir), wall, _steps(run_dir) == opts.steps)
        table.append(
            f"{case.label} | {'yes' if landed else 'NO'} | {'yes' if out.finished else 'NO'} | {out.lost} | "
            f"{out.duplicated} | {out.steps_twice} | {wall:.0f}"
        )
        f[f"kill_{case.name}_landed"] = float(landed)
        f[f"kill_{case.name}_finished"] = float(out.finished)
        f[f"kill_{case.name}_groups_lost"] = float(out.lost)
        f[f"kill_{case.name}_groups_duplicated"] = float(out.duplicated)
        f[f"kill_{case.name}_steps_trained_twice"] = float(out.steps_twice)
    result.notes.append(
        f"kills (default job, disaggregated, {opts.steps} steps, checkpoint every {opts.checkpoint_every}, "
        f"signals after step {opts.at}, failpoints in the stage named):"
    )
    result.notes.extend(table)


def _goodput(tmp: Path, opts: Options, items: list[str], result: Result, quick: bool) -> None:
    seed, f, r = load_run_config(None).run.seed, result.figures, result.ratios
    kills = [(k, *ROTATION[(k // opts.every - 1) % len(ROTATION)], signal.SIGKILL) for k in range(opts.every, opts.steps, opts.every)]
    items = [*items, *opts.goodput_items]
    # Undisturbed and role-restart runs interleaved, ``goodput_repeats`` pairs: two runs of
    # the same job here differ by ~5% in median step and ~1.5 s in start-up, as much as all
    # the failures cost; the pairs' median ratio is reported.
    runs = [(f"{name}{'' if i == 0 else f'_{i + 1}'}", plan, False) for i in range(opts.goodput_repeats) for name, plan in (("undisturbed", []), ("role_restart", kills))]
    walls: dict[str, float] = {}
    spans: dict[str, float] = {}
    for name, plan, restart_all in [*runs, ("restart_all", kills, True)]:
        run_dir = tmp / name
        began = time.time()
        wall, landed = _run(run_dir, items, plan, restart_all)
        ended = time.time()
        out = audit(run_dir, seed, training_prompts(run_dir), wall, _steps(run_dir) == opts.steps)
        walls[name] = f[f"wall_s_{name}"] = wall
        f[f"kills_landed_{name}"] = float(landed)
        f[f"finished_{name}"] = float(out.finished)
        f[f"groups_lost_{name}"] = float(out.lost)
        f[f"groups_duplicated_{name}"] = float(out.duplicated)
        if not out.finished:
            continue
        rows = read_jsonl(run_dir / names.METRICS)
        unix = [row["time/unix"] for row in rows]
        spans[name] = unix[-1] - unix[0]  # first step's end to the last's: start-up and export left out
        # Where the rest of the wall time went: the launch to the first step's end, the
        # last step's end to the launcher's exit (export, stopping the roles).
        f[f"startup_s_{name}"], f[f"shutdown_s_{name}"] = unix[0] - began, ended - unix[-1]
        f[f"step_s_median_{name}"] = statistics.median(row["time/step_s"] for row in rows[1:])
        if name.startswith("role_restart"):
            lost = 0.0
            for after, role, index, _ in kills:
                back = opts.checkpoint_every if role == "trainer" else 0
                lost += (cost := failure_cost(unix, after, back))
                f[f"s_lost_{role}_{index}_after_{after}{name.removeprefix('role_restart')}"] = cost
            # The same figure from this run's own timestamps: not swayed by a noisy undisturbed run.
            f[f"goodput_{name}_from_costs"] = 1 - lost / wall
    pairs = [(runs[i][0], runs[i + 1][0]) for i in range(0, len(runs), 2)]
    f["goodput_role_restart"] = statistics.median(walls[u] / walls[d] for u, d in pairs)
    if all(u in spans and d in spans for u, d in pairs):
        f["goodput_role_restart_steps"] = statistics.median(spans[u] / spans[d] for u, d in pairs)
    costs = [f[k] for k in f if k.startswith("goodput_role_restart") and k.endswith("_from_costs")]
    if costs:
        f["goodput_role_restart_from_costs_median"] = statistics.median(costs)
    undisturbed, disturbed = (statistics.median(walls[run[i]] for run in pairs) for i in (0, 1))
    f["goodput_restart_all"] = undisturbed / walls["restart_all"]
    if kills:  # what one failure costs: wall time over the undisturbed runs', per failure
        f["s_per_failure_role_restart"] = (disturbed - undisturbed) / len(kills)
        f["s_per_failure_restart_all"] = (walls["restart_all"] - undisturbed) / len(kills)
    r["goodput_role_restart_vs_restart_all"] = f["goodput_role_restart"] / f["goodput_restart_all"]
    r["wall_role_restart_vs_restart_all"] = disturbed / walls["restart_all"]
    result.notes.append(
        f"goodput: a failure every {opts.every} steps ({len(kills)} in the run{', ' + ' '.join(opts.goodput_items) if opts.goodput_items else ''}) cycling through "
        + ", ".join(f"{role}-{i}" for role, i in ROTATION)
        + f"; {opts.goodput_repeats} undisturbed and role-restart runs interleaved (the median of their pairs' ratios);"
        " restart_all kills the whole job at the same steps and resumes it with --resume;"
        " goodput_role_restart_steps: the same ratio over the time from the first step's end to the last's"
    )


def failure_cost(unix: list[float], after: int, back: int = 0, span: int = 3) -> float:
    """Seconds a failure landing after step ``after`` (that many lines in metrics.jsonl)
    cost: the wall time from the end of step ``after - back - 1`` to the end of step
    ``after + span - 1`` (``time/unix``) over what as many median steps take. ``span``:
    the steps its recovery can stall; ``back``: the steps a trainer group's restart can
    roll back and train again (the checkpoint interval)."""
    median = statistics.median(b - a for a, b in itertools.pairwise(unix))
    lo, hi = max(0, after - back - 1), min(len(unix) - 1, after + span - 1)
    return (unix[hi] - unix[lo]) - (hi - lo) * median


def _checkpoint_cost(tmp: Path, opts: Options, items: list[str], result: Result, quick: bool) -> None:
    """What a checkpoint every step costs a step: the same job with a checkpoint only at the
    end, then one every step written synchronously, then in the background."""
    import statistics

    f = result.figures
    job = [
        f"run.steps={opts.checkpoint_steps}", "placement.layout=disaggregated", f"model.path={opts.checkpoint_model}",
        "buffer.groups_per_step=2", "buffer.group_size=2", "buffer.filter=none",  # SmolLM2 rarely solves digits
    ]
    for name, extra in (
        ("none", ["trainer.checkpoint_every=0"]),
        ("sync", ["trainer.checkpoint_every=1", "trainer.checkpoint_async=false"]),
        ("async", ["trainer.checkpoint_every=1", "trainer.checkpoint_async=true"]),
    ):
        run_dir = tmp / f"checkpoint_{name}"
        _run(run_dir, [*job, *extra], [], False)
        if _steps(run_dir) != opts.checkpoint_steps:
            log = tmp / f"{run_dir.name}.launcher.log"
            raise RuntimeError(f"the {name} checkpoint run failed:\n{log.read_text()[-3000:]}")
        lines = read_jsonl(run_dir / names.METRICS)[1:-1]  # not the warm-up, nor the final (synchronous) save
        f[f"checkpoint_{name}_step_s"] = statistics.median(m["time/step_s"] for m in lines)
        f[f"checkpoint_{name}_in_step_s"] = statistics.median(m["time/checkpoint_s"] for m in lines)
    state = tmp / "checkpoint_sync" / "checkpoints" / "step_1" / "trainer"
    f["checkpoint_state_mb"] = sum(p.stat().st_size for p in state.iterdir()) / 2**20
    for name in ("sync", "async"):
        f[f"checkpoint_{name}_cost_per_step_s"] = f[f"checkpoint_{name}_step_s"] - f["checkpoint_none_step_s"]
        result.ratios[f"step_time_checkpoint_{name}_vs_none"] = f[f"checkpoint_{name}_step_s"] / f["checkpoint_none_step_s"]
    result.notes.append(
        f"checkpoint cost ({opts.checkpoint_model or 'tiny'} model, {f['checkpoint_state_mb']:.0f} MB of state, "
        f"{opts.checkpoint_steps} steps, median step of steps 1..{opts.checkpoint_steps - 2}): "
        + "; ".join(
            f"{n}: {f[f'checkpoint_{n}_step_s']:.2f} s/step, {f[f'checkpoint_{n}_in_step_s']:.2f} s of it in the checkpoint"
            for n in ("none", "sync", "async")
        )
    )


def _fuzz(tmp: Path, opts: Options, items: list[str], result: Result, quick: bool) -> None:
    from benchmarks.fuzzing import fuzz, launcher_ports, role_ports

    f = result.figures
    run_dir = tmp / "fuzz"
    proc = launch_run(run_dir, items)
    if _wait(proc, run_dir, 2):
        ports = [port for listed in role_ports(run_dir).values() for port in listed] + launcher_ports(proc.pid, run_dir)
        start = time.perf_counter()
        keyed = fuzz(ports, opts.fuzz_frames, keys=run_dir / "keys", authorised=True)
        f["fuzz_frames_per_s"] = keyed.sent / (time.perf_counter() - start)
        keyless = fuzz(ports, opts.fuzz_frames // 10, keys=run_dir / "keys", authorised=False, seed=1)
        f["fuzz_frames_sent"] = float(keyed.sent + keyless.sent)
        f["fuzz_ports"] = float(len(ports))
        f["fuzz_replies_to_keyed_peer"] = float(keyed.replies)
        f["fuzz_replies_to_keyless_peer"] = float(keyless.replies)
        f["fuzz_steps_done_when_fuzz_ended"] = float(_steps(run_dir))
    proc.wait(timeout=1800)
    log = (tmp / "fuzz.launcher.log").read_text()
    f["fuzz_role_crashes"] = float(log.count("exited with code") + log.count("stopped answering"))
    f["fuzz_run_finished"] = float(proc.returncode == 0 and _steps(run_dir) == opts.steps)


def _soak(tmp: Path, opts: Options, items: list[str], result: Result, quick: bool) -> None:
    usage = soak(tmp / "soak", opts.soak_steps, ["placement.layout=disaggregated"])
    for name, u in sorted(usage.items()):
        result.figures[f"soak_{name}_rss_growth_pct"] = 100 * u.rss_growth
        result.figures[f"soak_{name}_rss_mb_per_1000_steps"] = 1000 * u.rss_mb_per_step
        result.figures[f"soak_{name}_fds_growth"] = float(u.fds[1] - u.fds[0])
    result.notes.append(
        f"soak ({opts.soak_steps} steps): "
        + "; ".join(
            f"{n} RSS {u.rss_mb[0]:.0f} -> {u.rss_mb[1]:.0f} MiB ({1000 * u.rss_mb_per_step:+.1f} MiB per 1,000 steps), "
            f"fds {u.fds[0]} -> {u.fds[1]}"
            for n, u in sorted(usage.items())
        )
    )
    cost = replay_cost(tmp / "soak")
    result.figures.update({f"buffer_replay_{k}": v for k, v in cost.items()})
    result.ratios["buffer_replay_from_snapshot_vs_whole_ledger"] = cost["snapshot_s"] / cost["whole_s"]
    result.ratios["buffer_replay_from_previous_snapshot_vs_whole_ledger"] = cost["previous_s"] / cost["whole_s"]
    result.notes.append(
        f"buffer rebuilt from the soak's ledger ({cost['rows']:.0f} rows, median of {REPLAYS}): from the last "
        f"checkpoint's snapshot {cost['snapshot_events']:.0f} events in {cost['snapshot_s']:.3f} s, from the one before "
        f"it {cost['previous_events']:.0f} in {cost['previous_s']:.3f} s, the whole ledger {cost['whole_events']:.0f} "
        f"in {cost['whole_s']:.3f} s"
    )


REPLAYS = 5


def replay_cost(run_dir: Path) -> dict[str, float]:
    """Seconds to rebuild the buffer of a finished run from its ledger (what a restarted
    buffer does, ``SamplingBuffer.replay``): from the newest snapshot (the run's last
    checkpoint); from the one before it, the most a restart between two checkpoints
    replays (a copy of the ledger without the newest); and from the first row (a copy
    without any). The median of ``REPLAYS`` of each, interleaved; all three must come back
    to the same state."""
    import sqlite3

    from yatt.rl.sampling import SamplingBuffer

    cfg = load_run_config(run_dir / names.CONFIG)
    num_prompts = training_prompts(run_dir)
    ledgers = {"snapshot": run_dir / names.LEDGER}
    for name, delete in (
        ("previous", "DELETE FROM snapshots WHERE seq = (SELECT MAX(seq) FROM snapshots)"),
        ("whole", "DELETE FROM snapshots"),
    ):
        ledgers[name] = run_dir.parent / f"{run_dir.name}.{name}-ledger.db"
        ledgers[name].unlink(missing_ok=True)
        with contextlib.closing(sqlite3.connect(ledgers["snapshot"])) as src, contextlib.closing(sqlite3.connect(ledgers[name])) as dst:
            src.backup(dst)
            dst.execute(delete)
            dst.commit()
            rows = float(dst.execute("SELECT COUNT(*) FROM decisions").fetchone()[0])

    def rebuild(path: Path) -> tuple[float, int, SamplingBuffer]:
        ledger = Ledger(path)
        try:
            buf = SamplingBuffer(
                cfg.buffer, num_prompts=num_prompts, num_shards=cfg.controller.num_controllers,
                world_size=cfg.trainer.world_size, seed=cfg.run.seed, ledger=ledger, total_steps=cfg.run.steps,
            )
            start = time.perf_counter()
            events = buf.replay()
            return time.perf_counter() - start, events, buf
        finally:
            ledger.close()

    times: dict[str, list[float]] = {name: [] for name in ledgers}
    events: dict[str, int] = {}
    states: dict[str, tuple[object, ...]] = {}
    for _ in range(REPLAYS):
        for name, path in ledgers.items():
            seconds, events[name], buf = rebuild(path)
            times[name].append(seconds)
            states[name] = (buf.cursor, buf.step, buf.version, buf.ema, buf.dispatch_end, buf.stats, sorted(buf.decided))
    if len(set(map(repr, states.values()))) != 1:
        raise RuntimeError(f"the buffers rebuilt from a snapshot and from the whole ledger differ: {states}")
    figures = {"rows": rows}
    for name in ledgers:
        figures[f"{name}_s"] = statistics.median(times[name])
        figures[f"{name}_events"] = float(events[name])
    return figures


PARTS = {"kills": _kills, "goodput": _goodput, "checkpoint": _checkpoint_cost, "fuzz": _fuzz, "soak": _soak}
