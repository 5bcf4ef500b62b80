"""The reductions after a step's microbatches, in production's order, in the grad dtype:

1. over data-parallel replicas (:func:`reduce_across_replicas`, ``refgrad.reduce_scatter``'s
   rank-order sum with fp32 accumulation and one rounding to the grad dtype: for ``D <= 2``
   the correctly rounded sum, which any all-reduce algorithm produces; for any ``D``
   fastgrad's fp32-accumulating reduce-scatter), summed, averaged in the collective, or
   pre-scaled by ``1/D`` as production does;
2. under sequence parallelism, the replicated blocks' per-TP-rank grads summed over TP
   (:func:`sum_over_tensor_parallel`: Megatron-Core's all-reduce of sequence-parallel grads
   after the DP sync);
3. tied across stages, the embedding all-reduce of the first layer's and the head's grads
   over the embedding group (:func:`reduce_and_tie`; none for the one weight of
   ``LinearStackSpec.shares_one_weight``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradvocab import Averaging
from refgrad.pipeline.precision import add_rounded
from refgrad.pipeline.spec import EMBEDDING_PARAM, HEAD_PARAM, LinearStackSpec, stage_param_name
from refgrad.pipeline.tensor_parallel import vocab_split_names
from refgrad.reduce_scatter import all_reduce, prescale_like_torch

# The ways refgrad reduces across replicas (a pipeline's DP sync never post-scales).
REDUCTIONS = (Averaging.SUM, Averaging.AVG, Averaging.PRESCALE)


def check_reduction(reduction: Averaging) -> None:
    """ValueError unless ``reduction`` is one of :data:`REDUCTIONS` (the type, not its string)."""
    if not isinstance(reduction, Averaging) or reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of Averaging.SUM, .AVG, .PRESCALE, got {reduction!r}")


def reduce_across_replicas(per_replica: Sequence[torch.Tensor], reduction: Averaging) -> torch.Tensor:
    """The reference DP reduction of one parameter's per-replica grads (``refgrad.reduce_scatter``).

    ``reduction``: ``Averaging.SUM`` (rank-order sum, fp32 accumulation, one rounding to the
    grads' dtype), ``Averaging.AVG`` (that sum divided by ``D`` with one more rounding:
    ``ReduceOp.AVG``) or ``Averaging.PRESCALE`` (each replica's grad multiplied by ``1/D`` as torch does,
    then summed: production's gradient scaling factor before a SUM). For
    ``D <= 2`` the rank-order sum is the correctly rounded sum, which any
    all-reduce algorithm produces.
    """
    check_reduction(reduction)
    if not per_replica:
        raise ValueError("per_replica must hold at least one tensor")
    if len(per_replica) == 1:
        # A reduction over one replica is that replica (x * 1.0 and x / 1 are exact).
        return per_replica[0].clone()
    shape = per_replica[0].shape
    world = len(per_replica)
    numel = per_replica[0].numel()
    padded = -(-numel // world) * world
    flat = []
    for t in per_replica:
        f = torch.zeros(padded, dtype=t.dtype)
        f[:numel] = t.reshape(-1)
        flat.append(f)
    factors = reduction.factors(world)
    if factors.pre_scale is not None:
        flat = prescale_like_torch(flat, factors.pre_scale)
    op = Averaging.from_reduce_op(factors.op)  # the collective's op, SUM or AVG
    reduced = all_reduce(flat, accumulate="fp32", order="rank", op=op)[0]
    return reduced[:numel].reshape(shape)


def sum_over_tensor_parallel(spec: LinearStackSpec, reduced: dict[str, torch.Tensor]) -> None:
    """In place: each replicated block parameter's per-TP-rank DP-reduced grads summed in
    TP-rank order, each add rounded once to the grad dtype (step 2; one add at TP 2, correctly
    rounded in either order). The params split over TP by vocabulary rows are left alone."""
    split = vocab_split_names(spec)
    for name, per_rank in reduced.items():
        if name in split:
            continue
        total = per_rank[0]
        for k in range(1, spec.sequence_shards):
            total = add_rounded(total, per_rank[k], per_rank.dtype)
        reduced[name] = total


def reduce_and_tie(
    spec: LinearStackSpec, per_replica: Sequence[dict[str, torch.Tensor]], reduction: Averaging
) -> dict[str, torch.Tensor]:
    """Every gradient reduced as the module doc says: over DP, then (SP) over TP, then the
    tied-embedding all-reduce."""
    reduced = {name: reduce_across_replicas([sums[name] for sums in per_replica], reduction)
               for name in per_replica[0]}
    if spec.sequence_shards > 1:
        sum_over_tensor_parallel(spec, reduced)
    if spec.tied_embedding and not spec.shares_one_weight:  # one stage: one weight, no all-reduce
        head_name = stage_param_name(spec.num_stages - 1, HEAD_PARAM)
        tied_name = stage_param_name(0, EMBEDDING_PARAM)
        tied = add_rounded(reduced[tied_name], reduced[head_name], reduced[tied_name].dtype)
        reduced[tied_name] = tied
        reduced[head_name] = tied.clone()
    return reduced
