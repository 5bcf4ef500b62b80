"""The twin's AdamW settings: clipping, loss scaling and the param all-gather, from the configuration.

The ranks train their stages (at VPP > 1 their model chunks, one DDP buffer each, under one
optimizer) with the candidate's schedule, DDP, deferred output layer and tied embedding,
then step the candidate's optimizer (``verify.candidates.interfaces``: fastgrad's
``DistributedOptimizer`` over its reduce-scattered shard or, without
``--use-distributed-optimizer``, ``ReplicatedOptimizer`` over the all-reduced grads;
Megatron-Core's ``get_megatron_optimizer``), the norm summed over the pipeline group with
the tied copy on the last stage left out, clipped to ``--clip-grad``, the loss scaled as
Megatron's grad scaler does. The reference (:mod:`verify.preflight.twin.reference`) runs
``refgrad.pipeline``'s model one replica after the other, reduces as
``refgrad.pipeline.reduce_across_replicas`` does, and steps ``refgrad.optim.optimizer_step``
(exact arithmetic, one rounding per fp32 operation) with the same max norm and loss scale.

Loss scaling in the fp32 twin: the loss is multiplied by the scale ``S`` (a power of two)
before the backward, so every gradient is exactly ``S`` times the unscaled one (no fp32
overflow or underflow at the twin's magnitudes); the reference therefore holds its reduced
grads times ``S`` and unscales them with ``r32(1/S)`` as the optimizer must. With 16-bit
params (``AdamWTwin.precision``) the reference runs the scaled 16-bit backward itself
(``refgrad.pipeline.precision``): fp16 grads may overflow, the step is skipped and the scale
follows Megatron's scaler (:mod:`verify.preflight.twin.scaler`).

The fp16 twin's loss scale. The twin's grads are small (an MSE over unit-variance data
through Linear+tanh layers): refgrad's own fp16 backward of the twin first overflows at a
scale of 2^19 (hidden 8, micro batch 1) to 2^23 (hidden 64, micro batch 8). Megatron's
default initial scale of 2^32 would overflow it at every step: every step skipped, the loss
scaler checked and never an update. The fp16 twin therefore starts at
``min(the configuration's scale, TWIN_FP16_MAX_SCALE)`` (2^10: finite by a margin of 2^9),
steps without inf for ``FP16_OVERFLOW_STEP`` steps, and then meets one deliberate overflow:
that step's targets are 2^32 times the seeded ones (``LinearStackSpec.overflow_step``), whose
fp16 grads overflow at any scale >= 1, so the step is skipped and Megatron's scaler counts
it (hysteresis, then backoff), on both sides.
"""

from __future__ import annotations

from verify.candidates.interfaces import HyperparameterSchedule
from verify.preflight.config import PreflightConfig
from verify.preflight.twin.variants import AdamWTwin, Dtype, TwinPrecision, power_of_two

TWIN_FP16_MAX_SCALE = 2.0**10  # the fp16 twin's largest loss scale (see the module docstring)
FP16_OVERFLOW_STEP = 2  # the fp16 twin's deliberate overflow: after two finite steps


def adamw_twin_for(config: PreflightConfig, precision: TwinPrecision | None = None
                   ) -> tuple[AdamWTwin, list[str]]:
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
    if scale is not None and not (power_of_two(scale) and (kind == "constant"
                                                            or power_of_two(config.min_loss_scale))):
        left_out.append(f"loss scale {scale:g} (min {config.min_loss_scale:g}) is not a power of two: "
                        "unscaling would round, so the twin's AdamW steps unscaled")
        scale = None
    if scale is not None and precision.grads is Dtype.BF16:
        left_out.append(f"loss scale {scale:g} with bf16 grads: fastgrad.optim scales only fp16 "
                        "grads or fp32 ones, so the twin's AdamW steps unscaled")
        scale = None
    if scale is not None and precision.params is Dtype.FP16 and scale > TWIN_FP16_MAX_SCALE:
        what = "initial loss scale" if kind == "dynamic" else "loss scale"
        left_out.append(f"{what} {scale:g} lowered to {TWIN_FP16_MAX_SCALE:g} for the fp16 twin: its "
                        f"grads would overflow fp16 at {scale:g} at every step (every step skipped, "
                        "no update checked); from 2^10 its first steps are finite, and one "
                        "deliberate loss spike overflows later")
        scale = TWIN_FP16_MAX_SCALE
    if scale is not None and kind == "dynamic" and precision.params is not Dtype.FP16:
        left_out.append("loss-scale backoff: the fp32 twin's grads never overflow, so the dynamic "
                        "scaler's skip, backoff and --hysteresis are not exercised (its growth "
                        "every --loss-scale-window clean steps is)")
    return AdamWTwin(max_grad_norm=max_norm, loss_scale=scale, dynamic=kind == "dynamic",
                     min_loss_scale=config.min_loss_scale,
                     loss_scale_window=config.loss_scale_window,
                     hysteresis=config.hysteresis,
                     overlap_param_gather=config.overlap_param_gather,
                     precision=precision), left_out


def fp16_overflow_step(adamw: AdamWTwin, steps: int) -> tuple[int | None, list[str]]:
    """The fp16 twin's deliberately overflowing step (None: not an fp16 twin with a loss
    scale, or too few steps), and what it leaves out."""
    if adamw.loss_scale is None or adamw.precision.params is not Dtype.FP16:
        return None, []
    if steps <= FP16_OVERFLOW_STEP:
        return None, [f"the fp16 twin's deliberate overflow (a skipped step, Megatron's scaler's "
                      f"hysteresis and backoff) comes at step {FP16_OVERFLOW_STEP + 1}: "
                      f"--twin-steps {steps} ends before it"]
    return FP16_OVERFLOW_STEP, []


def _scaling_text(kind: str | None, scale: float | None, config: PreflightConfig) -> str:
    if kind is None or scale is None:
        return "none"
    if kind == "constant":
        return f"constant {scale:g}"
    return (f"dynamic from {scale:g} (min {config.min_loss_scale:g}, x2 after "
            f"{config.loss_scale_window} clean steps, hysteresis {config.hysteresis})")


def schedule_text(schedule: HyperparameterSchedule) -> str:
    """The schedule in words (the mapping's twin column)."""
    warmup = (f"warm-up over {schedule.warmup_steps} update(s) from {schedule.init_lr:g} to "
              if schedule.warmup_steps else "from ")
    decay = ("constant" if schedule.decay_style == "constant" else
             f"{schedule.decay_style} decay to {schedule.min_lr:g} at update {schedule.decay_steps}")
    return (f"lr {warmup}{schedule.max_lr:g}, {decay}; weight decay {schedule.start_wd:g} -> "
            f"{schedule.end_wd:g} ({schedule.wd_incr_style}, over {schedule.wd_incr_steps} "
            "updates; none on skipped steps)")


def optimizer_mapping(config: PreflightConfig, adamw: AdamWTwin | None,
                      overflow_step: int | None = None) -> tuple[tuple[str, str, str], ...]:
    """(setting, production, twin) rows for the lr schedule, clipping, loss scaling (with the
    fp16 twin's deliberate ``overflow_step``) and the param all-gather."""
    kind = config.loss_scaling
    production_scale = (config.loss_scale if kind == "constant"
                        else config.initial_loss_scale if kind == "dynamic" else None)
    clip = f"global norm <= {config.clip_grad:g}" if config.clip_grad > 0 else "off (--clip-grad 0)"
    if adamw is None:
        return (("gradient clipping", clip, "none (SGD twin)"),
                ("loss scaling", _scaling_text(kind, production_scale, config), "none (SGD twin)"))
    gather = "waited in forward pre-hooks" if config.overlap_param_gather else "right after the step"
    return (
        ("lr and weight-decay schedule", "--lr / --lr-warmup-* / --lr-decay-* / "
         "--start-weight-decay ... (the twin runs a schedule of its own; preflight reads --lr "
         "and --min-lr only for validate_args' --min-lr <= --lr)",
         schedule_text(adamw.schedule)),
        ("gradient clipping", clip,
         "none" if adamw.max_grad_norm is None else
         f"global norm <= {adamw.max_grad_norm:g} (summed over DP and pipeline, tied copy once)"),
        ("loss scaling", _scaling_text(kind, production_scale, config),
         _scaling_text("dynamic" if adamw.dynamic else "constant", adamw.loss_scale, config)
         + ("" if overflow_step is None else
            f"; step {overflow_step + 1}: a loss spike overflows the fp16 grads (skipped)")),
        ("param all-gather", gather, gather),
    )
