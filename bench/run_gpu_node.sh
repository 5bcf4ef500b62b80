#!/usr/bin/env bash
# Everything the GPU-node acceptance (issue 8) needs, in one command, with every
# output kept under bench/results/gpu-<date>-<device>/ (or $OUT_DIR).
#
#   bash bench/run_gpu_node.sh            # uses python3 (the node's CUDA torch) and PYTHONPATH=.
#   NGPU=8 bash bench/run_gpu_node.sh     # also runs the NCCL study at 8 processes
#
# Each step's exit code is recorded in status.txt; a failing step does not stop the others.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
python="${PYTHON:-python3}"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
device="$("$python" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")' | tr -c 'A-Za-z0-9_.-' '_')"
out="${OUT_DIR:-bench/results/gpu-$(date -u +%Y%m%d)-$device}"
mkdir -p "$out"
: > "$out/status.txt"

step() {  # step NAME COMMAND...: run, tee the log, record the exit code
  local name="$1"; shift
  echo "== $name: $*" | tee -a "$out/commands.txt"
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$out/status.txt"
  tail -n 40 "$out/$name.log"
}

step env "$python" -m verify env --json "$out/env.json"
step pytest-gpu "$python" -m pytest -m gpu -q -p no:cacheprovider
step pytest-all "$python" -m pytest -n 8 -q -p no:cacheprovider
step verify-cuda "$python" -m verify run --device cuda -v --json "$out/verify-cuda.json" --markdown "$out/verify-cuda.md"
step accumulation-nccl-1 "$python" -m torch.distributed.run --nproc-per-node 1 -m verify accumulation --backend dist --json "$out/accumulation-nccl-1.json"
if [ "${NGPU:-1}" -gt 1 ]; then
  step "accumulation-nccl-$NGPU" "$python" -m torch.distributed.run --nproc-per-node "$NGPU" -m verify accumulation --backend dist --json "$out/accumulation-nccl-$NGPU.json"
fi
step bench-reduce-scatter "$python" bench/bench_reduce_scatter.py --json "$out/bench-reduce-scatter.json"
step bench-mxfp8 "$python" bench/bench_mxfp8.py --json "$out/bench-mxfp8.json"
step bench-embedding-wgrad "$python" bench/bench_deferred_wgrad.py --json "$out/bench-embedding-wgrad.json"
step bench-oracle "$python" bench/bench_oracle.py --device cuda
# The training example on NCCL (CUDA tensors): one GPU, then DP=2 with the distributed
# optimizer and PP=2 (1F1B, tied embedding) when there are two; and the preflight twin
# under torchrun (its ranks run gloo on CPU tensors, as the report says).
tiny="--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 --global-batch-size 8 --train-iters 20 --log-interval 5"
step train-gpt-1gpu "$python" -m torch.distributed.run --standalone --nproc-per-node 1 examples/train_gpt.py $tiny --use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce
if [ "${NGPU:-1}" -gt 1 ]; then
  step train-gpt-dp2 "$python" -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_gpt.py $tiny --use-distributed-optimizer --overlap-param-gather --overlap-grad-reduce --ddp-reduce-scatter-with-fp32-accumulation
  step train-gpt-pp2 "$python" -m torch.distributed.run --standalone --nproc-per-node 2 examples/train_gpt.py $tiny --pipeline-model-parallel-size 2
  step preflight-torchrun "$python" -m torch.distributed.run --standalone --nproc-per-node 2 -m verify preflight --pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 4 --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --padded-vocab-size 256 --bf16 --json "$out/preflight-torchrun.json"
fi
if [ "${NGPU:-1}" -gt 1 ]; then  # the optimizer step on the CPU, then overlap_param_gather over NCCL
  step bench-optim-nccl "$python" bench/bench_optim.py --backend nccl --out "$out/bench-optim-nccl.txt"
fi
echo "results in $out"
