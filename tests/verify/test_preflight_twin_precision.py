"""``verify preflight``'s twin with 16-bit params: bf16/fp16 compute, fp32 or 16-bit grad buffers.

Multi-rank twins run in one spawned 8-rank world (grids side by side) and are
compared with refgrad (``refgrad.pipeline`` + ``refgrad.optim``) through
the CLI's own code. The fp16 twin starts from a loss scale at which its fp16
grads are finite (2^10 at most: Megatron's default 2^32 would skip every step), updates
twice, then meets a deliberate loss spike whose fp16 grads overflow, so an update and the
scaler's skip, hysteresis and backoff run on the ranks.
At TP 2 (``refgrad.pipeline.tensor_parallel``) the bf16 twin runs with and without
sequence parallelism, tied (the first layer vocab-parallel). Deliberately
broken fastgrads (grads accumulated through the param dtype into the fp32
main-grad buffer: a candidate whose stages build a broken DDP subclass; at TP 2 the
output layer's dgrad summed over TP in fp32, the sequence-parallel grads rounded to bf16
before their TP all-reduce, or under SP the tied first layer's wgrad taken on its own
sequence shard's rows without the all-gather of the output grad: fastgrad's autograd
functions and module function replaced in those ranks' processes, which no adapter class
exposes) must make the twin FAIL naming step and parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import fastgrad.pipeline as pipeline
from fastgrad.ddp import DistributedDataParallel
from fastgrad.deferred_wgrad import _OutputLayerFunction
from fastgrad.vocab_parallel_embedding import _VocabParallelEmbed
from gradvocab import Averaging
from refgrad.pipeline import (
    EMBEDDING_PARAM,
    HEAD_PARAM,
    LinearStackSpec,
    StageModule,
    cast_params_,
    head_weight_init,
    reduce_and_tie,
    replica_grad_sums,
    stage_param_name,
    sum_over_tensor_parallel,
)
from tests.verify.broken_optimizers import HysteresisOneEarly
from tests.verify.test_preflight_twin_optim import (
    STEPS,
    _BrokenOptimizerCandidate,
    _config,
    _plans,
    _WrongInverseOptimizer,
)
from tests.verify.twin_world import plan_layout, train_and_compare
from verify.candidates import FastgradCandidate
from verify.candidates.fastgrad.pipeline import FastgradPipeline
from verify.candidates.fastgrad.stages import FastgradStages
from verify.metrics import assert_bitwise_equal, bitwise_equal
from verify.preflight.twin import TwinOptions, TwinPrecision, plan_twin
from verify.preflight.twin.precision import precision_for
from verify.preflight.twin.rank import twin_phases_worker
from verify.preflight.twin.reference import reference_for

# PP2 DP2 M4, tied embedding, distributed optimizer, both overlaps: bf16 params with
# Megatron's default fp32 main grads (the usual production setup).
BF16 = ["--pipeline-model-parallel-size", "2", "--world-size", "4", "--global-batch-size", "8",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--bf16"]
# PP2 DP2 M4, bf16 grad buffer (--grad-reduce-in-bf16), deferred output wgrad (limit 2).
BF16_GRADS = ["--pipeline-model-parallel-size", "2", "--world-size", "4",
              "--global-batch-size", "8", "--use-distributed-optimizer", "--bf16",
              "--grad-reduce-in-bf16", "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "2"]
# PP2 DP2 M4, fp16 params and grads at Megatron's default initial scale (2^32, lowered to 2^10
# for the twin) with --hysteresis 1: steps 0 and 1 finite, step 2 the deliberate loss spike
# (skipped, and the scale halves after it; see the tests below).
FP16_OVERFLOW = ["--pipeline-model-parallel-size", "2", "--world-size", "4",
                 "--global-batch-size", "8", "--use-distributed-optimizer", "--fp16",
                 "--hysteresis", "1"]
# The same at DP 1 with Megatron's default --hysteresis 2 (the deliberate overflow counts down
# the hysteresis and keeps the scale).
FP16_DP1 = ["--pipeline-model-parallel-size", "2", "--world-size", "2",
            "--global-batch-size", "4", "--use-distributed-optimizer", "--fp16"]

# TP2 PP2 DP1 M4, bf16 params, fp32 main grads, deferred output wgrad (limit 2): the output
# layer's 16-bit partial dgrads all-reduced over TP in bf16.
TP2_BF16 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--world-size", "4", "--global-batch-size", "4", "--use-distributed-optimizer",
            "--bf16", "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "2"]
# TP2 PP2 DP2 M4 under SP, bf16 params and grads, both overlaps, tied: the blocks on sequence
# shards, the dgrad and the vocab-parallel first layer's partials reduce-scattered in bf16, the
# blocks' bf16 grads all-reduced over TP after the DP sync.
TP2_SP_BF16_GRADS = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                     "--pipeline-model-parallel-size", "2", "--world-size", "8",
                     "--global-batch-size", "8", "--use-distributed-optimizer", "--bf16",
                     "--grad-reduce-in-bf16", "--overlap-grad-reduce", "--overlap-param-gather"]
# TP2 PP2 DP1 M4 under SP, bf16 params, fp32 main grads (for the broken SP all-reduce below).
TP2_SP_BF16 = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
               "--pipeline-model-parallel-size", "2", "--world-size", "4",
               "--global-batch-size", "4", "--use-distributed-optimizer", "--bf16"]

# PP1 DP2 M4, tied (one weight: the output layer's fp32 wgrad, then the embedding's bf16 grad,
# each added into its bf16 main grad with one rounding, so the order shows: with an fp32 main
# grad refgrad's reversed order still matched at these sizes), bf16 params, distributed
# optimizer, overlap.
PP1_TIED_BF16 = ["--pipeline-model-parallel-size", "1", "--world-size", "2",
                 "--global-batch-size", "8", "--use-distributed-optimizer", "--bf16",
                 "--grad-reduce-in-bf16", "--overlap-grad-reduce"]

# TP2 PP1 DP2 M4 under SP, tied: each TP rank's vocab-parallel first-layer shard is its
# output-layer shard (one weight); bf16 params and grads.
TP2_SP_PP1_TIED_BF16 = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                        "--pipeline-model-parallel-size", "1", "--world-size", "4",
                        "--global-batch-size", "8", "--bf16", "--grad-reduce-in-bf16"]

LAYOUT = {"pp1_tied_bf16": (PP1_TIED_BF16, 0, 3), "tp2_sp_pp1_tied_bf16": (TP2_SP_PP1_TIED_BF16, 2, 3),
          "bf16": (BF16, 0, 0), "bf16_grads": (BF16_GRADS, 4, 0), "fp16_overflow": (FP16_OVERFLOW, 0, 1),
          "tp2_bf16": (TP2_BF16, 4, 1), "tp2_sp_bf16_grads": (TP2_SP_BF16_GRADS, 0, 2)}


# --------------------------------------------------------------------------- planning


@pytest.mark.parametrize("flags, params, grads", [
    (["--bf16"], "bf16", "fp32"),  # arguments.py: --bf16 accumulates in fp32 by default
    (["--bf16", "--grad-reduce-in-bf16"], "bf16", "bf16"),
    (["--fp16"], "fp16", "fp16"),
    (["--fp16", "--accumulate-allreduce-grads-in-fp32"], "fp16", "fp32"),
    ([], "fp32", "fp32"),
])
def test_the_twin_takes_the_configurations_param_and_grad_dtypes(flags, params, grads):
    config, _ = _config(["--pipeline-model-parallel-size", "2", "--world-size", "4",
                         "--global-batch-size", "8"] + flags)
    plan = plan_twin(config, STEPS)
    assert plan.training.precision == TwinPrecision(params, grads)
    assert plan.case.dp_size == 2 and plan.bitwise
    assert not any("computes in fp32" in g or "reduces fp32 grads" in g for g in plan.not_twinned)
    rows = {m[0]: m[1:] for m in plan.mapping}
    assert rows["main-grad buffer and DP wire dtype"] == (grads, grads)


@pytest.mark.parametrize("flags", [TP2_BF16, TP2_SP_BF16_GRADS])
def test_the_tp2_twin_keeps_16_bit_params_and_the_grad_dtype(flags):
    plan = plan_twin(_config(flags)[0], STEPS)
    spec = plan.case.spec
    assert (spec.tensor_parallel, spec.sequence_parallel) == (2, "--sequence-parallel" in flags)
    # Tied (Megatron's default): the multi-rank layouts cover the vocab-parallel first layer,
    # under SP too (its partials reduce-scattered along the sequence in 16 bits).
    assert spec.tied_embedding and spec.vocab_parallel_embedding
    grads = "bf16" if "--grad-reduce-in-bf16" in flags else "fp32"
    assert plan.training.precision == TwinPrecision("bf16", grads) and plan.bitwise
    assert not any("computes in fp32" in g or "TP > 1: the twin reduces" in g
                   for g in plan.not_twinned)
    rows = {m[0]: m[1:] for m in plan.mapping}
    assert rows["params and compute"][1].startswith("bf16 params and compute")


def test_where_the_twin_keeps_fp32_or_scales_dp_it_says_so():
    tp4, _ = _config(["--tensor-model-parallel-size", "4", "--world-size", "8",
                      "--global-batch-size", "2", "--bf16", "--grad-reduce-in-bf16"])
    precision, dp, left_out = precision_for(tp4, 2)  # TP 4 -> twin TP 2: still 16 bits
    assert precision == TwinPrecision("bf16", "bf16") and dp == 2
    assert not any("TP > 1" in g for g in left_out)
    with pytest.raises(ValueError, match="twin_tp must be 1 or 2"):
        precision_for(tp4, 4)
    # DP 4 with a backend-ordered 16-bit sum: DP 2, listed; the fp32-accumulating
    # reduce-scatter fixes the order, so DP 4 stays.
    dp4 = ["--world-size", "4", "--global-batch-size", "8", "--use-distributed-optimizer",
           "--bf16", "--grad-reduce-in-bf16"]
    plan = plan_twin(_config(dp4)[0], STEPS)
    assert plan.case.dp_size == 2 and plan.world_size == 2 and plan.bitwise
    assert any(g.startswith("data parallelism DP 4 scaled to DP 2") for g in plan.not_twinned)
    assert dict((m[0], m[1:]) for m in plan.mapping)["TP x PP x VPP x DP"] == ("1 x 1 x 1 x 4",
                                                                              "1 x 1 x 1 x 2")
    plan = plan_twin(_config(dp4 + ["--ddp-reduce-scatter-with-fp32-accumulation"])[0], STEPS)
    assert plan.case.dp_size == 4 and plan.bitwise
    with pytest.raises(ValueError, match="TwinPrecision.grads must be fp32 or the param dtype"):
        TwinPrecision("bf16", "fp16")


def test_refgrads_sp_grad_sum_over_tp_is_one_rounding_of_two_grad_dtype_terms():
    spec = LinearStackSpec(num_stages=2, layers_per_stage=1, hidden=4, microbatch_size=2,
                           output_head=True, tensor_parallel=2, sequence_parallel=True)
    # By hand, bf16 (8 significant bits, ULP 2^-7 at 1): 1 + 2^-8 is a tie -> 1 (even);
    # 1 + (2^-8 + 2^-15) is above the tie -> 1 + 2^-7. The head is not summed over TP.
    per_rank = torch.tensor([[1.0, 1.0], [2.0**-8, 2.0**-8 + 2.0**-15]], dtype=torch.bfloat16)
    head = torch.full((4, 4), 3.0, dtype=torch.bfloat16)
    reduced = {"stage0.layers.0.weight": per_rank, "stage1.head.weight": head}
    sum_over_tensor_parallel(spec, reduced)
    assert reduced["stage0.layers.0.weight"].tolist() == [1.0, 1.0 + 2.0**-7]
    assert reduced["stage0.layers.0.weight"].dtype == torch.bfloat16
    assert reduced["stage1.head.weight"] is head
    tp4 = LinearStackSpec(num_stages=2, layers_per_stage=1, hidden=8, microbatch_size=4,
                          output_head=True, tensor_parallel=4)
    with pytest.raises(ValueError, match="models tensor_parallel 2 only"):
        replica_grad_sums(tp4, [], {"w": torch.zeros(1, dtype=torch.bfloat16)}, None, 0, 1, 1,
                          grad_dtype=torch.float32)


def test_refgrads_16_bit_tied_sp_first_layer_keeps_one_buffer_left_out_of_the_tp_sum():
    """Tied at TP 2 under SP the 16-bit first layer is split over TP by vocabulary rows: one
    ``[V, H]`` grad buffer over every row (each rank's wgrad ``x_kᵀ · G`` with ``G`` gathered),
    not one per sequence shard as the replicated blocks', and not summed over TP."""
    spec = LinearStackSpec(num_stages=2, layers_per_stage=1, hidden=4, microbatch_size=2, seed=3,
                           output_head=True, tied_embedding=True, tensor_parallel=2,
                           sequence_parallel=True)
    stages = [StageModule(spec, s) for s in range(2)]
    named = {stage_param_name(s, n): p for s, st in enumerate(stages) for n, p in st.named_parameters()}
    head = head_weight_init(spec).requires_grad_(True)
    named[stage_param_name(1, "head.weight")] = head
    cast_params_(list(named.values()), torch.bfloat16)
    sums, _ = replica_grad_sums(spec, stages, named, head, 0, 2, 2, grad_dtype=torch.float32)
    emb, bias = stage_param_name(0, EMBEDDING_PARAM), stage_param_name(0, "layers.0.bias")
    assert sums[0][emb].shape == (4, 4) and sums[0][bias].shape == (2, 4)
    assert bool(sums[0][emb].ne(0).any())
    reduced = reduce_and_tie(spec, sums, Averaging.SUM)
    assert reduced[emb].shape == (4, 4) and reduced[bias].shape == (4,)


# --------------------------------------------------------------------------- multi-rank


@pytest.fixture(scope="module")
def twins():
    plans = _plans(LAYOUT)
    return train_and_compare(plans, 8)


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(LAYOUT))
def test_16_bit_twin_matches_refgrad_bitwise(twins, name):
    report, plan, passed, results = twins[name]
    assert passed, report["twin"]["failures"][:3]
    steps = report["twin"]["steps"]
    assert plan.bitwise and len(steps) == 3
    for s in steps:
        assert s["grads_bitwise"] == s["grads_total"] > 0
        assert s["params_bitwise"] == s["params_total"]
        assert s["state_bitwise"] == s["state_total"] == 3 * s["params_total"]
    precision = plan.training.precision
    for res in (r for r in results if r is not None):  # the ranks really ran 16 bits
        assert {p.dtype for p in res.params[0].values()} == {precision.param_dtype}
        assert {g.dtype for g in res.grads[0].values()} == {precision.grad_dtype}


@pytest.mark.dist
def test_the_16_bit_pp1_twin_keeps_the_tied_weight_as_one(twins):
    """bf16 at PP 1, tied (at TP 1, and at TP 2 under SP one shard per TP rank): one weight,
    its grad matched bitwise against refgrad's (output-layer wgrad, then the first layer's grad,
    per microbatch) above; nothing about the tie is listed as left out. (The ranks report the
    one main_grad under both names, so comparing the two names with each other would prove
    nothing; that the rank holds one Parameter is tested in test_preflight_twin.py.)"""
    for name in ("pp1_tied_bf16", "tp2_sp_pp1_tied_bf16"):
        report, plan, passed, _ = twins[name]
        assert plan.case.spec.shares_one_weight and passed
        assert not any("tied embedding" in g for g in plan.not_twinned)
        steps = report["twin"]["steps"]
        assert all(s["grads_bitwise"] == s["grads_total"] > 0 for s in steps)


@pytest.mark.dist
def test_the_fp16_twin_checks_two_updates_then_skips_its_loss_spike_and_keeps_the_params(twins):
    """Megatron's default initial scale (2^32) would overflow every fp16 twin step: the twin
    starts at 2^10, so steps 0 and 1 are updates (held to refgrad), and step 2's loss spike
    overflows its fp16 grads (refgrad's too): skipped on every rank, the params kept."""
    report, plan, passed, results = twins["fp16_overflow"]
    assert passed, report["twin"]["failures"][:3]
    assert plan.training.loss_scale == 2.0**10 and plan.case.spec.overflow_step == 2
    assert any(g.startswith("initial loss scale 4.29497e+09 lowered to 1024 for the fp16 twin")
               for g in plan.not_twinned), plan.not_twinned
    reference = reference_for(plan.case, plan.training)
    finite = [all(bool(g.isfinite().all()) for g in step.values()) for step in reference.grads]
    assert finite == [True, True, False]
    assert [s["stepped"] for s in report["twin"]["steps"]] == [True, True, False]
    assert [s["loss_scale"] for s in report["twin"]["steps"]] == [2.0**10] * 3
    for res in (r for r in results if r is not None):
        assert [outcome.stepped for outcome in res.optimizer.steps] == [True, True, False]
        for name, value in res.params[2].items():  # the skipped step kept step 1's params
            assert_bitwise_equal(value, res.params[1][name], msg=str(name))
    initial = {n: p.detach().to(torch.float16) for n, p in _initial_params(plan).items()}
    assert any(not bitwise_equal(v, initial[n]) for r in results if r is not None
               for n, v in r.params[0].items())  # step 0 updated them


@pytest.mark.dist
def test_the_fp16_twins_skip_moves_megatrons_scaler_and_planted_faults_fail():
    """Four steps: 2 updates, the loss spike's skip, an update at the scale Megatron's
    DynamicGradScaler leaves (by hand: hysteresis 1 -> x 0.5; hysteresis 2 -> kept). Planted
    faults, each a fastgrad whose optimizer is a broken subclass: unscaling by 2/S (invisible
    to the twin before issue 31: at 2^32 every step was skipped, so no update was compared)
    fails at step 0; a scaler backing off one overflow early fails at step 3's scale."""
    layout = {"hysteresis_1": (FP16_OVERFLOW, 0), "hysteresis_2": (FP16_DP1, 4),
              "wrong_inverse": (FP16_DP1, 6)}
    plans = plan_layout(layout, _config, TwinOptions(hidden_size=8, layers=1, steps=4))
    out = train_and_compare(plans, 8, {
        "hysteresis_1": FastgradCandidate(), "hysteresis_2": FastgradCandidate(),
        "wrong_inverse": _BrokenOptimizerCandidate(broken=_WrongInverseOptimizer)})
    for name, scales in (("hysteresis_1", [1024.0, 1024.0, 1024.0, 512.0]),
                         ("hysteresis_2", [1024.0] * 4)):
        report, _, passed, _ = out[name]
        assert passed, (name, report["twin"]["failures"][:3])
        steps = report["twin"]["steps"]
        assert [s["stepped"] for s in steps] == [True, True, False, True], name
        assert [s["loss_scale"] for s in steps] == scales, name
    report, _, passed, _ = out["wrong_inverse"]
    assert not passed and report["verdict"].startswith("FAIL"), report["verdict"]
    assert any(f.startswith("step 0: optimizer exp_avg of stage0.")
               for f in report["twin"]["failures"]), report["twin"]["failures"][:3]
    early = train_and_compare(plan_layout({"backs_off_early": (FP16_DP1, 0)}, _config,
                                          TwinOptions(hidden_size=8, layers=1, steps=4)), 2,
                              _BrokenOptimizerCandidate(broken=HysteresisOneEarly))
    report, _, passed, _ = early["backs_off_early"]
    assert not passed, report["verdict"]
    failures = report["twin"]["failures"]
    assert any(f.startswith("step 3: optimizer on stage 0 (replica 0): loss scale 512.0, refgrad 1024.0")
               for f in failures), failures[:5]
    assert not any(f.startswith(("step 0:", "step 1:", "step 2:")) for f in failures), failures[:5]


def _initial_params(plan) -> dict:
    spec = plan.case.spec
    named = {stage_param_name(s, n): p for s in range(spec.num_stages)
             for n, p in StageModule(spec, s).named_parameters()}
    named[stage_param_name(spec.num_stages - 1, HEAD_PARAM)] = head_weight_init(spec)
    return named


# --------------------------------------------------------------------------- broken fastgrad


class _AccumulatingInTheParamDtype(DistributedDataParallel):
    """fastgrad's DDP, except that before each add the fp32 main grad is rounded to the
    (16-bit) grad's dtype, i.e. grads accumulate in the wrong dtype."""

    def _on_grad_accumulated(self, param):
        if param.grad is not None and param.main_grad.dtype != param.grad.dtype:
            param.main_grad.copy_(param.main_grad.to(param.grad.dtype))
        return super()._on_grad_accumulated(param)


class _WrongDtypeStages(FastgradStages):
    ddp_class = _AccumulatingInTheParamDtype


@dataclass(frozen=True)
class _WrongDtypePipeline(FastgradPipeline):
    def model(self, case, grid, settings):
        return _WrongDtypeStages(case, self.rank_grid(case, grid), settings)


@dataclass(frozen=True)
class _WrongDtypeCandidate(FastgradCandidate):
    name = "fastgrad (bf16-accumulating DDP)"

    def pipeline(self):
        return _WrongDtypePipeline()


@pytest.mark.dist
def test_grads_accumulated_in_the_param_dtype_fail_naming_step_and_parameter():
    plans = _plans({"bf16": (BF16, 0)})
    report, _, passed, _ = train_and_compare(plans, 4, _WrongDtypeCandidate())["bf16"]
    assert not passed and report["verdict"].startswith("FAIL: ")
    failures = report["twin"]["failures"]
    assert any(f.startswith("step 0: reduced gradient stage0.layers.0.weight (replica 0) differs")
               for f in failures), failures[:3]


def _dgrad_summed_in_fp32() -> None:
    """Break fastgrad's output layer in this process only: each TP rank's dgrad GEMM keeps its
    fp32 output and the TP all-reduce sums those in fp32, rounding once to the param dtype
    (production rounds each rank's partial dgrad to 16 bits and all-reduces the 16-bit values)."""

    right = _OutputLayerFunction.backward

    def wrong(ctx, grad_output):
        grad_input, *rest = right(ctx, grad_output)  # the wgrad and the collective as usual
        weight = ctx.saved_tensors[1]
        unrounded = grad_output.float().matmul(weight.float())
        dist.all_reduce(unrounded, group=ctx.layer.tp_group)
        return (unrounded.to(grad_input.dtype), *rest)

    _OutputLayerFunction.backward = staticmethod(wrong)


def _sequence_parallel_grads_rounded_to_the_param_dtype() -> None:
    """Break fastgrad's TP all-reduce of sequence-parallel grads in this process only: each
    fp32 ``main_grad`` is rounded to bf16 before the sum (the sum in the param dtype instead of
    the grad dtype)."""
    right = pipeline.allreduce_sequence_parallel_grads

    def wrong(params, tp_group):
        for p in params:
            p.main_grad.copy_(p.main_grad.to(torch.bfloat16))
        right(params, tp_group)

    pipeline.allreduce_sequence_parallel_grads = wrong


def _faulty_tp_worker(rank: int, world_size: int, phases: list) -> list:
    # Ranks 0-3: the TP2 grid with the fp32 dgrad sum; ranks 4-7: the TP2 SP grid.
    if rank < 4:
        _dgrad_summed_in_fp32()
    else:
        _sequence_parallel_grads_rounded_to_the_param_dtype()
    return twin_phases_worker(rank, world_size, phases)


@pytest.mark.dist
def test_a_tp2_dgrad_or_sp_grad_sum_in_the_wrong_dtype_fails_naming_step_and_parameter():
    plans = _plans({"tp2_bf16": (TP2_BF16, 0), "tp2_sp_bf16": (TP2_SP_BF16, 4)})
    twins = train_and_compare(plans, 8, None, _faulty_tp_worker)
    for name in plans:
        report, _, passed, _ = twins[name]
        assert not passed and report["verdict"].startswith("FAIL: "), name
    # The fp32 dgrad reaches the last stage's blocks first: their grads differ at step 0 on
    # both TP ranks. The output layer's own wgrad (its input and grad_output) does not move, but
    # its reduced grad is the tied sum with the vocab-parallel first layer's, which the changed
    # dgrad reaches through the pipeline: the head's step-0 difference is exactly that layer's.
    failures = twins["tp2_bf16"][0]["twin"]["failures"]
    for tp_rank in (0, 1):
        assert any(f.startswith(f"step 0: reduced gradient stage1.layers.0.weight (replica 0, "
                                f"TP rank {tp_rank}) differs") for f in failures), failures[:3]
    step0 = "step 0: reduced gradient "
    head = [f.removeprefix(step0 + "stage1.head.weight") for f in failures
            if f.startswith(step0 + "stage1.head.weight")]
    embedding = [f.removeprefix(step0 + "stage0.layers.0.weight") for f in failures
                 if f.startswith(step0 + "stage0.layers.0.weight")]
    assert len(embedding) == 2 and head == embedding, (head, embedding)
    # Rounding the SP grads to bf16 before their TP sum moves every replicated block grad at
    # step 0; the tied first layer (split over TP, not summed) and the head do not move.
    failures = twins["tp2_sp_bf16"][0]["twin"]["failures"]
    for name in ("stage0.layers.0.bias", "stage1.layers.0.weight"):
        assert any(f.startswith(f"{step0}{name} (replica 0, TP rank 0) differs")
                   for f in failures), failures[:3]
    for name in ("stage0.layers.0.weight", "stage1.head.weight"):
        assert not any(f.startswith(step0 + name) for f in failures), name



def _embedding_wgrad_on_its_own_rows() -> None:
    """Break fastgrad's vocab-parallel embedding in this process only: under SP the backward
    skips the all-gather of the output grad, so each TP rank's wgrad ``x_kᵀ · G`` covers only
    its sequence shard's rows (production gathers ``G`` over every row first)."""

    right = _VocabParallelEmbed.backward

    def wrong(ctx, grad_output):
        layer = ctx.layer
        if not layer.sequence_parallel:
            return right(ctx, grad_output)
        (x_block,) = ctx.saved_tensors
        rows = grad_output.shape[0]
        start = dist.get_rank(layer.tp_group) * rows
        return None, x_block[start:start + rows].t().mm(grad_output.contiguous()), None

    _VocabParallelEmbed.backward = staticmethod(wrong)


def _faulty_embedding_worker(rank: int, world_size: int, phases: list) -> list:
    _embedding_wgrad_on_its_own_rows()
    return twin_phases_worker(rank, world_size, phases)


@pytest.mark.dist
def test_a_tied_sp_embedding_wgrad_on_its_own_rows_fails_naming_step_and_parameter():
    plans = _plans({"tp2_sp_bf16": (TP2_SP_BF16, 0)})
    report, _, passed, _ = train_and_compare(plans, 4, None,
                                             _faulty_embedding_worker)["tp2_sp_bf16"]
    assert not passed and report["verdict"].startswith("FAIL: ")
    failures = report["twin"]["failures"]
    step0 = "step 0: reduced gradient "
    # The first layer's wgrad misses the other shard's rows on both TP ranks (and so does the
    # tied head's reduced grad); nothing before it in the backward moves at step 0.
    for name in ("stage0.layers.0.weight", "stage1.head.weight"):
        for tp_rank in (0, 1):
            assert any(f.startswith(f"{step0}{name} (replica 0, TP rank {tp_rank}) differs")
                       for f in failures), (name, tp_rank, failures[:3])
    for name in ("stage0.layers.0.bias", "stage1.layers.0.bias", "stage1.layers.0.weight"):
        assert not any(f.startswith(step0 + name) for f in failures), name
