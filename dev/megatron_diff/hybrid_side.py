"""Megatron-LM's answer for a hybrid (Mamba) launch: what ``HybridModel`` would build.

Used by ``megatron_side.py`` when the launch gives ``--hybrid-layer-pattern`` (validate_args
has already derived the layers and the virtual pipeline size from it):

- ``split``: Megatron-Core's own ``select_pipeline_segment``
  (megatron/core/models/hybrid/hybrid_layer_allocation.py) for every (pipeline rank, virtual
  stage), on stand-in process groups that know only their rank and size (``HybridModel``
  calls it with the pipeline group);
- ``divide_like_the_model``: the TP ``divide()``s of the modules the pattern builds (the
  attention layer's and the MLP layer's only where it has ``*`` / ``-``, the vocabulary
  always) and ``MambaMixer.__init__``'s asserts, verbatim (mamba_mixer.py:239-272; the
  mixer needs mamba_ssm and a GPU to be built);
- ``layouts``: each chunk's dense buffer laid out by Megatron-Core's own
  ``DistributedOptimizer.compute_full_param_layout`` on meta tensors, in ``named_parameters``
  order, their shapes restated from hybrid_model.py (embedding, decoder, output layer),
  hybrid_block.py (``final_norm``), hybrid_layer_specs.py (Transformer Engine modules: the
  norms fused into in_proj / linear_qkv / linear_fc1), mamba_mixer.py:279-430 and
  attention.py / mlp.py, on Megatron's TransformerConfig.
"""

from __future__ import annotations

import contextlib


class _Group:
    """A process group that only knows this rank's place in it."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank_in, self.size_of = rank, size


@contextlib.contextmanager
def _stand_in_groups():
    """torch.distributed's rank/size queries answered by ``_Group``; the allocation's logging
    (which asks torch.distributed for more) silenced."""
    import torch.distributed as dist
    from megatron.core.models.hybrid import hybrid_layer_allocation as allocation

    saved = (dist.get_rank, dist.get_world_size, allocation.log_on_each_pipeline_stage,
             allocation.log_single_rank)
    dist.get_rank = lambda group=None: group.rank_in
    dist.get_world_size = lambda group=None: group.size_of
    allocation.log_on_each_pipeline_stage = allocation.log_single_rank = lambda *a, **k: None
    try:
        yield allocation
    finally:
        (dist.get_rank, dist.get_world_size, allocation.log_on_each_pipeline_stage,
         allocation.log_single_rank) = saved


def split(config, args, pp: int, vpp: int | None) -> tuple[list, list, list]:
    """(layers, first layer index, layer symbols) of every (pipeline rank, virtual stage)."""
    with _stand_in_groups() as allocation:
        main = allocation.parse_hybrid_pattern(args.hybrid_layer_pattern).main_pattern or ""
        layers, offsets, kinds = [], [], []
        for pp_rank in range(pp):
            row_layers, row_offsets, row_kinds = [], [], []
            for chunk in range(vpp or 1):
                types, offset = allocation.select_pipeline_segment(
                    main, _Group(pp_rank, pp), chunk if vpp is not None else None,
                    first_stage_layers=config.num_layers_in_first_pipeline_stage,
                    last_stage_layers=config.num_layers_in_last_pipeline_stage)
                row_layers.append(len(types))
                row_offsets.append(offset)
                row_kinds.append("".join(types))
            layers.append(row_layers)
            offsets.append(row_offsets)
            kinds.append(row_kinds)
    return layers, offsets, kinds


def _mamba_sizes(config, tp_size: int) -> dict:
    """mamba_mixer.py:211-272 MambaMixer.__init__, verbatim on the config (d_model = hidden,
    expand = 2, the hybrid spec's defaults); its asserts raise as the mixer's do."""
    d_model, expand = config.hidden_size, 2
    d_inner = int(expand * d_model)
    d_state = config.mamba_state_dim
    headdim = config.mamba_head_dim
    ngroups = config.mamba_num_groups
    assert d_state is not None and d_state > 0
    assert headdim is not None and headdim > 0
    assert ngroups is not None and ngroups > 0
    if config.mamba_num_heads is not None:
        nheads = config.mamba_num_heads
        assert nheads > 0
        d_inner = nheads * headdim
    else:
        assert d_inner % headdim == 0, "d_inner must be evenly divisible by headdim"
        nheads = d_inner // headdim
    if config.fp8:
        assert (2 * d_inner + 2 * ngroups * d_state + nheads) % 16 == 0, (
            "For FP8, the innermost dimension of the Mamba layer "
            "input projection output tensor must be a multiple of 16.")
    assert nheads % tp_size == 0, "nheads must be evenly divisble by tp_size"
    assert ngroups % tp_size == 0, "ngroups must be evenly divisible by tp_size"
    assert nheads % ngroups == 0, "nheads must be evenly divisible by ngroups"
    return {"d_inner": d_inner, "nheads": nheads, "ngroups": ngroups, "d_state": d_state}


def divide_like_the_model(config, args, divide, kinds: list) -> None:
    """The TP divides and asserts of the layers the pattern builds (module docstring)."""
    tp = config.tensor_model_parallel_size
    built = set("".join("".join(row) for row in kinds))
    if args.padded_vocab_size is not None:
        divide(args.padded_vocab_size, tp)  # VocabParallelEmbedding and the output layer
    if "M" in built:
        _mamba_sizes(config, tp)
    if "*" in built:
        if args.transformer_impl == "transformer_engine":
            assert config.num_attention_heads % config.num_query_groups == 0, (
                "The number of attention heads must be divisible by the number of GQA groups!")
        q = config.kv_channels * config.num_attention_heads
        kv = config.kv_channels * config.num_query_groups
        divide(q, config.num_attention_heads)
        if config.num_query_groups < tp:
            divide(config.num_attention_heads, config.num_query_groups)
        else:
            divide(config.num_query_groups, tp)
            divide(config.num_attention_heads, tp)
        divide(q + 2 * kv, tp)
        divide(q, tp)
    if "-" in built:
        ffn = config.ffn_hidden_size
        divide(ffn * (2 if config.gated_linear_unit else 1), tp)
        divide(ffn, tp)


def _layer_shapes(config, symbol: str, tp: int) -> list[tuple]:
    """One layer's parameter shapes on a TP rank, in named_parameters order."""
    h = config.hidden_size
    norm = [(h,)] + ([(h,)] if config.normalization == "LayerNorm" else [])  # TE's fused norm
    bias = config.add_bias_linear
    if symbol == "M":
        m = _mamba_sizes(config, tp)
        d_inner_tp, ngroups_tp, nheads_tp = m["d_inner"] // tp, m["ngroups"] // tp, m["nheads"] // tp
        conv_dim = d_inner_tp + 2 * ngroups_tp * m["d_state"]
        # MambaMixer's own params (conv1d_weight, conv1d_bias, dt_bias, A_log, D), then its
        # children: in_proj (norm, weight; bias=False), norm (RMSNormGated), out_proj.
        return [(conv_dim, 1, 4), (conv_dim,), (nheads_tp,), (nheads_tp,), (nheads_tp,), *norm,
                ((m["d_inner"] * 2 + 2 * m["ngroups"] * m["d_state"] + m["nheads"]) // tp, h),
                (d_inner_tp,), (h, d_inner_tp)]
    if symbol == "*":
        q = config.kv_channels * config.num_attention_heads
        qkv = q + 2 * config.kv_channels * config.num_query_groups
        qkv_bias = bias or config.add_qkv_bias
        # Attention.__init__ builds linear_proj, SelfAttention.__init__ then linear_qkv.
        return [(h, q // tp), *([(h,)] if bias else []), *norm, (qkv // tp, h),
                *([(qkv // tp,)] if qkv_bias else [])]
    fc1 = config.ffn_hidden_size * (2 if config.gated_linear_unit else 1)
    return [*norm, (fc1 // tp, h), *([(fc1 // tp,)] if bias else []),
            (h, config.ffn_hidden_size // tp), *([(h,)] if bias else [])]


def layouts(config, args, ddp_config, kinds: list, buckets: list, dp_cp: int) -> list:
    """Each (pipeline rank, virtual stage)'s dense buffer: [param elements, buffer numel,
    buckets] (numel and buckets with the distributed optimizer, from Megatron-Core's own
    compute_full_param_layout; None without)."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    tp, pp = config.tensor_model_parallel_size, config.pipeline_model_parallel_size
    h, vocab_rows = config.hidden_size, args.padded_vocab_size // tp
    share = not args.untie_embeddings_and_output_weights
    grid = []
    for pp_rank, row in enumerate(kinds):
        out = []
        for chunk, types in enumerate(row):
            pre, post = pp_rank == 0 and chunk == 0, pp_rank == pp - 1 and chunk == len(row) - 1
            shapes: list[tuple[tuple, bool]] = []  # (shape, shared_embedding)
            if pre:  # hybrid_model.py: LanguageModelEmbedding
                shapes.append(((vocab_rows, h), share and pp > 1))
                if args.position_embedding_type == "learned_absolute":
                    shapes.append(((args.max_position_embeddings, h), False))
            for symbol in types:
                shapes += [(s, False) for s in _layer_shapes(config, symbol, tp)]
            if post:  # hybrid_block.py final_norm (TENorm), then the output layer
                shapes += [((h,), False)] * (2 if config.normalization == "LayerNorm" else 1)
                if not (pre and share):  # skip_weight_param_allocation
                    shapes.append(((vocab_rows, h), share and pp > 1))
            params = []
            for shape, shared in shapes:
                p = torch.nn.Parameter(torch.empty(shape, device="meta", dtype=config.params_dtype))
                p.shared_embedding = shared
                params.append(p)
            elements = sum(p.numel() for p in params)
            if not ddp_config.use_distributed_optimizer:
                out.append([elements, None, None])
                continue
            full = DistributedOptimizer.compute_full_param_layout(
                params, buckets[pp_rank][chunk], dp_cp, ddp_config)
            ((_, layout),) = full.layouts.items()
            out.append([elements, layout.bucket_indices[-1][1], len(layout.bucket_indices)])
        grid.append(out)
    return grid
