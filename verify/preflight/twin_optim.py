"""The twin's optimizer: fastgrad.optim's AdamW vs refgrad.optim, every step.

Each rank trains its stage (at VPP > 1 its model chunks, one DDP buffer each,
under one optimizer through ``fastgrad.optim.ModelChunks``) with the same schedule, DDP
engine, deferred output layer and tied embedding as the SGD twin
(``verify.checks.pipeline.run_case_on_rank``), then steps
``fastgrad.optim.DistributedOptimizer`` (AdamW over its reduce-scattered shard,
or, without ``--use-distributed-optimizer``, ``ReplicatedOptimizer`` over the
all-reduced grads;
the norm summed over the pipeline group, the tied copy on the last stage left
out; clipped to ``--clip-grad``; the loss scaled as Megatron's grad scaler
does) and records its full fp32 master weights and AdamW state
(``state_dict``). The reference (``verify.preflight.twin_optim_reference``) runs ``refgrad.pipeline``'s model one replica
after the other, reduces as ``refgrad.pipeline.reduce_across_replicas`` does,
and steps ``refgrad.optim.optimizer_step`` (exact arithmetic, one rounding per
fp32 operation) with the same max norm and loss scale.

Loss scaling in the fp32 twin: the loss is multiplied by the scale ``S`` (a
power of two) before the backward, so every gradient is exactly ``S`` times the
unscaled one (no fp32 overflow or underflow at the twin's magnitudes); the
reference therefore holds its reduced grads times ``S`` and unscales them with
``r32(1/S)`` as the optimizer must. With 16-bit params (``AdamWTwin.precision``,
``verify.preflight.twin_precision``) the reference runs the scaled 16-bit backward
itself (``refgrad.pipeline_mixed``): fp16 grads may overflow, the step is skipped and
the scale follows Megatron's scaler (``verify.preflight.twin_scaler``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from verify.preflight.twin_precision import (
    TwinPrecision,
    cast_inputs,
    cast_stage_params_,
    mixed_loss_fn,
)

ADAMW = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")
CONSTANT_SCALE_WINDOW = 2**31  # a ConstantGradScaler never grows: a window no twin reaches


def _power_of_two(value: float) -> bool:
    return value > 0 and math.isfinite(value) and math.frexp(value)[0] == 0.5


@dataclass(frozen=True)
class AdamWTwin:
    """Clipping and loss scaling of the twin's AdamW, taken from the configuration.

    ``loss_scale``: the initial scale (dynamic) or the constant one; None = no
    scaling. Megatron's ConstantGradScaler is modelled as a scaler that never
    changes (min = initial, a growth window of 2^31 steps).
    """

    max_grad_norm: float | None = None
    loss_scale: float | None = None
    dynamic: bool = False
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    overlap_param_gather: bool = False  # gather launched by step(), waited in forward pre-hooks
    precision: TwinPrecision = TwinPrecision()  # 16-bit params/compute and the grad buffer dtype

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm)
                                                   and self.max_grad_norm > 0):
            raise ValueError(f"AdamWTwin.max_grad_norm must be finite and > 0, got {self.max_grad_norm}")
        if self.loss_scale is not None and not _power_of_two(self.loss_scale):
            raise ValueError(f"AdamWTwin.loss_scale must be a power of two, got {self.loss_scale}")

    @property
    def window(self) -> int:
        return self.loss_scale_window if self.dynamic else CONSTANT_SCALE_WINDOW

    def scaler(self) -> Any:
        """fastgrad's DynamicLossScaler for this setting (None without loss scaling)."""
        from fastgrad.optim import DynamicLossScaler

        if self.loss_scale is None:
            return None
        return DynamicLossScaler(initial_scale=self.loss_scale,
                                 min_scale=self.min_loss_scale if self.dynamic else self.loss_scale,
                                 growth_interval=self.window, hysteresis=self.hysteresis)


def adamw_twin_for(config: Any, precision: TwinPrecision | None = None) -> tuple[AdamWTwin, list[str]]:
    """The twin's clipping and loss scaling for ``config`` at ``precision`` (fp32 when None),
    and what it cannot reproduce."""
    precision = precision or TwinPrecision()
    left_out = []
    max_norm = config.clip_grad if config.clip_grad > 0 else None
    kind = config.loss_scaling
    scale = None
    if kind == "constant":
        scale = config.loss_scale
    elif kind == "dynamic":
        scale = config.initial_loss_scale
    if scale is not None and not (_power_of_two(scale) and (kind == "constant"
                                                            or _power_of_two(config.min_loss_scale))):
        left_out.append(f"loss scale {scale:g} (min {config.min_loss_scale:g}) is not a power of two: "
                        "unscaling would round, so the twin's AdamW steps unscaled")
        scale = None
    if scale is not None and precision.grads == "bf16":
        left_out.append(f"loss scale {scale:g} with bf16 grads: fastgrad.optim scales only fp16 "
                        "grads or fp32 ones, so the twin's AdamW steps unscaled")
        scale = None
    if scale is not None and kind == "dynamic" and precision.params != "fp16":
        left_out.append("loss-scale backoff: the fp32 twin's grads never overflow, so the dynamic "
                        "scaler's skip, backoff and --hysteresis are not exercised (its growth "
                        "every --loss-scale-window clean steps is)")
    return AdamWTwin(max_grad_norm=max_norm, loss_scale=scale, dynamic=kind == "dynamic",
                     min_loss_scale=config.min_loss_scale,
                     loss_scale_window=config.loss_scale_window,
                     hysteresis=config.hysteresis,
                     overlap_param_gather=config.overlap_param_gather,
                     precision=precision), left_out


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
    # per step: (stepped, grad norm, clip coefficient or None, loss scale or None)
    steps: list[tuple[bool, float, float | None, float | None]] = field(default_factory=list)
    # per step with overlap_param_gather at DP > 1: (gather in flight after the step,
    # every gather waited for by the next forward's pre-hooks)
    gathers_waited_in_hooks: list[tuple[bool, bool]] = field(default_factory=list)
    # per step: where each bucket's grad reduction was launched (the bucket rule's evidence)
    launch_sites: list[tuple[Any, ...]] = field(default_factory=list)


def _ddp_config(case: Any, overlap: bool, optim: AdamWTwin, stage: int, chunk: int = 0) -> Any:
    """The pipeline check's DDP settings for chunk ``chunk`` on ``stage`` (one place for the
    bucket rules), with the optimizer's param all-gather overlap."""
    import dataclasses

    from verify.checks.pipeline.worker import case_ddp_config

    return dataclasses.replace(case_ddp_config(case, overlap, stage, chunk),
                               overlap_param_gather=optim.overlap_param_gather,
                               grad_reduce_in_fp32=optim.precision.grads == "fp32")


def full_grads(ddps: list[Any], name_of: dict[int, Any], case: Any, groups: Any) -> dict:
    """Every param's reduced grad: each rank reduced only its shard, so gather the rest.
    ``name_of[id(param)]``: its name, or a list of its names (a shared weight)."""
    from fastgrad.comm import all_gather_into

    grads = {}
    for ddp in ddps:
        for bucket in ddp.buffer.buckets:
            full = bucket.grad_data.clone()  # all-reduced: whole on every rank
            if case.dp_size > 1 and case.use_distributed_optimizer:
                all_gather_into(full, bucket.local_grad_shard.clone(), group=groups.dp_group)
            for p in bucket.params:
                start, end = bucket.param_to_index[p]
                names = name_of[id(p)]
                for name in [names] if isinstance(names, str) else names:
                    grads[name] = full[start:end].reshape(p.shape).clone()
    return grads


class _Recorder:
    """Fills an OptimRankResult around each step of one rank's optimizer."""

    def __init__(self, result: OptimRankResult, optimizer: Any, target: Any, named: dict) -> None:
        self.result, self.optimizer, self.target, self.named = result, optimizer, target, named
        self.launched = False

    @property
    def scale(self) -> float:
        scaler = self.optimizer.loss_scaler
        return 1.0 if scaler is None else scaler.scale

    def before_forward(self) -> None:
        self.launched = self.optimizer.param_gather_in_flight

    def after_backward(self, step: int, groups: Any) -> None:
        """The previous step's params, now gathered by the forward pre-hooks, and its state."""
        if step == 0:
            return
        if self.optimizer.overlap_param_gather and groups.dp_size > 1:
            self.result.gathers_waited_in_hooks.append(
                (self.launched, not self.optimizer.param_gather_in_flight))
        self.snapshot()

    def snapshot(self) -> None:
        # Taken once the params are gathered: state_dict() would otherwise wait in the hooks' place.
        self.result.params.append({n: p.detach().clone() for n, p in self.named.items()})
        by_target_name = self.optimizer.named_state_dict()["params"]
        self.result.state.append({n: by_target_name[self.target.name_of(p)]
                                  for n, p in self.named.items()
                                  if self.target.name_of(p) in by_target_name})

    def step(self, losses: list[float], grads: dict, scale: float) -> None:
        outcome = self.optimizer.step()
        self.result.losses.append([v / scale for v in losses])  # exact: S = 2^k
        self.result.grads.append(grads)
        self.result.steps.append((outcome.stepped, outcome.grad_norm, outcome.clip_coefficient,
                                  outcome.loss_scale))

    def finish(self) -> OptimRankResult:
        self.optimizer.finish_param_sync()  # the last step's gather: no forward follows it
        self.snapshot()
        self.optimizer.remove_hooks()
        return self.result


def _optimizer(target: Any, optim: AdamWTwin, case: Any, groups: Any) -> Any:
    """DistributedOptimizer over the shards, or (no --use-distributed-optimizer) the
    ReplicatedOptimizer over the all-reduced grads: Megatron's two optimizers."""
    from fastgrad.optim import AdamWConfig, DistributedOptimizer, ReplicatedOptimizer

    cls = DistributedOptimizer if case.use_distributed_optimizer else ReplicatedOptimizer
    return cls(target, AdamWConfig(**ADAMW), max_grad_norm=optim.max_grad_norm,
               loss_scaler=optim.scaler(),
               model_parallel_group=norm_group(case, groups))


def norm_group(case: Any, groups: Any) -> Any:
    """The group the grad norm is summed over besides DP: every stage and TP rank of this
    replica (TP duplicates are marked ``shared``), as Megatron-Core's model-parallel group."""
    if case.tp_size > 1:
        return groups.model_parallel_group
    return groups.pp_group if case.pp_size > 1 else None


def run_optimizer_rank(case: Any, groups: Any, overlap: bool,
                       optim: AdamWTwin | None = None) -> OptimRankResult:
    """Train ``case`` on this rank (1F1B, or interleaved at VPP > 1: one DDP engine per model
    chunk, one AdamW over all of them through ``fastgrad.optim.ModelChunks``, as
    Megatron-Core's optimizer over its model chunks) with fastgrad's AdamW."""
    from fastgrad.ddp import DistributedDataParallel
    from fastgrad.optim import ModelChunks
    from fastgrad.pipeline import forward_backward_1f1b
    from fastgrad.pipeline_interleaved import forward_backward_interleaved
    from verify.checks.pipeline.shared_weight import drained_head, external_grad_params
    from verify.checks.pipeline.worker import build_stage_model, rank_microbatches, total_losses

    optim = optim or AdamWTwin()
    spec, stage, chunks = case.spec, groups.stage, case.virtual_stages
    built = [build_stage_model(case, groups, c) for c in range(chunks)]
    # build_stage_model: (module, {name: param}, output head or None, [tied params])
    modules = [module for module, _, _, _ in built]
    named = {n: p for _, chunk_params, _, _ in built for n, p in chunk_params.items()}
    cast_stage_params_(named.values(), optim.precision)
    heads = [head for _, _, head, _ in built]
    head = next((h for h in heads if h is not None), None)  # the last virtual stage's
    tied = [p for _, _, _, chunk_tied in built for p in chunk_tied]
    if head is not None and spec.tied_embedding and not spec.shares_one_weight:
        head.weight.shared = True  # the second copy: out of the grad norm (PP 1: one weight, in it)
    ddps = [DistributedDataParallel(module, config=_ddp_config(case, overlap, optim, stage, c),
                                    dp_group=groups.dp_group, average=case.reduction != "sum",
                                    external_grad_params=external_grad_params(spec, heads[c]))
            for c, module in enumerate(modules)]
    target = ddps[0] if chunks == 1 else ModelChunks(ddps)
    optimizer = _optimizer(target, optim, case, groups)
    name_of: dict[int, list[str]] = {}
    for n, p in named.items():  # the shared weight (tied at PP 1) under both its names
        name_of.setdefault(id(p), []).append(n)
    rec = _Recorder(OptimRankResult(stage=stage, dp_rank=groups.dp_rank, tp_rank=groups.tp_rank),
                    optimizer, target, named)
    for step, plan in enumerate(case.plans):
        for ddp in ddps:
            ddp.zero_grad_buffer()
        if head is not None:
            head.start_step()
        m, scale = plan.num_microbatches, rec.scale
        inputs, targets, loss_fn = rank_microbatches(case, groups, step, m)
        common = dict(groups=groups, num_microbatches=m,
                      activation_shape=spec.stage_activation_shape,
                      dtype=optim.precision.param_dtype, loss_fn=mixed_loss_fn(loss_fn, scale),
                      inputs=cast_inputs(inputs, optim.precision) if groups.is_first_stage else None,
                      targets=targets if groups.is_last_stage else None,
                      deferred_wgrad=drained_head(spec, head), embedding_params=tied)
        rec.before_forward()
        if chunks == 1:
            losses = forward_backward_1f1b(modules[0], grad_sync=ddps[0], **common)
        else:
            losses = forward_backward_interleaved(modules, grad_syncs=ddps, **common)
        rec.after_backward(step, groups)
        rec.result.launch_sites.append(tuple(s for ddp in ddps for s in ddp.last_launch_sites))
        rec.step(total_losses(case, groups, losses), full_grads(ddps, name_of, case, groups), scale)
    for ddp in ddps:
        ddp.remove_hooks()
    return rec.finish()


def _scaling_text(kind: str | None, scale: float | None, config: Any) -> str:
    if kind is None or scale is None:
        return "none"
    if kind == "constant":
        return f"constant {scale:g}"
    return (f"dynamic from {scale:g} (min {config.min_loss_scale:g}, x2 after "
            f"{config.loss_scale_window} clean steps, hysteresis {config.hysteresis})")


def optimizer_mapping(config: Any, adamw: AdamWTwin | None) -> tuple[tuple[str, str, str], ...]:
    """(setting, production, twin) rows for clipping, loss scaling and the param all-gather."""
    kind = config.loss_scaling
    production_scale = (config.loss_scale if kind == "constant"
                        else config.initial_loss_scale if kind == "dynamic" else None)
    clip = f"global norm <= {config.clip_grad:g}" if config.clip_grad > 0 else "off (--clip-grad 0)"
    if adamw is None:
        return (("gradient clipping", clip, "none (SGD twin)"),
                ("loss scaling", _scaling_text(kind, production_scale, config), "none (SGD twin)"))
    gather = "waited in forward pre-hooks" if config.overlap_param_gather else "right after the step"
    return (
        ("gradient clipping", clip,
         "none" if adamw.max_grad_norm is None else
         f"global norm <= {adamw.max_grad_norm:g} (summed over DP and pipeline, tied copy once)"),
        ("loss scaling", _scaling_text(kind, production_scale, config),
         _scaling_text("dynamic" if adamw.dynamic else "constant", adamw.loss_scale, config)),
        ("param all-gather", gather, gather),
    )
