"""Each data-parallel replica's gradient sums for one step: its microbatches, one after the
other, through the whole model, each parameter's grads summed in microbatch order.

One loop for every variant of the model (``LinearStackSpec``: output head, tied embedding,
deferral, tensor and sequence parallelism) and every precision (``refgrad.pipeline.precision``:
fp32, or 16-bit params with an fp32 or 16-bit main-grad buffer). Per microbatch:

1. the input rounded to the param dtype; one body copy per sequence shard runs it
   (``refgrad.pipeline.tensor_parallel``: its rows under SP, every row otherwise; one copy,
   all of the model, at TP 1), and with a head the shards' outputs are all-gathered;
2. the head's logits per vocab block ``k``, ``X · W_kᵀ``, each its own GEMM
   (:class:`refgrad.pipeline.model.HeadRecordingWgrad`, recording ``(G_k, X)`` for the head's
   weight gradient); each TP rank's partial loss in fp32, and the loss their sum (the TP
   all-reduce; one partial, the microbatch's MSE, without a split);
3. the backward of the loss times the loss scale (when one is given); autograd's add of the
   vocab blocks' input gradients is the TP sum of the head's partial dgrads (two terms at
   TP 2: one rounding, in either order);
4. tied on one stage (``spec.shares_one_weight``, production's PP 1) the head's wgrad added
   into the one weight's buffer first (the backward reaches the head first), then every
   parameter's grad into its buffer (``precision.accumulate``); under SP a replicated block's
   buffer has a leading TP dimension (one per sequence shard), the params split over TP by
   vocabulary rows one buffer of every row.

After the microbatches the head's wgrads are added into its buffer in
``spec.head_wgrad_order`` (the deferral order), or, tied on one stage, its buffer is the one
weight's, reported under both names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from refgrad.pipeline.model import HeadRecordingWgrad
from refgrad.pipeline.precision import accumulate, add_in_fp32, check_precision, head_wgrad
from refgrad.pipeline.spec import (
    EMBEDDING_PARAM,
    HEAD_PARAM,
    LinearStackSpec,
    microbatch_data,
    stage_param_name,
)
from refgrad.pipeline.tensor_parallel import (
    forward_shards,
    head_shard,
    loss_target,
    sequence_shard_bodies,
    stage_loss,
    vocab_split_names,
)

# One microbatch's head records: per vocab block, its one recorded (G_k, X).
HeadRecords = list[list[tuple[torch.Tensor, torch.Tensor]]]


def replica_grad_sums(
    spec: LinearStackSpec,
    stages: Sequence[nn.Module],
    named: dict[str, torch.Tensor],
    head: torch.Tensor | None,
    step: int,
    num_microbatches: int,
    dp_size: int,
    *,
    grad_dtype: torch.dtype = torch.float32,
    loss_scale: float | None = None,
) -> tuple[list[dict[str, torch.Tensor]], list[list[float]]]:
    """Each replica's grad-dtype buffers after one step's microbatches (see the module doc)
    and its unscaled losses, ``[dp][microbatch]``.

    ``named`` maps every parameter name to its tensor (the head's too, when ``head`` is
    given); the params' dtype is the param dtype. Under SP a block parameter's buffer has a
    leading TP dimension; the head's ``[V, H]`` buffer is every TP rank's row block.
    """
    param_dtype = next(iter(named.values())).dtype
    check_precision(spec, param_dtype, grad_dtype, output_head=head is not None)
    shards, tp = spec.sequence_shards, spec.tensor_parallel
    head_name = stage_param_name(spec.num_stages - 1, HEAD_PARAM)
    tied_name = stage_param_name(0, EMBEDDING_PARAM)
    split = vocab_split_names(spec)  # TP-split by vocabulary rows: one buffer, never per shard
    bodies, body_params = sequence_shard_bodies(spec, stages)
    body_names = [n for n in named if n != head_name]
    per_replica: list[dict[str, torch.Tensor]] = []
    step_losses: list[list[float]] = []
    for dp_rank in range(dp_size):
        inputs, targets = microbatch_data(spec, dp_rank, step, num_microbatches)
        sums = {n: torch.zeros((shards, *named[n].shape) if shards > 1 and n not in split
                               else named[n].shape, dtype=grad_dtype) for n in body_names}
        records: list[HeadRecords] = []
        losses: list[float] = []
        for x, target in zip(inputs, targets):
            for params in body_params:
                for p in params.values():
                    p.grad = None
            outs = forward_shards(spec, bodies, x.to(param_dtype))  # (a row slice commutes with the cast)
            if head is not None:
                full = torch.cat(outs) if shards > 1 else outs[0]  # the all-gather
                # One record per vocab block: autograd may run the blocks' backwards in any order.
                record: HeadRecords = [[] for _ in range(tp)]
                partials = [stage_loss(spec, HeadRecordingWgrad.apply(full, head_shard(spec, head, k),
                                                                      record[k]).float(),
                                       loss_target(spec, target, k), num_microbatches)
                            for k in range(tp)]
                records.append(record)
            else:  # the loss split over sequence shards under SP, else one
                partials = [stage_loss(spec, outs[k].float(), loss_target(spec, target, k),
                                       num_microbatches) for k in range(shards)]
            loss = partials[0]
            for part in partials[1:]:
                loss = loss + part  # the TP all-reduce of the partial losses (fp32)
            # Each rank's backward starts from its own partial times S; the gradient of
            # (p_0 + ... ) * S with respect to each partial is S, exactly.
            (loss if loss_scale is None else loss * float(loss_scale)).backward()
            losses.append(float(loss.detach()))
            with torch.no_grad():
                if spec.shares_one_weight:  # one weight (one stage): the head's wgrad first
                    sums[tied_name] = add_in_fp32(sums[tied_name], head_wgrad(records.pop()), grad_dtype)
                for k, params in enumerate(body_params):
                    for n, p in params.items():
                        if p.grad is None:  # frozen
                            continue
                        if shards > 1 and n not in split:
                            sums[n][k] = accumulate(sums[n][k], p.grad, grad_dtype)
                        else:
                            sums[n] = accumulate(sums[n], p.grad, grad_dtype)
        if spec.shares_one_weight:
            sums[head_name] = sums[tied_name].clone()  # one parameter, reported under both names
        elif head is not None:
            head_sum = torch.zeros(head.shape, dtype=grad_dtype)
            with torch.no_grad():
                for m in spec.head_wgrad_order(num_microbatches):
                    head_sum = add_in_fp32(head_sum, head_wgrad(records[m]), grad_dtype)
            sums[head_name] = head_sum
        step_losses.append(losses)
        per_replica.append(sums)
    return per_replica, step_losses
