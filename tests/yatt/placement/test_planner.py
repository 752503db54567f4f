"""The planner as a pure function: hand-computed predictions, the choice in the regimes
where each layout should win, memory refusals, and sanity (more slots are never slower)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from yatt.errors import ConfigError
from yatt.placement.costs import Efficiency, calibrate, estimate_costs, hf_param_count, model_sizes
from yatt.placement.layouts import Roles, assign, cpu_cluster, gpu_cluster
from yatt.placement.plan import LAYOUTS, ClusterSpec
from yatt.placement.planner import (
    GIB,
    Candidate,
    ModelSizes,
    Prediction,
    StageCosts,
    Workload,
    best,
    candidates,
    choose,
    predict,
    steps_in_flight,
)

SMALL = ModelSizes(policy_params=1000, weight_bytes=4, train_bytes=16)
# accepted 8, generated 16 samples x 10 tokens = 160 tokens; trained 8 x (10 + 10) = 160 tokens
COSTS = StageCosts(
    gen_token_s=0.01, gen_latency_s=0.02, completion_mean=10, completion_p90=15, acceptance=0.5,
    train_token_s=0.001, train_fixed_s=0.1, weight_sync_s=0.3, switch_s=0.2, gen_scaling=1.0, train_scaling=1.0,
)  # fmt: skip
WORK = Workload(groups_per_step=2, group_size=4, max_new_tokens=16, prompt_tokens=10, max_batch_sequences=8)
ROLES = Roles(trainers=2, generators=1, rewards=1, controllers=1)

LLAMA3_8B = {
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
}  # fmt: skip
SMOLLM2_135M = {
    "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
}  # fmt: skip
QWEN25_05B = {
    "model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True,
}  # fmt: skip


def gpus(n: int, gib: float = 80.0) -> ClusterSpec:
    return gpu_cluster([int(gib * GIB)] * n, list(range(2 * n)), peak_flops=1e15)


def test_param_count_matches_the_published_sizes() -> None:
    assert hf_param_count(SMOLLM2_135M) == 134_515_008
    assert hf_param_count(LLAMA3_8B) == 8_030_261_248
    assert hf_param_count(QWEN25_05B) == 494_032_768


def test_model_sizes_per_token() -> None:
    s = model_sizes(LLAMA3_8B, weight_bytes=2, reference=True)
    assert s.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, every layer, 8 KV heads of 128
    assert s.reference_params == s.policy_params and s.critic_params == 0 and s.train_bytes == 16
    assert s.activation_bytes_per_token == 32 * 34 * 4096 + 8 * 128256
    with pytest.raises(ConfigError, match="hidden_size"):
        hf_param_count({**LLAMA3_8B, "hidden_size": "4096"})


def test_colocated_is_the_sum_of_its_phases() -> None:
    cluster = cpu_cluster([0, 1], 8 * int(GIB))
    p = predict(assign("colocated", cluster, ROLES), cluster, SMALL, COSTS, WORK)
    # G = 160 * 0.01 / 2 slots = 0.8; tail = 5 * 0.02 = 0.1; T = 0.1 + 160 * 0.001 / 2 = 0.18
    assert p.step_s == pytest.approx(0.8 + 0.1 + 0.2 + 0.18)
    assert p.stages == pytest.approx(
        {"generate": 0.8, "tail": 0.1, "reward": 0.0, "train": 0.18, "weight_sync": 0.0, "switch": 0.2, "env": 0.0}
    )
    assert p.idle_share == pytest.approx({0: 1 - 0.98 / 1.28, 1: 1 - 0.98 / 1.28})


def test_environments_in_the_env_role_take_cpu_time_from_a_cpu_machine_and_overlap_on_a_gpu_one() -> None:
    """E = S * env_s / cores: 16 samples x 0.25 CPU s over 2 cores = 2 s, added on CPU (the
    episode processes share the cores the compute roles use), max() on GPU (host cores)."""
    costs, roles = replace(COSTS, env_s=0.25), replace(ROLES, envs=1)
    cluster = cpu_cluster([0, 1], 8 * int(GIB))
    without = predict(assign("colocated", cluster, ROLES), cluster, SMALL, costs, WORK)
    plan = assign("colocated", cluster, roles)
    with_env = predict(plan, cluster, SMALL, costs, WORK)
    assert with_env.stages["env"] == pytest.approx(2.0) and with_env.step_s == pytest.approx(without.step_s + 2.0)
    assert predict(plan, cluster, SMALL, COSTS, WORK).step_s == pytest.approx(without.step_s)  # not measured yet: 0
    big = gpus(2)  # 4 host cores: E = 1 s
    on_gpu = predict(assign("colocated", big, roles), big, SMALL, costs, WORK)
    alone = predict(assign("colocated", big, ROLES), big, SMALL, costs, WORK)
    assert on_gpu.stages["env"] == pytest.approx(1.0) and on_gpu.step_s == pytest.approx(max(alone.step_s, 1.0))


def test_partial_generates_on_a_subset_then_trains_on_all() -> None:
    cluster = cpu_cluster([0, 1], 8 * int(GIB))
    p = predict(assign("partial", cluster, ROLES), cluster, SMALL, COSTS, WORK)
    step = 1.6 + 0.1 + 0.2 + 0.18 + 0.3  # generation on 1 slot, then training on 2, then the push
    assert p.step_s == pytest.approx(step)
    assert p.idle_share == pytest.approx({0: 1 - (1.6 + 0.18) / step, 1: 1 - 0.18 / step})


def test_disaggregated_overlaps_only_when_staleness_allows() -> None:
    cluster = gpus(4)
    plan = assign("disaggregated", cluster, Roles(trainers=2, generators=2, rewards=1, controllers=1))
    on_policy = predict(plan, cluster, SMALL, COSTS, WORK)
    assert on_policy.step_s == pytest.approx(0.8 + 0.1 + 0.18 + 0.3)
    overlapped = predict(plan, cluster, SMALL, COSTS, replace(WORK, max_staleness=1))
    assert overlapped.step_s == pytest.approx(max(0.8, 0.18 + 0.3))  # the tail is hidden too
    assert overlapped.idle_share == pytest.approx({0: 0.0, 1: 0.0, 2: 1 - 0.18 / 0.8, 3: 1 - 0.18 / 0.8})


def test_only_a_stale_disaggregated_run_queues_a_second_step() -> None:
    """Generation runs a step ahead only where it overlaps training; the planner and the
    replanner both read this one rule."""
    stale = replace(WORK, max_staleness=1)
    assert steps_in_flight("disaggregated", stale) == 2
    assert steps_in_flight("disaggregated", WORK) == 1
    assert steps_in_flight("partial", stale) == steps_in_flight("colocated", stale) == 1


def test_unpinned_processes_share_the_cores() -> None:
    cluster = cpu_cluster([0, 1], 8 * int(GIB))  # 1 generator + 2 ranks on 2 cores: not pinned
    plan = assign("disaggregated", cluster, ROLES)
    taking_turns = predict(plan, cluster, SMALL, COSTS, WORK)  # the idle processes still contend
    assert taking_turns.step_s == pytest.approx((0.8 + 0.1 + 0.18) / COSTS.contention + 0.3)
    concurrent = predict(plan, cluster, SMALL, COSTS, replace(WORK, max_staleness=1))
    assert concurrent.step_s == pytest.approx((0.8 + 0.18) / COSTS.contention + 0.3)


def test_colocated_wins_on_a_few_cores() -> None:
    """A 0.5B model on 2 cores, on-policy: both phases are compute-bound on the same cores,
    and switching in-process is cheaper than pushing 2 GB of weights over the transport."""
    cluster = cpu_cluster([0, 1], 24 * int(GIB), peak_flops=8e10)
    sizes = model_sizes(QWEN25_05B, weight_bytes=4)
    work = Workload(groups_per_step=8, group_size=8, max_new_tokens=64, prompt_tokens=32, micro_batches_per_step=2)
    costs = estimate_costs(sizes=sizes, workload=work, kind="cpu", peak_flops=8e10, acceptance=0.5)
    assert costs.switch_s < costs.weight_sync_s
    plan = choose(cluster, sizes, costs, work, ROLES)
    assert plan.layout == "colocated"
    assert plan.predicted_step_s > 0 and set(plan.idle_share) == {0, 1} and plan.reason.startswith("colocated")


def test_disaggregated_wins_when_balanced_and_stale() -> None:
    """Generation and training about equal on 16 GPUs with max_staleness 1: overlapping them
    (disjoint halves) beats taking turns on every GPU."""
    costs = replace(COSTS, gen_token_s=0.1, train_token_s=0.1, switch_s=1.0, weight_sync_s=0.5)
    work = replace(WORK, max_staleness=1)
    plan = choose(gpus(16), SMALL, costs, work, ROLES, search=True)
    assert plan.layout == "disaggregated"
    counts = plan.counts()
    assert counts["generator"] + counts["trainer"] == 16 and counts["generator"] >= 4
    on_policy = choose(gpus(16), SMALL, costs, WORK, ROLES, search=True)
    assert on_policy.layout == "colocated"


def test_seven_billion_colocated_on_16_gib_is_refused() -> None:
    """Its FSDP shard (7B x 8 bytes / 8 ranks) plus a full bf16 engine (14 GB) exceed a 16 GiB
    slot; the disaggregated split fits, and is chosen although colocated would be faster."""
    sizes = ModelSizes(policy_params=7_000_000_000, weight_bytes=2, train_bytes=8)
    cluster = gpus(8, gib=16)
    cands = {c.layout: c for c in candidates(cluster, sizes, COSTS, WORK, ROLES, search=True)}
    colocated = cands["colocated"]
    assert colocated.refused.startswith("slot 0 needs 19.56 GiB (trainer 6.52, engine 13.04")
    assert colocated.refused.endswith("but has 16.00 GiB")
    assert cands["partial"].refused and not cands["disaggregated"].refused
    plan = choose(cluster, sizes, COSTS, WORK, ROLES, search=True)
    assert plan.layout == "disaggregated"
    assert colocated.prediction is not None and colocated.prediction.step_s < plan.predicted_step_s
    with pytest.raises(ConfigError, match=r"placement.layout: no layout fits .*colocated: slot 0 needs"):
        choose(gpus(8, gib=8), sizes, COSTS, WORK, ROLES, search=True)


def test_kv_cache_and_activations_take_turns_only_when_the_phases_do() -> None:
    sizes = ModelSizes(policy_params=1000, weight_bytes=2, train_bytes=8, kv_bytes_per_token=100,
                       activation_bytes_per_token=300)
    cluster = gpus(2)
    roles = Roles(trainers=1, generators=1, rewards=1, controllers=1)
    # per engine: 16 sequences in flight x (10 + 16) tokens x 100 = 41600; the rank's micro-batch:
    # 8 x (10 + 16) tokens x 300 = 62400
    work = replace(WORK, max_batch_sequences=256)
    colocated = predict(assign("colocated", gpus(1), roles), gpus(1), sizes, COSTS, work)
    assert colocated.memory_bytes == {0: 8000 + 2000 + 62400}
    split = predict(assign("disaggregated", cluster, roles), cluster, sizes, COSTS, work)
    assert split.memory_bytes == {0: 2000 + 41600, 1: 8000 + 62400}
    vllm = replace(work, engine_reserve_share=0.5)  # takes half of its 80 GiB slot, trainer ranks take none
    reserved = predict(assign("disaggregated", cluster, roles), cluster, sizes, COSTS, vllm)
    assert reserved.memory_bytes == {0: 40 * GIB, 1: 8000 + 62400}


def test_ties_go_to_colocated_and_refused_is_never_picked() -> None:
    same = Prediction(step_s=1.0, idle_share={}, stages={}, memory_bytes={})
    faster = replace(same, step_s=0.5)
    tie = [Candidate(layout=layout, plan=None, prediction=same) for layout in reversed(LAYOUTS)]
    assert (pick := best(tie)) is not None and pick.layout == "colocated"
    refused = [Candidate(layout="partial", plan=None, prediction=faster, refused="too big"),
               Candidate(layout="disaggregated", plan=None, prediction=same)]
    assert (pick := best(refused)) is not None and pick.layout == "disaggregated"
    assert best(refused[:1]) is None


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("stale", [0, 1])
def test_more_slots_are_never_slower(layout: str, stale: int) -> None:
    sizes = model_sizes(QWEN25_05B, weight_bytes=2)
    work = Workload(groups_per_step=64, group_size=8, max_new_tokens=1024, max_staleness=stale, micro_batches_per_step=16)
    costs = estimate_costs(sizes=sizes, workload=work, kind="gpu", peak_flops=8e14, acceptance=0.5)
    steps = []
    for n in (2, 4, 8, 16, 32, 64, 128):
        c = next(c for c in candidates(gpus(n), sizes, costs, work, ROLES, search=True) if c.layout == layout)
        assert c.prediction is not None and not c.refused
        steps.append(c.prediction.step_s)
    assert steps == sorted(steps, reverse=True), steps


def test_estimate_from_flops() -> None:
    e = Efficiency(decode=0.5, latency=0.1, forward=0.5, train=0.25, decode_step_s=0.01, train_fixed_s=0.2,
                   sync_bytes_per_s=1e3, sync_fixed_s=0.25, copy_bytes_per_s=1e4, wake_s=0.5, rule_reward_s=0.001)
    sizes = ModelSizes(policy_params=1000, reference_params=500, weight_bytes=2, train_bytes=8)
    c = estimate_costs(sizes=sizes, workload=WORK, kind="cpu", peak_flops=1e6, acceptance=0.5, efficiency=e)
    assert c.gen_token_s == pytest.approx(2000 / 5e5 + 0.01 / 8)  # a full batch (max_batch_sequences 8) at once
    assert c.gen_latency_s == pytest.approx(2000 / 1e5 + 0.01)
    assert c.train_token_s == pytest.approx((6000 + 1000) / 2.5e5)
    assert c.completion_mean == pytest.approx(9.6) and c.completion_p90 == 16.0
    assert c.weight_sync_s == pytest.approx(2.0 + 0.25) and c.switch_s == pytest.approx(0.2 + 0.5)
    assert c.reward_s == 0.001 and c.acceptance == 0.5
    with pytest.raises(ConfigError, match="peak_flops"):
        estimate_costs(sizes=sizes, workload=WORK, kind="cpu", peak_flops=0.0)


def test_calibrate_scales_each_stage_by_measured_over_predicted() -> None:
    # On 2 slots with COSTS: G = 0.8, tail = 0.1, T = 0.18 (see the colocated test).
    row = {"tokens_per_s": 100.0, "samples_per_s": 10.0, "time/train_s": 0.36,
           "time/wait_for_buffer_s": 2.7, "time/weight_sync_s": 0.05, "buffer/acceptance_ema": 0.5}
    warmup = {k: 99.0 for k in row}
    c = calibrate([warmup, row, row], COSTS, WORK, gen_slots=2, train_slots=2)
    assert c.train_token_s == pytest.approx(0.002) and c.train_fixed_s == pytest.approx(0.2)
    assert c.gen_token_s == pytest.approx(0.03) and c.gen_latency_s == pytest.approx(0.06)
    assert c.weight_sync_s == 0.05 and c.completion_mean == 10.0 and c.acceptance == 0.5
    assert c.switch_s == COSTS.switch_s  # the run did not take turns
    took_turns = calibrate([warmup, {**row, "time/switch_s": 0.04}], COSTS, WORK, gen_slots=2, train_slots=2)
    assert took_turns.switch_s == 0.04
    stale = calibrate([warmup, row], COSTS, replace(WORK, max_staleness=1), gen_slots=2, train_slots=2)
    assert stale.gen_token_s == COSTS.gen_token_s  # the wait is not the rollout when overlapped
    assert calibrate([], COSTS, WORK, gen_slots=2, train_slots=2) == COSTS


def test_the_plan_picks_one_rank_over_every_core_when_threads_scale_and_collectives_cost() -> None:
    """trainer.world_size 0: on a CPU machine the planner weighs a rank per core against one
    rank over every core, from the measured thread scaling and the collectives' cost."""
    cluster = cpu_cluster([0, 1], 24 * int(GIB), peak_flops=1e11)
    auto = replace(ROLES, trainers=0)
    big = replace(COSTS, thread_scaling=0.95, gen_thread_scaling=0.9, collective_s=3.0)  # a 135M model over gloo
    small = replace(COSTS, thread_scaling=0.3, gen_thread_scaling=0.05, collective_s=0.005)  # the tiny model
    for costs, ranks in ((big, 1), (small, 2)):
        plan = choose(cluster, SMALL, costs, WORK, auto)
        trainers = plan.of("trainer")
        assert plan.layout == "colocated" and len(trainers) == ranks, (costs, plan.reason)
        assert sum(a.threads for a in trainers) == 2 and sorted(s for a in trainers for s in a.slots) == [0, 1]
    one = predict(assign("colocated", cluster, replace(ROLES, trainers=1, generators=1)), cluster, SMALL, big, WORK)
    two = predict(assign("colocated", cluster, replace(ROLES, trainers=2, generators=2)), cluster, SMALL, big, WORK)
    # T = 0.1 + 160 * 0.001 / k: one rank k(2, 0.95) = 1.95, two ranks k(2, 1.0) = 2 plus the collectives
    assert one.stages["train"] == pytest.approx(0.1 + 0.16 / 1.95)
    assert two.stages["train"] == pytest.approx(0.1 + 0.16 / 2 + 3.0)
    assert one.stages["generate"] == pytest.approx(1.6 / 1.9) and two.stages["generate"] == pytest.approx(0.8)
    # Without a measured thread scaling (a GPU, ranks fixed) a process spanning n slots counts as n.
    assert predict(assign("colocated", cluster, replace(ROLES, trainers=1, generators=1)), cluster, SMALL, COSTS,
                   WORK).step_s == pytest.approx(predict(assign("colocated", cluster, ROLES), cluster, SMALL, COSTS, WORK).step_s)
    # One GPU per rank: a rank per GPU, whatever the threads.
    colocated = next(c for c in candidates(gpus(2), SMALL, big, WORK, auto) if c.layout == "colocated")
    assert colocated.plan is not None and [a.slots for a in colocated.plan.of("trainer")] == [(0,), (1,)]


def test_the_estimate_counts_cpu_collectives_from_the_bytes_they_move() -> None:
    sizes = model_sizes(SMOLLM2_135M, weight_bytes=2)
    work = Workload(groups_per_step=4, group_size=8, max_new_tokens=16, micro_batches_per_step=2)
    cpu = estimate_costs(sizes=sizes, workload=work, kind="cpu", peak_flops=1e11, thread_scaling=(0.9, 0.5))
    # 2 micro-batches x 134.5M parameters x (2 x 2 gathered + 4 reduced) bytes at 0.7 GB/s: 3.07 s
    assert cpu.collective_s == pytest.approx(2 * 134_515_008 * 8 / 0.7e9)
    assert (cpu.thread_scaling, cpu.gen_thread_scaling) == (0.9, 0.5)
    gpu = estimate_costs(sizes=sizes, workload=work, kind="gpu", peak_flops=1e15)
    assert gpu.collective_s == 0 and gpu.thread_scaling is None  # train_scaling covers NCCL's


def test_a_shared_prompt_is_trained_once_per_group() -> None:
    cluster = cpu_cluster([0, 1], 8 * int(GIB))
    shared = replace(WORK, prompt_shared_by=4)
    plain = predict(assign("colocated", cluster, ROLES), cluster, SMALL, COSTS, WORK)
    once = predict(assign("colocated", cluster, ROLES), cluster, SMALL, COSTS, shared)
    # trained: 8 x (10 + 10) = 160 tokens; a group of 4 computing its prompt once: 8 x (10 / 4 + 10) = 100
    assert plain.stages["train"] == pytest.approx(0.1 + 160 * 0.001 / 2)
    assert once.stages["train"] == pytest.approx(0.1 + 100 * 0.001 / 2)
