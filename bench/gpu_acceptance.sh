#!/usr/bin/env bash
# GPU acceptance: everything gradverify should show on a GPU, in one command that never stops
# at the first failure and fits a lent GPU's lease (under 7 minutes on one H200 by default).
#
#   bash bench/gpu_acceptance.sh                          # one GPU, python3 = the node's CUDA torch
#   NGPU=8 bash bench/gpu_acceptance.sh                   # also the NCCL steps at 2 and NGPU ranks
#   GPU_ACCEPTANCE_SMOKE=1 bash bench/gpu_acceptance.sh   # every step shrunk; on a CPU machine the
#                                                         # CUDA-only steps are rehearsed on the CPU
#
# Steps, in order (each under `timeout`, inside the total budget; the pytest suite gets what is left):
#   wheels            .whl/*.whl (bench/gpu_wheels.sh) installed into a temporary folder put on
#                     PYTHONPATH after the checkout, never into the system site
#   env               verify env --json
#   pytest-gpu        pytest -m gpu                                          (CUDA only)
#   bench-gpu-kernels bench/bench_gpu_kernels.py: bits vs refgrad, then the speed goals (CUDA only)
#   verify-run        verify run --device cuda, every check, --json --markdown  (CUDA only)
#   verify-megatron   verify run --device cuda --candidate megatron-core     (CUDA only; skipped,
#                     naming why, where megatron-core does not import)
#   train-gpt         examples/train_gpt.py under torchrun, world size 1 over NCCL, bf16, the
#                     distributed optimizer, fp32-accumulating reduce-scatter (CUDA only)
#   NGPU > 1 only:    accumulation-nccl-1/-N, bench-oracle-cuda, train-gpt-dp2, train-gpt-pp2,
#                     preflight-torchrun, bench-optim-nccl
#   pytest-all        the rest of the suite (-m "not gpu", -n 8), time-boxed to what is left
#
# Results: ONE folder, $OUT when set (the device tool's output folder), else
# bench/results/gpu-<date>-<device>/. At most 8 files, no subfolder: status.txt (a line per step:
# name, state ok|failed|timeout|skipped, rc, seconds, note), summary.md (the steps and the goal
# lines, printed at the end too), env.json, verify-<device>.json and .md, bench-gpu-kernels.json,
# logs.tar.gz (every step's log, the commands, the figures and the other reports; rewritten after
# every step, so a run killed from outside still leaves its logs).
# Without CUDA a CUDA-only step is recorded as skipped ("CUDA is not available"); with
# GPU_ACCEPTANCE_SMOKE=1 it is also rehearsed on the CPU (the same command with --device cpu,
# gloo for torchrun) and the rehearsal's exit code goes into the note. In smoke mode a step is
# bounded by the budget alone: the per-step caps are the GPU lease's time plan, and a smoke run
# shows that every step runs and is recorded, not how fast (in a loaded suite run, load 25-50
# on 2 cores, the kernel bench's rehearsal took over its 180 s cap).
# The exit status is 1 when a step (or a rehearsal) failed or timed out, else 0.
#
# Environment: PYTHON (default python3), NGPU (default 1), GPU_ACCEPTANCE_SMOKE (0|1),
# GPU_ACCEPTANCE_BUDGET_S (total seconds; default 400 on one GPU, 3600 with NGPU > 1, 1800 in
# smoke mode, where a slow shared machine must not cut a step), GPU_ACCEPTANCE_WHEELS (the
# wheels folder, default .whl), GPU_ACCEPTANCE_COMMIT (the commit to report where there is no
# .git), OUT.
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo" || exit 2
python="${PYTHON:-python3}"
ngpu="${NGPU:-1}"
smoke="${GPU_ACCEPTANCE_SMOKE:-0}"
wheels="${GPU_ACCEPTANCE_WHEELS:-$repo/.whl}"

fail_usage() { echo "gpu_acceptance.sh: $*" >&2; exit 2; }
case "$ngpu" in '' | *[!0-9]* | 0) fail_usage "NGPU must be a positive integer, got '$ngpu'" ;; esac
case "$smoke" in 0 | 1) ;; *) fail_usage "GPU_ACCEPTANCE_SMOKE must be 0 or 1, got '$smoke'" ;; esac
if [ "$smoke" = 1 ]; then default_budget=1800; elif [ "$ngpu" -gt 1 ]; then default_budget=3600; else default_budget=400; fi
budget="${GPU_ACCEPTANCE_BUDGET_S:-$default_budget}"
case "$budget" in '' | *[!0-9]*) fail_usage "GPU_ACCEPTANCE_BUDGET_S must be whole seconds, got '$budget'" ;; esac
deadline=$((SECONDS + budget))
reserve=15  # seconds kept for the summary and the last bundle

export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
work="$(mktemp -d "${TMPDIR:-/tmp}/gpu-acceptance.XXXXXX")" || exit 2
trap 'rm -rf "$work"' EXIT
logs="$work/logs"
mkdir -p "$logs"

probe="$("$python" -c 'import torch; print(int(torch.cuda.is_available()), torch.__version__,
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")' 2>"$logs/probe.log")"
read -r has_cuda torch_version device_name <<<"${probe:-0 none cpu}"
device_name="${device_name//[^A-Za-z0-9_.-]/_}"
if [ "$has_cuda" = 1 ]; then dev=cuda; else dev=cpu; fi
date_utc="$(date -u +%Y%m%d)"
results_name="gpu-$date_utc-$device_name"
out="${OUT:-bench/results/$results_name}"
mkdir -p "$out" || exit 2
top_files=(status.txt summary.md env.json "verify-$dev.json" "verify-$dev.md" bench-gpu-kernels.json logs.tar.gz)
for f in "${top_files[@]}"; do rm -f "$out/$f"; done
# A copy of the checkout without .git (a lent machine's) cannot tell its commit: the caller can.
commit="${GPU_ACCEPTANCE_COMMIT:-$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)}"
{
  echo "# gpu_acceptance $date_utc device=$device_name cuda=$has_cuda torch=$torch_version commit=$commit"
  echo "# smoke=$smoke ngpu=$ngpu budget=${budget}s python=$python results_name=$results_name"
} >"$out/status.txt"
cat "$out/status.txt"
failures=0
card_state() {  # the card as found (clocks, memory, temperature), into the logs; no settings touched
  command -v nvidia-smi >/dev/null && nvidia-smi -q -d CLOCK,MEMORY,TEMPERATURE,PERFORMANCE >>"$logs/nvidia-smi.log" 2>&1
  return 0
}
card_state

bundle() {  # the logs folder as one archive, replaced atomically
  tar -czf "$work/logs.tar.gz" -C "$work" logs 2>/dev/null && mv -f "$work/logs.tar.gz" "$out/logs.tar.gz"
}

record() {  # record NAME STATE RC SECONDS NOTE
  local line
  line="$(printf '%-20s %-8s rc=%-4s %4ss %s' "$1" "$2" "$3" "$4" "$5")"
  echo "$line" >>"$out/status.txt"
  echo "-- $line"
}

last_line() {  # the last line of a log that is neither empty nor "wrote PATH", at most 160 characters
  grep -Ev '^[[:space:]]*$|^wrote ' "$1" 2>/dev/null | tail -n 1 | tr -d '\r' | cut -c1-160
}

# step NAME NEEDS CAP_S COMMAND...: NEEDS is "any" or "cuda"; CAP_S bounds the step (not in smoke
# mode, see above), and the budget's remainder bounds it further. Never stops the script.
step() {
  local name="$1" needs="$2" cap="$3"
  shift 3
  local rehearsal=0
  if [ "$needs" = cuda ] && [ "$has_cuda" != 1 ]; then
    if [ "$smoke" != 1 ]; then
      record "$name" skipped - 0 "CUDA is not available"
      return 0
    fi
    rehearsal=1
  fi
  local left=$((deadline - SECONDS - reserve))
  if [ "$left" -lt 10 ]; then
    record "$name" skipped - 0 "out of time budget (${budget}s)"
    return 0
  fi
  local limit=$((cap < left ? cap : left))
  [ "$smoke" = 1 ] && limit=$left
  echo "== $name (at most ${limit}s): $*" | tee -a "$logs/commands.txt"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$logs/$name.log" 2>&1
  local rc=$? seconds=$((SECONDS - t0)) state note
  note="$(last_line "$logs/$name.log")"
  if [ "$rc" = 0 ]; then state=ok
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then state=timeout; note="stopped after ${limit}s; $note"
  else state=failed; fi
  if [ "$rehearsal" = 1 ]; then
    note="CUDA is not available; CPU rehearsal rc=$rc ($state): $note"
    [ "$state" = ok ] || failures=$((failures + 1))
    state=skipped
  elif [ "$state" != ok ]; then
    failures=$((failures + 1))
  fi
  record "$name" "$state" "$rc" "$seconds" "$note"
  bundle
}

# Problem sizes: the acceptance run, or the smoke run (seconds per step).
tiny=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2
  --global-batch-size 8 --log-interval 5)
if [ "$smoke" = 1 ]; then
  gpu_tests=(tests/fastgrad/test_mxfp8.py)
  suite=(tests/gradvocab/test_ddp_config.py)
  bench_size=(--quick)
  verify_size=(--quick --check formats)
  megatron_size=(--quick --check layout)
  train_iters=(--train-iters 2 --log-interval 1)
else
  gpu_tests=()
  suite=(-n 8 --ignore=tests/bench)  # tests/bench rehearses this script with CUDA hidden
  bench_size=()
  verify_size=()
  megatron_size=()
  train_iters=(--train-iters 20)
fi

if compgen -G "$wheels/*.whl" >/dev/null; then
  site="$work/site"
  step wheels any 120 "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$site" "$wheels"/*.whl
  if [ -d "$site" ]; then
    export PYTHONPATH="$PYTHONPATH:$site"
    echo "installed $(cd "$wheels" && echo *.whl) into $site (on PYTHONPATH after the checkout)"
  fi
else
  record wheels skipped - 0 "no wheels in $wheels: packages come from $python's own site"
fi

step env any 60 "$python" -m verify env --json "$out/env.json"
step pytest-gpu cuda 150 "$python" -m pytest -m gpu -q -p no:cacheprovider "${gpu_tests[@]}"
step bench-gpu-kernels cuda 180 "$python" bench/bench_gpu_kernels.py --device "$dev" \
  "${bench_size[@]}" --json "$out/bench-gpu-kernels.json"
step verify-run cuda 180 "$python" -m verify run --device "$dev" --jobs 4 -v "${verify_size[@]}" \
  --json "$logs/verify-$dev.json" --markdown "$logs/verify-$dev.md"
for suffix in json md; do  # the reports on top, their figures stay in the archive
  [ -f "$logs/verify-$dev.$suffix" ] && cp "$logs/verify-$dev.$suffix" "$out/"
done
step train-gpt cuda 150 "$python" -m torch.distributed.run --standalone --nproc-per-node 1 \
  examples/train_gpt.py "${tiny[@]}" "${train_iters[@]}" --bf16 --use-distributed-optimizer \
  --overlap-grad-reduce --overlap-param-gather --ddp-reduce-scatter-with-fp32-accumulation
# Without megatron-core (its wheel comes from bench/gpu_wheels.sh) the step is skipped, saying so.
megatron_missing=""
if [ "$has_cuda" = 1 ] || [ "$smoke" = 1 ]; then  # only where the step would run
  megatron_missing="$("$python" -c 'from verify.candidates.megatron_core.version import missing_reason
print(missing_reason() or "")' 2>&1 | tail -n 1)"
fi
if [ -n "$megatron_missing" ]; then
  record verify-megatron skipped - 0 "$megatron_missing"
else
  step verify-megatron cuda 150 "$python" -m verify run --device "$dev" --candidate megatron-core \
    --jobs 4 -v "${megatron_size[@]}" --json "$logs/verify-megatron-core-$dev.json" \
    --markdown "$logs/verify-megatron-core-$dev.md"
fi

if [ "$ngpu" -gt 1 ]; then  # users' own nodes: one GPU per rank, NCCL
  step accumulation-nccl-1 cuda 300 "$python" -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m verify accumulation --backend dist --json "$logs/accumulation-nccl-1.json"
  step "accumulation-nccl-$ngpu" cuda 600 "$python" -m torch.distributed.run --standalone \
    --nproc-per-node "$ngpu" -m verify accumulation --backend dist --json "$logs/accumulation-nccl-$ngpu.json"
  step bench-oracle-cuda cuda 300 "$python" bench/bench_oracle.py --device cuda
  step train-gpt-dp2 cuda 300 "$python" -m torch.distributed.run --standalone --nproc-per-node 2 \
    examples/train_gpt.py "${tiny[@]}" "${train_iters[@]}" --use-distributed-optimizer \
    --overlap-param-gather --overlap-grad-reduce --ddp-reduce-scatter-with-fp32-accumulation
  step train-gpt-pp2 cuda 300 "$python" -m torch.distributed.run --standalone --nproc-per-node 2 \
    examples/train_gpt.py "${tiny[@]}" "${train_iters[@]}" --pipeline-model-parallel-size 2
  # The preflight twin under torchrun: its ranks run gloo on CPU tensors, as the report says.
  step preflight-torchrun cuda 300 "$python" -m torch.distributed.run --standalone --nproc-per-node 2 \
    -m verify preflight --pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 4 \
    --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --padded-vocab-size 256 \
    --bf16 --json "$logs/preflight-torchrun.json"
  # The optimizer step on the CPU, then overlap_param_gather over NCCL.
  step bench-optim-nccl cuda 600 "$python" bench/bench_optim.py --backend nccl --out "$logs/bench-optim-nccl.txt"
fi

card_state  # after the kernels and the checks: clocks under load
# Last, with what is left: the rest of the suite; -v so that a run cut short still names each result.
step pytest-all any 3600 "$python" -m pytest -m "not gpu" -v -p no:cacheprovider --durations=15 "${suite[@]}"
# Per-test result lines, with or without xdist ("[gw0] [ 5%] PASSED tests/..", "tests/..::t PASSED").
counts="$(grep -Eo '^\[gw[0-9]+\] \[ *[0-9]+%\] [A-Z]+|::[^ ]* [A-Z]+' "$logs/pytest-all.log" 2>/dev/null \
  | awk '{n[$NF]++} END {for (k in n) printf "%s%s %d", (i++ ? ", " : ""), k, n[k]}')"

{
  echo "# GPU acceptance, $date_utc, $device_name"
  echo
  echo "torch $torch_version, commit $commit, smoke=$smoke, NGPU=$ngpu, budget ${budget}s, took ${SECONDS}s;"
  echo "results folder name: bench/results/$results_name/"
  echo
  echo '```'
  grep -v '^#' "$out/status.txt"
  echo '```'
  echo
  echo "pytest-all, per-test lines in its log: ${counts:-none}"
  echo
  echo "Goals (bench/bench_gpu_kernels.py):"
  echo
  echo '```'
  grep -E '^(goal |check FAILED|section |device copy|bf16 torch.mm|[0-9]+ of [0-9]+ bitwise)' \
    "$logs/bench-gpu-kernels.log" 2>/dev/null || echo "(no goal lines: the step did not run)"
  echo '```'
} >"$out/summary.md"
bundle
cat "$out/summary.md"
echo "results in $out ($failures failed or timed-out steps)"
[ "$failures" = 0 ]
