"""The scaled twin: the user's layout trained for a few steps with fastgrad, checked against refgrad.

:func:`plan_twin` maps a :class:`PreflightConfig` onto a
``verify.checks.pipeline`` case: the same TP x PP x VPP x DP grid (TP capped at
2: a vocab-parallel output layer, Linear+tanh blocks replicated, on sequence
shards under sequence parallelism) and microbatch count (capped), production's
bucket rule, the same reduction (Megatron's default 1/DP pre-scaling before a
SUM), the same collective (reduce-scatter with the distributed optimizer,
all-reduce without), fp32-accumulating reduce-scatter, overlap on or off,
the deferred output-layer wgrad and the tied-embedding all-reduce (at TP 2 each TP
rank's vocab-parallel first-layer shard tied to its output-layer shard; at PP 1
one weight shared by the first layer and the output layer, as production's), with
``--twin-hidden-size`` wide Linear+tanh layers in place of transformer blocks,
and (``--fp8-recipe mxfp8 --fp8-param-gather``) MXFP8 weights through fastgrad's
MXFP8 buffer, its param all-gather reusing the grad buffer where the
configuration does (``verify.preflight.twin_mxfp8``).
Everything the twin does not reproduce is listed in ``not_twinned``.

:func:`verify.preflight.twin_stage.run_twin_stage` trains it on real ranks
(spawned gloo processes, or the torchrun group) and
:func:`verify.preflight.twin_compare.compare_steps` holds every step's losses,
reduced gradients and updated parameters against refgrad's single-process
model: bitwise where the reduction order is fixed, else within a stated bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from verify.preflight.config import PreflightConfig
from verify.preflight.twin_compare import ulp_bound_factor

TWIN_LR = 0.05
# TP sums of two fp32 values are one rounding in any order: bitwise. Larger TP is scaled to 2.
MAX_TWIN_TP = 2
# An uneven split: the twin keeps each virtual stage's surplus over the lightest one, up to this.
MAX_EXTRA_TWIN_LAYERS = 3


class TwinSizeError(ValueError):
    """The twin needs more ranks than allowed (exit code 2)."""


@dataclass(frozen=True)
class TwinOptions:
    """How big the twin is and how long it may run (the ``--twin-*`` flags)."""

    hidden_size: int = 16
    layers: int = 1  # per virtual pipeline stage
    steps: int = 3
    max_microbatches: int = 8
    max_world_size: int = 8
    timeout_s: float = 240.0

    def __post_init__(self) -> None:
        for name, flag in (("hidden_size", "--twin-hidden-size"), ("layers", "--twin-layers"),
                           ("steps", "--twin-steps"), ("max_microbatches", "--twin-max-microbatches"),
                           ("max_world_size", "--max-world-size")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        if self.steps < 2:
            raise ValueError(f"--twin-steps must be >= 2 (a step that reuses learned state), "
                             f"got {self.steps}")
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s)
                and self.timeout_s > 0):
            raise ValueError(f"--timeout must be a finite number of seconds > 0, got {self.timeout_s!r}")


@dataclass(frozen=True)
class TwinPlan:
    """The case the twin runs, how it maps the configuration, and what it leaves out."""

    case: Any  # verify.checks.pipeline.PipelineCase
    overlap: bool
    world_size: int
    bitwise: bool
    order_note: str
    mapping: tuple[tuple[str, str, str], ...]  # (setting, production, twin)
    not_twinned: tuple[str, ...]
    optimizer: str = "sgd"  # "adamw": fastgrad.optim.DistributedOptimizer vs refgrad.optim
    adamw: Any = None  # verify.preflight.twin_optim.AdamWTwin (clipping, loss scale) for "adamw"
    mxfp8: Any = None  # verify.preflight.twin_mxfp8.MXFP8Twin: MXFP8 params (None: none)

    @property
    def rank_optimizer(self) -> Any:
        """What the ranks are told to step with: "sgd", the AdamWTwin settings, or (MXFP8
        params) the MXFP8Twin settings."""
        if self.mxfp8 is not None:
            return self.mxfp8
        return self.adamw if self.optimizer == "adamw" and self.adamw is not None else self.optimizer


def _twin_microbatches(config: PreflightConfig, options: TwinOptions) -> int:
    m, pp = config.num_microbatches, config.pipeline_model_parallel_size
    m = min(m, options.max_microbatches)
    if config.virtual_pipeline_model_parallel_size > 1:  # a multiple of PP, >= PP
        m = max(pp, m - m % pp)
    return m


def plan_twin(config: PreflightConfig, options: TwinOptions) -> TwinPlan:
    """Scale ``config`` down to a twin case; TwinSizeError when it needs too many ranks."""
    from refgrad.pipeline import LinearStackSpec, StepPlan
    from verify.checks.pipeline import PipelineCase
    from verify.preflight.twin_mxfp8 import twins_mxfp8
    from verify.preflight.twin_precision import precision_for

    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    # CP ranks reduce grads with the DP ranks (the dp_cp group): the twin's DP replicas stand
    # for all of them.
    vpp, config_dp = config.virtual_pipeline_model_parallel_size, config.data_context_parallel_size
    twin_tp = min(tp, MAX_TWIN_TP)
    precision, dp, not_twinned = precision_for(config, twin_tp)
    world = twin_tp * pp * dp
    if world > options.max_world_size:
        capped = f", capped from {tp}" if twin_tp != tp else ""
        dp_capped = f", capped from {config_dp}" if dp != config_dp else ""
        raise TwinSizeError(
            f"the twin needs TP ({twin_tp}{capped}) x PP ({pp}) x DP ({dp}{dp_capped}) = {world} "
            f"ranks, more than --max-world-size ({options.max_world_size}); raise "
            f"--max-world-size or run under torchrun")
    layers = options.layers
    stage_layers, split_left_out = twin_stage_layers(config, layers)
    not_twinned += split_left_out
    # The output layer sits on the last virtual stage (its drain follows the, possibly
    # interleaved, cooldown); its vocabulary, the twin's hidden size, is split over TP.
    from verify.preflight.twin_mxfp8 import BLOCK

    # MXFP8 params: blocks of 32 along each weight's last dimension (and the bias).
    multiple = math.lcm(twin_tp, BLOCK) if twins_mxfp8(config) else twin_tp
    h = options.hidden_size + (-options.hidden_size % multiple)
    sequence_parallel = config.sequence_parallel and twin_tp > 1
    rows = config.micro_batch_size
    if sequence_parallel and rows % twin_tp:
        rows *= twin_tp  # each sample twin_tp tokens long, so the sequence splits over TP
    # At TP 2 the tied first layer is vocab-parallel (refgrad.pipeline_embedding), so each TP
    # rank's embedding and output-layer shards are tied over its own embedding group. At PP 1
    # the two are one weight (LinearStackSpec.shares_one_weight; at TP 2 one shard per TP rank).
    tied = config.tied_embeddings and (pp > 1 or not twins_mxfp8(config))
    if pp == 1 and config.tied_embeddings and not tied:
        not_twinned.append("tied embedding at PP 1 with MXFP8 params: production's embedding and "
                           "output layer are one weight (both grads summed in the backward, no "
                           "all-reduce); the twin's output layer is untied")
    m = _twin_microbatches(config, options)
    spec = LinearStackSpec(num_stages=pp * vpp, layers_per_stage=layers, hidden=h,
                           microbatch_size=rows, seed=config.seed % 100_000,
                           output_head=True, tied_embedding=tied,
                           defer_output_wgrad=config.defer_embedding_wgrad_compute,
                           wgrad_deferral_limit=config.wgrad_deferral_limit,
                           tensor_parallel=twin_tp, sequence_parallel=sequence_parallel,
                           stage_layers=stage_layers)
    stage_numel = spec.layers_on(0) * (h * h + h)
    # Production's rule: only pipeline rank 0's first chunk is bucketed (with overlap);
    # every other chunk is one bucket (a size above its element count, head included).
    one_bucket = 10 * stage_numel
    bucket = max(h * h + h, stage_numel // 3) if config.overlap_grad_reduce else one_bucket
    rs_fp32 = config.ddp_reduce_scatter_with_fp32_accumulation and config.use_distributed_optimizer
    if rs_fp32 and twins_mxfp8(config):
        # fastgrad's MXFP8 buffer reduce-scatters with the backend's own sum order.
        rs_fp32 = False
        not_twinned.append("--ddp-reduce-scatter-with-fp32-accumulation with MXFP8 params: the "
                           "MXFP8 twin's buffer reduce-scatters in the backend's order")
    case = PipelineCase(
        name="twin", pp_size=pp, dp_size=dp, first_rank=0, spec=spec,
        plans=tuple(StepPlan(m) for _ in range(options.steps)),
        use_distributed_optimizer=config.use_distributed_optimizer,
        reduce_scatter_with_fp32_accumulation=rs_fp32,
        reduction="prescale", bucket_size=bucket, bucket_size_elsewhere=one_bucket, lr=TWIN_LR,
        virtual_stages=vpp,
    )
    if dp <= 2:
        bitwise, order_note = True, (f"DP <= 2: a sum of two {precision.grads} values has one "
                                     "rounding in any order")
    elif rs_fp32:
        bitwise, order_note = True, "fp32-accumulating reduce-scatter sums in rank order"
    else:
        bitwise = False
        order_note = (f"DP {dp} > 2: gloo/NCCL choose the order of the {dp}-value sum, so each "
                      f"reduced element may differ from refgrad's rank-order sum by up to "
                      f"(DP-1)u sum|x| (Higham 4.4); later steps carry those differences through "
                      f"the model. Bound: {ulp_bound_factor(dp)} x (step+1) ULP of each tensor's "
                      f"largest magnitude")
    optimizer = "adamw"  # verify.preflight.twin_optim (the SGD twin stays for the pipeline check)
    not_twinned += _left_out(config, m, optimizer)
    from verify.preflight.twin_mxfp8 import mxfp8_twin_for, with_mxfp8_rows
    from verify.preflight.twin_optim import adamw_twin_for
    from verify.preflight.twin_precision import precision_mapping

    adamw, optim_left_out = adamw_twin_for(config, precision)
    not_twinned += optim_left_out
    mxfp8, mxfp8_left_out = mxfp8_twin_for(config, adamw)
    not_twinned += mxfp8_left_out
    mapping = (
        ("TP x PP x VPP x DP", f"{tp} x {pp} x {vpp} x {config.data_parallel_size}"
         + (f" (x CP {config.context_parallel_size})" if config.context_parallel_size > 1 else ""),
         f"{twin_tp} x {pp} x {vpp} x {dp}"),
        *_context_parallel_rows(config, dp),
        ("ranks", str(tp * pp * config_dp), str(world)),
        ("microbatches per step", str(config.num_microbatches), str(m)),
        ("micro batch size (rows)", str(config.micro_batch_size), str(rows)),
        ("tensor parallelism", _tp_layout(tp, config.sequence_parallel),
         _tp_layout(twin_tp, sequence_parallel, twin=True)),
        _layers_row(config, spec, layers),
        ("hidden size", str(config.hidden_size), str(h)),
        ("grad reduction", f"x 1/DP then SUM ({'reduce-scatter' if config.use_distributed_optimizer else 'all-reduce'})",
         f"x 1/DP then SUM ({'reduce-scatter' if config.use_distributed_optimizer else 'all-reduce'}"
         f"{', fp32 rank-order accumulation' if rs_fp32 else ''})"),
        ("overlap grad reduce", str(config.overlap_grad_reduce), str(config.overlap_grad_reduce)),
        ("bucket size", f"{config.first_stage_bucket_size:,} on pipeline rank 0's first chunk, "
         "one bucket elsewhere" if config.overlap_grad_reduce else "one bucket per chunk",
         f"{bucket} elements on stage 0's first chunk, one bucket elsewhere"
         if config.overlap_grad_reduce else "one bucket per chunk"),
        ("output layer", _output_wgrad(config), _output_wgrad(config)),
        ("tied embedding all-reduce", _production_tie(config),
         _tied_layout(config, twin_tp, tied)),
        ("optimizer", "distributed optimizer" if config.use_distributed_optimizer
         else "fp32 masters of every param (no distributed optimizer)",
         "fastgrad.optim AdamW (lr 1e-2), " + ("DistributedOptimizer" if config.use_distributed_optimizer
                                              else "ReplicatedOptimizer")),
        *_optimizer_rows(config, adamw),
        *precision_mapping(config, precision),
        ("steps", "-", str(options.steps)),
    )
    mapping = with_mxfp8_rows(mapping, config, mxfp8, vpp)
    return TwinPlan(case=case, overlap=config.overlap_grad_reduce, world_size=world,
                    bitwise=bitwise, order_note=order_note, mapping=mapping,
                    not_twinned=tuple(not_twinned), optimizer=optimizer, adamw=adamw, mxfp8=mxfp8)


def twin_stage_layers(config: PreflightConfig, layers: int) -> tuple[tuple[int, ...], list[str]]:
    """The twin's layers per virtual stage (``()``: ``layers`` on each), and what it leaves out.

    An even split gives every virtual stage ``layers``. An uneven one (uneven first/last
    stages, the embedding or loss counted as a layer) gives virtual stage ``v`` (chunk x PP +
    stage) ``layers`` plus its surplus over production's lightest virtual stage, at most
    ``MAX_EXTRA_TWIN_LAYERS``: the twin's stages differ as production's do, so each stage's
    buffer, buckets and padding differ too."""
    pp = config.pipeline_model_parallel_size
    split = config.layer_split.layers
    counts = [split[v % pp][v // pp] for v in range(pp * config.virtual_pipeline_model_parallel_size)]
    if len(set(counts)) == 1:
        return (), []
    lightest = min(counts)
    twin = tuple(layers + min(c - lightest, MAX_EXTRA_TWIN_LAYERS) for c in counts)
    left_out = []
    if any(c - lightest > MAX_EXTRA_TWIN_LAYERS for c in counts):
        left_out.append(f"the uneven split's full differences: production's layers per virtual "
                        f"stage {counts}, the twin's {list(twin)} (each surplus over the lightest "
                        f"stage capped at {MAX_EXTRA_TWIN_LAYERS})")
    if 0 in counts:
        left_out.append("a virtual stage with no transformer layer (the embedding or loss alone): "
                        f"the twin's has {layers} Linear+tanh layer(s)")
    return twin, left_out


def _layers_row(config: PreflightConfig, spec: Any, layers: int) -> tuple[str, str, str]:
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    if not spec.stage_layers:
        return ("layers", str(config.num_layers), f"{layers} per virtual stage = {layers * pp * vpp}")
    split = config.layer_split.layers
    production = [split[v % pp][v // pp] for v in range(pp * vpp)]
    return ("layers per virtual stage", f"{production} (= {config.num_layers})",
            f"{list(spec.stage_layers)} (= {sum(spec.stage_layers)})")


def _context_parallel_rows(config: PreflightConfig, dp: int) -> tuple[tuple[str, str, str], ...]:
    """How the twin maps context parallelism (no rows without it)."""
    cp = config.context_parallel_size
    if cp == 1:
        return ()
    group = config.data_context_parallel_size
    return (("context parallelism",
             f"CP {cp}: each sample's sequence split over {cp} ranks; grads x 1/{group} then "
             f"summed over DP x CP = {group} ranks (the dp_cp group)",
             f"no sequence split: {dp} DP replicas, each with its own rows, stand for the "
             f"dp_cp group (x 1/{dp} then SUM)"),)


def _optimizer_rows(config: PreflightConfig, adamw: Any) -> tuple[tuple[str, str, str], ...]:
    """Mapping rows for clipping, loss scaling and the param all-gather."""
    from verify.preflight.twin_optim import optimizer_mapping

    return optimizer_mapping(config, adamw)


def _tp_layout(tp: int, sequence_parallel: bool, twin: bool = False) -> str:
    """How the model is split over TP: production's or the twin's."""
    if tp == 1:
        return "none"
    if not twin:
        return f"TP {tp}{', sequence parallel' if sequence_parallel else ''}"
    if sequence_parallel:
        return (f"TP {tp}: vocab-parallel output layer (input all-gathered, dgrad "
                "reduce-scattered); blocks replicated on sequence shards, grads all-reduced over TP")
    return (f"TP {tp}: vocab-parallel output layer (dgrad all-reduced); blocks replicated "
            "(identical on every TP rank)")


def _production_tie(config: PreflightConfig) -> str:
    """Production's tie: the all-reduce (PP > 1), one shared weight (PP 1), or none."""
    if not config.tied_embeddings:
        return "False"
    if config.pipeline_model_parallel_size == 1:
        return "one shared weight (PP 1: no all-reduce)"
    return "True"


def _tied_layout(config: PreflightConfig, twin_tp: int, tied: bool) -> str:
    """The twin's tied embedding: off, one shared weight (PP 1), at TP 1, or vocab-parallel."""
    if not tied:
        return "False"
    if config.pipeline_model_parallel_size == 1:
        shard = (" (TP 2: each TP rank's vocab-parallel first-layer shard is its output-layer "
                 "shard)" if twin_tp > 1 else "")
        return ("one shared weight (PP 1)" + shard + ": the output layer's wgrad, then the first "
                "layer's grad, added into its main_grad per microbatch; counted once in the "
                "grad norm")
    if twin_tp == 1:
        return "True"
    how = ("partial products reduce-scattered along the sequence" if config.sequence_parallel
           else "partial products all-reduced over TP")
    return (f"True: vocab-parallel first layer ({how}), each TP rank's shard tied to its "
            "output-layer shard over its own embedding group")


def _output_wgrad(config: PreflightConfig) -> str:
    """How the output layer's wgrad is accumulated (the same in production and the twin)."""
    if not config.defer_embedding_wgrad_compute:
        return "wgrad in the backward"
    limit = config.wgrad_deferral_limit
    return ("deferred wgrad, drained after the cooldown" if limit == 0 else
            f"first {limit} microbatches' wgrad deferred to the drain, the rest in the backward")


def _left_out(config: PreflightConfig, m: int, optimizer: str) -> list[str]:
    """Every part of the configuration the twin does not reproduce, with the reason."""
    out = []
    tp = config.tensor_model_parallel_size
    if config.context_parallel_size > 1:
        cp, group = config.context_parallel_size, config.data_context_parallel_size
        out.append(f"context parallelism CP {cp} scaled away: the twin splits no sequence and "
                   f"exchanges no attention keys/values over CP; its DP replicas stand for the "
                   f"DP x CP = {group} ranks that reduce production's grads")
    if tp > MAX_TWIN_TP:
        out.append(f"tensor parallelism TP {tp} scaled to TP {MAX_TWIN_TP}: a sum over more than "
                   "two TP ranks has a backend-chosen order (the collectives are the same)")
    shared_at_pp1 = config.tied_embeddings and config.pipeline_model_parallel_size == 1
    if not config.gradient_accumulation_fusion and (config.params_dtype != "fp32" or shared_at_pp1):
        # fp32 params, untied: the fused and the unfused add give the same bits.
        out.append("--no-gradient-accumulation-fusion on the output layer: production rounds each "
                   "microbatch's wgrad to the param dtype and adds it through param.grad (at PP 1 "
                   "summed first with the tied first layer's grad); the twin's output layer "
                   "accumulates fused, straight into main_grad")
    group = config.microbatch_group_size_per_vp_stage
    if group is not None and group != config.pipeline_model_parallel_size:
        out.append(f"--microbatch-group-size-per-virtual-pipeline-stage {group}: the twin's "
                   "interleaved schedule runs each virtual stage for PP microbatches in a row")
    if m != config.num_microbatches:
        out.append(f"microbatch count: {config.num_microbatches} capped to {m} "
                   "(--twin-max-microbatches; the schedule's steady state is the same)")
    if config.ddp_pad_buckets_for_high_nccl_busbw:
        out.append("--ddp-pad-buckets-for-high-nccl-busbw: padding is laid out on paper only")
    from verify.preflight.twin_mxfp8 import twins_mxfp8

    # MXFP8 params (--fp8-recipe mxfp8 --fp8-param-gather) are twinned: verify.preflight.twin_mxfp8.
    if (config.fp8_recipe or config.fp8_param_gather) and not twins_mxfp8(config):
        out.append(f"FP8 ({config.fp8_recipe or config.fp8_format}) "
                   f"{'params' if config.fp8_param_gather else 'compute'}: the twin reproduces "
                   "only --fp8-recipe mxfp8 with --fp8-param-gather; checked by "
                   "`verify run --check mxfp8`")
        if config.reuse_grad_buf_for_mxfp8_param_ag:
            out.append("grad-buffer reuse for the MXFP8 param all-gather: see the hazards")
    out.append("transformer blocks (attention, MLP, norms, embeddings) are Linear+tanh layers")
    return out
