"""Megatron-Core 0.19.2 builds the GPT model at TP > 1 on the CPU, beside preflight's verdict.

``megatron_side.py`` restates the ``divide()`` calls of the model's modules (building the
model needs process groups); this probe builds it: ``GPTModel`` with the local layer spec
(one layer, embedding and output layer), on TP gloo ranks with ``use_cpu_initialization``,
for launches chosen to meet each model-build rule on both of its sides, and asks ``verify
preflight`` about the same launches. It needs megatron-core 0.19.2 and Python 3.12 (the
project's ``.venv-mcore019``) for the builds, and runs preflight on the interpreter that
starts it::

    .venv/bin/python dev/megatron_diff/build_probe.py [--python .venv-mcore019/bin/python]

Transformer Engine is not installed here: its ``DotProductAttention`` assert (heads a
multiple of the query groups) is not met by the local spec, whose build accepts such a
model (its forward reshapes the QKV output and fails there); that row says so.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# (TP, heads, query groups or None, hidden, kv channels or None, ffn, swiglu, vocab, what it meets)
CASES = [
    (2, 4, None, 64, None, 256, False, 128, "valid"),
    (2, 4, 1, 64, None, 256, False, 128, "fewer query groups than TP (attention.py:355)"),
    (2, 3, None, 96, None, 256, False, 128, "heads % TP (transformer_config.py:1325)"),
    (2, 6, 3, 96, None, 256, False, 128, "groups neither multiple nor divisor of TP (:1338)"),
    (2, 4, None, 64, None, 129, False, 128, "FFN % TP (layers.py RowParallelLinear divide)"),
    (2, 4, None, 64, None, 129, True, 128, "FFN % TP under SwiGLU (fc2's input)"),
    (2, 4, None, 64, None, 256, False, 127, "vocab % TP (VocabParallelEmbedding divide)"),
    (2, 6, 4, 96, None, 256, False, 128, "heads % groups with groups >= TP (TE's assert only)"),
    (4, 4, 1, 64, 3, 256, False, 128, "QKV width (4 + 2 x 1) x 3 = 18 % TP 4 (linear_qkv divide)"),
    (4, 4, 2, 64, None, 256, False, 128, "fewer query groups than TP, TP % groups == 0"),
    (4, 8, 2, 64, None, 256, False, 128, "fewer query groups than TP, heads / groups = 4"),
]


def _launch(case: tuple) -> list[str]:
    tp, heads, groups, hidden, kv, ffn, swiglu, vocab, _ = case
    argv = ["--world-size", str(tp), "--tensor-model-parallel-size", str(tp), "--num-layers", "1",
            "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--ffn-hidden-size", str(ffn), "--seq-length", "16", "--max-position-embeddings", "16",
            "--micro-batch-size", "1", "--padded-vocab-size", str(vocab)]
    if groups is not None:
        argv += ["--group-query-attention", "--num-query-groups", str(groups)]
    if kv is not None:
        argv += ["--kv-channels", str(kv)]
    return argv + (["--swiglu"] if swiglu else [])


def preflight_verdict(case: tuple) -> str:
    sys.path.insert(0, str(REPO))
    from verify.cli import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        rc = main(["preflight", "--no-twin", *_launch(case)])
    text = " ".join(err.getvalue().split())
    return "accepts" if rc == 0 else "refuses: " + text.partition("error: ")[2][:260]


def _build_all(rank: int, world: int, cases: list[tuple], port: int) -> None:
    """One TP rank: build every case's model, rank 0 prints one JSON line per case."""
    import warnings

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    warnings.filterwarnings("ignore")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        import torch.nn.functional as F
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    for case in cases:
        tp, heads, groups, hidden, kv, ffn, swiglu, vocab, _ = case
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                # megatron/training/argument_utils.py core_transformer_config_from_args: SwiGLU is
                # a gated SiLU; the groups are the heads without --group-query-attention.
                config = TransformerConfig(
                    num_layers=1, hidden_size=hidden, num_attention_heads=heads,
                    num_query_groups=groups, kv_channels=kv, ffn_hidden_size=ffn,
                    gated_linear_unit=swiglu, activation_func=F.silu if swiglu else F.gelu,
                    tensor_model_parallel_size=world, use_cpu_initialization=True)
                GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                         vocab_size=vocab, max_sequence_length=16, pre_process=True,
                         post_process=True)
            verdict = "builds"
        except Exception as exc:  # noqa: BLE001 - any raise is Megatron's refusal
            verdict = f"refuses: {type(exc).__name__}: {exc}"[:220]
        if rank == 0:
            print(json.dumps({"case": list(case), "megatron": verdict}), flush=True)
    dist.destroy_process_group()


def megatron_builds(python: str) -> dict[tuple, str]:
    """Each case's verdict from megatron-core's own build, one spawn of TP ranks per TP."""
    out = {}
    for tp in sorted({c[0] for c in CASES}):
        cases = [c for c in CASES if c[0] == tp]
        code = ("import sys, json, torch.multiprocessing as mp; sys.path.insert(0, sys.argv[1]); "
                "import build_probe as b; cases = [tuple(c) for c in json.loads(sys.argv[2])]; "
                "mp.spawn(b._build_all, args=(int(sys.argv[3]), cases, 29600 + int(sys.argv[3])), "
                "nprocs=int(sys.argv[3]))")
        run = subprocess.run([python, "-c", code, str(HERE), json.dumps(cases), str(tp)],
                             capture_output=True, text=True, timeout=1200, check=True)
        for line in run.stdout.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                out[tuple(row["case"])] = row["megatron"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=str(Path("/work/main/.venv-mcore019/bin/python")),
                        help="an interpreter with megatron-core 0.19.2")
    parser.add_argument("--out", default=str(HERE / "results" / "build_probe.txt"))
    args = parser.parse_args()
    built = megatron_builds(args.python)
    lines = []
    for case in CASES:
        megatron, preflight = built[case], preflight_verdict(case)
        agree = megatron.startswith("builds") == preflight.startswith("accepts")
        # Transformer Engine's assert (the default --transformer-impl) is not in the local spec.
        label = "agree" if agree else "TE only" if "TE's assert only" in case[-1] else "DIFFER"
        lines.append(f"{label}: TP {case[0]}, {case[-1]}\n"
                     f"    launch: {' '.join(_launch(case))}\n    megatron-core 0.19.2 local "
                     f"spec: {megatron}\n    preflight: {preflight}")
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
