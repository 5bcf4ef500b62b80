"""Megatron-Core 0.19.2 builds GPT chunks with MTP and q/k layernorm on the CPU, beside
preflight's parameters for the same launch.

For each case, TP x PP gloo ranks run ``initialize_model_parallel`` and build every model chunk
of their pipeline rank as ``megatron/training/models/gpt.py`` does: ``GPTModel`` with the local
layer spec (``get_gpt_layer_local_spec(qk_layernorm=...)``), ``mtp_block_spec`` from
``get_gpt_mtp_block_spec`` on the decoder's last layer spec, ``pre_process``/``post_process``
from ``parallel_state``. Each chunk's ``named_parameters`` (name, shape, the
``shared_embedding`` flag) on TP rank 0 are held to ``verify.preflight.model.chunk_parameters``
of the same launch, in order (decoder layer indices compared as preflight's global ones less
the chunk's first), and each chunk's distributed-optimizer buffer as Megatron-LM lays it out
(``training.py`` wrap_model_chunks_with_ddp: ``DistributedOptimizer.compute_full_param_layout``
on the chunk's parameters, DP 4, bucket size 5,000 on pipeline rank 0's first chunk and one
bucket elsewhere, as ``get_model`` sets them under ``--overlap-grad-reduce --ddp-bucket-size
5000``: its padded size and bucket count, which the ``shared_embedding`` copy's own bucket
moves) is held to preflight's ``chunk_layouts``. One stand-in: ``Tensor.cuda`` is the identity, for the first/last stage's
embedding all-reduce at build (``language_module.py``: ``weight.data.cuda()``). Needs
megatron-core 0.19.2 (the project's ``.venv-mcore019``) for the builds; preflight runs on the
interpreter that starts it::

    .venv/bin/python dev/megatron_diff/mtp_probe.py [--python .venv-mcore019/bin/python]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# (TP, PP, VPP or None, tied, MTP depths or None, repeated, qk-layernorm, normalization, layers)
CASES = [
    (2, 2, None, False, 1, False, True, "LayerNorm", 4),
    (2, 2, None, True, 1, False, False, "LayerNorm", 4),
    (1, 2, None, True, 2, False, True, "RMSNorm", 4),
    (1, 2, None, False, 3, True, False, "RMSNorm", 4),
    (2, 1, None, True, 1, False, True, "LayerNorm", 2),
    (2, 1, None, False, 2, False, False, "RMSNorm", 2),
    (1, 2, 2, False, 1, False, True, "LayerNorm", 4),
    (2, 2, None, True, None, False, True, "RMSNorm", 4),
]
HIDDEN, HEADS, FFN, VOCAB, SEQ = 64, 4, 128, 128, 16
DP, BUCKET = 4, 5000  # the layouts' data-parallel size and pipeline rank 0's bucket size


def _launch(case: tuple) -> list[str]:
    tp, pp, vpp, tied, mtp, repeated, qk, norm, layers = case
    argv = ["--world-size", str(tp * pp * DP), "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--num-layers", str(layers),
            "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
            "--ffn-hidden-size", str(FFN), "--seq-length", str(SEQ),
            "--max-position-embeddings", str(SEQ), "--micro-batch-size", "1",
            "--global-batch-size", str(4 * DP), "--padded-vocab-size", str(VOCAB),
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", str(BUCKET),
            "--position-embedding-type", "rope", "--normalization", norm,
            "--transformer-impl", "local"]
    if vpp:
        argv += ["--num-virtual-stages-per-pipeline-rank", str(vpp)]
    if not tied:
        argv += ["--untie-embeddings-and-output-weights"]
    if mtp:
        argv += ["--mtp-num-layers", str(mtp)] + (["--mtp-use-repeated-layer"] if repeated else [])
    return argv + (["--qk-layernorm"] if qk else [])


def _build_all(rank: int, world: int, cases: list, port: int, folder: str) -> None:
    """One rank of a world of TP x PP ranks: every case of that size in turn; TP rank 0 of
    each pipeline rank writes ``<case>-<stage>.json`` under ``folder``."""
    import warnings

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    warnings.filterwarnings("ignore")
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # the build's one .cuda()
    for number, case in cases:
        _build(case, number, folder)
    dist.destroy_process_group()


def _build(case: list, number: int, folder: str) -> None:
    import torch
    tp, pp, vpp, tied, mtp, repeated, qk, norm, layers = case
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        import torch.nn.functional as F
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_mtp_block_spec,
        )
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        from megatron.core.transformer.transformer_config import TransformerConfig

        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp)
        config = TransformerConfig(
            num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
            ffn_hidden_size=FFN, activation_func=F.gelu, normalization=norm,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp, use_cpu_initialization=True,
            qk_layernorm=qk, mtp_num_layers=mtp, mtp_use_repeated_layer=repeated,
            pipeline_dtype=torch.float32)
        chunks = []
        for vp_stage in range(vpp or 1):
            stage = vp_stage if vpp else None
            spec = get_gpt_layer_local_spec(qk_layernorm=qk, normalization=norm)
            mtp_spec = (get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False,
                                               vp_stage=stage) if mtp else None)
            model = GPTModel(
                config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                max_sequence_length=SEQ, position_embedding_type="rope",
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                                    vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                                   vp_stage=stage),
                share_embeddings_and_output_weights=tied, mtp_block_spec=mtp_spec,
                vp_stage=stage)
            ddp = DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                overlap_grad_reduce=True, bucket_size=BUCKET)
            first = parallel_state.get_pipeline_model_parallel_rank() == 0 and vp_stage == 0
            full = DistributedOptimizer.compute_full_param_layout(
                [q for q in model.parameters() if q.requires_grad], BUCKET if first else None,
                DP, ddp)
            ((_, layout),) = full.layouts.items()
            chunks.append({"params": [[name, list(p.shape),
                                       bool(getattr(p, "shared_embedding", False))]
                                      for name, p in model.named_parameters()],
                           "buffer": [layout.bucket_indices[-1][1], len(layout.bucket_indices)]})
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        stage = parallel_state.get_pipeline_model_parallel_rank()
        Path(folder, f"{number}-{stage}.json").write_text(json.dumps(chunks), encoding="utf-8")


def megatron_params(python: str) -> dict[int, dict[int, list]]:
    """Every case's pipeline ranks' chunks' parameters, from megatron-core's own build: one
    spawn of ranks per world size."""
    out: dict[int, dict[int, list]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for world in sorted({c[0] * c[1] for c in CASES}):
            cases = [[i, list(c)] for i, c in enumerate(CASES) if c[0] * c[1] == world]
            code = ("import sys, json, torch.multiprocessing as mp; sys.path.insert(0, sys.argv[1]); "
                    "import mtp_probe as m; w = int(sys.argv[3]); mp.spawn(m._build_all, "
                    "args=(w, json.loads(sys.argv[2]), 29700 + w, sys.argv[4]), nprocs=w)")
            run = subprocess.run([python, "-c", code, str(HERE), json.dumps(cases), str(world),
                                  folder], capture_output=True, text=True, timeout=1800)
            if run.returncode:
                raise RuntimeError(f"world {world}: megatron build failed:\n{run.stderr[-3000:]}")
        for path in Path(folder).glob("*.json"):
            number, stage = map(int, path.stem.split("-"))
            out.setdefault(number, {})[stage] = json.loads(path.read_text(encoding="utf-8"))
    return out


def preflight_params(case: tuple) -> dict[int, list]:
    """preflight's chunk_parameters for the same launch, names with local layer indices."""
    sys.path.insert(0, str(REPO))
    from tests.verify.preflight_launch import preflight_config
    from verify.preflight.model import chunk_parameters, layers_of_chunk
    from verify.preflight.paper import chunk_layouts

    config = preflight_config(_launch(case))
    layouts = {(c.stage, c.chunk): c.layout for c in chunk_layouts(config)}
    out = {}
    for stage in range(config.pipeline_model_parallel_size):
        chunks = []
        for chunk in range(config.virtual_pipeline_model_parallel_size):
            first = layers_of_chunk(config, stage, chunk).start

            def local(name: str, first: int = first) -> str:
                return re.sub(r"^decoder\.layers\.(\d+)\.",
                              lambda m: f"decoder.layers.{int(m.group(1)) - first}.", name)

            layout = layouts[(stage, chunk)]
            chunks.append({"params": [[local(p.name), list(p.shape), p.shared_embedding]
                                      for p in chunk_parameters(config, stage, chunk)],
                           "buffer": [layout.numel, layout.num_buckets]})
        out[stage] = chunks
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default="/work/main/.venv-mcore019/bin/python",
                        help="an interpreter with megatron-core 0.19.2")
    parser.add_argument("--out", default=str(HERE / "results" / "mtp_probe.txt"))
    args = parser.parse_args()
    lines, agree = [], 0
    built = megatron_params(args.python)
    for number, case in enumerate(CASES):
        megatron = built[number]
        preflight = preflight_params(case)
        same = megatron == {int(k): v for k, v in preflight.items()}
        agree += same
        lines.append(f"{'agree' if same else 'DIFFER'}: {' '.join(_launch(case))}")
        if not same:
            for stage in sorted(megatron):
                for chunk, (m, p) in enumerate(zip(megatron[stage], preflight[stage])):
                    if m != p:
                        lines.append(f"    stage {stage} chunk {chunk}:\n      megatron  {m}\n"
                                     f"      preflight {p}")
    lines.append(f"{agree} of {len(CASES)} cases: every chunk's parameters (name, shape, "
                 "shared_embedding) equal, in order, and its distributed-optimizer buffer "
                 f"(padded size, buckets; DP {DP}, bucket size {BUCKET:,} on pipeline rank 0's "
                 "first chunk)")
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
