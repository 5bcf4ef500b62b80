"""The scaled twin's plan: the user's layout scaled down to a case a candidate trains.

:func:`plan_twin` maps a :class:`PreflightConfig` onto a
:class:`verify.candidates.interfaces.PipelineCase`: the same TP x PP x VPP x DP grid (TP
capped at 2: a vocab-parallel output layer, Linear+tanh blocks replicated, on sequence
shards under sequence parallelism) and microbatch count (capped), production's bucket rule,
the same reduction (Megatron's default 1/DP pre-scaling before a SUM), the same collective
(reduce-scatter with the distributed optimizer, all-reduce without), fp32-accumulating
reduce-scatter, overlap on or off, the deferred output-layer wgrad and the tied-embedding
all-reduce (at TP 2 each TP rank's vocab-parallel first-layer shard tied to its output-layer
shard; at PP 1 one weight shared by the first layer and the output layer, as production's),
with ``--twin-hidden-size`` wide Linear+tanh layers in place of transformer blocks, trained
by AdamW (:class:`verify.preflight.twin.variants.AdamWTwin`: clipping, loss scaling, the
param all-gather, 16-bit params) or, with ``--fp8-recipe mxfp8 --fp8-param-gather``, AdamW
over MXFP8 params (:class:`~verify.preflight.twin.variants.MXFP8Twin`). Everything the twin
does not reproduce is listed in ``not_twinned``, with the reason; a part the candidate
cannot build here (:class:`verify.candidates.interfaces.ModelSupport`) is scaled away or
replaced and listed, naming the candidate.

:func:`verify.preflight.twin.stage.run_twin_stage` trains it on real ranks (spawned gloo
processes, or the torchrun group) and :func:`verify.preflight.twin.compare.compare_steps`
holds every step's losses, reduced gradients and updated parameters against refgrad's
single-process model: bitwise where the reduction order is fixed, else within a stated bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gradvocab import Averaging
from refgrad.pipeline import LinearStackSpec, StepPlan
from verify.candidates.interfaces import ModelSupport, PipelineCase
from verify.preflight.config import PreflightConfig
from verify.preflight.twin.adamw import adamw_twin_for, fp16_overflow_step, optimizer_mapping
from verify.preflight.twin.bounds import ulp_bound_factor
from verify.preflight.twin.mapping import (
    MAX_TWIN_TP,
    context_parallel_rows,
    hybrid_rows,
    label_ddp_rows,
    layers_row,
    left_out,
    moe_rows,
    output_wgrad,
    production_optimizer,
    production_tie,
    tied_layout,
    tp_layout,
)
from verify.preflight.twin.mxfp8 import BLOCK, mxfp8_twin_for, with_mxfp8_rows
from verify.preflight.twin.precision import precision_for, precision_mapping
from verify.preflight.twin.variants import TwinTraining, twins_mxfp8

TWIN_LR = 0.05  # the SGD twin's (the pipeline check's) learning rate
# An uneven split: the twin keeps each virtual stage's surplus over the lightest one, up to this.
MAX_EXTRA_TWIN_LAYERS = 3


FULL_SUPPORT = ModelSupport()  # a candidate that builds every part of the twin (fastgrad)


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
    """The case the twin runs, how it trains, how it maps the configuration, and what it
    leaves out."""

    case: PipelineCase
    overlap: bool
    world_size: int
    bitwise: bool
    order_note: str
    mapping: tuple[tuple[str, str, str], ...]  # (setting, production, twin)
    not_twinned: tuple[str, ...]
    training: TwinTraining


@dataclass(frozen=True)
class _Limits:
    """What the twin may build for a candidate: the TP cap, MXFP8 params, one weight shared
    by the first and output layer at PP 1, the replicated optimizer; and why not."""

    max_tp: int
    mxfp8: bool
    shared_weight_at_pp1: bool
    replicated_optimizer: bool
    notes: tuple[str, ...]

    @classmethod
    def of(cls, config: PreflightConfig, support: ModelSupport, candidate: str) -> _Limits:
        notes = []
        tp = min(config.tensor_model_parallel_size, MAX_TWIN_TP)
        if support.tensor_parallel is not None and tp > 1:
            notes.append(f"tensor parallelism TP {tp} scaled to TP 1 for {candidate}: "
                         f"{support.tensor_parallel}")
            tp = 1
        mxfp8 = twins_mxfp8(config)
        if support.mxfp8_params is not None and mxfp8:
            notes.append(f"MXFP8 params (--fp8-recipe mxfp8 --fp8-param-gather) for {candidate}: "
                         f"{support.mxfp8_params}; its twin trains the configuration's "
                         f"{config.params_dtype} params instead")
            mxfp8 = False
        shared = True
        if (support.shared_weight_at_pp1 is not None and config.tied_embeddings
                and config.pipeline_model_parallel_size == 1):
            notes.append(f"tied embedding at PP 1 (one weight for the embedding and the output "
                         f"layer) for {candidate}: {support.shared_weight_at_pp1}; its twin's "
                         "output layer is untied")
            shared = False
        replicated = True
        if support.replicated_optimizer is not None and not config.use_distributed_optimizer:
            notes.append(f"the replicated optimizer (no --use-distributed-optimizer) for "
                         f"{candidate}: {support.replicated_optimizer}; its twin runs the "
                         "distributed optimizer")
            replicated = False
        return cls(tp, mxfp8, shared, replicated, tuple(notes))


def _twin_microbatches(config: PreflightConfig, options: TwinOptions) -> int:
    m, pp = config.num_microbatches, config.pipeline_model_parallel_size
    m = min(m, options.max_microbatches)
    if config.virtual_pipeline_model_parallel_size > 1:  # a multiple of PP, >= PP
        m = max(pp, m - m % pp)
    return m


def plan_twin(config: PreflightConfig, options: TwinOptions, support: ModelSupport = FULL_SUPPORT,
              candidate: str = "the candidate") -> TwinPlan:
    """Scale ``config`` down to a twin case that ``candidate`` can build (``support``: what
    it cannot, with why); TwinSizeError when it needs too many ranks."""
    limits = _Limits.of(config, support, candidate)
    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    # CP ranks reduce grads with the DP ranks (the dp_cp group): the twin's DP replicas stand
    # for all of them.
    vpp, config_dp = config.virtual_pipeline_model_parallel_size, config.data_context_parallel_size
    twin_tp = limits.max_tp
    precision, dp, not_twinned = precision_for(config, twin_tp, mxfp8=limits.mxfp8)
    not_twinned = list(limits.notes) + not_twinned
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
    # MXFP8 params: blocks of 32 along each weight's last dimension (and the bias).
    multiple = math.lcm(twin_tp, BLOCK) if limits.mxfp8 else twin_tp
    h = options.hidden_size + (-options.hidden_size % multiple)
    sequence_parallel = config.sequence_parallel and twin_tp > 1
    rows = config.micro_batch_size
    if sequence_parallel and rows % twin_tp:
        rows *= twin_tp  # each sample twin_tp tokens long, so the sequence splits over TP
    # At TP 2 the tied first layer is vocab-parallel (refgrad.pipeline.embedding), so each TP
    # rank's embedding and output-layer shards are tied over its own embedding group. At PP 1
    # the two are one weight (LinearStackSpec.shares_one_weight; at TP 2 one shard per TP rank).
    tied = config.tied_embeddings and (pp > 1 or (not limits.mxfp8 and limits.shared_weight_at_pp1))
    if pp == 1 and config.tied_embeddings and not tied and limits.mxfp8:
        not_twinned.append("tied embedding at PP 1 with MXFP8 params: production's embedding and "
                           "output layer are one weight (both grads summed in the backward, no "
                           "all-reduce); the twin's output layer is untied")
    m = _twin_microbatches(config, options)
    adamw, optim_left_out = adamw_twin_for(config, precision)
    overflow_step, overflow_left_out = fp16_overflow_step(adamw, options.steps)
    spec = LinearStackSpec(num_stages=pp * vpp, layers_per_stage=layers, hidden=h,
                           microbatch_size=rows, seed=config.seed % 100_000,
                           output_head=True, tied_embedding=tied,
                           defer_output_wgrad=config.defer_embedding_wgrad_compute,
                           wgrad_deferral_limit=config.wgrad_deferral_limit,
                           tensor_parallel=twin_tp, sequence_parallel=sequence_parallel,
                           stage_layers=stage_layers, overflow_step=overflow_step)
    stage_numel = spec.layers_on(0) * (h * h + h)
    # Production's rule: only pipeline rank 0's first chunk is bucketed (with overlap);
    # every other chunk is one bucket (a size above its element count, head included).
    one_bucket = 10 * stage_numel
    bucket = max(h * h + h, stage_numel // 3) if config.overlap_grad_reduce else one_bucket
    rs_fp32 = config.ddp_reduce_scatter_with_fp32_accumulation and config.use_distributed_optimizer
    if rs_fp32 and limits.mxfp8:
        # fastgrad's MXFP8 buffer reduce-scatters with the backend's own sum order.
        rs_fp32 = False
        not_twinned.append("--ddp-reduce-scatter-with-fp32-accumulation with MXFP8 params: the "
                           "MXFP8 twin's buffer reduce-scatters in the backend's order")
    case = PipelineCase(
        # the configuration's grid, scaled: TP capped, CP folded into the DP replicas
        name="twin", dims=replace(config.dims, tp_size=twin_tp, cp_size=1, dp_size=dp,
                                  sequence_parallel=sequence_parallel), spec=spec,
        plans=tuple(StepPlan(m) for _ in range(options.steps)),
        use_distributed_optimizer=config.use_distributed_optimizer or not limits.replicated_optimizer,
        reduce_scatter_with_fp32_accumulation=rs_fp32,
        reduction=Averaging.PRESCALE, bucket_size=bucket, bucket_size_elsewhere=one_bucket, lr=TWIN_LR,
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
    not_twinned += left_out(config, m)
    not_twinned += optim_left_out + overflow_left_out
    mxfp8, mxfp8_left_out = mxfp8_twin_for(config, adamw) if limits.mxfp8 else (None, [])
    not_twinned += mxfp8_left_out
    mapping = (
        ("TP x PP x VPP x DP", f"{tp} x {pp} x {vpp} x {config.data_parallel_size}"
         + (f" (x CP {config.context_parallel_size})" if config.context_parallel_size > 1 else ""),
         f"{twin_tp} x {pp} x {vpp} x {dp}"),
        *context_parallel_rows(config, dp),
        ("ranks", str(tp * pp * config_dp), str(world)),
        ("microbatches per step", str(config.num_microbatches), str(m)),
        ("micro batch size (rows)", str(config.micro_batch_size), str(rows)),
        ("tensor parallelism", tp_layout(tp, config.sequence_parallel),
         tp_layout(twin_tp, sequence_parallel, twin=True)),
        layers_row(config, spec, layers),
        *moe_rows(config),
        *hybrid_rows(config),
        ("hidden size", str(config.hidden_size), str(h)),
        ("grad reduction", f"x 1/DP then SUM ({'reduce-scatter' if config.use_distributed_optimizer else 'all-reduce'})",
         f"x 1/DP then SUM ({'reduce-scatter' if config.use_distributed_optimizer else 'all-reduce'}"
         f"{', fp32 rank-order accumulation' if rs_fp32 else ''})"),
        ("overlap grad reduce", str(config.overlap_grad_reduce), str(config.overlap_grad_reduce)),
        ("bucket size", f"{config.first_stage_bucket_size:,} on pipeline rank 0's first chunk, "
         "one bucket elsewhere" if config.overlap_grad_reduce else "one bucket per chunk",
         f"{bucket} elements on stage 0's first chunk, one bucket elsewhere"
         if config.overlap_grad_reduce else "one bucket per chunk"),
        ("output layer", output_wgrad(config), output_wgrad(config)),
        ("tied embedding all-reduce", production_tie(config),
         tied_layout(config, twin_tp, tied)),
        ("optimizer", production_optimizer(config),
         f"{candidate}'s AdamW (lr scheduled), " + ("distributed optimizer" if case.use_distributed_optimizer
                                              else "replicated optimizer")),
        *optimizer_mapping(config, adamw, overflow_step),
        *precision_mapping(config, precision),
        ("steps", "-", str(options.steps)),
    )
    mapping = label_ddp_rows(with_mxfp8_rows(mapping, config, mxfp8, vpp), config)
    return TwinPlan(case=case, overlap=config.overlap_grad_reduce, world_size=world,
                    bitwise=bitwise, order_note=order_note, mapping=mapping,
                    not_twinned=tuple(not_twinned), training=mxfp8 if mxfp8 is not None else adamw)


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
