"""Driver: Megatron-Core's distributed optimizer step and param all-gather, as plain tensors.

On every rank of a DP group, a module of parameters (2-D weights and 1-D biases; bf16,
fp16 or fp32) is wrapped in Megatron's ``DistributedDataParallel`` (distributed
optimizer, ``overlap_grad_reduce``, optionally ``overlap_param_gather``) and stepped by
``get_megatron_optimizer`` (Adam, decoupled weight decay, clipping, fp16's dynamic loss
scaler) with ``OptimizerParamScheduler`` setting each group's lr and weight decay as
Megatron-LM's training loop does (constant schedules). Rank- and step-specific
gradients come through real autograd (``loss = Σ_p (p · c_p).sum()``, scaled by
``optimizer.scale_loss`` as the schedules do), so ``p.grad = c_p · S``.

Per step every rank returns the params as the forward saw them (after the param
all-gather, which with ``overlap_param_gather`` is waited for by Megatron's forward
pre-hook), its gradients ``c_p``, what ``optimizer.step()`` returned (success, grad
norm), the loss scale, and the fp32 main params and Adam state it owns with the range of
each parameter they cover. After the last step a forced param sync gives the final params.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from verify.candidates.megatron_core.layout import transformer_config
from verify.candidates.megatron_core.runtime import ParallelGrid, megatron_world
from verify.distributed import spawn

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class OptimCase:
    """One distributed-optimizer configuration on ``dp_size`` gloo ranks."""

    dp_size: int = 2
    shapes: tuple[tuple[int, ...], ...] = ((12, 8), (12,), (5, 20))
    param_dtype: torch.dtype = torch.bfloat16
    lr: float = 0.01
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    initial_loss_scale: float | None = None
    grad_scale: float = 1.0
    overlap_param_gather: bool = False
    grad_reduce_in_fp32: bool = True
    call_owning_modules: bool = True
    steps: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.param_dtype not in DTYPES:
            raise ValueError(f"OptimCase.param_dtype must be one of {DTYPES}")
        if self.steps < 2:
            raise ValueError("OptimCase.steps must be >= 2 (Adam's bias correction changes per step)")
        if self.initial_loss_scale is not None and self.param_dtype is not torch.float16:
            raise ValueError("OptimCase.initial_loss_scale is fp16's dynamic loss scaler")

    def label(self) -> str:
        dtype = str(self.param_dtype).removeprefix("torch.")
        parts = [f"dp={self.dp_size}", dtype, f"wd={self.weight_decay}", f"clip={self.clip_grad}"]
        if self.initial_loss_scale is not None:
            parts.append(f"loss scale 2^{int(self.initial_loss_scale).bit_length() - 1}")
        if self.overlap_param_gather:
            parts.append("overlap_param_gather")
        if not self.call_owning_modules:
            parts.append("params read outside their modules")
        return " ".join(parts)


def initial_param(case: OptimCase, index: int) -> torch.Tensor:
    """Parameter ``index``'s initial value (param dtype), the same on every rank."""
    g = torch.Generator().manual_seed(case.seed * 1_000_003 + 17 * index + 3)
    return (torch.randn(case.shapes[index], generator=g) * 0.5).to(case.param_dtype)


def rank_gradient(case: OptimCase, rank: int, step: int, index: int) -> torch.Tensor:
    """Parameter ``index``'s gradient on DP rank ``rank`` at ``step`` (before loss scaling)."""
    g = torch.Generator().manual_seed(case.seed * 7_000_003 + rank * 7919 + step * 131 + index)
    return (torch.randn(case.shapes[index], generator=g) * case.grad_scale).to(case.param_dtype)


class _Coefficient(torch.nn.Module):
    """One parameter in a module of its own: ``(p · c).sum()``, so that DDP's forward
    pre-hook (which waits for this param's all-gather) fires when it is used."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(value)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.weight * c).sum()


class _Coefficients(torch.nn.Module):
    """``loss = Σ_p (p · c_p).sum()``. With ``call_owners`` each parameter's own module is
    called (as every Megatron model does); without, the parameters are read directly,
    outside their modules' forward."""

    def __init__(self, case: OptimCase) -> None:
        super().__init__()
        self.terms = torch.nn.ModuleList(
            [_Coefficient(initial_param(case, i)) for i in range(len(case.shapes))])
        self.call_owners = case.call_owning_modules
        self.seen: list[torch.Tensor] = []

    @property
    def weights(self) -> list[torch.nn.Parameter]:
        return [term.weight for term in self.terms]

    def forward(self, coefficients: list[torch.Tensor]) -> torch.Tensor:
        if self.call_owners:
            parts = [term(c) for term, c in zip(self.terms, coefficients)]
        else:
            parts = [(p * c).sum() for p, c in zip(self.weights, coefficients)]
        # After the calls above: every pre-hook that was going to wait for an all-gather has.
        self.seen = [p.detach().clone() for p in self.weights]
        return sum(parts)


def _owned_state(optimizer, params) -> dict[int, dict]:
    """The fp32 main params and Adam state this rank owns, per parameter index."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    owned = {}
    for i, param in enumerate(params):
        for dist_opt in inner:
            if param not in dist_opt.model_param_group_index_map:
                continue  # another optimizer's, or a piece this rank does not own
            param_range = dist_opt._get_model_param_range_map(param)["param"]
            group_index, order = dist_opt.model_param_group_index_map[param]
            main = dist_opt.optimizer.param_groups[group_index]["params"][order]
            state = dist_opt.optimizer.state.get(main, {})
            owned[i] = {"range": (param_range.start, param_range.end),
                        "main": main.detach().clone(),
                        "exp_avg": state.get("exp_avg", torch.zeros(0)).clone(),
                        "exp_avg_sq": state.get("exp_avg_sq", torch.zeros(0)).clone()}
    return owned


def _build(case: OptimCase):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    fp16, bf16 = case.param_dtype is torch.float16, case.param_dtype is torch.bfloat16
    module = _Coefficients(case)
    ddp = DistributedDataParallel(
        transformer_config(fp16=fp16, bf16=bf16, params_dtype=case.param_dtype),
        DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True,
            overlap_param_gather=case.overlap_param_gather,
            grad_reduce_in_fp32=case.grad_reduce_in_fp32, bucket_size=128),
        module)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=case.lr, min_lr=case.lr, weight_decay=case.weight_decay,
        adam_beta1=case.adam_beta1, adam_beta2=case.adam_beta2, adam_eps=case.adam_eps,
        clip_grad=case.clip_grad, fp16=fp16, bf16=bf16, params_dtype=case.param_dtype,
        use_distributed_optimizer=True, overlap_param_gather=case.overlap_param_gather,
        initial_loss_scale=case.initial_loss_scale), [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=case.lr, max_lr=case.lr, min_lr=case.lr, lr_warmup_steps=0,
        lr_decay_steps=case.steps, lr_decay_style="constant", start_wd=case.weight_decay,
        end_wd=case.weight_decay, wd_incr_steps=case.steps, wd_incr_style="constant")
    return module, ddp, optimizer, scheduler


def _optim_rank(rank: int, world_size: int, case: OptimCase) -> dict:
    with megatron_world(ParallelGrid(data_parallel=world_size)) as (place, log):
        module, ddp, optimizer, scheduler = _build(case)
        params = list(module.weights)
        steps = []
        for step in range(case.steps):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            grads = [rank_gradient(case, place.dp_rank, step, i) for i in range(len(params))]
            loss = ddp(grads)
            optimizer.scale_loss(loss).backward()
            ddp.finish_grad_sync()
            scale = float(optimizer.get_loss_scale())
            ok, norm, _ = optimizer.step()
            scheduler.step(increment=1)
            steps.append({"params": module.seen, "grads": grads, "loss_scale": scale,
                          "ok": bool(ok), "grad_norm": norm,
                          "owned": _owned_state(optimizer, params)})
        ddp.start_param_sync(force_sync=True)
        final = [p.detach().clone() for p in params]
        groups = [{"lr": g["lr"], "weight_decay": g["weight_decay"], "count": len(g["params"])}
                  for inner in getattr(optimizer, "chained_optimizers", [optimizer])
                  for g in inner.optimizer.param_groups]
        dist.barrier()
        return {"dp_rank": place.dp_rank, "steps": steps, "final": final, "groups": groups,
                "redirects": log.summary()}


def run_optim(case: OptimCase, *, timeout_s: float = 180.0) -> list[dict]:
    """Megatron's distributed optimizer for ``case`` on ``dp_size`` gloo ranks; per-rank results."""
    return spawn(_optim_rank, case.dp_size, case, timeout_s=timeout_s)
