"""``verify preflight``'s scaled twin and hazards.

Multi-rank configurations share one spawned 8-rank world (two phases, grids
side by side); each is compared with refgrad through the same code the CLI
uses (:func:`finish_twin_report`). The broken-fastgrad run goes through the CLI
end to end. Hazard decisions are checked against hand-derived expectations.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fastgrad.deferred_wgrad import ColumnParallelOutputLayer, EmbeddingWgradConfig
from gradvocab import Averaging, ParallelDims, RankPlace
from refgrad.pipeline import EMBEDDING_PARAM, HEAD_PARAM, stage_param_name
from tests.candidates.fastgrad_faults import Fault, FaultyFastgrad, output_layer_class
from tests.distributed_utils import run_distributed
from tests.timeouts import HANG_GUARD_S
from tests.verify.preflight_launch import parsed_launch, preflight_args, preflight_config
from verify.candidates import FastgradCandidate
from verify.candidates.fastgrad.pipeline_model import (
    build_stage_model,
    drained_head,
    external_grad_params,
)
from verify.distributed import DistributedRunError, free_port
from verify.metrics import assert_bitwise_equal, bitwise_equal
from verify.preflight import cli as preflight_cli
from verify.preflight.cli import build_report
from verify.preflight.findings import launch_settings, reached
from verify.preflight.hazards import FINDING, SAFE, decide_hazards
from verify.preflight.render import render_markdown, twin_tables
from verify.preflight.timing import CostInputs
from verify.preflight.twin import (
    AdamWTwin,
    TwinOptions,
    TwinPrecision,
    TwinSizeError,
    finish_twin_report,
    plan_twin,
    verdict,
)
from verify.preflight.twin.bounds import ulp_bound_factor
from verify.preflight.twin.bounds import within as _within
from verify.preflight.twin.compare import StepRow
from verify.preflight.twin.rank import TwinRun, twin_phases_worker
from verify.preflight.twin.reference import reference_for

MODEL = ["--micro-batch-size", "1", "--num-layers", "8", "--hidden-size", "64",
         "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
         "--padded-vocab-size", "128"]
SMALL = TwinOptions(hidden_size=8, layers=1, steps=2)

# PP2 DP2 M4: tied embedding, deferred output-layer wgrad, overlap, distributed optimizer.
TIED_DEFERRED = ["--pipeline-model-parallel-size", "2", "--world-size", "4",
                 "--global-batch-size", "8", "--defer-embedding-wgrad-compute",
                 "--overlap-grad-reduce", "--use-distributed-optimizer"]
# PP2 VPP2 DP1 M4: interleaved, distributed optimizer, bf16 grads with fp32-accumulating RS.
INTERLEAVED = ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank",
               "2", "--world-size", "2", "--global-batch-size", "4",
               "--use-distributed-optimizer", "--bf16", "--grad-reduce-in-bf16",
               "--ddp-reduce-scatter-with-fp32-accumulation", "--overlap-grad-reduce"]
# PP1 DP3 M4: all-reduce at a non-power-of-two DP (gloo picks the order: the ULP bound).
DP3 = ["--pipeline-model-parallel-size", "1", "--world-size", "3",
       "--global-batch-size", "12"]
# TP2 PP2 DP1 M8 (TP not twinned: listed), untied, deferral limit 2.
TP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
       "--world-size", "4", "--global-batch-size", "8", "--untie-embeddings-and-output-weights",
       "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "2"]

# PP2 DP1 M4: untied output layer computed in the backward, AdamW through the distributed optimizer.
UNTIED_ADAMW = ["--pipeline-model-parallel-size", "2", "--world-size", "2",
                "--global-batch-size", "4", "--untie-embeddings-and-output-weights",
                "--use-distributed-optimizer", "--overlap-grad-reduce"]


def _config(flags: list[str]):
    parsed = parsed_launch(MODEL + flags)
    config = preflight_config(MODEL + flags)
    return config, build_report(config, parsed, CostInputs())


# PP2 DP2 M4 with overlap and 2 layers per stage, SGD: production's bucket rule (stage 0
# bucketed, stage 1 one bucket).
BUCKETS = ["--pipeline-model-parallel-size", "2", "--world-size", "4",
           "--global-batch-size", "8", "--untie-embeddings-and-output-weights",
           "--overlap-grad-reduce"]

# TP2 PP2 DP2 M4, sequence parallel: vocab-parallel output layer (input all-gathered, dgrad
# reduce-scattered, deferred drain all-gathers), blocks on sequence shards with grads all-reduced
# over TP; tied (a vocab-parallel first layer reduce-scattered along the sequence, each TP
# rank's shard tied to its output-layer shard), overlap, distributed optimizer (AdamW).
TP2_SP = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
          "--world-size", "8", "--global-batch-size", "8", "--sequence-parallel",
          "--defer-embedding-wgrad-compute", "--overlap-grad-reduce", "--use-distributed-optimizer"]
# TP2 PP1 DP2 M4, sequence parallel, tied: each TP rank's vocab-parallel first-layer shard is its
# output-layer shard (one weight), the blocks on sequence shards.
TP2_SP_PP1 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
              "--world-size", "4", "--global-batch-size", "8", "--sequence-parallel"]
# TP2 PP2 VPP2 DP1 M4, sequence parallel, interleaved: the TP all-reduce after the chunks' sync.
TP2_SP_VPP = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--num-virtual-stages-per-pipeline-rank", "2", "--world-size", "4",
              "--global-batch-size", "4", "--sequence-parallel", "--overlap-grad-reduce"]

# PP2 VPP2 DP2 M4 interleaved with the output layer on the last virtual stage: tied embedding
# (chunk 0 of stage 0 and the head), every microbatch's wgrad deferred, overlap.
INTERLEAVED_DEFERRED = ["--pipeline-model-parallel-size", "2",
                        "--num-virtual-stages-per-pipeline-rank", "2", "--world-size", "4",
                        "--global-batch-size", "8", "--defer-embedding-wgrad-compute",
                        "--overlap-grad-reduce"]

# TP2 PP2 DP2 M4, tied without sequence parallelism: the vocab-parallel first layer's partial
# products all-reduced over TP; deferred output-layer wgrad, AdamW without the distributed
# optimizer.
TP2_TIED = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--world-size", "8", "--global-batch-size", "8",
            "--defer-embedding-wgrad-compute"]

# PP1 DP2 M4, tied: production's embedding and output layer are one weight (the output layer's
# wgrad, then the embedding's grad, into its main_grad per microbatch; no all-reduce), with
# overlap and the distributed optimizer (AdamW, the weight once in the grad norm).
PP1_TIED = ["--pipeline-model-parallel-size", "1", "--world-size", "2",
            "--global-batch-size", "8", "--overlap-grad-reduce", "--use-distributed-optimizer"]

# name -> (flags, phase, first rank, twin options)
LAYOUT = {"tied_deferred": (TIED_DEFERRED, 0, 0, SMALL), "interleaved": (INTERLEAVED, 0, 4, SMALL),
          "untied_adamw": (UNTIED_ADAMW, 0, 6, SMALL),
          "dp3": (DP3, 1, 0, SMALL), "tp2": (TP2, 1, 4, SMALL),
          "buckets": (BUCKETS, 2, 0, replace(SMALL, layers=2)), "tp2_sp_pp1": (TP2_SP_PP1, 2, 4, SMALL),
          "tp2_sp": (TP2_SP, 3, 0, SMALL), "tp2_sp_vpp": (TP2_SP_VPP, 4, 0, SMALL),
          "interleaved_deferred": (INTERLEAVED_DEFERRED, 4, 4, SMALL),
          "tp2_tied": (TP2_TIED, 6, 0, SMALL), "pp1_tied": (PP1_TIED, 5, 2, SMALL)}
# Broken fastgrads, trained beside them: name -> (flags, phase, first rank, options, candidate).
BROKEN = {"interleaved_lifo": (INTERLEAVED_DEFERRED[:5] + ["2", "--global-batch-size", "4",  # DP 1
                                                            "--defer-embedding-wgrad-compute"],
                               5, 0, SMALL, FaultyFastgrad(Fault.LIFO_DRAIN)),
          # TP2 PP2 DP1, tied: each first-stage shard all-reduced with the other TP rank's head.
          "tp2_crossed": (TP2_TIED[:5] + ["4", "--global-batch-size", "4"], 5, 4, SMALL,  # DP 1
                          FaultyFastgrad(Fault.CROSSED_EMBEDDING_GROUP)),
          # PP1 DP2, tied (one weight): the embedding's grad added before the output layer's
          # wgrad in each microbatch, or the output layer's wgrad never added.
          "pp1_embedding_first": (PP1_TIED, 7, 0, SMALL,
                                  FaultyFastgrad(Fault.EMBEDDING_GRAD_FIRST)),
          "pp1_head_dropped": (PP1_TIED, 7, 2, SMALL,
                               FaultyFastgrad(Fault.DROPPED_HEAD_WGRAD))}


@pytest.fixture(scope="module")
def twins():
    """Every configuration of LAYOUT trained in one spawned world; plans and results by name."""
    plans, phases = {}, [[] for _ in range(8)]
    layout = {name: (*entry, FastgradCandidate()) for name, entry in LAYOUT.items()} | BROKEN
    for name, (flags, phase, first, options, candidate) in layout.items():
        config, report = _config(flags)
        plan = plan_twin(config, options)
        plan = replace(plan, case=plan.case.at(first))
        plans[name] = (config, report, plan, phase, len(phases[phase]), candidate)
        phases[phase].append(TwinRun(plan.case, plan.overlap, plan.training, candidate))
    ranks = run_distributed(twin_phases_worker, 8, phases, timeout_s=300)
    out = {}
    for name, (config, report, plan, phase, index, candidate) in plans.items():
        results = [r[phase][index] for r in ranks]
        finish_twin_report(config, plan, results, report, where="test world",
                           candidate=candidate)
        # The twin's own verdict; the launch's may still FAIL on a Megatron-Core finding.
        out[name] = (config, report, plan, report["twin"]["passed"], results)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(LAYOUT))
def test_twin_passes_against_refgrad(twins, name):
    config, report, plan, passed, _ = twins[name]
    assert passed, report["twin"]["failures"][:3]
    if any(f.number in (3, 4) for f in reached(launch_settings(config))):
        # The launch reaches a Megatron-Core wrong gradient or crash: FAIL naming it, though
        # fastgrad's twin matches refgrad.
        assert report["verdict"].startswith("FAIL: ") and "fastgrad's twin matches refgrad" \
            in report["verdict"], report["verdict"]
    else:
        assert report["verdict"].startswith("PASS"), report["verdict"]
    steps = report["twin"]["steps"]
    assert len(steps) == SMALL.steps >= 2
    if plan.bitwise:
        assert all(s["grad_max_ulp"] == 0 and s["param_max_ulp"] == 0 and s["loss_max_ulp"] == 0
                   for s in steps)
        assert all(s["grads_bitwise"] == s["grads_total"] > 0 for s in steps)
        assert all(s["state_bitwise"] == s["state_total"] for s in steps)
    if isinstance(plan.training, AdamWTwin):  # master, exp_avg, exp_avg_sq of every (param, replica)
        assert all(s["state_total"] == 3 * s["params_total"] > 0 for s in steps)


@pytest.mark.dist
def test_twin_claims_and_gaps_follow_the_configuration(twins):
    # DP 2, and the fp32-accumulating reduce-scatter, fix the order: bitwise; DP 3 all-reduce not.
    assert twins["tied_deferred"][2].bitwise and twins["interleaved"][2].bitwise
    dp3 = twins["dp3"][2]
    assert not dp3.bitwise and f"{ulp_bound_factor(3)} x (step+1) ULP" in dp3.order_note
    # PP 1: the output layer follows the only stage, computed in the backward; production's
    # tied embedding is one weight there, and so it is in the twin (not listed as left out).
    assert dp3.case.spec.output_head and dp3.case.spec.shares_one_weight
    assert not dp3.case.spec.defer_output_wgrad
    assert not any("tied embedding" in g for g in dp3.not_twinned)
    assert dict((s, t) for s, _, t in dp3.mapping)["tied embedding all-reduce"].startswith(
        "one shared weight (PP 1)")
    assert ulp_bound_factor(3) == 8 * 2 * 3  # 8 (D-1) D, as documented
    tied = twins["tied_deferred"][2].case
    assert tied.spec.output_head and tied.spec.tied_embedding
    assert tied.use_distributed_optimizer and tied.reduction is Averaging.PRESCALE
    # The distributed optimizer is twinned (AdamW vs refgrad.optim), at VPP 2 over both chunks.
    assert isinstance(twins["tied_deferred"][2].training, AdamWTwin)
    assert isinstance(twins["untied_adamw"][2].training, AdamWTwin)
    assert not twins["untied_adamw"][2].case.spec.tied_embedding
    # Without it, ReplicatedOptimizer's AdamW over the all-reduced grads.
    assert isinstance(twins["interleaved"][2].training, AdamWTwin)
    assert isinstance(twins["dp3"][2].training, AdamWTwin)
    assert [p.num_microbatches for p in tied.plans] == [4, 4]
    inter = twins["interleaved"][2]
    assert inter.case.virtual_stages == 2 and inter.case.reduce_scatter_with_fp32_accumulation
    # --bf16 --grad-reduce-in-bf16: bf16 params and a bf16 grad buffer on the ranks, twinned.
    assert inter.training.precision == TwinPrecision("bf16", "bf16")
    assert not any("bf16 grad buffer" in g or "computes in fp32" in g for g in inter.not_twinned)
    tp2 = twins["tp2"][2]
    assert not any("tensor parallel" in g or "sequence parallel" in g for g in tp2.not_twinned)
    # --wgrad-deferral-limit 2 of M 8 is twinned: refgrad adds microbatches 2..7, then 0, 1.
    assert tp2.case.spec.defer_output_wgrad and tp2.case.spec.wgrad_deferral_limit == 2
    assert tp2.case.spec.head_wgrad_order(8) == [2, 3, 4, 5, 6, 7, 0, 1]
    assert not any("deferral" in g or "defers" in g for g in tp2.not_twinned)
    untied = twins["untied_adamw"][2].case.spec  # no --defer-embedding-wgrad-compute
    assert not untied.defer_output_wgrad and untied.head_wgrad_order(4) == [0, 1, 2, 3]
    markdown = render_markdown(twins["tp2"][1])
    assert "| TP x PP x VPP x DP | 2 x 2 x 1 x 2 | 2 x 2 x 1 x 1 |" not in markdown
    assert "| TP x PP x VPP x DP | 2 x 2 x 1 x 1 | 2 x 2 x 1 x 1 |" in markdown
    assert "Twin vs refgrad after every step" in markdown


@pytest.mark.dist
def test_twin_runs_tensor_parallel_ranks_and_checks_each(twins):
    """TP 2: TP x PP x DP ranks; every TP rank's grads, params (its head rows) and losses held
    against refgrad.pipeline.tensor_parallel; sequence parallel where asked."""
    for name, world in (("tp2", 4), ("tp2_sp", 8), ("tp2_sp_pp1", 4), ("tp2_sp_vpp", 4),
                        ("tp2_tied", 8)):
        _, report, plan, passed, results = twins[name]
        case = plan.case
        assert passed and plan.world_size == case.world == world, name
        assert case.tp_size == case.spec.tensor_parallel == 2
        assert case.spec.sequence_parallel == (name not in ("tp2", "tp2_tied"))
        ranks = [r for r in results if r is not None]
        assert sorted((r.stage, r.dp_rank, r.tp_rank) for r in ranks) == sorted(
            (s, d, t) for s in range(case.pp_size) for d in range(case.dp_size) for t in range(2))
        names = {n for r in ranks for n in r.grads[0]}
        # Every parameter on every (replica, TP rank) of its stage: names x DP x TP comparisons.
        assert all(s["grads_total"] == len(names) * case.dp_size * 2 == s["grads_bitwise"]
                   for s in report["twin"]["steps"]), name
    head = "stage1.head.weight"
    sp = {(r.tp_rank): r for r in twins["tp2_sp"][4] if r is not None and r.stage == 1
          and r.dp_rank == 0}
    # Vocab-parallel head: each TP rank holds 4 of the 8 rows; the blocks are replicated.
    assert tuple(sp[0].params[0][head].shape) == tuple(sp[1].params[0][head].shape) == (4, 8)
    assert not bitwise_equal(sp[0].params[0][head], sp[1].params[0][head])
    assert_bitwise_equal(sp[0].grads[1]["stage1.layers.0.weight"], sp[1].grads[1]["stage1.layers.0.weight"])
    assert sp[0].losses[1] == sp[1].losses[1] and len(sp[0].losses[1]) == 4
    # PP 1, TP 2: the vocab-parallel output layer on the only stage.
    pp1 = [r for r in twins["tp2_sp_pp1"][4] if r is not None]
    assert {tuple(r.params[1]["stage0.head.weight"].shape) for r in pp1} == {(4, 8)}
    # Sequence parallel needs rows divisible by TP: micro batch 1 -> 2 rows (2 tokens a sample).
    assert twins["tp2_sp"][2].case.spec.microbatch_size == 2
    assert twins["tp2"][2].case.spec.microbatch_size == 1


@pytest.mark.dist
@pytest.mark.parametrize("name", ["tp2_tied", "tp2_sp", "tp2_sp_vpp", "tp2_sp_pp1"])
def test_tied_twin_at_tp2_ties_each_tp_ranks_shards(twins, name):
    """Tied at TP 2 (with and without SP, at VPP 2 too, and at PP 1 where each TP rank's shard
    is one weight shared by both layers): the first stage's first layer is vocab-parallel, and
    after every step each (replica, TP rank) holds the same rows in its first-stage weight and
    its output layer, grads and params bitwise; the two TP ranks hold different rows. The
    report no longer lists the tie as not twinned."""
    _, report, plan, passed, results = twins[name]
    spec = plan.case.spec
    assert passed and spec.tied_embedding and spec.vocab_parallel_embedding
    assert spec.shares_one_weight == (name == "tp2_sp_pp1")
    assert not any("tied" in g for g in plan.not_twinned), plan.not_twinned
    assert dict((m[0], m[2]) for m in plan.mapping)["tied embedding all-reduce"].startswith(
        "one shared weight (PP 1) (TP 2" if spec.shares_one_weight
        else "True: vocab-parallel first layer")
    emb, head = "stage0.layers.0.weight", f"stage{spec.num_stages - 1}.head.weight"
    ranks = [r for r in results if r is not None]
    first = {(r.dp_rank, r.tp_rank): r for r in ranks if r.stage == 0}
    last = {(r.dp_rank, r.tp_rank): r for r in ranks if r.stage == plan.case.pp_size - 1}
    assert sorted(first) == sorted(last) == [(d, t) for d in range(plan.case.dp_size)
                                              for t in range(2)]
    for key, rank in first.items():
        for step in range(len(plan.case.plans)):
            assert tuple(rank.params[step][emb].shape) == (spec.hidden // 2, spec.hidden)
            assert_bitwise_equal(rank.grads[step][emb], last[key].grads[step][head], msg=str((key, step)))
            assert_bitwise_equal(rank.params[step][emb], last[key].params[step][head], msg=str((key, step)))
    assert not bitwise_equal(first[(0, 0)].params[1][emb], first[(0, 1)].params[1][emb])


@pytest.mark.dist
def test_an_embedding_all_reduce_over_the_other_tp_ranks_group_fails(twins):
    """A fastgrad whose embedding group pairs the first stage of TP rank t with the last stage
    of TP rank 1 - t (same shard shape, other rows) fails at step 0 on both tied weights."""
    _, broken, plan, passed, _ = twins["tp2_crossed"]
    assert plan.case.spec.vocab_parallel_embedding and not passed
    assert broken["verdict"].startswith("FAIL")
    failures = broken["twin"]["failures"]
    for name in ("stage0.layers.0.weight", "stage1.head.weight"):
        for tp_rank in (0, 1):
            assert any(f.startswith(f"step 0: reduced gradient {name} (replica 0, TP rank "
                                    f"{tp_rank}) differs") for f in failures), (name, failures[:4])
    # Everything not summed through the wrong group still matches at step 0.
    assert not any(f.startswith("step 0: reduced gradient stage0.layers.0.bias") for f in failures)


def test_the_pp1_tied_twin_builds_one_weight_for_the_embedding_and_the_output_layer():
    """Tied at PP 1 the rank's first layer and output layer hold the same Parameter, so DDP
    (which takes ``module.parameters()``) sees it once; autograd's hook, not the schedule's
    ``mark_grad_ready``, makes it ready, and nothing is drained or all-reduced."""
    case = plan_twin(_config(PP1_TIED)[0], SMALL).case
    grid = replace(case.dims, place=RankPlace(rank=0))  # the one rank of a PP 1 DP 1 grid
    module, named, head, tied = build_stage_model(case, grid)
    emb, out = stage_param_name(0, EMBEDDING_PARAM), stage_param_name(0, HEAD_PARAM)
    assert named[emb] is named[out] is head.weight
    assert len(list(module.parameters())) == 2 * SMALL.layers  # weight + bias per layer, no copy
    assert tied == [] and not getattr(head.weight, "shared_embedding", False)
    assert external_grad_params(case.spec, head) == [] and drained_head(case.spec, head) is None


@pytest.mark.dist
def test_the_pp1_tied_twin_matches_refgrad_with_one_weight_under_both_names(twins):
    config, report, plan, passed, results = twins["pp1_tied"]
    assert plan.case.spec.shares_one_weight and passed, report["twin"]["failures"][:3]
    emb, out = "stage0.layers.0.weight", "stage0.head.weight"
    ranks = [res for res in results if res is not None]
    assert len(ranks) == 2
    for res in ranks:
        for step in range(SMALL.steps):
            assert_bitwise_equal(res.grads[step][emb], res.grads[step][out])
            assert_bitwise_equal(res.params[step][emb], res.params[step][out])
    # The weight counts once in the norm: refgrad's norm (its head copy marked shared) is the
    # ranks' (compared bitwise by the twin) and differs from a norm counting it twice.
    reference = reference_for(plan.case, plan.training)
    grads = reference.grads[0]
    once = math.fsum(float(g.double().square().sum()) for n, g in grads.items() if n != out)
    assert math.isclose(reference.steps[0].grad_norm ** 2, once, rel_tol=1e-12)
    assert not math.isclose(reference.steps[0].grad_norm ** 2,
                            once + float(grads[out].double().square().sum()), rel_tol=1e-6)


@pytest.mark.dist
@pytest.mark.parametrize("name", ["pp1_embedding_first", "pp1_head_dropped"])
def test_the_shared_weights_grads_in_the_other_order_or_one_dropped_fail(twins, name):
    """Tied at PP 1: a fastgrad adding the embedding's grad before the output layer's wgrad
    (a different fp32 sum per microbatch), or dropping the wgrad, fails at step 0 on the
    shared weight, on every replica; the biases still match at step 0."""
    _, broken, plan, passed, _ = twins[name]
    assert plan.case.spec.shares_one_weight and not passed
    assert broken["verdict"].startswith("FAIL")
    failures = broken["twin"]["failures"]
    for replica in (0, 1):
        assert any(f.startswith(f"step 0: reduced gradient stage0.layers.0.weight (replica "
                                f"{replica}) differs") for f in failures), failures[:4]
    assert not any(f.startswith("step 0: reduced gradient stage0.layers.0.bias") for f in failures)


def test_twin_caps_tensor_parallelism_at_two_and_counts_tp_ranks(capsys):
    config, _ = _config(["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
                         "--world-size", "8", "--global-batch-size", "4",
                         "--sequence-parallel"])
    plan = plan_twin(config, TwinOptions())
    assert plan.world_size == 4 and plan.case.tp_size == 2
    assert any(g.startswith("tensor parallelism TP 4 scaled to TP 2") for g in plan.not_twinned)
    assert dict((m[0], m[2]) for m in plan.mapping)["TP x PP x VPP x DP"] == "2 x 2 x 1 x 1"
    # TP 2 x PP 4 x DP 2 = 16 ranks > 8: refused with the TP factor in the figure.
    flags = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
             "--world-size", "16", "--global-batch-size", "8"]
    with pytest.raises(TwinSizeError, match=r"TP \(2\) x PP \(4\) x DP \(2\) = 16 ranks"):
        plan_twin(_config(flags)[0], TwinOptions())
    rc, out, err = _cli(flags, capsys)
    assert rc == 2 and out == "" and "= 16 ranks, more than --max-world-size (8)" in err
    # An odd twin hidden size is rounded up so the output layer's vocabulary splits over TP 2.
    assert plan_twin(config, TwinOptions(hidden_size=7)).case.spec.hidden == 8


@pytest.mark.dist
def test_interleaved_twin_has_the_output_layer_drain_and_tied_embedding(twins):
    """VPP 2: the head on the last virtual stage (chunk 1 of stage 1), drained after the
    interleaved cooldown, tied to chunk 0 of stage 0 and all-reduced; a LIFO drain fails."""
    _, report, plan, passed, results = twins["interleaved_deferred"]
    spec = plan.case.spec
    assert passed and plan.case.virtual_stages == 2 and spec.output_head and spec.tied_embedding
    assert spec.defer_output_wgrad and not any("interleav" in g for g in plan.not_twinned)
    last = [r for r in results if r is not None and r.stage == 1]
    assert all("stage3.head.weight" in r.grads[1] for r in last)
    first = [r for r in results if r is not None and r.stage == 0]
    # The tied all-reduce: both copies hold the same sum (DP-reduced first + DP-reduced head).
    assert all(bitwise_equal(r.grads[1]["stage0.layers.0.weight"], last[0].grads[1]["stage3.head.weight"])
               for r in first)
    _, broken, _, passed, _ = twins["interleaved_lifo"]
    assert not passed and broken["verdict"].startswith("FAIL")
    failures = broken["twin"]["failures"]
    # The drain's sum is the head's gradient, and through the tie the first stage's weight's.
    for name in ("stage3.head.weight", "stage0.layers.0.weight"):
        assert any(f.startswith(f"step 0: reduced gradient {name} (replica 0) differs")
                   for f in failures), (name, failures[:4])


@pytest.mark.dist
def test_twin_buckets_only_pipeline_rank_0s_first_chunk(twins):
    """Production's rule: with overlap, stage 0's first chunk is bucketed, every other chunk is
    one bucket. Stage 0 holds 2 x (8x8 + 8) = 144 elements in 72-element buckets (bias 8 +
    weight 64 closes each): 2 buckets; stage 1 (144 + the 8x8 head) one."""
    _, report, plan, _, results = twins["buckets"]
    case = plan.case
    buckets = {(r.stage, len(r.launch_sites[1])) for r in results if r is not None}
    assert buckets == {(0, 2), (1, 1)}
    assert (case.bucket_size_for(0, 0), case.bucket_size_for(1, 0)) == (72, 1440)
    assert not any(g.startswith("bucket rule") for g in plan.not_twinned)
    # Interleaved: chunk 1 of stage 0 and both chunks of stage 1 are one bucket each.
    inter = twins["interleaved"][2].case
    assert inter.bucket_size_for(0, 1) == inter.bucket_size_for(1, 0) == 10 * (8 * 8 + 8)
    assert dict((m[0], m[2]) for m in report["twin"]["mapping"])["bucket size"].endswith(
        "one bucket elsewhere")


@pytest.mark.dist
def test_twin_hazards_and_launch_findings_in_the_report(twins):
    report = twins["tied_deferred"][1]
    # Deferral + overlap at PP 2, DP 2: Megatron-Core's schedule launches the last stage's
    # bucket before the drain (finding 4: megatron/core/pipeline_parallel/schedules.py calls
    # grad_sync_func before finish_embedding_wgrad_compute). M = 8 / (1 x 2) = 4 entries a
    # drain: no drain of one (finding 3). fastgrad's twin matches refgrad all the same, and the
    # launch FAILs, naming the finding (the launch runs Megatron-Core).
    findings = {f["number"]: f for f in report["findings"]}
    assert sorted(findings) == [4]
    assert findings[4]["reached_by_launch"] and findings[4]["fails_launch"]
    assert findings[4]["twin"] is None  # fastgrad's twin does not show Megatron-Core's bug
    assert report["verdict"].startswith("FAIL: ") and "finding 4 (wrong gradient)" in report["verdict"]
    assert report["twin"]["passed"]
    dp3 = {h["name"]: h for h in twins["dp3"][1]["hazards"]}
    assert dp3["pre-scaled averaging at a non-power-of-two DP"]["status"] == FINDING


def _findings(flags: list[str]) -> list[int]:
    """The numbers of Megatron-Core's findings the launch reaches by their rule."""
    config, _ = _config(flags)
    return sorted(f.number for f in reached(launch_settings(config)))


def _hazards(flags: list[str], **kw) -> dict[str, str]:
    config, _ = _config(flags)
    return {h.name: h.status for h in decide_hazards(config, **kw)}


def test_launch_findings_against_hand_derived_decisions():
    # M = 32 / (1 x 2) = 16; limit 1 -> one deferred entry: Megatron's UnboundLocalError
    # (finding 3); no --overlap-grad-reduce: buckets reduce after the drain (no finding 4).
    one = TIED_DEFERRED[:5] + ["32", "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "1"]
    assert _findings(one) == [3]
    # M = 2 / (1 x 2) = 1 microbatch, limit 0 (defer all) -> one entry.
    single = TIED_DEFERRED[:5] + ["2", "--defer-embedding-wgrad-compute"]
    assert _findings(single) == [3]
    # Overlap too: both; and with limit 2 at M = 16 only the drain's late write (finding 4).
    assert _findings(single + ["--overlap-grad-reduce"]) == [3, 4]
    two = TIED_DEFERRED[:5] + ["32", "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit",
                               "2", "--overlap-grad-reduce"]
    assert _findings(two) == [4]
    # DP 1 (world 2 at PP 2): nothing to reduce, so nothing races the drain.
    dp1 = ["--pipeline-model-parallel-size", "2", "--world-size", "2", "--global-batch-size",
           "8", "--defer-embedding-wgrad-compute", "--overlap-grad-reduce"]
    assert _findings(dp1) == []
    # The fp32-accumulating reduce-scatter alone reaches nothing.
    assert _findings(["--world-size", "2", "--global-batch-size", "4", "--use-distributed-optimizer",
                      "--ddp-reduce-scatter-with-fp32-accumulation"]) == []
    # MXFP8 reuse without --overlap-param-gather: NaN at iteration 2; forced sync zeroed.
    mxfp8 = ["--world-size", "2", "--global-batch-size", "4", "--use-distributed-optimizer",
             "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-param-gather",
             "--reuse-grad-buf-for-mxfp8-param-ag",
             "--overlap-grad-reduce"]
    got = _hazards(mxfp8)
    assert got["MXFP8 buffer reuse without both overlaps"] == FINDING
    assert got["forced param sync reads zeroed data"] == FINDING
    both = _hazards(mxfp8 + ["--overlap-param-gather"])
    assert both["MXFP8 buffer reuse without both overlaps"] == SAFE
    # DP 4 is a power of two (exact 1/4); DP 6 is not; DP 1 averages nothing.
    for dp, status in ((1, SAFE), (4, SAFE), (6, FINDING)):
        flags = ["--world-size", str(dp), "--global-batch-size", str(dp)]  # PP 1
        assert _hazards(flags)["pre-scaled averaging at a non-power-of-two DP"] == status, dp
    # Padding exists only with the distributed optimizer.
    assert _hazards(DP3, padding_elements=100)["padding in norms and checkpoints"] == SAFE
    assert _hazards(TIED_DEFERRED, padding_elements=100)["padding in norms and checkpoints"] == FINDING
    assert _hazards(TIED_DEFERRED, padding_elements=0)["padding in norms and checkpoints"] == SAFE
    # distributed_data_parallel.py: gradient_scaling_factor = 1 / dp_cp_group.size(): with CP 2
    # the pre-scale is 1/(DP x CP); DP 2 x CP 2 = 4 is exact, DP 3 x CP 2 = 6 is not.
    for world, status in ((4, SAFE), (6, FINDING)):
        flags = ["--world-size", str(world), "--context-parallel-size", "2",
                 "--global-batch-size", str(world // 2)]
        assert _hazards(flags)["pre-scaled averaging at a non-power-of-two DP"] == status, world
    # Megatron-LM 0.19 ignores --rampup-batch-size (num_microbatches_calculator.py) and
    # preflight refuses --step-batch-size-schedule as not modelled: M never changes, so no
    # hazard is decided for it.
    assert "changing microbatch count" not in _hazards(DP3)


def test_twin_options_and_size_refusals(capsys):
    with pytest.raises(ValueError, match="--twin-hidden-size"):
        TwinOptions(hidden_size=0)
    with pytest.raises(ValueError, match="--twin-steps"):
        TwinOptions(steps=1)
    with pytest.raises(ValueError, match="--timeout"):
        TwinOptions(timeout_s=float("nan"))
    config, _ = _config(["--pipeline-model-parallel-size", "4", "--world-size", "12",
                         "--global-batch-size", "12"])
    with pytest.raises(TwinSizeError, match=r"PP \(4\) x DP \(3\) = 12 ranks"):
        plan_twin(config, TwinOptions())
    rc, out, err = _cli(["--pipeline-model-parallel-size", "4", "--world-size", "12",
                         "--global-batch-size", "12"], capsys)
    assert rc == 2 and out == "" and "= 12 ranks, more than --max-world-size (8)" in err
    rc, _, err = _cli(DP3 + ["--twin-layers", "0"], capsys)
    assert rc == 2 and "--twin-layers must be a positive integer" in err


def _cli(flags: list[str], capsys, candidate: FastgradCandidate | None = None, extra=()):
    args = preflight_args(MODEL + flags + ["--twin-hidden-size", "8", "--twin-steps", "2",
                                           "--no-progress", *extra])
    rc = preflight_cli.main(args, environ={}, candidates=None if candidate is None else [candidate])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize(("raised", "message"), [
    (DistributedRunError("rank 3 timed out after 240 s"), "the twin's ranks failed: rank 3 timed out"),
    (KeyError("stage9.head.weight"), "internal error while checking the twin (KeyError"),
])
def test_a_twin_that_cannot_finish_is_an_error_that_keeps_the_paper_figures(
        raised, message, capsys, tmp_path, monkeypatch):
    """Exit 3 with an ERROR verdict naming why, no traceback on the terminal, and the
    paper figures and the configuration's hazards still printed and written."""
    def failing_spawn(*_args, **_kwargs):
        raise raised

    monkeypatch.setattr("verify.preflight.twin.stage.spawn", failing_spawn)
    json_path = tmp_path / "t.json"
    rc, out, err = _cli(["--pipeline-model-parallel-size", "2", "--world-size", "2",
                         "--global-batch-size", "4"], capsys, extra=("--json", str(json_path)))
    assert rc == 3
    assert out.splitlines()[0].startswith("ERROR: the scaled twin did not finish")
    flat_out = " ".join(out.split())  # the terminal report wraps long lines
    assert message in flat_out and message in err and "Traceback" not in out + err
    report = json.loads(json_path.read_text())
    assert report["passed"] is False and report["twin"]["run"] is False
    assert len(report["layout"]) == 2 and report["hazards"] and report["wire"]
    assert ("Traceback" in report.get("twin_traceback", "")) == isinstance(raised, KeyError)


@pytest.mark.dist
def test_a_drain_in_the_wrong_order_fails_naming_parameter_and_step(capsys, tmp_path):
    """A fastgrad whose drain runs the deferred GEMMs newest first: exit 1, FAIL, names."""
    flags = ["--pipeline-model-parallel-size", "2", "--world-size", "2",
             "--global-batch-size", "4", "--defer-embedding-wgrad-compute"]
    json_path, md_path = tmp_path / "t.json", tmp_path / "t.md"
    rc, out, _ = _cli(flags, capsys, FaultyFastgrad(Fault.LIFO_DRAIN),
                      extra=("--json", str(json_path), "--markdown", str(md_path)))
    assert rc == 1
    first = out.splitlines()[0]
    assert first.startswith("FAIL")
    report = json.loads(json_path.read_text())
    assert report["passed"] is False
    assert report["twin"]["candidate"] == "fastgrad (fault: lifo_drain)"
    assert report["twin"]["candidate_info"]["name"] == "fastgrad"
    # The head's gradient is the drain's sum: wrong in step 0, on the only replica.
    assert any(f.startswith("step 0: reduced gradient stage1.head.weight (replica 0)")
               for f in report["twin"]["failures"])
    assert report["env"]["torch"] and report["gradverify_version"]
    assert report["config"]["num_microbatches"] == 4
    assert "stage1.head.weight" in md_path.read_text()


@pytest.mark.dist
def test_an_uneven_context_parallel_twin_trains_its_per_stage_layers(capsys, tmp_path):
    """PP 2, 3 layers with the embedding counted as one: (3 + 1) / 2 = 2 per stage, stage 0
    builds 1 (transformer_block.py get_num_layers_to_build); CP 2 x DP 1: the twin's 2 DP
    replicas stand for the dp_cp group. The twin's stages hold 1 and 2 layers, checked
    against refgrad bitwise (a sum of two fp32 values)."""
    flags = ["--world-size", "4", "--pipeline-model-parallel-size", "2", "--num-layers", "3",
             "--account-for-embedding-in-pipeline-split", "--context-parallel-size", "2",
             "--global-batch-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce"]
    json_path = tmp_path / "t.json"
    rc, out, err = _cli(flags, capsys, extra=("--json", str(json_path)))
    assert rc == 0, err
    assert out.splitlines()[0].startswith("PASS: TP=1 PP=2 VPP=1 CP=2 DP=1, 2 microbatches")
    report = json.loads(json_path.read_text())
    assert report["config"]["layers_per_stage_and_chunk"] == [[1], [2]]
    assert [row["layers"] for row in report["layout"]] == [1, 2]
    mapping = {row[0]: row[1:] for row in report["twin"]["mapping"]}
    assert mapping["layers per virtual stage"] == ["[1, 2] (= 3)", "[1, 2] (= 3)"]
    # (parameter, replica) pairs compared: stage 0's layer (weight, bias), stage 1's two
    # layers and the output layer = 2 + 4 + 1 = 7 per replica, x 2 replicas (an even twin
    # would have 2 + 2 + 1 = 5).
    assert report["twin"]["passed"] and report["twin"]["bitwise"]
    assert [row["grads_total"] for row in report["twin"]["steps"]] == [14, 14]


@pytest.mark.dist
def test_under_torchrun_the_twin_runs_on_the_launched_world(tmp_path):
    """torchrun (2 processes): DP comes from WORLD_SIZE, rank 0 reports, both exit 0."""

    root = Path(__file__).resolve().parents[2]
    json_path = tmp_path / "torchrun.json"
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), "-m", "verify", "preflight",
           "--twin-hidden-size", "8", "--twin-steps", "2", "--no-progress", "--json",
           str(json_path), "--", *MODEL, "--pipeline-model-parallel-size", "2",
           "--global-batch-size", "4", "--defer-embedding-wgrad-compute"]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("PASS: TP=1 PP=2 VPP=1 DP=1") == 1  # rank 0 only
    report = json.loads(json_path.read_text())
    assert report["twin"]["where"].startswith("torchrun, 2 ranks")
    assert report["config"]["data_parallel_source"] == "world size 2 (WORLD_SIZE (torchrun)) / (TP x PP x CP)"


def test_a_broken_drain_is_a_fault_of_one_layer_instance_not_a_global_rebinding():
    """The LIFO candidate's drain lives on the rank's own output layer; the class is untouched."""

    production_drain = ColumnParallelOutputLayer.drain_deferred_wgrad
    assert FastgradCandidate().label == "fastgrad"
    assert FaultyFastgrad(Fault.LIFO_DRAIN).label == "fastgrad (fault: lifo_drain)"
    assert output_layer_class(None) is ColumnParallelOutputLayer
    cfg = EmbeddingWgradConfig(defer_embedding_wgrad_compute=True)
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(8, 8, generator=g)
    xs = [torch.randn(4, 8, generator=g) * 10.0**k for k in range(4)]
    drained = []
    for cls in (output_layer_class(Fault.LIFO_DRAIN), output_layer_class(None)):
        layer = cls(weight, cfg, parallel_dims=ParallelDims(pp_size=2))
        layer.start_step()
        for x in xs:
            layer(x.requires_grad_(True)).sum().backward()
        assert layer.drain_deferred_wgrad() == 4
        drained.append(layer.weight.main_grad.clone())
    # Same deferred GEMMs, opposite order: a different fp32 sum; the class kept its drain.
    assert not bitwise_equal(drained[0], drained[1])
    assert ColumnParallelOutputLayer.drain_deferred_wgrad is production_drain


def test_a_twin_whose_every_step_was_skipped_says_no_update_was_checked(monkeypatch):
    """Both sides skipping every step agree on the update vacuously: the verdict says so,
    and the per-step table marks the skipped steps."""
    config, report = _config(UNTIED_ADAMW)
    plan = plan_twin(config, SMALL)

    def rows(stepped):
        return [StepRow(step=k, microbatches=4, loss_max_ulp=0, grads_bitwise=1, grads_total=1,
                        grad_max_ulp=0, params_bitwise=1, params_total=1, param_max_ulp=0,
                        grad_norm=float("nan"), stepped=s) for k, s in enumerate(stepped)]

    monkeypatch.setattr(verdict, "reference_for", lambda *_a: None)
    for stepped, vacuous in (([False, False], True), ([False, True], False)):
        monkeypatch.setattr(verdict, "compare_steps", lambda *_a, s=stepped, **_k: (rows(s), []))
        assert finish_twin_report(config, plan, [], report, where="test",
                                  candidate=FastgradCandidate())
        assert ("no update was checked" in report["verdict"]) is vacuous
        steps_table = next(t for t in twin_tables(report) if t[0].startswith("Twin vs refgrad"))
        results = [r[-1] for r in steps_table[2]]
        assert results == ["ok (skipped: NaN/inf grads)" if not s else "ok" for s in stepped]


@pytest.mark.parametrize(("flags", "listed"), [
    (["--pipeline-model-parallel-size", "2", "--world-size", "4", "--global-batch-size", "8",
      "--bf16"], True),
    (["--pipeline-model-parallel-size", "1", "--world-size", "2", "--global-batch-size", "8"],
     True),  # fp32, but the tied weight's two grads are summed in param.grad first
    (["--pipeline-model-parallel-size", "2", "--world-size", "4", "--global-batch-size", "8"],
     False),  # fp32, untied by PP: fused and unfused adds give the same bits
])
def test_the_unfused_output_layer_is_listed_where_it_changes_bits(flags, listed):
    config, _ = _config(flags + ["--no-gradient-accumulation-fusion"])
    plan = plan_twin(config, SMALL)
    assert any(g.startswith("--no-gradient-accumulation-fusion on the output layer")
               for g in plan.not_twinned) is listed
    fused, _ = _config(flags)
    assert not any("--no-gradient-accumulation-fusion" in g for g in plan_twin(fused, SMALL).not_twinned)


def test_the_bounded_comparison_holds_non_finite_values_to_bitwise():
    """Within a ULP bound, an inf in refgrad does not make the bound infinite, and a shared inf
    is no failure (hand-picked values)."""
    inf = float("inf")
    ref = torch.tensor([inf, 1.0, 2.0])
    assert not _within(ref, torch.tensor([3e38, 1.5, 1000.0]), 8)[0]  # inf vs finite
    assert not _within(ref, torch.tensor([-inf, 1.0, 2.0]), 8)[0]  # the sign of an inf
    assert _within(ref, torch.tensor([inf, 1.0, 2.0000002]), 8)[0]  # 1 fp32 ULP of 2.0 < 8
    assert not _within(ref, torch.tensor([inf, 1.0, 2.0001]), 8)[0]  # ~420 ULPs of 2.0


def test_a_step_that_compared_nothing_fails(monkeypatch):
    """Ranks that report no grads (or params) leave nothing to compare: that is no pass."""
    config, report = _config(UNTIED_ADAMW)
    plan = plan_twin(config, SMALL)
    empty = StepRow(step=0, microbatches=4, loss_max_ulp=0, grads_bitwise=0, grads_total=0,
                    grad_max_ulp=0, params_bitwise=0, params_total=0, param_max_ulp=0)
    monkeypatch.setattr(verdict, "reference_for", lambda *_a: None)
    monkeypatch.setattr(verdict, "compare_steps", lambda *_a, **_k: ([empty], []))
    assert not finish_twin_report(config, plan, [], report, where="test",
                                  candidate=FastgradCandidate())
    assert report["verdict"].startswith("FAIL") and "no reduced gradient and no updated parameter" \
        in report["twin"]["failures"][0]
