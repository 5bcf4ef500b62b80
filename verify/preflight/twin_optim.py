"""The twin with the distributed optimizer: fastgrad.optim's AdamW vs refgrad.optim, every step.

Used when the configuration has ``--use-distributed-optimizer`` and no
interleaving. Each rank trains its stage with the same 1F1B schedule, DDP
engine, deferred output layer and tied embedding as the SGD twin
(``verify.checks.pipeline.run_case_on_rank``), then steps
``fastgrad.optim.DistributedOptimizer`` (AdamW over its reduce-scattered shard;
the norm summed over the pipeline group, the tied copy on the last stage left
out) and records its full fp32 master weights and AdamW state
(``state_dict``). The reference runs ``refgrad.pipeline``'s model one replica
after the other, reduces as ``refgrad.pipeline.reduce_across_replicas`` does,
and steps ``refgrad.optim.optimizer_step`` (exact arithmetic, one rounding per
fp32 operation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

ADAMW = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


@dataclass
class OptimRankResult:
    """Per step on one rank: losses, full reduced grads, params and optimizer state by name."""

    stage: int
    dp_rank: int
    tp_rank: int = 0
    losses: list[list[float]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    state: list[dict[str, dict[str, torch.Tensor]]] = field(default_factory=list)


def run_optimizer_rank(case: Any, groups: Any, overlap: bool) -> OptimRankResult:
    """Train ``case`` (1F1B, distributed optimizer) on this rank with fastgrad's AdamW."""
    from fastgrad.comm import all_gather_into
    from fastgrad.config import DDPConfig
    from fastgrad.ddp import DistributedDataParallel
    from fastgrad.optim import AdamWConfig, DistributedOptimizer
    from fastgrad.pipeline import forward_backward_1f1b
    from verify.checks.pipeline.worker import build_stage_model, rank_microbatches, total_losses

    spec, stage = case.spec, groups.stage
    module, named, head, tied = build_stage_model(case, groups)
    if head is not None and spec.tied_embedding:
        head.weight.shared = True  # the second copy: out of the grad norm
    ddp = DistributedDataParallel(
        module,
        config=DDPConfig(use_distributed_optimizer=True, overlap_grad_reduce=overlap,
                         reduce_scatter_with_fp32_accumulation=case.reduce_scatter_with_fp32_accumulation,
                         average_in_collective=case.reduction == "avg", bucket_size=case.bucket_size_for(stage, 0)),
        dp_group=groups.dp_group, average=case.reduction != "sum",
        external_grad_params=[] if head is None else [head.weight])
    model_parallel = groups.model_parallel_group if case.tp_size > 1 else (
        groups.pp_group if case.pp_size > 1 else None)  # the norm: every stage and TP rank
    optimizer = DistributedOptimizer(ddp, AdamWConfig(**ADAMW), model_parallel_group=model_parallel)
    name_of = {id(p): n for n, p in named.items()}
    result = OptimRankResult(stage=stage, dp_rank=groups.dp_rank, tp_rank=groups.tp_rank)
    for step, plan in enumerate(case.plans):
        ddp.zero_grad_buffer()
        if head is not None:
            head.start_step()
        m = plan.num_microbatches
        inputs, targets, loss_fn = rank_microbatches(case, groups, step, m)
        losses = forward_backward_1f1b(
            module, groups=groups, grad_sync=ddp, num_microbatches=m,
            activation_shape=spec.stage_activation_shape, loss_fn=loss_fn,
            inputs=inputs if groups.is_first_stage else None,
            targets=targets if groups.is_last_stage else None,
            deferred_wgrad=head, embedding_params=tied)
        grads = {}
        for bucket in ddp.buffer.buckets:  # each rank reduced only its shard: gather the rest
            full = bucket.grad_data.clone()
            if case.dp_size > 1:
                all_gather_into(full, bucket.local_grad_shard.clone(), group=groups.dp_group)
            for p in bucket.params:
                start, end = bucket.param_to_index[p]
                grads[name_of[id(p)]] = full[start:end].reshape(p.shape).clone()
        optimizer.step()
        result.losses.append(total_losses(case, groups, losses))
        result.grads.append(grads)
        result.params.append({n: p.detach().clone() for n, p in named.items()})
        by_ddp_name = optimizer.state_dict()["params"]
        result.state.append({name_of[id(p)]: by_ddp_name[ddp.name_of(p)]
                             for p in named.values() if ddp.name_of(p) in by_ddp_name})
    optimizer.remove_hooks()
    ddp.remove_hooks()
    return result


@dataclass
class OptimReference:
    """refgrad's run: per step losses [replica][microbatch], reduced grads, params, state."""

    losses: list[list[list[float]]] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)
    state: list[dict[str, dict[str, torch.Tensor]]] = field(default_factory=list)


def reference_with_optimizer(case: Any) -> OptimReference:
    """The whole model in one process: microbatch-ordered sums, DP reduction, exact AdamW."""
    from refgrad.optim import AdamW, ParamState, optimizer_step, to_tensor, values
    from refgrad.pipeline import (
        HEAD_PARAM,
        StageModule,
        head_weight_init,
        reduce_and_tie,
        replica_grad_sums,
        stage_param_name,
    )

    spec = case.spec
    stages = [StageModule(spec, s) for s in range(spec.num_stages)]
    named = {stage_param_name(s, n): p for s, st in enumerate(stages) for n, p in st.named_parameters()}
    head_name = stage_param_name(spec.num_stages - 1, HEAD_PARAM)
    head = None
    if spec.output_head:
        head = head_weight_init(spec).requires_grad_(True)
        named[head_name] = head
    names = list(named)
    states = {n: ParamState(master=values(p.detach())) for n, p in named.items()}
    hyper = AdamW(**ADAMW)
    out = OptimReference()
    for step, plan in enumerate(case.plans):
        per_replica, step_losses = replica_grad_sums(
            spec, stages, named, head, step, plan.num_microbatches, case.dp_size)
        reduced = reduce_and_tie(spec, per_replica, case.reduction)
        shared = [spec.tied_embedding and n == head_name for n in names]
        optimizer_step([states[n] for n in names], [reduced[n] for n in names],
                       [hyper] * len(names), [step + 1] * len(names), shared=shared)
        state_now = {}
        with torch.no_grad():
            for n in names:
                shape = named[n].shape
                named[n].copy_(to_tensor(states[n].master, shape))
                state_now[n] = {"master": to_tensor(states[n].master, shape),
                                "exp_avg": to_tensor(states[n].exp_avg, shape),
                                "exp_avg_sq": to_tensor(states[n].exp_avg_sq, shape)}
        out.losses.append(step_losses)
        out.grads.append(reduced)
        out.params.append({n: p.detach().clone() for n, p in named.items()})
        out.state.append(state_now)
    return out
