"""The mxfp8 check's multi-rank part: training with the grad buffer shared for the MXFP8 param all-gather, on and off."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradvocab import ParallelDims
from refgrad import mxfp8 as ref
from refgrad.formats import BFLOAT16, decode_tensor, round_values_to_tensor
from verify.candidates import Candidate, LaunchSettings
from verify.candidates.interfaces import ParamGatherResult, ParamGatherRun
from verify.check import CheckContext, CheckRecorder, launcher_for
from verify.checks.mxfp8.quantizer import as_e4m3, as_e8m0
from verify.distributed import spawn_each
from verify.fixtures import mxfp8_inputs as support

# ----------------------------------------------------------------------------- sharing

RunKey = tuple[bool, bool]  # (reuse_grad_buf_for_mxfp8_param_ag, grad_reduce_in_fp32)


def param_gather_runs(iterations: int, seed: int, grad_options: tuple[bool, ...]) -> list[ParamGatherRun]:
    """The toy model with sharing off and on, for each grad dtype (fp32 and/or bf16)."""
    return [
        ParamGatherRun(support.TOY_SHAPES, support.TOY_BUCKET_SIZE,
                       reuse_grad_buf_for_mxfp8_param_ag=sharing, grad_reduce_in_fp32=grad_fp32,
                       iterations=iterations, seed=seed)
        for grad_fp32 in grad_options
        for sharing in (False, True)
    ]


def param_gather_rank(rank: int, world_size: int, runs: list[ParamGatherRun],
                      candidate: Candidate) -> dict[RunKey, ParamGatherResult]:
    """One DP rank: every run through the candidate's MXFP8 param all-gather (one item of
    the check's world: what the candidate raises ends it and is its crash)."""
    with candidate.mxfp8() as mxfp8:
        return {
            (run.reuse_grad_buf_for_mxfp8_param_ag, run.grad_reduce_in_fp32):
                mxfp8.train_with_param_gather(run, rank, dist.group.WORLD)
            for run in runs
        }


SHARING = "MXFP8 params all-gathered through the grad buffer, sharing on and off"
SHARING_SETTINGS = LaunchSettings(
    dims=ParallelDims(dp_size=2), params_dtype="bfloat16", use_distributed_optimizer=True,
    overlap_param_gather=True, overlap_grad_reduce=True, has_output_layer=False,
    other_flags=("--fp8-recipe mxfp8", "--fp8-param-gather",
                 "--reuse-grad-buf-for-mxfp8-param-ag (sharing on)"))


def check_sharing(
    ctx: CheckContext, rec: CheckRecorder, candidate: Candidate, iterations: int = 3
) -> dict[RunKey, ParamGatherResult] | None:
    """Train on dp=2 gloo ranks with sharing on and off; bitwise equality every iteration.

    Returns rank 0's runs, keyed by ``(sharing, grad_fp32)`` (None: the candidate crashed).
    """
    # quick: fp32 grads only (the fp32 case is the one whose param bytes overlap other
    # buckets' grads); the full run adds bf16 grads.
    grad_options = (True,) if ctx.quick else (True, False)
    (outcome,) = spawn_each(param_gather_rank, 2, [param_gather_runs(iterations, ctx.seed,
                                                                     grad_options)],
                            candidate, isolate=True, timeout_s=ctx.timeout_s,
                            launcher=launcher_for(candidate))
    if outcome.crash is not None:
        with rec.case(SHARING, SHARING_SETTINGS):
            rec.crash(SHARING, outcome.crash, candidate)
        return None
    results = outcome.results
    for rank, per_mode in enumerate(results):
        for grad_fp32 in grad_options:
            off, on = per_mode[(False, grad_fp32)], per_mode[(True, grad_fp32)]
            grad_dtype = torch.float32 if grad_fp32 else torch.bfloat16
            tag = f"rank {rank}, {'fp32' if grad_fp32 else 'bf16'} grads"
            rec.expect(f"sharing active only when on ({tag})", on.sharing and not off.sharing)
            dtypes = {step.grads.dtype for run in (off, on) for step in run.steps}
            rec.expect(f"grad buffers hold {grad_dtype} ({tag})", dtypes == {grad_dtype}, f"got {dtypes}")
            for it, (a, b) in enumerate(zip(off.steps, on.steps)):
                where = f"{tag}, iteration {it}"
                for k, (sa, sb) in enumerate(zip(a.scale_bits, b.scale_bits)):
                    rec.compare(f"MXFP8 scales W{k + 1}, {where}", as_e8m0(sa), as_e8m0(sb))
                for k, (ea, eb) in enumerate(zip(a.element_bits, b.element_bits)):
                    rec.compare(f"MXFP8 elements W{k + 1}, {where}", as_e4m3(ea), as_e4m3(eb))
                rec.compare(f"grad buffer after reduce-scatter, {where}", a.grads, b.grads)
                for k, (ma, mb) in enumerate(zip(a.masters_after, b.masters_after)):
                    rec.compare(f"fp32 master shard bucket {k} after step, {where}", ma, mb)
    _check_gathered_against_refgrad(ctx, rec, results, iterations)
    return results[0]


def _check_gathered_against_refgrad(
    ctx: CheckContext, rec: CheckRecorder, results: list[dict[RunKey, ParamGatherResult]],
    iterations: int,
) -> None:
    """The MXFP8 params each rank holds equal refgrad's quantization of the gathered masters."""
    key = (True, True)
    run0 = results[0][key]
    numel = run0.numel
    check_iterations = [iterations - 1] if ctx.quick else [0, iterations - 1]
    for it in check_iterations:
        full = torch.zeros(numel, dtype=torch.float32)
        for per_rank in results:
            run = per_rank[key]
            for (lo, hi), shard in zip(run.shard_ranges, run.steps[it].masters_before):
                full[lo:hi] = shard
        # The staging cast fp32 -> bf16, rounded by refgrad.formats (not by torch's cast).
        params_bf16 = round_values_to_tensor(BFLOAT16, decode_tensor(full), full.shape)
        for k, (start, end) in enumerate(run0.param_ranges):
            shape = support.TOY_SHAPES[k]
            expected_scales, expected_elements = ref.quantize(
                params_bf16[start:end].reshape(shape), scale_mode="floor"
            )
            for rank, per_rank in enumerate(results):
                step = per_rank[key].steps[it]
                rec.compare(
                    f"gathered MXFP8 W{k + 1} vs refgrad(all-gathered masters), rank {rank}, iteration {it}",
                    as_e4m3(expected_elements.reshape(-1)),
                    as_e4m3(step.element_bits[k].reshape(-1)),
                )
                rec.compare(
                    f"gathered MXFP8 W{k + 1} scales vs refgrad, rank {rank}, iteration {it}",
                    as_e8m0(expected_scales.reshape(-1)),
                    as_e8m0(step.scale_bits[k].reshape(-1)),
                )
