"""The launches both sides are asked about: random, Megatron-LM's example scripts, our docs.

- ``random``: seeded draws over the flags preflight models (and some it does not; the
  gradient averaging flags and the mixture-of-experts flags each from a generator of their
  own, added with issue 28), with
  mistakes made on purpose (a world size TP x PP x CP does not divide, a batch that does
  not split, a layer count that does not split, a flag spelled as preflight once spelled it,
  an unquoted multi-word value, ...);
- ``example``: the flags Megatron-LM's own launch scripts (branch ``core_r0.19.0``,
  ``examples/``) hand to ``pretrain_*.py``, captured by running each script under bash with
  ``torchrun``/``python``/``srun`` replaced by a stub that records its arguments; the SC21
  paper's configurations are expanded from ``academic_paper_scripts/sc21/CONFIG.sh``'s
  template for every option its ``run_*.sh`` scripts list;
- ``moe``: the ``mixtral`` example's launch at 32, 64, 96 and 128 GPUs, with edits that keep it
  valid and move the expert grid, the expert buffers and their averaging
  (:data:`MIXTRAL_EDITS`);
- ``hybrid``: the ``mamba`` example's two launches (800M at TP 1, 8B at TP 4) at other TP,
  PP (with and without ``|`` in the pattern, interleaved by more segments than PP ranks,
  uneven), world sizes and settings, mostly valid, a few refused (:func:`hybrid_variants`);
- ``sgd``: Megatron-LM's GPT-3 175B and Llama-3 8B launches with ``--optimizer sgd``
  (:data:`SGD_EDITS`), valid and not;
- ``fsdp``: the ``megatron_fsdp`` example's launch at 8, 16 and 32 GPUs with each sharding
  strategy and edits of its averaging, its grad dtype and its companions, and the same launch
  moved to torch FSDP2 (:data:`FSDP_EDITS`, :func:`fsdp_variants`);
- ``mtpqk``: the Qwen3-8B model of ``post_training/modelopt/conf/Qwen/Qwen3-8B.sh``
  (``--qk-layernorm``, RMSNorm, rope, untied) at TP 1/2, PP 1/2/4 (VPP 3 once), tied and
  untied, without and with multi-token prediction (:data:`QWEN_EDITS`);
- ``docs``: every ``$ verify preflight`` line of README.md and docs/*.md
  (``tests/verify/doc_launches.py``), preflight's own options taken out.

A launch whose vocabulary would come from tokenizer files (absent here) gets
``--padded-vocab-size`` with the size Megatron pads GPT-2's 50257 tokens to
(``megatron/core/tokenizers/utils/build_tokenizer.py vocab_size_with_padding``), on both sides.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPT2_VOCAB = 50257
STUBBED = ("torchrun", "python", "python3", "srun", "sbatch", "uv", "nsys", "git", "nvidia-smi")


def _padded_vocab(argv: list[str]) -> list[str]:
    if "--padded-vocab-size" in argv or "--vocab-size" in argv:
        return argv
    tp = int(_value(argv, "--tensor-model-parallel-size") or 1)
    divisible = int(_value(argv, "--make-vocab-size-divisible-by") or 128)
    multiple = divisible * tp
    return [*argv, "--padded-vocab-size", str(-(-GPT2_VOCAB // multiple) * multiple)]


def _value(argv: list[str], flag: str) -> str | None:
    value = None
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith(flag + "="):
            value = token.split("=", 1)[1]
    return value


# ----------------------------------------------------------------------------- random


def random_launches(count: int, seed: int = 22) -> list[dict]:
    """``count`` seeded random launches (see the module docstring)."""
    rng = random.Random(seed)
    return [_random_launch(rng, i, seed) for i in range(count)]


def _random_launch(rng: random.Random, index: int, seed: int) -> dict:
    def p(prob: float) -> bool:
        return rng.random() < prob

    tp = rng.choice([1, 1, 2, 2, 4, 8])
    pp = rng.choice([1, 1, 2, 2, 3, 4, 4, 5, 8])
    cp = rng.choice([1, 1, 1, 1, 2, 2, 4])
    dp = rng.choice([1, 2, 2, 3, 4, 8])
    world = tp * pp * cp * dp
    if p(0.06):
        world = world + tp  # TP x PP x CP no longer divides it (mostly)
    heads = rng.choice([4, 8, 12, 16, 32, 64])
    head_dim = rng.choice([32, 64, 128])
    hidden = heads * head_dim + (rng.choice([8, 16]) if p(0.04) else 0)
    layers_per_stage = rng.choice([1, 2, 3, 4, 6])
    vpp = rng.choice([2, 3, 4]) if pp > 1 and p(0.3) else 1
    num_layers = pp * vpp * layers_per_stage
    account_embedding, account_loss = p(0.15), p(0.15)
    num_layers -= int(account_embedding) + int(account_loss)
    if p(0.08):
        num_layers += rng.choice([-1, 1, 2])
    num_layers = max(num_layers, 1)
    seq = rng.choice([256, 512, 1024, 2048, 4096]) + (rng.choice([2, 6]) if p(0.04) else 0)
    mbs = rng.choice([1, 1, 2, 4])
    m = rng.choice([1, 2, 3, 4, 6, 8, 12, 16])
    gbs = mbs * dp * m + (rng.choice([1, mbs]) if p(0.08) else 0)
    argv = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--num-layers", str(num_layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", str(seq),
            "--micro-batch-size", str(mbs)]
    if cp > 1 or p(0.05):
        argv += ["--context-parallel-size", str(cp)]
    if not p(0.08):
        argv += ["--max-position-embeddings", str(seq if p(0.9) else seq // 2)]
    if not p(0.1):
        argv += ["--global-batch-size", str(gbs)]
    if vpp > 1:
        if p(0.6):
            argv += ["--num-virtual-stages-per-pipeline-rank", str(vpp)]
        else:
            argv += ["--num-layers-per-virtual-pipeline-stage", str(layers_per_stage)]
    if account_embedding:
        argv += ["--account-for-embedding-in-pipeline-split"]
    if account_loss:
        argv += ["--account-for-loss-in-pipeline-split"]
    if pp > 1 and p(0.15):
        total = num_layers
        if p(0.5):
            argv += ["--decoder-first-pipeline-num-layers", str(rng.choice([1, 2, max(1, total // pp - 1)]))]
        if p(0.6):
            argv += ["--decoder-last-pipeline-num-layers", str(rng.choice([1, 2, max(1, total // pp - 1)]))]
    if p(0.3):
        groups = rng.choice([1, 2, 4, 8])
        argv += ["--group-query-attention", "--num-query-groups", str(groups)]
    if p(0.4):
        argv += ["--swiglu"]
    if p(0.5):
        argv += ["--ffn-hidden-size", str(rng.choice([2, 3, 4]) * hidden + (rng.choice([0, 0, 0, 3]) if p(0.2) else 0))]
    precision = rng.choice(["bf16", "bf16", "bf16", "fp16", "fp32", "both"])
    argv += {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": [], "both": ["--bf16", "--fp16"] if p(0.3) else ["--bf16"]}[precision]
    if precision == "bf16" and p(0.2):
        argv += ["--grad-reduce-in-bf16"]
    if p(0.1):
        argv += ["--accumulate-allreduce-grads-in-fp32"]
    dist_opt = p(0.6)
    if dist_opt:
        argv += ["--use-distributed-optimizer"]
    overlap = p(0.5)
    if overlap:
        argv += ["--overlap-grad-reduce"]
    if p(0.3):
        argv += ["--overlap-param-gather"]
    if p(0.15):
        argv += ["--ddp-bucket-size", str(rng.choice([1_000_000, 10_000_000, 50_000_000]))]
    if p(0.08):
        argv += ["--ddp-pad-buckets-for-high-nccl-busbw"]
    if p(0.1):
        argv += ["--ddp-reduce-scatter-with-fp32-accumulation"]
    if p(0.15):
        argv += ["--fp8-format", rng.choice(["e4m3", "hybrid"])]
    if p(0.15):
        argv += ["--fp8-recipe", rng.choice(["mxfp8", "delayed", "tensorwise", "blockwise"])]
    if p(0.12):
        argv += ["--fp8-param-gather"]
    if p(0.06):
        argv += ["--reuse-grad-buf-for-mxfp8-param-ag"]
    if p(0.1):
        argv += ["--defer-embedding-wgrad-compute"]
        if p(0.5):
            argv += ["--wgrad-deferral-limit", str(rng.choice([-1, 0, 1, 2]))]
    if p(0.3):
        argv += ["--sequence-parallel"]
    if p(0.3):
        argv += ["--untie-embeddings-and-output-weights"]
    if p(0.4):
        argv += ["--position-embedding-type", rng.choice(["rope", "rope", "none", "learned_absolute", "yarn"])]
    if p(0.3):
        argv += ["--normalization", "RMSNorm"]
    if p(0.3):
        argv += ["--disable-bias-linear"]
    if p(0.05):
        argv += ["--no-gradient-accumulation-fusion"]
    if vpp > 1 and p(0.1):
        argv += ["--no-overlap-p2p-communication"]
    if vpp > 1 and p(0.1):
        argv += ["--microbatch-group-size-per-virtual-pipeline-stage", str(rng.choice([pp, pp + 1, 2 * pp]))]
    if p(0.05):
        argv += ["--decrease-batch-size-if-needed"]
    if p(0.5):
        argv += ["--padded-vocab-size", str(rng.choice([50304, 51200, 32000, 128256]))]
    else:
        argv += ["--vocab-size", str(rng.choice([50257, 32000, 128256])), "--tokenizer-type", "NullTokenizer"]
    if p(0.2):
        argv += ["--clip-grad", rng.choice(["1.0", "0.5", "0"])]
    if precision == "fp16" and p(0.3):
        argv += ["--loss-scale", rng.choice(["1024", "4096"])]
    # Flags preflight does not use, harmless and otherwise.
    argv += ["--lr", "1.5e-4", "--train-iters", "100"]
    if p(0.05):
        argv += ["--min-lr", "-1e-5"]  # argparse takes "-1e-5" for an option
    if p(0.04):
        argv += ["--split", "969,", "30,", "1"]  # an unquoted multi-word value
    if p(0.05):
        schedule = "0:16 1000:32"
        argv += ["--step-batch-size-schedule", *(schedule.split() if p(0.4) else [schedule])]
    if p(0.03):
        argv += ["--rampup-batch-size", "16", "16", "1000"]
    if p(0.03):
        argv += [rng.choice(["--data-parallel-size", "--virtual-pipeline-model-parallel-size"]), "2"]
    if p(0.02):
        argv += ["--use-distributed-optimiser"]
    if p(0.06):
        argv += rng.choice([["--num-experts", "8", "--expert-model-parallel-size", "2"],
                            ["--calculate-per-token-loss"], ["--qk-layernorm"],
                            ["--mtp-num-layers", "1"], ["--optimizer", "sgd"],
                            ["--use-torch-fsdp2"]])
    # Since issue 28, the gradient averaging flags (and their DDP-wrap refusal together),
    # drawn from a generator of their own: every draw above stays that of earlier corpora.
    averaging = random.Random(f"{seed}:{index}")
    if averaging.random() < 0.12:
        argv += ["--calculate-per-token-loss"]
    if averaging.random() < 0.12:
        argv += ["--ddp-average-in-collective"]
    # Since MoE is modelled (issue 28), mixture-of-experts flags from a generator of their own
    # too: the draws above stay those of earlier corpora.
    argv += _moe_flags(random.Random(f"{seed}:{index}:moe"), world, tp, pp)
    # Since --qk-layernorm and MTP are modelled (issue 28), their flags from a generator of
    # their own as well.
    argv += _mtp_qk_flags(random.Random(f"{seed}:{index}:mtp"))
    return {"id": f"random-{index:03d}", "source": "random", "world_size": world, "argv": argv}


def _mtp_qk_flags(rng: random.Random) -> list[str]:
    """--qk-layernorm (at times with --qk-l2-norm) in a sixth of the launches; MTP in another
    sixth: 1 to 3 depths (0 at times), at times repeated, at times with rope (otherwise the
    position embedding drawn above, which Megatron refuses unless rope or none)."""
    argv = []
    if rng.random() < 0.16:
        argv += ["--qk-layernorm"] + (["--qk-l2-norm"] if rng.random() < 0.2 else [])
    if rng.random() < 0.16:
        argv += ["--mtp-num-layers", str(rng.choice([0, 1, 1, 2, 3]))]
        if rng.random() < 0.3:
            argv += ["--mtp-use-repeated-layer"]
        if rng.random() < 0.6:
            argv += ["--position-embedding-type", "rope"]
    return argv


def _moe_flags(rng: random.Random, world: int, tp: int, pp: int) -> list[str]:
    """A quarter of the launches get experts: mostly an expert grid that divides the world
    (EP from the divisors of world / (ETP x PP)), at times one that does not, and Megatron's
    MoE rules met or broken (top-1 without pre-softmax, biases with ETP > 1, a layer pattern
    of the wrong length, an expert FFN ETP does not divide, shared experts)."""
    if rng.random() >= 0.25:
        return []
    etp = rng.choice([1, 1, tp, tp, 2]) if rng.random() < 0.4 else None
    expert_tp = etp or tp
    room = world // (expert_tp * pp) if world % (expert_tp * pp) == 0 else 0
    divisors = [d for d in (1, 2, 3, 4, 8, 16) if room and room % d == 0]
    ep = rng.choice(divisors) if divisors and rng.random() < 0.85 else rng.choice([2, 3, 4, 8])
    experts = ep * rng.choice([1, 2, 4]) if rng.random() < 0.9 else rng.choice([3, 6, 8])
    argv = ["--num-experts", str(experts), "--expert-model-parallel-size", str(ep)]
    if etp is not None:
        argv += ["--expert-tensor-parallel-size", str(etp)]
    if rng.random() < 0.5:
        argv += ["--moe-ffn-hidden-size", str(rng.choice([256, 512, 1024, 1536, 777]))]
    topk = rng.choice([1, 2, 2, 4])
    argv += ["--moe-router-topk", str(topk)]
    if topk == 1 and rng.random() < 0.5:
        argv += ["--moe-router-pre-softmax"]
    if rng.random() < 0.25:
        argv += ["--moe-layer-freq", rng.choice(["2", "([0]+[1]*3)", "[1,0]*2", "([1]*1)"])]
    if rng.random() < 0.2:
        argv += ["--moe-shared-expert-intermediate-size", str(rng.choice([512, 1024, 333]))]
    if rng.random() < 0.4:
        argv += ["--moe-grouped-gemm"]
    if rng.random() < 0.4:
        argv += ["--moe-token-dispatcher-type", rng.choice(["alltoall", "allgather"])]
    if rng.random() < 0.3:
        argv += ["--moe-aux-loss-coeff", "1e-2", "--moe-router-load-balancing-type", "aux_loss"]
    if rng.random() < 0.6:
        argv += ["--disable-bias-linear"]
    return argv


# --------------------------------------------------------------------------- examples


POSITIONAL = ["/tmp/ckpt", "/tmp/tb", "/tmp/vocab.json", "/tmp/merges.txt", "/tmp/data_text_document"]
EXAMPLES = {
    # script under examples/ -> (its command-line arguments, variants as {variable: value}
    # edits of its assignments); "{work}" is the run's own folder.
    "gpt3/train_gpt3_175b_distributed.sh": (POSITIONAL, [{}]),
    "llama/train_llama3_8b_h100_fp8.sh": ([], [{}, {"DTYPE": '"bf16"'}]),
    "mixtral/train_mixtral_8x7b_distributed.sh": (POSITIONAL, [{}]),
    "gptoss/02_train.sh": (["--checkpoint-path", "{work}"], [{}]),
    "mamba/train.sh": (POSITIONAL, [{}, {"MODEL_SCALE": '"8B"'}]),
    "bert/train_bert_340m_distributed.sh": (POSITIONAL, [{}]),
    "megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh": ([], [{}]),
}


def _stub_dir(root: Path) -> Path:
    stubs = root / "stubs"
    stubs.mkdir()
    for name in STUBBED:
        path = stubs / name
        path.write_text('#!/bin/bash\nprintf "ENV:%s\\0" "${CUDA_DEVICE_MAX_CONNECTIONS-unset}" '
                        '>> "$CAPTURE"\nfor a in "$@"; do printf "%s\\0" "$a" >> "$CAPTURE"; done\n'
                        'printf "\\n\\0" >> "$CAPTURE"\n')
        path.chmod(0o755)
    return stubs


def _captured_launch(capture: Path) -> tuple[list[str], int, str] | None:
    """(flags after the training script, world size, CUDA_DEVICE_MAX_CONNECTIONS or "unset")."""
    if not capture.exists():
        return None
    for call in capture.read_text().split("\n\0"):
        tokens = [t for t in call.split("\0") if t]
        connections = tokens.pop(0)[len("ENV:"):] if tokens and tokens[0].startswith("ENV:") else "1"
        script = next((i for i, t in enumerate(tokens) if re.search(r"pretrain_\w+\.py$", t)), None)
        if script is None:
            continue
        launcher = tokens[:script]
        nproc = int(_value(launcher, "--nproc_per_node") or _value(launcher, "--nproc-per-node") or 8)
        nnodes = int(_value(launcher, "--nnodes") or 1)
        return tokens[script + 1:], nproc * nnodes, connections
    return None


def example_launches(examples: Path) -> list[dict]:
    """Megatron-LM's example scripts' launches (see the module docstring)."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        stubs = _stub_dir(root)
        for script, (script_args, variants) in EXAMPLES.items():
            for number, edits in enumerate(variants):
                work = root / f"run-{Path(script).stem}-{number}"
                shutil.copytree(examples, work / "examples")
                path = work / "examples" / script
                text = path.read_text()
                for name, value in edits.items():
                    text = re.sub(rf"^(\s*){name}=.*$", rf"\g<1>{name}={value}", text, count=1,
                                  flags=re.M)
                path.write_text(text)
                for folder in (work, path.parent):  # scripts check that their script exists
                    for name in ("pretrain_gpt.py", "pretrain_bert.py", "pretrain_hybrid.py",
                                 "pretrain_mamba.py"):
                        (folder / name).touch()
                capture = work / "capture"
                env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(work), "CAPTURE": str(capture)}
                subprocess.run(["bash", path.name, *(a.format(work=work) for a in script_args)],
                               cwd=path.parent, env=env, timeout=60,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                launch = _captured_launch(capture)
                if launch is None:
                    print(f"no launch captured from {script} {edits}", file=sys.stderr)
                    continue
                argv, world, connections = launch
                out.append({"id": f"example-{Path(script).stem}-{number}", "source": "example",
                            "world_size": world, "argv": _padded_vocab(argv),
                            "env": {"CUDA_DEVICE_MAX_CONNECTIONS": connections}})
    return out + sc21_launches(examples)


# examples/academic_paper_scripts/sc21: CONFIG.sh's MEGATRON_PARAMS, for the options each
# run_*.sh lists in its comments (TP, PP, MBS, GBS, NLS, HS, NAH, NNODES x 8 GPUs).
SC21 = "academic_paper_scripts/sc21"
SC21_DROPPED = ("--DDP-impl", "--activations-checkpoint-method")  # gone from Megatron-LM 0.19


def _sc21(tp, pp, mbs, gbs, nls, hs, nah, nodes, extra=""):
    return {"TP": tp, "PP": pp, "MBS": mbs, "GBS": gbs, "NLS": nls, "HS": hs, "NAH": nah,
            "NNODES": nodes, "EXTRA": extra}


def _sc21_configs(examples: Path) -> list[dict]:
    configs = []
    for pp in (1, 2, 4, 8):  # run_figure_11
        for gbs in (8, 128):
            configs.append(_sc21(8, pp, 1, gbs, 3 * pp, 20480, 128, pp))
    for interleaved in (True, False):  # run_figure_12
        for gbs in (12, 24, 36, 48, 60):
            extra = "--num-layers-per-virtual-pipeline-stage 2" if interleaved else ""
            configs.append(_sc21(8, 12, 1, gbs, 96, 12288, 96, 12, extra))
    for pp in (2, 4, 8, 16, 32):  # run_figure_13 (TP = 64 / PP) and 14 (DP = 64 / PP)
        for gbs in (32, 128):
            configs.append(_sc21(64 // pp, pp, 1, gbs, 32, 20480, 128, 8))
        for gbs in (32, 512):
            configs.append(_sc21(1, pp, 1, gbs, 32, 3840, 32, 8))
    for tp in (2, 4, 8, 16, 32):  # run_figure_15
        for gbs in (32, 128, 512):
            configs.append(_sc21(tp, 1, 1, gbs, 32, 3840, 32, 8))
    for mbs in (1, 2, 4, 8):  # run_figure_16
        for gbs in (128, 512):
            configs.append(_sc21(8, 8, mbs, gbs, 32, 15360, 128, 8))
    for gbs in (1, 2, 4, 8, 16, 32, 64, 128, 256):  # run_figure_17
        configs.append(_sc21(8, 16, 1, gbs, 80, 12288, 96, 16))
    configs += _sc21_table_1(examples)
    return configs


def _sc21_table_1(examples: Path) -> list[dict]:
    """run_table_1.sh's ten model sizes, read from its if/elif blocks."""
    text = (examples / SC21 / "run_table_1.sh").read_text()
    blocks = re.split(r'(?:if|elif) \[ \$\{MODEL_SIZE\} == "[^"]+" \]; then', text)[1:]
    out = []
    for block in blocks:
        values = dict(re.findall(r"^\s*(TP|PP|MBS|GBS|NLS|HS|NAH|NNODES)=(\d+)", block, flags=re.M))
        out.append(_sc21(*(int(values[k]) for k in ("TP", "PP", "MBS", "GBS", "NLS", "HS",
                                                      "NAH", "NNODES"))))
    return out


def sc21_launches(examples: Path) -> list[dict]:
    out = []
    for number, c in enumerate(_sc21_configs(examples)):
        argv = (c["EXTRA"].split() + [
            "--tensor-model-parallel-size", str(c["TP"]), "--pipeline-model-parallel-size", str(c["PP"]),
            "--micro-batch-size", str(c["MBS"]), "--global-batch-size", str(c["GBS"]),
            "--num-layers", str(c["NLS"]), "--hidden-size", str(c["HS"]),
            "--num-attention-heads", str(c["NAH"]), "--DDP-impl", "local",
            "--data-path", "/data/megatron", "--vocab-file", "/data/vocab.json",
            "--merge-file", "/data/merges.txt", "--log-interval", "5", "--seq-length", "2048",
            "--max-position-embeddings", "2048", "--train-iters", "500", "--lr-decay-iters", "320",
            "--lr", "0.0001", "--min-lr", "0.00001", "--lr-decay-style", "cosine",
            "--lr-warmup-fraction", "0.01", "--split", "969,30,1", "--eval-iters", "100",
            "--eval-interval", "1000", "--clip-grad", "1.0", "--fp16", "--loss-scale", "8192"])
        world = c["NNODES"] * 8
        out.append({"id": f"example-sc21-{number:02d}-asis", "source": "example",
                    "world_size": world, "argv": _padded_vocab(argv)})
        # The same configuration without the flags Megatron-LM has since removed.
        kept, skip = [], False
        for token in argv:
            if skip:
                skip = False
                continue
            if token in SC21_DROPPED:
                skip = True
                continue
            kept.append(token)
        out.append({"id": f"example-sc21-{number:02d}", "source": "example",
                    "world_size": world, "argv": _padded_vocab(kept)})
    return out


# ------------------------------------------------------------------------------- moe


# Edits of Megatron-LM's mixtral launch that keep it valid and move what MoE modelling lays
# out: the expert grid, the expert buffers' padding and bucketing, their averaging.
MIXTRAL_EDITS = (
    [], ["--ddp-average-in-collective"], ["--calculate-per-token-loss"],
    ["--expert-model-parallel-size", "4"], ["--expert-model-parallel-size", "2"],
    ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "2"],
    ["--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
     "--ddp-average-in-collective"],
    ["--moe-layer-freq", "2"], ["--moe-layer-freq", "([0]+[1]*31)", "--moe-grouped-gemm"],
    ["--moe-shared-expert-intermediate-size", "4096", "--moe-shared-expert-gate"],
    ["--num-virtual-stages-per-pipeline-rank", "2"], ["--transformer-impl", "local"],
    ["--moe-ffn-hidden-size", "1408", "--num-experts", "64", "--moe-router-topk", "6"],
    ["--expert-model-parallel-size", "1", "--ddp-bucket-size", "1000000"],
    # Since MTP is modelled: its layer is of the last layer's kind (MoE, then dense).
    ["--mtp-num-layers", "1"], ["--mtp-num-layers", "2", "--moe-layer-freq", "([1]*31+[0])"],
    ["--mtp-num-layers", "3", "--mtp-use-repeated-layer"],
)


def mixtral_variants(examples: list[dict]) -> list[dict]:
    """The mixtral example's launch at 32 to 128 GPUs, each with each of MIXTRAL_EDITS."""
    base = next((x for x in examples if "mixtral" in x["id"]), None)
    if base is None:
        return []
    # (world, its batch): 32, 64, 128 GPUs keep the global batch 256 (DP 8, 16, 32); at 96
    # (DP 24, expert DP 3 at EP 8: bucket ends padded to lcm(3, 128)) it is 240.
    worlds = ((32, []), (64, []), (96, ["--global-batch-size", "240"]), (128, []))
    return [{"id": f"moe-mixtral-{world}-{number:02d}", "source": "moe", "world_size": world,
             "argv": base["argv"] + batch + edit, "env": base.get("env", {})}
            for world, batch in worlds for number, edit in enumerate(MIXTRAL_EDITS)]


# ------------------------------------------------------------------------------- hybrid


def _with(argv: list[str], flag: str, *values: str) -> list[str]:
    """``argv`` with ``flag`` given ``values`` (replaced where given, else appended; no
    values: a switch added once)."""
    out, skip = [], 0
    for token in argv:
        if skip:
            skip -= 1
            continue
        if token == flag:
            skip = len(values)
            continue
        out.append(token)
    return out + [flag, *values]


def _piped(pattern: str, *cuts: int) -> str:
    """``pattern`` with '|' before each of the layer indices ``cuts``."""
    bounds = [0, *cuts, len(pattern)]
    return "|".join(pattern[a:b] for a, b in zip(bounds, bounds[1:]))


def hybrid_variants(examples: list[dict]) -> list[dict]:
    """The mamba example's two launches (examples/mamba/train.sh, MODEL_SCALE 800M and 8B),
    each edited by :func:`_hybrid_edits`."""
    out = []
    for base in (x for x in examples if x["id"].startswith("example-train-")):
        scale = "8b" if _value(base["argv"], "--tensor-model-parallel-size") == "4" else "800m"
        out += [{"id": f"hybrid-{scale}-{number:02d}", "source": "hybrid", "world_size": world,
                 "argv": edit, "env": base.get("env", {})}
                for number, (world, edit) in enumerate(_hybrid_edits(base["argv"], scale))]
    return out


def _hybrid_edits(argv: list[str], scale: str) -> list[tuple[int, list[str]]]:
    """(world size, edited launch) each: mostly valid, the last six refused."""
    pattern = _value(argv, "--hybrid-layer-pattern")
    n = len(pattern)

    def pp(a: list[str], k: int, *cuts: int) -> list[str]:
        return _with(_with(a, "--pipeline-model-parallel-size", str(k)),
                     "--hybrid-layer-pattern", _piped(pattern, *cuts))

    def tp(a: list[str], k: int) -> list[str]:
        # A global batch of 64 splits over every DP below (micro batch 4, DP <= 16).
        return _with(_with(_padded(a, k), "--tensor-model-parallel-size", str(k)),
                     "--global-batch-size", "64")

    return [
        (8, tp(argv, 2)), (16, tp(argv, 4)), (16, tp(argv, 8)), (8, tp(argv, 1)),
        (16, pp(argv, 2)), (16, pp(argv, 2, n // 2)), (16, pp(argv, 2, n // 2 - 4)),
        (32, _with(pp(argv, 2, n // 4, n // 2, 3 * n // 4), "--global-batch-size", "128")),
        (32, _with(pp(argv, 4, n // 4, n // 2, 3 * n // 4), "--global-batch-size", "64")),
        # uneven segments, interleaved: 10 and 14 layers on stage 0, 10 and the rest on stage 1
        (32, _with(pp(argv, 2, 10, 20, 34), "--global-batch-size", "128")),
        (16, _with(pp(argv, 2), "--decoder-first-pipeline-num-layers", str(n // 2 - 2))),
        (16, _without(pp(argv, 2, n // 2), "--untie-embeddings-and-output-weights")),
        (8, _without(argv, "--untie-embeddings-and-output-weights")),
        (8, _with(argv, "--normalization", "LayerNorm")),
        (8, _without(argv, "--disable-bias-linear")),
        (8, _with(argv, "--mamba-num-heads", "48" if scale == "800m" else "96")),
        (8, _with(_with(argv, "--mamba-num-groups", "4"), "--mamba-state-dim", "64")),
        (8, _with(argv, "--ddp-bucket-size", "10000000")),
        (8, _with(argv, "--ddp-average-in-collective")),
        (8, _with(argv, "--calculate-per-token-loss")),
        (8, _without(argv, "--use-distributed-optimizer", "--overlap-param-gather")),
        (8, _with(_with(argv, "--ffn-hidden-size", "3000"), "--swiglu")),
        (8, ["--hybrid-override-pattern" if t == "--hybrid-layer-pattern" else t for t in argv]),
        # refused: segments over PP, mixer groups over TP, interleaving flags, head dim,
        # uneven-stage flags with '|', '|' at PP 1 (an interleaved schedule).
        (24, pp(argv, 3, n // 2)), (16, tp(argv, 16)),
        (16, _with(pp(argv, 2), "--num-virtual-stages-per-pipeline-rank", "2")),
        (8, _with(argv, "--mamba-head-dim", "96")),
        (16, _with(pp(argv, 2, n // 2), "--decoder-last-pipeline-num-layers", "4")),
        (8, _with(argv, "--hybrid-layer-pattern", _piped(pattern, n // 2))),
    ]


def _padded(argv: list[str], tp: int) -> list[str]:
    """The launch's GPT-2 vocabulary padded for TP ``tp`` (as :func:`_padded_vocab`)."""
    multiple = 128 * tp
    return _with(argv, "--padded-vocab-size", str(-(-GPT2_VOCAB // multiple) * multiple))
# ------------------------------------------------------------------------------- sgd


# (example, world, what to drop from its flags, edits): Megatron-LM's GPT-3 175B launch at
# 256 GPUs (TP 8 x PP 16 x DP 2; its --step-batch-size-schedule, unquoted in the script,
# which argparse refuses, dropped) and its Llama-3 8B FP8 launch at 8 GPUs without the
# distributed optimizer and what needs it (--overlap-param-gather, --fp8-param-gather),
# each with --optimizer sgd: valid ones that move the optimizer state (momentum 0 or not,
# weight decay, bucketing, interleaving) and some Megatron refuses at the optimizer's build
# (the distributed optimizer, a negative momentum or weight decay, no --lr) or in
# validate_args (--min-lr above --lr).
DISTRIBUTED = ("--use-distributed-optimizer", "--overlap-param-gather", "--fp8-param-gather")
SGD_EDITS = (
    ("train_gpt3_175b_distributed", 256, ("--step-batch-size-schedule",), (
        ["--optimizer", "sgd"], ["--optimizer", "sgd", "--sgd-momentum", "0"],
        ["--optimizer", "sgd", "--sgd-momentum", "0.5", "--weight-decay", "0"],
        ["--optimizer", "sgd", "--overlap-grad-reduce"],
        ["--optimizer", "sgd", "--num-virtual-stages-per-pipeline-rank", "2"],
        ["--optimizer", "sgd", "--use-distributed-optimizer"],
        ["--optimizer", "sgd", "--sgd-momentum=-0.9"],
        ["--optimizer", "sgd", "--weight-decay=-0.1"],
        ["--optimizer", "sgd", "--min-lr", "1e-3"],
        ["--sgd-momentum", "0"],  # read only under --optimizer sgd
    )),
    ("train_gpt3_175b_distributed", 256, ("--step-batch-size-schedule", "--lr"),
     (["--optimizer", "sgd"],)),
    ("train_llama3_8b_h100_fp8-0", 8, DISTRIBUTED, (
        ["--optimizer", "sgd"], ["--optimizer", "sgd", "--sgd-momentum", "0"],
        ["--optimizer", "sgd", "--overlap-grad-reduce", "--ddp-bucket-size", "10000000"],
    )),
    ("train_llama3_8b_h100_fp8-0", 8, (), (["--optimizer", "sgd"],)),
)


def _without(argv: list[str], *flags: str) -> list[str]:
    """``argv`` less ``flags``, each with the values that follow it (none for a switch)."""
    out, dropping = [], False
    for token in argv:
        if token.startswith("--"):
            dropping = token in flags
        if not dropping:
            out.append(token)
    return out


def sgd_variants(examples: list[dict]) -> list[dict]:
    """SGD_EDITS on the example launches they name (none where an example is absent)."""
    out = []
    for number, (name, world, drop, edits) in enumerate(SGD_EDITS):
        base = next((x for x in examples if name in x["id"]), None)
        if base is None:
            continue
        for index, edit in enumerate(edits):
            out.append({"id": f"sgd-{name}-{number}-{index:02d}", "source": "sgd",
                        "world_size": world, "argv": _without(base["argv"], *drop) + edit,
                        "env": base.get("env", {})})
    return out


# ------------------------------------------------------------------------------- fsdp


# Edits of Megatron-LM's Megatron-FSDP launch (examples/megatron_fsdp), as (flags dropped,
# flags added): each strategy, without its per-token loss, with averaging in the collective,
# fp32 grads, without --use-distributed-optimizer (validate_args turns it on), and three it
# refuses (the checkpoint format, no_shard with meta-device init, the weight-hash check).
_PER_TOKEN, _META = ("--calculate-per-token-loss",), ("--init-model-with-meta-device",)
FSDP_EDITS = (
    ((), []), (_META, ["--data-parallel-sharding-strategy", "no_shard"]),
    ((), ["--data-parallel-sharding-strategy", "optim"]),
    ((), ["--data-parallel-sharding-strategy", "optim_grads"]),
    (_PER_TOKEN, []), (_PER_TOKEN, ["--megatron-fsdp-main-grads-dtype", "fp32"]),
    (_PER_TOKEN, ["--ddp-average-in-collective"]), ((), ["--ddp-average-in-collective"]),
    (("--use-distributed-optimizer",), []),
    ((), ["--ckpt-format", "torch_dist"]),
    ((), ["--data-parallel-sharding-strategy", "no_shard"]),
    ((), ["--check-weight-hash-across-dp-replicas-interval", "10"]),
)
# Flags of the Megatron-FSDP launch that torch FSDP2 refuses or does not read.
_MEGATRON_FSDP_ONLY = ("--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                       "--ckpt-format", "--use-nccl-ub", "--fsdp-double-buffer",
                       "--fsdp-manual-registration", "--use-distributed-optimizer",
                       "--overlap-param-gather")
# Edits of the same launch moved to torch FSDP2; the last three it refuses.
FSDP2_EDITS = (
    ((), []), (_PER_TOKEN, []), (_PER_TOKEN, ["--ddp-average-in-collective"]),
    ((), ["--torch-fsdp2-no-reshard-after-forward"]), ((), ["--ckpt-format", "torch_dcp"]),
    ((), ["--tensor-model-parallel-size", "2"]),
    (("--no-gradient-accumulation-fusion",), []), ((), ["--use-distributed-optimizer"]),
    ((), ["--ckpt-format", "torch_dcp", "--tensor-model-parallel-size", "2"]),
)


def fsdp_variants(examples: list[dict]) -> list[dict]:
    """The Megatron-FSDP example's launch at 8, 16 and 32 GPUs with each of FSDP_EDITS, and
    moved to torch FSDP2 with each of FSDP2_EDITS (the example's environment: no
    CUDA_DEVICE_MAX_CONNECTIONS)."""
    base = next((x for x in examples if "fsdp" in x["id"]), None)
    if base is None:
        return []
    fsdp2 = _without(base["argv"], *_MEGATRON_FSDP_ONLY) + ["--use-torch-fsdp2"]
    out = []
    for world in (8, 16, 32):
        for kind, argv, edits in (("megatron", base["argv"], FSDP_EDITS),
                                  ("torch", fsdp2, FSDP2_EDITS)):
            out += [{"id": f"fsdp-{kind}-{world}-{number:02d}", "source": "fsdp",
                     "world_size": world, "argv": _without(argv, *drop) + add,
                     "env": base.get("env", {})}
                    for number, (drop, add) in enumerate(edits)]
    return out


# ----------------------------------------------------------------------------- mtpqk

QWEN3_8B = "post_training/modelopt/conf/Qwen/Qwen3-8B.sh"
# (world, TP, PP, extra) grids for the Qwen3-8B model (36 layers): TP 1/2, PP 1/2/4, VPP 3.
QWEN_GRIDS = ((8, 1, 1, []), (8, 2, 1, []), (8, 2, 2, []), (8, 1, 4, []), (16, 2, 4, []),
              (8, 2, 2, ["--num-virtual-stages-per-pipeline-rank", "3"]))
# Edits that keep the launch valid and move what MTP and qk-layernorm modelling lays out (the
# last one Megatron refuses: MTP needs rope or no position embeddings).
QWEN_EDITS = (
    [], ["--mtp-num-layers", "1"], ["--mtp-num-layers", "2"],
    ["--mtp-num-layers", "3", "--mtp-use-repeated-layer"], ["tied", "--mtp-num-layers", "1"],
    ["tied"], ["--mtp-num-layers", "1", "--use-distributed-optimizer", "--overlap-grad-reduce"],
    ["--qk-l2-norm", "--mtp-num-layers", "1"],
    ["--mtp-num-layers", "1", "--position-embedding-type", "learned_absolute"],
)


def qwen_launches(examples: Path) -> list[dict]:
    """Qwen3-8B's model flags (the conf's MODEL_ARGS, read by bash) on each grid, each edit."""
    conf = examples / QWEN3_8B
    if not conf.exists():
        return []
    read = subprocess.run(["bash", "-c", 'source "$0"; printf "%s" "$MODEL_ARGS"', str(conf)],
                          capture_output=True, text=True, timeout=60, check=True,
                          env={"PATH": "/usr/bin:/bin"})
    model = read.stdout.split()
    out = []
    for world, tp, pp, extra in QWEN_GRIDS:
        for number, edit in enumerate(QWEN_EDITS):
            argv = [t for t in model if not (t == "--untie-embeddings-and-output-weights"
                                             and "tied" in edit)]
            argv += ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
                     str(pp), *extra, "--global-batch-size", "32",
                     # Qwen3's 151,936 tokens = 1187 x 128 (its --make-vocab-size-divisible-by).
                     "--padded-vocab-size", "151936", *[t for t in edit if t != "tied"]]
            out.append({"id": f"mtpqk-qwen3-8b-{world}-tp{tp}-pp{pp}"
                              f"{'-vpp' if extra else ''}-{number:02d}",
                        "source": "mtpqk", "world_size": world, "argv": argv,
                        "env": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}})
    return out


# ------------------------------------------------------------------------------- docs


def _grid_world(argv: list[str]) -> int:
    """TP x PP x CP x DP, for a line that gave its DP (an older spelling) and no world size."""
    size = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--context-parallel-size", "--data-parallel-size"):
        size *= int(_value(argv, flag) or 1)
    return size


def doc_launches() -> list[dict]:
    """Every ``$ verify preflight`` line of README.md and docs/*.md, as a Megatron launch."""
    sys.path.insert(0, str(REPO))
    from tests.verify.doc_launches import doc_launch_lines
    from tests.verify.preflight_launch import split_argv

    out = []
    for where, argv in doc_launch_lines(REPO):
        world, megatron = split_argv(argv)
        out.append({"id": f"docs-{where}", "source": "docs",
                    "world_size": world or _grid_world(megatron), "argv": megatron})
    return out


def main() -> None:
    examples = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/work/notes/mlm19/examples")
    target = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("launches.jsonl")
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 400
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 22
    examples_found = example_launches(examples)
    launches = (random_launches(count, seed) + examples_found + mixtral_variants(examples_found)
                + hybrid_variants(examples_found) + sgd_variants(examples_found)
                + fsdp_variants(examples_found) + qwen_launches(examples) + doc_launches())
    with target.open("w", encoding="utf-8") as out:
        for launch in launches:
            out.write(json.dumps(launch) + "\n")
    counts = {s: sum(1 for x in launches if x["source"] == s)
              for s in ("random", "example", "moe", "hybrid", "sgd", "fsdp", "mtpqk", "docs")}
    print(f"wrote {len(launches)} launches to {target}: {counts}")


if __name__ == "__main__":
    main()
