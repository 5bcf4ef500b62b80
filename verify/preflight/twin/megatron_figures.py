"""Megatron-Core's own figures for a launch, computed in a process of its own (run as a module).

``python -m verify.preflight.twin.megatron_figures SIZES`` takes the launch's sizes as JSON (one
launch, or a list of them: one answer each) and writes, as JSON on stdout, what
Megatron-Core's own code derives from them, sharing no code with preflight:

- DP and DP x CP: ``megatron/core/parallel_state.py initialize_model_parallel`` over a world
  of the launch's size (torch's ``fake`` process-group backend: groups without
  communication), then ``get_data_parallel_world_size()`` with and without CP;
- the microbatches per step and the global batch a step runs:
  ``megatron/core/num_microbatches_calculator.py ConstantNumMicroBatchesCalculator`` (built
  as ``megatron/training/global_vars.py`` builds it, from that DP);
- the layers of every (pipeline stage, model chunk) and the first one's index:
  ``megatron/core/transformer/transformer_block.py get_num_layers_to_build`` and
  ``transformer_layer.py get_transformer_layer_offset`` over a ``TransformerConfig`` of the
  launch's split (its ``__post_init__`` checks included).

A process of its own, because ``initialize_model_parallel`` fills Megatron's process-wide
``parallel_state`` and needs a default process group of the launch's world size. Anything
Megatron-Core raises is reported as ``{"refused": "..."}``.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import warnings


def megatron_figures(sizes: dict) -> dict:
    """Megatron-Core's DP, microbatches and layer split for ``sizes`` (see the module docstring)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        import torch
        import torch.distributed as dist
        from megatron.core import package_info, parallel_state
        from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        tp, pp, cp, vpp = sizes["tp"], sizes["pp"], sizes["cp"], sizes["vpp"]
        dist.init_process_group("fake", rank=0, world_size=sizes["world_size"])
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            context_parallel_size=cp, create_gloo_process_groups=False)
        dp = parallel_state.get_data_parallel_world_size()
        dp_cp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        calculator = ConstantNumMicroBatchesCalculator(
            sizes["global_batch_size"], sizes["micro_batch_size"], dp,
            sizes["decrease_batch_size_if_needed"], rank=0)
        config = TransformerConfig(
            num_layers=sizes["num_layers"], hidden_size=8, num_attention_heads=1,
            pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            num_layers_in_first_pipeline_stage=sizes["first"],
            num_layers_in_last_pipeline_stage=sizes["last"],
            account_for_embedding_in_pipeline_split=sizes["account_embedding"],
            account_for_loss_in_pipeline_split=sizes["account_loss"])
        chunks = vpp if vpp > 1 and pp > 1 else 1
        stage = [None if chunks == 1 and vpp == 1 else c for c in range(chunks)]
        layers = [[get_num_layers_to_build(config, vp_stage=v, pp_rank=r) for v in stage]
                  for r in range(pp)]
        offsets = [[get_transformer_layer_offset(config, vp_stage=v, pp_rank=r) for v in stage]
                   for r in range(pp)]
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return {"megatron": f"megatron-core {package_info.__version__}", "dp": dp, "dp_cp": dp_cp,
            "microbatches": calculator.get(),
            "running_global_batch_size": calculator.get_current_running_global_batch_size(),
            "layers": layers, "offsets": offsets}


def answer(sizes: dict) -> dict:
    """:func:`megatron_figures`, or what Megatron-Core raised (its refusal), its world left
    (the next launch builds its own)."""
    try:
        return megatron_figures(sizes)
    except Exception as exc:  # noqa: BLE001 - what Megatron-Core raises is its refusal
        parallel_state = sys.modules.get("megatron.core.parallel_state")
        if parallel_state is not None:
            parallel_state.destroy_model_parallel()
        distributed = sys.modules.get("torch.distributed")
        if distributed is not None and distributed.is_initialized():
            distributed.destroy_process_group()
        return {"refused": f"{type(exc).__name__}: {exc}"[:500]}


def main() -> None:
    sizes = json.loads(sys.argv[1])
    out = [answer(one) for one in sizes] if isinstance(sizes, list) else answer(sizes)
    sys.stdout.write(json.dumps(out))


if __name__ == "__main__":
    main()
