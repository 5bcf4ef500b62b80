"""The twin's mapping of a configuration: the (setting, production, twin) rows and the parts
it does not reproduce (``not_twinned``), each with the reason."""

from __future__ import annotations

from refgrad.pipeline import LinearStackSpec
from verify.preflight.config import PreflightConfig
from verify.preflight.twin.variants import twins_mxfp8

MOE_NOT_TWINNED = ("mixture-of-experts layers (the experts, the router and the "
                   "expert-data-parallel reduction are laid out on paper only)")
HYBRID_NOT_TWINNED = ("Mamba mixers of the hybrid pattern (the selective scan, conv1d, dt_bias, "
                      "A_log, D and the gated norm: their params and buffers are laid out on paper "
                      "only)")
SGD_NOT_TWINNED = ("the SGD step (--optimizer sgd): the twin steps AdamW; its gradients and "
                   "their reduction are SGD's, the update and its momentum buffer are not checked")


def sharded_not_twinned(config: PreflightConfig) -> str | None:
    """Why the twin does not check the launch's fully-sharded data-parallel path (None under
    Megatron-Core's DDP): the twin's ranks reduce through a DDP-style bucketed buffer."""
    sharded = config.sharded_dp
    if sharded is None:
        return None
    if config.torch_fsdp2:
        return ("torch FSDP2 (--use-torch-fsdp2): the twin reduces its grads through a bucketed "
                "DDP buffer, not torch's fully_shard reduce-scatter and all-gathers; the "
                "torch-fsdp2 candidate cannot train a twin (no pipeline training wired), and "
                "`verify run --candidate torch-fsdp2` checks fully_shard's gradients on its own "
                "cases, not this launch's")
    return (f"{sharded.label} (--use-megatron-fsdp): the twin reduces its grads through "
            "Megatron-Core's DDP buffer; Megatron-FSDP's sharded buffers, per-microbatch "
            "reduce-scatter and param all-gathers are laid out on paper only")


# The mapping rows whose production column describes Megatron-Core DDP's collectives.
DDP_COLLECTIVE_ROWS = ("grad reduction", "param all-gather")
DDP_FOR_COMPARISON = "DDP's, for comparison; the launch's own are in the fully-sharded table"


def label_ddp_rows(mapping: tuple[tuple[str, str, str], ...], config: PreflightConfig,
                   ) -> tuple[tuple[str, str, str], ...]:
    """Under Megatron-FSDP or torch FSDP2, mark the production column of the rows that
    describe DDP's collectives as DDP's (the launch's own are on paper, in the fully-sharded
    table); ``mapping`` unchanged under DDP."""
    if config.sharded_dp is None:
        return mapping
    return tuple((setting, f"{production} ({DDP_FOR_COMPARISON})", twin)
                 if setting in DDP_COLLECTIVE_ROWS else (setting, production, twin)
                 for setting, production, twin in mapping)


# TP sums of two fp32 values are one rounding in any order: bitwise. Larger TP is scaled to 2.
MAX_TWIN_TP = 2


def layers_row(config: PreflightConfig, spec: LinearStackSpec, layers: int) -> tuple[str, str, str]:
    pp, vpp = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
    if not spec.stage_layers:
        return ("layers", str(config.num_layers), f"{layers} per virtual stage = {layers * pp * vpp}")
    split = config.layer_split.layers
    production = [split[v % pp][v // pp] for v in range(pp * vpp)]
    return ("layers per virtual stage", f"{production} (= {config.num_layers})",
            f"{list(spec.stage_layers)} (= {sum(spec.stage_layers)})")


def context_parallel_rows(config: PreflightConfig, dp: int) -> tuple[tuple[str, str, str], ...]:
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


def moe_rows(config: PreflightConfig) -> tuple[tuple[str, str, str], ...]:
    """How the twin maps a mixture of experts (no rows without one): not at all."""
    moe = config.moe
    if moe is None:
        return ()
    count = sum(moe.moe_layers(config.num_layers))
    where = (f"expert grads {config.expert_grad_averaging}" if config.expert_buffers
             else "the experts' grads in the dense buffers (EP 1, ETP = TP)")
    return (("mixture of experts",
             f"{moe.num_experts} experts (top-{moe.moe_router_topk}) in {count} of "
             f"{config.num_layers} layers, EP {moe.expert_model_parallel_size}, ETP "
             f"{moe.expert_tensor_parallel_size}; {where}",
             "none: each MoE layer's FFN trained as a dense block of the twin (not twinned; the "
             "expert path is laid out on paper only)"),)


def hybrid_rows(config: PreflightConfig) -> tuple[tuple[str, str, str], ...]:
    """How the twin maps a hybrid Mamba pattern (no rows without one): each layer, whatever
    its kind, is one of the twin's blocks; nothing of a Mamba mixer runs."""
    hybrid = config.hybrid
    if hybrid is None:
        return ()
    types = hybrid.layer_types
    return (("hybrid layers",
             f"{hybrid.pattern!r}: {types.count('M')} Mamba, {types.count('*')} attention, "
             f"{types.count('-')} MLP layers",
             "each layer one dense block of the twin (the Mamba mixers not twinned: laid out "
             "on paper only)"),)


def production_optimizer(config: PreflightConfig) -> str:
    """The optimizer row's production column: the optimizer and where its masters live."""
    where = ("distributed optimizer" if config.use_distributed_optimizer
             else "fp32 masters of every param (no distributed optimizer)")
    choice = config.optimizer
    if choice.name != "sgd":
        return where
    return (f"SGD (momentum {choice.sgd_momentum:g}, weight decay {choice.weight_decay:g}, "
            f"lr {choice.lr:g}), {where}")


def tp_layout(tp: int, sequence_parallel: bool, twin: bool = False) -> str:
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


def production_tie(config: PreflightConfig) -> str:
    """Production's tie: the all-reduce (PP > 1), one shared weight (PP 1), or none."""
    if not config.tied_embeddings and config.word_embedding_all_reduce:
        return ("untied, but MTP all-reduces the word embeddings' grads between the first "
                "stage and the last stage's copy")
    if not config.tied_embeddings:
        return "False"
    if config.pipeline_model_parallel_size == 1:
        return "one shared weight (PP 1: no all-reduce)"
    return "True"


def tied_layout(config: PreflightConfig, twin_tp: int, tied: bool) -> str:
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


def output_wgrad(config: PreflightConfig) -> str:
    """How the output layer's wgrad is accumulated (the same in production and the twin)."""
    if not config.defer_embedding_wgrad_compute:
        return "wgrad in the backward"
    limit = config.wgrad_deferral_limit
    return ("deferred wgrad, drained after the cooldown" if limit == 0 else
            f"first {limit} microbatches' wgrad deferred to the drain, the rest in the backward")


def left_out(config: PreflightConfig, m: int) -> list[str]:
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
    if config.calculate_per_token_loss and config.torch_fsdp2:
        # TorchFullyShardedDataParallel keeps the base class's no-op scale_gradients
        # (data_parallel_base.py:45), so finalize_model_grads' 1/T never reaches the grads.
        out.append("--calculate-per-token-loss under torch FSDP2: production sums each token's "
                   "loss and fully_shard averages the grads over DP x CP (ReduceOp.AVG), but the "
                   "1/T of finalize_model_grads (T: the global batch's loss-mask tokens) is not "
                   "applied (Megatron-Core finding 8): its grads are the DP x CP average of "
                   "per-rank token sums, T/(DP x CP) times the per-token mean; the twin averages "
                   "as without it (x 1/DP before the SUM) and so does not reproduce that gradient")
    elif config.calculate_per_token_loss:
        out.append("--calculate-per-token-loss: production sums each token's loss, reduces the "
                   "grads unscaled over DP x CP and multiplies them by 1/T (the global batch's "
                   "loss-mask tokens) after the reduction; the twin averages as without it (x 1/DP "
                   "before the SUM): the same gradient up to rounding when every token counts. "
                   "The averaging's rounding is decided on paper (hazards)")
    if config.ddp_average_in_collective:
        out.append("--ddp-average-in-collective: production reduces with ReduceOp.AVG (NCCL "
                   "multiplies each grad by 1/N rounded to the wire dtype, then sums); the twin "
                   "pre-scales by 1/DP and sums (gloo has no ReduceOp.AVG). The factor's bias and "
                   "the fp32-accumulating reduce-scatter's assert are decided on paper (hazards)")
    if config.ddp_pad_buckets_for_high_nccl_busbw:
        out.append("--ddp-pad-buckets-for-high-nccl-busbw: padding is laid out on paper only")
    # MXFP8 params (--fp8-recipe mxfp8 --fp8-param-gather) are twinned where ``mxfp8``
    # (verify.preflight.twin.mxfp8); a candidate that cannot build them has its reason listed.
    if (config.fp8_recipe or config.fp8_param_gather) and not twins_mxfp8(config):
        out.append(f"FP8 ({config.fp8_recipe or config.fp8_format}) "
                   f"{'params' if config.fp8_param_gather else 'compute'}: the twin reproduces "
                   "only --fp8-recipe mxfp8 with --fp8-param-gather; checked by "
                   "`verify run --check mxfp8`")
        if config.reuse_grad_buf_for_mxfp8_param_ag:
            out.append("grad-buffer reuse for the MXFP8 param all-gather: see the hazards")
    if config.moe is not None:
        # The twin's blocks stand for each MoE layer's FFN as for a dense MLP of its shape:
        # nothing of the expert path (routing, expert parallelism, the expert buffers and
        # their reduction over expert DP) runs in it.
        out.append(MOE_NOT_TWINNED)
    if config.hybrid is not None and config.hybrid.builds("M"):
        # The twin's blocks stand for each Mamba layer as for any other: the mixer's scan,
        # its convolution and its sharded 1-D params run nowhere in it.
        out.append(HYBRID_NOT_TWINNED)
    if config.optimizer.name == "sgd":
        out.append(SGD_NOT_TWINNED)
    sharded = sharded_not_twinned(config)
    if sharded is not None:
        out.append(sharded)
    if config.qk_norm_params:
        reduce = (" and the TP all-reduce of their grads are" if config.tensor_model_parallel_size > 1
                  else " are")
        out.append(f"--qk-layernorm: the q/k layernorm params of every attention layer{reduce} "
                   "laid out on paper only (the twin's blocks have no attention)")
    if config.mtp is not None and config.pipeline_model_parallel_size > 1:
        tie = ("its all-reduce stands for production's between the first stage's embedding and "
               "the last stage's copy, but no MTP gradient reaches it" if config.tied_embeddings
               else "the twin is untied and all-reduces no embedding, where production "
               "all-reduces the word embeddings' grads between the first and last stage")
        out.append(f"--mtp-num-layers {config.mtp.mtp_num_layers}: the MTP layers, their loss and "
                   f"the last stage's word-embedding copy are laid out on paper only; {tie}")
    elif config.mtp is not None:
        # PP 1: the one stage builds the one word embedding its MTP layers read (gpt_model.py
        # :167), and its one-rank embedding group skips the all-reduce (finalize_model_grads.py
        # :229, core_r0.19.0): no copy, no all-reduce to name.
        out.append(f"--mtp-num-layers {config.mtp.mtp_num_layers}: the MTP layers and their "
                   "loss are laid out on paper only")
    out.append("transformer blocks (attention, MLP, norms, embeddings) are Linear+tanh layers")
    return out
