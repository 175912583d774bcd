"""The planner on a mixture of experts (hybridpar.plan.experts): Llama 4 Scout's and Maverick's parameters,
expert state per ep rank, all-to-all bytes and FLOPs against hand arithmetic from the presets' shapes,
and their plans on H100s. (The dry run's state, counted on the real model, is held to the planner's in
tests/test_dryrun.py.)"""

import dataclasses
import json

import pytest

from hybridpar.models.args import ModelArgs
from hybridpar.plan import Layout, Workload, estimate, make_plan
from hybridpar.plan.experts import dense_skeleton, expert_terms
from hybridpar.plan.hardware import spec

D, L, KV, VOCAB, HIDDEN, DENSE = 5120, 48, 8 * 128, 202048, 8192, 16384  # both presets' shapes
ATTENTION = 2 * D * D + 2 * D * KV + 2 * D  # wq, wo; wk, wv; the two norms
EXPERT = 3 * D * HIDDEN  # one SwiGLU of the experts' hidden size (each routed expert, and the shared one)
ENDS = 2 * VOCAB * D + D  # the embedding, the output head, the final norm


def _by_hand(n_experts: int, moe: int, active: bool) -> int:
    experts = 1 if active else n_experts  # experts_per_token = 1 in both
    return L * ATTENTION + moe * ((experts + 1) * EXPERT + n_experts * D) + (L - moe) * 3 * D * DENSE + ENDS


def test_scout_and_maverick_total_and_active_parameters_by_hand():
    scout, maverick = ModelArgs.from_preset("llama4_scout"), ModelArgs.from_preset("llama4_maverick")
    assert scout.num_params() == _by_hand(16, 48, False) and round(scout.num_params() / 1e9, 1) == 107.8
    assert scout.num_params(active=True) == _by_hand(16, 48, True) and round(scout.num_params(active=True) / 1e9, 1) == 17.2
    assert maverick.num_params() == _by_hand(128, 24, False) and round(maverick.num_params() / 1e9, 1) == 400.7
    assert maverick.num_params(active=True) == _by_hand(128, 24, True)
    # The planner's state of the whole model on one rank: every parameter once, fp32 params, grads, 2 moments.
    for args in (scout, maverick):
        e = estimate(args, Layout(mp=1, dp_shard=1), Workload(seq_len=8192), spec("h100", 1))
        assert e.memory.params == 4 * args.num_params() and e.memory.optimizer == 8 * args.num_params()
        skeleton = dense_skeleton(args)
        assert skeleton.num_params() + expert_terms(args, Layout(1, 1), Workload(8192)).local == args.num_params()


def test_expert_state_per_ep_rank_and_the_rest_over_every_dp_rank():
    """Maverick at mp 8 x dp_shard 32, ep 8: each rank holds 128 / 8 = 16 experts of each of the 24 MoE
    layers, their hidden size / 8, FSDP-sharded over the 32 / 8 = 4 ranks holding the same ones; the
    routers over all 32."""
    args = ModelArgs.from_preset("llama4_maverick")
    x = expert_terms(args, Layout(mp=8, dp_shard=32, ep=8), Workload(seq_len=8192))
    assert x.experts_per_rank == 16 and x.expert_fsdp == 4
    assert x.expert_unit == 16 * EXPERT // 8
    assert x.sharded == 24 * (4 * EXPERT // 8 + 128 * D // 32)
    at_ep1 = expert_terms(args, Layout(mp=8, dp_shard=32), Workload(seq_len=8192))
    assert at_ep1.experts_per_rank == 128 and at_ep1.sharded == x.sharded  # 128 / 32 = 16 / 4 experts' worth either way
    assert at_ep1.expert_unit == 8 * x.expert_unit and at_ep1.all_to_all_mb == 0


@pytest.mark.parametrize("ac,recomputed", [("none", 0), ("full", 24), ("selective", 0)])
def test_all_to_all_bytes_per_step_by_hand(ac, recomputed):
    """Dispatch and combine, forward and backward (again in a recomputed layer's forward): tokens x top-k x
    dim in bf16 each, plus the tokens-per-expert counts (128 int64) before each forward dispatch; (ep - 1) / ep of
    it leaves the rank, over the 45 GB/s a GPU has between nodes (the ep group spans 8 nodes at mp 8).
    Maverick's MoE layers are the odd ones: AC every 2 recomputes none of them."""
    args, tokens = ModelArgs.from_preset("llama4_maverick"), 2 * 8192
    layout, workload = Layout(mp=8, dp_shard=32, ep=8, ac=ac), Workload(seq_len=8192, micro_batch=2, global_batch=128)
    e = estimate(args, layout, workload, spec("h100", 256))
    per_micro_batch = (4 * 24 + 2 * recomputed) * tokens * D * 2 + (24 + recomputed) * 128 * 8
    assert e.grad_accum == 2 and e.experts.all_to_all_mb == per_micro_batch
    assert e.experts.leaving_share == 7 / 8
    assert e.time.ep_comm == pytest.approx(2 * per_micro_batch * 7 / 8 / 45e9)


def test_flops_are_six_times_the_active_parameters_and_the_attention():
    args = ModelArgs.from_preset("llama4_scout")
    e = estimate(args, Layout(mp=8, dp_shard=8, ep=8), Workload(seq_len=8192), spec("h100", 64))
    matmuls = _by_hand(16, 48, True) - VOCAB * D  # the embedding's lookup is free; the head is a matmul
    assert e.model_flops_per_step == (6 * matmuls + 12 * L * D * 8192) * e.tokens_per_step


@pytest.mark.parametrize("preset,gpus", [("llama4_scout", 64), ("llama4_maverick", 256)])
def test_the_planner_prices_scout_and_maverick_on_h100_searching_ep(preset, gpus):
    args, hw = ModelArgs.from_preset(preset), spec("h100", gpus)
    plan = make_plan(args, Workload(seq_len=8192), hw)
    assert plan.fitting and all(e.memory.total <= hw.usable_bytes for e in plan.fitting)
    eps = {e.layout.ep for e in plan.estimates}
    assert {1, 2, 8} <= eps and all(args.n_experts % ep == 0 and e.layout.dp_shard % ep == 0
                                    for e in plan.estimates for ep in [e.layout.ep])
    # cp: the job refuses it with Llama 4; pp: layouts fit without it, so it is not searched.
    assert all(e.layout.pp == e.layout.cp == 1 for e in plan.estimates) and not plan.pipeline
    best = plan.fitting[0]
    assert best.layout.ep > 1 and best.time.ep_comm > 0
    # Experts shrink the state as ep grows only through who shards them: the same layout at ep 1 holds as much
    # state but all-gathers every expert over dp_shard.
    same = estimate(args, dataclasses.replace(best.layout, ep=1), Workload(seq_len=8192), hw)
    assert same.memory.state == pytest.approx(best.memory.state, rel=0.01)
    assert same.memory.gathered_params > best.memory.gathered_params


def test_cli_plans_maverick_with_active_parameters_and_the_ep_flag(capsys):
    from hybridpar import cli

    assert cli.main(["plan", "--model", "llama4_maverick", "--gpus", "256", "--gpu", "h100", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "400.71B parameters (17.18B active per token: 1 of 128 experts and the shared expert in 24 MoE layers" in out
    assert "assumed: balanced routing" in out and "a2a s" in out
    best = out.split("\nbest: ")[1]
    assert "all-to-all" in best and "of each MoE layer's on a GPU" in best and "--parallel.ep " in best


def test_cli_refuses_context_parallelism_for_llama4_in_one_line_as_the_job_does(capsys):
    """The job's line (hybridpar.config.llama4.check_llama4: tests/test_preflight.py) names what cp does not run;
    the planner's names the same, and the flag to change."""
    from hybridpar import cli
    from hybridpar.config.llama4 import context_parallel_gaps

    args = ModelArgs.from_preset("llama4_scout")
    assert cli.main(["plan", "--model", "llama4_scout", "--gpus", "64", "--gpu", "h100", "--cp", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(f"--cp 2: {context_parallel_gaps(args)} (hybridpar.config.llama4); plan "
                                             "it with --cp 1"), err
    assert "routed experts (n_experts = 16)" in err[0] and "pipeline" not in err[0]
    with pytest.raises(ValueError, match=r"^cp = 2: context parallelism does not run Llama 4's .* plan it with --cp 1$"):
        estimate(args, Layout(mp=8, dp_shard=4, cp=2), Workload(seq_len=8192), spec("h100", 64))


def _stage_experts(n_moe: int, n_experts: int, mp: int, ep: int) -> int:
    """Elements of n_moe MoE layers' routed experts and routers on one rank, by hand."""
    return n_moe * (n_experts // ep * EXPERT // mp + n_experts * D)


@pytest.mark.parametrize("preset,gpus,moe", [("llama4_scout", 64, 48), ("llama4_maverick", 256, 24)])
def test_pipeline_stages_hold_their_share_of_the_experts(preset, gpus, moe):
    """--pp 2: every layout a pipeline of two stages (1F1B, interleaved), each rank holding half the MoE layers
    (Scout's 48 all MoE; Maverick's odd 24 of 48), so half the experts' state of the same layout without pp."""
    args, hw = ModelArgs.from_preset(preset), spec("h100", gpus)
    workload = Workload(seq_len=8192, global_batch=4 * gpus)
    plan = make_plan(args, workload, hw, pp=2)
    assert plan.fitting and plan.pipeline == (2,) and all(e.layout.pp == 2 for e in plan.estimates)
    assert {e.layout.pp_schedule for e in plan.estimates} == {"1F1B", "Interleaved1F1B"}
    for e in plan.fitting[:5]:
        lay = e.layout
        assert e.memory.total <= hw.usable_bytes and e.time.pp_bubble > 0 and e.tokens_per_s_per_gpu > 0
        assert e.experts.local == _stage_experts(moe // 2, args.n_experts, lay.mp, lay.ep)
        whole = estimate(args, dataclasses.replace(lay, pp=1, pp_schedule="1F1B", v=1),
                         dataclasses.replace(workload, global_batch=0), spec("h100", gpus // 2))
        assert whole.experts.local == 2 * e.experts.local and whole.experts.sharded == 2 * e.experts.sharded
        # Per step the stage's experts gather once and their all-to-alls carry each micro-batch's tokens.
        assert e.experts.all_to_all_mb == pytest.approx(whole.experts.all_to_all_mb / 2, rel=1e-3)


def test_the_search_tries_pipeline_stages_for_llama4_when_nothing_fits_without():
    """Scout on 16 H100s fits no layout without pp: the planner tries pp as for a dense model."""
    args = ModelArgs.from_preset("llama4_scout")
    plan = make_plan(args, Workload(seq_len=8192, global_batch=64), spec("h100", 16))
    assert plan.pipeline == (2, 4, 8, 16) and any(e.layout.pp > 1 for e in plan.estimates)


def test_float8_speeds_up_only_the_dense_skeleton():
    """float8 runs in the skeleton's linears (attention, the shared expert, the dense layers); the routed
    experts, the router and the all-to-alls stay bf16: float8 saves, on the same layout, exactly what it saves
    on the skeleton alone."""
    args, hw = ModelArgs.from_preset("llama4_scout"), spec("h100", 64)
    f8, bf16 = Workload(seq_len=8192, float8="tensorwise", compile=True), Workload(seq_len=8192, compile=True)
    plan = make_plan(args, f8, hw)
    assert plan.fitting
    best = plan.fitting[0]
    same = estimate(args, best.layout, bf16, hw)
    assert best.experts.work_mb == same.experts.work_mb and best.time.ep_comm == same.time.ep_comm > 0
    skeleton, dense = dense_skeleton(args), dataclasses.replace(best.layout, ep=1)
    saved = estimate(skeleton, dense, bf16, hw).time.compute - estimate(skeleton, dense, f8, hw).time.compute
    assert saved > 0 and same.time.compute - best.time.compute == pytest.approx(saved, rel=1e-6)
    # Faster per step; in compute by less than the skeleton's own ratio, the experts' share unchanged.
    assert best.time.step < same.time.step and best.tokens_per_s_per_gpu > same.tokens_per_s_per_gpu
    ratio = estimate(skeleton, dense, bf16, hw).time.compute / estimate(skeleton, dense, f8, hw).time.compute
    assert 1 < same.time.compute / best.time.compute < ratio


def test_compile_fuses_the_blocks_and_leaves_the_routed_experts_eager():
    """train.compile: the blocks' elementwise chains fused, MoE.routed eager (the experts' work unchanged)."""
    args, hw = ModelArgs.from_preset("llama4_maverick"), spec("h100", 256)
    compiled, eager = Workload(seq_len=8192, compile=True), Workload(seq_len=8192)
    plan = make_plan(args, compiled, hw)
    assert plan.fitting and plan.fitting[0].memory.total <= hw.usable_bytes
    best = plan.fitting[0]
    same = estimate(args, best.layout, eager, hw)
    assert best.experts.work_mb == same.experts.work_mb
    assert best.time.compute < same.time.compute and best.tokens_per_s_per_gpu > same.tokens_per_s_per_gpu


def test_an_ep_the_experts_or_dp_shard_do_not_allow_is_refused():
    args, w, hw = ModelArgs.from_preset("llama4_scout"), Workload(seq_len=8192), spec("h100", 64)
    with pytest.raises(ValueError, match="^ep = 32 does not divide the model's 16 experts"):
        estimate(args, Layout(mp=2, dp_shard=32, ep=32), w, hw)
    with pytest.raises(ValueError, match="^ep = 16 does not divide dp_shard = 8"):
        estimate(args, Layout(mp=8, dp_shard=8, ep=16), w, hw)
    with pytest.raises(ValueError, match="^ep = 2: a dense model has no experts"):
        estimate(ModelArgs.from_preset("llama3_8b"), Layout(mp=1, dp_shard=8, ep=2), w, spec("h100", 8))


def test_the_plans_json_gives_active_parameters_ep_and_the_all_to_all():
    from hybridpar.plan import plan_json

    args = ModelArgs.from_preset("llama4_scout")
    data = plan_json(make_plan(args, Workload(seq_len=8192), spec("h100", 64)), "llama4_scout", "--model.preset llama4_scout")
    assert data["parameters"] == _by_hand(16, 48, False) and data["active_parameters"] == _by_hand(16, 48, True)
    at_ep = [row for row in data["layouts"] if row["ep"] > 1]
    assert at_ep and all(row["all_to_all_bytes"] > 0 and row["all_to_all_s"] > 0 for row in at_ep)
    assert all(row["all_to_all_bytes"] == 0 for row in data["layouts"] if row["ep"] == 1)
    best = data["layouts"][0]  # fitting layouts first, the fastest first
    assert best["fits"] and best["config"] == data["best"] and best["ep"] > 1
    assert f"--parallel.ep {best['ep']} " in data["best"]


# --- --ep N: the planner prices the ep the user intends to run ---------------------------------------


def test_a_fixed_ep_keeps_only_its_layouts_each_estimated_as_in_the_full_search():
    """make_plan(ep=8) (`--ep 8`): Scout on 64 H100s, only ep 8 layouts, exactly the full search's ep 8 ones and
    their estimates; --ep 1 (every GPU holds all 16 experts) is a plan too, without all-to-alls."""
    args, w, hw = ModelArgs.from_preset("llama4_scout"), Workload(seq_len=8192), spec("h100", 64)
    fixed, free = make_plan(args, w, hw, ep=8), make_plan(args, w, hw)
    assert fixed.expert_parallel == 8 and fixed.fitting and {e.layout.ep for e in fixed.estimates} == {8}
    assert {e.layout for e in fixed.estimates} == {e.layout for e in free.estimates if e.layout.ep == 8}
    best = fixed.fitting[0]
    lay = best.layout
    same = [e for e in free.find(lay.mp, lay.dp_shard, lay.dp_replicate, lay.ac, ep=8)
            if e.layout == lay]
    assert same == [best] and best.time.ep_comm > 0
    assert len(free.find(lay.mp, lay.dp_shard, lay.dp_replicate, lay.ac)) > len(same)  # other eps, without ep=
    whole = make_plan(args, w, hw, ep=1)
    assert whole.fitting and all(e.layout.ep == 1 and e.experts.experts_per_rank == 16 and e.time.ep_comm == 0
                                 for e in whole.estimates)


def test_cli_plans_a_fixed_ep_end_to_end(capsys, tmp_path):
    from hybridpar import cli

    path = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", "llama4_scout", "--gpus", "64", "--gpu", "h100", "--ep", "8", "--top", "100",
                     "--json", str(path)]) == 0
    out = capsys.readouterr().out
    table = out.split("\n  # layout ")[1].split("\n\n")[0].splitlines()[1:]  # the rows under the header
    rows = [line.split()[1] for line in table if not line.startswith("    ...")]
    assert rows and all("_ep8_" in name for name in rows), rows
    assert "(ep 8 of them)" in out.split("\nbest: ")[1].splitlines()[0] and "--parallel.ep 8 " in out
    assert "expert parallelism: ep 8 only (--ep 8); without --ep the planner searches every ep" in out
    data = json.loads(path.read_text())
    assert data["layouts"] and {row["ep"] for row in data["layouts"]} == {8} and "--parallel.ep 8 " in data["best"]


SCOUT_64 = ["--model", "llama4_scout", "--gpus", "64", "--gpu", "h100"]


@pytest.mark.parametrize("argv,line", [
    (["--model", "llama3_8b", "--gpus", "8", "--gpu", "h100", "--ep", "2"],
     "--ep 2: a dense model has no experts to split (n_experts = 0); drop --ep"),
    ([*SCOUT_64, "--ep", "3"],
     "--ep 3 does not divide the model's 16 experts (n_experts): choose an --ep dividing 16 (1, 2, 4, 8, 16)"),
    ([*SCOUT_64, "--ep", "-1"], "--ep -1: ep must be 1 or more (0, or no --ep: the planner chooses)"),
    (["--model", "llama4_scout", "--gpus", "8", "--gpu", "h100", "--ep", "16"],
     "--ep 16 fits no layout of 8 GPUs: ep takes its ranks from dp_shard and must divide it, and dp_shard is at "
     "most 8 here; choose an ep that fits (1, 2, 4, 8), or more GPUs"),
    (["--model", "llama4_scout", "--gpus", "16", "--gpu", "h100", "--ep", "8", "--pp", "4"],
     "--ep 8 fits no layout of 16 GPUs at --pp 4: ep takes its ranks from dp_shard and must divide it, and dp_shard "
     "is at most 4 here; choose an ep that fits (1, 2, 4), or more GPUs or fewer pipeline stages"),
    (["--model", "llama4_scout", "--gpus", "16", "--gpu", "h100", "--ep", "8", "--global-batch", "4"],
     "global batch 4 is not a multiple of dp x micro-batch (1) for any data-parallel size of 16 GPUs that ep 8 "
     "divides ([8, 16]): choose a global batch divisible by one of them, or a smaller --ep"),
    ([*SCOUT_64, "--ep", "8", "--cp", "2"], "--cp 2: {gaps} (hybridpar.config.llama4); plan it with --cp 1"),
], ids=["dense", "not-dividing-the-experts", "negative", "above-dp_shard", "above-a-stage's-dp_shard", "batch", "cp"])
def test_an_ep_the_model_or_the_gpus_do_not_allow_is_one_line(capsys, argv, line):
    from hybridpar import cli
    from hybridpar.config.llama4 import context_parallel_gaps

    line = line.format(gaps=context_parallel_gaps(ModelArgs.from_preset("llama4_scout")))
    assert cli.main(["plan", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [f"hybridpar: error: {line}"]


def test_with_ep_fixed_the_report_says_which_stages_it_left_out_and_what_more_gpus_buy(capsys):
    """Scout on 16 H100s fits nothing without pp. At --ep 8 only pp 2 leaves a stage a dp_shard of 8: pp 4, 8, 16
    are named as left out, not as considered. At --ep 16 no stage has room, and mp is held at 1 (ep takes all 16
    GPUs' dp_shard): more GPUs do help, at mp 2, which the hint names instead of 'more GPUs will not do'."""
    from hybridpar import cli

    args, w, hw = ModelArgs.from_preset("llama4_scout"), Workload(seq_len=8192, global_batch=64), spec("h100", 16)
    plan = make_plan(args, w, hw, ep=8)
    assert plan.pipeline == (2,) and plan.pipeline_left == (4, 8, 16)
    assert {e.layout.pp for e in plan.estimates} == {1, 2} and {e.layout.ep for e in plan.estimates} == {8}
    assert cli.main(["plan", "--model", "llama4_scout", "--gpus", "16", "--gpu", "h100", "--global-batch", "64",
                     "--ep", "16"]) == 1
    out = capsys.readouterr().out
    assert "pp 2, 4, 8, 16 not considered: stages of 8, 4, 2, 1 GPUs take no layout (ep 16 must divide their " \
           "dp_shard)" in out and "pipeline parallelism considered" not in out
    hints = next(line for line in out.splitlines() if line.startswith("no layout fits"))
    assert "pipeline parallelism (--pp N" not in hints and "more GPUs will not do" not in hints
    assert "another --ep, or none" in hints
    at_mp = {mp: estimate(args, Layout(mp=mp, dp_shard=16, ep=16, ac="full"), w, spec("h100", 16 * mp))
             for mp in (1, 2)}
    other = {mp: e.memory.total - e.memory.state for mp, e in at_mp.items()}
    assert other[1] > hw.usable_bytes > other[2]
    assert (f"more GPUs: activations and buffers alone need {other[1] / 2**30:.1f} GiB at mp 1, all that ep 16 leaves "
            f"of 16 GPUs; mp 2 on 32 GPUs needs {other[2] / 2**30:.1f} GiB of them") in hints
