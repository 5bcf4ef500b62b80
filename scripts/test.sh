#!/usr/bin/env bash
# Test suite on a fresh machine: set up .venv with the test extras, then run every
# test (unit, property, multi-rank gloo; GPU tests skip without CUDA) in parallel, with
# megatron-core 0.16.x (Python 3.11, torch 2.13.0); then the second leg
# (scripts/test-megatron-019.sh): the Megatron-Core tests on megatron-core 0.19.2 and the
# tests that depend on the torch/Triton/NumPy release, on the lent GPU node's software
# (Python 3.12, torch 2.11.0). GRADVERIFY_MEGATRON_019=0 skips that second leg (it installs
# torch's CUDA build for Python 3.12, ~4.7 GB, on its first run).
# Extra arguments go to the first pytest.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GRADVERIFY_EXTRAS="${GRADVERIFY_EXTRAS:-test,plot,lint,gpu,megatron}" "$repo/scripts/setup-venv.sh"
venv="${VENV:-$repo/.venv}"
cd "$repo"
status=0
"$venv/bin/python" -m pytest -n auto "$@" || status=$?
if [ "${GRADVERIFY_MEGATRON_019:-1}" != "0" ]; then
  VENV="$repo/.venv-mcore019" bash "$repo/scripts/test-megatron-019.sh" || status=$((status ? status : $?))
fi
exit "$status"
