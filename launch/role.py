"""One role process: ``python -m launch.role ROLE --run-dir DIR --registry EP [--index I]``.

The launcher (``python -m launch run``, or ``srun`` on SLURM) starts one of these per
process. Each reads the resolved config from ``DIR/config.yaml``, takes only its own
sections, serves its actor, registers with the registry (the READY handshake: the
launcher waits for every registration, never for a sleep) and runs until SIGTERM, a
``Shutdown`` message, or (trainer ranks) the end of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import faulthandler
import functools
import linecache
import logging
import os
import signal
import sys
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from launch.config import RunConfig, load_run_config
from launch.placement.plan_file import assignment_for, pin, read_plan, world_size_of
from launch.processes import FAILED_MARK, STOPPED_MARK
from yatt.errors import RUN_STOPPED_EXIT, ConfigError, RunStopped, StorageError
from yatt.runtime import run_dir as names
from yatt.runtime import trace
from yatt.runtime.actor import Actor, cancel
from yatt.runtime.lifetime import die_with_parent, release_freed_memory
from yatt.runtime.registry import Directory, Registration
from yatt.runtime.transport import Transport

if TYPE_CHECKING:
    from workers.reward.scorers import RewardMix
    from yatt.rl.agents.client import AgentRunner
    from yatt.rl.agents.envs import EnvFactory
    from yatt.rl.agents.episodes import EpisodeRunner
    from yatt.rl.data import Prompt

logger = logging.getLogger("yatt.role")

ROLES = ("buffer", "controller", "env", "generator", "reward", "trainer")


def die_with_launcher() -> None:
    """A role started by ``launch run`` dies with its launcher, even a SIGKILLed one (the
    OOM killer): the kernel sends SIGKILL when the parent goes (PR_SET_PDEATHSIG). The
    parent is the launcher, or the fork server the launcher started (``launch.forkserver``),
    which exits when the launcher goes. If the launcher is already gone, exit now."""
    launcher = os.environ.get("YATT_LAUNCHER_PID")
    if not launcher or not sys.platform.startswith("linux"):
        return  # started another way (SLURM steps end with their job)
    import psutil

    die_with_parent(None)
    parent = os.getppid()
    try:
        grandparent = psutil.Process(parent).ppid()
    except psutil.Error:
        grandparent = None
    if int(launcher) not in (parent, grandparent):
        sys.exit(f"launch.role: the launcher (pid {launcher}) is gone; exiting")


def _stop_on_signals(stop: asyncio.Event) -> None:
    """SIGTERM and SIGINT stop the role. SIGUSR1 writes to stderr (the role's log) every
    thread's Python stack (``faulthandler``, from the signal handler itself: even with the
    event loop blocked) and then every asyncio task's: what the launcher asks for before it
    kills a role that did not stop, and when the run stalls."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, write_tasks)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)  # (after: it chains to the loop's)


def write_tasks() -> None:
    """Every asyncio task of this loop, with where it waits, to stderr: the whole chain of
    awaits (``Task.print_stack`` shows a suspended task's outermost frame only)."""
    tasks = asyncio.all_tasks()
    lines = [f"yatt: {len(tasks)} asyncio tasks (SIGUSR1), outermost call first:"]
    for task in tasks:
        lines.append(f"task {task.get_name()!r}:")
        awaited: object = task.get_coro()
        while awaited is not None:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is None:
                break
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}')
            if source := linecache.getline(code.co_filename, frame.f_lineno).strip():
                lines.append(f"    {source}")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    print("\n".join(lines), file=sys.stderr, flush=True)


async def _serve(
    actor: Actor, registry: str, stop: asyncio.Event, until: Callable[[], Awaitable[None]] | None = None,
    registered: Callable[[Registration], None] | None = None,
) -> None:
    """Serve ``actor``, registered, until ``stop`` (or ``until`` returns, or the actor closes);
    ``registered`` is handed its registration (a generator leaves and rejoins the pool)."""
    await actor.start()
    try:
        async with Registration(actor.transport, registry, actor.info(pid=str(os.getpid()))) as registration:
            if registered is not None:
                registered(registration)
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(actor.wait_closed())]
            if until is not None:
                waits.append(asyncio.ensure_future(until()))
            done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            await cancel(pending)
            for task in done:
                task.result()  # re-raise a failure of the role's own work
    finally:
        await actor.close()


def _prompt_sets(cfg: RunConfig, run_dir: Path, model_path: Path) -> tuple[list[Prompt], list[Prompt]]:
    """The run's (training, held-out) prompts: those the launcher wrote to the run dir, else tokenised now."""
    from yatt.rl.data import PROMPT_SETS_FILE, load_prompt_sets, read_prompt_sets

    sets = read_prompt_sets(run_dir / PROMPT_SETS_FILE, cfg.data, str(model_path))
    return sets if sets is not None else load_prompt_sets(cfg.data, str(model_path))


def _shard_images(prompts: list[Prompt], shard: int, shards: int) -> list[Prompt]:
    """A controller's prompts: every one (a key's prompt_index is its position), the images
    (a VLM's pixels) of its own shard's only (index % shards), the only ones it sends."""
    return [
        p if i % shards == shard or not p.mm_inputs else dataclasses.replace(p, mm_inputs={}, images=[])
        for i, p in enumerate(prompts)
    ]


async def _buffer(cfg: RunConfig, args: argparse.Namespace, transport: Transport, stop: asyncio.Event) -> None:
    from yatt.rl.buffer import Buffer

    num_prompts, num_eval_prompts = (len(s) for s in _prompt_sets(cfg, args.run_dir, args.model_path))
    release_freed_memory()  # (it needs their count only: a VLM's prompts hold their pixels)
    actor = Buffer(
        transport,
        endpoint=f"tcp://{args.host}:*",
        config=cfg.buffer,
        num_prompts=num_prompts,
        num_shards=cfg.controller.num_controllers,
        world_size=world_size_of(read_plan(args.run_dir), cfg.trainer.world_size),  # re-planned: the plan's
        seed=cfg.run.seed,
        ledger_path=args.run_dir / names.LEDGER,
        resume_from=args.resume,
        total_steps=0 if args.eval_only else cfg.run.steps,
        num_eval_prompts=num_eval_prompts,
        eval_config=cfg.eval,
        keep_groups=cfg.trainer.share_prompt is not False,  # its prompt computed once, in one micro-batch
    )
    await _serve(actor, args.registry, stop)


async def _controller(cfg: RunConfig, args: argparse.Namespace, transport: Transport, stop: asyncio.Event) -> None:
    from yatt.rl.controller import Controller, ControllerActor

    shards = cfg.controller.num_controllers
    prompts, eval_prompts = (_shard_images(s, args.index, shards) for s in _prompt_sets(cfg, args.run_dir, args.model_path))
    release_freed_memory()
    async with Directory(transport, args.registry, name=f"controller-{args.index}") as directory:
        controller = Controller(
            cfg.controller,
            cfg.algorithm,
            shard=args.index,
            group_size=cfg.buffer.group_size,
            prompts=prompts,
            directory=directory,
            seed=cfg.run.seed,
            eval_prompts=eval_prompts,
            evaluation=cfg.eval,
            episodes=episode_runner(cfg, args.model_path) if cfg.env.enabled else None,
        )
        actor = ControllerActor(transport, endpoint=f"tcp://{args.host}:*", controller=controller)
        await _serve(actor, args.registry, stop, until=lambda: controller.run(stop))


def served_model(cfg: RunConfig) -> str:
    """The model name agent code's OpenAI-compatible endpoint serves (``/v1/models``)."""
    return Path(cfg.model.path).name or "policy"


def episode_runner(cfg: RunConfig, model_path: Path) -> tuple[EpisodeRunner | AgentRunner, EnvFactory | None]:
    """A controller's episode runner (its renderer checked against the model's chat
    template) and, for ``env.inline``, its environment factory (else None: the env role's);
    for ``env.episode``, the runner of the user's function."""
    from transformers import AutoConfig, AutoTokenizer

    from launch.checks import episode_context
    from workers.models import is_vision_language
    from yatt.rl.agents.client import AgentRunner
    from yatt.rl.agents.endpoint import Endpoint
    from yatt.rl.agents.envs import env_factory
    from yatt.rl.agents.episodes import EpisodeRunner
    from yatt.rl.agents.render import Renderer, self_check

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoConfig.from_pretrained(model_path)
    processor = None
    if is_vision_language(model):  # (observations may hold images: its processor expands them)
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(model_path)  # type: ignore[no-untyped-call]
    renderer = Renderer(tokenizer, protocol=cfg.env.render_protocol, name=str(model_path), processor=processor)
    self_check(renderer)
    context = episode_context(cfg, getattr(model.get_text_config(), "max_position_embeddings", None))
    eos = model.eos_token_id if isinstance(model.eos_token_id, list) else [model.eos_token_id]
    decode = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))  # noqa: E731
    eos_ids = {int(i) for i in [*eos, tokenizer.eos_token_id] if i is not None}
    new_tokens = cfg.controller.max_new_tokens
    runner: EpisodeRunner | AgentRunner = (
        AgentRunner(
            cfg.env, renderer, decode=decode, eos_ids=eos_ids, max_new_tokens=new_tokens, context=context,
            endpoint=Endpoint(served_model(cfg)),
        )
        if cfg.env.episode
        else EpisodeRunner(cfg.env, renderer, decode=decode, eos_ids=eos_ids, max_new_tokens=new_tokens, context=context)
    )
    return runner, env_factory(cfg.env) if cfg.env.inline and not cfg.env.episode else None


async def _generator(cfg: RunConfig, args: argparse.Namespace, transport: Transport, stop: asyncio.Event) -> None:
    from workers.engines import make_engine
    from workers.generator import Generator

    engine = await asyncio.to_thread(
        make_engine, str(args.model_path), cfg.generator, device=args.device, dtype=cfg.model.dtype, lora=cfg.model.lora
    )
    actor = Generator(transport, endpoint=f"tcp://{args.host}:*", engine=engine, config=cfg.generator)

    def parkable(registration: Registration) -> None:
        actor.registration = registration

    await _serve(actor, args.registry, stop, registered=parkable)


async def _reward(
    cfg: RunConfig, args: argparse.Namespace, transport: Transport, stop: asyncio.Event, *, mix: RewardMix | None = None
) -> None:
    from workers.reward.worker import Reward

    actor = Reward(transport, endpoint=f"tcp://{args.host}:*", config=cfg.reward, tokenizer_path=str(args.model_path),
                   slow=trace.reward_slowdown(Path(args.run_dir)), mix=mix)
    await _serve(actor, args.registry, stop)


async def _env(cfg: RunConfig, args: argparse.Namespace, transport: Transport, stop: asyncio.Event) -> None:
    from workers.env import EnvWorker

    actor = EnvWorker(transport, endpoint=f"tcp://{args.host}:*", config=cfg.env, model=served_model(cfg))
    await _serve(actor, args.registry, stop)


async def _trainer(cfg: RunConfig, args: argparse.Namespace, transport: Transport, stop: asyncio.Event) -> None:
    from workers.trainer_rank import RankConfig, TrainerRank

    plan = read_plan(args.run_dir)
    mine = assignment_for(plan, "trainer", args.index)
    async with Directory(transport, args.registry, name=f"trainer-{args.index}") as directory:
        rank = await asyncio.to_thread(
            TrainerRank.create,
            RankConfig(
                model=cfg.model, trainer=cfg.trainer, algorithm=cfg.algorithm, generator=cfg.generator,
                transport=cfg.transport, steps=cfg.run.steps, micro_batches_per_step=cfg.buffer.micro_batches_per_step,
                temperature=cfg.controller.temperature, ready_timeout_s=cfg.run.ready_timeout_s,
                rollouts_per_step=cfg.run.rollouts_per_step, eval_every=cfg.run.eval_every, report_to=cfg.run.report_to,
                wandb_project=cfg.run.wandb_project, incarnation=args.incarnation,
            ),
            run_dir=args.run_dir,
            model_path=args.model_path,
            resume=args.resume,
            layout=plan.layout if plan is not None else "disaggregated",
            hosts_generator=mine is not None and mine.hosts_generator,
        )
        actor = rank.actor(transport, endpoint=f"tcp://{args.host}:*")
        async with contextlib.AsyncExitStack() as stack:
            generator = rank.colocated_generator(transport, endpoint=f"tcp://{args.host}:*")
            if generator is not None:  # the colocated layout: this rank serves a generator too
                await generator.start()
                stack.push_async_callback(generator.close)
                info = generator.info(pid=str(os.getpid()))
                await stack.enter_async_context(Registration(transport, args.registry, info))
            await _serve(actor, args.registry, stop, until=lambda: rank.run(directory, stop))


_MAINS = {
    "buffer": _buffer, "controller": _controller, "env": _env, "generator": _generator, "reward": _reward, "trainer": _trainer,
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.role", description=__doc__)
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--run-dir", type=Path, required=True, help="the run dir holding config.yaml")
    parser.add_argument("--registry", required=True, help="the registry's endpoint, tcp://host:port")
    parser.add_argument("--index", type=int, default=0, help="shard of a controller, rank of a trainer, n-th worker")
    parser.add_argument("--model-path", type=Path, required=True, help="the resolved local model directory")
    parser.add_argument("--resume", type=Path, default=None, help="checkpoint dir to resume from")
    parser.add_argument("--incarnation", type=int, default=0, help="a trainer group's restarts in the run")
    parser.add_argument("--eval-only", action="store_true", help="buffer: dispatch nothing to train (launch eval)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--host", default=None, help="the address to bind on (default run.host; on SLURM its node's)")
    args = parser.parse_args(argv)
    die_with_launcher()
    logging.basicConfig(
        level=os.environ.get("YATT_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s {args.role}-{args.index} %(levelname)s %(name)s: %(message)s",
    )
    try:
        _run(args)
    except Exception as e:
        return failed(e)
    return 0


def _run(args: argparse.Namespace) -> None:
    """Serve the role ``args`` name until it stops."""
    cfg = load_run_config(args.run_dir / names.CONFIG)
    pin(assignment_for(read_plan(args.run_dir), args.role, args.index))  # before any model loads
    role_main = _MAINS[args.role]
    if args.role == "reward":
        from workers.reward.scorers import RewardMix

        # Before any thread starts (tracing's sampler, ZeroMQ's, the event loop's): its
        # scorer pool is forked while this process runs one thread, not spawned.
        mix = RewardMix(cfg.reward, tokenizer_path=str(args.model_path))
        role_main = functools.partial(_reward, mix=mix)
    args.host = args.host or cfg.run.host
    if cfg.run.trace:
        trace.configure(args.run_dir / "trace" / f"{args.role}-{args.index}.jsonl")
    if failpoint := os.environ.get(trace.FAILPOINT_ENV):
        trace.arm_failpoint(failpoint, f"{args.role}-{args.index}", args.run_dir / "failpoints")

    async def run() -> None:
        stop = asyncio.Event()
        _stop_on_signals(stop)
        async with Transport(cfg.transport) as transport:
            await role_main(cfg, args, transport, stop)

    asyncio.run(run())


def failed(error: Exception) -> int:
    """Say how this role failed, last in its log (stderr), and return its exit code.

    A failure a restart cannot fix, ``error`` or one of its causes (``raise ... from``: an
    actor's ``ActorFailed`` carries its task's error so) a ``RunStopped``, a ``ConfigError``
    or a ``StorageError`` (a full disk stays full): ``yatt: the run cannot go on: <why>``
    and ``RUN_STOPPED_EXIT``, the launcher stops the run with that line. Any other: its
    traceback, then ``yatt: failed: <error> (at <file>:<line>)`` of its innermost cause,
    by which the launcher tells a failure that repeats (``launch.processes.failure_of``), and 1.
    """
    chain: list[BaseException] = [error]
    while (cause := chain[-1].__cause__) is not None and cause not in chain:
        chain.append(cause)
    hopeless = next((e for e in chain if isinstance(e, (RunStopped, ConfigError, StorageError))), None)
    if isinstance(hopeless, RunStopped):  # not a crash: its message says why (a scorer's traceback included)
        print(f"{STOPPED_MARK}{hopeless}", file=sys.stderr, flush=True)
        return RUN_STOPPED_EXIT
    traceback.print_exception(error)
    if hopeless is not None:
        print(f"{STOPPED_MARK}{_first_line(hopeless) or type(hopeless).__name__}", file=sys.stderr, flush=True)
        return RUN_STOPPED_EXIT
    root = chain[-1]
    kind = type(root).__qualname__ if type(root).__module__ == "builtins" else f"{type(root).__module__}.{type(root).__qualname__}"
    frames = traceback.extract_tb(root.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    text = _first_line(root)
    print(f"{FAILED_MARK}{kind}{': ' + text if text else ''}{where}", file=sys.stderr, flush=True)
    return 1


def _first_line(error: BaseException) -> str:
    """The first line of ``error``'s message ("" when it has none)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


if __name__ == "__main__":
    sys.exit(main())
